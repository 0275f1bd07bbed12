"""The trainer that stays up against the rules of the systems around it (issue 32, items 2, 3, 5, 6 and 8),
each with a fake that carries the upstream rule:

  - a rank that fails outside a step the ranks agree on ends its process (its peers may wait in an NCCL
    collective it never joins), and rank 0 alone decides whether an update has work to do;
  - a Worker of the trainer's PyTorchJob survives a master that starts late (kubeflow/trainer v1.9.4's
    init-pytorch init container and restartPolicy Never);
  - the trainer ends when its launcher's heartbeat stops, not when updates pause (Argo v4.1.2 fails a
    daemon whose pod succeeds);
  - the launcher outlives 429s, 5xx and resets of the Kubernetes API (kubernetes-client/python's errors);
  - a bigger DeepEP buffer is made once torch's cache has gone back to the driver (DeepEP dd758ca).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import fake_deep_ep
import pytest
import torch
import urllib3
from kubernetes.client.exceptions import ApiException

from pipelines.workflow import pytorchjob
from steps import pytorchjob_launcher
from steps.expert_parallel.dispatch import HeldDispatch
from steps.run import keys as run_store
from steps.run.config import validate_config
from steps.store.object_store import Store
from steps.training import trainer_server
from steps.training.update import agreed

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}


# ------------------------------------------------------------------------------ item 2: a rank fails alone


class Ended(BaseException):
    """What the fake `abort` raises instead of ending the test's process."""


def follower(monkeypatch, commands: list[dict], train) -> tuple[trainer_server.TrainerService, list]:
    """Rank 1 of two, its commands from a list, train_iteration replaced by `train`; pending_iteration must
    never run on it (rank 0 decides)."""
    mesh = SimpleNamespace(rank=1, world_group=None, ep_size=1, device=torch.device("cpu"))
    service = trainer_server.TrainerService(Store.open("file:///nowhere"), mesh, 0, None, object(), print)
    feed = iter(commands)
    monkeypatch.setattr(service, "_broadcast", lambda command: next(feed))
    ended: list[int] = []

    def abort(code: int):
        ended.append(code)
        raise Ended

    service.abort = abort

    def decided(*args, **kwargs):
        raise AssertionError("a rank other than 0 decided whether to train")

    monkeypatch.setattr(trainer_server, "pending_iteration", decided)
    monkeypatch.setattr(trainer_server, "iteration_inputs", lambda run, iteration, replay: f"inputs of {iteration}")
    monkeypatch.setattr(trainer_server, "train_iteration", train)
    return service, ended


UPDATE = {"op": "update", "iteration": 3, "from_memory": False}


def test_a_follower_trains_on_rank_0s_decision_without_deciding_itself(monkeypatch):
    trained = []
    service, ended = follower(
        monkeypatch, [UPDATE, {"op": "stop"}], lambda work, *a, **k: (trained.append(work), (None, "held"))[1]
    )
    service.follow()
    assert trained == ["inputs of 3"] and service.held == "held" and not ended


def test_a_rank_that_fails_outside_an_agreed_step_ends_its_process(monkeypatch):
    """An OOM in training (no agreement around it): the other ranks wait in a collective this rank never
    joins; going on listening would leave them there for the NCCL timeout (an hour)."""

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    service, ended = follower(monkeypatch, [UPDATE, UPDATE, {"op": "stop"}], oom)
    with pytest.raises(Ended):
        service.follow()
    assert ended == [trainer_server.EXIT_RANK_FAILED]


def test_a_failure_every_rank_agreed_on_leaves_the_ranks_listening(monkeypatch):
    """update.agreed: every rank raises at the same step, no collective is pending; the next update
    reloads."""
    mesh = SimpleNamespace(rank=1, world_group=None)

    def store_down(*args, **kwargs):
        agreed(mesh, lambda: (_ for _ in ()).throw(OSError("store unreachable")))

    service, ended = follower(monkeypatch, [UPDATE, UPDATE, {"op": "stop"}], store_down)
    service.held = "stale"
    service.follow()  # both updates failed, both agreed: it listened on until stop
    assert not ended and service.held is None


