"""`moerl local` held to the last Argo rules that Argo's own suite (v4.1.2: examples/, test/e2e) found off:
memoizationStatus, `when` with expr-lang pipes, workflowMetadata of workflows submitted from templates,
podSpecPatch in the recorded pod spec, errors of the entry and exit templates, retried daemons in a DAG, and
how a pass scales with thousands of pods. Each test names the upstream workflow or Go test that showed the
rule and the Argo source that defines it; it writes the smallest workflow that reproduces the rule (no upstream
file is copied here). bench/argo_suite.py runs the upstream files themselves."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from argo_helpers import pod_dir, sh, stdout, workflow
from argo_helpers import run as run_in

from pipelines.local.api.status import DAG, FAILED, PENDING, POD, RUNNING, STEPS, SUCCEEDED, Nodes
from pipelines.local.controller import loops
from pipelines.local.controller import workflow_controller as executor
from pipelines.local.controller.workflow_controller import Controller
from pipelines.local.lang.expressions import referenced_names, substitute_text

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fast_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")  # backoffs and grace periods


def run(manifest: dict | Path, tmp_path: Path, **kwargs):
    return run_in(manifest, tmp_path / "runs", **kwargs)  # tmp_path itself holds the tests' own files


def write(path: Path, *documents: dict) -> Path:
    path.write_text(yaml.safe_dump_all(list(documents), sort_keys=False))
    return path


def output(node: dict, name: str) -> str:
    return next(p["value"] for p in node["outputs"]["parameters"] if p["name"] == name)


def pods(result) -> list[dict]:
    return [n for n in result.status["nodes"].values() if n["type"] == POD]


# ----------------------------------------------------------------------------- a. memoize


def memoized_twice(kind: str, cache: str) -> dict:
    """TestStepLevelMemoize / TestDAGLevelMemoize (test/e2e/functional_test.go): a memoized steps (or DAG)
    template called by two step groups in a row with the same key."""
    arguments = {"parameters": [{"name": "m", "value": "{{inputs.parameters.m}}"}]}
    call = {"name": "cache", "template": "echo", "arguments": arguments}
    body = {"steps": [[call]]} if kind == "steps" else {"dag": {"tasks": [call]}}
    result = "{{steps.cache.outputs.result}}" if kind == "steps" else "{{tasks.cache.outputs.result}}"
    memostep = {
        "name": "memostep",
        "inputs": {"parameters": [{"name": "m"}]},
        "memoize": {"key": "{{inputs.parameters.m}}", "maxAge": "1h", "cache": {"configMap": {"name": cache}}},
        **body,
        "outputs": {"parameters": [{"name": "out", "valueFrom": {"parameter": result}}]},
    }
    echo = {
        "name": "echo",
        "inputs": {"parameters": [{"name": "m"}]},
        "container": {"image": "alpine", "command": ["echo"], "args": ["{{inputs.parameters.m}}"]},
    }
    args = {"parameters": [{"name": "m", "value": "hello1"}]}
    main = {
        "name": "main",
        "steps": [[{"name": "first", "template": "memostep", "arguments": args}],
                  [{"name": "second", "template": "memostep", "arguments": args}]],
    }  # fmt: skip
    return workflow([main, memostep, echo])


@pytest.mark.parametrize(("kind", "node_type"), [("steps", STEPS), ("dag", DAG)])
def test_a_memoized_template_is_a_hit_for_a_later_step_of_the_same_run(tmp_path, kind, node_type):
    """TestStepLevelMemoize, TestDAGLevelMemoize: the second call finds the first one's outputs. Argo saves a
    steps or DAG node's outputs where it marks it Succeeded (workflow/controller/steps.go executeSteps, dag.go
    executeDAG: c.Save), so the next step group of the same reconciliation reads them; the hit node is
    initializeCacheHitNode's: the template's node type, Succeeded, the cached outputs, no children, and
    memoizationStatus {hit: true, key, cacheName}; the node that ran shows {hit: false, ...}
    (initializeExecutableNode)."""
    cache = f"memo-{kind}"
    result, nodes = run(memoized_twice(kind, cache), tmp_path)
    assert result.phase == "Succeeded"
    first, second = nodes["first"], nodes["second"]
    assert first["memoizationStatus"] == {"hit": False, "key": "hello1", "cacheName": cache}
    assert second["memoizationStatus"] == {"hit": True, "key": "hello1", "cacheName": cache}
    assert (second["type"], second["phase"], second.get("children")) == (node_type, "Succeeded", None)
    assert output(first, "out") == output(second, "out") == "hello1"
    assert len(pods(result)) == 1  # only the first call ran its pod


def test_every_node_of_a_memoized_template_records_its_status_and_a_hit_keeps_the_retry_type(tmp_path):
    """operator.go initializeExecutableNode sets memoizationStatus {hit: false} on every node made from a
    memoized template, the attempts of a Retry node too; a hit on a template with its own retryStrategy is a
    node of type Retry (Template.GetNodeType), with no attempt under it."""
    memo = {"key": "k", "cache": {"configMap": {"name": "retry-memo"}}}
    leaf = sh("leaf", "echo v > /tmp/o", memoize=memo, retryStrategy={"limit": "1"},
              outputs={"parameters": [{"name": "o", "valueFrom": {"path": "/tmp/o"}}]})  # fmt: skip
    main = {"name": "main", "steps": [[{"name": "a", "template": "leaf"}], [{"name": "b", "template": "leaf"}]]}
    result, nodes = run(workflow([main, leaf]), tmp_path)
    assert result.phase == "Succeeded"
    miss = {"hit": False, "key": "k", "cacheName": "retry-memo"}
    assert nodes["a"]["type"] == "Retry" and nodes["a"]["memoizationStatus"] == miss
    assert nodes["a(0)"]["memoizationStatus"] == miss
    assert nodes["b"]["type"] == "Retry" and nodes["b"]["memoizationStatus"] == {**miss, "hit": True}
    assert nodes["b"].get("children") is None and output(nodes["b"], "o") == "v"


# ----------------------------------------------------------------------------- b. when with expr-lang pipes


def test_a_when_with_an_expr_pipe_waits_for_the_loop_item(tmp_path):
    """TestStepsWhenExprFilter (test/e2e/functional/steps-when-expr-filter.yaml): `when` holds
    `{{= get(item, 'type') ?? 'x' }}`, which names the loop's `item`, and `{{= inputs... | fromJSON() | join(...) }}`.
    Argo resolves `when` before the loop is expanded (steps.go resolveReferences): the first tag reads `item`,
    a bare identifier, which `??` does not guard (util/template/expression_template.go guardVisitor guards
    member nodes only), so it is left for the expansion; the second resolves at once. Each item then runs or
    is skipped by its own condition."""
    items = [{"name": "a", "type": ""}, {"name": "b", "type": "x"}, {"name": "c", "type": "no"}, {"name": "d"}]
    when = '"{{= get(item, \'type\') ?? \'x\' }}" in ("{{= inputs.parameters.list | fromJSON() | join(\'","\') }}","")'
    main = {
        "name": "main",
        "inputs": {"parameters": [{"name": "list", "value": "{{= ['x', 'y'] | toJSON() }}"}]},
        "steps": [[{"name": "run", "template": "say", "when": when, "withParam": json.dumps(items),
                    "arguments": {"parameters": [{"name": "n", "value": "{{item.name}}"}]}}]],
    }  # fmt: skip
    say = sh("say", "echo {{inputs.parameters.n}}", inputs={"parameters": [{"name": "n"}]})
    result, nodes = run(workflow([main, say]), tmp_path)
    assert result.phase == "Succeeded", [(n["displayName"], n.get("message")) for n in nodes.values()]
    phases = {name: (node["type"], node["phase"]) for name, node in nodes.items() if name.startswith("run(")}
    assert phases == {
        "run(0:name:a,type:)": ("Pod", "Succeeded"),
        "run(1:name:b,type:x)": ("Pod", "Succeeded"),
        "run(2:name:c,type:no)": ("Skipped", "Skipped"),
        "run(3:name:d)": ("Pod", "Succeeded"),
    }
    assert stdout(result, nodes["run(3:name:d)"]) == "d\n"


def test_nil_coalescing_guards_members_not_bare_identifiers():
    """util/template/expression_template.go getIdentifiers: guardVisitor marks the member nodes left of `??`
    and the object of `?.`; identifierVisitor reports the rest in expr-lang's ast.Walk order (children
    first). A strict substitution leaves a tag that reads a late variable (item) for later."""
    assert referenced_names("get(item, 'type') ?? 'x'") == ["item"]
    assert referenced_names("item.optional ?? 'x'") == ["item"]
    assert referenced_names("a.b?.c") == ["a"]
    assert referenced_names("steps.a.outputs.result") == [
        "steps", "steps.a", "steps.a.outputs", "steps.a.outputs.result",
    ]  # fmt: skip
    tag = "{{= get(item, 'type') ?? 'x' }}"
    assert substitute_text(tag, {"inputs.parameters.p": "1"}, strict=("steps", "tasks")) == tag


# ----------------------------------------------------------------------------- c. workflowMetadata


def labelled_template(name: str) -> dict:
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "WorkflowTemplate",
        "metadata": {"name": name, "labels": {"owner": "the-template-object"}},
        "spec": {
            "workflowMetadata": {
                "labels": {"from-template": "yes"},
                "annotations": {"note": "tmpl"},
                "labelsFrom": {"computed": {"expression": "'c-' + workflow.parameters.p"}},
            },
            "arguments": {"parameters": [{"name": "p", "value": "x"}]},
            "entrypoint": "main",
            "templates": [sh("main", "echo {{workflow.labels.from-template}} {{workflow.labels.computed}} "
                                     "{{workflow.annotations.note}}")],
        },
    }  # fmt: skip


def test_a_workflow_template_run_as_a_workflow_has_the_metadata_argo_submit_from_gives(tmp_path):
    """`argo submit --from workflowtemplate/NAME` creates a Workflow named `NAME-xxxxx`, labelled
    workflows.argoproj.io/workflow-template: NAME, without the template object's own labels
    (workflow/common/convert.go NewWorkflowFromWorkflowTemplate); the controller then applies the spec's
    workflowMetadata: labels, annotations, labelsFrom (operator.go updateWorkflowMetadata)."""
    result, nodes = run(write(tmp_path / "tmpl.yaml", labelled_template("labelled")), tmp_path)
    assert result.phase == "Succeeded"
    assert result.name.startswith("labelled-")
    assert result.metadata["labels"] == {
        "workflows.argoproj.io/workflow-template": "labelled", "from-template": "yes", "computed": "c-x",
    }  # fmt: skip
    assert result.metadata["annotations"] == {"note": "tmpl"}
    assert stdout(result, nodes[result.name]) == "yes c-x tmpl\n"


def test_a_workflow_template_ref_merges_the_workflow_metadata_of_both(tmp_path):
    """A Workflow with workflowTemplateRef runs the template's spec joined with its own by a strategic merge
    (workflow/util/merge.go JoinWorkflowSpec, MergeTo): workflowMetadata's labels and annotations are merged
    key by key (the Workflow's win) and the template's labelsFrom entries the Workflow lacks are kept, so the
    template's labels apply even when the Workflow brings workflowMetadata of its own."""
    write(tmp_path / "tmpl.yaml", labelled_template("labelled"))
    wf = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "ref-", "labels": {"own": "mine"}},
        "spec": {"workflowTemplateRef": {"name": "labelled"},
                 "workflowMetadata": {"labels": {"from-wf": "1"}, "annotations": {"note": "wf"}}},
    }  # fmt: skip
    result, nodes = run(write(tmp_path / "wf.yaml", wf), tmp_path)
    assert result.phase == "Succeeded"
    assert result.metadata["labels"] == {"own": "mine", "from-template": "yes", "from-wf": "1", "computed": "c-x"}
    assert stdout(result, nodes[result.name]) == "yes c-x wf\n"


