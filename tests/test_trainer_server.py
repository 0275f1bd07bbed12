"""The trainer that stays up (steps/trainer_server.py), end to end without Argo: a 2-rank torchrun trainer driven
by update clients (steps/update.py --workflow) trains the very bytes of plain update steps, whether it trains
on from memory or reloads after it was killed mid-update and restarted; and a client with no trainer exits to
be retried (it holds no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import faults_helpers
import pytest
import torch
from delta_helpers import assert_the_ranks_delta_is_the_one_publish_would_write
from faults_helpers import HOOKS
from test_update_experience import REPO, experience_table, run_cmd, step_env, tiny_model, write_experience

from steps.demo.char_tokenizer import save_tokenizer
from steps.errors import MoerlError
from steps.import_sft import import_sft
from steps.models.hf_checkpoint import save_pretrained
from steps.publish import publish
from steps.run import checkpoint, serving, weight_delta
from steps.run.candidate import MARKER, OPTIMIZER_RECEIPTS, WEIGHTS_MARKER
from steps.run.config import RunConfig
from steps.run.keys import TRAINER_SERVER_NAME, candidate_prefix, optimizer_prefix, update_metrics_key
from steps.store.object_store import Store

WORKFLOW = "wf-segment-1"
TRAINER = {"steps_per_epoch": 2, "server": True}


def new_run(base: Path, dtype: str, trainer: dict) -> str:
    """A file:// run store whose v000000 is the tiny model in `dtype` (fp32 or bf16)."""
    base.mkdir()
    sft = base / "sft"
    save_pretrained(tiny_model().to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])), sft)
    save_tokenizer(sft)
    run_uri = (base / "run").as_uri()
    # A rollout server in the config (none runs here): the update's ranks then write each version's delta.
    cfg = RunConfig(sft_checkpoint=sft.as_uri(), run_store=run_uri, rollout={"servers": 1},
                    trainer={"ep_backend": "alltoall", "micro_batch_size": 4, "lr": 1e-2, **trainer})  # fmt: skip
    import_sft(sft.as_uri(), run_uri, cfg.model_dump_json())
    return run_uri


def plain_update(run_uri: str, iteration: int) -> subprocess.CompletedProcess:
    """Today's update step: a torchrun of two ranks of its own."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            "-m", "steps.update", "--", "--run", run_uri, "--iteration", str(iteration)]  # fmt: skip
    return run_cmd(argv, timeout=300)


def client(run_uri: str, iteration: int) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, "-m", "steps.update", "--run", run_uri, "--iteration", str(iteration),
                    "--workflow", WORKFLOW], timeout=300)  # fmt: skip


def start_trainer(run_uri: str, log: Path, fault: str | None = None) -> subprocess.Popen:
    env = step_env()
    if fault:  # tests/fault_hooks/sitecustomize.py: a crash point in the trainer's own processes
        env |= {"PYTHONPATH": os.pathsep.join([str(HOOKS), env["PYTHONPATH"]]), "MOERL_FAULT": fault}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
            "-m", "steps.trainer_server", "--", "--run", run_uri, "--workflow", WORKFLOW]  # fmt: skip
    with log.open("a") as out:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the trainer and every process below it (torchrun's workers run in sessions of their own)."""
    faults_helpers.kill_tree(faults_helpers.process_tree(proc.pid))
    proc.wait(timeout=60)


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def candidate_files(run_uri: str, iteration: int) -> dict:
    """The files of the complete candidate, once the trainer stored its optimizer shards (after it answered)."""
    store = Store.open(run_uri)
    wait_for(lambda: store.exists(f"{candidate_prefix(iteration)}/{MARKER}"), f"no {MARKER} of iteration {iteration}")
    return store.get_json(f"{candidate_prefix(iteration)}/{MARKER}")["files"]


def lose_optimizer_shards(run_uri: str, iteration: int) -> None:
    """What a trainer lost after it answered update `iteration` leaves: WEIGHTS.json and the indexed delta, no
    optimizer shard, receipt or CANDIDATE.json."""
    store, prefix = Store.open(run_uri), candidate_prefix(iteration)
    store.delete_prefix(f"{prefix}/{OPTIMIZER_RECEIPTS}/")
    for key in store.list(f"{prefix}/"):
        if key.rsplit("/", 1)[-1] == MARKER or key.rsplit("/", 1)[-1].startswith("optimizer-rank"):
            store.delete(key)
    assert store.exists(f"{candidate_prefix(iteration)}/{WEIGHTS_MARKER}")


def published_bytes(run_uri: str, version: int) -> dict[str, bytes]:
    """The weights and config of v(version) and its optimizer state, byte for byte."""
    run = Store.open(run_uri)
    files = {name: meta["sha256"] for name, meta in checkpoint.require_manifest(run, version).files.items()}
    prefix = optimizer_prefix(version)
    return files | {key: run.get_bytes(key) for key in run.list(f"{prefix}/")}


