"""`moerl local` held to Argo's own test suite (argoproj/argo-workflows v4.1.2: examples/ and the workflows
test/e2e/*_test.go submits). Each test names the upstream workflow that showed the rule and the Argo source
that defines it. Each test writes the smallest workflow that reproduces the rule (no upstream file is copied
here); tests/test_local_executor_conformance.py runs Argo's own examples where tests/argo_reference.py finds them."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from argo_helpers import pod_dir, sh, stdout, workflow
from argo_helpers import run as run_in

from pipelines.local.api.manifest import load_workflow, parse_entrypoint
from pipelines.local.cli import main as cli_main
from pipelines.local.controller.sync import LockManager
from steps.errors import MoerlError

# argoproj/argosay's ENTRYPOINT is `/argosay`: `argosay echo X` prints X, `argosay sleep 30s` sleeps.
ARGOSAY = 'sh -c \'case $0 in echo) echo "$@";; sleep) sleep "${1%s}";; exit) exit "$1";; esac\''


@pytest.fixture(autouse=True)
def fast_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")  # backoffs and grace periods


def run(manifest: dict | Path, tmp_path: Path, **kwargs):
    return run_in(manifest, tmp_path / "runs", **kwargs)  # tmp_path itself holds the tests' own files


def output(node: dict, name: str) -> str:
    return next(p["value"] for p in node["outputs"]["parameters"] if p["name"] == name)


def argosay() -> dict[str, list[str]]:
    return dict(
        [parse_entrypoint(f"argoproj/argosay:v2={ARGOSAY}"), parse_entrypoint(f"argoproj/argosay:v1={ARGOSAY}")]
    )


# ----------------------------------------------------------------------------- scripts


def test_a_script_is_staged_executable_so_sh_c_runs_it(tmp_path):
    """examples/scripts-bash.yaml and test/e2e/functional/retry-script.yaml run `command: [sh, -c]` with the
    script's path as the argument, which sh execs: Argo stages the file 0755 (workflow/executor/executor.go
    StageFiles), so it runs instead of exiting 126."""
    manifest = workflow(
        [
            {"name": "main", "steps": [[{"name": "generate", "template": "gen"}]]},
            {"name": "gen", "script": {"image": "alpine", "command": ["sh", "-c"], "source": "echo 42\n"}},
        ]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Succeeded", nodes["generate"].get("message")
    assert stdout(result, nodes["generate"]) == "42\n"
    assert (pod_dir(result, nodes["generate"]) / "script").stat().st_mode & 0o777 == 0o755


def test_an_empty_script_source_gets_no_script_path(tmp_path):
    """test/e2e/functional/loops-empty-param.yaml's gen-number-list is a script with no source: Argo appends the
    script's path to the args only for a non-empty source (workflow/controller/operator.go executeScript)."""
    manifest = workflow([{"name": "main", "script": {"image": "alpine", "command": ["echo"], "args": ["[]"]}}])
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Succeeded"
    assert stdout(result, nodes[result.name]) == "[]\n"


# ----------------------------------------------------------------------------- loops


def empty_param_workflow(kind: str, generated: str) -> dict:
    """The shape of test/e2e/functional/loops-empty-param.yaml (steps) and dag-empty-param.yaml (DAG)."""
    gen = {"name": "gen-number-list", "script": {"image": "argoproj/argosay:v2", "args": ["echo", generated]}}
    sleep = {
        "name": "sleep-n-sec",
        "inputs": {"parameters": [{"name": "seconds"}]},
        "container": {
            "image": "argoproj/argosay:v1",
            "command": ["sh", "-c"],
            "args": ["echo sleeping for {{inputs.parameters.seconds}} seconds; echo done"],
        },
    }
    call = {
        "name": "sleep",
        "template": "sleep-n-sec",
        "arguments": {"parameters": [{"name": "seconds", "value": "{{item}}"}]},
    }
    if kind == "steps":
        call["withParam"] = "{{steps.generate.outputs.result}}"
        main = {"name": "main", "steps": [[{"name": "generate", "template": "gen-number-list"}], [call]]}
    else:
        call.update(withParam="{{tasks.generate.outputs.result}}", dependencies=["generate"])
        main = {"name": "main", "dag": {"tasks": [{"name": "generate", "template": "gen-number-list"}, call]}}
    return workflow([main, gen, sleep])


@pytest.mark.parametrize(("kind", "node_count"), [("steps", 5), ("dag", 3)])
def test_an_empty_with_param_skips_the_step(tmp_path, kind, node_count):
    """TestLoopEmptyParam / TestDAGEmptyParam (test/e2e/functional_test.go): `[]` gives a Skipped node
    "Skipped, empty params" and the workflow Succeeds (workflow/controller/steps.go expandStepGroup,
    dag.go). The generator runs argosay without a command, through --entrypoint."""
    result, nodes = run(empty_param_workflow(kind, "[]"), tmp_path, entrypoints=argosay())
    assert result.phase == "Succeeded"
    assert len(result.status["nodes"]) == node_count
    assert (nodes["sleep"]["phase"], nodes["sleep"]["message"]) == ("Skipped", "Skipped, empty params")


@pytest.mark.parametrize("kind", ["steps", "dag"])
def test_a_with_param_that_is_not_a_json_list_errors_and_does_not_hang(tmp_path, kind):
    """Argo: "withParam value could not be parsed as a JSON list" (workflow/controller/steps.go expandStep,
    dag.go expandTask); the step does not run with `{{item}}` left in it, and a DAG ends."""
    result, nodes = run(empty_param_workflow(kind, "not-json"), tmp_path, entrypoints=argosay())
    assert result.phase in ("Failed", "Error")
    erred = nodes["sleep"] if kind == "dag" else nodes["[1]"]
    assert erred["phase"] == "Error"
    assert erred["message"].startswith("withParam value could not be parsed as a JSON list: not-json")
    assert not any(
        n.get("templateName") == "sleep-n-sec" and n["type"] == "Pod" for n in result.status["nodes"].values()
    )


