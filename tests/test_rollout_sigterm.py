"""SIGTERM in mid-shard (a Spot reclaim): the rollout process stops, keeps its finished chunks and exits 143;
a rerun then completes the shard, and the union is exactly what an uninterrupted run writes."""

import signal
import subprocess
import sys
import time

import pytest
import torch
from experience_helpers import REPO, make_run, run_files, run_step, step_env, tiny_model, write_checkpoint

from steps.rollout import EXIT_PREEMPTED, rollout_shard
from steps.run.keys import chunk_key, rollout_prefix
from steps.store.object_store import Store

# Many small chunks, so that the signal lands while most are still to do.
CONFIG = dict(prompts_per_iteration=80, group_size=4, rollout={"num_shards": 1, "chunk_size": 2},
              sampling={"max_new_tokens": 16}, heldout_size=0)  # fmt: skip
NUM_CHUNKS = 40


@pytest.fixture(autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.faults
def test_sigterm_mid_shard_exits_143_and_a_rerun_completes_the_exact_union(tmp_path):
    checkpoint_dir = write_checkpoint(tiny_model(seed=6), tmp_path / "policy")
    run_uri = make_run(tmp_path, checkpoint_dir, name="preempted", **CONFIG)
    run = Store.open(run_uri)
    args = ["--run", run_uri, "--iteration", "1", "--shard", "0", "--num-shards", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "steps.rollout", *args], cwd=REPO, env=step_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not run.exists(chunk_key(1, 0)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the rollout wrote no chunk within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)  # a hang guard, far beyond any grace period
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, stderr
    assert "SIGTERM: stopped; its finished chunks are kept" in stderr
    kept = sorted(run_files(run_uri, rollout_prefix(1)))
    assert 1 <= len(kept) < NUM_CHUNKS
    assert kept == [chunk_key(1, c) for c in range(len(kept))]  # finished in order, nothing partial
    assert not any(".moerl-tmp" in p.name for p in (tmp_path / "preempted").rglob("*"))

    rerun = run_step("steps.rollout", *args)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(kept)} already finished" in rerun.stdout
    clean_uri = make_run(tmp_path, checkpoint_dir, name="clean", **CONFIG)
    rollout_shard(clean_uri, 1, 0, 1, log=lambda line: None)
    assert run_files(run_uri, rollout_prefix(1)) == run_files(clean_uri, rollout_prefix(1))
    assert len(run_files(run_uri, rollout_prefix(1))) == NUM_CHUNKS


def test_a_bad_command_line_is_one_error_line_and_exit_2(tmp_path):
    result = run_step(
        "steps.rollout", "--run", (tmp_path / "missing").as_uri(), "--iteration", "1", "--shard", "0",
        "--num-shards", "1",
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "no run config" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
