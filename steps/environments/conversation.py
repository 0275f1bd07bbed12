"""Multi-turn generation: conversations between the policy and the user's environment, one batch per turn.

For each prompt x sample of a chunk a conversation starts from the environment's `reset` (or the prompt's own
messages) rendered by the checkpoint's chat template with the environment's tools and the generation prompt. Then,
turn by turn, every conversation still going is one request of one `engine.generate` call (the same engine
interface as single-turn rollouts, a torch engine here or a rollout server over HTTP: steps/run/serving.py), the
model's turn is read into an assistant message (tool_calls.py) and handed to the environment's `step` in the worker
pool (worker.py: one turn's steps run side by side over the workers), and its observation messages are appended.

Tokens. A conversation is one token sequence: the first prompt, then each model turn exactly as sampled (its stop
token included), then each observation as the chat template renders it after that turn: the text that
render(conversation + observation, add_generation_prompt=True) adds to render(conversation), starting after the
model's stop token (e.g. ChatML's "\\n" after <|im_end|>, then the tool message, then the next generation prompt).
The model's turns are never re-tokenized, so the trainer sees exactly the tokens the engine sampled. The
experience stores everything after the first prompt as the response with a loss mask (1: a model token, trained;
0: an observation token, context only) and a behaviour log-prob per response token (0 where the mask is 0).

Limits. A conversation ends when the environment says done ("stop"), after environment.max_turns model turns
("turns"), or when a turn reaches sampling.max_new_tokens without a stop token or the conversation would pass
environment.max_total_tokens tokens after its first prompt ("length": a turn is given at most what is left, and an
observation that does not fit ends it before it is appended). The last thing in a conversation is always a model
turn, which the verifier and the reward function read.

Randomness. Turn t of a sample is sampled with its own seed derived from the sample's (turn 0 is the sample's),
and which conversations share a generate call depends only on the chunk's outcomes so far: a chunk's bytes are the
same in any process, as single-turn chunks are (steps/experience/rollout_chunks.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from steps.data.tasks import Prompt
from steps.data.tokenizer import CheckpointTokenizer, PromptFormat
from steps.engines.interface import FINISH_LENGTH, FINISH_STOP, Engine, GenerationRequest, SamplingParams
from steps.environments.tool_calls import parse_turn
from steps.environments.worker import Call, EnvironmentPool
from steps.errors import MoerlError

FINISH_TURNS = "turns"  # environment.max_turns model turns, and the environment had not said done


@dataclass(frozen=True)
class ConversationLimits:
    """environment.max_turns, max_total_tokens and tool_call_format (their defaults are the run config's)."""

    max_turns: int
    max_total_tokens: int
    tool_call_format: str


@dataclass(frozen=True)
class EnvironmentSettings:
    """The run's `environment` section as the conversation loop and its worker pool take it."""

    class_path: str
    params: Mapping[str, Any]
    limits: ConversationLimits
    step_timeout_s: float
    workers: int

    @classmethod
    def from_config(cls, environment: Any) -> EnvironmentSettings:
        """The settings of the run's `environment` section (steps/run/config.py EnvironmentConfig), by field name."""
        limits = ConversationLimits(environment.max_turns, environment.max_total_tokens, environment.tool_call_format)
        return cls(environment.class_path, dict(environment.params), limits, environment.step_timeout_s,
                   environment.workers)  # fmt: skip

    def open_pool(self, conversations: int | None = None) -> EnvironmentPool:
        """The worker pool (no more workers than `conversations`, when given)."""
        workers = self.workers if conversations is None else max(1, min(self.workers, conversations))
        return EnvironmentPool(self.class_path, self.params, workers, self.step_timeout_s)


def derived_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed of (seed, parts): each turn's sampling, and each prompt's environment."""
    key = "\x1f".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"moerl-turn").digest(), "big") >> 1


@dataclass
class Conversation:
    prompt: Prompt
    sample_index: int
    seed: int  # the sample's seed (turn 0's)
    index: int  # its number among the batch's conversations (picks its environment worker)
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None  # None while it goes on
    last_turn: tuple[int, int] = (0, 0)  # the last model turn's slice of response_ids

    @property
    def where(self) -> str:
        return f"prompt {self.prompt.prompt_id!r} sample {self.sample_index}"

    @property
    def last_turn_ids(self) -> list[int]:
        return self.response_ids[self.last_turn[0] : self.last_turn[1]]

    def end(self, reason: str) -> None:
        self.finish_reason = reason


def run_conversations(
    engine: Engine,
    tok: CheckpointTokenizer,
    fmt: PromptFormat,
    pool: EnvironmentPool,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    limits: ConversationLimits,
    seed_of: Callable[[str, int], int],
    should_stop: Callable[[], bool] | None = None,
) -> list[Conversation]:
    """params.n conversations per prompt (prompt by prompt, samples 0..n-1), each to its end (module docstring)."""
    conversations = [
        Conversation(p, k, seed_of(p.prompt_id, k), i * params.n + k)
        for i, p in enumerate(prompts)
        for k in range(params.n)
    ]
    _start(conversations, tok, fmt, pool, seed_of)
    for turn in range(limits.max_turns):
        going = [c for c in conversations if c.finish_reason is None]
        if not going:
            break
        _model_turn(going, engine, params, limits, turn, should_stop)
        answered = [c for c in going if c.finish_reason is None]
        for c in answered:
            message = assistant_message(tok, c, limits.tool_call_format)
            c.messages.append(message)
            c.tool_calls += len(message.get("tool_calls", []))
        calls = [Call(c.index, "step", {"messages": c.messages}, f"{c.where} turn {turn + 1}") for c in answered]
        for conversation, answer in zip(answered, pool.run(calls), strict=True):
            _observe(conversation, answer, tok, fmt, limits, turn)
    # (an error or a preemption leaves the closing to the pool's owner, which kills the workers)
    pool.run([Call(c.index, "close", {}, f"{c.where} (closing)") for c in conversations])
    return conversations


def _start(
    conversations: list[Conversation],
    tok: CheckpointTokenizer,
    fmt: PromptFormat,
    pool: EnvironmentPool,
    seed_of: Callable[[str, int], int],
) -> None:
    calls = [
        Call(c.index, "reset", {"prompt": c.prompt.content, "answer": c.prompt.answer,
                                "metadata": dict(c.prompt.metadata),
                                "seed": derived_seed(seed_of(c.prompt.prompt_id, 0), "environment")},
             f"{c.where} (reset)")
        for c in conversations
    ]  # fmt: skip
    for conversation, answer in zip(conversations, pool.run(calls), strict=True):
        messages = answer["messages"] if answer["messages"] is not None else conversation.prompt.content
        conversation.messages = fmt.messages(messages)
        conversation.tools = answer["tools"]
        text = tok.render_chat(conversation.messages, fmt, add_generation_prompt=True, tools=conversation.tools)
        if bad := tok.unencodable(text):
            raise MoerlError(
                f"{conversation.where}: the checkpoint's tokenizer cannot encode {', '.join(map(repr, bad[:8]))} of "
                "its first prompt (the environment's reset); fix the prompt or the environment"
            )
        conversation.prompt_ids = tok.encode_text(text)


def _model_turn(
    going: list[Conversation],
    engine: Engine,
    params: SamplingParams,
    limits: ConversationLimits,
    turn: int,
    should_stop: Callable[[], bool] | None,
) -> None:
    """One generate call per distinct token allowance (what is left of max_total_tokens, at most a turn's)."""
    by_allowance: dict[int, list[Conversation]] = {}
    for c in going:
        allowance = min(params.max_new_tokens, limits.max_total_tokens - len(c.response_ids))
        by_allowance.setdefault(allowance, []).append(c)
    for allowance, group in sorted(by_allowance.items()):
        requests = [
            GenerationRequest(c.prompt.prompt_id, (*c.prompt_ids, *c.response_ids), c.sample_index,
                              c.seed if turn == 0 else derived_seed(c.seed, "turn", turn))
            for c in group
        ]  # fmt: skip
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=allowance)
        for c, generation in zip(group, engine.generate(requests, turn_params, should_stop), strict=True):
            start = len(c.response_ids)
            c.response_ids.extend(generation.response_ids)
            c.logprobs.extend(generation.logprobs)
            c.loss_mask.extend([1] * len(generation.response_ids))
            c.last_turn = (start, len(c.response_ids))
            c.turns += 1
            if generation.finish_reason != FINISH_STOP:
                c.end(FINISH_LENGTH)


def _observe(
    c: Conversation,
    answer: Mapping[str, Any],
    tok: CheckpointTokenizer,
    fmt: PromptFormat,
    limits: ConversationLimits,
    turn: int,
) -> None:
    """The environment's answer to the turn just ended: its reward, and its observation appended unless it ends."""
    c.reward += answer["reward"]
    c.metrics.update(answer["metrics"])
    if answer["done"]:
        c.end(FINISH_STOP)
        return
    if turn + 1 >= limits.max_turns:
        c.end(FINISH_TURNS)
        return
    ids = observation_ids(tok, fmt, c, answer["observation"])
    if len(c.response_ids) + len(ids) >= limits.max_total_tokens:
        c.end(FINISH_LENGTH)
        return
    c.messages.extend(answer["observation"])
    c.response_ids.extend(ids)
    c.logprobs.extend([0.0] * len(ids))
    c.loss_mask.extend([0] * len(ids))


def observation_ids(
    tok: CheckpointTokenizer, fmt: PromptFormat, c: Conversation, observation: list[dict[str, Any]]
) -> list[int]:
    """The tokens that follow the model's last turn (module docstring, "Tokens"); c.messages ends with that turn,
    as an assistant message (parsed here when it is not yet)."""
    before = tok.render_chat(c.messages, fmt, add_generation_prompt=False, tools=c.tools)
    after = tok.render_chat([*c.messages, *observation], fmt, add_generation_prompt=True, tools=c.tools)
    if not after.startswith(before):
        raise MoerlError(
            f"{tok.source}: its chat template renders the conversation of {c.where} differently once the "
            f"environment's {observation[0].get('role')!r} message follows (the earlier turns change), so the "
            "model's sampled tokens would not be what the trainer sees; use a template that renders earlier turns "
            "the same whatever follows"
        )
    # The template's end of the turn after the model's stop token (ChatML's "\n"). A model that stopped on a token
    # the template never writes (another of the checkpoint's stop tokens) gets the observation right after it.
    stop = tok.decode(c.last_turn_ids[-1:], skip_special_tokens=False)
    cut = before.rfind(stop) if stop else -1
    tail = before[cut + len(stop) :] if cut >= 0 else ""
    text = tail + after[len(before) :]
    if bad := tok.unencodable(text):
        raise MoerlError(
            f"{c.where}: the checkpoint's tokenizer cannot encode {', '.join(map(repr, bad[:8]))} of the environment's "
            "observation; return text the tokenizer covers"
        )
    ids = tok.encode_text(text)
    if not ids:
        raise MoerlError(f"{c.where}: the environment's observation renders to no tokens; return a message with text")
    return ids


def assistant_message(tok: CheckpointTokenizer, c: Conversation, fmt_name: str) -> dict[str, Any]:
    """The model's last turn as an assistant message (its text up to the stop token, tool calls parsed)."""
    text, _ = tok.response_text(c.last_turn_ids)
    return parse_turn(text, fmt_name)
