"""Run an Argo manifest on this machine: the entry point for the CLI and for Python callers, and the one
face of the executor that code outside pipelines/local/ uses (with RunResult and parse_chaos).

from pipelines.local import run_workflow
result = run_workflow("workflow.yaml", parameters={"iterations": "2"}, chaos="preempt=1,kill=0,seed=3")
result.succeeded, result.status["nodes"]
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.local.api.manifest import load_workflow
from pipelines.local.api.status import SUCCEEDED
from pipelines.local.controller.workflow_controller import Controller, View
from pipelines.local.pods.chaos import Injection, parse_chaos
from pipelines.local.pods.pod import warm_start_candidates
from pipelines.local.pods.warm import LIBRARIES, WarmStarter, warm_starts_enabled
from pipelines.local.view import LiveView, PlainView
from steps.errors import MoerlError

DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "moerl-local"


@dataclass
class RunResult:
    name: str
    phase: str
    message: str
    status: dict[str, Any]  # Argo's Workflow.status
    run_dir: Path  # <workdir>/<workflow name>: pods/<pod>/{stdout.log,stderr.log,pod.json,root/}
    faults: list[Injection] = field(default_factory=list)  # the --chaos faults that landed, in order
    # Argo's Workflow.metadata (name, namespace, labels, annotations) as the run ended: spec.workflowMetadata
    # applied, as the e2e tests read it (ExpectWorkflow's metadata)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return self.phase == SUCCEEDED


Manifest = str | Path | dict


def run_workflow(
    manifest: Manifest | Callable[[], Manifest],
    parameters: dict[str, str] | None = None,
    chaos: str | None = None,
    status_out: str | Path | None = None,
    workdir: str | Path | None = None,
    view: View | str | None = "auto",
    name: str | None = None,
    warm_start: bool | WarmStarter | None = None,
    entrypoints: dict[str, list[str]] | None = None,
    configmaps: list[str | Path] | None = None,
    strict: bool = True,
    preload: Sequence[str] = (),
    prestart: Sequence[tuple[list[str], dict[str, str]]] = (),
) -> RunResult:
    """Load, validate and run a workflow manifest (a path, or an already-loaded mapping), or the one that
    `manifest()` returns: it is called after the prestart below, so that the warm server's imports overlap
    whatever it does (rendering, input checks).

    view: "auto" (a live tree on a terminal, log lines otherwise), "plain", None (silent), or a View.
    warm_start: start `python -m` pods as forks of a warm Python (warm.py); None: unless MOERL_LOCAL_WARM=0.
    preload: the modules that warm Python imports besides warm.LIBRARIES (the caller's step modules).
    prestart: (command, env) of pods whose warm server starts before the manifest is loaded, env as their
    container sets it (the executor starts the servers of the manifest's own templates as the run starts).
    entrypoints: image -> host command for containers that give no command (`--entrypoint IMAGE=COMMAND`).
    configmaps: YAML files of ConfigMaps, for synchronization semaphores' limits.
    strict: refuse fields that are not Argo's (as `argo submit`); False drops them with a warning.
    Raises MoerlError, before anything runs, for a manifest this executor cannot run or a --chaos aim it lacks,
    and after a run that succeeded before every requested --chaos fault had landed."""
    spec = parse_chaos(chaos)
    if warm_start is None:
        warm_start = warm_starts_enabled()
    starter = warm_start if isinstance(warm_start, WarmStarter) else None
    if starter is None and warm_start:
        starter = WarmStarter((*LIBRARIES, *preload))
    try:
        if starter is not None:
            pods = [{"container": {"command": command, "env": [{"name": k, "value": v} for k, v in env.items()]}}
                    for command, env in prestart]  # fmt: skip
            for argv, env in warm_start_candidates(pods):
                starter.prestart(argv, env)
        workflow = load_workflow(
            manifest() if callable(manifest) else manifest,
            parameters or {},
            name=name,
            entrypoints=entrypoints,
            configmap_files=[Path(f) for f in configmaps or []],
            strict=strict,
        )
        if view == "auto":
            view = LiveView() if sys.stdout.isatty() else PlainView()
        elif view == "plain":
            view = PlainView()
        controller = Controller(
            workflow,
            Path(workdir) if workdir else DEFAULT_WORKDIR,
            chaos=spec,
            status_out=Path(status_out) if status_out else None,
            view=view,  # type: ignore[arg-type]
            warm_start=starter or False,
        )
    except BaseException:  # the run never started: its warm servers go now (the controller closes them after a run)
        if starter is not None:
            starter.close()
        raise
    with _sigterm_stops_the_run(controller):
        status = controller.run()
    shortfall = controller.chaos.shortfall() if controller.chaos is not None else None
    if shortfall and status["phase"] == SUCCEEDED:  # a clean run is not passed off as a chaos run
        raise MoerlError(shortfall)
    faults = [i for i in controller.chaos.log if i.fired] if controller.chaos is not None else []
    metadata = {"name": workflow.name, "namespace": workflow.namespace, "labels": dict(workflow.labels),
                "annotations": dict(workflow.annotations)}  # fmt: skip
    return RunResult(
        workflow.name, status["phase"], status.get("message", ""), status, controller.run_dir, faults, metadata
    )


@contextmanager
def _sigterm_stops_the_run(controller: Controller) -> Iterator[None]:
    """SIGTERM (a `kill`, a CI timeout) ends the run as Ctrl-C does: the executor stops every pod's process
    group before it exits, instead of dying and leaving them running. Exit status 143, as for a SIGTERM.
    The handler only asks: the executor stops between passes, never halfway through starting a pod (whose
    process would then be known to no one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        controller.stop_requested = 128 + signum

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
