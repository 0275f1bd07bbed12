"""`moerl simulate` for a config with an environment (multi-turn, tool-using rollouts): a chunk is its model turns
decoded at the engine's rate plus each turn's environment steps over the workers; the trainer runs the prompt, the
model's turns and the observations; --from-run takes turns, a turn's fill and an observation's tokens from a
multi-turn run; a config without an environment is modelled exactly as before."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from test_simulate import EKS, REPO, run_cli

from pipelines.config import load_config
from pipelines.simulate.from_run import measured_assumptions
from pipelines.simulate.model import simulate
from pipelines.simulate.sizing import (
    CPU_ASSUMPTIONS,
    GPU_ASSUMPTIONS,
    Assumptions,
    candidate_write_s,
    cluster_for,
    conversation_turns,
    derived_step_model,
    flops_seq_len,
    response_tokens,
    tokens_per_iteration,
)
from pipelines.simulate.sources import CPU_SOURCES, GPU_SOURCES
from steps.run.config import RunConfig

DEMO = REPO / "configs" / "demo.yaml"
# simulate never imports the environment's class: any class_path will do.
MULTI_TURN = {"prompt_format": "chat", "rollout.record_routes": False, "trainer.routing_replay": "none"}
NEW = ("turns", "environment_step_s", "observation_tokens")


def with_environment(path, max_turns: int = 3, workers: int = 2, max_total_tokens: int = 4096, **overrides
                     ) -> RunConfig:  # fmt: skip
    environment = {"class_path": "nowhere.env:Env", "max_turns": max_turns, "workers": workers,
                   "max_total_tokens": max_total_tokens}  # fmt: skip
    return load_config(path, {**MULTI_TURN, "environment": environment, **overrides})


def test_the_chunk_grows_by_each_turns_environment_steps_over_the_workers():
    cfg = with_environment(DEMO)  # 64 prompts x 8 samples a chunk, 3 turns, 2 workers
    conversations = cfg.rollout.chunk_size * cfg.group_size
    without = derived_step_model(cfg, CPU_ASSUMPTIONS.override({"environment_step_s": 0.0}))
    with_steps = derived_step_model(cfg, CPU_ASSUMPTIONS)
    assert CPU_ASSUMPTIONS.environment_step_s == GPU_ASSUMPTIONS.environment_step_s == 0.05
    expected = 3 * math.ceil(conversations / 2) * 0.05
    assert with_steps.rollout_chunk_s - without.rollout_chunk_s == pytest.approx(expected)
    assert with_steps.environment_s == pytest.approx(expected) and without.environment_s == 0.0
    # 5 workers: 103 conversations a worker a turn (ceil); 2.5 turns on average: 3 turns of steps.
    odd = with_environment(DEMO, workers=5)
    a = CPU_ASSUMPTIONS.override({"turns": 2.5})
    assert derived_step_model(odd, a).environment_s == pytest.approx(3 * 103 * 0.05)
    # The decode part is the model's tokens at the engine's rate, as for single-turn rollouts.
    assert without.rollout_chunk_s == pytest.approx(conversations * 3 * 8 / CPU_ASSUMPTIONS.rollout_tokens_per_gpu_s)


def test_the_models_tokens_and_the_trainers_scale_with_turns():
    cfg = with_environment(EKS, max_turns=4, max_total_tokens=32768, **{"rollout.servers": 0, "trainer.server": False})
    base = GPU_ASSUMPTIONS.override({"environment_step_s": 0.0, "response_fill": 0.5})
    one = derived_step_model(cfg, base.override({"turns": 1}))
    for turns in (2, 3, 4):
        a = base.override({"turns": turns})
        steps = derived_step_model(cfg, a)
        assert steps.rollout_chunk_s == pytest.approx(turns * one.rollout_chunk_s)
        assert tokens_per_iteration(cfg, a) == pytest.approx(1024 * 16 * turns * 4096 * 0.5)
        # The trainer: the model's turns and the turns - 1 observations between them (the prompt beside them).
        per_sample = turns * 4096 * 0.5 + (turns - 1) * 32
        assert response_tokens(cfg, a) == pytest.approx(per_sample)
        assert flops_seq_len(cfg, a) == pytest.approx(a.prompt_tokens + per_sample)
        train_s = 4 / 3 * 1024 * 16 * per_sample / (a.trainer_tokens_per_gpu_s * 128)
        write_s = candidate_write_s(cfg, a)
        assert steps.update_s == pytest.approx(a.pod_start_s + a.trainer_startup_s + train_s + write_s)
    # The default: every conversation runs to environment.max_turns; more than that is capped at it.
    assert conversation_turns(cfg, base) == 4 == conversation_turns(cfg, base.override({"turns": 9}))
    assert derived_step_model(cfg, base) == derived_step_model(cfg, base.override({"turns": 4}))


def test_a_conversation_stops_at_max_total_tokens():
    cfg = with_environment(DEMO, max_turns=3, max_total_tokens=20)  # 3 x 8 + 2 x 32 = 88 tokens wanted
    a = CPU_ASSUMPTIONS
    assert response_tokens(cfg, a) == pytest.approx(20)
    assert tokens_per_iteration(cfg, a) == pytest.approx(512 * 8 * 20 * 24 / 88)  # the model's share of the 20


def test_a_config_without_an_environment_is_modelled_as_before():
    for cfg, base in ((load_config(EKS), GPU_ASSUMPTIONS), (load_config(DEMO), CPU_ASSUMPTIONS)):
        assert cfg.environment is None
        steps = derived_step_model(cfg, base)
        ignored = base.override({"turns": 3, "environment_step_s": 7.0, "observation_tokens": 500.0})
        assert derived_step_model(cfg, ignored) == steps
        # the client's own work on a chunk is its verdicts alone (rollout servers: steps/scoring/verdicts.py)
        assert steps.environment_s == 0.0 and steps.served_chunk_s == steps.rollout_chunk_s - steps.verdicts_s
        devices = max(int(cfg.placement["rollout"].resources.limits.get("nvidia.com/gpu", 0)), 1)
        chunk_tokens = cfg.rollout.chunk_size * cfg.group_size * cfg.sampling.max_new_tokens * base.response_fill
        assert steps.served_chunk_s == pytest.approx(chunk_tokens / (base.rollout_tokens_per_gpu_s * devices))
        assert tokens_per_iteration(cfg, ignored) == (
            cfg.prompts_per_iteration * cfg.group_size * cfg.sampling.max_new_tokens * base.response_fill
        )
        assert flops_seq_len(cfg, ignored) == base.prompt_tokens + cfg.sampling.max_new_tokens * base.response_fill


def test_rollout_servers_serve_other_clients_while_a_client_steps_its_environment():
    # 32 shards, one chunk each, on 4 servers: 8 clients a server, their chunks one after the other on it.
    cfg = with_environment(EKS, max_total_tokens=16384, workers=16, **{"rollout.servers": 4, "trainer.server": False,
                                                                       "iterations": 1})  # fmt: skip
    a = GPU_ASSUMPTIONS.override({"environment_step_s": 0.5})
    steps = derived_step_model(cfg, a)
    assert steps.environment_s == pytest.approx(3 * 32 * 0.5)  # 512 conversations over 16 workers, 3 turns
    assert steps.served_chunk_s == pytest.approx(steps.rollout_chunk_s - steps.environment_s - steps.verdicts_s)
    result = simulate(cfg, steps, cluster_for(cfg, a), a, staleness=0)
    work = [s for s in result.segments if s.step == "rollout-server" and s.phase == "work"]
    assert len(work) == 32 and all(s.end - s.start == pytest.approx(steps.served_chunk_s) for s in work)
    # The environment adds one chunk's steps to the rollout (the last client's), not 8: the server is not held.
    no_steps = derived_step_model(cfg, a.override({"environment_step_s": 0.0}))
    without = simulate(cfg, no_steps, cluster_for(cfg, a), a, staleness=0)

    def rollout_end(r) -> float:
        return max(s.end for s in r.segments if s.step == "rollout")

    assert rollout_end(result) - rollout_end(without) == pytest.approx(steps.environment_s)  # verdicts in both
    # Without servers the rollout step's clock holds both, as the shard's pod does (and no verdicts: score verifies).
    today = with_environment(EKS, max_total_tokens=16384, workers=16, **{"rollout.servers": 0, "trainer.server": False})
    shard = derived_step_model(today, a)
    assert shard.rollout_chunk_s == pytest.approx(steps.rollout_chunk_s - steps.verdicts_s)


def write_run(root, metrics: dict) -> str:
    directory = root / "run" / "metrics"
    directory.mkdir(parents=True)
    for i in (1, 2):
        (directory / f"iter-{i:06d}.json").write_text(json.dumps({"iteration": i, **metrics}))
    return (root / "run").as_uri()


MULTI_TURN_METRICS = {"response_length_mean": 98.0, "model_tokens_mean": 50.0, "turns_mean": 2.5,
                      "prompt_length_mean": 40.0, "tied_group_fraction": 0.25}  # fmt: skip


def test_from_run_takes_turns_a_turns_fill_and_an_observations_tokens(tmp_path):
    run = write_run(tmp_path, MULTI_TURN_METRICS)
    cfg = with_environment(DEMO, **{"sampling.max_new_tokens": 40})
    values, line = measured_assumptions(run, cfg)
    assert values["turns"] == pytest.approx(2.5)
    assert values["response_fill"] == pytest.approx(50.0 / 2.5 / 40)  # a turn's share of max_new_tokens
    assert values["observation_tokens"] == pytest.approx((98.0 - 50.0) / 1.5)
    assert values["prompt_tokens"] == pytest.approx(40.0) and values["tied_group_share"] == pytest.approx(0.25)
    assert "2.50 model turns" in line and "fill 0.50 of 40 a turn" in line and "32 an observation" in line
    a = CPU_ASSUMPTIONS.override(values)
    assert response_tokens(cfg, a) == pytest.approx(98.0)  # the run's response length back
    # A fill over 1 is capped; one turn: the observations of max(turns - 1, 1).
    capped, _ = measured_assumptions(write_run(tmp_path / "b", {**MULTI_TURN_METRICS, "turns_mean": 1.0}),
                                     with_environment(DEMO))  # fmt: skip
    assert capped["response_fill"] == 1.0 and capped["observation_tokens"] == pytest.approx(48.0)
    # A config without an environment takes the response as today: the whole of it over max_new_tokens.
    single, _ = measured_assumptions(run, load_config(DEMO, {"sampling.max_new_tokens": 196}))
    assert single == {"response_fill": 0.5, "prompt_tokens": 40.0, "tied_group_share": 0.25}


def test_explain_lists_the_environment_assumptions_with_their_sources(tmp_path, capsys):
    assert set(NEW) <= {f.name for f in dataclasses.fields(Assumptions)} and set(NEW) <= set(GPU_SOURCES)
    assert all(CPU_SOURCES[name] == GPU_SOURCES[name] for name in NEW)
    assert "--from-run does not measure it" in GPU_SOURCES["environment_step_s"]
    sets = ["--set", "prompt_format=chat", "--set", "rollout.record_routes=false", "--set",
            "environment={class_path: 'nowhere.env:Env', max_turns: 3, workers: 2, max_total_tokens: 4096}"]
    run_cli([str(DEMO), *sets, "--iterations", "2", "--explain"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 2}
    assert rows["turns"].split()[1] == "3" and "environment.max_turns" in rows["turns"]
    assert rows["environment_step_s"].split()[1] == "0.05" and "time your environment's step" in rows[
        "environment_step_s"]  # fmt: skip
    assert rows["observation_tokens"].split()[1] == "32" and "response_length_mean" in rows["observation_tokens"]
    assert "environment: 3 turns, 2 workers, environment_step_s 0.05: 38.40 s of each chunk" in out
    run = write_run(tmp_path, MULTI_TURN_METRICS)
    measured = ["--from-run", run, "--assume", "environment_step_s=0.2"]
    run_cli([str(DEMO), *sets, "--iterations", "2", "--explain", *measured])
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ") and len(line.split()) > 2}  # fmt: skip
    assert rows["turns"].split()[1:3] == ["2.5", "measured:"]
    assert rows["observation_tokens"].split()[1:3] == ["32", "measured:"]
    assert rows["environment_step_s"].split()[1:3] == ["0.2", "--assume"]