def test_rank_0_decides_and_broadcasts_only_work_to_do(monkeypatch, tmp_path):
    mesh = SimpleNamespace(rank=0, world_group=None, ep_size=1, device=torch.device("cpu"))
    config = SimpleNamespace(vocab_size=10)
    run = Store.open(tmp_path.as_uri())
    service = trainer_server.TrainerService(run, mesh, 0, config, object(), print)
    sent: list[dict] = []
    monkeypatch.setattr(service, "_broadcast", lambda command: sent.append(command) or command)
    monkeypatch.setattr(service, "_may_train_on", lambda iteration: False)
    sample = SimpleNamespace(prompt_ids=[1], response_ids=[2], prompt_id="p", sample_index=0)
    work = SimpleNamespace(samples=[sample], replay=False)
    decisions = {4: None, 5: work}
    monkeypatch.setattr(trainer_server, "pending_iteration", lambda r, iteration, force, rank: decisions[iteration])
    trained = []
    monkeypatch.setattr(
        trainer_server, "train_iteration", lambda w, *a, **k: (trained.append(w), (None, "held"))[1]
    )
    assert service.update({"run": run.uri, "iteration": 4})["outcome"] == "nothing to do"
    assert sent == []  # nothing to do: the other ranks are not asked
    assert service.update({"run": run.uri, "iteration": 5})["outcome"] == "trained"
    update_5 = {"op": "update", "iteration": 5, "from_memory": False, "replay": False, "optimizer_later": False}
    assert sent == [update_5] and trained == [work]
    # inputs that cannot train are refused before any rank starts
    bad = SimpleNamespace(
        samples=[SimpleNamespace(prompt_ids=[99], response_ids=[], prompt_id="p", sample_index=0)], replay=False
    )
    decisions[6] = bad
    with pytest.raises(trainer_server.MoerlError, match="outside the policy's vocabulary"):
        service.update({"run": run.uri, "iteration": 6})
    assert len(sent) == 1

    ended = []

    def abort(code):
        ended.append(code)
        raise Ended

    service.abort = abort

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(trainer_server, "train_iteration", oom)
    with pytest.raises(Ended):  # rank 0 too: its client then sees the trainer lost (exit 75, retried)
        service.update({"run": run.uri, "iteration": 5})
    assert ended == [trainer_server.EXIT_RANK_FAILED]


# ------------------------------------------------------------------------------ item 3: a cold start

INIT_PYTORCH_MAX_TRIES, INIT_PYTORCH_SLEEP_S = 100, 2.0  # kubeflow/trainer v1.9.4 config.go, initcontainer.go


def operator_starts_worker(job: dict, master_ready_at: float) -> str:
    """A Worker pod's start as kubeflow/trainer v1.9.4 and the kubelet run it: the template's init containers,
    then the operator's init-pytorch (setInitContainer appends it; `nslookup <job>-master-0` at most 100
    times, 2 s apart), in order; the master's headless Service resolves only once the master pod is Ready
    (`master_ready_at`, s). An init container that fails fails the pod under restartPolicy Never, and a
    failed replica under Never fails the job (pytorchjob_controller.go UpdateJobStatus). Our own
    init container runs steps.pytorchjob_launcher's wait with the args the manifest gives it."""
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["restartPolicy"] == "Never" or worker["restartPolicy"] == "OnFailure"
    master = pytorchjob.master_service(job["metadata"]["name"])
    clock = [0.0]

    def resolve(host: str) -> object:
        assert host == master
        if clock[0] < master_ready_at:
            raise OSError("NXDOMAIN")
        return [("10.0.0.1",)]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    for init in worker["template"]["spec"].get("initContainers", []):
        assert init["command"] == ["python", "-m", "steps.pytorchjob_launcher"]
        args = init["args"]
        host, seconds = args[args.index("--wait-for-host") + 1], float(args[args.index("--wait-seconds") + 1])
        code = pytorchjob_launcher.wait_for_host(host, seconds, resolve, sleep, lambda: clock[0])
        if code != 0:
            return "Failed"
    for _ in range(INIT_PYTORCH_MAX_TRIES):  # the operator's init-pytorch
        try:
            resolve(master)
            return "Running"
        except OSError:
            sleep(INIT_PYTORCH_SLEEP_S)
    return "Failed" if worker["restartPolicy"] == "Never" else "Restarting"


