"""Pods: each step's container runs on this machine as a process group.

`plan_pod` turns a (substituted) container, script or resource template into a `PodPlan`: the host
command (the image is recorded, not pulled; `python`/`python3` become this interpreter), the
environment (this process's, plus the container's `env`), the working directory (workingDir where it
exists on this host, else the directory `moerl local` was started in) and the pod's sandbox
(sandbox.py). Everything the real pod spec would have held is written to the pod's `pod.json`.

`Pod` runs a plan: stdout and stderr go to files in the pod's directory, the process gets its own
process group so that a kill reaches all of its children (torchrun's workers included); a `python -m`
pod starts as a fork of a warm Python (warm.py), and one whose warm server is still importing waits for
it, as a pod waits for its image, rather than import everything itself (at most WARM_WAIT_SECONDS). When it
exits the outcome is read the way Argo's executor and controller read a finished pod: exit code 0
is Succeeded, else Failed "main: Error (exit code N)" (a signal N counts as 128+N); `result` is stdout
less one trailing newline; output parameters are read from their sandboxed paths, less one trailing
newline, falling back to valueFrom.default; a missing one with no default is an Error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.local.api.status import ERROR, FAILED, SUCCEEDED, timestamp
from pipelines.local.pods import pytorchjob
from pipelines.local.pods.chaos import Injection
from pipelines.local.pods.sandbox import Sandbox
from pipelines.local.pods.warm import PER_POD_ENV, WarmProcess, WarmStarter

MAX_RESULT_BYTES = 256 * 1024
PYTHON_RE = re.compile(r"python(\d+(\.\d+)?)?")
DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
WARM_WAIT_SECONDS = 60.0  # the longest a Python pod waits for its warm server's imports before starting cold
STRIKE_MARKER = "chaos-strike"  # in the pod's directory: the pid that stopped itself at its strike point


@dataclass
class PodPlan:
    name: str
    node_name: str
    template_name: str
    kind: str  # container, script or resource
    image: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    pod_dir: Path
    sandbox: Sandbox
    output_parameters: list[dict]
    output_paths: dict[str, Path]
    capture_result: bool
    grace_seconds: float
    spot: bool
    job: pytorchjob.PyTorchJob | None = None
    script: str | None = None
    recorded: dict = field(default_factory=dict)
    daemon: bool = False  # `daemon: true`: runs until its scope ends; exiting on its own is a failure
    readiness_probe: dict | None = None


@dataclass
class PodOutcome:
    phase: str
    message: str
    exit_code: int | None
    result: str | None
    parameters: list[dict] | None


@dataclass
class Termination:
    """Why we stopped a pod, and how its node is to be recorded."""

    phase: str
    message: str
    keep_exit_code: bool
    sigkill_at: float | None = None
    override: bool = True  # False: let the outcome follow from how the process ended (PyTorchJob)


class PlanError(Exception):
    """A template that cannot be turned into a process here; the node errors with this message."""


def host_program(program: str) -> str:
    """The image's program on this machine: any python is this interpreter; a program installed
    beside it (torchrun, moerl: this environment's console scripts) is taken from there; an absolute
    path that does not exist here is looked up by its name on PATH."""
    name = program.rsplit("/", 1)[-1]
    if PYTHON_RE.fullmatch(name):
        return sys.executable
    beside = Path(sys.executable).parent / name
    if ("/" not in program or not Path(program).exists()) and beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    if program.startswith("/") and not Path(program).exists():
        return shutil.which(name) or program
    return program


def plan_pod(
    template: dict,
    *,
    pod_name: str,
    node_name: str,
    workflow: Any,
    run_dir: Path,
    placement: dict,
    spot: bool,
    capture_result: bool,
    time_scale: float,
    pod_spec_patches: list[str] | None = None,
) -> PodPlan:
    """pod_spec_patches: the workflow's and the template's podSpecPatch, substituted as Argo's
    processPodSpecPatch substitutes them (workflow.*, pod.name); None takes them as the manifest has them."""
    kind = "script" if "script" in template else "resource" if "resource" in template else "container"
    if pod_spec_patches is None:
        pod_spec_patches = [p for p in (workflow.spec.get("podSpecPatch"), template.get("podSpecPatch")) if p]
    patches = [] if kind == "resource" else [_parse_patch(p) for p in pod_spec_patches]
    pod_dir = run_dir / "pods" / pod_name
    job = None
    if kind == "resource":
        resource = template["resource"]
        job = pytorchjob.parse_job(
            resource["manifest"], resource.get("successCondition", ""), resource.get("failureCondition", "")
        )
        container = job.container
    else:
        container = _patched_main(template[kind], patches)
    probe = container.get("readinessProbe") if template.get("daemon") else None
    if kind == "container" and (
        launched := pytorchjob.launched_job([*container.get("command", []), *container.get("args", [])])
    ):
        job, container = launched, launched.container
    outputs = (template.get("outputs") or {}).get("parameters") or []
    # output parameter -> the container file it is read from
    from_files = {p["name"]: p["valueFrom"]["path"] for p in outputs if (p.get("valueFrom") or {}).get("path")}
    mounts = _mounts(container, job.volumes if job else template.get("volumes") or [], workflow, run_dir, pod_dir)
    sandbox = Sandbox(pod_dir / "root", mounts, list(from_files.values()))

    command = [str(c) for c in container.get("command") or []]
    args = [str(a) for a in container.get("args") or []]
    if not command:  # the image's ENTRYPOINT, as the user mapped it (--entrypoint IMAGE=COMMAND)
        command = list(workflow.entrypoints.get(str(container.get("image", ""))) or [])
    if not command:
        raise PlanError(
            f"container of template {template.get('name')!r} has no command; the image's entrypoint "
            f"is not known here, so give container.command or --entrypoint IMAGE=COMMAND"
        )
    argv = [sandbox.rewrite(a) for a in command + args]
    argv[0] = host_program(argv[0])
    script = None
    if kind == "script" and container.get("source"):  # Argo appends the script's path for a non-empty source
        script = sandbox.rewrite(str(container["source"]))
        argv.append(str(pod_dir / "script"))
    if job is not None:
        argv = pytorchjob.torchrun_argv(argv, job.world_size)

    # ARGO_PROGRESS_FILE: the pod may write "N/M" there, which becomes its node's progress (as Argo's executor reads it)
    env = {"MOERL_LOCAL_SANDBOX": str(sandbox.root), "ARGO_PROGRESS_FILE": str(pod_dir / "progress")}
    for entry in container.get("env") or []:
        env[entry["name"]] = sandbox.rewrite(_env_value(entry, pod_name, workflow))
    working_dir = container.get("workingDir")
    cwd = Path.cwd()
    if working_dir:
        mapped = Path(sandbox.rewrite(str(working_dir)))
        cwd = mapped if mapped.is_dir() else Path(working_dir) if Path(working_dir).is_dir() else cwd
    grace = placement.get("terminationGracePeriodSeconds")
    grace_seconds = (30.0 if grace is None else float(grace)) * time_scale

    recorded = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": workflow.namespace,
            "labels": {"workflows.argoproj.io/workflow": workflow.name},
            "annotations": {"workflows.argoproj.io/node-name": node_name},
        },
        "spec": {
            "containers": [{**container, "name": "main"}],
            **{k: v for k, v in placement.items() if v not in (None, {}, [])},
            **{
                k: template[k]
                for k in (
                    "activeDeadlineSeconds",
                    "schedulerName",
                    "priorityClassName",
                    "serviceAccountName",
                    "securityContext",
                    "metadata",
                    "volumes",
                )
                if k in template
            },
        },
        "local": {"argv": argv, "cwd": str(cwd), "sandbox": str(sandbox.root), "env": env, "spotPlaced": spot},
    }
    for patch in patches:  # the rest of the pod spec, as Argo's ApplyPodSpecPatch merges it over the pod's
        recorded["spec"] = _strategic_merge(recorded["spec"], {k: v for k, v in patch.items() if k != "containers"})
    if job is not None:
        recorded["local"]["pytorchJob"] = job.manifest
    return PodPlan(
        name=pod_name,
        node_name=node_name,
        template_name=str(template.get("name")),
        kind=kind,
        image=str(container.get("image", "")),
        argv=argv,
        env=env,
        cwd=cwd,
        pod_dir=pod_dir,
        sandbox=sandbox,
        output_parameters=outputs,
        output_paths={name: sandbox.host_path(path) for name, path in from_files.items()},
        capture_result=capture_result,
        grace_seconds=grace_seconds,
        spot=spot,
        job=job,
        script=script,
        recorded=recorded,
        daemon=bool(template.get("daemon")),
        readiness_probe=probe,
    )


def _parse_patch(text: str | dict) -> dict:
    """A podSpecPatch: YAML or JSON of (part of) a PodSpec (workflow/util ApplyPodSpecPatch)."""
    try:
        patch = yaml.safe_load(text) if isinstance(text, str) else text
    except yaml.YAMLError as err:
        raise PlanError(f"Failed to convert the PodSpecPatch yaml to json: {err}") from err
    if not isinstance(patch, dict):
        raise PlanError(f"invalid podSpecPatch {text!r}: not a PodSpec (a JSON or YAML mapping)")
    return patch


def _patched_main(container: dict, patches: list[dict]) -> dict:
    """The main container with the podSpecPatches' `containers: [{name: main, ...}]` merged over it (the
    workflow's, then the template's), as Kubernetes' strategic merge does (workflowpod.go
    processPodSpecPatch, ApplyPodSpecPatch). Entries for Argo's own containers (wait, init) are left out:
    there are none here."""
    for patch in patches:
        for entry in patch.get("containers") or []:
            if isinstance(entry, dict) and entry.get("name") == "main":
                container = _strategic_merge(container, {k: v for k, v in entry.items() if k != "name"})
    return container


# The merge keys of the PodSpec and Container lists that Kubernetes' strategic merge merges item by item
# (patchMergeKey in k8s.io/api/core/v1 types.go); any other list is replaced whole.
MERGE_KEYS = {
    "env": "name", "volumes": "name", "volumeMounts": "mountPath", "imagePullSecrets": "name",
    "ports": "containerPort", "hostAliases": "ip", "initContainers": "name", "ephemeralContainers": "name",
}  # fmt: skip


def _strategic_merge(base: dict, patch: dict) -> dict:
    out = dict(base)
    for key, value in patch.items():
        merge_key = MERGE_KEYS.get(key)
        if merge_key is not None and isinstance(value, list) and isinstance(out.get(key), list):
            by_key = {e.get(merge_key): e for e in out[key] if isinstance(e, dict)}
            for entry in value:
                if isinstance(entry, dict):
                    old = by_key.get(entry.get(merge_key))
                    by_key[entry.get(merge_key)] = _strategic_merge(old, entry) if old is not None else entry
            out[key] = list(by_key.values())
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _strategic_merge(out[key], value)
        else:
            out[key] = value
    return out


def warm_start_candidates(templates: list[dict]) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of the container templates whose pods would share one warm server, as far as the
    template alone tells: host program mapped, env as plan_pod builds it. A template whose server
    environment depends on the pod (a parameter, a fieldRef, a path the sandbox may rewrite) is left out:
    its pods start their own server when they come. For WarmStarter.prestart."""
    found = []
    for template in templates:
        container = template.get("container")
        if not isinstance(container, dict) or not container.get("command"):
            continue
        argv = [str(c) for c in container.get("command") or []] + [str(a) for a in container.get("args") or []]
        env: dict[str, str] = {**os.environ, "MOERL_LOCAL_SANDBOX": ""}
        for entry in container.get("env") or []:
            value = entry.get("value")
            if entry.get("name") in PER_POD_ENV:
                continue
            if "valueFrom" in entry or not isinstance(value, str) or "{{" in value or value.startswith("/"):
                break
            env[entry["name"]] = value
        else:
            found.append(([host_program(argv[0]), *argv[1:]], env))
    return found