def test_a_cron_workflow_run_now_has_the_metadata_of_the_workflow_it_creates(tmp_path):
    """workflow/common/convert.go ConvertCronWorkflowToWorkflow: generateName `<cron>-`, the cron-workflow label
    and scheduled-time annotation, then the CronWorkflow's spec.workflowMetadata labels and annotations (not the
    CronWorkflow object's own labels)."""
    cron = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "CronWorkflow",
        "metadata": {"name": "nightly", "labels": {"owner": "the-cron-object"}},
        "spec": {"schedules": ["0 2 * * *"], "workflowMetadata": {"labels": {"team": "t"}},
                 "workflowSpec": {"entrypoint": "main", "templates": [sh("main", "echo {{workflow.labels.team}}")]}},
    }  # fmt: skip
    result, nodes = run(write(tmp_path / "cron.yaml", cron), tmp_path)
    assert result.phase == "Succeeded" and result.name.startswith("nightly-")
    assert result.metadata["labels"] == {"workflows.argoproj.io/cron-workflow": "nightly", "team": "t"}
    assert "workflows.argoproj.io/scheduled-time" in result.metadata["annotations"]
    assert stdout(result, nodes[result.name]) == "t\n"


# ----------------------------------------------------------------------------- d. podSpecPatch


def test_pod_spec_patches_are_substituted_and_merged_into_the_recorded_pod_spec(tmp_path):
    """examples/pod-spec-patch-wf-tmpl.yaml, TestWorkflowPodSpecPatch: the workflow's podSpecPatch, then the
    template's, each substituted with the workflow's variables and pod.name (workflowpod.go
    processPodSpecPatch), are merged over the whole pod spec by a strategic merge (util.go ApplyPodSpecPatch):
    the main container's resources, the pod's terminationGracePeriodSeconds and priorityClassName. An entry
    for Argo's own wait container has nothing to merge into here."""
    memory = {"name": "main", "resources": {"limits": {"memory": "{{workflow.parameters.mem}}"}}}
    spec_patch = yaml.safe_dump({"containers": [memory]})  # a YAML patch, as the example's
    template_patch = json.dumps({
        "terminationGracePeriodSeconds": 5,
        "priorityClassName": "high",
        "containers": [
            {"name": "main", "resources": {"limits": {"cpu": "{{inputs.parameters.cpu}}"}},
             "env": [{"name": "POD", "value": "{{pod.name}}"}]},
            {"name": "wait", "resources": {"limits": {"cpu": "101m"}}},
        ],
    })  # fmt: skip
    main = sh("main", "echo $POD", podSpecPatch=template_patch,
              inputs={"parameters": [{"name": "cpu", "value": "100m"}]})  # fmt: skip
    manifest = workflow([main], podSpecPatch=spec_patch, arguments={"parameters": [{"name": "mem", "value": "100Mi"}]})
    result, nodes = run(manifest, tmp_path)
    assert result.phase == "Succeeded"
    pod = json.loads((pod_dir(result, nodes[result.name]) / "pod.json").read_text())
    assert [c["name"] for c in pod["spec"]["containers"]] == ["main"]
    main_container = pod["spec"]["containers"][0]
    assert main_container["resources"] == {"limits": {"memory": "100Mi", "cpu": "100m"}}
    assert (pod["spec"]["terminationGracePeriodSeconds"], pod["spec"]["priorityClassName"]) == (5, "high")
    assert stdout(result, nodes[result.name]) == f"{pod['metadata']['name']}\n"


