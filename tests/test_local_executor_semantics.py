"""Argo semantics of `moerl local` beyond the examples: deadlines, parallelism, loops, DAG depends,
continueOn, exit hooks, outputs, path sandboxing, volumes, PyTorchJobs, and the command's exit code."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml
from argo_helpers import params, pod_dir, run, sh, stdout, step, workflow

from pipelines.local import run_workflow
from pipelines.local.cli import main as cli_main
from steps.errors import MoerlError, run_cli


@pytest.fixture(autouse=True)
def fast_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")  # backoffs and grace periods


ECHO = {
    "name": "echo",
    "inputs": {"parameters": [{"name": "m"}]},
    "container": {"image": "alpine", "command": ["echo", "{{inputs.parameters.m}}"]},
}


def test_workflow_deadline_fails_running_steps_and_spares_the_exit_handler(tmp_path):
    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [[{"name": "slow", "template": "slow"}], [{"name": "never", "template": "slow"}]],
            },
            sh("slow", "sleep 30"),
            sh("bye", "echo bye {{workflow.status}}"),
        ],
        activeDeadlineSeconds=1,
        onExit="bye",
    )
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Failed"
    assert (nodes["slow"]["phase"], nodes["slow"]["message"]) == ("Failed", "Step exceeded its deadline")
    assert "never" not in nodes
    assert result.message == f"child '{nodes['slow']['id']}' failed"
    assert nodes[f"{result.name}.onExit"]["phase"] == "Succeeded"
    assert stdout(result, nodes[f"{result.name}.onExit"]) == "bye Failed\n"


def test_template_deadline_stops_the_pod_gracefully_then_by_force(tmp_path):
    manifest = workflow(
        [
            {"name": "main", "steps": [[step("polite", "polite"), step("stubborn", "stubborn")]]},
            sh("polite", "trap 'echo got TERM; exit 0' TERM; sleep 30 & wait", activeDeadlineSeconds=1),
            sh(
                "stubborn",
                "trap '' TERM; sleep 30",
                activeDeadlineSeconds=1,
                podSpecPatch="terminationGracePeriodSeconds: 1",
            ),
        ]
    )
    result, nodes = run(manifest, tmp_path)
    message = "Pod was active on the node longer than the specified deadline"
    assert result.phase == "Failed"
    assert (nodes["polite"]["phase"], nodes["polite"]["message"]) == ("Failed", message)
    assert stdout(result, nodes["polite"]) == "got TERM\n"
    assert (nodes["stubborn"]["phase"], nodes["stubborn"]["outputs"]["exitCode"]) == ("Failed", "137")  # SIGKILL


def test_template_parallelism_runs_one_child_at_a_time(tmp_path):
    manifest = workflow(
        [
            {"name": "main", "parallelism": 1, "steps": [[step("s", "span", withSequence={"count": "3"})]]},
            sh("span", "date +%s.%N; sleep 0.3; date +%s.%N"),
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded
    spans = sorted(tuple(map(float, stdout(result, nodes[f"s({i}:{i})"]).split())) for i in range(3))
    assert all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:], strict=False))


def test_loops_over_maps_and_json_objects_with_aggregated_outputs(tmp_path):
    source = "import json; print(json.dumps([{'n': 1, 'w': 'a'}, {'n': 2, 'w': 'b'}]))"
    gen = {"name": "gen", "script": {"image": "python", "command": ["python"], "source": source}}
    square = {
        "name": "square",
        "inputs": {"parameters": [{"name": "n"}]},
        "script": {"image": "python", "command": ["python"], "source": "print({{inputs.parameters.n}} ** 2)"},
        "outputs": {"parameters": [{"name": "sq", "valueFrom": {"path": "/tmp/sq"}}]},
    }
    square["script"]["source"] = "open('/tmp/sq', 'w').write(str({{inputs.parameters.n}} ** 2))"
    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [
                    [{"name": "gen", "template": "gen"}],
                    [
                        {
                            "name": "sq",
                            "template": "square",
                            "withParam": "{{steps.gen.outputs.result}}",
                            "arguments": {"parameters": [{"name": "n", "value": "{{item.n}}"}]},
                        },
                        {
                            "name": "map",
                            "template": "echo",
                            "withItems": [{"k": "x", "v": 1}],
                            "arguments": {"parameters": [{"name": "m", "value": "{{item.k}}={{item.v}}"}]},
                        },
                    ],
                    [
                        {
                            "name": "sum",
                            "template": "echo",
                            "arguments": {"parameters": [{"name": "m", "value": "{{steps.sq.outputs.parameters.sq}}"}]},
                        }
                    ],
                ],
            },
            gen,
            square,
            ECHO,
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded
    assert {"sq(0:n:1,w:a)", "sq(1:n:2,w:b)", "map(0:k:x,v:1)"} <= set(nodes)
    assert stdout(result, nodes["map(0:k:x,v:1)"]) == "x=1\n"
    assert stdout(result, nodes["sum"]) == '["1","4"]\n'


def test_dag_depends_runs_failure_branches_and_omits_the_rest(tmp_path):
    manifest = workflow(
        [
            {
                "name": "main",
                "dag": {
                    "tasks": [
                        {"name": "A", "template": "ok"},
                        {"name": "B", "template": "fail", "depends": "A"},
                        {"name": "on-failure", "template": "ok", "depends": "B.Failed"},
                        {"name": "on-success", "template": "ok", "depends": "B"},
                        {"name": "after", "template": "ok", "depends": "on-failure || on-success"},
                        {"name": "not-skipped", "template": "ok", "depends": "!on-success.Skipped && after"},
                    ]
                },
            },
            sh("ok", "true"),
            sh("fail", "exit 3"),
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded  # the failure is handled by the branch that depends on it
    assert nodes["B"]["phase"] == "Failed" and nodes["on-failure"]["phase"] == "Succeeded"
    assert (nodes["on-success"]["type"], nodes["on-success"]["phase"]) == ("Skipped", "Omitted")
    assert nodes["on-success"]["message"] == "omitted: depends condition not met"
    assert nodes["after"]["phase"] == nodes["not-skipped"]["phase"] == "Succeeded"


def test_a_failed_leaf_fails_the_dag_unless_it_continues_on_failure(tmp_path):
    failing = workflow([{"name": "main", "dag": {"tasks": [{"name": "A", "template": "fail"}]}}, sh("fail", "exit 1")])
    result, nodes = run(failing, tmp_path / "a")
    assert (result.phase, nodes["A"]["phase"]) == ("Failed", "Failed")
    continuing = workflow(
        [
            {
                "name": "main",
                "dag": {
                    "tasks": [
                        {"name": "A", "template": "fail", "continueOn": {"failed": True}},
                        {"name": "B", "template": "fail", "dependencies": ["A"], "continueOn": {"failed": True}},
                    ]
                },
            },
            sh("fail", "exit 1"),
        ]
    )
    result, nodes = run(continuing, tmp_path / "b")
    assert result.succeeded and nodes["B"]["phase"] == "Failed"


def test_step_exit_hooks_see_the_steps_outputs(tmp_path):
    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [
                    [
                        step(
                            "work",
                            "work",
                            hooks={
                                "exit": {
                                    "template": "echo",
                                    "arguments": params(m="{{steps.work.status}}:{{steps.work.outputs.parameters.p}}"),
                                }
                            },
                        ),
                        step("other", "fail", onExit="cleanup", continueOn={"failed": True}),
                    ]
                ],
            },
            sh("work", "echo -n 42 > /tmp/p", outputs={"parameters": [{"name": "p", "valueFrom": {"path": "/tmp/p"}}]}),
            sh("fail", "exit 1"),
            sh("cleanup", "echo cleaned"),
            ECHO,
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded
    assert stdout(result, nodes["work.onExit"]) == "Succeeded:42\n"
    assert nodes["work.onExit"]["nodeFlag"] == {"hooked": True}
    assert stdout(result, nodes["other.onExit"]) == "cleaned\n"
    assert nodes["work.onExit"]["id"] in nodes["work"]["children"]


def test_pods_writing_the_same_container_path_each_get_their_own(tmp_path):
    writer = sh(
        "writer",
        "echo -n {{inputs.parameters.v}} > /tmp/out.txt; cat /tmp/out.txt",
        inputs={"parameters": [{"name": "v"}]},
        outputs={"parameters": [{"name": "v", "valueFrom": {"path": "/tmp/out.txt"}}]},
    )
    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [
                    [
                        {
                            "name": "w",
                            "template": "writer",
                            "withItems": ["a", "b", "c"],
                            "arguments": {"parameters": [{"name": "v", "value": "{{item}}"}]},
                        }
                    ]
                ],
            },
            writer,
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded
    for i, value in enumerate("abc"):
        node = nodes[f"w({i}:{value})"]
        assert node["outputs"]["parameters"][0]["value"] == value
        assert stdout(result, node) == value
        assert (pod_dir(result, node) / "root" / "tmp" / "out.txt").read_text() == value  # the pod's own /tmp


def test_a_claimed_volume_is_shared_and_an_empty_dir_is_not(tmp_path):
    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [[{"name": "write", "template": "write"}], [{"name": "read", "template": "read"}]],
            },
            sh(
                "write",
                "echo shared > /data/f; echo own > /scratch/f",
                {"work": "/data", "tmp": "/scratch"},
                volumes=[{"name": "tmp", "emptyDir": {}}],
            ),
            sh(
                "read",
                "cat /data/f; ls /scratch",
                {"work": "/data", "tmp": "/scratch"},
                volumes=[{"name": "tmp", "emptyDir": {}}],
            ),
        ],
        volumeClaimTemplates=[{"metadata": {"name": "work"}, "spec": {"accessModes": ["ReadWriteOnce"]}}],
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded
    assert stdout(result, nodes["read"]) == "shared\n"


def test_output_parameters_default_or_error_when_the_file_is_missing(tmp_path):
    def maker(name: str, source: dict) -> dict:
        return sh(name, "true", outputs={"parameters": [{"name": "p", "valueFrom": {"path": "/tmp/none", **source}}]})

    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [
                    [
                        {"name": "with-default", "template": "d", "continueOn": {"error": True}},
                        {"name": "without", "template": "n", "continueOn": {"error": True}},
                    ]
                ],
            },
            maker("d", {"default": "fallback"}),
            maker("n", {}),
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded
    assert nodes["with-default"]["outputs"]["parameters"][0]["value"] == "fallback"
    assert (nodes["without"]["phase"], nodes["without"]["message"]) == (
        "Error",
        "wait: Error (exit code 1): open /tmp/none: no such file or directory",
    )


def test_variables_and_expressions_reach_the_command(tmp_path):
    manifest = workflow(
        [
            {
                "name": "main",
                "inputs": {"parameters": [{"name": "n", "value": "3"}]},
                "container": {
                    "image": "a",
                    "command": [
                        "echo",
                        "{{workflow.name}}",
                        "{{pod.name}}",
                        "{{=asInt(inputs.parameters.n) * 7}}",
                        "{{workflow.parameters.who}}",
                        "{{=sprig.upper(workflow.parameters.who)}}",
                    ],
                },
            },
        ],
        arguments={"parameters": [{"name": "who", "value": "ada"}]},
    )
    result, nodes = run(manifest, tmp_path)
    assert stdout(result, nodes[result.name]) == f"{result.name} {result.name} 21 ada ADA\n"


def test_a_missing_program_fails_like_a_container_that_cannot_start(tmp_path):
    manifest = workflow([{"name": "main", "container": {"image": "a", "command": ["no-such-program-xyz"]}}])
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Failed"
    assert nodes[result.name]["message"].startswith('main: StartError (exit code 128): exec: "no-such-program-xyz"')


def test_an_invalid_when_errors_its_step_group(tmp_path):
    manifest = workflow(
        [{"name": "main", "steps": [[{"name": "a", "template": "ok", "when": "hello world == x"}]]}, sh("ok", "true")]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Failed"
    assert nodes["[0]"]["phase"] == "Error"
    assert "Invalid 'when' expression 'hello world == x'" in nodes["[0]"]["message"]


def test_global_outputs_and_suspend(tmp_path):
    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [[{"name": "wait", "template": "pause"}], [{"name": "emit", "template": "emit"}]],
            },
            {"name": "pause", "suspend": {"duration": "2"}},
            sh(
                "emit",
                "echo -n v1 > /tmp/version",
                outputs={
                    "parameters": [{"name": "version", "globalName": "version", "valueFrom": {"path": "/tmp/version"}}]
                },
            ),
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.succeeded
    assert (nodes["wait"]["type"], nodes["wait"]["phase"]) == ("Suspend", "Succeeded")
    assert result.status["outputs"] == {"parameters": [{"name": "version", "value": "v1"}]}


def two_rank_job(tmp_path: Path) -> dict:
    """A PyTorchJob of a Master and a Worker whose ranks print RANK WORLD_SIZE and exit FAIL."""
    script = tmp_path / "train.py"
    script.write_text(
        # One write per rank: both ranks share the pod's log, and with PYTHONUNBUFFERED set (as on CI) a
        # print's pieces are separate writes that interleave.
        "import os\nos.write(1, f\"{os.environ['RANK']} {os.environ['WORLD_SIZE']}\\n\".encode())\n"
        "raise SystemExit(int(os.environ['FAIL']))\n"
    )
    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"generateName": "train-"},
        "spec": {
            "pytorchReplicaSpecs": {
                role: {
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "pytorch",
                                    "image": "trainer",
                                    "command": ["python", str(script)],
                                    "env": [{"name": "FAIL", "value": "{{inputs.parameters.fail}}"}],
                                }
                            ]
                        }
                    },
                }
                for role in ("Master", "Worker")
            }
        },
    }
    return job


def test_a_pytorchjob_runs_as_torchrun_and_its_conditions_decide(tmp_path):
    job = two_rank_job(tmp_path)
    manifest = workflow(
        [
            {
                "name": "main",
                "steps": [
                    [step("ok", "train", arguments=params(fail="0")), step("bad", "train", arguments=params(fail="1"))]
                ],
            },
            {
                "name": "train",
                "inputs": {"parameters": [{"name": "fail"}]},
                "resource": {
                    "action": "create",
                    "manifest": yaml.safe_dump(job),
                    "successCondition": "status.replicaStatuses.Master.succeeded > 0",
                    "failureCondition": "status.replicaStatuses.Master.failed > 0",
                },
            },
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert nodes["ok"]["phase"] == "Succeeded"
    assert sorted(stdout(result, nodes["ok"]).split("\n")) == ["", "0 2", "1 2"]  # two ranks, world size 2
    assert nodes["bad"]["phase"] == "Failed"
    assert nodes["bad"]["message"] == (
        "main: Error (exit code 1): failure condition 'status.replicaStatuses.Master.failed>0' evaluated true"
    )
    job_status = json.loads((pod_dir(result, nodes["ok"]) / "pytorchjob.json").read_text())["status"]
    assert job_status["replicaStatuses"] == {"Master": {"succeeded": 1}, "Worker": {"succeeded": 1}}


def test_a_launcher_pod_runs_its_pytorchjob_and_ends_as_the_launcher_would(tmp_path):
    """A container that runs steps.pytorchjob_launcher (the daemon of a multi-node trainer that stays up): no
    Kubernetes API here, so the pod is its job's torchrun, and it exits 0 iff the job succeeded."""
    job = two_rank_job(tmp_path)
    launcher = {
        "name": "launch",
        "inputs": {"parameters": [{"name": "fail"}]},
        "container": {
            "image": "control",
            "command": ["python", "-m", "steps.pytorchjob_launcher"],
            "args": ["--manifest-json", json.dumps(job), "--namespace", "moerl", "--deadline-seconds", "0"],
        },
    }
    main = {"name": "main", "steps": [[step("ok", "launch", arguments=params(fail="0")),
                                       step("bad", "launch", arguments=params(fail="1"))]]}  # fmt: skip
    result, nodes = run(workflow([main, launcher]), tmp_path)
    assert nodes["ok"]["phase"] == "Succeeded"
    assert sorted(stdout(result, nodes["ok"]).split("\n")) == ["", "0 2", "1 2"]
    assert (nodes["bad"]["phase"], nodes["bad"]["message"]) == ("Failed", "main: Error (exit code 1)")
    job_status = json.loads((pod_dir(result, nodes["bad"]) / "pytorchjob.json").read_text())["status"]
    assert job_status["conditions"][-1]["type"] == "Failed"


