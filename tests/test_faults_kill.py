"""SIGKILL of the update (torchrun and its worker, as the workflow runs it) and of publish, at a random moment
and at chosen points between their writes; each rerun ends in the fault-free run's checkpoint, bit for bit,
and at no point is a version half published or LATEST ahead of a complete version.

(A two-rank update killed and restarted is tests/test_update_restart.py.)"""

from __future__ import annotations

import random

import pytest
from faults_helpers import (
    ITERATION,
    assert_nothing_half_published,
    kill_after,
    kill_at,
    manifest_files,
    published,
    run,
    start,
    step_argv,
    step_env,
)

from steps.run import checkpoint, weight_delta
from steps.run.candidate import MARKER
from steps.run.keys import RUN_CONFIG, candidate_prefix, optimizer_prefix

pytestmark = pytest.mark.faults

# Where publish is killed, in the order of its writes, all after the update indexed v000001's delta (rollout
# servers may be generating with it): the optimizer state (1st), the checkpoint's first file, some checkpoint
# files (4th), just before MANIFEST.json, just after it (LATEST not moved yet), and just after LATEST (before
# clean-up).
PUBLISH_KILLS = [
    kill_at("put", r".", nth=1),
    kill_at("put", r"^checkpoints/v000001/", when="before"),
    kill_at("put", r".", nth=4),
    kill_at("put", r"/v000001/MANIFEST\.json$", when="before"),
    kill_at("put", r"/v000001/MANIFEST\.json$"),
    kill_at("put", r"^checkpoints/LATEST$"),
]


def test_killed_update_and_publish_rerun_to_the_fault_free_checkpoint(fault_free_run, tmp_path):
    run_uri = (tmp_path / "run").as_uri()
    cfg = fault_free_run.config_for(run_uri)
    run_store = fault_free_run.copy_stage(run_uri, "update")
    stored = run_store.get_json(RUN_CONFIG)  # with rollout servers, publish writes the version's delta too
    run_store.put_json(RUN_CONFIG, stored | {"rollout": stored["rollout"] | {"servers": 1}})
    marker = f"{candidate_prefix(ITERATION)}/{MARKER}"
    update, publish = step_argv("update", run_uri, cfg), step_argv("publish", run_uri, cfg)

    # update: SIGKILL of the worker right after it uploaded its weight shard (a partial candidate, no marker).
    killed = run(update, step_env(kill_at("put", r"^candidates/iter-\d+/model-")))
    assert killed.returncode != 0
    assert not run_store.exists(marker)
    assert run_store.list(candidate_prefix(ITERATION)), "the kill should have left part of a candidate"
    assert published(run_store) == ("v000000", [0])
    # Then a hard kill of the update (torchrun and its worker) at a random moment of the retry's start-up, loading and
    # training; a retry that gets as far as its first write (it has removed the partial candidate by then)
    # stops itself there, so the kill lands before any of its candidate, however fast the machine.
    stop_at_write = kill_at("put", r"^candidates/iter-\d+/model-", when="before", sig="STOP")
    retry = start(update, step_env(stop_at_write))
    killed = kill_after(retry, random.Random(3).uniform(0.5, 4.0))
    assert killed.returncode == -9 and not run_store.exists(marker), killed.stderr
    # update: SIGKILL after CANDIDATE.json, before the delta's DELTA.json: the retry finds the candidate
    # complete and indexes it (rollout of the next iteration waits for this step, not for publish).
    killed = run(update, step_env(kill_at("put", r"^deltas/v000001/DELTA\.json$", when="before")))
    assert killed.returncode != 0 and run_store.exists(marker) and weight_delta.read_index(run_store, 1) is None
    done = run(update, step_env())
    assert done.returncode == 0, done.stderr
    assert run_store.exists(marker)
    indexed = weight_delta.read_index(run_store, 1)
    assert indexed is not None and checkpoint.read_manifest(run_store, 1) is None

    # publish, killed at each point in turn: every state in between is "v0 only" or "v1 complete".
    for fault in PUBLISH_KILLS:
        killed = run(publish, step_env(fault))
        assert killed.returncode == -9, (fault, killed.stderr)
        assert_nothing_half_published(run_store)
        latest, versions = published(run_store)
        assert (latest, versions) in [("v000000", [0]), ("v000000", [0, 1]), ("v000001", [0, 1])], fault
    assert published(run_store) == ("v000001", [0, 1])
    assert run_store.list(candidate_prefix(ITERATION)), "killed before its clean-up: the candidate is still there"

    done = run(publish, step_env())
    assert done.returncode == 0, done.stderr
    assert "v000001 was already published; LATEST and retention checked" in done.stdout
    assert published(run_store) == published(fault_free_run.store) == ("v000001", [0, 1])
    for version in (0, 1):
        assert manifest_files(run_store, version) == manifest_files(fault_free_run.store, version)
    reference = fault_free_run.store
    optimizer_state = {k: run_store.sha256(k) for k in run_store.list(optimizer_prefix(1))}
    assert optimizer_state == {k: reference.sha256(k) for k in reference.list(optimizer_prefix(1))}
    assert not run_store.list(candidate_prefix(ITERATION))
    assert checkpoint.latest_version(run_store) == 1
    assert_nothing_half_published(run_store)
    # What rollout servers could take before publish is what got published; the delta rebuilds v000001 exactly
    # (steps/run/weight_delta.py checks every file's sha256).
    assert indexed.describes(1, checkpoint.require_manifest(run_store, 1).files)
    assert weight_delta.read_index(run_store, 1) == indexed
    rebuilt = tmp_path / "rebuilt"
    rebuilt.mkdir()
    weight_delta.apply_delta(run_store, 1, checkpoint.fetch(run_store, 0), rebuilt)