# ----------------------------------------------------------------------------- e. entry and exit templates


def unmounted(name: str) -> dict:
    """A pod template mounting a volume no one declares: Argo's validation lets it through, its pod cannot be
    created (workflowpod.go addVolumeReferences: "volume 'foo' not found in workflow spec")."""
    template = sh(name, "echo never")
    template["container"]["volumeMounts"] = [{"name": "foo", "mountPath": "/foo"}]
    return template


def test_an_entry_template_whose_pod_cannot_be_created_errs_the_workflow(tmp_path):
    """TestWorkflowTemplateInvalidEntryPoint (test/e2e/workflow_template_test.go): executeTemplate returns the
    pod's creation error, operate() marks the workflow Error "error in entry template execution: ERR"
    (operator.go) and returns: the exit handler does not run."""
    manifest = workflow([unmounted("main"), sh("notify", "echo exit")], onExit="notify")
    result, nodes = run(manifest, tmp_path)
    assert (result.phase, result.message) == (
        "Error", "error in entry template execution: volume 'foo' not found in workflow spec",
    )  # fmt: skip
    assert (nodes[result.name]["phase"], nodes[result.name]["message"]) == (
        "Error", "volume 'foo' not found in workflow spec",
    )  # fmt: skip
    assert f"{result.name}.onExit" not in nodes


