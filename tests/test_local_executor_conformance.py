"""Every example of Argo's reference selection (`examples/`, see tests/argo_reference.py) ends under
`moerl local` as it ends on Argo: the final phase, each node's type and phase, outputs and retry counts.

The expected outcome of each example is written below as data, derived from the example and Argo's
documented semantics. Examples that are random (coinflip, retry-backoff, retry-conditional,
scripts-python) are checked on the invariants that hold whichever way the dice fall. Commands that
sleep run with a `sleep` on PATH that sleeps a hundredth of the time and records when it ran, and
retry backoffs are scaled down by MOERL_LOCAL_TIME_SCALE; nothing else differs from a real run.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from argo_reference import reference_path

from pipelines.local import run_workflow
from pipelines.local.api.status import pod_name


@pytest.fixture
def fast_sleep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `sleep` that sleeps 1/100 of the time and logs its start and end times (for parallelism)."""
    real_sleep = shutil.which("sleep")
    assert real_sleep is not None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sleep.log"
    shim = bin_dir / "sleep"
    shim.write_text(
        "#!/bin/sh\n"
        f'echo "start $(date +%s.%N)" >> "{log}"\n'
        f'{real_sleep} "$(awk "BEGIN{{print $1*0.01}}")"\n'
        f'echo "end $(date +%s.%N)" >> "{log}"\n'
    )
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")
    return log


@dataclass
class Run:
    result: Any
    status: dict
    by_name: dict[str, dict]  # display name -> node (display names are unique in these examples)

    def stdout(self, display_name: str) -> str:
        node = self.by_name[display_name]
        name = pod_name(self.result.name, node["name"], node["templateName"])
        return (self.result.run_dir / "pods" / name / "stdout.log").read_text()

    def children(self, display_name: str) -> list[str]:
        ids = self.by_name[display_name].get("children", [])
        return sorted(self.status["nodes"][i]["displayName"] for i in ids)

    def attempts(self, display_name: str) -> list[dict]:
        return [self.status["nodes"][i] for i in self.by_name[display_name].get("children", [])]


def run_example(name: str, tmp_path: Path, **kwargs: Any) -> Run:
    manifest = reference_path("examples") / f"{name}.yaml"
    result = run_workflow(manifest, workdir=tmp_path / "work", view=None, status_out=tmp_path / "status.json", **kwargs)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status == result.status
    by_name: dict[str, dict] = {}
    for node in status["nodes"].values():
        assert node["displayName"] not in by_name, f"display name {node['displayName']} is not unique"
        by_name[node["displayName"]] = node
    return Run(result, status, by_name)


def outputs(node: dict) -> dict:
    return node.get("outputs") or {}


def param(node: dict, section: str, name: str) -> str:
    return next(p["value"] for p in node[section]["parameters"] if p["name"] == name)


@dataclass
class Expected:
    phase: str
    # display name ("ROOT" for the workflow's own node) -> (type, phase[, message])
    nodes: dict[str, tuple] = field(default_factory=dict)
    message: str | None = None
    stdout: dict[str, str] = field(default_factory=dict)  # display name -> exact stdout
    exact_nodes: bool = True  # no node beyond those listed
    check: Callable[[Run], None] | None = None


def check_coinflip(run: Run) -> None:
    flip = run.by_name["flip-coin"]
    side = outputs(flip)["result"]
    assert side in ("heads", "tails")
    other = "tails" if side == "heads" else "heads"
    assert (run.by_name[side]["type"], run.by_name[side]["phase"]) == ("Pod", "Succeeded")
    assert (run.by_name[other]["type"], run.by_name[other]["phase"]) == ("Skipped", "Skipped")
    assert run.by_name[other]["message"] == f"when '{side} == {other}' evaluated false"
    assert run.stdout(side) == f"it was {side}\n"


