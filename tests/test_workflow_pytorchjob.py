"""The multi-node update's PyTorchJob step in each outcome the training operator (kubeflow/trainer v1.9.4)
can give it, judged the way Argo's executor (argo-workflows v4.1.2 workflow/executor/resource.go) judges a
resource template: success and failure conditions parsed as Kubernetes label selectors over gjson paths,
any failure requirement failing the step, all success requirements succeeding it, neither: keep polling."""

from __future__ import annotations

import re

import pytest
import yaml

from pipelines.config import load_config
from pipelines.local.pods.pytorchjob import match_conditions, parse_selector
from pipelines.workflow import pytorchjob
from pipelines.workflow.build import workflow
from pipelines.workflow.templates import UPDATE_CLEAR, UPDATE_JOB
from steps import pytorchjob_launcher
from steps.run.config import validate_config

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run", "trainer": {"nodes": 3}}
# k8s.io/apimachinery validation.IsQualifiedName, which labels.Parse applies to every key
QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                            r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")  # fmt: skip


def templates(cfg) -> dict[str, dict]:
    return {t["name"]: t for t in workflow(cfg).to_dict()["spec"]["templates"]}


def condition(kind: str, status: str = "True") -> dict:
    return {"type": kind, "status": status, "reason": f"PyTorchJob{kind}"}


def argo_verdict(job_status: dict) -> bool | None:
    """True: the step succeeds; False: it fails; None: Argo polls again."""
    ok, _ = match_conditions({"status": job_status}, pytorchjob.SUCCESS_CONDITION, pytorchjob.FAILURE_CONDITION)
    return ok


def test_every_condition_key_is_a_label_key_that_argo_can_parse():
    for text in (pytorchjob.SUCCESS_CONDITION, pytorchjob.FAILURE_CONDITION):
        for requirement in parse_selector(text):
            assert QUALIFIED_NAME.match(requirement.key) and len(requirement.key) <= 63, requirement.key