def test_moerl_local_exits_0_iff_the_workflow_succeeded(tmp_path, capsys):
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump(workflow([sh("main", "true")])))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(workflow([sh("main", "echo boom >&2; exit 7")])))

    def args(path: Path, *extra: str) -> argparse.Namespace:
        return argparse.Namespace(
            manifest=path,
            parameter=list(extra),
            chaos=None,
            status_out=tmp_path / "s.json",
            workdir=tmp_path / "w",
            cold_start=False,
            entrypoint=[],
            configmap=[],
        )

    assert cli_main(args(ok)) == 0
    assert cli_main(args(bad)) == 1
    out = capsys.readouterr().out
    assert "Failed" in out and "boom" in out and "main: Error (exit code 7)" in out  # the failed step's last lines
    assert json.loads((tmp_path / "s.json").read_text())["phase"] == "Failed"
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: cli_main(args(ok, "nonsense")))
    assert exit_.value.code == 2
    with pytest.raises(MoerlError, match="expected NAME=VALUE"):
        cli_main(args(ok, "nonsense"))


def test_sandbox_rewrites_container_paths_and_leaves_host_paths(tmp_path):
    from pipelines.local.pods.sandbox import Sandbox

    root = tmp_path / "root"
    box = Sandbox(root, {"/data": tmp_path / "vol"}, ["/tmp/plan/latest", "/tmp/out.txt", "/outputs/m.json"])
    text = (
        "--out /tmp/plan --latest /tmp/plan/latest --file=/tmp/out.txt --m /outputs/m.json "
        "--data /data/x --run /tmp/runs/demo --store file:///tmp/plan --other /tmp/out.txt2 /tmp/planner"
    )
    assert box.rewrite(text).split() == [
        "--out",
        f"{root}/tmp/plan",
        "--latest",
        f"{root}/tmp/plan/latest",
        f"--file={root}/tmp/out.txt",
        "--m",
        f"{root}/outputs/m.json",
        "--data",
        f"{tmp_path}/vol/x",
        "--run",
        "/tmp/runs/demo",  # a host path: /tmp itself is not the pod's
        "--store",
        "file:///tmp/plan",
        "--other",
        "/tmp/out.txt2",
        "/tmp/planner",
    ]
    assert box.host_path("/data/sub/f") == tmp_path / "vol" / "sub" / "f"


