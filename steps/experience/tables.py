"""The rollout <-> training contract: the experience Parquet files' schemas and the one type the trainer reads.

    <run>/experience/iter-000001/rollout/chunk-000003.parquet    ROLLOUT_SCHEMA, written by rollout
    <run>/experience/iter-000001/scored.parquet                  SCORED_SCHEMA, written by score

Columns: prompt_id string, sample_index int32, prompt_ids / response_ids list<int32>, behavior_logprobs list<float32>
(one per response token; steps/engines/interface.py says what they are), policy_version int64; plus task, answer,
finish_reason (strings); routed_experts list<int16>, null unless the run records routes (rollout.record_routes): the
array [positions, MoE layers, top_k] of Generation.routed_experts flattened row-major, positions = len(prompt_ids) +
len(response_ids) - 1, global expert ids, -1 where the engine recorded none (a table without the column records none);
selected_keys list<uint8>, for a model with DeepSeek sparse attention recorded with the routes, null otherwise:
Generation.selected_keys flattened row-major (the bits of the keys each query past index_topk attended to, per layer
with an indexer; steps/engines/interface.py). A run with an environment (multi-turn,
steps/environments/conversation.py) stores each conversation after its first prompt as the response: loss_mask
list<int8>, one per response token, 1 for the model's own tokens (trained) and 0 for the environment's (context only;
their behavior_logprobs are 0), env_reward float32 (the sum of the environment's step rewards), turns int32 (the
model's turns) and env_metrics (a JSON object: the environment's named metrics and tool_calls); all four are null for
single-turn rows. Scored files add correct and well_formed (bool), rm_score (float32, null without a reward model),
reward and advantage (float32). Readers use the canonical order: sorted by (prompt_id, sample_index). The trainer
imports this file alone of the experience package: `Sample` and `read_scored_experience` are all it sees of rollout.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from steps.errors import MoerlError
from steps.run.keys import scored_key
from steps.store.object_store import Store

ROLLOUT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("sample_index", pa.int32()),
        ("task", pa.string()),
        ("answer", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
        ("policy_version", pa.int64()),
        ("routed_experts", pa.list_(pa.int16())),
        ("selected_keys", pa.list_(pa.uint8())),
        ("loss_mask", pa.list_(pa.int8())),
        ("env_reward", pa.float32()),
        ("turns", pa.int32()),
        ("env_metrics", pa.string()),
    ]
)
SCORED_SCHEMA = ROLLOUT_SCHEMA.append(pa.field("correct", pa.bool_()))
for _name, _type in (("well_formed", pa.bool_()), ("rm_score", pa.float32()), ("reward", pa.float32()),
                     ("advantage", pa.float32())):  # fmt: skip
    SCORED_SCHEMA = SCORED_SCHEMA.append(pa.field(_name, _type))
CANONICAL_ORDER = [("prompt_id", "ascending"), ("sample_index", "ascending")]

META_PLAN = b"moerl.plan_digest"
META_CHUNK = b"moerl.chunk"
META_NUM_CHUNKS = b"moerl.num_chunks"


def table_bytes(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


def read_table(run: Store, key: str) -> pa.Table:
    try:
        # ParquetFile, one thread: pq.read_table goes through pyarrow.dataset, whose readahead tasks on Arrow's
        # I/O pool can still run when the process exits (a std::terminate, SIGABRT, at exit: apache/arrow#34314)
        return pq.ParquetFile(io.BytesIO(run.get_bytes(key))).read(use_threads=False)
    except (pa.ArrowException, OSError) as err:
        raise MoerlError(f"{run.url(key)}: not a readable Parquet file ({err}); delete it and rerun its step") from err


SCORED_COLUMNS = (
    "prompt_id", "sample_index", "prompt_ids", "response_ids", "behavior_logprobs", "policy_version",
    "reward", "advantage",
)  # fmt: skip


@dataclass
class Sample:
    """One scored response: the tokens the model is trained on and what the rollout recorded."""

    prompt_id: str
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    advantage: float
    routed_experts: np.ndarray | None = None  # int16, flat (the routed_experts column), None when not recorded
    selected_keys: np.ndarray | None = None  # uint8, flat (the selected_keys column), None when not recorded
    # multi-turn: one per response token, True where the model wrote it (trained); None: every response token
    loss_mask: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_trained_tokens(self) -> int:
        """Response tokens the loss reads: the model's own (all of them in a single-turn sample)."""
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())

    def trained(self, values: list[float]) -> list[float]:
        """Those of per-response-token `values` at the model's own tokens."""
        if self.loss_mask is None:
            return values
        return [v for v, keep in zip(values, self.loss_mask.tolist(), strict=True) if keep]