def _mounts(container: dict, pod_volumes: list[dict], workflow: Any, run_dir: Path, pod_dir: Path) -> dict[str, Path]:
    """container mountPath -> host directory, per the volume each mount names (the workflow's or the pod's)."""
    volumes = {v["name"]: v for v in (workflow.spec.get("volumes") or []) + pod_volumes}
    claims = {(c.get("metadata") or {}).get("name") for c in workflow.spec.get("volumeClaimTemplates") or []}
    mounts = {}
    for mount in container.get("volumeMounts") or []:
        name = mount.get("name")
        volume = volumes.get(name)
        if volume is None and name in claims:
            host = run_dir / "volumes" / name
        elif volume is None:
            raise PlanError(f"volume '{name}' not found in workflow spec")  # workflowpod.go addVolumeReferences
        elif "hostPath" in volume:
            host = Path(volume["hostPath"]["path"])
        elif "persistentVolumeClaim" in volume:
            host = run_dir / "volumes" / str(volume["persistentVolumeClaim"].get("claimName") or name)
        else:  # emptyDir lives and dies with the pod
            host = pod_dir / "volumes" / name
        mounts[mount["mountPath"]] = host / mount["subPath"] if mount.get("subPath") else host
    return mounts


def _env_value(entry: dict, pod_name: str, workflow: Any) -> str:
    if "valueFrom" not in entry:
        return str(entry.get("value", ""))
    field_path = ((entry["valueFrom"] or {}).get("fieldRef") or {}).get("fieldPath", "")
    known = {
        "metadata.name": pod_name,
        "metadata.namespace": workflow.namespace,
        "spec.nodeName": socket.gethostname(),
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
        "spec.serviceAccountName": str(workflow.spec.get("serviceAccountName") or "default"),
    }
    if field_path not in known:
        raise PlanError(
            f"env {entry.get('name')}: fieldRef {field_path!r} has no value here (known: {', '.join(known)})"
        )
    return known[field_path]


