"""Pod nodes: a template's pod started, watched and ended as the kubelet and Argo's pod reconciliation would
(exits, deadlines, chaos, progress), and the sleep between passes on the pods' pidfds. A mixin of the controller
(workflow_controller.py), which is its only user."""

from __future__ import annotations

import re
import select
import time
from typing import Any

import yaml

from pipelines.durations import parse_duration
from pipelines.local.api.status import (
    ERROR,
    FAILED,
    PENDING,
    POD,
    RETRY,
    RUNNING,
    Node,
    fulfilled,
    node_id,
    pod_name,
)
from pipelines.local.controller.calls import Opts
from pipelines.local.controller.scope import last_attempt, result_referenced
from pipelines.local.lang.expressions import (
    substitute,
)
from pipelines.local.pods.chaos import Injection, is_spot_placed, placement
from pipelines.local.pods.pod import (
    DEADLINE_MESSAGE,
    STRIKE_MARKER,
    PlanError,
    Pod,
    PodOutcome,
    Termination,
    forget_container_processes,
    plan_pod,
    read_progress,
)  # fmt: skip
from steps.progress import PROGRESS_ANNOTATION, STRIKE_ENV

DEADLINE_EXCEEDED = "Step exceeded its deadline"
IDLE_WAIT_SECONDS = 0.1  # the longest sleep between passes while nothing happens (see Executor.wait_for_pods)
POLL_SECONDS = 0.02  # the sleep between passes while a pod can only be polled


