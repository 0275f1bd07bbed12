"""`moerl simulate` with engines that stay up: rollout servers (rollout.servers) and a trainer server
(trainer.server) start once per segment and once per replacement, bring their weights to each new version
from bytes and bandwidth, and take the start-up out of the iterations; rollout.servers 0 is today's model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.simulate.cli import register
from pipelines.simulate.model import SimResult, Simulation, simulate, simulate_both
from pipelines.simulate.sizing import (
    DELTA_FRACTION,
    GPU_ASSUMPTIONS,
    Cluster,
    Pool,
    StepModel,
    cluster_for,
    derived_step_model,
    measured_step_model,
    shard_gb,
)
from pipelines.simulate.state import TRAINER_SERVER
from pipelines.workflow.graph import ROLLOUT_SERVER
from steps.run.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"
TODAY = {"rollout.servers": 0, "trainer.server": False}  # engines per step
TODAY_ARGS = ["--set", "rollout.servers=0", "--set", "trainer.server=false"]

# Hand-made step seconds, so that the expected times below follow from the DAG and the servers alone.
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
    client_s=0.5,
    weight_sync_s=2.0,
    full_sync_s=3.0,
    trainer_startup_s=8.0,
    train_s=6.0,
)
ASSUME = GPU_ASSUMPTIONS.override({"node_replacement_s": 100.0})
FAST_RETRY = {"retries.rollout": {"limit": 3, "backoff": {"duration": "30s", "factor": 2}}}


def eks(**overrides) -> RunConfig:
    """The EKS config in today's shape, with the overrides (the servers each test turns on)."""
    return load_config(EKS, {"iterations": 10, "segment_size": 10, **TODAY, **overrides})


def rollout_end(result: SimResult) -> float:
    return max(s.end for s in result.segments if s.step == "rollout")


def test_todays_shape_is_modelled_as_before():
    """rollout.servers 0 and no trainer server: the figures of issue 21's text (682 s and 385 s an iteration,
    23% and 41% of the rollout pool starting engines) with the candidate's write that the update step does
    (issue 32: 61.8 s, the busiest node's share), whatever checkpoint.deltas says."""
    results = {}
    for deltas in (True, False):
        # (without activation checkpointing, as the config was then: its extra forward lengthens the update)
        cfg = load_config(EKS, {**TODAY, "checkpoint.deltas": deltas, "trainer.activation_checkpointing": False})
        steps = derived_step_model(cfg, GPU_ASSUMPTIONS)
        assert steps.publish_s == pytest.approx(105.0)  # no delta written without servers to read it
        results[deltas] = simulate_both(cfg, steps, cluster_for(cfg, GPU_ASSUMPTIONS), GPU_ASSUMPTIONS)
    assert results[True][0].iteration_times == results[False][0].iteration_times
    both = results[True]
    assert [round(both[s].mean_iteration_s, 1) for s in (0, 1)] == [743.8, 446.8]
    assert [round(both[s].usage["rollout"].startup_share, 2) for s in (0, 1)] == [0.21, 0.36]
    assert both[1].server_starts == {ROLLOUT_SERVER: 0, TRAINER_SERVER: 0}


def test_start_up_share_falls_with_servers_below_five_percent_async():
    today = eks(**TODAY, iterations=60, segment_size=20)
    served = eks(**{"rollout.servers": 32, "trainer.server": True}, iterations=60, segment_size=20)
    shares = {}
    for name, cfg in (("today", today), ("served", served)):
        result = simulate(cfg, derived_step_model(cfg, ASSUME), cluster_for(cfg, ASSUME), ASSUME, staleness=1)
        shares[name] = result.usage["rollout"].startup_share
    assert shares["served"] < 0.05 < shares["today"]
    # once a segment instead of once an iteration (the served iterations being shorter, a start weighs a little more)
    assert shares["served"] < shares["today"] / 8