def read_scored_experience(run: Store, iteration: int, expected_version: int) -> list[Sample]:
    """The scored experience of `iteration`, validated, sorted by (prompt_id, sample_index).

    Sorting makes the order independent of how many rollout shards wrote the rows.
    """
    key = scored_key(iteration)
    url = run.url(key)
    if not run.exists(key):
        raise MoerlError(
            f"{url}: no scored experience for iteration {iteration}; run the rollout and score steps of "
            f"iteration {iteration} first (python -m steps.score --run {run.uri} --iteration {iteration})"
        )
    table = read_table(run, key)
    missing = [c for c in SCORED_COLUMNS if c not in table.column_names]
    if missing:
        raise MoerlError(f"{url}: missing columns {missing}; scored experience needs {list(SCORED_COLUMNS)}")
    if table.num_rows == 0:
        raise MoerlError(f"{url}: no rows; iteration {iteration} produced no experience to train on")
    cols = {c: table.column(c).to_pylist() for c in SCORED_COLUMNS}
    # routed_experts: optional (a table written without it records no routes)
    routes = _int16_lists(table.column("routed_experts")) if "routed_experts" in table.column_names else None
    selected = (
        _int_lists(table.column("selected_keys"), np.uint8) if "selected_keys" in table.column_names else None
    )
    masks = table.column("loss_mask").to_pylist() if "loss_mask" in table.column_names else [None] * table.num_rows

    versions = sorted({int(v) for v in cols["policy_version"]})
    if versions != [expected_version]:
        raise MoerlError(
            f"{url}: experience from policy version(s) {versions}, but iteration {iteration} trains on "
            f"samples of v{expected_version:06d} (staleness of the run config); the experience is stale or "
            "from another run — regenerate it with the rollout and score steps of this iteration"
        )
    samples = []
    for i in range(table.num_rows):
        response, logprobs = cols["response_ids"][i], cols["behavior_logprobs"][i]
        where = f"{url} row {i} (prompt_id {cols['prompt_id'][i]!r}, sample_index {cols['sample_index'][i]})"
        if not response or len(logprobs) != len(response):
            raise MoerlError(
                f"{where}: {len(response or [])} response tokens but {len(logprobs or [])} behavior_logprobs; "
                "the rollout must record one log-prob per response token"
            )
        mask = masks[i]
        if mask is not None and (len(mask) != len(response) or not any(mask)):
            raise MoerlError(
                f"{where}: its loss_mask has {len(mask)} entries ({sum(mask)} ones) for {len(response)} response "
                "tokens; a multi-turn sample needs one per response token and at least one model token"
            )
        values = [cols["advantage"][i], cols["reward"][i], *logprobs]
        if any(v is None or not math.isfinite(v) for v in values):
            raise MoerlError(f"{where}: reward, advantage or behavior_logprobs is NaN/inf/null; rerun score")
        samples.append(
            Sample(
                prompt_id=str(cols["prompt_id"][i]),
                sample_index=int(cols["sample_index"][i]),
                prompt_ids=[int(t) for t in cols["prompt_ids"][i]],
                response_ids=[int(t) for t in response],
                behavior_logprobs=[float(x) for x in logprobs],
                advantage=float(cols["advantage"][i]),
                routed_experts=None if routes is None else routes[i],
                selected_keys=None if selected is None else selected[i],
                loss_mask=None if mask is None else np.asarray(mask, dtype=bool),
            )
        )
    samples.sort(key=lambda s: (s.prompt_id, s.sample_index))
    return samples


def _int16_lists(column: pa.ChunkedArray) -> list[np.ndarray | None]:
    """A list<int16> column as one numpy array a row (None for a null row), without a Python int per value."""
    return _int_lists(column, np.int16)


def _int_lists(column: pa.ChunkedArray, dtype: type[np.integer]) -> list[np.ndarray | None]:
    """A list<int> column as one numpy array of `dtype` a row (None for a null row)."""
    lists = column.combine_chunks()
    if isinstance(lists, pa.ChunkedArray):  # an empty column
        lists = pa.array([], type=column.type)
    values = lists.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    offsets = lists.offsets.to_numpy()
    valid = lists.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]].copy() if valid[i] else None for i in range(len(lists))]
