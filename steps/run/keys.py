"""The run store's layout: every key a step reads or writes below `<run>/`, and the staleness rule.

    <run>/run.json                                      resolved config (import-sft writes it once)
    <run>/checkpoints/v000003/                          HF-format model dir of a published version
    <run>/checkpoints/v000003/MANIFEST.json             written LAST: every file with size + sha256
    <run>/checkpoints/LATEST                            the newest complete version's name, moved after its MANIFEST
    <run>/experience/iter-000001/rollout/chunk-000003.parquet    one finished rollout chunk
    <run>/experience/iter-000001/verdicts/chunk-000003.json    the verifier's verdicts of a chunk's samples
    <run>/experience/iter-000001/scored.parquet         all chunks, canonical order, with rewards
    <run>/metrics/iter-000001.json                      the score step's metrics
    <run>/metrics/iter-000001.update.json               the update step's metrics
    <run>/candidates/iter-000001/                       update's unpublished output (steps/run/candidate.py)
    <run>/optimizer/v000001/                            AdamW state (+ fp32 masters) the next update resumes from
    <run>/deltas/v000001/                               v000001's compressed delta against its parent (the update)
    <run>/deltas/v000001/files/config.json              the version's other files, whole (small)
    <run>/deltas/v000001/DELTA.json                     written LAST: the delta's index (steps/run/weight_delta.py)
    <run>/servers/<workflow>/<server>.json              a live server's address (its registration)
    <run>/launchers/<workflow>/trainer-server.json      the trainer job launcher's heartbeat, rewritten at each poll
    <run>/report/                                       the report's table and plot
    <run>/tensorboard/, <run>/wandb/, <run>/tracking/   experiment trackers' files and ledger (tracking/)

Only names live here (no I/O, nothing but the standard library), so any tool can import it; the protocols
over these keys are steps/run/checkpoint.py (versions, LATEST), steps/experience/rollout_plan.py (Parquet files),
steps/run/candidate.py (the candidate format) and steps/training/optimizer_state.py (AdamW state files).
"""

from __future__ import annotations

import re

from steps.errors import MoerlError

RUN_CONFIG = "run.json"

# ---------------------------------------------------------------------------------------------- versions

CHECKPOINTS = "checkpoints"
MANIFEST = "MANIFEST.json"
LATEST = f"{CHECKPOINTS}/LATEST"


def version_name(version: int) -> str:
    return f"v{version:06d}"


def parse_version(name: str) -> int:
    name = name.strip()
    if len(name) != 7 or name[0] != "v" or not name[1:].isdigit():
        raise MoerlError(f"bad checkpoint version name {name!r}: expected v followed by 6 digits, e.g. v000003")
    return int(name[1:])


def version_prefix(version: int) -> str:
    return f"{CHECKPOINTS}/{version_name(version)}"


def behaviour_version(iteration: int, staleness: int) -> int:
    """The policy version that rollout[iteration] samples from: v(iteration - 1 - staleness), at least v0.

    The one staleness rule: the workflow graph waits for that version's publish, the rollout samples from it,
    and the update refuses experience of any other version."""
    return max(0, iteration - 1 - staleness)


# ------------------------------------------------------------------------------------- per iteration


def _iteration(iteration: int) -> str:
    return f"iter-{iteration:06d}"


def parse_iteration(name: str) -> int | None:
    """The iteration an `iter-NNNNNN` key segment names; None for any other name."""
    digits = name.removeprefix("iter-")
    return int(digits) if name.startswith("iter-") and len(digits) == 6 and digits.isdigit() else None


def experience_prefix(iteration: int) -> str:
    return f"experience/{_iteration(iteration)}"


def rollout_prefix(iteration: int) -> str:
    return f"{experience_prefix(iteration)}/rollout"


def chunk_key(iteration: int, chunk: int) -> str:
    return f"{rollout_prefix(iteration)}/chunk-{chunk:06d}.parquet"


def verdicts_key(iteration: int, chunk: int) -> str:
    """The verifier's verdicts of one chunk's samples, written as the chunk lands (steps/scoring/verdicts.py)."""
    return f"{experience_prefix(iteration)}/verdicts/chunk-{chunk:06d}.json"


def scored_key(iteration: int) -> str:
    return f"{experience_prefix(iteration)}/scored.parquet"


