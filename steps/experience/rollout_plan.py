"""Experience on the run store: which prompts an iteration samples, how they are cut into chunks, and the
chunk files that rollout writes and score reads (the update reads the scored file through tables.py).

    <run>/experience/iter-000001/rollout/chunk-000003.parquet    one finished chunk, written atomically
    <run>/experience/iter-000001/scored.parquet                  all chunks, canonical order, with rewards
    <run>/metrics/iter-000001.json                               the score step's metrics

The plan. An iteration's prompts are fixed by (run seed, iteration): `prompts_per_iteration` problems (more with
rollout.dynamic_sampling: generated_prompt_count) of the task's train split, or of the prompt file's training
prompts (steps/data/prompt_data.py: without a heldout_file, the prompts that the stable-hash split holds out are
never among them). They are cut, in that order, into chunks
of `rollout.chunk_size` prompts; a chunk is all `group_size` samples of each of its prompts and is always
generated as one batch.
Shard K of S generates chunks K, K+S, K+2S, ...: the chunks never depend on the shard count, so neither
does any sample. A chunk file carries the digest of everything that determines its samples (plan_digest);
a resumed shard skips the chunks whose file is there with the right digest and refuses one with another
digest (delete it and rerun the shard), and score refuses such a chunk too.

The Parquet files' schemas and the trainer's `Sample` are steps/experience/tables.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from steps.data.prompt_data import PromptFields, heldout_split, read_prompt_uri
from steps.data.tasks import Prompt, Task, get_task
from steps.data.tokenizer import TOKENIZER_FILES, CheckpointTokenizer, PromptFormat
from steps.engines.interface import Generation, SamplingParams
from steps.environments.conversation import Conversation, EnvironmentSettings
from steps.errors import MoerlError
from steps.experience.tables import (
    CANONICAL_ORDER,
    META_CHUNK,
    META_NUM_CHUNKS,
    META_PLAN,
    ROLLOUT_SCHEMA,
    read_table,
    table_bytes,
)
from steps.run.config import RunConfig
from steps.run.keys import chunk_key, metrics_key, rollout_prefix, version_prefix
from steps.store.object_store import Store

# ----------------------------------------------------------------------------------------------------
# The run config and an iteration's prompts
# ----------------------------------------------------------------------------------------------------


def iteration_seed(seed: int, iteration: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{iteration}".encode(), digest_size=8, person=b"moerl-prompts").digest()
    return int.from_bytes(digest, "big") >> 1


def run_task(cfg: RunConfig) -> Task | None:
    """The built-in task of the run (None when the run trains on a prompt file)."""
    if cfg.task is None:
        return None
    return get_task(cfg.task.name, **cfg.task.params)


def prompt_fields(cfg: RunConfig) -> PromptFields:
    f = cfg.prompt_fields
    return PromptFields(prompt=f.prompt, answer=f.answer, id=f.id)


def prompt_format(cfg: RunConfig) -> PromptFormat:
    """How the run's prompts become the text the policy sees (raw, or the checkpoint's chat template)."""
    return PromptFormat(cfg.prompt_format, cfg.system_prompt, dict(cfg.chat_template_kwargs))


def training_pool(cfg: RunConfig) -> list[Prompt]:
    """The prompt file's training prompts: all of them with a heldout_file, else those not held out."""
    assert cfg.prompt_file is not None
    prompts = read_prompt_uri(cfg.prompt_file, prompt_fields(cfg))
    if cfg.heldout_file is None and cfg.heldout_fraction > 0:
        prompts = [p for p in prompts if not heldout_split(p.prompt_id, cfg.heldout_fraction)]
        if not prompts:
            raise MoerlError(
                f"prompt_file {cfg.prompt_file}: heldout_fraction {cfg.heldout_fraction} holds out every prompt; "
                "lower heldout_fraction or add prompts"
            )
    return prompts


def iteration_prompts(cfg: RunConfig, iteration: int, count: int | None = None) -> list[Prompt]:
    """The `count` (default prompts_per_iteration) prompts of `iteration`, in plan order: the same for the same
    (config, iteration, count) on any machine."""
    count = cfg.prompts_per_iteration if count is None else count
    seed = iteration_seed(cfg.seed, iteration)
    task = run_task(cfg)
    if task is not None:
        return task.prompts("train", count, seed)
    prompts = training_pool(cfg)
    # A prompt file smaller than the count is used whole, in a fresh order each iteration.
    return random.Random(seed).sample(prompts, min(count, len(prompts)))