def check_dag_diamond(run: Run) -> None:
    assert run.children("ROOT") == ["A"]
    assert run.children("A") == ["B", "C"]
    assert run.children("B") == run.children("C") == ["D"]
    for task in "ABCD":
        assert param(run.by_name[task], "inputs", "message") == task
        assert run.stdout(task) == f"{task}\n"
    assert [run.status["nodes"][i]["displayName"] for i in run.by_name["ROOT"]["outboundNodes"]] == ["D"]


def check_dag_multiroot(run: Run) -> None:
    assert run.children("ROOT") == ["A", "B"]
    assert run.children("A") == ["C", "D"]
    assert run.children("B") == ["D"]


def check_exit_code_output_variable(run: Run) -> None:
    assert outputs(run.by_name["failing-container"])["exitCode"] == "123"
    assert param(run.by_name["echo-container"], "inputs", "exitCode") == "123"


def check_exit_handlers(run: Run) -> None:
    text = run.stdout("notify")
    assert text.startswith(f"send e-mail: {run.result.name} Failed ")
    failures = json.loads(text.split("Failed steps ", 1)[1])
    assert [(f["displayName"], f["phase"], f["message"], f["templateName"]) for f in failures] == [
        (run.result.name, "Failed", "main: Error (exit code 1)", "intentional-fail")
    ]
    assert run.by_name[f"{run.result.name}.onExit"]["nodeFlag"] == {"hooked": True}


def check_loops_param_result(run: Run) -> None:
    assert outputs(run.by_name["generate"])["result"] == json.dumps(list(range(20, 31)))
    for i, seconds in enumerate(range(20, 31)):
        node = run.by_name[f"sleep({i}:{seconds})"]
        assert param(node, "inputs", "seconds") == str(seconds)
        assert run.stdout(f"sleep({i}:{seconds})") == f"sleeping for {seconds} seconds\ndone\n"


LOOPS_SEQUENCE = {
    "sequence-count": [str(i) for i in range(5)],
    "sequence-start-end": [str(i) for i in range(100, 106)],
    "sequence-param": ["200", "201", "202"],
    "sequence-negative": [str(i) for i in range(5, -1, -1)],
    "sequence-format": [f"testuser{i:02X}" for i in range(5)],
}


def check_loops_sequence(run: Run) -> None:
    for step, items in LOOPS_SEQUENCE.items():
        for i, item in enumerate(items):
            assert run.stdout(f"{step}({i}:{item})") == f"{item}\n"


def check_output_parameter(run: Run) -> None:
    generated = run.by_name["generate-parameter"]
    assert param(generated, "outputs", "hello-param") == "hello world"
    assert param(run.by_name["consume-parameter"], "inputs", "message") == "hello world"


def check_retry_backoff(run: Run) -> None:
    attempts = run.attempts("ROOT")
    assert 1 <= len(attempts) <= 11  # limit 10: the first try and up to 10 retries
    assert [a["displayName"] for a in attempts] == [f"{run.result.name}({i})" for i in range(len(attempts))]
    for attempt in attempts[:-1]:
        assert (attempt["phase"], outputs(attempt)["exitCode"]) == ("Failed", "1")
    last = attempts[-1]
    if last["phase"] == "Succeeded":
        assert (run.status["phase"], run.by_name["ROOT"]["phase"]) == ("Succeeded", "Succeeded")
    else:  # 11 failures in a row: (2/3)^11, about 1%
        assert len(attempts) == 11 and run.by_name["ROOT"]["message"] == "No more retries left"
        assert run.status["phase"] == "Failed"


def check_retry_conditional(run: Run) -> None:
    assert outputs(run.by_name["safe-to-retry"])["result"] == "true"
    attempts = run.attempts("retry")
    retry = run.by_name["retry"]
    assert retry["type"] == "Retry" and retry["phase"] == "Failed"
    assert [a["displayName"] for a in attempts] == [f"retry({i})" for i in range(len(attempts))]
    # exit 2 satisfies the expression and is retried; exit 1 does not and ends the retries
    for attempt in attempts[:-1]:
        assert (attempt["phase"], outputs(attempt)["exitCode"]) == ("Failed", "2")
    if outputs(attempts[-1])["exitCode"] == "1":
        assert retry["message"] == "retryStrategy.expression evaluated to false"
    else:
        assert len(attempts) == 11 and retry["message"] == "No more retries left"
    assert run.status["message"] == f"child '{retry['id']}' failed"