def test_a_segment_boundary_costs_one_server_start():
    cfg = eks(**{"rollout.servers": 32}, segment_size=5)
    result = simulate(cfg, STEPS, cluster_for(cfg, ASSUME), ASSUME, staleness=0)
    # Iteration 1: the servers start after import-sft, their clients wait for them; v0 is the version they open.
    assert result.iteration_times[0] == pytest.approx(10 + 5 + 3 + 20 + 4)
    # Then every iteration: a client starts, its server moves to the next version, one chunk, score, update; the
    # publish (4 s) runs beside the next rollout, which waits for the update that indexed its version.
    steady = 0.5 + 2 + 5 + 3 + 20
    assert result.iteration_times[1:5] == pytest.approx([steady] * 4)
    # The boundary: report, hand-over, plan, and one server start (the new servers open v5, the one asked for).
    assert result.iteration_times[5] == pytest.approx(1 + 0 + 1 + 10 + 5 + 3 + 20 + 4)
    assert result.iteration_times[6:] == pytest.approx([steady] * 4)
    assert result.server_starts[ROLLOUT_SERVER] == 2 * 32
    assert result.usage["rollout"].startup_seconds == pytest.approx(2 * 32 * 10)
    # The first segment's servers take their nodes after plan and wait there, idle, for import-sft's v000000.
    first = {(s.phase, s.end) for s in result.segments if s.step == ROLLOUT_SERVER and s.start == 1.0}
    assert first == {("ready", 3.0)}
    assert result.usage["rollout"].sync_seconds == pytest.approx(8 * 32 * 2)


def one_server(nodes: int, **overrides) -> tuple[RunConfig, Cluster]:
    # One shard of 4 chunks and one server; retries wait 30 s first.
    cfg = eks(
        **{"rollout.num_shards": 1, "rollout.servers": 1, "rollout.chunk_size": 4, "prompts_per_iteration": 16,
           "iterations": 1, **FAST_RETRY, **overrides},
    )  # fmt: skip
    cluster = Cluster(
        rollout=Pool("rollout", nodes, 8, spot=True),
        trainer=Pool("trainer", 1, 8, spot=False),
        cpu=Pool("cpu", 1, 0, spot=False, slots_per_node=None),
    )
    return cfg, cluster


def run_with(cfg: RunConfig, cluster: Cluster, events: list[tuple[float, str]]) -> SimResult:
    """One iteration, with "interrupt" (rollout node 0 reclaimed) or "crash" (the trainer's pod) at times."""
    simulation = Simulation(cfg, STEPS, cluster, ASSUME, staleness=0, iterations=1, interruptions_per_hour=0.0, seed=0)
    for at, what in events:
        if what == "interrupt":
            simulation.at(at, lambda: simulation.interrupt(simulation.nodes["rollout"][0]))
        else:
            simulation.at(at, lambda: simulation.crash(simulation.servers[0][-1]))
    return simulation.run()


def test_a_spot_replacement_costs_one_server_start_and_the_chunk_in_flight():
    start = 1 + 2  # plan, import-sft: the server starts on node 0, ready at +10; chunks of 5 s from there
    cfg, cluster = one_server(nodes=2)
    # At +22 two chunks are done and 2 s of the third are lost with the server. The client's attempt fails and
    # is retried after its 30 s backoff; the server's daemon too, on the other node: start-up, then 2 chunks.
    result = run_with(cfg, cluster, [(start + 22, "interrupt")])
    assert rollout_end(result) == pytest.approx(start + 22 + 30 + 10 + 2 * 5)
    assert result.server_starts[ROLLOUT_SERVER] == 2
    assert result.usage["rollout"].startup_seconds == pytest.approx(2 * 10)
    assert result.usage["rollout"].lost_seconds == pytest.approx(2)
    assert (result.interruptions, result.requeues, result.retries_exhausted) == (1, 2, 0)  # server and client