# ----------------------------------------------------------------------------- timeouts and retries


def test_template_timeout_stops_the_pod_like_its_active_deadline(tmp_path):
    """TestTemplateLevelTimeout (test/e2e/functional_test.go), examples/step-level-timeout.yaml and
    dag-task-level-timeout.yaml: `timeout: "{{inputs.parameters.x}}"` becomes the pod's activeDeadlineSeconds,
    counted from the node's start (workflow/controller/operator.go checkTemplateTimeouts, workflowpod.go)."""
    sleep = {
        "name": "sleep",
        "timeout": "{{inputs.parameters.timeout}}",
        "inputs": {"parameters": [{"name": "timeout"}, {"name": "seconds"}]},
        "container": {"image": "alpine", "command": ["sleep", "{{inputs.parameters.seconds}}"]},
    }

    def task(name: str, timeout: str, seconds: str, **fields) -> dict:
        arguments = {"parameters": [{"name": "timeout", "value": timeout}, {"name": "seconds", "value": seconds}]}
        return {"name": name, "template": "sleep", "arguments": arguments, **fields}

    dag = {"name": "main", "dag": {"tasks": [task("A", "60s", "0"), task("B", "1s", "60", depends="A")]}}
    result, nodes = run(workflow([dag, sleep]), tmp_path)
    assert result.phase == "Failed"
    assert nodes["A"]["phase"] == "Succeeded"
    assert (nodes["B"]["phase"], nodes["B"]["message"]) == (
        "Failed",
        "Pod was active on the node longer than the specified deadline",
    )


def test_an_empty_retry_strategy_retries_until_success(tmp_path):
    """`retryStrategy: {}` retries without limit (docs/retries.md; workflow/controller/operator.go makes a
    Retry node for any non-nil strategy, retryStrategy() returns it, and processNodeRetries has no limit)."""
    counter = tmp_path / "attempts"
    flaky = sh("flaky", f"echo x >> {counter}; [ $(wc -l < {counter}) -ge 3 ]", retryStrategy={})
    result, nodes = run(workflow([flaky], entrypoint="flaky"), tmp_path)
    assert result.phase == "Succeeded"
    assert nodes[result.name]["type"] == "Retry"
    attempts = [n for n in result.status["nodes"].values() if n["type"] == "Pod"]
    assert [n["phase"] for n in sorted(attempts, key=lambda n: n["name"])] == ["Failed", "Failed", "Succeeded"]


# ----------------------------------------------------------------------------- scopes


def test_output_expressions_of_steps_templates_see_their_inputs(tmp_path):
    """examples/fibonacci-seq-conditional-param.yaml: a steps template's output expression reads
    `inputs.parameters.num` (workflow/controller/scope.go createScope puts the inputs in the scope that
    getTemplateOutputsFromScope resolves against)."""
    fib = {
        "name": "fibonacci",
        "inputs": {"parameters": [{"name": "num"}]},
        "steps": [[{"name": "helper", "template": "echo", "when": "{{inputs.parameters.num}} != 1"}]],
        "outputs": {
            "parameters": [
                {
                    "name": "fib",
                    "valueFrom": {
                        "expression": "asInt(inputs.parameters.num) == 1 ? 1 : steps['helper'].outputs.result"
                    },
                }
            ]
        },
    }
    main = {
        "name": "main",
        "steps": [
            [
                {"name": "one", "template": "fibonacci", "arguments": {"parameters": [{"name": "num", "value": "1"}]}},
                {"name": "two", "template": "fibonacci", "arguments": {"parameters": [{"name": "num", "value": "2"}]}},
            ]
        ],
    }
    echo = sh("echo", "echo 7")
    result, nodes = run(workflow([main, fib, echo]), tmp_path)
    assert result.phase == "Succeeded", result.message
    assert output(nodes["one"], "fib") == "1"
    assert output(nodes["two"], "fib") == "7"


def test_workflow_metadata_labels_are_workflow_labels(tmp_path):
    """{{workflow.labels.NAME}} of spec.workflowMetadata.labels and labelsFrom (examples/label-value-from-
    workflow.yaml; workflow/controller/operator.go updateWorkflowMetadata)."""
    manifest = workflow(
        [sh("main", "echo {{workflow.labels.team}} {{workflow.labels.foo}}")],
        arguments={"parameters": [{"name": "foo", "value": "bar"}]},
        workflowMetadata={"labels": {"team": "rl"}, "labelsFrom": {"foo": {"expression": "workflow.parameters.foo"}}},
    )
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Succeeded"
    assert stdout(result, nodes[result.name]) == "rl bar\n"


def test_null_arguments_parameters_are_no_parameters(tmp_path):
    """`arguments: {parameters: null}` (YAML `parameters:` with nothing after it) decodes to no parameters
    in Argo (Go's nil slice); it used to raise TypeError (pipelines/local/api/manifest.py)."""
    result, _ = run(workflow([sh("main", "true")], arguments={"parameters": None}), tmp_path)
    assert result.phase == "Succeeded"