def test_an_exit_template_whose_pod_cannot_be_created_errs_the_workflow(tmp_path):
    """TestWorkflowTemplateInvalidOnExit: the same for the exit handler, in Argo's words with the space before
    the colon, "error in exit template execution : ERR" (operator.go)."""
    manifest = workflow([sh("main", "echo main"), unmounted("notify")], onExit="notify")
    result, nodes = run(manifest, tmp_path)
    assert nodes[result.name]["phase"] == "Succeeded"
    assert (result.phase, result.message) == (
        "Error", "error in exit template execution : volume 'foo' not found in workflow spec",
    )  # fmt: skip


# ----------------------------------------------------------------------------- f. retried daemons in a DAG


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_retried_daemon_serves_the_dag_tasks_that_depend_on_it(tmp_path):
    """examples/dag-daemon-retry-strategy.yaml: a daemon task with a retryStrategy whose first attempt dies
    before it is ready; the Retry node starts another, and the looped client task (`depends: server`, one
    at a time under mutex client-{{workflow.uid}}) reaches it at {{tasks.server.ip}}; at the DAG's end the
    live attempt is stopped and Succeeded (dag.go, operator.go processNodeRetries, killDaemonedChildren).
    On a cluster each pod has its own IP; here every daemon serves on this machine, so the test takes a free
    port where the example takes nginx's 80 (two workflows serving on one port at once collide)."""
    port, marker = free_port(), tmp_path / "crashed-once"
    serve = (
        f"import http.server, os, sys\n"
        f"if not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w').close(); sys.exit(1)\n"
        f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler).serve_forever()"
    )
    server = {
        "name": "server", "retryStrategy": {"limit": "6"}, "daemon": True,
        "container": {"image": "nginx:1.13", "command": ["python3", "-c", serve], "workingDir": str(tmp_path),
                      "readinessProbe": {"httpGet": {"path": "/", "port": port}, "timeoutSeconds": 1}},
    }  # fmt: skip
    client = sh("client", f"curl -sf http://{{{{inputs.parameters.server-ip}}}}:{port}/ >/dev/null",
                inputs={"parameters": [{"name": "server-ip"}]},
                synchronization={"mutexes": [{"name": "client-{{workflow.uid}}"}]})  # fmt: skip
    tasks = [
        {"name": "server", "template": "server"},
        {"name": "client", "template": "client", "depends": "server", "withSequence": {"count": "3"},
         "arguments": {"parameters": [{"name": "server-ip", "value": "{{tasks.server.ip}}"}]}},
    ]  # fmt: skip
    result, nodes = run(workflow([{"name": "main", "dag": {"tasks": tasks}}, server, client]), tmp_path)
    assert result.phase == "Succeeded", [(n["displayName"], n["phase"], n.get("message")) for n in nodes.values()]
    assert (nodes["server(0)"]["phase"], nodes["server(1)"]["phase"]) == ("Failed", "Succeeded")
    assert nodes["server"]["type"] == "Retry" and nodes["server"]["phase"] == "Succeeded"
    assert [nodes[f"client({i}:{i})"]["phase"] for i in range(3)] == ["Succeeded"] * 3