# Dynamic sampling generates this much more than the estimate of what fills the batch with mixed groups, so that
# an iteration whose share of tied groups is a little above the last one's still fills it.
DYNAMIC_SAMPLING_MARGIN = 1.2


def generated_prompt_count(cfg: RunConfig, iteration: int, run: Store | None) -> int:
    """How many prompts `iteration` generates. prompts_per_iteration, or with rollout.dynamic_sampling (DAPO):
    prompts_per_iteration x DYNAMIC_SAMPLING_MARGIN / (1 - t), where t is the share of tied groups (every sample of
    the prompt got the same reward) that the score of iteration i - 1 - staleness measured, the iteration whose
    update made the version iteration i samples from (so its score is done before iteration i's rollout starts,
    and every step that plans iteration i reads the same figure); between prompts_per_iteration and
    dynamic_sampling_max_factor times it, which is also what the first 1 + staleness iterations generate."""
    if not cfg.rollout.dynamic_sampling:
        return cfg.prompts_per_iteration
    source = iteration - 1 - cfg.staleness
    if source < 1:
        return prompt_count_for(cfg, None)
    if run is None:
        raise ValueError("rollout.dynamic_sampling: the plan reads the run store's score metrics")
    key = metrics_key(source)
    if not run.exists(key):
        raise MoerlError(
            f"{run.url(key)}: no score metrics of iteration {source}, whose share of tied groups sizes iteration "
            f"{iteration}'s rollout (rollout.dynamic_sampling); run the score step of iteration {source} first"
        )
    tied = run.get_json(key).get("tied_group_fraction")
    if not isinstance(tied, int | float) or not 0 <= tied <= 1:
        raise MoerlError(f"{run.url(key)}: tied_group_fraction {tied!r} is not a share in [0, 1]; rerun its score")
    return prompt_count_for(cfg, float(tied))


def prompt_count_for(cfg: RunConfig, tied: float | None) -> int:
    """generated_prompt_count's arithmetic for a measured tied share (None: none measured yet, the cap)."""
    wanted = cfg.prompts_per_iteration
    if not cfg.rollout.dynamic_sampling:
        return wanted
    cap = max(wanted, math.floor(wanted * cfg.rollout.dynamic_sampling_max_factor))
    if tied is None or tied >= 1:
        return cap
    return min(cap, max(wanted, math.ceil(wanted * DYNAMIC_SAMPLING_MARGIN / (1.0 - tied))))


def heldout_prompts(cfg: RunConfig) -> list[Prompt]:
    """The run's held-out prompts (the same every iteration): the task's held-out split, or the prompt file's
    (heldout_file, else the hash split), at most heldout_size of them."""
    if cfg.heldout_size == 0:
        return []
    task = run_task(cfg)
    if task is not None:
        return task.prompts("heldout", cfg.heldout_size, cfg.seed)
    assert cfg.prompt_file is not None
    if cfg.heldout_file is not None:
        pool = read_prompt_uri(cfg.heldout_file, prompt_fields(cfg))
    elif cfg.heldout_fraction > 0:
        pool = [p for p in read_prompt_uri(cfg.prompt_file, prompt_fields(cfg))
                if heldout_split(p.prompt_id, cfg.heldout_fraction)]  # fmt: skip
    else:
        return []
    pool.sort(key=lambda p: p.prompt_id)
    return random.Random(f"heldout/{cfg.seed}").sample(pool, min(cfg.heldout_size, len(pool)))


def version_tokenizer(run: Store, version: int) -> CheckpointTokenizer:
    """The tokenizer of a usable version (published, or indexed by its update before publish: rollout servers
    sample from it then, steps/run/weight_delta.py): only its tokenizer and config files are read."""
    import tempfile
    from pathlib import Path

    from steps.run import weight_delta  # lazily: experience is imported by tools that never touch a version

    files = weight_delta.require_version_files(run, version)
    with tempfile.TemporaryDirectory(prefix="moerl-tokenizer-") as tmp:
        for name in TOKENIZER_FILES:
            if name in files:
                (Path(tmp) / name).write_bytes(weight_delta.read_version_file(run, version, name))
        return CheckpointTokenizer.load(tmp, source=run.url(version_prefix(version)))


def sampling_params(cfg: RunConfig, stop_token_ids: Sequence[int]) -> SamplingParams:
    return SamplingParams.from_config(cfg.sampling, stop_token_ids, cfg.group_size)


