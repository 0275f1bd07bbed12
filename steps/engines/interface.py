"""The generation interface: what the rollout step and the evaluation ask of an engine, and what it returns.

    engine = TorchEngine.from_checkpoint(model_dir)  # engines/torch_engine.py; or engines/sglang_engine.py
    requests = sample_requests(prompts, SamplingParams(n=8), seed_of=lambda pid, k: sample_seed(0, 1, pid, k))
    generations = engine.generate(requests, SamplingParams(n=8))

A `GenerationRequest` is one sample: a prompt's token ids, the sample's index within its group and the seed
of its randomness. `SamplingParams.n` is the group size that `sample_requests` expands each prompt into; an
engine only ever sees single samples, so every sample's randomness is its own.

What `Generation.logprobs` holds (every engine): for each sampled token, log_softmax(logits) of the *policy*
at temperature 1 — the raw model distribution, before temperature, top-k or top-p reshape it for sampling.
That is exactly what the trainer recomputes (steps.models.kernels.token_logprobs), so the importance ratio between
behaviour and trainer policy is 1 up to numerics when nothing is stale. With the default sampling settings
(temperature 1, top_p 1, top_k 0) it is also the log-probability of the distribution the token was drawn from.

Routing replay: an engine opened to record routes fills Generation.routed_experts, the experts its routers chose
for every token it ran (the torch engine from its routers, SGLang from its routed-experts output), which the
trainer can replay (trainer.routing_replay) and compares with its own routers' choice; for a model with DeepSeek
sparse attention also Generation.selected_keys, the keys its indexers selected (the torch engine), replayed alike.

Nothing here imports torch or an engine: the engines import this module (the rollout step opens the one the
run config names).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from steps.run.config import SamplingConfig

FINISH_STOP = "stop"  # the sample ended with one of the stop tokens (kept as its last response token)
FINISH_LENGTH = "length"  # max_new_tokens reached without a stop token


class GenerationInterrupted(Exception):
    """Raised by Engine.generate when should_stop() said so between two decode steps (e.g. on SIGTERM)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy (argmax); > 0: sample from softmax(logits / temperature)
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    max_new_tokens: int = 8
    stop_token_ids: tuple[int, ...] = ()  # a sampled stop token ends the sample and is kept (the checkpoint's)
    n: int = 1  # samples per prompt (the GRPO group); see sample_requests

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1 or self.n < 1:
            raise ValueError(f"{self}: top_k must be >= 0, max_new_tokens and n >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_config(cls, sampling: SamplingConfig, stop_token_ids: Sequence[int], n: int) -> SamplingParams:
        """The run's `sampling` section, field by field, with the checkpoint's stop tokens and the group size."""
        return cls(**dict(sampling), stop_token_ids=tuple(stop_token_ids), n=n)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GenerationRequest:
    prompt_id: str
    prompt_ids: tuple[int, ...]
    sample_index: int
    seed: int  # the only source of this sample's randomness (see sample_seed)


@dataclass
class Generation:
    prompt_id: str
    sample_index: int
    response_ids: list[int]  # sampled tokens, the stop token included when finish_reason is "stop"
    logprobs: list[float]  # one per response token: policy log-prob at temperature 1 (module docstring)
    finish_reason: str  # FINISH_STOP or FINISH_LENGTH
    # With an engine that records routes (rollout.record_routes): [positions, MoE layers, top_k] int16, the global
    # expert ids each MoE layer (in layer order, dense layers left out) routed each token to, for the positions
    # 0 .. len(prompt) + len(response) - 2 of prompt + response (every token fed through the model; the last
    # sampled token never is), -1 where the engine recorded none. Otherwise None.
    routed_experts: np.ndarray | None = None
    # With an engine that records routes, for a model with DeepSeek sparse attention: the keys each query attended
    # to, [queries, indexer layers, ceil(fed / 8)] uint8, fed = len(prompt) + len(response) - 1, the queries those
    # at positions index_topk .. fed - 1 (every query before sees at most index_topk keys and attends to all), the
    # layers those with an indexer of their own (layer order), key s of a query at bit s of its row
    # (np.packbits, big-endian: bit 7 of byte 0 is key 0). Otherwise None.
    selected_keys: np.ndarray | None = None


class Engine(Protocol):
    """What the rollout step and the evaluation need from a generation engine."""

    name: str

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        """One Generation per request, in request order. Raises GenerationInterrupted when should_stop()
        returns True (polled between decode steps); nothing is returned then."""
        ...

    def update_weights(self, model_dir: str | os.PathLike) -> None:
        """Serve the weights of checkpoint dir `model_dir` from now on, replaced in place (not a new engine):
        another version of the same run, so the same architecture and dtype; anything else is refused with a
        MoerlError. Generations afterwards are those of an engine opened on model_dir."""
        ...

    def close(self) -> None: ...


def sample_seed(seed: int, iteration: int, prompt_id: str, sample_index: int) -> int:
    """The seed of one sample: a stable 63-bit hash of (run seed, iteration, prompt id, sample index).

    hashlib, not hash(): the same on every machine and under any PYTHONHASHSEED.
    """
    key = f"{seed}\x1f{iteration}\x1f{prompt_id}\x1f{sample_index}".encode()
    digest = hashlib.blake2b(key, digest_size=8, person=b"moerl-sample").digest()
    return int.from_bytes(digest, "big") >> 1


def sample_requests(
    prompts: Sequence[tuple[str, Sequence[int]]],
    params: SamplingParams,
    seed_of: Callable[[str, int], int],
) -> list[GenerationRequest]:
    """params.n requests per (prompt_id, prompt_ids), prompt by prompt, sample indices 0..n-1."""
    return [
        GenerationRequest(prompt_id, tuple(int(t) for t in ids), k, seed_of(prompt_id, k))
        for prompt_id, ids in prompts
        for k in range(params.n)
    ]