@pytest.mark.parametrize("kind", ["trainer-server", "update"])
def test_a_worker_survives_a_master_that_starts_late(kind):
    cfg = validate_config({**BASE, "trainer": {"nodes": 3, "server": kind == "trainer-server"}})
    job = pytorchjob.trainer_server_manifest(cfg, "wf", "uid") if kind == "trainer-server" else (
        pytorchjob.manifest(cfg, "4"))  # fmt: skip
    cold = 15 * 60.0  # a new node and the trainer image pulled on the master's node
    assert operator_starts_worker(job, master_ready_at=cold) == "Running"
    # the rule the wait is for: the operator's own init container alone gives up after ~200 s
    bare = json.loads(json.dumps(job))
    bare["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].pop("initContainers")
    if kind == "trainer-server":
        assert operator_starts_worker(bare, master_ready_at=cold) == "Failed"
    assert operator_starts_worker(bare, master_ready_at=100.0) == "Running"
    # the master has no wait of its own (the operator gives it none either), and it keeps the pod's security
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    init = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["initContainers"][0]
    assert "initContainers" not in master and init["securityContext"] == master["containers"][0]["securityContext"]


def test_the_wait_for_the_master_gives_up_after_its_own_time():
    clock = [0.0]

    def never(host):
        raise OSError("NXDOMAIN")

    def sleep(s):
        clock[0] += s

    assert pytorchjob_launcher.wait_for_host("job-master-0", 60.0, never, sleep, lambda: clock[0]) == 1
    assert 60.0 <= clock[0] < 60.0 + 2 * pytorchjob_launcher.HOST_POLL_SECONDS


# ------------------------------------------------------------------------------ item 5: the launcher's heartbeat


def test_the_trainer_ends_when_its_launcher_is_gone_not_when_updates_pause(tmp_path, monkeypatch):
    """Argo v4.1.2 (workflow/controller/operator.go) marks a daemon whose pod succeeds as Failed: a trainer
    that ended itself during a long pause between updates would spend its retries. It ends only once the
    launcher's heartbeat stops."""
    cfg = validate_config({**BASE, "run_store": tmp_path.as_uri(), "trainer": {"nodes": 2, "server": True}})
    job = pytorchjob.trainer_server_manifest(cfg, "wf", "uid")
    beat = pytorchjob_launcher.heartbeat_writer(job)
    assert beat is not None
    run = Store.open(cfg.run_store)
    args = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"]
    timeout = float(args[args.index("--idle-exit-s") + 1])
    assert timeout == cfg.trainer.server_idle_exit_s > 0

    clock = [0.0]
    key = run_store.launcher_heartbeat_key("wf")
    watch = trainer_server.LauncherWatch(run, key, timeout, lambda: clock[0])
    mesh = SimpleNamespace(rank=0, world_group=None, ep_size=1)
    lines: list[str] = []
    service = trainer_server.TrainerService(run, mesh, 0, None, None, lines.append)
    monkeypatch.setattr(trainer_server, "HEARTBEAT_S", 0.0)
    ticks = 0
    beats_for = 40  # idle ticks with a live launcher: 20 x the timeout without one update request

    def noop(command):
        nonlocal ticks
        ticks += 1
        clock[0] += timeout / 2
        if ticks <= beats_for:
            beat()  # the launcher polls its job
        return command

    monkeypatch.setattr(service, "_broadcast", noop)
    beat()  # before it created the job
    server = trainer_server.JsonServer({"update": service.update}, service.health, main_thread=True)
    server.serve_in_background()
    try:
        service.serve(server, watch)  # returns once it stopped itself
    finally:
        server.close()
    assert service.stopping.is_set() and beats_for < ticks <= beats_for + 3
    assert "the launcher is gone" in lines[-1]


def test_a_trainer_whose_launcher_never_wrote_a_heartbeat_never_ends_itself(tmp_path):
    """The local executor runs a launcher pod's job itself: no heartbeat, no launcher to outlive."""
    clock = [0.0]
    watch = trainer_server.LauncherWatch(Store.open(tmp_path.as_uri()), "launchers/wf/trainer-server.json", 10.0,
                                          lambda: clock[0])  # fmt: skip
    clock[0] = 10_000.0
    assert not watch.gone()


# ------------------------------------------------------------------------------ item 6: API hiccups


class FlakyApi:
    """kubernetes.client.CustomObjectsApi as kubernetes-client/python 30 raises: ApiException with the HTTP
    status (rest.py RESTClientObject.request), urllib3's own errors for a reset connection."""

    def __init__(self, gets: list) -> None:
        self.gets, self.log, self.exists = gets, [], False

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, **kw):
        self.log.append("delete")
        if not self.exists:
            raise ApiException(status=404, reason="Not Found")
        self.exists = False

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if not self.exists:
            raise ApiException(status=404, reason="Not Found")
        answer = self.gets.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.log.append("create")
        self.exists = True