def test_a_literal_output_value_and_an_image_from_template_defaults(tmp_path):
    """An output parameter with a literal `value` (workflow/validate/validate.go validateOutputParameter
    accepts value or valueFrom), and a template whose image and command come from spec.templateDefaults
    (test/e2e/functional/template-default-image.yaml; operator.go mergedTemplateDefaultsInto)."""
    main = {
        "name": "main",
        "steps": [[{"name": "c", "template": "c"}]],
        "outputs": {"parameters": [{"name": "fixed", "value": "v"}]},
    }
    c = {
        "name": "c",
        "container": {"args": ["echo from-defaults"]},
        "outputs": {"parameters": [{"name": "p", "value": "q"}]},
    }
    manifest = workflow([main, c], templateDefaults={"container": {"image": "alpine", "command": ["sh", "-c"]}})
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Succeeded", result.message
    assert stdout(result, nodes["c"]) == "from-defaults\n"
    assert output(nodes["c"], "p") == "q" and output(nodes[result.name], "fixed") == "v"


# ----------------------------------------------------------------------------- progress


def test_progress_counts_failed_pods_as_not_done_and_reads_argo_progress_file(tmp_path):
    """Argo's progress (workflow/progress/updater.go UpdateProgress): a pod is 0/1 until Succeeded (a Failed
    one stays 0/1), or what it wrote to $ARGO_PROGRESS_FILE (workflow/executor/executor.go monitorProgress)."""
    main = {
        "name": "main",
        "steps": [
            [
                {"name": "bad", "template": "bad", "continueOn": {"failed": True}},
                {"name": "partial", "template": "partial", "continueOn": {"failed": True}},
                {"name": "good", "template": "good"},
            ]
        ],
    }
    templates = [
        main,
        sh("bad", "exit 1"),
        sh("partial", 'echo 3/10 > "$ARGO_PROGRESS_FILE"; exit 1'),
        sh("good", "true"),
    ]
    result, nodes = run(workflow(templates), tmp_path)
    assert result.phase == "Succeeded"
    assert nodes["bad"]["progress"] == "0/1"
    assert nodes["partial"]["progress"] == "3/10"
    assert nodes["good"]["progress"] == "1/1"
    assert result.status["progress"] == "4/12"


# ----------------------------------------------------------------------------- crashes and leaks


def test_pods_whose_descriptors_are_numbered_over_1024_are_waited_for(tmp_path):
    """Over ~1,000 concurrent pods the pidfds are numbered 1024 and up, which select() cannot take
    ("ValueError: filedescriptor out of range in select()"); the executor polls them instead."""
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        result, _ = run(workflow([sh("main", "sleep 0.2")]), tmp_path, warm_start=False)
    finally:
        for fd in held:
            os.close(fd)
    assert result.phase == "Succeeded"