def check_scripts_python(run: Run) -> None:
    number = outputs(run.by_name["generate"])["result"]
    assert 1 <= int(number) <= 100
    assert param(run.by_name["print"], "inputs", "message") == number
    assert run.stdout("print") == f"result was: {number}\n"


def check_parallelism_limit(run: Run, sleep_log: Path) -> None:
    events = sorted((float(t), kind) for kind, t in (line.split() for line in sleep_log.read_text().splitlines()))
    running = peak = 0
    for _, kind in events:
        running += 1 if kind == "start" else -1
        peak = max(peak, running)
    assert peak == 2  # spec.parallelism: 2


def check_steps(run: Run) -> None:
    assert run.children("ROOT") == ["[0]"]
    assert run.children("[0]") == ["hello1"]
    assert run.children("hello1") == ["[1]"]
    assert run.children("[1]") == ["hello2a", "hello2b"]


OK = "Succeeded"
EXAMPLE_OUTCOMES: dict[str, Expected] = {
    "arguments-parameters": Expected(OK, {"ROOT": ("Pod", OK)}, stdout={"ROOT": "hello world\n"}),
    "coinflip": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK), "flip-coin": ("Pod", OK), "[1]": ("StepGroup", OK),
    }, exact_nodes=False, check=check_coinflip),
    "dag-diamond": Expected(OK, {"ROOT": ("DAG", OK), **{t: ("Pod", OK) for t in "ABCD"}}, check=check_dag_diamond),
    "dag-multiroot": Expected(OK, {"ROOT": ("DAG", OK), **{t: ("Pod", OK) for t in "ABCD"}},
                              check=check_dag_multiroot),
    "exit-code-output-variable": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK),
        "failing-container": ("Pod", "Failed", "main: Error (exit code 123)"),
        "[1]": ("StepGroup", OK), "echo-container": ("Pod", OK),
    }, stdout={"echo-container": "Exit code was: 123\n"}, check=check_exit_code_output_variable),
    "exit-handlers": Expected("Failed", {
        "ROOT": ("Pod", "Failed", "main: Error (exit code 1)"), "ONEXIT": ("Steps", OK), "[0]": ("StepGroup", OK),
        "notify": ("Pod", OK), "celebrate": ("Skipped", "Skipped", "when 'Failed == Succeeded' evaluated false"),
        "cry": ("Pod", OK),
    }, message="main: Error (exit code 1)", stdout={"cry": "boohoo!\n", "ROOT": "intentional failure\n"},
        check=check_exit_handlers),
    "global-parameters": Expected(OK, {"ROOT": ("Pod", OK)}, stdout={"ROOT": "hello world\n"}),
    "hello-world": Expected(OK, {"ROOT": ("Pod", OK)}, stdout={"ROOT": "hello world\n"}),
    "loops-param-result": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK), "generate": ("Pod", OK), "[1]": ("StepGroup", OK),
        **{f"sleep({i}:{20 + i})": ("Pod", OK) for i in range(11)},
    }, check=check_loops_param_result),
    "loops-sequence": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK),
        **{f"{step}({i}:{item})": ("Pod", OK)
           for step, items in LOOPS_SEQUENCE.items() for i, item in enumerate(items)},
    }, check=check_loops_sequence),
    "loops": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK),
        "print-message-loop(0:hello world)": ("Pod", OK), "print-message-loop(1:goodbye world)": ("Pod", OK),
    }, stdout={"print-message-loop(0:hello world)": "hello world\n",
               "print-message-loop(1:goodbye world)": "goodbye world\n"}),
    "output-parameter": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK), "generate-parameter": ("Pod", OK),
        "[1]": ("StepGroup", OK), "consume-parameter": ("Pod", OK),
    }, stdout={"consume-parameter": "hello world\n"}, check=check_output_parameter),
    "parallelism-limit": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK),
        **{f"sleep({i}:{w})": ("Pod", OK) for i, w in enumerate(
            ["this", "workflow", "should", "take", "at", "least", "60", "seconds", "to", "complete"])},
    }),
    "retry-backoff": Expected("", {"ROOT": ("Retry", None)}, exact_nodes=False, check=check_retry_backoff),
    "retry-conditional": Expected("Failed", {
        "ROOT": ("Steps", "Failed"), "[0]": ("StepGroup", OK), "safe-to-retry": ("Pod", OK),
        "[1]": ("StepGroup", "Failed"), "retry": ("Retry", "Failed"),
    }, exact_nodes=False, check=check_retry_conditional),
    "scripts-python": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK), "generate": ("Pod", OK), "[1]": ("StepGroup", OK),
        "print": ("Pod", OK),
    }, check=check_scripts_python),
    "steps": Expected(OK, {
        "ROOT": ("Steps", OK), "[0]": ("StepGroup", OK), "hello1": ("Pod", OK), "[1]": ("StepGroup", OK),
        "hello2a": ("Pod", OK), "hello2b": ("Pod", OK),
    }, stdout={"hello1": "hello1\n", "hello2a": "hello2a\n", "hello2b": "hello2b\n"}, check=check_steps),
}  # fmt: skip