# ----------------------------------------------------------------------------- g. a pass over thousands of pods


def gated_loop(count: int, gate: Path) -> dict:
    """A loop of `count` pods that run until the test opens the gate (test/e2e/functional/
    loop-sequence-many-long-pods.yaml is 10,000 of them, 7,000 at once)."""
    wait = sh("wait", f"while [ ! -e {gate} ]; do sleep 0.2; done")
    loop = {"name": "w", "template": "wait", "withSequence": {"count": str(count)}}
    return workflow([{"name": "main", "parallelism": count, "steps": [[loop]]}, wait])


def observe_passes(monkeypatch: pytest.MonkeyPatch, count: int, gate: Path, passes: int) -> dict:
    """Instrument the controller: template resolutions and loop expansions in each pass during which all
    `count` pods ran, the number of those passes and of status writes; the gate opens after `passes` of them."""
    seen: dict = {"resolves": [], "expansions": [], "passes": 0, "controller": None}
    calls = {"resolve": 0, "expand": 0}
    resolve, operate, expand_ = Controller.resolve, Controller.operate, loops._expand

    def counting_resolve(self, call):
        calls["resolve"] += 1
        return resolve(self, call)

    def counting_expand(step):
        calls["expand"] += 1
        return expand_(step)

    def observed_operate(self):
        seen["controller"] = self
        before, running = dict(calls), len(self.pods)
        done = operate(self)
        if running == count and len(self.pods) == count:
            seen["resolves"].append(calls["resolve"] - before["resolve"])
            seen["expansions"].append(calls["expand"] - before["expand"])
            seen["passes"] += 1
            if seen["passes"] >= passes:
                gate.touch()
        return done

    monkeypatch.setattr(Controller, "resolve", counting_resolve)
    monkeypatch.setattr(Controller, "operate", observed_operate)
    monkeypatch.setattr(loops, "_expand", counting_expand)
    return seen