RUNNING = {"status": {"conditions": [{"type": "Created"}, {"type": "Running"}]}}
SUCCEEDED = {"status": {"replicaStatuses": {"Master": {"succeeded": 1}}}}


def test_the_launcher_retries_transient_api_errors_and_keeps_the_job():
    reset = urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset by peer"))
    gets = [RUNNING, ApiException(status=429, reason="Too Many Requests"), ApiException(status=503),
            reset, ConnectionResetError(104, "reset"), ApiException(status=500), RUNNING, SUCCEEDED]  # fmt: skip
    api = FlakyApi(gets)
    slept: list[float] = []
    beats = []
    job = {"metadata": {"name": "run-trainer-server"}}
    code = pytorchjob_launcher.launch(job, "ns", poll_seconds=0, api=api, sleep=slept.append,
                                      heartbeat=lambda: beats.append(1))  # fmt: skip
    assert code == 0 and api.log == ["delete", "create"]  # never deleted nor recreated
    backoff = [s for s in slept if s > 0]
    assert backoff == [1.0, 2.0, 4.0, 8.0, 16.0] and len(beats) >= 4


def test_only_a_404_or_the_failed_condition_is_final():
    api = FlakyApi([RUNNING])
    api.gets.append(ApiException(status=404))
    job = {"metadata": {"name": "j"}}
    # the job gone while waited for: the wait fails (the daemon's retry replaces it)
    api.get_namespaced_custom_object = lambda *a: (_ for _ in ()).throw(ApiException(status=404))  # type: ignore
    api.exists = True
    assert pytorchjob_launcher.launch(job, "ns", poll_seconds=0, api=api, sleep=lambda s: None) == 1
    # a 403 (RBAC) is no hiccup: raised at once
    forbidden = FlakyApi([ApiException(status=403, reason="Forbidden")])
    with pytest.raises(ApiException):
        pytorchjob_launcher.launch(job, "ns", poll_seconds=0, api=forbidden, sleep=lambda s: None)
    assert pytorchjob_launcher.transient(ApiException(status=0, reason="SSLError"))
    assert not pytorchjob_launcher.transient(ApiException(status=409))


def test_a_create_that_failed_in_transit_is_not_a_conflict_on_retry():
    api = FlakyApi([SUCCEEDED])
    created = api.create_namespaced_custom_object
    tries = []

    def create(*args):
        tries.append(1)
        created(*args)  # it reached the API server...
        if len(tries) == 1:
            raise urllib3.exceptions.ProtocolError("Connection aborted.")  # ...but the answer was lost
        raise ApiException(status=409, reason="AlreadyExists")

    api.create_namespaced_custom_object = create  # type: ignore[method-assign]
    assert pytorchjob_launcher.launch({"metadata": {"name": "j"}}, "ns", poll_seconds=0, api=api,
                                      sleep=lambda s: None) == 0  # fmt: skip
    assert len(tries) == 2


# ------------------------------------------------------------------------------ item 8: DeepEP buffer regrowth


def test_a_bigger_deepep_buffer_is_made_once_torchs_cache_went_back_to_the_driver(monkeypatch):
    device = fake_deep_ep.DeviceMemory(total=1 << 30)
    monkeypatch.setattr(fake_deep_ep, "DEVICE", device)
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", device.synchronize)
    monkeypatch.setattr(torch.cuda, "empty_cache", device.empty_cache)
    monkeypatch.setenv("EP_DISABLE_GIN", "1")
    group = SimpleNamespace(rank=lambda: 0, size=lambda: 2)
    mesh = SimpleNamespace(world_size=2, ep_size=2, ep_rank=0, ep_group=group, device=torch.device("cuda", 0))
    held = HeldDispatch()
    hidden = 4096
    first = held.get("deepep", mesh, 8, hidden, 2, 8192)
    assert first.buffer is not None and device.buffers == fake_deep_ep.buffer_bytes(2, 8192, hidden)
    # Training cached what it freed: the driver has less left than the bigger buffer needs until torch
    # gives it back (the old dispatcher may still be referenced, e.g. by the last update's modules).
    bigger = fake_deep_ep.buffer_bytes(2, 16384, hidden)
    device.torch_cached = device.total - device.buffers - bigger + (4 << 20)
    second = held.get("deepep", mesh, 8, hidden, 2, 16384)
    assert second is not first and second.buffer is not None
    assert device.calls == ["synchronize", "empty_cache"] and device.buffers == bigger
    assert first._buffer is None  # released, on every rank at the same update