def test_every_example_has_an_expected_outcome():
    assert sorted(p.stem for p in reference_path("examples").glob("*.yaml")) == sorted(EXAMPLE_OUTCOMES)


@pytest.mark.parametrize("example", sorted(EXAMPLE_OUTCOMES))
def test_example_ends_as_on_argo(example: str, tmp_path: Path, fast_sleep: Path):
    expected = EXAMPLE_OUTCOMES[example]
    run = run_example(example, tmp_path)
    root_name = run.result.name
    # ROOT and ONEXIT stand for the workflow's own node and its exit handler, whose names are generated
    run.by_name["ROOT"] = run.by_name[root_name]
    if f"{root_name}.onExit" in run.by_name:
        run.by_name["ONEXIT"] = run.by_name[f"{root_name}.onExit"]
    if expected.phase:
        assert run.status["phase"] == expected.phase
    assert run.result.succeeded == (run.status["phase"] == "Succeeded")
    if expected.message is not None:
        assert run.status["message"] == expected.message
    for display_name, want in expected.nodes.items():
        node = run.by_name[display_name]
        assert node["type"] == want[0], display_name
        if want[1] is not None:
            assert node["phase"] == want[1], (display_name, node.get("message"))
        if len(want) > 2:
            assert node.get("message") == want[2], display_name
    if expected.exact_nodes:
        listed = {run.by_name[n]["id"] for n in expected.nodes}
        assert set(run.status["nodes"]) == listed
    for display_name, text in expected.stdout.items():
        assert run.stdout(display_name) == text, display_name
    if example == "parallelism-limit":
        check_parallelism_limit(run, fast_sleep)
    elif expected.check is not None:
        expected.check(run)
    for node in run.status["nodes"].values():  # every node is done, with Argo's timestamps
        assert node["phase"] in ("Succeeded", "Failed", "Error", "Skipped", "Omitted")
        assert node["startedAt"].endswith("Z") and node["finishedAt"] >= node["startedAt"]
    # Argo's progress (workflow/progress/updater.go): a pod is done once Succeeded; a Failed one stays 0/1
    pods = [n for n in run.status["nodes"].values() if n["type"] == "Pod"]
    done = sum(1 for n in pods if n["phase"] == "Succeeded")
    assert run.status["progress"] == f"{done}/{len(pods)}"


def test_parameters_given_with_p_override_the_manifests_arguments(tmp_path: Path):
    run = run_example("arguments-parameters", tmp_path, parameters={"message": "goodbye world"})
    assert run.stdout(run.result.name) == "goodbye world\n"
    assert param(run.by_name[run.result.name], "inputs", "message") == "goodbye world"
