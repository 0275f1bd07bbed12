"""`moerl simulate`: the discrete-event model follows the workflow's DAG (sync and async), models Spot
interruptions with resumable chunks, is deterministic for a seed, and reads step times from a status."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.simulate.cli import register
from pipelines.simulate.measured import iteration_times_from_status, load_step_times, step_times_from_status
from pipelines.simulate.model import SimResult, Simulation, simulate
from pipelines.simulate.sizing import (
    CPU_ASSUMPTIONS,
    GPU_ASSUMPTIONS,
    Cluster,
    Pool,
    StepModel,
    candidate_write_s,
    chunks_per_iteration,
    cluster_for,
    derived_step_model,
    measured_step_model,
    tokens_per_iteration,
)
from steps.errors import MoerlError
from steps.run.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"
# These tests model today's shape, an engine per step (engines that stay up: tests/test_simulate_servers.py).
TODAY = {"rollout.servers": 0, "trainer.server": False}
TODAY_ARGS = ["--set", "rollout.servers=0", "--set", "trainer.server=false"]

# Hand-made step seconds, so that the expected times below follow from the DAG alone.
STEPS = StepModel(
    plan_s=1.0,
    import_sft_s=2.0,
    rollout_startup_s=10.0,
    rollout_chunk_s=5.0,
    score_s=3.0,
    update_s=20.0,
    publish_s=4.0,
    report_s=1.0,
    next_segment_s=0.0,
    source="test",
)
ASSUME = GPU_ASSUMPTIONS.override({"node_replacement_s": 100.0})


def eks(**overrides) -> RunConfig:
    return load_config(EKS, {"iterations": 10, "segment_size": 10, **TODAY, **overrides})


def test_sync_iterations_follow_the_critical_path():
    cfg = eks()  # 32 chunks over 32 shards: one chunk a shard
    result = simulate(cfg, STEPS, cluster_for(cfg, ASSUME), ASSUME, staleness=0)
    rollout = 10 + 5  # start-up, one chunk
    assert result.iteration_times == pytest.approx([rollout + 3 + 20 + 4] * 10)
    # Per iteration the rollout nodes work 15 of 42 s; the trainer 20 of 42 s.
    loop = sum(result.iteration_times)
    assert result.usage["rollout"].busy_seconds == pytest.approx(32 * 15 * 10)
    assert result.usage["trainer"].busy_seconds == pytest.approx(20 * 10)
    assert result.usage["rollout"].idle_share == pytest.approx(1 - 15 * 10 / (3 + loop + 1))
    assert result.usage["rollout"].startup_share == pytest.approx(10 * 10 / (3 + loop + 1))


def test_async_overlaps_the_next_rollout_with_the_update():
    cfg = eks()
    result = simulate(cfg, STEPS, cluster_for(cfg, ASSUME), ASSUME, staleness=1)
    # publish-i = max(publish-(i-1), publish-(i-2) + rollout + score) + update + publish: the trainer bounds it.
    assert result.iteration_times[0] == pytest.approx(42)
    assert result.iteration_times[1:] == pytest.approx([20 + 4] * 9)
    sync = simulate(cfg, STEPS, cluster_for(cfg, ASSUME), ASSUME, staleness=0)
    assert result.usage["trainer"].idle_share < sync.usage["trainer"].idle_share


@pytest.mark.parametrize(
    ("chunk_s", "score_s", "period"),
    [
        # rollout 22 + score 10 > update + publish 24: two iterations in flight, so
        # publish-i - publish-(i-2) = rollout + score + update + publish.
        (12.0, 10.0, (22 + 10 + 20 + 4) / 2),
        # rollout 35 s: rollout-(i+1) cannot start before rollout-i frees the nodes; the rollout pool bounds it.
        (25.0, 3.0, 35),
    ],
)
def test_async_period_when_rollout_is_the_longer_side(chunk_s, score_s, period):
    steps = StepModel(**{**vars(STEPS), "rollout_chunk_s": chunk_s, "score_s": score_s})
    cfg = eks()
    result = simulate(cfg, steps, cluster_for(cfg, ASSUME), ASSUME, staleness=1)
    assert sum(result.iteration_times[-2:]) / 2 == pytest.approx(period)  # it may alternate: two in flight


def test_each_segment_adds_its_report_and_the_next_plan():
    cfg = eks(segment_size=5)
    result = simulate(cfg, STEPS, cluster_for(cfg, ASSUME), ASSUME, staleness=0)
    assert result.iteration_times[4] == pytest.approx(42)
    assert result.iteration_times[5] == pytest.approx(1 + 0 + 1 + 42)  # report, hand-over, plan


def test_shards_queue_for_rollout_nodes():
    cfg = eks()
    a = ASSUME.override({"rollout_nodes": 16})  # 32 shards on 16 nodes: two waves
    result = simulate(cfg, STEPS, cluster_for(cfg, a), a, staleness=0)
    assert result.iteration_times[0] == pytest.approx(2 * 15 + 3 + 20 + 4)


def one_shard_cluster(nodes: int) -> tuple[RunConfig, Cluster]:
    # 16 prompts in chunks of 4: one shard with 4 chunks; the first retry waits 30 s.
    cfg = eks(
        **{"rollout.num_shards": 1, "rollout.chunk_size": 4, "prompts_per_iteration": 16, "iterations": 1},
        **{"retries": {"rollout": {"limit": 3, "backoff": {"duration": "30s", "factor": 2}}}},
    )
    cluster = Cluster(
        rollout=Pool("rollout", nodes, 8, spot=True),
        trainer=Pool("trainer", 1, 8, spot=False),
        cpu=Pool("cpu", 1, 0, spot=False, slots_per_node=None),
    )
    return cfg, cluster


def interrupted_run(cfg: RunConfig, cluster: Cluster, at: float) -> SimResult:
    simulation = Simulation(cfg, STEPS, cluster, ASSUME, staleness=0, iterations=1, interruptions_per_hour=0.0, seed=0)
    node = simulation.nodes["rollout"][0]
    simulation.at(at, lambda: simulation.interrupt(node))
    return simulation.run()


def rollout_end(result: SimResult) -> float:
    return max(s.end for s in result.segments if s.step == "rollout")


def test_an_interrupted_shard_keeps_its_finished_chunks_and_restarts_its_engine():
    start = 1 + 2  # plan, import-sft
    cfg, cluster = one_shard_cluster(nodes=2)
    # 10 s start-up, then chunks of 5 s: at +22 two chunks are done and 2 s of the third are lost.
    result = interrupted_run(cfg, cluster, start + 22)
    # Retried after the 30 s backoff on the other node: start-up again, then the 2 chunks left.
    assert rollout_end(result) == pytest.approx(start + 22 + 30 + 10 + 2 * 5)
    assert result.usage["rollout"].lost_seconds == pytest.approx(2)
    assert result.usage["rollout"].startup_seconds == pytest.approx(20)
    assert (result.interruptions, result.requeues, result.retries_exhausted) == (1, 1, 0)


def test_a_shard_waits_for_the_replacement_node_when_the_pool_has_no_other():
    start = 1 + 2
    cfg, cluster = one_shard_cluster(nodes=1)
    result = interrupted_run(cfg, cluster, start + 22)
    assert rollout_end(result) == pytest.approx(start + 22 + 100 + 10 + 2 * 5)  # node replacement, not backoff
    assert result.usage["rollout"].node_seconds == pytest.approx(result.makespan - 100)


def test_an_interruption_during_engine_start_up_loses_no_chunk():
    start = 1 + 2
    cfg, cluster = one_shard_cluster(nodes=2)
    result = interrupted_run(cfg, cluster, start + 4)
    assert rollout_end(result) == pytest.approx(start + 4 + 30 + 10 + 4 * 5)
    assert result.usage["rollout"].lost_seconds == 0


def test_a_shard_out_of_retries_is_counted():
    cfg, cluster = one_shard_cluster(nodes=2)
    cfg = cfg.model_copy(update={"retries": {**cfg.retries, "rollout": cfg.retries["rollout"].model_copy(
        update={"limit": 0})}})  # fmt: skip
    result = interrupted_run(cfg, cluster, 10)
    assert result.retries_exhausted == 1


def test_spot_interruptions_are_deterministic_for_a_seed_and_cost_time():
    cfg = eks(iterations=30, segment_size=30)
    cluster = cluster_for(cfg, ASSUME)
    calm = simulate(cfg, STEPS, cluster, ASSUME, staleness=0)
    runs = [
        simulate(cfg, STEPS, cluster, ASSUME, staleness=0, interruptions_per_hour=2.0, seed=seed) for seed in (7, 7, 8)
    ]
    assert runs[0].iteration_times == runs[1].iteration_times
    assert runs[0].iteration_times != runs[2].iteration_times
    for run in runs:
        assert run.interruptions > 0 and run.requeues > 0
        assert run.mean_iteration_s > calm.mean_iteration_s
        assert run.usage["rollout"].lost_seconds > 0


def test_the_local_machine_runs_every_ready_step_at_once():
    cfg = load_config(REPO / "configs" / "demo.yaml", {"iterations": 3, "staleness": 1})
    cluster = cluster_for(cfg, CPU_ASSUMPTIONS)
    assert cluster.local and cluster.rollout.slots_per_node is None
    result = simulate(cfg, STEPS, cluster, CPU_ASSUMPTIONS)
    # rollout-1 and rollout-2 both sample v0, and nothing makes rollout-2 wait: 4 shard pods at once.
    first = [s for s in result.segments if s.step == "rollout" and s.phase == "startup"]
    assert sorted(s.iteration for s in first if s.start == first[0].start) == [1, 1, 2, 2]


def test_derived_step_times_scale_with_the_config():
    cfg = eks()
    a = GPU_ASSUMPTIONS
    base = derived_step_model(cfg, a)
    tokens = 1024 * 16 * 4096
    assert tokens_per_iteration(cfg, a) == tokens
    assert base.rollout_chunk_s == pytest.approx(32 * 16 * 4096 / (a.rollout_tokens_per_gpu_s * 8))
    recompute = 4 / 3 if cfg.trainer.activation_checkpointing else 1.0  # one more forward a step
    assert cfg.trainer.activation_checkpointing  # configs/eks-p5en.yaml checkpoints to fit the H200
    assert base.update_s == pytest.approx(
        a.pod_start_s + a.trainer_startup_s + recompute * tokens / (a.trainer_tokens_per_gpu_s * 128)
        + candidate_write_s(cfg, a)
    )
    half_cfg = load_config(EKS, {"trainer.nodes": 8, **TODAY})
    half = derived_step_model(half_cfg, a)
    assert half.update_s - a.pod_start_s - a.trainer_startup_s - candidate_write_s(half_cfg, a) == pytest.approx(
        2 * (base.update_s - a.pod_start_s - a.trainer_startup_s - candidate_write_s(cfg, a))
    )


def test_a_measured_rollout_splits_into_start_up_and_chunks():
    # 4 chunks over 2 shards: each shard starts its engine once, then generates 2 chunks.
    cfg = load_config(REPO / "configs" / "demo.yaml", {"prompts_per_iteration": 64, "rollout.chunk_size": 16})
    model = measured_step_model(cfg, CPU_ASSUMPTIONS, {"rollout": 9.0, "engine_startup": 5.0}, "t")
    assert (model.rollout_startup_s, model.rollout_chunk_s) == (5.0, 2.0)
    model = measured_step_model(cfg, CPU_ASSUMPTIONS, {"rollout": 2.0, "update": 7.0}, "t")
    assert model.rollout_startup_s == 2.0 and model.rollout_chunk_s == 0.0  # start-up capped at the figure
    assert model.update_s == 7.0


def pod(name: str, template: str, start: int, end: int, phase: str = "Succeeded") -> dict:
    return {
        "name": name,
        "type": "Pod",
        "templateName": template,
        "phase": phase,
        "startedAt": f"2026-01-01T00:{start // 60:02d}:{start % 60:02d}Z",
        "finishedAt": f"2026-01-01T00:{end // 60:02d}:{end % 60:02d}Z",
    }


def fake_status() -> dict:
    nodes = [
        pod("wf.plan(0)", "plan", 0, 1),
        pod("wf.import-sft(0)", "import-sft", 1, 3),
        pod("wf.rollout-1(0:0)(0)", "rollout", 3, 4, phase="Failed"),  # preempted: no measure
        pod("wf.rollout-1(0:0)(1)", "rollout", 5, 11),
        pod("wf.rollout-1(1:1)(0)", "rollout", 3, 9),
        pod("wf.score-1(0)", "score", 11, 13),
        pod("wf.update-1(0)", "update", 13, 23),
        pod("wf.publish-1(0)", "publish", 23, 25),
        pod("wf.rollout-2(0:0)(0)", "rollout", 25, 32),
        pod("wf.rollout-2(1:1)(0)", "rollout", 25, 31),
        pod("wf.score-2(0)", "score", 32, 34),
        pod("wf.update-2(0)", "update", 34, 46),
        pod("wf.publish-2(0)", "publish", 46, 48),
        pod("wf.onExit(0)", "report", 48, 50),
        {"name": "wf.rollout-1", "type": "TaskGroup", "templateName": "rollout", "phase": "Succeeded",
         "startedAt": "2026-01-01T00:00:03Z", "finishedAt": "2026-01-01T00:00:11Z"},
    ]  # fmt: skip
    return {"phase": "Succeeded", "nodes": {str(k): node for k, node in enumerate(nodes)}}


def test_step_times_are_medians_of_succeeded_pods():
    times = step_times_from_status(fake_status())
    assert times == {
        "plan": 1,
        "import-sft": 2,
        "rollout": 6,  # 6, 6, 7, 6: the failed attempt is left out
        "score": 2,
        "update": 11,
        "publish": 2,
        "report": 2,
    }
    assert iteration_times_from_status({"status": fake_status()}) == [22, 23]  # a whole Workflow object


def test_step_times_load_from_a_status_file_or_a_step_times_file(tmp_path):
    status = tmp_path / "status.json"
    status.write_text(json.dumps(fake_status()))
    assert load_step_times(status)["update"] == 11
    plain = tmp_path / "times.json"
    plain.write_text(json.dumps({"rollout": 30, "update": 12.5}))
    assert load_step_times(plain) == {"rollout": 30.0, "update": 12.5}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"rolout": 3}, "did you mean 'rollout'"),
        ({"update": -1}, "update must be a number of seconds >= 0"),
        ({"nodes": {}}, "no Succeeded pod"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_step_times_name_the_problem(tmp_path, content, message):
    path = tmp_path / "times.json"
    path.write_text(json.dumps(content))
    with pytest.raises(MoerlError, match=message):
        load_step_times(path)


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def test_the_command_prints_sync_against_async_for_the_eks_config(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert run_cli([str(EKS), "--iterations", "40", "--plot", str(png), "--spot-interruptions-per-hour", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "32 nodes x 8 GPUs (Spot)" in out and "16 nodes x 8 GPUs (on-demand)" in out
    assert "async (staleness 1)*" in out  # the config's own staleness
    speedup = float(out.split("async vs sync: ")[1].split("x")[0])
    assert speedup > 1.2
    for row in ("iteration time, mean", "iteration time, p95", "rollout tokens/s", "rollout pool idle",
                "trainer pool idle"):  # fmt: skip
        assert row in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_is_deterministic_for_a_seed(capsys):
    argv = [str(EKS), "--iterations", "30", "--spot-interruptions-per-hour", "0.5", "--seed", "3"]
    run_cli(argv)
    first = capsys.readouterr().out
    run_cli(argv)
    assert capsys.readouterr().out == first


def test_the_command_reads_measured_step_times_and_assumptions(tmp_path, capsys):
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"rollout": 400, "engine_startup": 200, "update": 300}))
    run_cli([str(EKS), "--iterations", "5", "--step-times", str(times), "--assume", "publish_s=10", *TODAY_ARGS])
    out = capsys.readouterr().out
    assert "start-up 200.0 s + 1 chunk x 200.00 s" in out
    assert "update 300.0 s" in out and "publish 25.0 s" in out  # pod start 10 + step start 5 + 10 s
    assert "measured" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--assume", "rollout_tokens_per_gpu=1"], "did you mean 'rollout_tokens_per_gpu_s'"),
        (["--assume", "trainer_tokens_per_gpu_s=0"], "a throughput > 0"),
        (["--spot-interruptions-per-hour", "-1"], ">= 0"),
        (["--iterations", "0"], "at least 1"),
    ],
)
def test_bad_arguments_name_the_problem(argv, message):
    with pytest.raises(MoerlError, match=message):
        run_cli([str(EKS), *argv])


def test_a_served_runs_rollout_and_update_pods_are_measured_as_clients():
    """With server daemons in the status, the rollout and update pods are clients: keyed rollout-client and
    update-client, and fitted as the servers' work (their own start inside the figure)."""
    status = fake_status()
    daemons = [pod("wf.rollout-server-0(0)", "rollout-server", 2, 48, phase="Succeeded"),
               pod("wf.trainer-server(0)", "trainer-server", 2, 48, phase="Succeeded")]  # fmt: skip
    status["nodes"].update({f"d{k}": node for k, node in enumerate(daemons)})
    times = step_times_from_status(status)
    assert (times["rollout-client"], times["update-client"]) == (6, 11)
    assert "rollout" not in times and "update" not in times and "rollout-server" not in times
    cfg = load_config(REPO / "configs" / "demo.yaml", {"rollout.servers": 2, "trainer.server": True})
    model = measured_step_model(cfg, CPU_ASSUMPTIONS, times, "status")
    chunks_per_shard = chunks_per_iteration(cfg) / cfg.rollout.num_shards
    assert model.client_s == 0.0
    assert model.rollout_chunk_s == pytest.approx(6 / chunks_per_shard)
    assert model.train_s == 11
    assert model.rollout_startup_s == derived_step_model(cfg, CPU_ASSUMPTIONS).rollout_startup_s  # not timed
    assert "rollout-client" in model.source and "update-client" in model.source