def test_sigterm_to_moerl_local_stops_every_pod(tmp_path):
    """SIGTERM to `moerl local` while pods run stops their process groups before it exits (143), as Ctrl-C
    does; it used to leave the pods running."""
    pids = tmp_path / "pids"
    pids.mkdir()
    manifest = workflow(
        [
            {"name": "main", "steps": [[{"name": f"s{i}", "template": "sleeper"} for i in range(3)]]},
            sh("sleeper", f"echo $$ > {pids}/$$; sleep 600"),
        ]
    )
    path = tmp_path / "wf.yaml"
    path.write_text(yaml.safe_dump(manifest))
    code = "import sys; from pipelines.cli import main; sys.exit(main())"
    process = subprocess.Popen(
        [sys.executable, "-c", code, "local", str(path), "--workdir", str(tmp_path / "w"), "--cold-start"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len(list(pids.iterdir())) < 3 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    started = [int(p.name) for p in pids.iterdir()]
    assert len(started) == 3
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 143
    for pid in started:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ----------------------------------------------------------------------------- containers without a command


def test_a_container_without_command_is_refused_with_the_fix_named(tmp_path):
    """204 of Argo's 600 workflow files run the image's ENTRYPOINT (no `command`), e.g. examples/dag-daemon-
    task.yaml's influxdb; which program that is only the image knows. Refused before anything runs, naming
    both fixes."""
    manifest = workflow([{"name": "main", "container": {"image": "argoproj/argosay:v2", "args": ["echo", "hi"]}}])
    with pytest.raises(MoerlError) as err:
        load_workflow(manifest)
    assert "container without command" in str(err.value)
    assert "--entrypoint 'argoproj/argosay:v2=COMMAND'" in str(err.value)


def test_entrypoint_maps_an_image_to_a_host_command(tmp_path, capsys):
    """`moerl local --entrypoint IMAGE=COMMAND`: the container's args follow the mapped command."""
    path = tmp_path / "wf.yaml"
    path.write_text(
        yaml.safe_dump(
            workflow([{"name": "main", "container": {"image": "argoproj/argosay:v2", "args": ["echo", "hi"]}}])
        )
    )
    args = argparse.Namespace(
        manifest=path, parameter=[], chaos=None, status_out=tmp_path / "s.json", workdir=tmp_path / "w",
        cold_start=False, entrypoint=[f"argoproj/argosay:v2={ARGOSAY}"], configmap=[],
    )  # fmt: skip
    assert cli_main(args) == 0
    status = json.loads((tmp_path / "s.json").read_text())
    the_pod = next((tmp_path / "w").glob("*/pods/*"))
    assert status["phase"] == "Succeeded"
    assert (the_pod / "stdout.log").read_text() == "hi\n"
    with pytest.raises(MoerlError, match="expected IMAGE=COMMAND"):
        parse_entrypoint("argoproj/argosay:v2")


# ----------------------------------------------------------------------------- synchronization


def locked_step(name: str, log: Path, sync: dict) -> dict:
    """A pod that logs its start and end to a shared file, holding `sync`."""
    return sh(name, f"echo start {{{{pod.name}}}} >> {log}; sleep 0.3; echo end {{{{pod.name}}}} >> {log}",
              synchronization=sync)  # fmt: skip


def most_at_once(log: Path) -> int:
    running, most = 0, 0
    for line in log.read_text().splitlines():
        running += 1 if line.startswith("start") else -1
        most = max(most, running)
    return most


def test_a_template_mutex_lets_one_pod_run_at_a_time(tmp_path):
    """examples/synchronization-mutex-tmpl-level.yaml: the five items of a loop over a template holding mutex
    `welcome` run one at a time, while the other template's mutex is its own (workflow/sync/mutex.go, a
    semaphore of limit 1; operator.go executeTemplate takes it before the node runs and releases it once
    the node is fulfilled)."""
    welcome, test = tmp_path / "welcome.log", tmp_path / "test.log"
    items = '["1","2","3"]'
    main = {
        "name": "main",
        "steps": [
            [
                {"name": "acquire-lock", "template": "acquire-lock", "withParam": items},
                {"name": "acquire-lock-1", "template": "acquire-lock-1", "withParam": items},
            ]
        ],
    }
    manifest = workflow(
        [main, locked_step("acquire-lock", welcome, {"mutexes": [{"name": "welcome"}]}),
         locked_step("acquire-lock-1", test, {"mutexes": [{"name": "test"}]})]
    )  # fmt: skip
    result, _ = run(manifest, tmp_path)
    assert result.phase == "Succeeded"
    assert most_at_once(welcome) == 1 and most_at_once(test) == 1
    assert len(welcome.read_text().splitlines()) == 6
    assert (
        not list((tmp_path / "runs" / ".sync").glob("*"))
        or LockManager(tmp_path / "runs" / ".sync", "default", {}).try_acquire(
            "probe", {"mutexes": [{"name": "welcome"}]}
        )[0]
    )  # released at the end


def test_a_template_semaphore_takes_its_limit_from_a_configmap(tmp_path):
    """examples/synchronization-tmpl-level.yaml: semaphore ConfigMap my-config key template (limit 2 here),
    given beside the manifest; at most two of the loop's pods hold it (workflow/sync/semaphore.go)."""
    log = tmp_path / "sem.log"
    main = {
        "name": "main",
        "steps": [[{"name": "acquire-lock", "template": "acquire-lock", "withParam": '["1","2","3","4"]'}]],
    }
    sync = {"semaphores": [{"configMapKeyRef": {"name": "my-config", "key": "template"}}]}
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(workflow([main, locked_step("acquire-lock", log, sync)])))
    configmap = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "my-config"}, "data": {"template": "2"}}
    (tmp_path / "my-config.yaml").write_text(yaml.safe_dump(configmap))
    result, _ = run(tmp_path / "wf.yaml", tmp_path)
    assert result.phase == "Succeeded"
    assert most_at_once(log) == 2


def test_a_semaphore_without_its_configmap_is_refused_before_anything_runs(tmp_path):
    """examples/synchronization-wf-level.yaml reads ConfigMap my-config key workflow, which Argo reads from the
    cluster; here it must be given (--configmap or beside the manifest)."""
    sync = {"semaphores": [{"configMapKeyRef": {"name": "my-config", "key": "workflow"}}]}
    with pytest.raises(MoerlError, match="ConfigMap 'my-config' key 'workflow', which is not given; pass --configmap"):
        load_workflow(workflow([sh("main", "true")], synchronization=sync))


def test_a_workflow_mutex_held_by_another_run_keeps_the_workflow_pending(tmp_path):
    """examples/synchronization-mutex-wf-level.yaml: a Workflow whose spec.synchronization mutex another
    workflow holds stays Pending with Argo's message "Waiting for NAMESPACE/Mutex/NAME lock. Lock status:
    0/1" (workflow/sync/semaphore.go checkAcquire; operator.go operate marks the workflow's phase with it),
    and runs once the holder lets go. Runs sharing a workdir share their locks (moerl's run mutex)."""
    other_run = LockManager(tmp_path / "runs" / ".sync", "default", {})
    assert other_run.try_acquire("default/other", {"mutexes": [{"name": "welcome"}]}) == (True, "")
    status_out = tmp_path / "status.json"
    manifest = workflow([sh("main", "echo ran")], synchronization={"mutexes": [{"name": "welcome"}]})
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(result=run(manifest, tmp_path, status_out=status_out)[0]))
    thread.start()
    seen = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and seen is None:
        try:
            status = json.loads(status_out.read_text())
        except (OSError, ValueError):
            status = {}
        if status.get("phase") == "Pending":
            seen = status
        time.sleep(0.05)
    other_run.release("default/other")
    thread.join(timeout=120)
    assert seen is not None and seen["message"] == "Waiting for default/Mutex/welcome lock. Lock status: 0/1"
    assert seen["nodes"] == {}
    assert done["result"].phase == "Succeeded"


# ----------------------------------------------------------------------------- memoize


def memoized(max_age: str = "10s") -> dict:
    """examples/memoize-simple.yaml's template: outputs cached in cache-config under key cache-key."""
    return {
        "name": "world-to-file",
        "memoize": {"key": "cache-key", "maxAge": max_age, "cache": {"configMap": {"name": "cache-config"}}},
        "container": {"image": "busybox", "command": ["sh", "-c"], "args": ["echo world > /tmp/hello_world.txt"]},
        "outputs": {"parameters": [{"name": "hello", "valueFrom": {"path": "/tmp/hello_world.txt"}}]},
    }