# ----------------------------------------------------------------------------------------------------
# The chunk plan
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutPlan:
    """Everything that determines an iteration's samples, and how they are cut into chunks."""

    iteration: int
    policy_version: int
    prompts: tuple[Prompt, ...]
    chunk_size: int
    sampling: SamplingParams
    seed: int
    engine: str
    prompt_format: PromptFormat = PromptFormat()
    record_routes: bool = False  # each sample's routed experts are recorded (RunConfig.records_routes)
    environment: EnvironmentSettings | None = None  # multi-turn: the conversations' environment and limits

    @classmethod
    def for_iteration(
        cls,
        cfg: RunConfig,
        iteration: int,
        policy_version: int,
        stop_token_ids: Sequence[int],
        run: Store | None = None,
    ) -> RolloutPlan:
        """The plan of `iteration` (`run`: the run store, which rollout.dynamic_sampling reads the count from)."""
        return cls(
            iteration=iteration,
            policy_version=policy_version,
            prompts=tuple(iteration_prompts(cfg, iteration, generated_prompt_count(cfg, iteration, run))),
            chunk_size=cfg.rollout.chunk_size,
            sampling=sampling_params(cfg, stop_token_ids),
            seed=cfg.seed,
            engine=cfg.rollout.engine,
            prompt_format=prompt_format(cfg),
            record_routes=cfg.records_routes,
            environment=None if cfg.environment is None else EnvironmentSettings.from_config(cfg.environment),
        )

    @property
    def group_size(self) -> int:
        return self.sampling.n

    @property
    def num_chunks(self) -> int:
        return -(-len(self.prompts) // self.chunk_size)

    def chunk_prompts(self, chunk: int) -> tuple[Prompt, ...]:
        return self.prompts[chunk * self.chunk_size : (chunk + 1) * self.chunk_size]

    def shard_chunks(self, shard: int, num_shards: int) -> list[int]:
        """Chunks shard, shard + num_shards, ...: round robin, so shards get near-equal work."""
        return list(range(shard, self.num_chunks, num_shards))

    @cached_property
    def digest(self) -> str:
        """sha256 of everything that determines the samples (not the shard count: it changes none)."""
        content = {
            "iteration": self.iteration,
            "policy_version": self.policy_version,
            "seed": self.seed,
            "engine": self.engine,
            "chunk_size": self.chunk_size,
            "sampling": [self.sampling.temperature, self.sampling.top_p, self.sampling.top_k,
                         self.sampling.max_new_tokens, list(self.sampling.stop_token_ids), self.sampling.n],
            "prompts": [[p.prompt_id, p.task, p.text, p.answer, p.messages] for p in self.prompts],
            "format": [self.prompt_format.kind, self.prompt_format.system_prompt,
                       dict(self.prompt_format.template_kwargs)],
            "record_routes": self.record_routes,
        }  # fmt: skip
        if self.environment is not None:  # the workers' count and time limit change no sample
            env = self.environment
            content["environment"] = [env.class_path, dict(env.params), env.limits.max_turns,
                                      env.limits.max_total_tokens, env.limits.tool_call_format]  # fmt: skip
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------
# Chunk files
# ----------------------------------------------------------------------------------------------------


def chunk_table(
    plan: RolloutPlan, chunk: int, prompt_ids: dict[str, list[int]], generations: Sequence[Generation]
) -> pa.Table:
    """The Parquet table of one chunk, rows in canonical order."""
    by_id = {p.prompt_id: p for p in plan.chunk_prompts(chunk)}
    rows = sorted(generations, key=lambda g: (g.prompt_id, g.sample_index))
    columns = {
        "prompt_id": [g.prompt_id for g in rows],
        "sample_index": [g.sample_index for g in rows],
        "task": [by_id[g.prompt_id].task for g in rows],
        "answer": [by_id[g.prompt_id].answer for g in rows],
        "prompt_ids": [prompt_ids[g.prompt_id] for g in rows],
        "response_ids": [g.response_ids for g in rows],
        "behavior_logprobs": [g.logprobs for g in rows],
        "finish_reason": [g.finish_reason for g in rows],
        "policy_version": [plan.policy_version] * len(rows),
        "routed_experts": [None if g.routed_experts is None else g.routed_experts.reshape(-1) for g in rows],
        "selected_keys": [None if g.selected_keys is None else g.selected_keys.reshape(-1) for g in rows],
    }
    return _with_plan_metadata(plan, chunk, columns)


def conversation_table(plan: RolloutPlan, chunk: int, conversations: Sequence[Conversation]) -> pa.Table:
    """The Parquet table of one multi-turn chunk (tables.py: loss_mask, env_reward, turns, env_metrics)."""
    rows = sorted(conversations, key=lambda c: (c.prompt.prompt_id, c.sample_index))
    columns = {
        "prompt_id": [c.prompt.prompt_id for c in rows],
        "sample_index": [c.sample_index for c in rows],
        "task": [c.prompt.task for c in rows],
        "answer": [c.prompt.answer for c in rows],
        "prompt_ids": [c.prompt_ids for c in rows],
        "response_ids": [c.response_ids for c in rows],
        "behavior_logprobs": [c.logprobs for c in rows],
        "finish_reason": [c.finish_reason for c in rows],
        "policy_version": [plan.policy_version] * len(rows),
        "routed_experts": [None] * len(rows),
        "selected_keys": [None] * len(rows),
        "loss_mask": [c.loss_mask for c in rows],
        "env_reward": [c.reward for c in rows],
        "turns": [c.turns for c in rows],
        "env_metrics": [json.dumps({**c.metrics, "tool_calls": c.tool_calls}, sort_keys=True) for c in rows],
    }
    return _with_plan_metadata(plan, chunk, columns)


def _with_plan_metadata(plan: RolloutPlan, chunk: int, columns: dict[str, list[Any]]) -> pa.Table:
    for field in ROLLOUT_SCHEMA:
        columns.setdefault(field.name, [None] * len(columns["prompt_id"]))
    metadata = {META_PLAN: plan.digest.encode(), META_CHUNK: str(chunk).encode(),
                META_NUM_CHUNKS: str(plan.num_chunks).encode()}  # fmt: skip
    return pa.table(columns, schema=ROLLOUT_SCHEMA.with_metadata(metadata))


def write_chunk(run: Store, plan: RolloutPlan, chunk: int, table: pa.Table) -> str:
    """Publish one finished chunk atomically (the store writes a temp object and renames it)."""
    key = chunk_key(plan.iteration, chunk)
    run.put_bytes(key, table_bytes(table))
    return key


# The multi-turn columns (tables.py): a chunk written before they existed has none, which a run without an
# environment reads as nulls (with_conversation_columns).
CONVERSATION_COLUMNS = ("loss_mask", "env_reward", "turns", "env_metrics")


def with_conversation_columns(table: pa.Table) -> pa.Table:
    """`table` with the multi-turn columns it lacks, as nulls."""
    for name in CONVERSATION_COLUMNS:
        if name not in table.column_names:
            field = ROLLOUT_SCHEMA.field(name)
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    return table


def chunk_problem(plan: RolloutPlan, chunk: int, table: pa.Table) -> str | None:
    """What makes `table` not the chunk `chunk` of `plan` (None when it is exactly that chunk)."""
    if plan.environment is None:
        table = with_conversation_columns(table)
    for field in ROLLOUT_SCHEMA:
        if field.name not in table.column_names:
            return f"it has no column {field.name!r}"
        if table.schema.field(field.name).type != field.type:
            return f"its column {field.name!r} is {table.schema.field(field.name).type}, not {field.type}"
    logprobs = pc.list_flatten(table.column("behavior_logprobs"))
    if len(logprobs) and not pc.all(pc.is_finite(logprobs)).as_py():
        return "its behavior_logprobs hold NaN or inf (the engine that sampled it is broken)"
    masks = table.column("loss_mask")
    if plan.environment is not None and masks.null_count:
        return "it has samples without a loss_mask, which a run with an environment writes for every conversation"
    if plan.environment is None and masks.null_count < len(masks):
        return "it has multi-turn samples (a loss_mask), but this run has no environment"
    if masks.null_count < len(masks):
        lengths = pc.list_value_length(table.column("response_ids"))
        if not pc.all(pc.equal(pc.list_value_length(masks), lengths)).as_py():
            return "its loss_mask and response_ids differ in length"
    routes = table.column("routed_experts")
    if plan.record_routes and routes.null_count:
        return "it has samples without routed_experts, which this run records (rollout.record_routes)"
    if routes.null_count < len(routes):
        positions = pc.subtract(pc.add(pc.list_value_length(table.column("prompt_ids")),
                                       pc.list_value_length(table.column("response_ids"))), 1)  # fmt: skip
        lengths = pc.list_value_length(routes)
        if not pc.all(pc.equal(pc.multiply(pc.divide(lengths, positions), positions), lengths)).as_py():
            return "its routed_experts do not hold a whole number of routes for each token of prompt + response - 1"
    selected = table.column("selected_keys")
    if selected.null_count < len(selected):  # whole rows of ceil(positions / 8) bytes (the trainer checks the rest)
        positions = pc.subtract(pc.add(pc.list_value_length(table.column("prompt_ids")),
                                       pc.list_value_length(table.column("response_ids"))), 1)  # fmt: skip
        row_bytes = pc.divide(pc.add(positions, 7), 8)
        lengths = pc.list_value_length(selected)
        if not pc.all(pc.equal(pc.multiply(pc.divide(lengths, row_bytes), row_bytes), lengths)).as_py():
            return "its selected_keys do not hold whole rows of key bits (one bit a token of prompt + response - 1)"
    meta = table.schema.metadata or {}
    if meta.get(META_PLAN) != plan.digest.encode():
        return (
            "it was generated under another plan (different config, prompts, policy version or sampling "
            "settings than this iteration's)"
        )
    if meta.get(META_CHUNK) != str(chunk).encode():
        return f"its metadata says chunk {meta.get(META_CHUNK, b'?').decode()}"
    expected = [(p.prompt_id, k) for p in sorted(plan.chunk_prompts(chunk), key=lambda p: p.prompt_id)
                for k in range(plan.group_size)]  # fmt: skip
    got = list(zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True))
    if got != expected:
        return f"it holds {len(got)} samples, not exactly the {len(expected)} of its prompts x group size"
    return None