def test_plain_log_lines_and_the_live_tree(tmp_path):
    import io
    import re

    from rich.console import Console

    from pipelines.local.view import LiveView, PlainView

    manifest = workflow([
        {"name": "main", "steps": [[step("good", "ok"), step("bad", "fail", continueOn={"failed": True})]]},
        sh("ok", "true"), sh("fail", "echo oops >&2; exit 4"),
    ])  # fmt: skip
    plain = io.StringIO()
    result = run_workflow(manifest, workdir=tmp_path / "a", view=PlainView(plain))
    lines = plain.getvalue().splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d good Running", lines[0]) or re.fullmatch(
        r"\d\d:\d\d:\d\d bad Running", lines[0]
    )
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d good Succeeded \d+\.\ds", line) for line in lines)
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d bad Failed \d+\.\ds: main: Error \(exit code 4\)", line) for line in lines)
    assert f"Workflow {result.name} Succeeded" in plain.getvalue() and "    oops" in plain.getvalue()

    screen = io.StringIO()
    result = run_workflow(manifest, workdir=tmp_path / "b", view=LiveView(Console(file=screen, width=120)))
    text = screen.getvalue()
    # the failed pod (continueOn) is not done: Argo's progress counts it 0/1 (workflow/progress/updater.go)
    assert f"{result.name} Succeeded" in text and "1/2 pods" in text
    assert "✔ good" in text and "✖ bad" in text and "main: Error (exit code 4)" in text