def test_memoize_reuses_outputs_of_a_run_that_succeeded(tmp_path):
    """examples/memoize-simple.yaml run twice: the second run is a cache hit, Succeeded with the cached outputs
    and no pod (workflow/controller/operator.go executeTemplate, initializeCacheHitNode; the cache is a
    ConfigMap in Argo, a file under the workdir here)."""
    first, nodes = run(workflow([memoized()], entrypoint="world-to-file"), tmp_path)
    assert first.phase == "Succeeded"
    assert nodes[first.name]["memoizationStatus"] == {"hit": False, "key": "cache-key", "cacheName": "cache-config"}
    second, nodes = run(workflow([memoized()], entrypoint="world-to-file"), tmp_path)
    assert second.phase == "Succeeded"
    assert nodes[second.name]["memoizationStatus"] == {"hit": True, "key": "cache-key", "cacheName": "cache-config"}
    assert output(nodes[second.name], "hello") == "world"
    assert not (second.run_dir / "pods").exists()


def test_memoize_misses_an_entry_older_than_max_age(tmp_path):
    """maxAge: an entry older than it is not a hit (operator.go, GetOutputsWithMaxAge)."""
    first, _ = run(workflow([memoized("0s")], entrypoint="world-to-file"), tmp_path)
    time.sleep(0.01)
    second, nodes = run(workflow([memoized("0s")], entrypoint="world-to-file"), tmp_path)
    assert second.phase == "Succeeded"
    assert nodes[second.name]["memoizationStatus"]["hit"] is False
    assert (second.run_dir / "pods").is_dir()


# ----------------------------------------------------------------------------- daemons

# A stand-in for influxdb:1.2's ENTRYPOINT (given with --entrypoint): /ping answers 204 once it listens,
# /write keeps the body, GET /query returns what was written.
INFLUX = """
import http.server, sys
points = []
class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def reply(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.reply(204) if self.path.startswith("/ping") else self.reply(200, "\\n".join(points).encode())
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        if self.path.startswith("/write"):
            points.append(body)
        self.reply(204)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def daemon_workflow(kind: str, port: int) -> dict:
    """examples/daemon-step.yaml (steps) and dag-daemon-task.yaml (DAG): an influxdb daemon with a readiness
    probe on /ping, clients that reach it at {{steps.influx.ip}} / {{tasks.influx.ip}}, a consumer that reads
    back what the producers wrote (the port is a free one, so that tests on one machine do not collide, and
    the probe's initialDelaySeconds is 0 instead of 5)."""
    prefix = "steps" if kind == "steps" else "tasks"
    url = f"http://{{{{{prefix}.influx.ip}}}}:{port}"

    def client(name: str, cmd: str, **fields) -> dict:
        arguments = {"parameters": [{"name": "cmd", "value": cmd}]}
        return {"name": name, "template": "influxdb-client", "arguments": arguments, **fields}

    init = client("init-database", f"curl -sf -XPOST '{url}/query' --data-urlencode 'q=CREATE DATABASE mydb'")
    producers = [
        client(f"producer-{i}", f"curl -sf -XPOST '{url}/write?db=mydb' -d 'cpu,host=server0{i} load={i}'")
        for i in (1, 2, 3)
    ]
    consumer = client("consumer", f"curl -sf -G '{url}/query?pretty=true' --data-urlencode 'db=mydb'")
    if kind == "steps":
        main = {"name": "main", "steps": [[{"name": "influx", "template": "influxdb"}], [init], producers, [consumer]]}
    else:
        init["depends"] = "influx"
        for producer in producers:
            producer["depends"] = "init-database"
        consumer["depends"] = "producer-1 && producer-2 && producer-3"
        main = {
            "name": "main",
            "dag": {"tasks": [{"name": "influx", "template": "influxdb"}, init, *producers, consumer]},
        }
    influxdb = {
        "name": "influxdb",
        "daemon": True,
        "container": {
            "image": "influxdb:1.2",
            "args": [str(port)],
            "readinessProbe": {
                "httpGet": {"path": "/ping", "port": port},
                "initialDelaySeconds": 0,
                "timeoutSeconds": 1,
            },
        },
    }
    client_template = {
        "name": "influxdb-client",
        "inputs": {"parameters": [{"name": "cmd"}]},
        "container": {
            "image": "curlimages/curl:latest",
            "command": ["sh", "-c"],
            "args": ["{{inputs.parameters.cmd}}"],
        },
    }
    return workflow([main, influxdb, client_template])


@pytest.mark.parametrize("kind", ["steps", "dag"])
def test_a_daemon_serves_the_steps_after_it_and_ends_with_its_scope(tmp_path, kind):
    """A `daemon: true` node is fulfilled once its pod runs and its readinessProbe passes (Argo:
    NodeStatus.Fulfilled with IsDaemoned; operator.go podReconciliation marks it daemoned when running and
    ready); the steps or tasks after it reach it at 127.0.0.1 ({{steps.X.ip}}); when its steps/DAG node is
    fulfilled its pod is stopped and its node Succeeded (exec_control.go killDaemonedChildren)."""
    port = free_port()
    entrypoints = {"influxdb:1.2": [sys.executable, "-c", INFLUX]}
    result, nodes = run(daemon_workflow(kind, port), tmp_path, entrypoints=entrypoints)
    assert result.phase == "Succeeded", [(n["displayName"], n.get("message")) for n in nodes.values()]
    assert nodes["influx"]["phase"] == "Succeeded" and "daemoned" not in nodes["influx"]
    assert sorted(stdout(result, nodes["consumer"]).splitlines()) == [
        f"cpu,host=server0{i} load={i}" for i in (1, 2, 3)
    ]
    with pytest.raises(OSError):  # the daemon was stopped with its scope
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_daemon_that_exits_on_its_own_fails(tmp_path):
    """A daemon's pod that succeeds is marked Failed: a daemon should run until its scope ends
    (operator.go podReconciliation, "Daemoned pod succeeded. Marking it as failed")."""
    main = {"name": "main", "steps": [[{"name": "d", "template": "d"}], [{"name": "after", "template": "after"}]]}
    manifest = workflow([main, sh("d", "exit 0", daemon=True, **{}), sh("after", "sleep 5")])
    manifest["spec"]["templates"][1]["container"]["readinessProbe"] = {"exec": {"command": ["false"]}}
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Failed"
    assert nodes["d"]["phase"] == "Failed"
    assert "after" not in nodes


# ----------------------------------------------------------------------------- refused valid input, messages


def test_a_referenced_workflow_template_calls_its_own_templates_by_name(tmp_path):
    """examples/workflow-template/templates.yaml: workflow-template-inner-steps' steps call `template:
    print-message`, a template of that same WorkflowTemplate, reached through templateRef from the Workflow
    (workflow/templateresolution/context.go WithTemplateHolder: a template resolves in its own holder)."""
    library = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "WorkflowTemplate",
        "metadata": {"name": "workflow-template-inner-steps"},
        "spec": {
            "templates": [
                {
                    "name": "print-message",
                    "inputs": {"parameters": [{"name": "message"}]},
                    "container": {"image": "busybox", "command": ["echo"], "args": ["{{inputs.parameters.message}}"]},
                },
                {
                    "name": "inner-steps",
                    "steps": [
                        [
                            {
                                "name": "inner-hello",
                                "template": "print-message",
                                "arguments": {"parameters": [{"name": "message", "value": "inner"}]},
                            }
                        ]
                    ],
                },
            ]
        },
    }
    (tmp_path / "templates.yaml").write_text(yaml.safe_dump(library))
    ref = {"name": "workflow-template-inner-steps", "template": "inner-steps"}
    main = {"name": "main", "steps": [[{"name": "hello", "templateRef": ref}]]}
    (tmp_path / "wf.yaml").write_text(yaml.safe_dump(workflow([main])))
    result, nodes = run(tmp_path / "wf.yaml", tmp_path)
    assert result.phase == "Succeeded", result.message
    assert stdout(result, nodes["inner-hello"]) == "inner\n"