def placement(run_uri: str, iteration: int) -> list:
    return Store.open(run_uri).get_json(update_metrics_key(iteration))["update"]["expert_placement"]["slots"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_trainer_that_stays_up_trains_the_bytes_of_plain_updates(tmp_path, dtype, monkeypatch):
    iterations = (1, 2, 3)
    # Publish indexes the deltas the update's ranks wrote (two EP ranks: two weight files), never its own.
    monkeypatch.setattr(weight_delta, "write_delta", lambda *a, **k: pytest.fail("publish wrote the delta"))
    # bf16: the SFT checkpoint and every version in bf16, fp32 masters in the optimizer state, the KL
    # penalty against v000000 on (the reference policy read each iteration).
    extra = {"kl_coef": 0.05} if dtype == "bf16" else {}
    runs, candidates = {}, {"plain": {}, "served": {}}
    for name, wait_s in (("plain", 0), ("served", 300)):
        runs[name] = new_run(tmp_path / name, dtype, {**TRAINER, **extra, "server_wait_s": wait_s})
        for i in iterations:
            write_experience(runs[name], i, experience_table(policy_version=i - 1, prompts=4, group=4, seed=i))

    # Plain: today's update steps. A client finds no trainer (server_wait_s 0) and exits to be retried: it holds
    # no GPU to train on.
    plain = runs["plain"]
    lonely = client(plain, 1)
    assert lonely.returncode == serving.EXIT_SERVER_LOST and "no trainer of workflow" in lonely.stdout
    for i in iterations:
        done = plain_update(plain, i)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert f"iteration {i}: loss" in done.stdout
        candidates["plain"][i] = candidate_files(plain, i)
        publish(plain, i)

    # Served: iteration 1 from the store; iteration 2 killed while rank 0 holds (SIGSTOP) right after writing
    # its weight shard, the client exits 75, a new trainer reloads v000001 and trains it; that trainer is lost
    # after it answered, before it stored the optimizer shards (they are deleted here), and the next trainer
    # trains iteration 2 again before it serves (the weights bit for bit, the optimizer shards written), then
    # iteration 3 from memory.
    served, log = runs["served"], tmp_path / "trainer.log"
    stop_at_write = '[{"kill": "STOP", "on": "put", "match": "^candidates/iter-000002/model-rank00000"}]'
    first = start_trainer(served, log, fault=stop_at_write)
    try:
        done = client(served, 1)
        assert done.returncode == 0, done.stdout[-3000:] + log.read_text()[-3000:]
        assert "update 1: trained by trainer (store)" in done.stdout
        candidates["served"][1] = candidate_files(served, 1)
        publish(served, 1)
        second = subprocess.Popen(
            [sys.executable, "-m", "steps.update", "--run", served, "--iteration", "2", "--workflow", WORKFLOW],
            cwd=REPO, env=step_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        store = Store.open(served)
        wait_for(lambda: any("model-rank00000" in k for k in store.list(f"{candidate_prefix(2)}/")),
                 "the trainer never wrote its iteration-2 weight shard\n" + log.read_text()[-3000:])  # fmt: skip
        kill_tree(first)
        out, err = second.communicate(timeout=120)
        assert second.returncode == serving.EXIT_SERVER_LOST, out + err
        assert not store.exists(f"{candidate_prefix(2)}/{WEIGHTS_MARKER}")
    finally:
        if first.poll() is None:
            kill_tree(first)

    restarted = start_trainer(served, log)
    try:
        retried = client(served, 2)  # the retry reaches the replacement, registered under the same name
        assert retried.returncode == 0, retried.stdout[-3000:] + log.read_text()[-3000:]
        assert "update 2: trained by trainer (store)" in retried.stdout
        candidates["served"][2] = candidate_files(served, 2)
    finally:
        kill_tree(restarted)
    lose_optimizer_shards(served, 2)

    restarted = start_trainer(served, log)
    try:
        # before it serves, the replacement trains iteration 2 again: the same weights, the same optimizer shards
        assert candidate_files(served, 2) == candidates["served"][2]
        done = client(served, 3)
        assert done.returncode == 0, done.stdout[-3000:] + log.read_text()[-3000:]
        assert "update 3: trained by trainer (memory)" in done.stdout
        assert "the candidate of iteration 2 lacks its optimizer shards: training it again" in log.read_text()
        publish(served, 2)
        moved = placement(served, 2) != placement(served, 3)  # then the ranks swapped experts in memory
        assert ("0 expert(s) changed EP rank" not in log.read_text()) == moved, log.read_text()[-2000:]
        again = client(served, 3)  # a retried client finds the candidate complete
        assert again.returncode == 0 and "nothing to do" in again.stdout
        (trainer,) = serving.live_servers(store, WORKFLOW, TRAINER_SERVER_NAME, exact=True)
        health = serving.health(trainer)
        assert health["dispatches_made"] == 1  # updates 2 (again) and 3 with one dispatcher
        assert health["reference_loads"] == (1 if extra else 0)  # and, with the KL penalty, one read of v000000
        answer = serving.call(trainer, "update", {"run": store.uri, "iteration": 3})  # and so does the trainer
        assert answer["outcome"] == "nothing to do"
        with pytest.raises(MoerlError, match="not 'file:///elsewhere'"):
            serving.call(trainer, "update", {"run": "file:///elsewhere", "iteration": 3})
        candidates["served"][3] = candidate_files(served, 3)  # before the trainer goes: stored after it answered
    finally:
        kill_tree(restarted)
    publish(served, 3)

    monkeypatch.undo()
    for i in iterations:
        assert candidates["served"][i] == candidates["plain"][i], f"candidate {i}"
        assert placement(served, i) == placement(plain, i)
        assert published_bytes(served, i) == published_bytes(plain, i), f"v{i}"
        for run_uri in (plain, served):  # from the store (1, 2 after the kill) and from memory (3)
            assert_the_ranks_delta_is_the_one_publish_would_write(Store.open(run_uri), i)