class PodNodes:
    """Methods of the controller; `self` is a Controller."""

    def stop_all_pods(self) -> None:
        forget_container_processes()
        for pod in self.pods.values():
            pod.kill(Termination(FAILED, "stopped", keep_exit_code=True))
        for pod in self.pods.values():
            pod.wait(timeout=10)
        self.pods.clear()

    def pods_nodes(self) -> list[Node]:
        return [node for id_ in self.pods if (node := self.nodes.get(id_)) is not None]

    def wait_for_pods(self) -> None:
        """Sleep until a pod's process exits, for IDLE_WAIT_SECONDS at most (each pass checks the timers:
        retry backoffs, deadlines, chaos, grace periods), or POLL_SECONDS while some pod can only be polled.
        Reconciling on exits rather than every few milliseconds is what Argo's controller does too: here it
        starts the next pod within a millisecond or so of the last one's exit and leaves the cores to the pods
        (a pass over a long run's nodes takes milliseconds; 50 of them a second took a fifth of a core)."""
        # scaled time (MOERL_LOCAL_TIME_SCALE < 1: backoffs of milliseconds) checks its timers as often as before
        timeout = max(POLL_SECONDS, IDLE_WAIT_SECONDS * min(1.0, self.time_scale))
        waiting: dict[int, Pod] = {}
        for pod in self.pods.values():
            fd = pod.exit_fd()
            if fd is None:
                timeout = POLL_SECONDS
            else:
                waiting[fd] = pod
        if not waiting:
            time.sleep(timeout)
            return
        poller = select.poll()  # not select(): it cannot take a descriptor numbered 1024 or more (~1,000 pods)
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(timeout * 1000):
            waiting[fd].exit_seen()

    def reconcile_pods(self) -> None:
        """What the kubelet and Argo's pod reconciliation would see: exits, deadlines, chaos."""
        now = self.now
        forget_container_processes()  # the pods that end in this pass share one read of /proc
        for id_, pod in list(self.pods.items()):
            node = self.nodes.get(id_)
            assert node is not None
            if pod.running and not fulfilled(node.phase):  # (a daemoned node is fulfilled, yet still running)
                self.enforce(node, pod, now)
            outcome = pod.poll(now)
            if outcome is None:
                if pod.plan.daemon and not node.daemoned and node.phase == RUNNING and pod.ready(now):
                    node.daemoned = True  # Argo: running and ready, so the steps and tasks after it may start
                continue
            del self.pods[id_]
            node.reported_progress = read_progress(pod.plan.pod_dir)
            if pod.injection is not None and self.chaos is not None:
                if pod.injection.fired:
                    self.hit.add(id_)
                else:
                    self.chaos.missed(pod.injection)
            if not fulfilled(node.phase):
                self.apply_outcome(node, outcome)

    def read_reported_progress(self) -> None:
        """What the running pods wrote to their ARGO_PROGRESS_FILE (read when the status is written)."""
        for id_, pod in self.pods.items():
            node = self.nodes.get(id_)
            if node is not None:
                node.reported_progress = read_progress(pod.plan.pod_dir) or node.reported_progress

    def enforce(self, node: Node, pod: Pod, now: float) -> None:
        past_workflow_deadline = self.deadline is not None and now > self.deadline
        if past_workflow_deadline and node.id not in self.exit_handler_pods:
            # Argo's execution control: the node fails at once, the pod is stopped behind it.
            self.nodes.mark(node, FAILED, DEADLINE_EXCEEDED)
            pod.terminate(Termination(FAILED, DEADLINE_EXCEEDED, keep_exit_code=True), pod.plan.grace_seconds)
        elif pod.deadline is not None and now >= pod.deadline:
            pod.terminate(Termination(FAILED, DEADLINE_MESSAGE, keep_exit_code=True), pod.plan.grace_seconds)
        elif pod.injection is not None and not pod.injection.fired and self.strike_due(pod, pod.injection, now):
            injection = pod.injection
            injection.fired = True
            termination = Termination(
                injection.phase,
                injection.message,
                keep_exit_code=injection.phase == FAILED,
                override=pod.plan.job is None or pod.plan.job.launched,  # a launcher pod's end is its own
            )
            if injection.kind == "kill":
                pod.kill(termination)
            else:
                pod.terminate(termination, pod.plan.grace_seconds)

    def strike_due(self, pod: Pod, injection: Injection, now: float) -> bool:
        """A pod that reports progress: once it has stopped itself at its strike point (steps/progress.py);
        any other: `delay` seconds after its start."""
        if not injection.at_progress:
            return now >= pod.started_at + injection.delay
        pid = pod.stopped_at_strike()
        if pid is None:
            return False
        pod.struck_pid = pid
        return True

    def apply_outcome(self, node: Node, outcome: PodOutcome) -> None:
        outputs: dict[str, Any] = {}
        if outcome.parameters:
            outputs["parameters"] = outcome.parameters
        if outcome.result is not None:
            outputs["result"] = outcome.result
        if outcome.exit_code is not None:
            outputs["exitCode"] = str(outcome.exit_code)
        node.outputs = outputs or None
        node.daemoned = False
        self.add_global_outputs(node.outputs)
        self.nodes.mark(node, outcome.phase, outcome.message)

    def active_pods(self) -> int:
        return self.nodes.active_pods()

    def pod_running(self, node: Node) -> bool:
        """A Pod node whose pod is running, or a Retry node whose last attempt is one (not yet daemoned)."""
        if node.type == RETRY:
            last = last_attempt(node, self.nodes)
            if last is None or last.fulfilled:
                return False
            node = last
        return node.type == POD and node.id in self.pods and not node.fulfilled

    def execute_pod(self, node_name: str, template: dict, opts: Opts) -> Node | None:
        node = self.nodes.by_name(node_name)
        if node is not None and node.id not in self.lock_granted:
            return node
        parallelism = self.wf.spec.get("parallelism")
        if parallelism is not None and self.active_pods() >= int(parallelism) + (node is not None):
            return None
        if node is None:
            node = self.create_node(node_name, POD, template, opts, PENDING)
        else:  # it waited for a lock (sync.py) and holds it now
            self.lock_granted.discard(node.id)
        if self.deadline is not None and time.time() > self.deadline and not opts.on_exit:
            return self.nodes.mark(node, FAILED, DEADLINE_EXCEEDED)
        self.start_pod(node, template, opts)
        return node

    def start_pod(self, node: Node, template: dict, opts: Opts) -> None:
        where = placement(template, self.wf.spec)
        spot = self.is_spot(template)
        name = pod_name(self.wf.name, node.name, node.template_name)
        boundary_template = self.node_templates.get(node.boundary_id)
        try:
            plan = plan_pod(
                template,
                pod_name=name,
                node_name=node.name,
                workflow=self.wf,
                run_dir=self.run_dir,
                placement=where,
                spot=spot,
                capture_result=result_referenced(boundary_template, node.name),
                time_scale=self.time_scale,
                pod_spec_patches=self.pod_spec_patches(template, name),
            )
        except (PlanError, KeyError, ValueError, TypeError, yaml.YAMLError) as err:
            # the pod cannot be created: executeTemplate marks the node Error and returns the error, which
            # operate() wraps for the entrypoint and the exit handler (createWorkflowPod's errors)
            self.template_errors.add(node.id)
            self.nodes.mark(node, ERROR, str(err))
            return
        deadlines = []
        if template.get("activeDeadlineSeconds") is not None:
            deadlines.append(node.started_at + float(template["activeDeadlineSeconds"]))
        if template.get("timeout"):  # Argo sets the pod's activeDeadlineSeconds from it (checkTemplateTimeouts)
            try:
                deadlines.append(node.started_at + parse_duration(str(template["timeout"])))
            except ValueError as err:
                self.nodes.mark(node, ERROR, f"timeout: {err}")
                return
        if opts.execution_deadline is not None:
            deadlines.append(opts.execution_deadline)
        injection = None
        if self.chaos is not None:
            eligible = not opts.on_exit and not self.previous_attempt_hit(node)
            reports_progress = PROGRESS_ANNOTATION in ((template.get("metadata") or {}).get("annotations") or {})
            injection = self.chaos.target(name, node.name, spot, eligible, node.template_name, reports_progress)
            if injection is not None and injection.at_progress:
                plan.env[STRIKE_ENV] = f"{injection.fraction!r}:{plan.pod_dir / STRIKE_MARKER}"
        pod = Pod(plan, min(deadlines) if deadlines else None, injection, self.starter)
        self.pod_dirs[node.id] = plan.pod_dir
        if opts.on_exit:
            self.exit_handler_pods.add(node.id)
        if pod.outcome is not None:  # the program could not be started
            self.apply_outcome(node, pod.outcome)
            return
        self.pods[node.id] = pod
        self.nodes.mark(node, RUNNING)

    def pod_spec_patches(self, template: dict, pod: str) -> list[str]:
        """Argo's processPodSpecPatch: the workflow's podSpecPatch, then the template's, each substituted with
        the workflow's variables and `pod.name` (a workflow-level patch is not substituted anywhere else)."""
        scope = {**self.globals(), "pod.name": pod}
        patches = (self.wf.spec.get("podSpecPatch"), template.get("podSpecPatch"))
        return [substitute(p, scope) if isinstance(p, str) else p for p in patches if p]

    def previous_attempt_hit(self, node: Node) -> bool:
        """Whether chaos hit the attempt before this one (then this one is spared)."""
        match = re.fullmatch(r"(.*)\((\d+)\)", node.name)
        if not node.retried or match is None or match.group(2) == "0":
            return False
        return node_id(self.wf.name, f"{match.group(1)}({int(match.group(2)) - 1})") in self.hit

    def is_spot(self, template: dict) -> bool:
        where = placement(template, self.wf.spec)
        spot = is_spot_placed(where["nodeSelector"], where["affinity"])
        if template.get("resource"):  # a PyTorchJob's pods are placed by its own replica spec
            spot = spot or self._job_is_spot(template)
        return spot

    def _job_is_spot(self, template: dict) -> bool:
        text = re.sub(r"\{\{[^}]*\}\}", "x", str(template["resource"].get("manifest", "")))
        try:
            master = yaml.safe_load(text)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        except (KeyError, TypeError, ValueError):
            return False
        return is_spot_placed(master.get("nodeSelector"), master.get("affinity"))
