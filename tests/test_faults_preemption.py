"""Spot preemptions (SIGTERM, then SIGKILL after the grace period) and hard kills of the real steps: through the
local executor's --chaos, and as signals sent straight to a rollout or score process. Whatever the moment, the
run ends with the fault-free run's experience, scores and weights, and no sample is lost or doubled."""

from __future__ import annotations

import random

import pytest
from faults_helpers import (
    ITERATION,
    assert_nothing_half_published,
    assert_same_result,
    chunk_bytes,
    error_lines,
    finish,
    kill_at,
    leftovers,
    metrics_without_timing,
    preempt_after,
    run,
    run_local,
    start,
    step_argv,
    step_env,
    wait_for_line,
)

from pipelines.local.pods.chaos import NODE_SHUTDOWN, POD_DELETED
from steps.rollout import EXIT_PREEMPTED
from steps.run.keys import metrics_key, scored_key
from steps.store.object_store import Store

pytestmark = pytest.mark.faults

# preempt=2,kill=3,seed=327 lands, in pod start order: a preemption of rollout shard 0, a kill of rollout shard 1,
# a preemption of score, kills of update and publish, each at one of the pod's progress reports
# (pipelines/local/pods/chaos.py), so on any machine, however fast or loaded.
CHAOS = "preempt=2,kill=3,seed=327"


def test_chaos_preemptions_and_kills_end_in_the_fault_free_weights(fault_free_run, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")  # 30 s grace -> 1.5 s; backoff 1 s -> 0.05 s
    run_uri = (tmp_path / "run").as_uri()
    result = run_local(fault_free_run.config_for(run_uri), tmp_path / "work", chaos=CHAOS)
    assert result.succeeded, result.message

    landed = [(f.template, f.kind) for f in result.faults]
    print("chaos landed:", landed)
    assert landed == [("rollout", "preempt"), ("rollout", "kill"), ("score", "preempt"), ("update", "kill"),
                      ("publish", "kill")]  # fmt: skip
    pods = [n for n in result.status["nodes"].values() if n["type"] == "Pod"]
    hit = sorted((n["displayName"], n["phase"], n["message"]) for n in pods if n["phase"] != "Succeeded")
    assert len(hit) == len(landed) and all(message in (POD_DELETED, NODE_SHUTDOWN) for _, _, message in hit)
    for name, _, _ in hit:  # every hit attempt was retried to success
        retried = name.rsplit("(", 1)[0]
        assert any(n["displayName"].startswith(retried) and n["phase"] == "Succeeded" for n in pods), name

    assert_same_result(Store.open(run_uri), fault_free_run.store)


def test_rollout_shards_stopped_at_any_moment_resume_to_the_same_chunks(fault_free_run, tmp_path):
    run_uri = (tmp_path / "run").as_uri()
    cfg = fault_free_run.config_for(run_uri)
    run_store = fault_free_run.copy_stage(run_uri, "rollout")
    reference = chunk_bytes(fault_free_run.store)
    argv = [step_argv("rollout", run_uri, cfg, shard) for shard in (0, 1)]

    # Shard 0: SIGTERM right after its first chunk is written; shard 1: SIGKILL between the rename of the
    # digest sidecar and the rename of its first chunk into place (the narrowest window of a local write).
    term = start(argv[0], step_env(kill_at("put", r"/chunk-\d+\.parquet$", sig="TERM")))
    kill = start(argv[1], step_env(kill_at("replace", r"/rollout/chunk-000001\.parquet$", when="before")))
    term, kill = finish(term), finish(kill)
    assert term.returncode == EXIT_PREEMPTED, term.stderr
    assert "SIGTERM: stopped; its finished chunks are kept" in term.stderr
    assert kill.returncode == -9, kill.stderr
    assert chunk_bytes(run_store) == {0: reference[0]}  # the finished chunk, complete; the torn one invisible
    assert leftovers(tmp_path / "run"), "the kill should have left a staging file (hidden from readers)"
    # Score reads nothing torn: it names the missing chunks and the shards that write them, and writes nothing.
    score = run(step_argv("score", run_uri, cfg), step_env())
    assert score.returncode == 2, score.stderr
    [line] = error_lines(score.stderr)
    assert "3 of 4 chunks missing: chunk 000001 (rollout shard 1 of 2), chunk 000002 (rollout shard 0 of 2)" in line
    assert not run_store.exists(scored_key(ITERATION))

    # Shard 1 again, preempted at a random moment of its work: SIGTERM, then SIGKILL after a 1 s grace period.
    shard = start(argv[1], step_env())
    wait_for_line(shard, "rollout iteration 1 shard 1/2: policy v000000")
    preempted = preempt_after(shard, random.Random(8).uniform(0.0, 3.0))
    # 143: stopped by its handler; -15: the signal came while the interpreter was starting or shutting down
    # (default action); -9: the grace period ran out; 0: it had finished.
    assert preempted.returncode in (0, EXIT_PREEMPTED, -15, -9), preempted.stderr
    assert chunk_bytes(run_store).items() <= reference.items()  # whatever is there is exactly the reference's

    # The retries finish the job: only the missing chunks are generated.
    retries = [start(a, step_env()) for a in argv]
    outs = [finish(p) for p in retries]
    assert [o.returncode for o in outs] == [0, 0], [o.stderr for o in outs]
    assert "1 already finished" in outs[0].stdout
    assert chunk_bytes(run_store) == reference


def test_score_stopped_at_any_moment_rewrites_the_same_bytes(fault_free_run, tmp_path):
    run_uri = (tmp_path / "run").as_uri()
    cfg = fault_free_run.config_for(run_uri)
    run_store = fault_free_run.copy_stage(run_uri, "score")
    argv = step_argv("score", run_uri, cfg)

    # A kill between its two writes: scored.parquet is there, the metrics are not.
    killed = run(argv, step_env(kill_at("put", r"experience/iter-\d+/scored\.parquet$")))
    assert killed.returncode == -9, killed.stderr
    assert run_store.exists(scored_key(ITERATION)) and not run_store.exists(metrics_key(ITERATION))
    # Then a reclaim at a random moment (score has no SIGTERM handler: the default action ends it at once);
    # on a fast machine the step may have finished first (0), which the rerun must also accept.
    stopped = preempt_after(start(argv, step_env()), random.Random(5).uniform(0.5, 4.0))
    assert stopped.returncode in (0, -15, -9), stopped.stderr

    rerun = run(argv, step_env())
    assert rerun.returncode == 0, rerun.stderr
    assert run_store.get_bytes(scored_key(ITERATION)) == fault_free_run.store.get_bytes(scored_key(ITERATION))
    assert metrics_without_timing(run_store) == metrics_without_timing(fault_free_run.store)
    assert_nothing_half_published(run_store)
