"""Rollout servers under faults: Spot reclaims of the servers in the middle of a request and kills of their
clients end in the fault-free run's experience, scores and weights, whatever the number of servers and shards;
nothing is lost and nothing doubled."""

from __future__ import annotations

import json

import pytest
from faults_helpers import assert_same_result, run_local

from steps.store.object_store import Store

pytestmark = pytest.mark.faults

# Lands, in pod start order, a preemption of rollout server 1 while it holds a generated, unwritten chunk and
# a kill of a rollout client at one of its progress reports (pipelines/local/pods/chaos.py): on any machine.
CHAOS = "preempt=1@rollout-server,kill=1@rollout,seed=1"


def served(fault_free_run, run_uri: str, servers: int, shards: int):
    rollout = {"num_shards": shards, "chunk_size": 2, "engine": "torch", "servers": servers, "server_wait_s": 300}
    return fault_free_run.config_for(run_uri, rollout=rollout)


def test_reclaimed_servers_and_killed_clients_end_in_the_fault_free_weights(fault_free_run, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")  # 30 s grace -> 1.5 s; backoff 1 s -> 0.05 s
    run_uri = (tmp_path / "run").as_uri()
    result = run_local(served(fault_free_run, run_uri, servers=2, shards=2), tmp_path / "work", chaos=CHAOS)
    assert result.succeeded, result.message
    landed = sorted((f.template, f.kind) for f in result.faults)
    assert landed == [("rollout", "kill"), ("rollout-server", "preempt")]
    pods = [n for n in result.status["nodes"].values() if n["type"] == "Pod"]
    lost = [n for n in pods if n["templateName"] == "rollout" and n.get("message", "").endswith("(exit code 75)")]
    assert lost, "the reclaimed server's client should have lost it mid-request and been retried"
    assert_same_result(Store.open(run_uri), fault_free_run.store)


# A kill of publish at one of its progress reports: the rollout of the next iteration waits for the update that
# indexed the version, not for its publish, so the servers may be generating with it while publish is killed.
PUBLISH_CHAOS = "kill=1@publish,seed=2"  # seed 2 lets no publish pod start pass: publish-1 is hit


def test_publish_killed_while_servers_generate_with_its_version_ends_in_the_fault_free_weights(
    fault_free_run, tmp_path, monkeypatch
):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")
    run_uri = (tmp_path / "run").as_uri()
    result = run_local(served(fault_free_run, run_uri, servers=2, shards=2), tmp_path / "work", chaos=PUBLISH_CHAOS)
    assert result.succeeded, result.message
    assert [(f.template, f.kind) for f in result.faults] == [("publish", "kill")]
    assert_same_result(Store.open(run_uri), fault_free_run.store)


@pytest.mark.parametrize(("servers", "shards"), [(1, 3), (3, 1)])
def test_any_number_of_servers_and_shards_gives_the_fault_free_weights(fault_free_run, tmp_path, servers, shards):
    run_uri = (tmp_path / "run").as_uri()
    result = run_local(served(fault_free_run, run_uri, servers, shards), tmp_path / "work")
    assert result.succeeded, result.message
    daemons = {n["displayName"] for n in result.status["nodes"].values() if n["templateName"] == "rollout-server"}
    assert {f"rollout-server-{k}" for k in range(servers)} <= daemons
    assert_same_result(Store.open(run_uri), fault_free_run.store)


# A kill of the trainer that stays up at one of its progress reports (in the middle of an update request), with
# rollout servers beside it: the update's client loses it, is retried, and the restarted trainer reloads v(i-1).
TRAINER_CHAOS = "kill=1@trainer-server,seed=2"  # seed 2 lets no eligible pod start pass before the kill


def test_a_trainer_killed_mid_update_ends_in_the_fault_free_weights(fault_free_run, tmp_path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")
    run_uri = (tmp_path / "run").as_uri()
    cfg = served(fault_free_run, run_uri, servers=1, shards=2)
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"server": True})})
    result = run_local(cfg, tmp_path / "work", chaos=TRAINER_CHAOS)
    assert result.succeeded, result.message
    assert [(f.template, f.kind) for f in result.faults] == [("trainer-server", "kill")]
    pods = [n for n in result.status["nodes"].values() if n["type"] == "Pod"]
    lost = [n for n in pods if n["templateName"] == "update" and n.get("message", "").endswith("(exit code 75)")]
    assert lost, "the update's client should have lost its trainer mid-request and been retried"
    assert_same_result(Store.open(run_uri), fault_free_run.store)


def test_a_multi_node_trainer_that_stays_up_killed_mid_update_trains_the_per_step_bits(
    fault_free_run, tmp_path, monkeypatch
):
    """trainer.nodes 2: the daemon is the launcher of the trainer's PyTorchJob (run here as the job's torchrun);
    killed in the middle of an update, it is retried, and the weights are those of per-iteration updates over
    the same two ranks (one node of two: the local executor has no kubectl for a per-iteration job's delete)."""
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")
    two_nodes = {"ep_backend": "alltoall", "nproc_per_node": 1, "nodes": 2, "micro_batch_size": 32}
    two_ranks = {**two_nodes, "nproc_per_node": 2, "nodes": 1}
    per_step_uri, served_uri = (tmp_path / "per-step").as_uri(), (tmp_path / "served").as_uri()
    per_step = run_local(fault_free_run.config_for(per_step_uri, trainer=two_ranks), tmp_path / "work-per-step")
    assert per_step.succeeded, per_step.message
    served = fault_free_run.config_for(served_uri, trainer={**two_nodes, "server": True, "server_wait_s": 300})
    result = run_local(served, tmp_path / "work", chaos=TRAINER_CHAOS)
    assert result.succeeded, result.message
    assert [(f.template, f.kind) for f in result.faults] == [("trainer-server", "kill")]
    pods = [n for n in result.status["nodes"].values() if n["type"] == "Pod"]
    assert not [n for n in pods if n["templateName"].startswith("update-")], "no per-iteration job with a server"
    lost = [n for n in pods if n["templateName"] == "update" and n.get("message", "").endswith("(exit code 75)")]
    assert lost, "the update's client should have lost its trainer mid-request and been retried"
    trainer_pods = [pod for pod in (result.run_dir / "pods").iterdir() if "-trainer-server-" in pod.name]
    jobs = [json.loads((pod / "pod.json").read_text())["local"]["pytorchJob"] for pod in trainer_pods]
    assert len(jobs) == 2 and {job["metadata"]["name"] for job in jobs} == {"faults-trainer-server"}
    assert_same_result(Store.open(served_uri), Store.open(per_step_uri))