def test_the_expression_pipe_operator(tmp_path):
    """expr-lang's pipe, `a | f(b)` for `f(a, b)` (expr parser parsePipe), as Argo's expression tags take it."""
    manifest = workflow(
        [sh("main", "echo {{='ab' | upper()}} {{=[1, 2, 3] | filter(# > 1) | len()}} {{='a' | sprig.upper()}}")]
    )
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Succeeded", result.message
    assert stdout(result, nodes[result.name]) == "AB 2 A\n"


def test_the_real_blocker_is_named_before_an_unknown_field_and_no_strict_drops_those(tmp_path):
    """Argo's controller drops fields that are not in its types (the e2e suite submits `metadata.label`); `argo
    submit` refuses them (--strict, its default). Refused here too, but only after the whole manifest is read,
    so that an unsupported field is named first; --no-strict drops them with a warning."""
    manifest = workflow([sh("main", "echo hi", initContainers=[{"name": "i", "image": "x"}])])
    manifest["metadata"]["label"] = {"a": "b"}
    with pytest.raises(MoerlError, match="unsupported: initContainers"):
        load_workflow(manifest)
    manifest = workflow([sh("main", "echo hi")])
    manifest["metadata"]["label"] = {"a": "b"}
    with pytest.raises(MoerlError, match="unknown field: label at metadata .*--no-strict drops"):
        load_workflow(manifest)
    result, _ = run(manifest, tmp_path, strict=False)
    assert result.phase == "Succeeded"


def test_the_removed_single_mutex_is_refused_with_its_replacement_named():
    """Argo v3.6 replaced synchronization.mutex/semaphore with lists; v4's types no longer have them, so its
    decoder drops them and the lock silently does not exist. Named here, with the list form."""
    manifest = workflow([sh("main", "true")], synchronization={"mutex": {"name": "m"}})
    with pytest.raises(MoerlError, match=r"unknown field: mutex .*mutexes: \[\{name: \.\.\.\}\]"):
        load_workflow(manifest)


def test_an_argument_from_a_skipped_step_without_a_default_errors_with_argos_message(tmp_path):
    """An argument that is a pure reference to a skipped step's output with no default, for an input with no
    default: "inputs.parameters.X: argument references an absent optional (skipped/omitted node output with
    no default)" (workflow/common/util.go ProcessArgs; steps.go markAbsentOptionalArgs)."""
    producer = {
        "name": "producer",
        "container": {"image": "alpine", "command": ["sh", "-c", "echo 1 > /tmp/o"]},
        "outputs": {"parameters": [{"name": "o", "valueFrom": {"path": "/tmp/o"}}]},
    }
    consumer = {
        "name": "consumer",
        "inputs": {"parameters": [{"name": "x"}]},
        "container": {"image": "alpine", "command": ["echo", "{{inputs.parameters.x}}"]},
    }
    arguments = {"parameters": [{"name": "x", "value": "{{steps.p.outputs.parameters.o}}"}]}
    main = {
        "name": "main",
        "steps": [
            [{"name": "p", "template": "producer", "when": "1 == 2"}],
            [{"name": "c", "template": "consumer", "arguments": arguments}],
        ],
    }
    result, nodes = run(workflow([main, producer, consumer]), tmp_path)
    assert result.phase in ("Failed", "Error")
    assert nodes["c"]["message"] == (
        "inputs.parameters.x: argument references an absent optional (skipped/omitted node output with no default)"
    )


