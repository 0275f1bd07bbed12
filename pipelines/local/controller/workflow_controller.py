"""The controller loop: Argo's workflow operator, run against processes on this machine.

Each pass (`operate`) does what one reconciliation of Argo's controller does: read what the pods did
(`reconcile_pods`: exits, deadlines, chaos), walk the workflow from its entrypoint
(`execute_template`), creating the nodes and starting the pods whose turn has come, then run the exit
handler and settle the workflow's phase. The walk is idempotent (a node that exists is looked at, not
made again), so the code that starts a step is the code that later notices it finished, as in Argo.
Steps and DAG templates are walked by steps_template.py and dag_template.py.

Argo's wording is kept wherever a message reaches the status: "child 'ID' failed", "No more retries
left", "Backoff for 2 seconds", "retryStrategy.expression evaluated to false", "Step exceeded its
deadline", "when 'x == y' evaluated false", "omitted: depends condition not met".
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from pipelines.durations import parse_duration
from pipelines.local.api.fields import LEAF_TYPES, merge_defaults, template_type
from pipelines.local.api.manifest import Workflow
from pipelines.local.api.status import (
    DAG,
    ERROR,
    FAILED,
    OMITTED,
    PENDING,
    POD,
    RETRY,
    RUNNING,
    SKIPPED,
    SKIPPED_PHASE,
    STEPS,
    SUCCEEDED,
    SUSPEND,
    TASK_GROUP,
    Node,
    Nodes,
    WorkflowStatus,
    fulfilled,
    node_id,
    pod_name,
    timestamp,
    write_json_atomic,
)
from pipelines.local.controller.calls import Call, Opts, TemplateError, exit_hook_of
from pipelines.local.controller.dag_template import execute_dag
from pipelines.local.controller.memoize import MemoizeError, Memoizer
from pipelines.local.controller.pod_nodes import PodNodes
from pipelines.local.controller.retries import RetryNodes
from pipelines.local.controller.scope import add_node_ref, last_attempt
from pipelines.local.controller.steps_template import ABSENT_OPTIONAL, execute_steps
from pipelines.local.controller.sync import LockError, LockManager
from pipelines.local.lang import exprlang
from pipelines.local.lang.expressions import (
    SubstitutionError,
    expand,
    substitute,
)
from pipelines.local.lang.functions import go_json
from pipelines.local.pods.chaos import ChaosMonkey, ChaosSpec
from pipelines.local.pods.pod import (
    Pod,
    Termination,
    warm_start_candidates,
)  # fmt: skip
from pipelines.local.pods.warm import WarmStarter, warm_starts_enabled
from steps.errors import MoerlError

WORKFLOW_HOLDER = "workflow"  # the holder of spec.synchronization's locks (node IDs hold the templates')
NODE_TYPES = {"container": POD, "script": POD, "resource": POD, "steps": STEPS, "dag": DAG, "suspend": SUSPEND}
MAX_PASSES_WITHOUT_WAIT = 10  # passes in a row that changed something before a sleep anyway
STATUS_INTERVAL_SECONDS = 1.0  # the shortest time between two writes of the status file


def time_scale_from_env() -> float:
    raw = os.environ.get("MOERL_LOCAL_TIME_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        scale = -1.0
    if not scale > 0:
        raise MoerlError(
            f"MOERL_LOCAL_TIME_SCALE={raw!r}: expected a number above 0 (1 is real time, 0.01 is 100x faster backoffs)"
        )
    return scale


class _WorkflowEnded(Exception):
    """The workflow ended before its entrypoint ran (a lock that cannot be set up); the status says why."""


class View(Protocol):
    def update(self, controller: Controller) -> None: ...
    def finish(self, controller: Controller) -> None: ...


class Controller(PodNodes, RetryNodes):
    def __init__(
        self,
        workflow: Workflow,
        workdir: Path,
        chaos: ChaosSpec | None = None,
        status_out: Path | None = None,
        view: View | None = None,
        time_scale: float | None = None,
        warm_start: bool | WarmStarter | None = None,
    ):
        self.wf = workflow
        self.nodes = Nodes(workflow.name)
        self.status = WorkflowStatus()
        self.run_dir = Path(workdir) / workflow.name
        self.status_out = status_out
        self.view = view
        self.time_scale = time_scale_from_env() if time_scale is None else time_scale
        self.chaos = ChaosMonkey(chaos) if chaos and chaos.enabled else None
        if self.chaos is not None:
            spot = {name for name, t in workflow.templates.items() if self.is_spot(t)}
            self.chaos.check_aims(workflow.templates, spot)
        self.pods: dict[str, Pod] = {}  # node ID -> the pod running it
        self.pod_dirs: dict[str, Path] = {}  # node ID -> its pod's directory (logs, pod.json)
        self.hit: set[str] = set()  # node IDs of attempts that chaos hit
        self.exit_handler_pods: set[str] = set()  # node IDs of pods of exit handlers (no deadline, no chaos)
        self.node_templates: dict[str, dict] = {}  # steps/DAG node ID -> its processed template
        self.global_outputs: dict[str, str] = {}
        self.exit_scope: dict[str, str] = {}  # workflow.status and workflow.failures, once main is done
        self.deadline: float | None = None
        # mutexes and semaphores (sync.py), shared through the workdir with other runs
        self.locks = LockManager(
            Path(workdir) / ".sync",
            workflow.namespace,
            workflow.configmaps,
            workflow_key=f"{workflow.namespace}/{workflow.name}",
            priority=int(workflow.spec.get("priority") or 0),
            created_at=workflow.created_at,
        )
        self.stop_requested: int | None = None  # an exit status: a SIGTERM asked the run to stop (run.py)
        self.template_errors: set[str] = set()  # node IDs whose template could not be executed (error_node)
        self.lock_granted: set[str] = set()  # node IDs that waited for a lock, got it, and have yet to start
        self.memo = Memoizer(Path(workdir) / ".memoize")
        self.now = time.time()
        self._last_status_write = 0.0
        self._status_interval = STATUS_INTERVAL_SECONDS
        self._last_status_state: tuple | None = None  # what the last status write showed (write_status)
        self.status_writes = 0  # how many times the status file was written (write_status)
        self._globals: dict[str, Any] | None = None
        if warm_start is None:
            warm_start = warm_starts_enabled()
        # python -m pods start as forks of a Python that has imported torch already (warm.py)
        self.starter = warm_start if isinstance(warm_start, WarmStarter) else WarmStarter() if warm_start else None

    # ------------------------------------------------------------------------- the loop

    def run(self) -> dict[str, Any]:
        """Run the workflow to its end; returns the Argo status object."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.now = time.time()
        self.status.phase = RUNNING
        self.status.started_at = self.now
        seconds = self.wf.spec.get("activeDeadlineSeconds")
        if seconds is not None:
            self.deadline = float(int(self.now)) + float(int(seconds))
        try:
            self.apply_workflow_metadata()
        except (MoerlError, exprlang.ExprError) as err:  # Argo marks the workflow Error before any node runs
            self.status.phase, self.status.message, self.status.finished_at = ERROR, str(err), time.time()
            self.write_status(force=True)
            return self.status.to_argo(self.nodes)
        try:
            if self.starter is not None:  # the servers import while the first pods (plan, downloads) run
                for argv, env in warm_start_candidates(list(self.wf.templates.values())):
                    self.starter.prestart(argv, env)
            progress, passes_without_wait = self.progress(), 0
            while True:
                if self.stop_requested is not None:
                    raise SystemExit(self.stop_requested)
                self.now = time.time()
                if self.operate():
                    break
                if self.view is not None:
                    self.view.update(self)
                self.write_status()
                # A pass that moved something (a pod ended or started, a node changed phase) may have made
                # more work ready: the next pass comes at once. Otherwise sleep until a pod exits.
                before, progress = progress, self.progress()
                if progress != before and passes_without_wait < MAX_PASSES_WITHOUT_WAIT:
                    passes_without_wait += 1
                    continue
                passes_without_wait = 0
                self.wait_for_pods()
        except _WorkflowEnded:
            self.status.finished_at = time.time()
        except BaseException:  # Ctrl-C, or a bug: stop the pods and leave a status that says so
            self.abort("the local executor was interrupted")
            raise
        finally:
            self.stop_all_pods()
            self.locks.release_all()
            if self.starter is not None:
                self.starter.close()
            self.write_status(force=True)
            if self.view is not None:
                self.view.finish(self)
        return self.status.to_argo(self.nodes)

    def stop_daemons_out_of_scope(self, root: Node | None) -> None:
        """Argo's killDaemonedChildren: once the steps or DAG node a daemon belongs to is fulfilled (the
        workflow's root, for one at the top), its pod is stopped and its node Succeeded, whatever its phase: a
        daemon's Retry node stays daemoned after its attempt's pod ended, retried or out of retries
        (daemon_lost)."""
        for node in self.nodes:
            if not node.daemoned:
                continue
            boundary = self.nodes.get(node.boundary_id) if node.boundary_id else root
            if boundary is None or not fulfilled(boundary.phase):
                continue
            node.daemoned = False
            pod = self.pods.get(node.id)
            if pod is not None:
                pod.terminate(Termination(SUCCEEDED, "", keep_exit_code=False), pod.plan.grace_seconds)
            self.nodes.mark(node, SUCCEEDED)

    def workflow_lock_acquired(self) -> bool:
        """Argo's workflow-level synchronization: the workflow stays Pending, with the lock's message, until
        it holds every lock of spec.synchronization (released when it ends)."""
        sync = self.wf.spec.get("synchronization")
        if not sync or self.locks.holding(WORKFLOW_HOLDER):
            return True
        try:
            acquired, message = self.locks.try_acquire(WORKFLOW_HOLDER, sync)
        except LockError as err:
            self.status.phase, self.status.message = FAILED, f"Failed to acquire the synchronization lock. {err}"
            raise _WorkflowEnded from err
        if not acquired:
            self.status.phase, self.status.message = PENDING, message
            return False
        self.status.phase, self.status.message = RUNNING, ""
        return True

    def settle_fulfilled_holders(self) -> None:
        """Release the locks of nodes that have finished, and put the outputs of memoized nodes that
        succeeded in their cache (Argo does both once it sees the node fulfilled)."""
        for holder in list(self.locks.held):
            node = self.nodes.get(holder)
            if holder != WORKFLOW_HOLDER and (node is None or node.fulfilled):
                self.locks.release(holder)
        for id_ in list(self.memo.pending):
            node = self.nodes.get(id_)
            if node is not None and fulfilled(node.phase):  # done (a daemoned node runs on: not yet)
                self.memo.settle(node)

    def wait_for_locks(self, node: Node | None, node_name: str, template: dict, call: Call, opts: Opts) -> Node | None:
        """A template's synchronization: None once the node holds every lock; else its node, Pending with
        Argo's waiting message (created as the node the template will run as)."""
        id_ = node_id(self.wf.name, node_name)
        try:
            acquired, message = self.locks.try_acquire(id_, template["synchronization"])
        except LockError as err:
            return self.error_node(node, node_name, call, opts, str(err))
        if acquired:
            if node is not None and node.phase == PENDING:  # it waited: now it runs
                node.message = ""
                if node.type == POD:
                    self.lock_granted.add(node.id)
                else:
                    node.phase = RUNNING
            return None
        if node is None:
            kind = RETRY if self.retry_strategy(template) is not None else NODE_TYPES[template_type(template)]
            return self.create_node(node_name, kind, template, opts, PENDING, message)
        for key in ("timeout", "pendingTimeout"):  # checkTemplateTimeouts: a Pending node past either fails
            try:
                past = bool(template.get(key)) and time.time() > node.started_at + parse_duration(str(template[key]))
            except ValueError as err:
                return self.error_node(node, node_name, call, opts, f"{key}: {err}")
            if past:
                return self.nodes.mark(node, FAILED, "timeout")
        node.message = message
        return node

    def apply_workflow_metadata(self) -> None:
        """Argo's updateWorkflowMetadata: spec.workflowMetadata's labels, annotations and labelsFrom
        expressions become the workflow's own, and so `{{workflow.labels.NAME}}`."""
        metadata = self.wf.spec.get("workflowMetadata") or {}
        # Argo substitutes the global parameters into the spec (all but its templates) before it applies the
        # metadata (operator.go: substituteGlobalVariables, then updateWorkflowMetadata), unresolved tags kept.
        given = {key: metadata.get(key) or {} for key in ("labels", "annotations")}
        metadata = {**metadata, **substitute(given, self.globals())}
        for name, value in (metadata.get("labels") or {}).items():
            self.wf.labels[str(name)] = text_of(value)
        for name, value in (metadata.get("annotations") or {}).items():
            self.wf.annotations[str(name)] = text_of(value)
        self._globals = None
        for name, source in (metadata.get("labelsFrom") or {}).items():
            expression = str((source or {}).get("expression", ""))
            value = exprlang.evaluate(expression, expand(self.globals()))
            if not isinstance(value, str):
                raise MoerlError(
                    f'workflowMetadata.labelsFrom.{name}: failed to evaluate label "{name}" expression '
                    f'"{expression}" evaluted to {type(value).__name__} but must be a string'
                )
            self.wf.labels[str(name)] = value
        self._globals = None

    def operate(self) -> bool:
        """One reconciliation; True once the workflow has finished."""
        self._globals = None
        self.reconcile_pods()
        self.settle_fulfilled_holders()
        if not self.workflow_lock_acquired():
            return False
        root = self.execute_template(
            self.wf.name,
            Call({"template": self.wf.spec["entrypoint"], "arguments": self.wf.spec.get("arguments") or {}}, "root"),
            Opts(),
        )
        self.stop_daemons_out_of_scope(root)
        if root is not None and root.id in self.template_errors:  # operate(): the workflow errs at once
            self.settle_error(f"error in entry template execution: {root.message}")
            return True
        if root is None or not root.fulfilled:
            return False
        workflow_phase = {
            SUCCEEDED: SUCCEEDED,
            SKIPPED_PHASE: SUCCEEDED,
            OMITTED: SUCCEEDED,
            FAILED: FAILED,
            ERROR: ERROR,
        }[root.phase]
        self.exit_scope = {
            "workflow.status": workflow_phase,
            "workflow.failures": json.dumps(json.dumps(self.nodes.failures(), separators=(",", ":"))),
        }
        self._globals = None
        exit_node = None
        hook = exit_hook_of(self.wf.spec)
        if hook is not None:
            exit_node = self.execute_template(
                f"{self.wf.name}.onExit", Call(hook, "hook"), Opts(on_exit=True, hooked=True)
            )
            if exit_node is not None and exit_node.id in self.template_errors:
                self.settle_error(f"error in exit template execution : {exit_node.message}")
                return True
            if exit_node is None or not exit_node.fulfilled:
                return False
        self.settle(workflow_phase, root, exit_node)
        return True

    def settle(self, phase: str, root: Node, exit_node: Node | None) -> None:
        """The workflow's final phase and message, as Argo's operate() decides them."""
        message = root.message
        if phase == SUCCEEDED and exit_node is not None and exit_node.failed_or_error:
            phase, message = exit_node.phase, exit_node.message
        elif phase == SUCCEEDED:
            message = ""
        self.status.phase = phase
        self.status.message = message
        self.status.finished_at = time.time()
        if self.global_outputs:
            self.status.outputs = {"parameters": [{"name": k, "value": v} for k, v in self.global_outputs.items()]}

    def settle_error(self, message: str) -> None:
        """Argo's markWorkflowError after executeTemplate returned an error for the entrypoint or exit handler."""
        self.status.phase, self.status.message, self.status.finished_at = ERROR, message, time.time()

    def abort(self, message: str) -> None:
        for node in self.nodes:
            if not node.fulfilled:
                self.nodes.mark(node, FAILED, message)
        self.status.phase = FAILED
        self.status.message = message
        self.status.finished_at = time.time()

    def write_status(self, force: bool = False) -> None:
        """The status file, at most once a second and only when something changed since the last write (or
        forced, at the end). A write of thousands of nodes takes a while: the next one waits ten times as long
        as that took, so that writing the status never takes more than a tenth of the controller's time."""
        if self.status_out is None:
            return
        now = time.time()
        if not force and (now - self._last_status_write < self._status_interval):
            return
        self.read_reported_progress()
        # progress() covers the pods and the nodes' phases and messages; reported progress is read just above
        changed = (
            self.status.phase,
            self.status.message,
            self.progress(),
            tuple(n.reported_progress for n in self.pods_nodes()),
        )
        if not force and changed == self._last_status_state:
            return
        self._last_status_state = changed
        write_json_atomic(self.status_out, self.status.to_argo(self.nodes))
        self.status_writes += 1
        took = time.time() - now
        self._last_status_write = time.time()
        self._status_interval = max(STATUS_INTERVAL_SECONDS, 10 * took)


    # ------------------------------------------------------------------------- pods

    def progress(self) -> tuple:
        """What a pass can change: the running pods, and each node's phase and message."""
        return tuple(self.pods), tuple((n.phase, n.message) for n in self.nodes)

    def add_global_outputs(self, outputs: dict | None) -> None:
        for param in (outputs or {}).get("parameters") or []:
            if param.get("globalName") and param.get("value") is not None:
                self.global_outputs[param["globalName"]] = param["value"]
                self._globals = None

    def active_children(self, boundary_id: str) -> int:
        return self.nodes.active_children(boundary_id)

    # ------------------------------------------------------------------------- scopes

    def globals(self) -> dict[str, Any]:
        """The workflow.* variables (Argo's globalParams), computed once per pass."""
        if self._globals is None:
            self._globals = self._compute_globals()
        return self._globals

    def _compute_globals(self) -> dict[str, Any]:
        wf = self.wf
        created = time.gmtime(int(wf.created_at))
        params = (wf.spec.get("arguments") or {}).get("parameters") or []
        scope: dict[str, Any] = {
            "workflow.name": wf.name,
            "workflow.namespace": wf.namespace,
            "workflow.uid": wf.uid,
            "workflow.mainEntrypoint": wf.spec.get("entrypoint"),
            "workflow.serviceAccountName": wf.spec.get("serviceAccountName") or "",
            "workflow.creationTimestamp": timestamp(wf.created_at),
            "workflow.creationTimestamp.RFC3339": timestamp(wf.created_at),
            "workflow.parameters": go_json(params),
            "workflow.parameters.json": go_json(params),
            "workflow.annotations": go_json(wf.annotations),
            "workflow.annotations.json": go_json(wf.annotations),
            "workflow.labels": go_json(wf.labels),
            "workflow.labels.json": go_json(wf.labels),
            "workflow.status": self.status.phase,
            "workflow.duration": f"{self.duration():f}",
        }
        for char in "aAbBcCdDeFgGhHIjklmMnpPrRsStTuUVwWxXyYzZ":
            try:
                scope[f"workflow.creationTimestamp.{char}"] = time.strftime("%" + char, created)
            except ValueError:
                pass
        scope["workflow.creationTimestamp.s"] = str(int(wf.created_at))
        if wf.spec.get("priority") is not None:
            scope["workflow.priority"] = str(wf.spec["priority"])
        for param in params:
            scope[f"workflow.parameters.{param['name']}"] = text_of(param.get("value"))
        scope.update({f"workflow.annotations.{k}": v for k, v in wf.annotations.items()})
        scope.update({f"workflow.labels.{k}": v for k, v in wf.labels.items()})
        scope.update({f"workflow.outputs.parameters.{k}": v for k, v in self.global_outputs.items()})
        scope.update(self.exit_scope)
        return scope

    def duration(self) -> float:
        now = time.time()
        return max(0.0, (self.status.finished_at or now) - (self.status.started_at or now))

    # ------------------------------------------------------------------------- templates

    def templates_in(self, scope: tuple[bool, str] | None) -> dict[str, dict]:
        return self.wf.templates if scope is None else self.wf.library[scope]

    def resolve(self, call: Call) -> tuple[dict, tuple[bool, str] | None]:
        """The template a call names, and the scope its own references resolve in."""
        ref = call.holder.get("templateRef")
        if ref:
            scope = (bool(ref.get("clusterScope")), str(ref.get("name")))
            templates = self.wf.library.get(scope, {})
            name = ref.get("template")
        else:
            scope = call.scope
            templates = self.templates_in(scope)
            name = call.holder.get("template")
        if name not in templates:
            raise TemplateError(f"template name '{name}' undefined")
        template = copy.deepcopy(templates[name])
        defaults = self.wf.spec.get("templateDefaults")
        if defaults:
            template = merge_defaults(defaults, template)
        return template, scope

    def process_args(self, template: dict, arguments: dict | None, local: dict[str, Any]) -> dict:
        """Argo's ProcessArgs: input values from arguments (or defaults), then substitution of the
        workflow's and the node's variables, then of the inputs."""
        supplied = {p.get("name"): p for p in (arguments or {}).get("parameters") or []}
        for param in (template.get("inputs") or {}).get("parameters") or []:
            value = param.get("value")
            if value is None:
                value = (param.get("valueFrom") or {}).get("default", param.get("default"))
            argument = supplied.get(param["name"])
            if argument is not None and argument.get("value") == ABSENT_OPTIONAL:  # (common/util.go ProcessArgs)
                if value is None and param.get("valueFrom") is None:
                    raise TemplateError(
                        f"inputs.parameters.{param['name']}: argument references an absent optional "
                        f"(skipped/omitted node output with no default)"
                    )
            elif argument is not None and argument.get("value") is not None:
                value = argument["value"]
            if value is None:
                raise TemplateError(f"inputs.parameters.{param['name']} was not supplied")
            param["value"] = text_of(value)
        scope = {**self.globals(), **local}
        template = substitute(template, scope)
        inputs = (template.get("inputs") or {}).get("parameters") or []
        for param in inputs:
            scope[f"inputs.parameters.{param['name']}"] = param["value"]
        scope["inputs.parameters"] = go_json(inputs)
        for param in (template.get("outputs") or {}).get("parameters") or []:
            if (param.get("valueFrom") or {}).get("path"):
                scope[f"outputs.parameters.{param['name']}.path"] = param["valueFrom"]["path"]
        return substitute(template, scope)

    def execute_template(self, node_name: str, call: Call, opts: Opts) -> Node | None:
        """Argo's executeTemplate: the node for `node_name`, created (and its pod started) if its
        turn has come; None when parallelism holds it back."""
        node = self.nodes.by_name(node_name)
        if node is not None and self.settled(node):
            return node
        if node is not None and node.id not in self.lock_granted and self.pod_running(node):
            # Its pod runs: what follows would resolve and substitute its template again only to find the same
            # node (execute_pod returns it as it is); skipping that keeps a pass over thousands of running pods
            # cheap. Its end is read by reconcile_pods, and the next pass goes on from there.
            return node
        try:
            template, scope = self.resolve(call)
            local: dict[str, Any] = {"node.name": node_name}
            if call.kind == "step":
                local["steps.name"] = call.holder.get("name")
            if call.kind == "task":
                local["tasks.name"] = call.holder.get("name")
            if template_type(template) in LEAF_TYPES and self.retry_strategy(template) is None:
                local["pod.name"] = pod_name(self.wf.name, node_name, template.get("name", ""))
            processed = self.process_args(template, call.holder.get("arguments"), local)
        except (TemplateError, SubstitutionError) as err:
            return self.error_node(node, node_name, call, opts, str(err))
        if node is None and self.boundary_parallelism_reached(opts.boundary_id):
            return None
        unlocked = False  # a node that waited for its locks and holds them now (Argo's unlockedNode)
        if processed.get("synchronization") and not self.locks.holding(node_id(self.wf.name, node_name)):
            waiting = self.wait_for_locks(node, node_name, processed, call, opts)
            if waiting is not None:
                return waiting
            unlocked = node is not None
        if processed.get("memoize") and (node is None or unlocked):  # the cache is read before the node runs
            try:
                hit = self.memo.lookup(processed["memoize"])
            except MemoizeError as err:
                return self.error_node(node, node_name, call, opts, str(err))
            if hit is not None:
                return self.cache_hit_node(node, node_name, processed, opts, hit)
        retry = self.retry_strategy(processed)
        if retry is None:
            started = self.dispatch(node_name, processed, call, opts, scope)
        else:
            started = self.execute_retries(node, node_name, processed, call, opts, scope, retry)
        if started is not None and fulfilled(started.phase) and started.id in self.memo.pending:
            # saved where it is marked Succeeded (executeSteps, executeDAG): a step later in this pass with
            # the same key is a hit (TestStepLevelMemoize)
            self.memo.settle(started)
        return started

    def cache_hit_node(self, node: Node | None, node_name: str, template: dict, opts: Opts, hit: dict) -> Node:
        """Argo's initializeCacheHitNode (updateAsCacheHitNode for a node that waited for a lock): the node, of
        the template's node type (Template.GetNodeType: Retry for a template with its own retryStrategy),
        Succeeded at once with the cached outputs and memoizationStatus.hit."""
        if node is None:
            kind = RETRY if template.get("retryStrategy") is not None else NODE_TYPES[template_type(template)]
            node = self.create_node(node_name, kind, template, opts, RUNNING)
        self.lock_granted.discard(node.id)
        self.memo.pending.pop(node.id, None)  # served from the cache: not saved again
        node.outputs = hit["outputs"]
        node.memoization = {"hit": True, "key": hit["key"], "cacheName": hit["cacheName"]}
        self.add_global_outputs(node.outputs)
        return self.nodes.mark(node, SUCCEEDED, "")

    def dispatch(self, node_name: str, template: dict, call: Call, opts: Opts, scope: Any) -> Node | None:
        kind = template_type(template)
        if kind in LEAF_TYPES:
            return self.execute_pod(node_name, template, opts)
        if kind == "steps":
            return execute_steps(self, node_name, template, opts, scope)
        if kind == "dag":
            return execute_dag(self, node_name, template, opts, scope)
        if kind == "suspend":
            return self.execute_suspend(node_name, template, opts)
        return self.error_node(None, node_name, call, opts, f"Template '{template.get('name')}' missing specification")

    def create_node(self, name: str, type_: str, template: dict, opts: Opts, phase: str, message: str = "") -> Node:
        node = self.nodes.create(
            name,
            type_,
            str(template.get("name", "")),
            opts.boundary_id,
            phase,
            message=message,
            display_parent=opts.display_parent,
            hooked=opts.hooked,
        )
        node.retried = opts.retried
        if template.get("memoize"):  # initializeExecutableNode: every node of a memoized template (attempts too)
            node.memoization = self.memo.track(node, template["memoize"])
        inputs = (template.get("inputs") or {}).get("parameters")
        if inputs:
            kept = ("name", "value", "default", "enum", "description")
            node.inputs = {"parameters": [{k: v for k, v in p.items() if k in kept} for p in inputs]}
        return node

    def error_node(self, node: Node | None, name: str, call: Call, opts: Opts, message: str) -> Node:
        """Argo's initializeNodeOrMarkError: a new node of type Skipped in phase Error, or the
        existing node marked Error. (executeTemplate returns the error too: template_errors.)"""
        self.template_errors.add(node_id(self.wf.name, name))
        if node is not None:
            return self.nodes.mark(node, ERROR, message)
        template_name = str(call.holder.get("template") or (call.holder.get("templateRef") or {}).get("template", ""))
        return self.nodes.create(
            name, SKIPPED, template_name, opts.boundary_id, ERROR, message=message,
            display_parent=opts.display_parent, hooked=opts.hooked,
        )  # fmt: skip

    def boundary_parallelism_reached(self, boundary_id: str) -> bool:
        template = self.node_templates.get(boundary_id)
        if template is None or template.get("parallelism") is None:
            return False
        return self.active_children(boundary_id) >= int(template["parallelism"])

    # ------------------------------------------------------------------------- retries

    def settled(self, node: Node) -> bool:
        """Fulfilled, and so left alone by this pass, unless it is a lost daemon that Argo retries."""
        return node.fulfilled and not self.daemon_lost(node)


    # ------------------------------------------------------------------------- pods and suspends

    def execute_suspend(self, node_name: str, template: dict, opts: Opts) -> Node:
        node = self.nodes.by_name(node_name) or self.create_node(node_name, SUSPEND, template, opts, RUNNING)
        seconds = parse_duration(template["suspend"]["duration"]) * self.time_scale
        if time.time() >= node.started_at + seconds:
            self.nodes.mark(node, SUCCEEDED)
        return node

    # ------------------------------------------------------------------------- exit hooks

    def run_exit_hook(
        self,
        hook: dict,
        parent: Node,
        boundary_id: str,
        scope: dict,
        prefix: str,
        name: str,
        call_scope: tuple[bool, str] | None,
    ) -> Node | None:
        """Argo's runOnExitNode: `<parent>.onExit`, run once the parent completed."""
        outputs = (last_attempt(parent, self.nodes) or parent).outputs or {}
        hook_scope = dict(scope)
        for param in outputs.get("parameters") or []:
            hook_scope[f"{prefix}.{name}.outputs.parameters.{param['name']}"] = str(param.get("value", ""))
        add_node_ref(hook_scope, prefix, name, parent, self.nodes)
        holder = dict(hook)
        if holder.get("arguments"):
            holder["arguments"] = substitute(holder["arguments"], {**self.globals(), **hook_scope})
        hook_node = self.execute_template(
            f"{parent.name}.onExit",
            Call(holder, "hook", call_scope),
            Opts(boundary_id=boundary_id, display_parent=parent.id, on_exit=True, hooked=True),
        )
        if hook_node is not None:
            self.nodes.add_child(parent.name, hook_node.name)
        return hook_node

    # ------------------------------------------------------------------------- graph

    def outbound_nodes(self, id_: str) -> list[str]:
        """Argo's getOutboundNodes: the nodes the next step group or dependent task hangs from."""
        node = self.nodes.get(id_)
        if node is None:
            return []
        if node.type in (SKIPPED, SUSPEND, POD):
            return [node.id]
        if node.type == TASK_GROUP:
            if not node.children:
                return [node.id]
            return [out for child in node.children for out in self.outbound_nodes(child)]
        if node.type == RETRY:
            return [node.children[-1]] if node.children else []
        return [out for child in node.outbound_nodes for out in self.outbound_nodes(child)]


# ----------------------------------------------------------------------------- helpers


def text_of(value: Any) -> str:
    """An AnyString: YAML numbers and booleans become their JSON text."""
    if value is None:
        return ""
    return value if isinstance(value, str) else go_json(value)