# A process that leaves its pod's process group and session (as torchrun's workers do) and records its pid.
ESCAPE = (
    "python3 -c 'import subprocess, sys; "
    'p = subprocess.Popen(["sleep", "300"], start_new_session=True); '
    'open(sys.argv[1], "w").write(str(p.pid))\' {where}; {then}'
)


def _ends(pid: int) -> bool:
    """Whether process pid ends (or is a zombie) within 60 s: a SIGKILL is delivered asynchronously."""
    import time

    for _ in range(600):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("end", ["exits", "is killed at its deadline"])
def test_a_pods_end_ends_every_process_of_its_container_in_a_session_of_its_own_too(tmp_path, end):
    """A container's processes end with it (the kubelet kills its cgroup), also those in a session of their
    own, such as torchrun's workers, and those whose parent ended first."""
    where = tmp_path / "escaped.pid"
    then = "exit 0" if end == "exits" else "sleep 30"
    deadline = {} if end == "exits" else {"activeDeadlineSeconds": 1}
    manifest = workflow(
        [
            {"name": "main", "steps": [[step("leaky", "leaky")]]},
            sh("leaky", ESCAPE.format(where=where, then=then), **deadline),
        ]  # fmt: skip
    )
    result, nodes = run(manifest, tmp_path)
    assert nodes["leaky"]["phase"] == ("Succeeded" if end == "exits" else "Failed")
    assert _ends(int(where.read_text()))
