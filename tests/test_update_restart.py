"""A 2-rank update killed in the middle (SIGKILL, as a reclaimed node) and started again produces the same
bits as an update that was never interrupted: the restart starts over from the published inputs and the
partial candidate is never read."""

from __future__ import annotations

import signal
import subprocess
import time

from test_update_experience import experience_table, make_run, start_ranks, wait_ranks, write_experience

from steps.publish import publish
from steps.run import checkpoint
from steps.run.candidate import MARKER, model_shard_name
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store

# Long enough (several optimizer steps of one-sequence micro-batches) that a kill lands mid-update.
TRAINER = {"micro_batch_size": 1, "epochs": 2, "steps_per_epoch": 2, "lr": 5e-3, "kl_coef": 0.05}


def start_update(run_uri: str, *extra: str) -> list[subprocess.Popen]:
    return start_ranks(run_uri, 1, 2, *extra)


def finish(procs: list[subprocess.Popen]) -> None:
    for code, _, err in wait_ranks(procs):
        assert code == 0, err[-3000:]


def candidate_digests(run: Store) -> dict[str, dict]:
    return run.get_json(f"{candidate_prefix(1)}/{MARKER}")["files"]


def test_killed_update_restarts_to_the_same_bits(tmp_path):
    run_uri = make_run(tmp_path, trainer=TRAINER)
    run = Store.open(run_uri)
    write_experience(run_uri, 1, experience_table(policy_version=0, prompts=8, group=4))
    marker_key = f"{candidate_prefix(1)}/{MARKER}"

    finish(start_update(run_uri))
    uninterrupted = candidate_digests(run)
    assert {model_shard_name(0, 2), model_shard_name(1, 2)} <= set(uninterrupted)

    # Retrain (--force) and kill both ranks once the old candidate is gone, i.e. while training.
    procs = start_update(run_uri, "--force")
    deadline = time.monotonic() + 180
    while run.exists(marker_key):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "update never started"
        time.sleep(0.02)
    time.sleep(0.5)
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
    assert not run.exists(marker_key), "the kill came too late: the update had already finished"
    # What a crash during the upload could leave: a torn shard under the final name.
    run.put_bytes(f"{candidate_prefix(1)}/{model_shard_name(1, 2)}", b"torn")
    assert checkpoint.published_versions(run) == [0]

    finish(start_update(run_uri))
    assert candidate_digests(run) == uninterrupted  # every shard bit-identical

    publish(run_uri, 1)
    assert checkpoint.read_latest(run) == "v000001"
