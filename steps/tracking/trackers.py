"""Experiment tracking: each step's metrics to MLflow, TensorBoard and Weights & Biases, at step = iteration.

The run store stays the record; trackers get a copy. A step calls one function when its own metrics are in
the store:

    log_iteration(run, cfg, "score" | "update", iteration, metrics)      score and update (rank 0)
    log_run_end(run, cfg, stored_step_metrics(run), workflow_name, ...)  the report step (the exit handler)

log_run_end adds the workflow's step wall times and retries per finished iteration (`workflow/<step>_seconds`,
`workflow/<step>_retries`, from the Argo Workflow's node status), the run's config as parameters, the Argo
workflow name and UI link as tags, report.md and report.png as artifacts, and logs any score or update points
that a tracker missed while it was down (they are in the store).

No duplicate points, whatever is retried or resumed:
- a ledger in the store, `tracking/logged/<tracker>/<source>-iter-NNNNNN.json`, is written once a tracker
  has taken an iteration's points; a retried step, a resumed run and the report's catch-up skip what it holds;
- TensorBoard: one event file per (iteration, source) under a fixed name, so a rewrite replaces it;
- MLflow: one run per moerl run (its id kept in `tracking/mlflow-run.json`, found again by the tag
  moerl.run_store); a `.pending.json` record goes before each write, and where one is left without its
  ledger record (an attempt died between the two), the points the server already holds at that step are
  left out;
- W&B: one run per moerl run, its id derived from the run store URI; offline run files are copied to
  `<run>/wandb/<source>-iter-NNNNNN/offline-run-*/`, replacing an earlier attempt's.

A tracker that is down never fails or slows the run: each call runs under tracking.timeout_seconds
(a deadline on a daemon thread, with the client's own HTTP timeout and retries set below it); a tracker that
misses it is dropped for the rest of the step with one warning naming the tracker and the points it missed.

This module holds the ledger, the deadlines and the dispatch; the trackers themselves are beside it
(interface.py: what each one is; tensorboard_tracker.py, mlflow_tracker.py, wandb_tracker.py). The tracking
libraries are imported only when a tracker is configured; TensorBoard files are tensorboard's own Event protos in
TFRecord framing written by tensorboard_tracker.py (its docstring says why not a library's writer).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from steps.run.keys import (
    METRICS_PREFIX,
    ledger_key,
    params_ledger_key,
    pending_key,
)
from steps.store.object_store import Store
from steps.tracking.interface import Tracker
from steps.tracking.mlflow_tracker import MlflowTracker
from steps.tracking.tensorboard_tracker import TensorboardTracker
from steps.tracking.wandb_tracker import WandbTracker
from steps.tracking.workflow_status import status_nodes, step_nodes

SOURCES = ("score", "update", "workflow")
# Steps whose wall time and retries the workflow points carry, as graph.STEPS names them.
WORKFLOW_STEPS = ("rollout", "score", "update", "publish")
# The local executor writes the Workflow's Argo-shaped status here (moerl run / moerl demo set it).
STATUS_FILE_ENV = "MOERL_WORKFLOW_STATUS_FILE"
Log = Callable[[str], None]


# ------------------------------------------------------------------------------------------ points


def metric_points(source: str, metrics: dict[str, Any]) -> dict[str, float]:
    """The finite scalar metrics of a step, keyed `source/name` (nested: `update/is_weight/mean`).

    Lists (per-step grad norms, per-expert rows), strings and booleans are left out; so is `iteration`,
    which is the step of every point."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[_NOT_IN_A_KEY.sub("_", prefix)] = float(value)

    for key, value in metrics.items():
        if key != "iteration":
            walk(f"{source}/{key}", value)
    return out


_NOT_IN_A_KEY = re.compile(r"[^\w\-. /]")  # MLflow's key rule (mlflow.utils.validation): a bad key fails a batch