def test_a_replacement_server_waits_for_a_node_and_its_client_for_it():
    start = 1 + 2
    cfg, cluster = one_server(nodes=1)
    result = run_with(cfg, cluster, [(start + 22, "interrupt")])
    # The only node comes back after 100 s; the client waits within rollout.server_wait_s (600 s).
    assert rollout_end(result) == pytest.approx(start + 22 + 100 + 10 + 2 * 5)
    assert result.server_starts[ROLLOUT_SERVER] == 2


def test_a_client_whose_server_is_not_up_in_time_goes_to_a_ready_one():
    # Two shards of one chunk, two servers on one node: rollout-server-1 never gets a node in this iteration.
    cfg, cluster = one_server(
        nodes=1, **{"rollout.num_shards": 2, "rollout.servers": 2, "prompts_per_iteration": 8,
                    "rollout.server_wait_s": 20},
    )  # fmt: skip
    result = run_with(cfg, cluster, [])
    start = 1 + 2
    # Shard 0 on server 0 (ready at +10): +10..+15. Shard 1 gives up on server 1 at +0.5 +20, then server 0.
    assert rollout_end(result) == pytest.approx(start + 0.5 + 20 + 5)
    assert result.server_starts[ROLLOUT_SERVER] == 1


def test_the_trainer_server_starts_once_per_segment():
    cfg = eks(**{"trainer.server": True}, segment_size=5)
    result = simulate(cfg, STEPS, cluster_for(cfg, ASSUME), ASSUME, staleness=0)
    # Rollout shards as today (start-up + a chunk), score, then the update: a client start and 6 s on the trainer.
    per_iteration = 10 + 5 + 3 + 0.5 + 6 + 4
    assert result.iteration_times == pytest.approx([per_iteration] * 5 + [1 + 0 + 1 + per_iteration] * 1 +
                                                   [per_iteration] * 4)  # fmt: skip
    assert result.server_starts == {ROLLOUT_SERVER: 0, TRAINER_SERVER: 2}
    assert result.usage["trainer"].startup_seconds == pytest.approx(2 * 8)
    assert result.usage["trainer"].busy_seconds == pytest.approx(2 * 8 + 10 * 6)  # ready and idle is not busy


def test_a_trainer_crash_costs_one_trainer_start_and_the_update_in_flight():
    cfg, cluster = one_server(nodes=2, **{"trainer.server": True})
    start = 1 + 2
    # 4 chunks on the rollout server (ready at +10): until +30; score; the update's client sends its request at
    # +33.5 (the trainer is up since +8) and it trains until +39.5.
    result = run_with(cfg, cluster, [(start + 36, "crash")])
    # Crash 2.5 s into training; both retried after the trainer's 1 min backoff: start-up 8 s, train 6 s.
    assert result.iteration_times == pytest.approx([36 + 60 + 8 + 6 + 4])
    assert result.server_starts[TRAINER_SERVER] == 2
    assert result.usage["trainer"].lost_seconds == pytest.approx(2.5)