class Pod:
    """One running attempt of a step."""

    def __init__(
        self, plan: PodPlan, deadline: float | None, injection: Injection | None, starter: WarmStarter | None = None
    ):
        self.plan = plan
        self.deadline = deadline
        self.injection = injection
        self.termination: Termination | None = None
        self.outcome: PodOutcome | None = None
        # the process that stopped itself at its chaos strike point: signalled with the pod's process group
        # (a torchrun worker lives in a session of its own) and resumed after a SIGTERM, so that it can take it
        self.struck_pid: int | None = None
        plan.pod_dir.mkdir(parents=True, exist_ok=True)
        plan.sandbox.prepare()
        if plan.script is not None:  # staged 0755, as Argo's executor stages it: `sh -c SCRIPT` execs it
            script_path = plan.pod_dir / "script"
            script_path.write_text(plan.script)
            script_path.chmod(0o755)
        self.stdout_path = plan.pod_dir / "stdout.log"
        self.stderr_path = plan.pod_dir / "stderr.log"
        self.stdout_path.write_bytes(b"")
        self.stderr_path.write_bytes(b"")
        self.started_at = time.time()
        self.process: subprocess.Popen | WarmProcess | None = None
        self.env = {**os.environ, **plan.env}
        self.starter = starter
        self._exit_fd: int | None = None  # a pidfd of the pod's process (exit_fd)
        self._next_probe = 0.0  # when a daemon's readinessProbe may run again
        self._exit_seen = False
        # A Python pod that finds its warm server still importing waits for it (like an image pull) rather
        # than importing everything itself on the same cores: poll starts it once the server is ready.
        self.waiting_since = time.time() if starter is not None and starter.importing(plan.argv, self.env) else None
        if self.waiting_since is None:
            self._start()
        else:
            self._record()

    def _start(self) -> None:
        plan = self.plan
        self.started_at = time.time()  # chaos delays count from here
        if self.starter is not None:  # a fork of a Python that has imported torch already, if it can
            self.process = self.starter.start(plan.argv, plan.cwd, self.env, self.stdout_path, self.stderr_path)
        if self.process is None:
            with open(self.stdout_path, "ab") as stdout, open(self.stderr_path, "ab") as stderr:
                try:
                    self.process = subprocess.Popen(
                        plan.argv,
                        cwd=plan.cwd,
                        env=self.env,
                        stdout=stdout,
                        stderr=stderr,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                except OSError as err:  # the container runtime's StartError
                    self.outcome = PodOutcome(
                        FAILED, f"main: StartError (exit code 128): {_start_error(err)}", 128, None, None
                    )
        if self.process is not None:
            self._exit_fd = _pidfd(self.process.pid)
        self._record()

    def _record(self) -> None:
        self.plan.recorded["local"]["warmStart"] = isinstance(self.process, WarmProcess)
        text = json.dumps(self.plan.recorded, indent=2, default=str) + "\n"
        (self.plan.pod_dir / "pod.json").write_text(text)

    def _start_when_ready(self, now: float) -> None:
        """A waiting pod: stopped before it started, or started once its server is ready (or gave up)."""
        assert self.starter is not None and self.waiting_since is not None
        if self.termination is not None:  # killed before its container started: no process ever ran
            self.outcome = self._finish(128 + signal.SIGKILL)
        elif not self.starter.importing(self.plan.argv, self.env):
            self._start()
        elif now - self.waiting_since > WARM_WAIT_SECONDS:
            self.starter = None  # the server is slow to import: start cold after all
            self._start()

    @property
    def running(self) -> bool:
        return self.outcome is None

    def exit_fd(self) -> int | None:
        """A file descriptor that turns readable when the pod's process exits, for the executor to sleep on;
        None when the pod must be polled instead: not started yet (waiting for its warm server), no pidfd
        (not Linux, or the process was gone already), or exited with its end not read yet (a warm pod's
        exit code comes in a file that its server writes just after) (see exit_seen)."""
        if self.outcome is not None or self._exit_seen:
            return None
        return self._exit_fd

    def exit_seen(self) -> None:
        """The executor saw exit_fd readable: poll from now on until the outcome is read."""
        self._exit_seen = True

    def _close_exit_fd(self) -> None:
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None

    def poll(self, now: float) -> PodOutcome | None:
        """Advance kills that are due; once the process has exited, the pod's outcome."""
        if self.outcome is None and self.process is None and self.waiting_since is not None:
            self._start_when_ready(now)
        if self.outcome is not None or self.process is None:
            return self.outcome
        if self.termination and self.termination.sigkill_at is not None and now >= self.termination.sigkill_at:
            self._signal(signal.SIGKILL)
            self.termination.sigkill_at = None
        code = self.process.poll()
        if code is None:
            return None
        # A container ends with its main process: whatever it left running goes with it.
        self._signal_container(signal.SIGKILL)
        self._close_exit_fd()
        self.outcome = self._finish(128 - code if code < 0 else code)
        return self.outcome

    def _signal_container(self, sig: int) -> None:
        """`sig` to the pod's process group and to every process started in its container, wherever it went:
        torchrun starts each worker in a session of its own, and a process whose parent died is the init's."""
        assert self.process is not None
        own_group = os.getpgrp()
        pids: set[int] = set(container_processes(self.plan.env)) if sig == signal.SIGKILL else set()
        signalled: set[int] = set()
        # A process found between its fork and its setsid (torchrun's start_new_session) has left the group
        # it was found in by the time that group is killed: signalled by its pid too, it cannot escape. Where
        # the container has processes outside its main group (torchrun's workers), /proc is read again until
        # none is left unsignalled, for one started meanwhile; a killed process forks no more, so this ends.
        for _ in range(100):
            groups = {_pgid(pid) for pid in pids} | {self.process.pid}
            for pgid in groups - {0, own_group}:  # never the executor's own group
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
            for pid in pids - {os.getpid()}:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            signalled |= pids
            if sig != signal.SIGKILL or groups <= {self.process.pid, 0}:
                break
            pids = set(container_processes(self.plan.env, fresh=True)) - signalled
            if not pids:
                break

    def stopped_at_strike(self) -> int | None:
        """The pid that wrote the strike marker (steps/progress.py), once that process has stopped itself."""
        try:
            pid = int((self.plan.pod_dir / STRIKE_MARKER).read_text())
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:  # no marker yet, or its process is gone already (the pod is ending)
            return None
        except (OSError, ValueError):
            return None
        state = stat.rsplit(")", 1)[-1].split()[0]  # the field after the command name, which may hold spaces
        return pid if state in ("T", "t") else None

    def ready(self, now: float) -> bool:
        """Whether a running daemon's container is ready: its readinessProbe (httpGet, tcpSocket or exec,
        against this machine, after initialDelaySeconds, at most once per periodSeconds capped at 1 s here)
        passed, or it has none (Kubernetes: ready once started)."""
        if self.process is None or self.outcome is not None:
            return False
        probe = self.plan.readiness_probe
        if not probe:
            return True
        if now < self.started_at + float(probe.get("initialDelaySeconds") or 0) or now < self._next_probe:
            return False
        self._next_probe = now + min(float(probe.get("periodSeconds") or 10), 1.0)
        return _probe(probe, self.plan.cwd, self.env)

    def terminate(self, termination: Termination, grace_seconds: float) -> None:
        """SIGTERM now, SIGKILL after the grace period (the kubelet's way of stopping a pod)."""
        if self.termination is not None or self.outcome is not None:
            return
        self.termination = termination
        termination.sigkill_at = time.time() + grace_seconds
        self._signal(signal.SIGTERM)

    def kill(self, termination: Termination) -> None:
        if self.outcome is not None:
            return
        if self.termination is None:
            self.termination = termination
        self.termination.sigkill_at = None
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float) -> None:
        if self.process is not None:
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        self.poll(time.time())

    def _signal(self, sig: int) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        if sig == signal.SIGKILL:  # the kubelet's SIGKILL ends every process of the container
            self._signal_container(sig)
        else:
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if self.struck_pid is not None:
            for each in (sig, signal.SIGCONT):  # a stopped process takes a SIGTERM only once it runs again
                try:
                    os.kill(self.struck_pid, each)
                except (ProcessLookupError, PermissionError):
                    pass

    def _finish(self, exit_code: int) -> PodOutcome:
        plan = self.plan
        parameters = self._output_parameters(exit_code)
        result = self._result() if plan.capture_result else None
        termination = self.termination
        if plan.job is not None and (termination is None or not termination.override):
            return self._job_outcome(exit_code, parameters)
        if termination is not None:
            code = exit_code if termination.keep_exit_code else None
            return PodOutcome(termination.phase, termination.message, code, result, parameters)
        if exit_code != 0:
            return PodOutcome(FAILED, f"main: Error (exit code {exit_code})", exit_code, result, parameters)
        if plan.daemon:  # Argo: "Daemoned pod succeeded. Marking it as failed" (a daemon should run on)
            return PodOutcome(FAILED, "", exit_code, result, parameters)
        found = {q["name"] for q in parameters or []}
        missing = [p for p in plan.output_parameters if p["name"] in plan.output_paths and p["name"] not in found]
        if missing:
            path = missing[0]["valueFrom"]["path"]
            return PodOutcome(
                ERROR,
                f"wait: Error (exit code 1): open {path}: no such file or directory",
                exit_code,
                result,
                parameters,
            )
        return PodOutcome(SUCCEEDED, "", exit_code, result, parameters)

    def _job_outcome(self, exit_code: int, parameters: list[dict] | None) -> PodOutcome:
        job = self.plan.job
        assert job is not None
        job_object = pytorchjob.job_status(
            job, exit_code, timestamp(self.started_at) or "", timestamp(time.time()) or ""
        )
        (self.plan.pod_dir / "pytorchjob.json").write_text(json.dumps(job_object, indent=2) + "\n")
        if job.launched:  # the launcher pod's own end: a daemon's job that succeeds is a daemon that ended
            code = pytorchjob.launcher_exit(job_object)
            if code == 0:
                return PodOutcome(FAILED if self.plan.daemon else SUCCEEDED, "", 0, None, parameters)
            return PodOutcome(FAILED, f"main: Error (exit code {code})", code, None, parameters)
        try:
            ok, message = pytorchjob.match_conditions(job_object, job.success_condition, job.failure_condition)
        except ValueError as err:
            return PodOutcome(ERROR, f"main: Error (exit code 1): {err}", 1, None, None)
        params = _resource_parameters(self.plan.output_parameters, job_object)
        if ok:
            return PodOutcome(SUCCEEDED, "", 0, None, params)
        if ok is None:
            message = (
                f"PyTorchJob {job.name} ended (torchrun exit code {exit_code}) but {message[0].lower()}{message[1:]}"
            )
        return PodOutcome(FAILED, f"main: Error (exit code 1): {message}", 1, None, params)

    def _result(self) -> str:
        data = self.stdout_path.read_bytes()[-MAX_RESULT_BYTES - 1 :]
        text = data.decode(errors="replace")
        return text[:-1] if text.endswith("\n") else text

    def _output_parameters(self, exit_code: int) -> list[dict] | None:
        if not self.plan.output_parameters or self.plan.job is not None:
            return None
        found = []
        for param in self.plan.output_parameters:
            source = param.get("valueFrom") or {}
            path = self.plan.output_paths.get(param["name"])
            value = None
            if path is not None and path.is_file():
                value = path.read_text(errors="replace")
                value = value[:-1] if value.endswith("\n") else value
            elif "default" in source:
                value = str(source["default"])
            elif "valueFrom" not in param and param.get("value") is not None:  # a literal output value
                value = str(param["value"])
            if value is not None:
                found.append({**param, "value": value})
        return found


