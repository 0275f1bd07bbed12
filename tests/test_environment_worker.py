"""steps/environments/worker.py: the EnvironmentPool against real worker processes (`python -m
steps.environments.worker`) running small environment classes that the tests write into a module under tmp_path.

Covered: answers in call order over several conversations and two workers, per-conversation state kept from reset
to step, close() called on close; an environment that raises, hangs past the time limit, exits, or returns what the
contract forbids (one error naming the class path and the prompt, sample and turn, every worker killed); a class
that cannot be imported; and resolve()'s own checks of the class path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from steps.environments.worker import Call, EnvironmentPool, resolve
from steps.errors import MoerlError

REPO = Path(__file__).resolve().parents[1]
MODULE = "moerl_test_envs"

ENVIRONMENTS = '''
import json
import os
import subprocess
import time

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


class EchoEnv:
    """Well behaved: two turns; logs reset/close to `log`; its answers carry what reset was given."""

    tools = TOOLS

    def __init__(self, log, greeting="hi"):
        self.log, self.greeting, self.turns = log, greeting, 0

    def _write(self, line):
        with open(self.log, "a") as f:
            f.write(line + "\\n")

    def reset(self, prompt, answer, metadata, seed):
        time.sleep(metadata.get("sleep", 0))
        self.prompt, self.answer, self.seed = prompt, answer, seed
        self._write(f"reset {prompt}")
        if metadata.get("own"):
            return None
        return [{"role": "user", "content": f"{self.greeting} {prompt}"}]

    def step(self, messages):
        self.turns += 1
        done = self.turns >= 2
        text = f"{self.prompt}|{self.answer}|{self.seed}|{self.turns}|{messages[-1]['content']}"
        observation = [] if done else [{"role": "user", "content": text}]
        return observation, float(self.seed) + self.turns, done, {"turns": self.turns, "pid": os.getpid()}

    def close(self):
        self._write(f"close {self.prompt}")


class NoCloseEnv:
    def reset(self, prompt, answer, metadata, seed):
        return None

    def step(self, messages):
        return [], 1, True, None


class RaisesEnv:
    def __init__(self):
        self.turns = 0

    def reset(self, prompt, answer, metadata, seed):
        return None

    def step(self, messages):
        self.turns += 1
        if self.turns == 2:
            raise ValueError("bad move 7")
        return [{"role": "tool", "content": "ok"}], 0.0, False, {}


class HangsEnv:
    def __init__(self, op):
        self.op = op

    def reset(self, prompt, answer, metadata, seed):
        if self.op == "reset":
            time.sleep(60)
        return None

    def step(self, messages):
        time.sleep(60)
        return [], 0.0, True, {}


class NoisyEnv:
    """Prints, from Python and from a program it runs (as a tool sandbox would), then answers."""

    def reset(self, prompt, answer, metadata, seed):
        return None

    def step(self, messages):
        print("a print from python")
        subprocess.run(["echo", "a tool's own output"], check=True)
        return [], 1.0, True, {}


class ExitsEnv:
    def reset(self, prompt, answer, metadata, seed):
        return None

    def step(self, messages):
        os._exit(3)


NAN = float("nan")
STEP_RETURNS = {
    "not_a_tuple": lambda: ([], 1.0),
    "reward_nan": lambda: ([], NAN, True, {}),
    "reward_string": lambda: ([], "1", True, {}),
    "done_not_bool": lambda: ([], 1.0, 1, {}),
    "observation_not_a_list": lambda: ({"role": "tool", "content": "x"}, 1.0, False, {}),
    "observation_assistant": lambda: ([{"role": "assistant", "content": "x"}], 1.0, False, {}),
    "observation_content_not_text": lambda: ([{"role": "tool", "content": 5}], 1.0, False, {}),
    "metric_not_a_number": lambda: ([], 1.0, True, {"acc": "high"}),
    "goes_on_without_observation": lambda: ([], 1.0, False, {}),
}
RESETS = {"not_a_list": lambda: "hello", "empty": lambda: [], "fine": lambda: None}


class GarbageEnv:
    def __init__(self, step="fine", reset="fine", tools=None):
        self.step_kind, self.reset_kind = step, reset
        if tools is not None:
            self.tools = tools

    def reset(self, prompt, answer, metadata, seed):
        return RESETS[self.reset_kind]()

    def step(self, messages):
        return STEP_RETURNS[self.step_kind]()
'''


@pytest.fixture
def envs(tmp_path, monkeypatch):
    """The test environments as an importable module, for this process and the worker processes."""
    (tmp_path / f"{MODULE}.py").write_text(ENVIRONMENTS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{REPO}")
    monkeypatch.chdir(REPO)  # the worker runs `python -m steps.environments.worker` in the current directory
    return tmp_path


def reset(conversation, prompt, seed=0, metadata=None):
    body = {"prompt": prompt, "answer": f"a-{prompt}", "metadata": metadata or {}, "seed": seed}
    return Call(conversation, "reset", body, f"prompt {prompt!r} sample 0 turn 0")


def step(conversation, turn, content="x", where=None):
    body = {"messages": [{"role": "assistant", "content": content}]}
    return Call(conversation, "step", body, where or f"prompt 'p{conversation}' sample 0 turn {turn}")


def all_dead(pool):
    return all(worker.process.poll() is not None for worker in pool.workers)


def error_of(pool, calls):
    with pytest.raises(MoerlError) as err:
        pool.run(calls)
    assert all_dead(pool)
    return str(err.value)


def test_answers_come_back_in_call_order_across_two_workers(envs):
    log = envs / "log"
    with EnvironmentPool(f"{MODULE}:EchoEnv", {"log": str(log), "greeting": "hello"}, 2, 30) as pool:
        # conversation 0's reset is slow, so worker 1 answers first: the answers still follow the calls
        calls = [reset(c, f"p{c}", seed=10 * c, metadata={"sleep": 0.3} if c == 0 else {}) for c in range(4)]
        answers = pool.run(calls)
        assert [a["messages"] for a in answers] == [[{"role": "user", "content": f"hello p{c}"}] for c in range(4)]
        assert all(a["tools"][0]["function"]["name"] == "calc" for a in answers)
        answers = pool.run([step(c, 1, content=f"turn of {c}") for c in reversed(range(4))])
    assert [a["observation"][0]["content"] for a in answers] == [
        f"p{c}|a-p{c}|{10 * c}|1|turn of {c}" for c in reversed(range(4))
    ]
    assert [a["reward"] for a in answers] == [10.0 * c + 1 for c in reversed(range(4))]
    assert len({a["metrics"]["pid"] for a in answers}) == 2  # both workers served conversations
    assert all_dead(pool)


def test_state_is_kept_per_conversation_and_close_calls_close(envs):
    log = envs / "log"
    with EnvironmentPool(f"{MODULE}:EchoEnv", {"log": str(log)}, 2, 30) as pool:
        first = pool.run([reset(0, "p0", seed=3, metadata={"own": True}), reset(1, "p1", seed=4), reset(2, "p2")])
        assert first[0] == {"messages": None, "tools": first[0]["tools"]}  # None keeps the prompt's own messages
        turn1 = pool.run([step(c, 1) for c in range(3)])
        assert [a["done"] for a in turn1] == [False] * 3
        turn2 = pool.run([step(c, 2) for c in range(3)])  # each conversation counts its own turns
        assert [(a["done"], a["observation"], a["metrics"]["turns"]) for a in turn2] == [(True, [], 2.0)] * 3
        assert [a["reward"] for a in turn2] == [5.0, 6.0, 2.0]
        assert sorted(log.read_text().splitlines()) == ["reset p0", "reset p1", "reset p2"]  # not closed yet
        closed = pool.run([Call(c, "close", {}, f"prompt 'p{c}' sample 0 turn 2") for c in range(3)])
        assert closed == [{}, {}, {}]
    assert sorted(log.read_text().splitlines()) == ["close p0", "close p1", "close p2", "reset p0", "reset p1",
                                                    "reset p2"]  # fmt: skip


def test_close_without_a_close_method_or_a_reset_answers_nothing(envs):
    with EnvironmentPool(f"{MODULE}:NoCloseEnv", {}, 1, 30) as pool:
        assert pool.run([reset(0, "p0"), step(0, 1), Call(0, "close", {}, "w"), Call(5, "close", {}, "w")]) == [
            {"messages": None, "tools": None},
            {"observation": [], "reward": 1.0, "done": True, "metrics": {}},
            {},
            {},
        ]


def test_a_step_that_raises_names_the_class_the_turn_and_the_exception(envs):
    pool = EnvironmentPool(f"{MODULE}:RaisesEnv", {}, 2, 30)
    pool.run([reset(0, "p0"), reset(1, "p1")])
    assert [a["done"] for a in pool.run([step(0, 1), step(1, 1)])] == [False, False]
    message = error_of(pool, [step(0, 2)])  # worker 1, idle, is killed too
    assert f"environment {MODULE}:RaisesEnv raised in step on prompt 'p0' sample 0 turn 2: ValueError: bad move 7" in (
        message
    )


@pytest.mark.parametrize("op", ["reset", "step"])
def test_a_call_that_hangs_past_the_limit_is_an_error(envs, op):
    pool = EnvironmentPool(f"{MODULE}:HangsEnv", {"op": op}, 2, 30)
    if op == "step":
        pool.run([reset(0, "p0"), reset(1, "p1")])
    pool.timeout_s = 0.5
    calls = [reset(0, "p0"), reset(1, "p1")] if op == "reset" else [step(0, 3), step(1, 3)]
    message = error_of(pool, calls)
    turn = 0 if op == "reset" else 3
    assert f"environment {MODULE}:HangsEnv: {op} took longer than 0.5s on prompt 'p0' sample 0 turn {turn}" in message


def test_a_worker_that_exits_is_reported_as_ended(envs):
    pool = EnvironmentPool(f"{MODULE}:ExitsEnv", {}, 2, 30)
    pool.run([reset(0, "p0"), reset(1, "p1")])
    message = error_of(pool, [step(0, 1)])
    assert f"environment {MODULE}:ExitsEnv: its worker process ended (exit code 3) on prompt 'p0' sample 0 turn 1" in (
        message
    )


def test_output_of_a_program_the_environment_runs_goes_to_the_log(envs):
    with EnvironmentPool(f"{MODULE}:NoisyEnv", {}, 1, 30) as pool:
        answers = pool.run([reset(0, "p0"), step(0, 1)])
    assert answers[1] == {"observation": [], "reward": 1.0, "done": True, "metrics": {}}


@pytest.mark.parametrize(
    "kind, problem",
    [
        ("not_a_tuple", "returned '([], 1.0)'; step must return (observation messages, reward, done, metrics)"),
        ("reward_nan", "returned reward nan; a step's reward is a finite number"),
        ("reward_string", "returned reward '1'; a step's reward is a finite number"),
        ("done_not_bool", "returned done 1; done is True or False"),
        ("observation_not_a_list", "the observation is dict, not a list of messages"),
        ("observation_assistant", "the observation holds a 'assistant' message; observations are tool, user, system"),
        ("observation_content_not_text", "the observation holds a message whose content is int, not text"),
        ("metric_not_a_number", "metrics['acc'] = 'high'; every metric must be a finite number"),
        ("goes_on_without_observation", "returned no observation and done False; a conversation that goes on needs"),
    ],
)
def test_a_step_that_returns_garbage_is_an_error(envs, kind, problem):
    pool = EnvironmentPool(f"{MODULE}:GarbageEnv", {"step": kind}, 2, 30)
    pool.run([reset(0, "p0"), reset(1, "p1")])
    message = error_of(pool, [step(0, 1)])  # worker 1, idle, is killed too
    assert message.startswith(f"environment {MODULE}:GarbageEnv: step on prompt 'p0' sample 0 turn 1 {problem}")
    assert message.endswith("; fix the environment")


@pytest.mark.parametrize(
    "params, problem",
    [
        ({"reset": "not_a_list"}, "reset's messages is str, not a list of messages"),
        ({"reset": "empty"}, "reset returned no messages; return the first messages, or None for the prompt's own"),
        ({"tools": "calc"}, "its tools are 'calc'; tools is a list of JSON schema dicts"),
        ({"tools": ["calc"]}, "its tools are \"['calc']\"; tools is a list of JSON schema dicts"),
    ],
)
def test_a_reset_that_returns_garbage_is_an_error(envs, params, problem):
    pool = EnvironmentPool(f"{MODULE}:GarbageEnv", params, 1, 30)
    message = error_of(pool, [reset(0, "p0")])
    assert f"environment {MODULE}:GarbageEnv: reset on prompt 'p0' sample 0 turn 0 {problem}" in message


def test_a_missing_module_says_to_install_the_package(envs):
    with pytest.raises(MoerlError) as err:
        EnvironmentPool("no_such_pkg_xyz.envs:Env", {}, 2, 30)
    message = str(err.value)
    assert message.startswith("environment no_such_pkg_xyz.envs:Env: cannot import no_such_pkg_xyz.envs")
    assert "install the package" in message


def test_a_module_with_a_missing_dependency_says_to_install_the_package(envs):
    (envs / "needs_dep.py").write_text("import no_such_dependency_xyz\n\nclass Env:\n    pass\n")
    with pytest.raises(MoerlError) as err:
        EnvironmentPool("needs_dep:Env", {}, 1, 30)
    assert "environment needs_dep:Env: cannot import needs_dep" in str(err.value)
    assert "no_such_dependency_xyz" in str(err.value) and "install the package" in str(err.value)


def test_a_module_that_raises_at_import_names_the_error(envs):
    (envs / "broken_env.py").write_text("raise RuntimeError('config file missing')\n")
    with pytest.raises(MoerlError) as err:
        EnvironmentPool("broken_env:Env", {}, 1, 30)
    assert "environment broken_env:Env: importing broken_env raised RuntimeError: config file missing; fix the" in (
        str(err.value)
    )


def test_a_missing_class_names_it(envs):
    with pytest.raises(MoerlError, match=f"environment {MODULE}:NoSuchEnv: {MODULE} has no class 'NoSuchEnv'"):
        EnvironmentPool(f"{MODULE}:NoSuchEnv", {}, 2, 30)


def test_a_pool_whose_spec_has_no_colon_is_an_error(envs):
    with pytest.raises(MoerlError, match="write package.module:Class"):
        EnvironmentPool(f"{MODULE}.EchoEnv", {}, 1, 30)


@pytest.mark.parametrize("spec", ["steps.demo.calculator.CalculatorEnv", ":CalculatorEnv", "steps.demo.calculator:"])
def test_resolve_needs_module_colon_class(spec):
    with pytest.raises(MoerlError, match=r"environment.class_path .*: write package.module:Class"):
        resolve(spec)


def test_resolve_finds_the_demo_calculator():
    from steps.demo.calculator import CalculatorEnv

    assert resolve("steps.demo.calculator:CalculatorEnv") is CalculatorEnv