def test_entry_and_exit_template_errors_are_the_workflows_error(tmp_path):
    """operator.go operate: an error from executing the entrypoint (or the exit handler), here a memoize key
    that a ConfigMap cannot hold, is the workflow's Error: "error in entry template execution: ..." ("error in
    exit template execution : ..."), and the exit handler does not run after it."""
    memo = {"key": "{{workflow.name}} has spaces", "cache": {"configMap": {"name": "c"}}}
    bad = {"name": "bad", "memoize": memo, "container": {"image": "alpine", "command": ["true"]}}
    result, _ = run(workflow([bad, sh("bye", "echo bye")], entrypoint="bad", onExit="bye"), tmp_path)
    assert result.phase == "Error"
    assert result.message.startswith("error in entry template execution: memoize.key ")
    assert not any(n["displayName"].endswith("onExit") for n in result.status["nodes"].values())
    result, _ = run(workflow([sh("main", "true"), bad], onExit="bad"), tmp_path)
    assert result.phase == "Error"
    assert result.message.startswith("error in exit template execution : memoize.key ")


def test_pod_spec_patch_reaches_the_main_container(tmp_path):
    """examples/pod-spec-patch.yaml: podSpecPatch's `containers: [{name: main, ...}]` is merged into the main
    container (workflow/controller/workflowpod.go processPodSpecPatch, a strategic merge: env by name)."""
    main_patch = {
        "name": "main",
        "resources": {"limits": {"cpu": "{{workflow.parameters.cpu-limit}}"}},
        "env": [{"name": "GREETING", "value": "patched"}],
    }
    patch = json.dumps({"containers": [main_patch]})
    template = sh("main", "echo $GREETING", podSpecPatch=patch)
    template["container"]["env"] = [{"name": "GREETING", "value": "plain"}, {"name": "OTHER", "value": "kept"}]
    manifest = workflow([template], arguments={"parameters": [{"name": "cpu-limit", "value": "100m"}]})
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Succeeded"
    assert stdout(result, nodes[result.name]) == "patched\n"
    pod = json.loads(next((result.run_dir / "pods").glob("*/pod.json")).read_text())
    main = pod["spec"]["containers"][0]
    assert main["resources"] == {"limits": {"cpu": "100m"}}
    assert {e["name"]: e["value"] for e in main["env"]} == {"GREETING": "patched", "OTHER": "kept"}


def test_a_retried_daemon_serves_clients_that_hold_a_templated_mutex(tmp_path):
    """examples/steps-daemon-retry-strategy.yaml: a daemon server with a retryStrategy (its first attempt dies
    before it is ready here, so the Retry node retries it), and clients reaching {{steps.server.ip}} one at a
    time under mutex `client-{{workflow.uid}}` (the server is a Python one on a free port, not nginx on 80)."""
    port, marker, log = free_port(), tmp_path / "crashed-once", tmp_path / "clients.log"
    serve = (
        f"import http.server, os, sys\n"
        f"if not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w').close(); sys.exit(1)\n"
        f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()"
    )
    server = {
        "name": "server",
        "retryStrategy": {"limit": "10"},
        "daemon": True,
        "container": {
            "image": "nginx:1.13",
            "command": ["python3", "-c", serve],
            "workingDir": str(tmp_path),
            "readinessProbe": {"httpGet": {"path": "/", "port": port}, "timeoutSeconds": 1},
        },
    }
    client = locked_step("client", log, {"mutexes": [{"name": "client-{{workflow.uid}}"}]})
    client["inputs"] = {"parameters": [{"name": "server-ip"}]}
    client["container"]["command"][2] += f" && curl -sf http://{{{{inputs.parameters.server-ip}}}}:{port}/ >/dev/null"
    arguments = {"parameters": [{"name": "server-ip", "value": "{{steps.server.ip}}"}]}
    main = {
        "name": "main",
        "steps": [
            [{"name": "server", "template": "server"}],
            [{"name": "client", "template": "client", "arguments": arguments, "withSequence": {"count": "3"}}],
        ],
    }
    result, nodes = run(workflow([main, server, client]), tmp_path)
    assert result.phase == "Succeeded", [(n["displayName"], n.get("message")) for n in nodes.values()]
    attempts = sorted(
        (n for n in result.status["nodes"].values() if n.get("templateName") == "server" and n["type"] == "Pod"),
        key=lambda n: n["name"],
    )
    assert [a["phase"] for a in attempts] == ["Failed", "Succeeded"]  # the second one, stopped with its scope
    assert nodes["server"]["type"] == "Retry" and nodes["server"]["phase"] == "Succeeded"
    assert most_at_once(log) == 1 and len(log.read_text().splitlines()) == 6


