"""The launcher pod of a PyTorchJob: create the job through the Kubernetes API, wait for it the way Argo's
resource template waits (pipelines/workflow/pytorchjob.py builds the jobs and says what the training
operator does), and exit 0 iff it succeeded; on SIGTERM delete it. It runs a multi-node update on KFP, and
on Argo the daemon of a multi-node trainer that stays up (its job never succeeds: it runs until the daemon
is stopped, or fails and the daemon is retried).

`python -m steps.pytorchjob_launcher --manifest-json JOB --namespace NS [--deadline-seconds S]`; runs with
the pod's service account (create, get and delete on pytorchjobs, as Argo's resource templates need).

Its wait outlives a hiccup of the Kubernetes API: a 429, a 5xx or a connection reset while it polls is retried
with backoff (`retrying`), so one failed GET never deletes and recreates a healthy 16-node job; only a 404 (the
job is gone) or the job's Failed condition are final. When the job's metadata names a launcher heartbeat
(`heartbeat_annotations`: a trainer that stays up), it rewrites that object in the run store at every poll;
the trainer ends itself once the heartbeat has been still for trainer.server_idle_exit_s (its launcher is
gone), never because updates pause.

`python -m steps.pytorchjob_launcher --wait-for-host NAME [--wait-seconds S]` is a worker pod's first init
container (pipelines/workflow/pytorchjob.py): it waits until NAME, the master's Service, resolves.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
# Created, Running|Restarting, Suspended, Succeeded, Failed: at most five conditions, and a Failed one sits
# at index 1 to 4 (0 too, should a job miss its Created condition).
FAILED_CONDITION_INDEXES = range(5)
# The operator fails a job that has been active this long (a hung collective, a rank that never joins);
# the wait's own deadline is a little longer, so that the job's comes first and cleans up its pods.
JOB_DEADLINE_SECONDS = 6 * 3600
WAIT_DEADLINE_SECONDS = JOB_DEADLINE_SECONDS + 600

# Retrying the API: what kubernetes-client/python raises (kubernetes/client/rest.py RESTClientObject.request)
# is an ApiException whose `.status` is the HTTP status (0 for an SSL error it wraps), or urllib3's own
# exceptions (urllib3.exceptions.HTTPError: ProtocolError for a reset connection, MaxRetryError, timeouts),
# which it lets through; a reset may also surface as an OSError. 408, 429 and 5xx are the server's "try
# again"; 404 is final (the job is gone), and so is any other 4xx (a bad manifest, missing RBAC).
TRANSIENT_STATUSES = frozenset({0, 408, 429})
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0

# A trainer that stays up: the run-store object its launcher rewrites at every poll (Store URI, key), named
# in the job's metadata (pipelines/workflow/pytorchjob.py trainer_server_manifest) and watched by the
# trainer (steps/trainer_server.py LauncherWatch).
HEARTBEAT_STORE_ANNOTATION = "moerl.dev/launcher-heartbeat-store"
HEARTBEAT_KEY_ANNOTATION = "moerl.dev/launcher-heartbeat-key"

# A worker's wait for the master's Service name (--wait-for-host): long enough for a cold start (a new node
# and the trainer image pulled on the master's node), where the operator's own init container gives up after
# about 200 s (kubeflow/trainer v1.9.4 pkg/config/config.go PyTorchInitContainerMaxTriesDefault = 100 tries,
# 2 s apart: pkg/controller.v1/pytorch/initcontainer.go initContainerTemplate).
MASTER_WAIT_SECONDS = 3600
HOST_POLL_SECONDS = 2.0


def transient(err: BaseException) -> bool:
    """Whether an API call's error is worth retrying (see TRANSIENT_STATUSES)."""
    status = getattr(err, "status", None)
    if isinstance(status, int):
        return status in TRANSIENT_STATUSES or status >= 500
    try:
        import urllib3  # noqa: PLC0415 - the Kubernetes client's transport

        if isinstance(err, urllib3.exceptions.HTTPError):
            return True
    except ImportError:
        pass
    return isinstance(err, (OSError, TimeoutError))


def retrying(
    call: Callable[[], T],
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    deadline: float = float("inf"),
    clock: Callable[[], float] = time.monotonic,
) -> T:
    """call(), again after each transient error (`transient`) with exponential backoff from RETRY_FIRST_S up to
    RETRY_MAX_S, until `deadline` (clock()); any other error at once."""
    delay = RETRY_FIRST_S
    while True:
        try:
            return call()
        except Exception as err:
            if not transient(err) or clock() + delay > deadline:
                raise
            status = getattr(err, "status", None)
            print(f"{what}: {type(err).__name__} (status {status}): {err}; again in {delay:.0f} s", flush=True)
            sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)