def _resource_parameters(parameters: list[dict], job_object: dict) -> list[dict] | None:
    if not parameters:
        return None
    found = []
    for param in parameters:
        source = param.get("valueFrom") or {}
        path = str(source.get("jsonPath", "")).strip("{}").lstrip(".")
        ok, value = pytorchjob.gjson_get(job_object, path) if path else (False, "")
        if ok:
            found.append({**param, "value": value})
        elif "default" in source:
            found.append({**param, "value": str(source["default"])})
    return found


def _start_error(err: OSError) -> str:
    if isinstance(err, FileNotFoundError):
        return f'exec: "{err.filename}": executable file not found in $PATH'
    return str(err)


def tail(path: Path, lines: int = 12) -> list[str]:
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return []
    return data.decode(errors="replace").splitlines()[-lines:]


def _pidfd(pid: int) -> int | None:
    """A pidfd of process pid (readable once it exits), or None: no pidfds here, or it is gone already."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def read_progress(pod_dir: Path) -> tuple[int, int] | None:
    """The "N/M" a pod wrote to its ARGO_PROGRESS_FILE, if it wrote a valid one (0 <= N <= M, M > 0)."""
    try:
        text = (pod_dir / "progress").read_text().strip()
    except OSError:
        return None
    done, sep, total = text.partition("/")
    if not sep or not done.isdigit() or not total.isdigit() or not 0 <= int(done) <= int(total) or int(total) == 0:
        return None
    return int(done), int(total)


SANDBOX_TAG = b"MOERL_LOCAL_SANDBOX="
_process_index: dict[bytes, list[int]] | None = None  # sandbox tag -> pids, read once per controller pass


def forget_container_processes() -> None:
    """Drop the index of which process belongs to which pod: the controller calls this at the start of each
    pass, so that all the pods that end in one pass share one read of /proc (a read per ending pod would make
    a run of N pods read N x processes environments: quadratic at a thousand concurrent pods)."""
    global _process_index
    _process_index = None


def _read_process_index() -> dict[bytes, list[int]]:
    index: dict[bytes, list[int]] = {}
    # os.listdir, not Path.glob("[0-9]*/environ"): glob stats each match, and a process that ends between the
    # listing and the stat raises ProcessLookupError (ESRCH), which pathlib's exists() does not take for "absent"
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            entries = Path("/proc", name, "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile, or another user's
        for entry in entries:
            if entry.startswith(SANDBOX_TAG):
                index.setdefault(entry, []).append(int(name))
                break
    return index


def container_processes(pod_env: dict[str, str], fresh: bool = False) -> list[int]:
    """The processes started in a pod's container: those whose environment carries its sandbox (each pod's
    own MOERL_LOCAL_SANDBOX), as a cgroup holds a container's processes. A pod started as a fork of the warm
    server does not show it (a fork's /proc environ is its parent's); its process group does. From the pass's
    index, or read anew (`fresh`)."""
    global _process_index
    tag = SANDBOX_TAG + pod_env.get("MOERL_LOCAL_SANDBOX", "").encode()
    if tag == SANDBOX_TAG:
        return []
    if fresh:
        return _read_process_index().get(tag, [])
    if _process_index is None:
        _process_index = _read_process_index()
    return list(_process_index.get(tag, []))


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return 0


def _probe(probe: dict, cwd: Path, env: dict[str, str]) -> bool:
    """One readinessProbe, as the kubelet runs it, against 127.0.0.1 (timeoutSeconds capped at 1 s)."""
    timeout = min(float(probe.get("timeoutSeconds") or 1), 1.0)
    if probe.get("httpGet"):
        get = probe["httpGet"]
        scheme = str(get.get("scheme") or "HTTP").lower()
        url = f"{scheme}://{get.get('host') or '127.0.0.1'}:{get.get('port')}{get.get('path') or '/'}"
        request = urllib.request.Request(url, headers={h["name"]: h["value"] for h in get.get("httpHeaders") or []})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return 200 <= response.status < 400
        except (OSError, ValueError):  # refused, timed out, or an HTTP error status (>= 400)
            return False
    if probe.get("tcpSocket"):
        sock = probe["tcpSocket"]
        try:
            with socket.create_connection((sock.get("host") or "127.0.0.1", int(sock.get("port"))), timeout=timeout):
                return True
        except (OSError, ValueError):
            return False
    if probe.get("exec"):
        argv = [str(a) for a in probe["exec"].get("command") or []]
        argv[:1] = [host_program(argv[0])] if argv else []  # the image's python is this one, as for the command
        try:
            done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0
    return True