@pytest.mark.parametrize("count", [4, 40])
def test_a_pass_over_running_pods_does_not_process_their_templates_again(tmp_path, monkeypatch, count):
    """Argo walks the whole workflow on each reconciliation (executeTemplate for every step of every group); a
    pod node whose pod runs comes back unchanged from that walk. Here such a pass neither resolves the running
    pods' templates again nor expands their loop again: the work of a pass over running pods does not grow with
    their number (it did: one resolution and substitution per pod per pass, so thousands of pods made each of
    thousands of passes slow), only the entrypoint's own template is resolved."""
    gate = tmp_path / "gate"
    seen = observe_passes(monkeypatch, count, gate, passes=5)
    result, _ = run(gated_loop(count, gate), tmp_path)
    assert result.phase == "Succeeded"
    assert seen["passes"] >= 5
    assert set(seen["resolves"]) == {1}  # the steps template at the root, whatever the number of pods
    assert set(seen["expansions"]) == {0}  # expanded once, when the pods started


def test_the_status_is_written_when_it_changed_not_on_every_pass(tmp_path, monkeypatch):
    """The status file is rewritten only when a pass changed it (a pod ended or started, a phase or message
    moved), and at the end; passes that only checked timers leave it alone (with thousands of nodes a write
    costs more than such a pass)."""
    gate = tmp_path / "gate"
    monkeypatch.setattr(executor, "STATUS_INTERVAL_SECONDS", 0.0)  # no rate limit: only what changed counts
    seen = observe_passes(monkeypatch, 3, gate, passes=12)
    status = tmp_path / "status.json"
    result, _ = run(gated_loop(3, gate), tmp_path, status_out=status)
    assert result.phase == "Succeeded" and seen["passes"] >= 12
    assert seen["controller"].status_writes <= 5  # started, running, its pods ending, the end: not 12+ idle passes
    assert json.loads(status.read_text()) == result.status