def test_delta_bytes_scale_the_servers_update_time():
    cfg = eks(**{"rollout.servers": 32, "checkpoint.deltas": True})
    # the encoder on one slow core: the writer of EP rank 0's weight file is then the busiest node
    a = GPU_ASSUMPTIONS.override({"delta_encode_gb_per_s": 0.2, "delta_encode_speedup": 1.0})
    small, large = (derived_step_model(cfg, a.override({"delta_fraction": f})) for f in (0.1, DELTA_FRACTION))
    fetched_gb = (DELTA_FRACTION - 0.1) * a.checkpoint_gb
    assert large.weight_sync_s - small.weight_sync_s == pytest.approx(fetched_gb / a.s3_gb_per_s)
    # The writer of EP rank 0's weight file (the largest: the replicated weights go with it) writes it, encodes
    # its delta and writes that: the busiest node; publish only indexes it.
    w0 = shard_gb(cfg, a)[0]["weights"]
    assert large.update_s - small.update_s == pytest.approx((DELTA_FRACTION - 0.1) * w0 / a.s3_gb_per_s)
    encode_s = w0 / a.delta_encode_gb_per_s
    busiest_without = shard_gb(cfg, a)[0]["optimizer"] / a.s3_gb_per_s  # EP rank 0's optimizer file, alone
    assert large.update_s - derived_step_model(eks(**TODAY), a).update_s == pytest.approx(
        w0 * (1 + DELTA_FRACTION) / a.s3_gb_per_s + encode_s - busiest_without
    )
    assert large.publish_s == small.publish_s == derived_step_model(eks(**TODAY), a).publish_s
    whole = derived_step_model(eks(**{"rollout.servers": 32, "checkpoint.deltas": False}), a)
    assert whole.weight_sync_s == whole.full_sync_s
    assert whole.full_sync_s - large.weight_sync_s == pytest.approx((1 - DELTA_FRACTION) * a.checkpoint_gb)
    assert whole.publish_s == pytest.approx(derived_step_model(eks(**TODAY), a).publish_s)
    # Synchronous, the update and the servers' fetch are on the critical path: an iteration is longer by both.
    runs = [simulate(cfg, s, cluster_for(cfg, a), a, staleness=0) for s in (small, large)]
    longer = fetched_gb / a.s3_gb_per_s + (DELTA_FRACTION - 0.1) * w0 / a.s3_gb_per_s
    assert runs[1].iteration_times[2] - runs[0].iteration_times[2] == pytest.approx(longer)


def test_a_server_opens_the_version_its_segments_first_rollout_samples():
    """Asynchronous, a segment's first rollout samples v(first-2) while LATEST is v(first-1): the new servers
    open that version (steps/experience/rollout_server.py), not LATEST, so no whole checkpoint is fetched; every next
    version is a delta."""
    cfg = eks(**{"rollout.servers": 32}, segment_size=5)
    result = simulate(cfg, STEPS, cluster_for(cfg, ASSUME), ASSUME, staleness=1)
    syncs = {(s.iteration, round(s.end - s.start, 6)) for s in result.segments if s.phase == "sync"}
    # Iterations 1 and 2 sample v0, 6 samples v4 (LATEST v5): each opened by its segment's servers.
    assert syncs == {(i, STEPS.weight_sync_s) for i in (3, 4, 5, 7, 8, 9, 10)}


def test_spot_interruptions_with_servers_end_every_iteration_deterministically():
    cfg = eks(**{"rollout.servers": 32, "trainer.server": True}, iterations=30, segment_size=10)
    cluster = cluster_for(cfg, ASSUME)
    steps = derived_step_model(cfg, ASSUME)
    calm = simulate(cfg, steps, cluster, ASSUME, staleness=1)
    runs = [simulate(cfg, steps, cluster, ASSUME, staleness=1, interruptions_per_hour=0.5, seed=s) for s in (4, 4)]
    assert runs[0].iteration_times == runs[1].iteration_times
    assert len(runs[0].iteration_times) == 30
    assert runs[0].interruptions > 0
    assert runs[0].server_starts[ROLLOUT_SERVER] > calm.server_starts[ROLLOUT_SERVER] == 3 * 32
    assert runs[0].mean_iteration_s > calm.mean_iteration_s


