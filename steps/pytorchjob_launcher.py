"""The launcher pod of a PyTorchJob: create the job through the Kubernetes API, wait for it the way Argo's
resource template waits (pipelines/workflow/pytorchjob.py builds the jobs and says what the training
operator does), and exit 0 iff it succeeded; on SIGTERM delete it. It runs a multi-node update on KFP, and
on Argo the daemon of a multi-node trainer that stays up (its job never succeeds: it runs until the daemon
is stopped, or fails and the daemon is retried).

`python -m steps.pytorchjob_launcher --manifest-json JOB --namespace NS [--deadline-seconds S]`; runs with
the pod's service account (create, get and delete on pytorchjobs, as Argo's resource templates need).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from typing import Any

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
# Created, Running|Restarting, Suspended, Succeeded, Failed: at most five conditions, and a Failed one sits
# at index 1 to 4 (0 too, should a job miss its Created condition).
FAILED_CONDITION_INDEXES = range(5)
# The operator fails a job that has been active this long (a hung collective, a rank that never joins);
# the wait's own deadline is a little longer, so that the job's comes first and cleans up its pods.
JOB_DEADLINE_SECONDS = 6 * 3600
WAIT_DEADLINE_SECONDS = JOB_DEADLINE_SECONDS + 600


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
) -> int:
    """Replace any job of this name, wait for the new one (up to `deadline_seconds`; 0: no deadline, for a
    trainer that stays up until SIGTERM), delete it unless it succeeded, and on SIGTERM; 0 iff it succeeded.
    The same lifecycle as the Argo update step."""
    if api is None:
        from kubernetes import client, config  # imported here: only KFP's launcher pod needs it

        config.load_incluster_config()
        api = client.CustomObjectsApi()
    name = job["metadata"]["name"]
    foreground = {"propagation_policy": "Foreground"}

    def delete() -> None:
        try:
            api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, **foreground)
        except Exception as err:  # noqa: BLE001 - kubernetes' ApiException; absent is what we want
            if getattr(err, "status", None) != 404:
                raise

    def gone() -> bool:
        try:
            api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except Exception as err:  # noqa: BLE001
            if getattr(err, "status", None) == 404:
                return True
            raise
        return False

    delete()
    while not gone():
        time.sleep(poll_seconds)
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
    print(f"created PyTorchJob {namespace}/{name}", flush=True)

    def stop(signum: int, frame: object) -> None:
        delete()
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + deadline_seconds if deadline_seconds > 0 else float("inf")
    try:
        while True:
            outcome = job_outcome(api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
            if outcome is None and time.monotonic() > deadline:
                outcome = f"Failed (still running after {deadline_seconds:.0f} s)"
            if outcome is not None:
                print(f"PyTorchJob {name}: {outcome}", flush=True)
                if outcome != "Succeeded":
                    delete()
                return 0 if outcome == "Succeeded" else 1
            time.sleep(poll_seconds)
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.pytorchjob_launcher", description=__doc__.splitlines()[0])
    parser.add_argument("--manifest-json", required=True, help="the PyTorchJob to create, as JSON")
    parser.add_argument("--namespace", required=True)
    parser.add_argument(
        "--deadline-seconds",
        type=float,
        default=WAIT_DEADLINE_SECONDS,
        help=f"fail a job still running after this long (default {WAIT_DEADLINE_SECONDS}; 0: never, for a server)",
    )
    args = parser.parse_args()
    return launch(json.loads(args.manifest_json), args.namespace, deadline_seconds=args.deadline_seconds)


if __name__ == "__main__":
    from steps.errors import run_cli

    run_cli(main)