METRICS_PREFIX = "metrics"
# The score step's metrics file of an iteration (not the update's `.update.json` beside it).
METRICS_KEY_PATTERN = re.compile(rf"^{METRICS_PREFIX}/iter-(\d+)\.json$")


def metrics_key(iteration: int) -> str:
    return f"{METRICS_PREFIX}/{_iteration(iteration)}.json"


def update_metrics_key(iteration: int) -> str:
    return f"{METRICS_PREFIX}/{_iteration(iteration)}.update.json"


CANDIDATES_PREFIX = "candidates"


def candidate_prefix(iteration: int) -> str:
    return f"{CANDIDATES_PREFIX}/{_iteration(iteration)}"


# ------------------------------------------------------------------------------------------ per version

OPTIMIZER_PREFIX = "optimizer"
OPTIMIZER_INDEX = "optimizer.index.json"  # tensor name -> shard file; written after the shards


def optimizer_prefix(version: int) -> str:
    return f"{OPTIMIZER_PREFIX}/{version_name(version)}"


DELTAS_PREFIX = "deltas"


def delta_prefix(version: int) -> str:
    """Where v(version)'s delta against v(version-1) lies; the full checkpoint stays the source of truth."""
    return f"{DELTAS_PREFIX}/{version_name(version)}"


DELTA_INDEX = "DELTA.json"  # written LAST: what the delta holds and how to check what it rebuilds


def delta_index_key(version: int) -> str:
    return f"{delta_prefix(version)}/{DELTA_INDEX}"


def delta_blob_key(version: int, file_name: str) -> str:
    """The delta of one safetensors file of v(version): its header and every tensor, XORed and compressed."""
    return f"{delta_prefix(version)}/{file_name}.delta"


def delta_copy_key(version: int, file_name: str) -> str:
    """One of v(version)'s files other than its weights (config, tokenizer, shard index), stored whole beside
    the delta, so that the delta alone with the parent's weights rebuilds the version before it is published."""
    return f"{delta_prefix(version)}/files/{file_name}"


# ------------------------------------------------------------------------------------------ whole run

SERVERS_PREFIX = "servers"


def servers_prefix(workflow: str) -> str:
    """The registrations of one Workflow's rollout servers (a segment's; a later segment has its own)."""
    return f"{SERVERS_PREFIX}/{workflow}"


def server_key(workflow: str, server: str) -> str:
    return f"{servers_prefix(workflow)}/{server}.json"


def rollout_server_name(index: object) -> str:
    """Rollout server `index`'s name: its Workflow task's and its registration's (rollout-server-0, ...)."""
    return f"rollout-server-{index}"


# The trainer that stays up: its Workflow task's and its registration's name (servers/<workflow>/trainer.json).
TRAINER_SERVER_NAME = "trainer"
LAUNCHERS_PREFIX = "launchers"


def launcher_heartbeat_key(workflow: str) -> str:
    """The heartbeat of `workflow`'s trainer job launcher (steps/pytorchjob_launcher.py rewrites it at every
    poll of the job; the multi-node trainer ends itself once it stops changing, steps/training/trainer_server.py)."""
    return f"{LAUNCHERS_PREFIX}/{workflow}/trainer-server.json"


REPORT_PREFIX = "report"
REPORT_MD = "report.md"  # the metrics table, also under the report step's --out DIR
REPORT_PNG = "report.png"  # the reward/accuracy curve
REPORT_MD_KEY = f"{REPORT_PREFIX}/{REPORT_MD}"
REPORT_PNG_KEY = f"{REPORT_PREFIX}/{REPORT_PNG}"
TENSORBOARD_PREFIX = "tensorboard"
WANDB_PREFIX = "wandb"
TRACKING_LEDGER_PREFIX = "tracking/logged"  # what each tracker was sent already (a retried step sends none twice)
MLFLOW_RUN_KEY = "tracking/mlflow-run.json"


def ledger_key(tracker: str, source: str, iteration: int) -> str:
    return f"{TRACKING_LEDGER_PREFIX}/{tracker}/{source}-{_iteration(iteration)}.json"


def pending_key(tracker: str, source: str, iteration: int) -> str:
    """Written before a tracker is sent an iteration's points; the ledger record (ledger_key) after."""
    return f"{TRACKING_LEDGER_PREFIX}/{tracker}/{source}-{_iteration(iteration)}.pending.json"


def params_ledger_key(tracker: str) -> str:
    return f"{TRACKING_LEDGER_PREFIX}/{tracker}/params.json"
