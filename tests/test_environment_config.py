"""The run config's `environment` section: what it refuses at load (each problem with its field and the fix) and
what `moerl check` finds by importing the environment class the way the rollout's workers do."""

from __future__ import annotations

import pytest

from pipelines.preflight import _reward_problems
from steps.errors import MoerlError
from steps.run.config import validate_config

BASE = {"sft_checkpoint": "file:///sft", "run_store": "file:///run", "prompt_format": "chat",
        "environment": {"class_path": "steps.demo.calculator:CalculatorEnv"}}  # fmt: skip


def problem(**changes) -> str:
    config = {**BASE, **changes}
    with pytest.raises(MoerlError) as caught:
        validate_config(config)
    return str(caught.value)


def test_a_good_environment_section_loads_with_its_defaults():
    env = validate_config(BASE).environment
    assert env is not None and (env.max_turns, env.tool_call_format, env.workers) == (4, "qwen", 4)


def test_an_environment_needs_chat_prompts():
    assert "prompt_format: an environment's conversations are rendered turn by turn" in problem(prompt_format="raw")


def test_the_class_path_is_a_dotted_path():
    message = problem(environment={"class_path": "my_envs.calc.Env"})
    assert "environment.class_path" in message and "write package.module:Class" in message


def test_a_conversation_holds_at_least_one_turn():
    message = problem(environment={**BASE["environment"], "max_total_tokens": 8}, sampling={"max_new_tokens": 16})
    assert "environment.max_total_tokens" in message and "below one turn's sampling.max_new_tokens" in message


@pytest.mark.parametrize("changes", [{"rollout": {"record_routes": True}}, {"trainer": {"routing_replay": "rollout"}}])
def test_routes_are_not_recorded_for_conversations(changes):
    assert "rollout.record_routes: routes are recorded per generation" in problem(**changes)


def test_unknown_fields_and_formats_are_refused():
    assert "tool_call_format" in problem(environment={**BASE["environment"], "tool_call_format": "llama"})
    assert "max_turns" in problem(environment={**BASE["environment"], "max_turns": 0})


def test_check_imports_the_environment_class_as_the_rollouts_workers_do():
    assert _reward_problems(validate_config(BASE), for_cluster=False, notes=[]) == []
    missing = validate_config({**BASE, "environment": {"class_path": "no_such_envs.calc:Env"}})
    problems = _reward_problems(missing, for_cluster=False, notes=[])
    assert len(problems) == 1 and "environment no_such_envs.calc:Env: cannot import no_such_envs.calc" in problems[0]
    notes: list[str] = []  # for a cluster it is installed in the image, not necessarily here
    assert _reward_problems(missing, for_cluster=True, notes=notes) == [] and "not installed here" in notes[0]