def config_params(config: dict[str, Any]) -> dict[str, str]:
    """The run config as flat parameters, `trainer.lr` -> '0.0002' (a user's label key such as
    `a:b` becomes `a_b`)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            out[prefix] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    walk("", config)
    return {_NOT_IN_A_KEY.sub("_", key): value for key, value in out.items()}


# ------------------------------------------------------------------------------------------ the workflow


_ATTEMPT = re.compile(r"\((\d+)\)$")


def workflow_points(status: dict[str, Any]) -> dict[int, dict[str, float]]:
    """iteration -> {workflow/<step>_seconds, workflow/<step>_retries} of each iteration that finished.

    From an Argo Workflow's status: a step's wall time spans its pods (all shards, all attempts); its retries
    count the pod attempts after the first (an attempt is a Pod node named `<task>(N)` with N >= 1, e.g.
    `score-3(1)` or `rollout-3(0:1)(2)`). An iteration counts once its publish node Succeeded: an iteration
    that a failed Workflow left half done is run again, and logged, by the Workflow that finishes it."""
    spans: dict[tuple[int, str], list[datetime]] = {}
    retries: dict[tuple[int, str], int] = {}
    published: set[int] = set()
    for node in step_nodes(status):
        if node.step not in WORKFLOW_STEPS or node.iteration is None:
            continue
        key = (node.iteration, node.step)
        if node.step == "publish" and not node.attempt and node.phase == "Succeeded":
            published.add(key[0])
        if node.type != "Pod":
            continue
        spans.setdefault(key, []).extend(s for s in (node.started, node.finished) if s is not None)
        attempt = _ATTEMPT.search(node.attempt)
        retries[key] = retries.get(key, 0) + (1 if attempt and int(attempt[1]) >= 1 else 0)
    out: dict[int, dict[str, float]] = {}
    for (iteration, step), stamps in sorted(spans.items()):
        if iteration in published and stamps:
            points = out.setdefault(iteration, {})
            points[f"workflow/{step}_seconds"] = (max(stamps) - min(stamps)).total_seconds()
            points[f"workflow/{step}_retries"] = float(retries.get((iteration, step), 0))
    return out


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def read_workflow_status(
    name: str | None, namespace: str | None, timeout: float, log: Log, service_account: Path = SERVICE_ACCOUNT_DIR
) -> dict | None:
    """The running Workflow's Argo status: the local executor's status file ($MOERL_WORKFLOW_STATUS_FILE),
    or the Workflow object from the Kubernetes API with the pod's service account (in a cluster; the
    moerl-report Role grants `get` on workflows). None, with a note, where neither is there."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path:
        # The executor rewrites the file at most once a second: wait (bounded) until it shows the main DAG
        # done, which it is before the exit handler starts.
        deadline = time.monotonic() + min(timeout, 5.0)
        status = None
        while True:
            try:
                status = json.loads(Path(path).read_text())
            except (OSError, ValueError):
                status = None
            nodes = status_nodes(status or {})
            if status is not None and name and nodes and name not in nodes:
                log(f"tracking: {path} is the status of another Workflow than {name}: no step times or retries")
                return None
            if nodes.get(name or "", {}).get("finishedAt") or time.monotonic() >= deadline:
                return status
            time.sleep(0.2)
    token_file = service_account / "token"
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not (name and namespace and host and token_file.is_file()):
        log("tracking: no workflow status here (no status file, not in a cluster): no step wall times or retries")
        return None
    import ssl

    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    url = f"https://{host}:{port}/apis/argoproj.io/v1alpha1/namespaces/{namespace}/workflows/{name}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token_file.read_text().strip()}"})
    context = ssl.create_default_context(cafile=str(token_file.with_name("ca.crt")))
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return json.loads(response.read()).get("status") or {}
    except (OSError, ValueError) as err:
        log(f"tracking: cannot read Workflow {namespace}/{name} from the Kubernetes API ({err}): no step times")
        return None


