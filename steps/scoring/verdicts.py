"""The verifier's verdicts of a chunk's samples, written as the chunk lands, so that scoring overlaps rollout.

    <run>/experience/iter-I/verdicts/chunk-C.json     {chunk, chunk_sha256, verifier, answer_pattern,
                                                       prompt_id, sample_index, correct, well_formed}

With rollout servers, a rollout step is a client on the CPU pool whose server generates its chunks: once a chunk
is on the store, the client verifies its samples (write_chunk_verdicts) before it sends its next request (its
server serves other clients meanwhile, if it has any), so the verifier's work is spread over the iteration's
clients and done by the time the last chunk lands, instead of running over every sample in one score pod
afterwards. The verdicts are an optimisation: a client that cannot write them says so and goes on, and score
verifies that chunk. Only the verifier's
verdicts are written here; a reward function and a reward model run in score, once, over every sample.

score reads them (sample_verdicts): a chunk's verdicts count when they describe that chunk as it is on the
store (its sha256) under the run's verifier settings; any other chunk (no verdicts, stale or unreadable ones)
is verified there. Either way the same function runs on the same rows (verify_samples over each sample's last
model turn), so the scored experience is the same bytes with and without them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from steps.data.tokenizer import CheckpointTokenizer
from steps.errors import MoerlError
from steps.experience.rollout_plan import RolloutPlan, with_conversation_columns
from steps.experience.tables import read_table
from steps.run.config import RunConfig
from steps.run.keys import chunk_key, verdicts_key
from steps.scoring.rewards import last_turns, verify_samples
from steps.store.object_store import Store

Verdicts = dict[tuple[str, int], tuple[bool, bool]]  # (prompt_id, sample_index) -> (correct, well_formed)


def verify_table(tok: CheckpointTokenizer, table: pa.Table, cfg: RunConfig) -> tuple[list[bool], list[bool]]:
    """(correct, well_formed) of every row: the verifier on each sample's last model turn."""
    table = with_conversation_columns(table)
    responses = last_turns(table.column("response_ids").to_pylist(), table.column("loss_mask").to_pylist())
    return verify_samples(
        tok, table.column("task").to_pylist(), table.column("answer").to_pylist(), responses,
        cfg.rewards.verifier, cfg.rewards.answer_pattern,
    )  # fmt: skip


def _settings(cfg: RunConfig) -> dict[str, Any]:
    return {"verifier": cfg.rewards.verifier, "answer_pattern": cfg.rewards.answer_pattern}


def write_chunk_verdicts(
    run: Store,
    cfg: RunConfig,
    plan: RolloutPlan,
    tok: CheckpointTokenizer,
    chunk: int,
    interrupted: Callable[[], bool] = lambda: False,
) -> int:
    """Verify chunk `chunk` of the plan, as it is on the store, and write its verdicts; returns the samples
    verified. Nothing is written when `interrupted()` says the verification was (a SIGTERM that a verifier's own
    `except Exception` swallowed would leave wrong verdicts) or the store keeps no digest: score then verifies
    the chunk."""
    key = chunk_key(plan.iteration, chunk)
    sha = run.sha256(key)
    if sha is None:
        return 0
    table = read_table(run, key)
    correct, well_formed = verify_table(tok, table, cfg)
    if interrupted():
        return 0
    record = {
        "chunk": chunk,
        "chunk_sha256": sha,
        **_settings(cfg),
        "prompt_id": table.column("prompt_id").to_pylist(),
        "sample_index": table.column("sample_index").to_pylist(),
        "correct": correct,
        "well_formed": well_formed,
    }
    run.put_bytes(verdicts_key(plan.iteration, chunk), json.dumps(record).encode())
    return table.num_rows


def stored_verdicts(run: Store, cfg: RunConfig, plan: RolloutPlan) -> Verdicts:
    """The verdicts of every chunk whose record describes the chunk on the store under the run's settings."""
    found: Verdicts = {}
    for chunk in range(plan.num_chunks):
        key = verdicts_key(plan.iteration, chunk)
        if not run.exists(key):
            continue
        try:
            record = json.loads(run.get_bytes(key))
            if record["chunk_sha256"] is None or record["chunk_sha256"] != run.sha256(chunk_key(plan.iteration, chunk)):
                continue  # another chunk than the one verified (or no digest to tell): verified again in score
            if {name: record[name] for name in _settings(cfg)} != _settings(cfg):
                continue
            rows = list(
                zip(record["prompt_id"], record["sample_index"], record["correct"], record["well_formed"], strict=True)
            )
            if not all(type(c) is bool and type(w) is bool for _, _, c, w in rows):
                continue
            found.update({(str(p), int(k)): (c, w) for p, k, c, w in rows})
        except (ValueError, KeyError, TypeError, MoerlError):
            continue  # unreadable (or the store's digest check failed): the chunk is verified in score
    return found


def sample_verdicts(
    run: Store, cfg: RunConfig, plan: RolloutPlan, tok: CheckpointTokenizer, table: pa.Table
) -> tuple[list[bool], list[bool], int]:
    """(correct, well_formed) of every row of the iteration's table, from the chunks' verdicts where they count
    and the verifier elsewhere; and how many rows the verdicts gave."""
    stored = stored_verdicts(run, cfg, plan)
    keys = list(zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True))
    missing = [i for i, key in enumerate(keys) if key not in stored]
    correct = [stored[key][0] if key in stored else False for key in keys]
    well_formed = [stored[key][1] if key in stored else False for key in keys]
    if missing:
        own_correct, own_formed = verify_table(tok, table.take(pa.array(missing, type=pa.int64())), cfg)
        for i, c, w in zip(missing, own_correct, own_formed, strict=True):
            correct[i], well_formed[i] = c, w
    return correct, well_formed, len(keys) - len(missing)