def test_measured_update_carries_over_to_the_trainer_server():
    cfg = eks(**{"trainer.server": True})
    model = measured_step_model(cfg, GPU_ASSUMPTIONS, {"update": 300.0}, "t")
    # the optimizer shards' part of the measured write the trainer does after it answered
    assert model.optimizer_write_s > 0
    assert model.train_s == pytest.approx(300.0 - model.trainer_startup_s - model.optimizer_write_s)
    assert model.update_s == 300.0  # today's shape keeps the whole figure


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def test_the_command_prints_the_servers_and_plots_their_lanes(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    argv = [str(EKS), "--iterations", "40", "--plot", str(png), "--set", "rollout.servers=32"]
    assert run_cli([*argv, "--set", "trainer.server=true"]) == 0
    out = capsys.readouterr().out
    for line in ("rollout servers: 32 a segment", "per new version a server fetches", "trainer server: start-up",
                 "rollout pool updating weights", "server starts (rollout / trainer)"):  # fmt: skip
        assert line in out
    assert "64 / 2" in out  # two segments of 20 iterations: 32 rollout servers and the trainer each
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run_cli([str(EKS), "--iterations", "5", *TODAY_ARGS])
    assert "rollout servers" not in capsys.readouterr().out


def test_a_server_is_bounded_by_its_retry_limit_not_by_max_duration():
    """backoff.max_duration counts from a pod's first start, for a server its segment's: a server's retries
    leave it out (pipelines/workflow/retry.py), so only a client past it runs out; the limit bounds both."""
    timed = {"limit": 3, "backoff": {"duration": "30s", "factor": 2, "max_duration": "40s"}}
    cfg, cluster = one_server(nodes=2, **{"retries.rollout": timed})
    result = run_with(cfg, cluster, [(3 + 22, "interrupt")])
    assert (result.retries_exhausted, result.servers_out_of_retries) == (1, 0)  # the client only
    spent = {"limit": 0, "backoff": {"duration": "30s", "factor": 2}}
    cfg, cluster = one_server(nodes=2, **{"retries.rollout": spent})
    result = run_with(cfg, cluster, [(3 + 22, "interrupt")])
    assert result.servers_out_of_retries == 1


def test_a_server_several_versions_behind_moves_by_the_chain_of_deltas_while_it_is_cheaper():
    """As steps/engines/weight_sync.py chooses: with deltas, k versions on cost k deltas up to the whole fetch."""
    from types import SimpleNamespace

    from pipelines.simulate.servers import ServedSteps

    def move(cfg: RunConfig, held: int | None, wanted: int) -> float:
        return ServedSteps.sync_seconds(SimpleNamespace(cfg=cfg, steps=STEPS), held, wanted)  # type: ignore[arg-type]

    with_deltas, without = eks(**{"checkpoint.deltas": True}), eks(**{"checkpoint.deltas": False})
    assert [move(with_deltas, 3, w) for w in (3, 4, 5, 6)] == [0.0, 2.0, 3.0, 3.0]  # full_sync_s 3.0 caps it
    assert move(with_deltas, None, 4) == move(without, 3, 5) == STEPS.full_sync_s
    assert move(without, 3, 4) == STEPS.weight_sync_s


def test_the_trainer_answers_before_the_optimizer_shards_and_publish_waits_for_them():
    """steps/training/optimizer_write.py in the model: the trainer is busy train_s until it answers (the weights
    written), stores the optimizer shards after it, and the next update joins that write before it writes its own;
    the segment's last update stores them before it answers; each publish waits for its candidate's shards."""
    served = {"rollout.servers": 32, "trainer.server": True, "checkpoint.deltas": True}
    cfg = eks(**served, iterations=6, segment_size=3)
    steps = derived_step_model(cfg, ASSUME)
    assert steps.optimizer_write_s > steps.weights_write_s > 0
    one_shot = derived_step_model(eks(), ASSUME)  # today's update writes all of it before it ends
    assert one_shot.update_s - steps.train_s > steps.optimizer_write_s - steps.weights_write_s
    sim = Simulation(cfg, steps, cluster_for(cfg, ASSUME), ASSUME, staleness=1, iterations=6,
                     interruptions_per_hour=0.0, seed=0)  # fmt: skip
    sim.run()

    def task(step: str, iteration: int):
        return next(t for t in sim.tasks.values() if t.step == step and t.iteration == iteration)

    for i in range(1, 7):
        update, publish = task("update", i), task("publish", i)
        stored = sim.candidate_complete[i]
        if i in (3, 6):  # the segment's last update: the shards before the answer
            assert stored <= update.end
        else:
            assert stored > update.end
        assert publish.end >= stored + steps.publish_s - 1e-6