def test_active_children_and_pods_are_counted_from_an_index():
    """node_counters.go getActiveChildren / getActivePods: the Pod, Steps and DAG nodes of a boundary that are
    Pending or Running. Kept as nodes are created and marked, instead of a walk over every node on each
    question (a loop with template parallelism asks once per waiting item per pass)."""
    nodes = Nodes("wf")
    nodes.create("wf", STEPS, "main", "", RUNNING)
    made = [nodes.create(f"wf.p{i}", POD, "t", "wf", PENDING if i % 2 else RUNNING) for i in range(6)]
    nodes.create("wf.s", STEPS, "t", "wf", RUNNING)
    nodes.create("wf.other", POD, "t", "elsewhere", RUNNING)

    def brute(boundary: str) -> int:
        return sum(1 for n in nodes if n.boundary_id == boundary and n.type in (POD, STEPS, DAG)
                   and n.phase in (PENDING, RUNNING))  # fmt: skip

    assert (nodes.active_children("wf"), nodes.active_pods()) == (brute("wf"), 7) == (7, 7)
    nodes.mark(made[0], SUCCEEDED)
    nodes.mark(made[1], RUNNING)
    nodes.mark(made[2], FAILED, "boom")
    assert nodes.active_children("wf") == brute("wf") == 5 and nodes.active_pods() == 5
    nodes.add_child("wf", "wf.p3")
    nodes.add_child("wf", "wf.p3")
    assert nodes.by_name("wf").children == [made[3].id]


# ----------------------------------------------------------------------------- the upstream suite


def test_the_upstream_suite_runner_skips_without_a_checkout():
    """bench/argo_suite.py needs Argo's sources (ARGO_WORKFLOWS_SRC); without them it says so and exits 0."""
    env = {k: v for k, v in os.environ.items() if k != "ARGO_WORKFLOWS_SRC"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "argo_suite.py")], capture_output=True, text=True,
                          env=env, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("argo_suite: skipped: set ARGO_WORKFLOWS_SRC")


def test_workflow_metadata_values_take_the_global_parameters(tmp_path):
    """operator.go substitutes the global parameters into the spec (all but its templates) before
    updateWorkflowMetadata applies it, so a title annotation or a label may read {{workflow.parameters.X}};
    an unresolved tag is left as it is."""
    manifest = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"name": "meta"},
        "spec": {
            "entrypoint": "main",
            "arguments": {"parameters": [{"name": "first", "value": "41"}]},
            "workflowMetadata": {
                "labels": {"first": "{{workflow.parameters.first}}"},
                "annotations": {
                    "title": "iterations {{workflow.parameters.first}} to {{=asInt(workflow.parameters.first) + 19}}",
                    "other": "{{workflow.parameters.absent}}",
                },
            },
            "templates": [{"name": "main", "container": {"image": "alpine", "command": ["echo", "hi"]}}],
        },
    }
    result, nodes = run_in(manifest, tmp_path / "runs")
    assert result.phase == "Succeeded"
    assert result.metadata["labels"]["first"] == "41"
    assert result.metadata["annotations"]["title"] == "iterations 41 to 60"
    assert result.metadata["annotations"]["other"] == "{{workflow.parameters.absent}}"
