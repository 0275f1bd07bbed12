"""Generating an iteration's rollout chunks: what a rollout step and a rollout server both do with an engine.

An IterationRollout is everything one iteration's chunks need besides an engine: the run's config, the policy
version the iteration samples from (steps.run.keys.behaviour_version), that version's tokenizer and the plan
that fixes every chunk's prompts. `generate` turns one chunk into its samples with an engine holding that
version and writes the chunk atomically. A sample's randomness is keyed by (seed, iteration, prompt id, sample
index), so a chunk has the same bytes whichever process, engine instance or server generates it, and a chunk
written twice (a retried request) is written with the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

from steps.data.tasks import Prompt
from steps.data.tokenizer import CheckpointTokenizer
from steps.engines.interface import Engine, sample_requests, sample_seed
from steps.engines.sglang_engine import SGLangSettings
from steps.environments.conversation import run_conversations
from steps.errors import MoerlError
from steps.experience.rollout_plan import (
    RolloutPlan,
    chunk_problem,
    chunk_table,
    conversation_table,
    finished_chunks,
    version_tokenizer,
    write_chunk,
)
from steps.experience.tables import read_table
from steps.run.config import RunConfig, load_run_config
from steps.run.keys import behaviour_version, chunk_key
from steps.store.object_store import Store

EXIT_PREEMPTED = 143  # 128 + SIGTERM, what Kubernetes and Argo expect from a terminated container


def open_engine(
    kind: str,
    model_dir: str | os.PathLike,
    device: str = "cpu",
    sglang_settings: SGLangSettings | None = None,
    record_routes: bool = False,
) -> Engine:
    """The engine `kind` ("torch" or "sglang", as rollout.engine in the run config) on a checkpoint dir; with
    record_routes each generation carries its routed experts (Generation.routed_experts)."""
    if kind == "torch":
        from steps.engines.torch_engine import TorchEngine  # lazy: an SGLang rollout pod never loads the torch engine

        return TorchEngine.from_checkpoint(model_dir, device=device, record_routes=record_routes)
    if kind == "sglang":
        from steps.engines.sglang_engine import SGLangEngine  # lazy: sglang is a GPU-image dependency only

        settings = dataclasses.replace(sglang_settings or SGLangSettings(), record_routes=record_routes)
        return SGLangEngine(model_dir, settings)
    raise MoerlError(f"rollout.engine {kind!r} is not an engine; use 'torch' or 'sglang'")


def engine_settings(cfg: RunConfig) -> SGLangSettings:
    return SGLangSettings.from_config(cfg.rollout.sglang, random_seed=cfg.seed)


class Preempted(Exception):
    """SIGTERM arrived: stop now, keep what is finished."""


class Preemption:
    """SIGTERM handling: the handler raises Preempted at once (Python runs it between two bytecodes, so in a
    decode loop between two tensor ops), except inside a protected section (writing a chunk), where it only
    records the request, honoured as soon as the section ends. Nothing but a chunk write changes the store,
    so stopping anywhere else loses only the unfinished chunk."""

    def __init__(self) -> None:
        self.requested = False
        self._protected = 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self._protected == 0:
            raise Preempted()

    @contextlib.contextmanager
    def protected(self) -> Iterator[None]:
        self._protected += 1
        try:
            yield
        finally:
            self._protected -= 1
        self.check()

    def check(self) -> None:
        if self.requested:
            raise Preempted()


def encoded_prompt(tok: CheckpointTokenizer, prompt: Prompt, plan: RolloutPlan) -> list[int]:
    """The prompt's ids as the policy sees them; a prompt the checkpoint's tokenizer cannot encode is refused
    (moerl check reports every such prompt before a run starts)."""
    ids, problem = tok.checked_prompt_ids(prompt.content, plan.prompt_format)
    if problem:
        raise MoerlError(f"prompt {prompt.prompt_id!r}: {problem}; fix the prompt or use a checkpoint whose tokenizer "
                         "covers it")  # fmt: skip
    return ids


@dataclass
class ChunkStats:
    chunk: int
    samples: int
    tokens: int
    seconds: float


@dataclass
class IterationRollout:
    run: Store
    cfg: RunConfig
    iteration: int
    version: int  # the policy version this iteration samples from
    tok: CheckpointTokenizer
    plan: RolloutPlan

    @classmethod
    def open(cls, run: Store, iteration: int, cfg: RunConfig | None = None) -> IterationRollout:
        if iteration < 1:
            raise MoerlError(f"--iteration {iteration}: iterations count from 1")
        cfg = cfg or load_run_config(run)
        version = behaviour_version(iteration, cfg.staleness)
        tok = version_tokenizer(run, version)  # its stop tokens are part of the plan
        plan = RolloutPlan.for_iteration(cfg, iteration, version, stop_token_ids=tok.stop_ids, run=run)
        return cls(run, cfg, iteration, version, tok, plan)

    def check_version(self, policy_version: int | None, flag: str = "--policy-version") -> None:
        """A request or a flag naming another version than this iteration's is refused, never served."""
        if policy_version is not None and policy_version != self.version:
            raise MoerlError(
                f"{flag} {policy_version}: iteration {self.iteration} with staleness {self.cfg.staleness} "
                f"samples from v{self.version:06d} (rollout of iteration i uses v(i-1-staleness)); pass "
                f"{self.version} or leave it out"
            )

    def finished(self, chunks: list[int]) -> list[int]:
        """Those of `chunks` already on the store; each must be exactly this plan's chunk."""
        finished = sorted(finished_chunks(self.run, self.plan) & set(chunks))
        for chunk in finished:
            key = chunk_key(self.iteration, chunk)
            problem = chunk_problem(self.plan, chunk, read_table(self.run, key))
            if problem:
                raise MoerlError(f"{self.run.url(key)}: {problem}; delete it and rerun this shard")
        return finished

    def generate(
        self,
        engine: Engine,
        chunk: int,
        preemption: Preemption | None = None,
        should_stop: Callable[[], bool] | None = None,
        before_write: Callable[[], None] | None = None,
    ) -> ChunkStats:
        """Generate chunk `chunk` with `engine` (which must hold self.version) and write it atomically.
        `before_write` runs between generating and writing (a server reports its progress there)."""
        start = time.monotonic()
        prompts = self.plan.chunk_prompts(chunk)
        seed_of = lambda prompt_id, k: sample_seed(self.cfg.seed, self.iteration, prompt_id, k)  # noqa: E731
        if preemption is not None:
            preemption.check()
        if self.plan.environment is not None:
            environment = self.plan.environment
            with environment.open_pool(len(prompts) * self.plan.group_size) as pool:
                conversations = run_conversations(
                    engine, self.tok, self.plan.prompt_format, pool, prompts, self.plan.sampling, environment.limits,
                    seed_of, should_stop,
                )  # fmt: skip
            table = conversation_table(self.plan, chunk, conversations)
            tokens = sum(sum(c.loss_mask) for c in conversations)
        else:
            prompt_ids = {p.prompt_id: encoded_prompt(self.tok, p, self.plan) for p in prompts}
            requests = sample_requests(
                [(p.prompt_id, prompt_ids[p.prompt_id]) for p in prompts], self.plan.sampling, seed_of=seed_of
            )
            generations = engine.generate(requests, self.plan.sampling, should_stop)
            table = chunk_table(self.plan, chunk, prompt_ids, generations)
            tokens = sum(len(g.response_ids) for g in generations)
        if before_write is not None:
            before_write()
        with preemption.protected() if preemption is not None else contextlib.nullcontext():
            write_chunk(self.run, self.plan, chunk, table)
        return ChunkStats(chunk, table.num_rows, tokens, time.monotonic() - start)