def finished_chunks(run: Store, plan: RolloutPlan) -> set[int]:
    """The chunks of the plan whose file is on the store (validity is checked when they are read)."""
    found = set()
    for key in run.list(rollout_prefix(plan.iteration)):
        name = key.rsplit("/", 1)[-1]
        if name.startswith("chunk-") and name.endswith(".parquet") and name[6:-8].isdigit():
            found.add(int(name[6:-8]))
    return found


def read_rollout(run: Store, plan: RolloutPlan, num_shards: int) -> pa.Table:
    """All chunks of the plan, each checked to be exactly its chunk, concatenated in canonical order.

    Missing, surplus or mismatched chunks end in one MoerlError that names them and the shard that writes
    them (shard = chunk mod num_shards).
    """
    present = finished_chunks(run, plan)
    expected = set(range(plan.num_chunks))

    def who(chunk: int) -> str:
        return f"chunk {chunk:06d} (rollout shard {chunk % num_shards} of {num_shards})"

    missing, surplus = sorted(expected - present), sorted(present - expected)
    if missing:
        listed = ", ".join(who(c) for c in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise MoerlError(
            f"{run.url(rollout_prefix(plan.iteration))}: {len(missing)} of {plan.num_chunks} chunks missing: "
            f"{listed}; rerun those rollout shards of iteration {plan.iteration} (they resume where they stopped)"
        )
    if surplus:
        raise MoerlError(
            f"{run.url(chunk_key(plan.iteration, surplus[0]))}: chunk {surplus[0]} is not in this iteration's "
            f"plan of {plan.num_chunks} chunks (rollout.chunk_size or prompts_per_iteration changed?); delete "
            f"{run.url(rollout_prefix(plan.iteration))}/ and rerun the rollout of iteration {plan.iteration}"
        )
    tables = []
    for chunk in range(plan.num_chunks):
        key = chunk_key(plan.iteration, chunk)
        table = read_table(run, key)
        problem = chunk_problem(plan, chunk, table)
        if problem:
            raise MoerlError(
                f"{run.url(key)}: {who(chunk)} does not match this iteration: {problem}; delete the file and "
                f"rerun rollout shard {chunk % num_shards} of iteration {plan.iteration}"
            )
        tables.append(with_conversation_columns(table).replace_schema_metadata(None).select(ROLLOUT_SCHEMA.names))
    return pa.concat_tables(tables).sort_by(CANONICAL_ORDER)


# ----------------------------------------------------------------------------------------------------
# Scored experience, as the update reads it
# ----------------------------------------------------------------------------------------------------

# The columns the trainer reads (docs/contracts.md, "Run store"; SCORED_SCHEMA has more).