def heartbeat_writer(job: dict[str, Any]) -> Callable[[], None] | None:
    """The heartbeat the job's metadata asks for (HEARTBEAT_*_ANNOTATION), else None: each call rewrites the
    object with a new beat. A failed write is said and skipped: the trainer waits server_idle_exit_s."""
    notes = job.get("metadata", {}).get("annotations", {})
    uri, key = notes.get(HEARTBEAT_STORE_ANNOTATION), notes.get(HEARTBEAT_KEY_ANNOTATION)
    if not uri or not key:
        return None
    from steps.store.object_store import Store  # noqa: PLC0415 - the KFP launcher needs no store

    store = Store.open(uri)
    launcher = {"launcher": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
    beats = 0

    def beat() -> None:
        nonlocal beats
        beats += 1
        try:
            store.put_json(key, {**launcher, "beat": beats, "written": time.time()})
        except Exception as err:  # noqa: BLE001 - a store hiccup must not end the launcher
            print(f"launcher heartbeat {store.url(key)}: {type(err).__name__}: {err}", flush=True)

    return beat


def wait_for_host(
    host: str,
    timeout_s: float = MASTER_WAIT_SECONDS,
    resolve: Callable[[str], object] = lambda h: socket.getaddrinfo(h, None),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """0 once `host` resolves, 1 after `timeout_s` (a worker's first init container: the master's headless
    Service has an address only once the master pod is Ready, kubeflow/trainer v1.9.4
    pkg/controller.v1/common/service.go CreateNewService sets no publishNotReadyAddresses)."""
    start = clock()
    while True:
        try:
            resolve(host)
            print(f"{host} resolves", flush=True)
            return 0
        except OSError:
            pass
        if clock() - start >= timeout_s:
            print(f"{host} did not resolve within {timeout_s:.0f} s", flush=True)
            return 1
        sleep(HOST_POLL_SECONDS)


def job_outcome(job: dict[str, Any]) -> str | None:
    """'Succeeded', 'Failed' or None (still running), by the same rule as the Argo conditions
    (pipelines/workflow/pytorchjob.py SUCCESS_CONDITION, FAILURE_CONDITION)."""
    status = job.get("status", {})
    if status.get("replicaStatuses", {}).get("Master", {}).get("succeeded", 0) > 0:
        return "Succeeded"
    conditions = status.get("conditions", [])
    if any(conditions[i].get("type") == "Failed" for i in FAILED_CONDITION_INDEXES if i < len(conditions)):
        return "Failed"
    return None


def launch(
    job: dict[str, Any],
    namespace: str,
    poll_seconds: float = 10.0,
    api: Any = None,
    deadline_seconds: float = WAIT_DEADLINE_SECONDS,
    heartbeat: Callable[[], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Replace any job of this name, wait for the new one (up to `deadline_seconds`; 0: no deadline, for a
    trainer that stays up until SIGTERM), delete it unless it succeeded, and on SIGTERM; 0 iff it succeeded.
    The same lifecycle as the Argo update step. Every API call is retried on a transient error (`retrying`);
    `heartbeat` is called before the job is created and at every poll."""
    if api is None:
        from kubernetes import client, config  # imported here: only KFP's launcher pod needs it

        config.load_incluster_config()
        api = client.CustomObjectsApi()
    name = job["metadata"]["name"]
    foreground = {"propagation_policy": "Foreground"}

    def get() -> dict[str, Any] | None:
        """The job, None once it is gone (404)."""
        try:
            return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except Exception as err:  # noqa: BLE001 - kubernetes' ApiException
            if getattr(err, "status", None) == 404:
                return None
            raise

    def delete() -> None:
        try:
            api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, **foreground)
        except Exception as err:  # noqa: BLE001 - kubernetes' ApiException; absent is what we want
            if getattr(err, "status", None) != 404:
                raise

    tries = 0

    def create() -> None:
        nonlocal tries
        tries += 1
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
        except Exception as err:  # noqa: BLE001 - kubernetes' ApiException
            # 409 on a retry: the try that failed in transit created it (the name was free before it)
            if not (tries > 1 and getattr(err, "status", None) == 409):
                raise

    def api_call(fn: Callable[[], T], what: str) -> T:
        return retrying(fn, f"PyTorchJob {namespace}/{name}: {what}", sleep)

    api_call(delete, "delete")
    while api_call(get, "get") is not None:
        sleep(poll_seconds)
    if heartbeat is not None:
        heartbeat()
    api_call(create, "create")
    print(f"created PyTorchJob {namespace}/{name}", flush=True)

    def stop(signum: int, frame: object) -> None:
        # retried too, but within the pod's grace period (Kubernetes' default: 30 s)
        retrying(delete, f"PyTorchJob {namespace}/{name}: delete", sleep, deadline=time.monotonic() + 20)
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + deadline_seconds if deadline_seconds > 0 else float("inf")
    try:
        while True:
            if heartbeat is not None:
                heartbeat()
            current = api_call(get, "get")
            outcome = "Failed (the job is gone: 404)" if current is None else job_outcome(current)
            if outcome is None and time.monotonic() > deadline:
                outcome = f"Failed (still running after {deadline_seconds:.0f} s)"
            if outcome is not None:
                print(f"PyTorchJob {name}: {outcome}", flush=True)
                if outcome != "Succeeded":
                    api_call(delete, "delete")
                return 0 if outcome == "Succeeded" else 1
            sleep(poll_seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.pytorchjob_launcher", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest-json", help="the PyTorchJob to create, as JSON")
    parser.add_argument("--namespace")
    parser.add_argument("--wait-for-host", help="only wait until this name resolves (a worker's init container)")
    parser.add_argument("--wait-seconds", type=float, default=MASTER_WAIT_SECONDS, help="with --wait-for-host")
    parser.add_argument(
        "--deadline-seconds",
        type=float,
        default=WAIT_DEADLINE_SECONDS,
        help=f"fail a job still running after this long (default {WAIT_DEADLINE_SECONDS}; 0: never, for a server)",
    )
    args = parser.parse_args()
    if args.wait_for_host:
        return wait_for_host(args.wait_for_host, args.wait_seconds)
    if not args.manifest_json or not args.namespace:
        parser.error("--manifest-json and --namespace are required")
    job = json.loads(args.manifest_json)
    return launch(job, args.namespace, deadline_seconds=args.deadline_seconds, heartbeat=heartbeat_writer(job))


if __name__ == "__main__":
    from steps.errors import run_cli

    run_cli(main)