# The operator's status in each outcome (pod.go ReconcilePods, job.go ReconcileJobs, util/status.go setCondition).
OUTCOMES = {
    # a rank crashes, restarts inside its Running pod until backoffLimit is spent: only the Failed condition
    "crash-restarted-in-place-until-the-backoff-limit": (
        {"conditions": [condition("Created"), condition("Restarting"), condition("Failed")],
         "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 2}}},
        False,
    ),
    # a Worker pod lost with its node: failed rises while the operator recreates it; the job goes on
    "pod-lost-to-its-node-is-being-recreated": (
        {"conditions": [condition("Created"), condition("Restarting")],
         "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 1, "failed": 1}}},
        None,
    ),
    # runPolicy.activeDeadlineSeconds passed: Failed after Running (set to False)
    "deadline-passed": (
        {"conditions": [condition("Created"), condition("Running", "False"), condition("Failed")],
         "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 2}}},
        False,
    ),
    "deadline-passed-before-any-pod-ran": (
        {"conditions": [condition("Created"), condition("Failed")], "replicaStatuses": {"Master": {}}},
        False,
    ),
    "failed-after-a-suspension": (
        {"conditions": [condition("Created"), condition("Running", "False"), condition("Suspended", "False"),
                        condition("Failed")], "replicaStatuses": {}},
        False,
    ),
    "running": ({"conditions": [condition("Created"), condition("Running")],
                 "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 2}}}, None),
    "succeeded": (
        {"conditions": [condition("Created"), condition("Running", "False"), condition("Succeeded")],
         "replicaStatuses": {"Master": {"succeeded": 1}, "Worker": {"succeeded": 2}}},
        True,
    ),
}  # fmt: skip


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
def test_the_step_follows_the_jobs_final_state(outcome):
    status, verdict = OUTCOMES[outcome]
    assert argo_verdict(status) is verdict
    judged = pytorchjob_launcher.job_outcome({"status": status})
    assert judged == {True: "Succeeded", False: "Failed", None: None}[verdict]


def test_the_job_has_a_deadline_before_argos_and_frees_its_nodes_when_it_fails():
    cfg = validate_config(BASE)
    job = yaml.safe_load(templates(cfg)[UPDATE_JOB]["resource"]["manifest"])
    policy = job["spec"]["runPolicy"]
    assert policy["activeDeadlineSeconds"] == pytorchjob_launcher.JOB_DEADLINE_SECONDS
    assert templates(cfg)[UPDATE_JOB]["activeDeadlineSeconds"] > policy["activeDeadlineSeconds"]
    assert policy["cleanPodPolicy"] == "Running"  # the failed job's running pods go at once
    assert policy["backoffLimit"] == cfg.retries["trainer"].limit
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["restartPolicy"] == "OnFailure"


def test_each_attempt_deletes_the_iterations_job_before_it_creates_it():
    eks = pytest.importorskip("pathlib").Path(__file__).parents[1] / "configs" / "eks-p5en.yaml"
    cfg = load_config(eks, {"trainer.server": False})  # a PyTorchJob per iteration
    tpl = templates(cfg)
    update = tpl["update"]
    assert "retryStrategy" in update and "retryStrategy" not in tpl[UPDATE_JOB]  # a retry repeats both steps
    assert [[s["template"] for s in group] for group in update["steps"]] == [[UPDATE_CLEAR], [UPDATE_JOB]]
    clear = tpl[UPDATE_CLEAR]["resource"]
    assert clear["action"] == "delete" and {"--cascade=foreground", "--wait=true"} <= set(clear["flags"])
    deleted = yaml.safe_load(clear["manifest"])
    created = yaml.safe_load(tpl[UPDATE_JOB]["resource"]["manifest"])
    assert "generateName" not in created["metadata"]  # one name per run and iteration: a resubmit replaces it
    assert (deleted["apiVersion"], deleted["kind"], deleted["metadata"]["name"]) == (
        created["apiVersion"], created["kind"], created["metadata"]["name"],
    )  # fmt: skip
    assert created["metadata"]["name"] == f"{cfg.name}-update-{{{{inputs.parameters.iteration}}}}"


class FakeApi:
    """kubernetes.client.CustomObjectsApi over one dict of jobs; statuses to hand out in turn."""

    def __init__(self, existing: dict | None, statuses: list[dict]) -> None:
        self.jobs = {existing["metadata"]["name"]: existing} if existing else {}
        self.statuses, self.log = statuses, []

    def _missing(self) -> Exception:
        err = Exception("not found")
        err.status = 404  # type: ignore[attr-defined]
        return err

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        self.log.append(("delete", name, kw.get("propagation_policy")))
        if name not in self.jobs:
            raise self._missing()
        del self.jobs[name]

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if name not in self.jobs:
            raise self._missing()
        job = self.jobs[name]
        if self.statuses and job.get("created"):
            job["status"] = self.statuses.pop(0)
        return job

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.log.append(("create", body["metadata"]["name"], None))
        self.jobs[body["metadata"]["name"]] = {**body, "created": True}


def test_the_kfp_launcher_replaces_a_leftover_job_and_deletes_a_failed_one():
    cfg = validate_config(BASE)
    job = pytorchjob.manifest(cfg, "4")
    failed = OUTCOMES["crash-restarted-in-place-until-the-backoff-limit"][0]
    api = FakeApi({"metadata": {"name": job["metadata"]["name"]}}, [OUTCOMES["running"][0], failed])
    assert pytorchjob_launcher.launch(job, "moerl", poll_seconds=0, api=api) == 1
    name = job["metadata"]["name"]
    assert api.log == [("delete", name, "Foreground"), ("create", name, None), ("delete", name, "Foreground")]
    api = FakeApi(None, [OUTCOMES["succeeded"][0]])
    assert pytorchjob_launcher.launch(job, "moerl", poll_seconds=0, api=api) == 0
    assert api.log == [("delete", name, "Foreground"), ("create", name, None)]


def test_the_trainer_servers_launcher_waits_without_a_deadline_and_deletes_its_job_on_sigterm(monkeypatch):
    """The daemon of a multi-node trainer that stays up: its job never succeeds; it runs past the update's
    deadline, and Argo's SIGTERM at the end of the segment deletes it (the launcher then exits 128+15)."""
    cfg = validate_config({**BASE, "trainer": {"nodes": 2, "server": True}})
    job = pytorchjob.trainer_server_manifest(cfg, "wf", "uid-1")
    name = job["metadata"]["name"]
    clock = iter(range(0, 10**9, pytorchjob_launcher.WAIT_DEADLINE_SECONDS))  # each poll a deadline later
    monkeypatch.setattr(pytorchjob_launcher.time, "monotonic", lambda: float(next(clock)))
    handlers = {}
    monkeypatch.setattr(pytorchjob_launcher.signal, "signal", lambda sig, handler: handlers.setdefault(sig, handler))
    running = OUTCOMES["running"][0]
    polls = 0

    class StoppedAfterPolls(FakeApi):
        def get_namespaced_custom_object(self, *args):
            nonlocal polls
            polls += 1
            if polls == 5:  # Argo stops the daemon
                handlers[pytorchjob_launcher.signal.SIGTERM](pytorchjob_launcher.signal.SIGTERM, None)
            return super().get_namespaced_custom_object(*args)

    api = StoppedAfterPolls(None, [running] * 10)
    with pytest.raises(SystemExit) as stopped:
        pytorchjob_launcher.launch(job, "moerl", poll_seconds=0, api=api, deadline_seconds=0)
    assert stopped.value.code == 128 + pytorchjob_launcher.signal.SIGTERM
    assert api.log == [("delete", name, "Foreground"), ("create", name, None), ("delete", name, "Foreground")]
    assert name not in api.jobs and polls == 5