def wandb_run_id(run_uri: str) -> str:
    """The W&B run of a moerl run: the same id from every step, every retry and every resumed Workflow."""
    return "moerl-" + hashlib.sha256(run_uri.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------ bounded calls


class Missed(Exception):
    """A tracker call failed or ran past its deadline."""


def bounded(fn: Callable[[], Any], timeout: float) -> Any:
    """fn() on a daemon thread, waited for at most `timeout` s: a hung tracker cannot hold the step."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001  # every failure of a tracker is the same to the run
            result["error"] = err

    thread = threading.Thread(target=target, name="moerl-tracking", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise Missed(f"no answer within {timeout:g} s")
    if "error" in result:
        err = result["error"]
        raise Missed(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": "))
    return result.get("value")


@dataclass
class Session:
    """The trackers of one step process, each dropped at its first failure (one warning, then silence)."""

    run: Store
    config: dict[str, Any]
    timeout: float
    log: Log
    trackers: list[Tracker]
    failed: dict[str, str]

    def call(self, tracker: Tracker, what: str, fn: Callable[[], Any]) -> Any:
        if tracker.name in self.failed:
            raise Missed(self.failed[tracker.name])
        try:
            return bounded(fn, self.timeout)
        except Missed as err:
            self.failed[tracker.name] = str(err)
            self.log(f"warning: tracking: {tracker.name} missed {what} ({err}); they stay in the run store")
            raise

    def live(self) -> list[Tracker]:
        return [t for t in self.trackers if t.name not in self.failed]

    def ensure_params(self) -> None:
        for tracker in self.live():
            key = params_ledger_key(tracker.name)
            if self.run.exists(key):
                continue
            try:
                self.call(tracker, "the run's parameters", lambda t=tracker: t.log_params(config_params(self.config)))
            except Missed:
                continue
            self.run.put_json(key, {"logged_at": time.time()})

    def log_points(self, source: str, iteration: int, values: dict[str, float]) -> None:
        """Log one iteration's points of one source to every tracker that has not taken them yet."""
        if not values:
            return
        for tracker in self.trackers:
            key = ledger_key(tracker.name, source, iteration)
            if self.run.exists(key):
                continue
            what = f"{source} points of iteration {iteration}"
            if tracker.name in self.failed:
                self.log(f"warning: tracking: {tracker.name} missed {what} ({self.failed[tracker.name]}); "
                         "they stay in the run store")  # fmt: skip
                continue

            # Two-phase: `pending` before the write, the record after it. A pending record without the final
            # one means an attempt died in between, and only then is the tracker asked what it already has.
            pending = pending_key(tracker.name, source, iteration)
            interrupted = self.run.exists(pending)

            def send(t: Tracker = tracker, check: bool = interrupted) -> None:
                present = t.points_at(iteration, sorted(values)) if check else set()
                t.log_points(source, iteration, {k: v for k, v in values.items() if k not in present})

            self.run.put_json(pending, {"keys": sorted(values), "step": iteration})
            try:
                self.call(tracker, what, send)
            except Missed:
                continue
            self.run.put_json(key, {"keys": sorted(values), "step": iteration})

    def close(self) -> None:
        for tracker in self.live():
            try:
                self.call(tracker, "its last writes (close)", tracker.close)
            except Missed:
                pass


_LIBRARY = {"tensorboard": "tensorboard.compat.proto.event_pb2", "mlflow": "mlflow.tracking", "wandb": "wandb"}


def configured(cfg: Any) -> list[str]:
    """The trackers a run config names, in the order they are opened."""
    tracking = cfg.tracking
    names = []
    if tracking.tensorboard is not None and tracking.tensorboard.enabled:
        names.append("tensorboard")
    if tracking.mlflow is not None:
        names.append("mlflow")
    if tracking.wandb is not None:
        names.append("wandb")
    return names


def open_session(run: Store, cfg: Any, log: Log, label: str, names: list[str] | None = None) -> Session | None:
    """The trackers `names` (default: all configured), each opened under the deadline (one that cannot open
    is warned about, and its points are reported as missed). None when there is none to open."""
    tracking = cfg.tracking
    names = configured(cfg) if names is None else names
    if not names:
        return None
    config = cfg.model_dump(mode="json")
    session = Session(run, config, tracking.timeout_seconds, log, [], {})
    makers: dict[str, Callable[[], Tracker]] = {
        "tensorboard": lambda: TensorboardTracker(run),
        "mlflow": lambda: MlflowTracker(run, tracking.mlflow, config, tracking.timeout_seconds),
        "wandb": lambda: WandbTracker(
            run, tracking.wandb, config, tracking.timeout_seconds, label, wandb_run_id(run.uri)
        ),
    }
    for name in names:
        make = makers[name]
        # The library is imported first, outside the deadline: importing it is slow on a busy machine (MLflow
        # 2-10 s), never hangs on the network, and is not what the deadline bounds.
        __import__(_LIBRARY[name])
        try:
            session.trackers.append(bounded(make, tracking.timeout_seconds))
        except Missed as err:
            placeholder = Tracker()
            placeholder.name = name
            session.trackers.append(placeholder)  # still named, so that its points are reported as missed
            session.failed[name] = str(err)
            log(f"warning: tracking: {name} is unavailable ({err}); its points stay in the run store")
    return session


def best_effort(fn: Callable[..., None]) -> Callable[..., None]:
    """Tracking runs after a step's own outputs are in the store: nothing in it (a tracker, the ledger's store
    writes, a bug) may fail the step. A failure is one warning."""

    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> None:
        log = signature.bind(*args, **kwargs).arguments.get("log", print)
        try:
            fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001
            log(f"warning: tracking: {fn.__name__} failed ({type(err).__name__}: {err}); the metrics are in the store")

    return guarded


@best_effort
def log_iteration(run: Store, cfg: Any, source: str, iteration: int, metrics: dict[str, Any], log: Log = print) -> None:
    """A step's own metrics to every tracker, at step = iteration. Never raises for a tracker's sake."""
    # Only the trackers that lack these points are opened: a retry of a step that logged them touches none
    # (and a W&B offline retry would otherwise replace the step's run files with an empty run).
    names = [name for name in configured(cfg) if not run.exists(ledger_key(name, source, iteration))]
    session = open_session(run, cfg, log, f"{source}-iter-{iteration:06d}", names)
    if session is None:
        return
    try:
        session.ensure_params()
        session.log_points(source, iteration, metric_points(source, metrics))
    finally:
        session.close()


_STORED_METRICS = re.compile(rf"^{METRICS_PREFIX}/iter-(\d+)\.(json|update\.json)$")


def stored_step_metrics(run: Store) -> dict[int, dict[str, dict[str, Any]]]:
    """iteration -> {"score": metrics/iter-N.json, "update": metrics/iter-N.update.json's "update"}: what
    the steps wrote to the store, for the report's catch-up of points a tracker missed. An unreadable file
    is left out (the report names it)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for key in run.list("metrics"):
        match = _STORED_METRICS.match(key)
        if match is None:
            continue
        try:
            data = run.get_json(key)
        except Exception:  # noqa: BLE001  # a torn or foreign file: the report itself says so
            continue
        source = "score" if match[2] == "json" else "update"
        metrics = data.get("update") if source == "update" and isinstance(data, dict) else data
        if isinstance(metrics, dict):
            out.setdefault(int(match[1]), {})[source] = metrics
    return out


def argo_tags(workflow_name: str | None, namespace: str | None, ui_url: str | None) -> dict[str, str]:
    if not workflow_name:
        return {}
    tags = {"argo.workflow": workflow_name, "argo.namespace": namespace or ""}
    if ui_url:
        tags["argo.ui"] = f"{ui_url.rstrip('/')}/workflows/{namespace}/{workflow_name}"
    return tags


@best_effort
def log_run_end(
    run: Store,
    cfg: Any,
    stored_metrics: dict[int, dict[str, dict[str, Any]]],
    workflow_name: str | None = None,
    namespace: str | None = None,
    report_files: dict[str, Path] | None = None,
    log: Log = print,
) -> None:
    """The report step's part: tags, workflow points, catch-up of missed step points, report artifacts.

    stored_metrics: iteration -> source -> the metrics that step wrote to the store."""
    session = open_session(run, cfg, log, f"report-{workflow_name or 'local'}")
    if session is None:
        return
    try:
        session.ensure_params()
        tags = argo_tags(workflow_name, namespace, cfg.tracking.argo_ui_url)
        for tracker in session.live():
            if tags:
                try:
                    session.call(tracker, "the Argo tags", lambda t=tracker: t.set_tags(tags))
                except Missed:
                    pass
        for iteration, sources in sorted(stored_metrics.items()):
            for source, metrics in sorted(sources.items()):
                session.log_points(source, iteration, metric_points(source, metrics))
        status = read_workflow_status(workflow_name, namespace, cfg.tracking.timeout_seconds, log)
        for iteration, values in sorted(workflow_points(status or {}).items()):
            session.log_points("workflow", iteration, values)
        for tracker in session.live():
            if report_files:
                try:
                    session.call(tracker, "the report artifacts", lambda t=tracker: t.log_artifacts(report_files))
                except Missed:
                    pass
    finally:
        session.close()