def test_a_node_that_waited_for_its_mutex_reads_the_cache_its_holder_filled(tmp_path):
    """A template with both a mutex and memoize: the second of two parallel steps waits for the mutex, and
    once it holds it finds the first one's outputs in the cache (operator.go executeTemplate: the cache is
    read when the node is created or unlocked, "Node is using mutex with memoize. Cache is hit.")."""
    counter = tmp_path / "ran"
    template = {
        "name": "once",
        "synchronization": {"mutexes": [{"name": "once"}]},
        "memoize": {"key": "k", "cache": {"configMap": {"name": "once-cache"}}},
        "container": {"image": "alpine", "command": ["sh", "-c", f"echo x >> {counter}; echo v > /tmp/o"]},
        "outputs": {"parameters": [{"name": "o", "valueFrom": {"path": "/tmp/o"}}]},
    }
    main = {"name": "main", "steps": [[{"name": "a", "template": "once"}, {"name": "b", "template": "once"}]]}
    result, nodes = run(workflow([main, template]), tmp_path)
    assert result.phase == "Succeeded"
    assert counter.read_text() == "x\n"  # one pod ran
    hits = sorted(nodes[n]["memoizationStatus"]["hit"] for n in ("a", "b"))
    assert hits == [False, True]
    assert output(nodes["a"], "o") == output(nodes["b"], "o") == "v"


def test_a_node_waiting_for_a_lock_past_its_timeout_fails(tmp_path):
    """TestTemplateLevelTimeoutWithForbidden's rule (test/e2e/functional_test.go): a node that is still Pending
    (here: waiting for a mutex another run holds) when its template's `timeout` runs out is Failed "timeout"
    (operator.go checkTemplateTimeouts, ErrTimeout)."""
    other_run = LockManager(tmp_path / "runs" / ".sync", "default", {})
    assert other_run.try_acquire("default/other", {"mutexes": [{"name": "busy"}]})[0]
    waiting = sh("waiting", "echo never", timeout="1s", synchronization={"mutexes": [{"name": "busy"}]})
    result, nodes = run(workflow([waiting], entrypoint="waiting"), tmp_path)
    other_run.release_all()
    assert result.phase == "Failed"
    assert (nodes[result.name]["phase"], nodes[result.name]["message"]) == ("Failed", "timeout")


def test_a_free_slot_goes_to_the_workflow_at_the_front_of_argos_queue(tmp_path):
    """workflow/sync/semaphore.go checkAcquire and its priorityQueue: between workflows, a free slot goes to
    the one at the front, highest spec.priority first, then the oldest; the others wait, told how many slots
    are free ("Lock status: 1/1"). A queue entry whose run is gone is dropped."""
    mutex = {"mutexes": [{"name": "m"}]}

    def run_of(name: str, priority: int, created: float) -> LockManager:
        return LockManager(
            tmp_path, "default", {}, workflow_key=f"default/{name}", priority=priority, created_at=created
        )

    holder, old_low, new_high = run_of("holder", 0, 0.0), run_of("old-low", 0, 1.0), run_of("new-high", 5, 2.0)
    assert holder.try_acquire("default/holder", mutex) == (True, "")
    assert old_low.try_acquire("default/old-low", mutex) == (
        False,
        "Waiting for default/Mutex/m lock. Lock status: 0/1",
    )
    assert new_high.try_acquire("default/new-high", mutex)[0] is False
    holder.release_all()
    assert old_low.try_acquire("default/old-low", mutex) == (
        False,
        "Waiting for default/Mutex/m lock. Lock status: 1/1",
    )
    assert new_high.try_acquire("default/new-high", mutex) == (True, "")
    new_high.release_all()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    entry = {"workflow": "default/gone", "priority": 9, "created": 0.0, "pid": int(gone.stdout)}
    (tmp_path / "default_Mutex_m.queue" / "default_gone").write_text(json.dumps(entry))
    assert old_low.try_acquire("default/old-low", mutex) == (True, "")
    assert not (tmp_path / "default_Mutex_m.queue" / "default_gone").exists()


def test_a_daemon_lost_after_it_was_ready_is_retried_while_its_dependent_runs(tmp_path):
    """test/e2e/daemon_pod_test.go TestDaemonPodRetry, in a DAG: attempt 0 of a daemon with a retryStrategy dies
    after it became ready while the task that depends on it runs. Argo (v4.1.2) keeps the Retry node daemoned
    (its dependents go on), re-executes it on each pass ("pre-execute daemoned tasks", dag.go) and starts a new
    attempt because a node below the lost one is unfinished (operator.go executeTemplate); at the end of the DAG
    the live attempt is stopped and marked Succeeded."""
    d = str(tmp_path)
    serve = (f"touch {d}/ready{{{{retries}}}}; if [ {{{{retries}}}} = 0 ]; then "
             f"while [ ! -f {d}/lose-it ]; do sleep 0.05; done; exit 1; fi; sleep 300")  # fmt: skip
    server = sh("server", serve, daemon=True, retryStrategy={"limit": "2", "retryPolicy": "Always"})
    # The probe leaves a mark when it passes: the client ends only once attempt 1 is ready (daemoned).
    ready = f"test -f {d}/ready{{{{retries}}}} && touch {d}/probed{{{{retries}}}}"
    server["container"]["readinessProbe"] = {"exec": {"command": ["sh", "-c", ready]}}
    client = sh("client", f"touch {d}/lose-it; while [ ! -f {d}/probed1 ]; do sleep 0.05; done")
    tasks = [{"name": "server", "template": "server"}, {"name": "client", "template": "client", "depends": "server"}]
    dag = {"name": "main", "dag": {"tasks": tasks}}
    result, nodes = run(workflow([dag, server, client]), tmp_path)
    assert result.phase == "Succeeded", [(n["displayName"], n["phase"], n.get("message")) for n in nodes.values()]
    assert (nodes["server(0)"]["phase"], nodes["server(1)"]["phase"]) == ("Failed", "Succeeded")
    assert nodes["server"]["phase"] == "Succeeded" and nodes["client"]["phase"] == "Succeeded"
