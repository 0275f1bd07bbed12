"""Experiment tracking against real backends: an MLflow tracking server on loopback, TensorBoard event files
read back with tensorboard's EventAccumulator, W&B offline run files read back from the run directory; a
tracker outage mid-run; no duplicate point whatever is retried."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from steps.errors import MoerlError
from steps.run import keys as run_store
from steps.run.config import validate_config
from steps.store.object_store import Store
from steps.tracking import trackers as tracking
from steps.tracking.mlflow_tracker import RUN_STORE_TAG
from steps.tracking.tensorboard_tracker import TensorboardTracker
from tests.wandb_records import history_rows, records, run_records

REPO = Path(__file__).resolve().parents[1]
# `make install` puts the MLflow server in a venv of its own: mlflow (the server) pins pyarrow<26 and the
# project pins pyarrow 26; the steps need only the client, mlflow-skinny.
MLFLOW_SERVER = Path(os.environ.get("MOERL_MLFLOW_SERVER", REPO / ".venv" / "mlflow-server" / "bin" / "mlflow"))
SERVER_START_SECONDS = 180
# A fresh server's first requests take seconds on a loaded machine: the tests that need answers wait long.
PATIENT = 60


def run_config(store: Path, **tracking_section: object):
    return validate_config(
        {"sft_checkpoint": "file:///nonexistent", "run_store": store.as_uri(), "tracking": tracking_section}
    )


def score_metrics(i: int) -> dict:
    return {"iteration": i, "policy_version": i - 1, "reward_mean": 0.5 + i / 10, "accuracy": i / 10,
            "heldout_accuracy": 0.4 + i / 100, "score_seconds": 1.5}  # fmt: skip


def update_metrics(i: int) -> dict:
    return {"loss": 1.0 / i, "clip_fraction": 0.01 * i, "kl": 0.001, "entropy": 2.0, "grad_norm": 0.3,
            "tokens_per_s": 1000.0 + i, "is_weight": {"mean": 1.0, "min": 0.9, "max": 1.1},
            "grad_norms": [0.1, 0.3], "ep_backend": "alltoall"}  # fmt: skip


def write_store_metrics(run: Store, i: int) -> None:
    run.put_json(f"metrics/iter-{i:06d}.json", score_metrics(i))
    run.put_json(f"metrics/iter-{i:06d}.update.json", {"update": update_metrics(i), "iteration": i})


def argo_status(name: str, iterations: range, retried: dict[str, int] | None = None) -> dict:
    """An Argo Workflow status as the controller (and the local executor) writes it: retry nodes with pod
    attempts `<task>(N)`, rollout shards `rollout-i(s:s)`."""
    retried = retried or {}
    nodes = {name: {"displayName": name, "type": "DAG", "phase": "Succeeded", "startedAt": "2026-01-01T00:00:00Z",
                    "finishedAt": "2026-01-01T01:00:00Z"}}  # fmt: skip
    clock = 0

    def pod(display: str, seconds: int, phase: str = "Succeeded") -> None:
        nonlocal clock
        start, clock = clock, clock + seconds
        nodes[f"{name}-{len(nodes)}"] = {
            "displayName": display, "type": "Pod", "phase": phase,
            "startedAt": f"2026-01-01T00:{start // 60:02d}:{start % 60:02d}Z",
            "finishedAt": f"2026-01-01T00:{clock // 60:02d}:{clock % 60:02d}Z",
        }  # fmt: skip

    for i in iterations:
        for step in ("rollout", "score", "update", "publish"):
            task = f"{step}-{i}"
            nodes[f"{name}-{len(nodes)}"] = {"displayName": task, "type": "Retry", "phase": "Succeeded"}
            tasks = [f"{task}(0:0)", f"{task}(1:1)"] if step == "rollout" else [task]
            for t in tasks:
                for attempt in range(retried.get(task, 0)):
                    pod(f"{t}({attempt})", 2, "Failed")
                pod(f"{t}({retried.get(task, 0)})", 3)
    return {"phase": "Running", "nodes": nodes}


# ------------------------------------------------------------------------------------------ TensorBoard


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_one_point_per_iteration_read_back_by_tensorboard(tmp_path):
    cfg = run_config(tmp_path / "run", tensorboard={})
    run = Store.open(cfg.run_store)
    for i in (1, 2, 3):
        tracking.log_iteration(run, cfg, "score", i, score_metrics(i), log=lambda _: None)
        tracking.log_iteration(run, cfg, "update", i, update_metrics(i), log=lambda _: None)
    # A retried score-2, and one that died after writing its event file but before the ledger's record.
    tracking.log_iteration(run, cfg, "score", 2, score_metrics(2), log=lambda _: None)
    run.delete(run_store.ledger_key("tensorboard", "score", 2))
    tracking.log_iteration(run, cfg, "score", 2, score_metrics(2), log=lambda _: None)
    assert run.exists(run_store.ledger_key("tensorboard", "score", 2))  # logged again: the file rewritten whole

    found = scalars(tmp_path / "run" / "tensorboard")
    assert found["score/accuracy"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert [s for s, _ in found["update/is_weight/max"]] == [1, 2, 3]
    for tag in ("update/loss", "update/clip_fraction", "update/kl", "update/entropy", "update/grad_norm",
                "update/tokens_per_s", "update/is_weight/mean", "update/is_weight/min", "score/reward_mean"):
        assert [s for s, _ in found[tag]] == [1, 2, 3], tag  # fmt: skip
    assert "update/grad_norms" not in found and "score/iteration" not in found
    # No digest sidecar in the log dir: tensorboard would read any name holding 'tfevents' as an event file.
    assert all(p.name.startswith("events.out.tfevents.") for p in (tmp_path / "run" / "tensorboard").iterdir())


def test_the_readme_tensorboard_command_serves_the_points(tmp_path):
    """`tensorboard --logdir <run>/tensorboard` (README), on loopback: its HTTP API has each step's points."""
    cfg = run_config(tmp_path / "run", tensorboard={})
    run = Store.open(cfg.run_store)
    for i in (1, 2):
        tracking.log_iteration(run, cfg, "update", i, update_metrics(i), log=print)
    port = free_port()
    argv = [str(Path(sys.executable).with_name("tensorboard")), "--logdir", str(tmp_path / "run" / "tensorboard"),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?tag=update/loss&run=."
        deadline, points = time.monotonic() + SERVER_START_SECONDS, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    points = json.loads(response.read())
                if len(points) == 2:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)
    assert [(step, value) for _, step, value in points] == [(1, 1.0), (2, 0.5)]


def test_report_adds_workflow_times_and_retries_once_and_catches_up(tmp_path):
    cfg = run_config(tmp_path / "run", tensorboard={})
    run = Store.open(cfg.run_store)
    for i in (1, 2):
        write_store_metrics(run, i)  # as if the score and update steps had run while tensorboard was off
    status_file = tmp_path / "status.json"
    status_file.write_text(json.dumps(argo_status("demo-abc", range(1, 3), {"score-2": 2, "rollout-1": 1})))
    os.environ[tracking.STATUS_FILE_ENV] = str(status_file)
    try:
        for _ in range(2):  # the report retried, or the exit handler of a resumed Workflow
            tracking.log_run_end(run, cfg, tracking.stored_step_metrics(run), "demo-abc", "moerl", log=print)
    finally:
        del os.environ[tracking.STATUS_FILE_ENV]
    found = scalars(tmp_path / "run" / "tensorboard")
    assert found["workflow/score_retries"] == [(1, 0.0), (2, 2.0)]
    assert found["workflow/rollout_retries"] == [(1, 2.0), (2, 0.0)]  # one retry on each of the two shards
    assert found["workflow/score_seconds"] == [(1, 3.0), (2, 7.0)]  # two failed attempts of 2 s, then 3 s
    assert [s for s, _ in found["update/loss"]] == [1, 2] and [s for s, _ in found["score/accuracy"]] == [1, 2]


def test_workflow_points_read_compressed_nodes():
    import base64
    import gzip

    status = argo_status("wf", range(1, 3), {"publish-2": 1})
    packed = {"phase": "Running", "compressedNodes": base64.b64encode(gzip.compress(json.dumps(status["nodes"])
                                                                                    .encode())).decode()}  # fmt: skip
    assert tracking.workflow_points(packed) == tracking.workflow_points(status)
    assert tracking.workflow_points(packed)[2]["workflow/publish_retries"] == 1.0
    assert tracking.workflow_points({"offloadNodeStatusVersion": "abc"}) == {}


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = directory / "ca.crt", directory / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_file, key_file


def test_in_a_cluster_the_report_reads_its_workflow_from_the_kubernetes_api(tmp_path, monkeypatch):
    """The Workflow object through the API server with the pod's service-account token and CA, as the
    moerl-report Role allows: GET /apis/argoproj.io/v1alpha1/namespaces/NS/workflows/NAME (here a loopback
    HTTPS server standing in for it)."""
    import http.server
    import ssl
    import threading

    account = tmp_path / "serviceaccount"
    account.mkdir()
    cert_file, key_file = self_signed_certificate(account)
    (account / "token").write_text("pod-token\n")
    status = argo_status("wf-7", range(1, 2))
    seen: list[tuple[str, str]] = []

    class ApiServer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append((self.path, self.headers.get("Authorization", "")))
            body = json.dumps({"kind": "Workflow", "status": status}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ApiServer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.delenv(tracking.STATUS_FILE_ENV, raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.server_address[1]))
    try:
        got = tracking.read_workflow_status("wf-7", "moerl", 30, print, service_account=account)
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [("/apis/argoproj.io/v1alpha1/namespaces/moerl/workflows/wf-7", "Bearer pod-token")]
    assert tracking.workflow_points(got) == tracking.workflow_points(status) != {}


def test_a_status_file_of_another_workflow_is_not_read(tmp_path, monkeypatch):
    status_file = tmp_path / "status.json"
    status_file.write_text(json.dumps(argo_status("other-wf", range(1, 2))))
    monkeypatch.setenv(tracking.STATUS_FILE_ENV, str(status_file))
    lines: list[str] = []
    assert tracking.read_workflow_status("this-wf", "moerl", 5, lines.append) is None
    assert "another Workflow" in lines[0]
    assert tracking.read_workflow_status("other-wf", "moerl", 5, lines.append)["nodes"]


def test_workflow_points_leave_out_an_iteration_whose_publish_did_not_succeed():
    status = argo_status("wf", range(1, 3))
    for node in status["nodes"].values():
        if node["displayName"] == "publish-2":
            node["phase"] = "Failed"
    points = tracking.workflow_points(status)
    assert sorted(points) == [1]
    assert set(points[1]) == {f"workflow/{s}_{k}" for s in tracking.WORKFLOW_STEPS for k in ("seconds", "retries")}


# ------------------------------------------------------------------------------------------ MLflow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1, a sqlite store and local artifacts in a temp dir; killed by stop()."""

    def __init__(self, root: Path, port: int):
        self.root, self.port = root, port
        self.uri = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [str(MLFLOW_SERVER), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
                "--artifacts-destination", str(self.root / "artifacts")]  # fmt: skip
        log = open(self.root / f"server-{time.monotonic_ns()}.log", "wb")
        self.process = subprocess.Popen(argv, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + SERVER_START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health within {SERVER_START_SECONDS} s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)  # the server and its worker processes, which share its session
            self.process.wait(timeout=30)
        self.process = None


@pytest.fixture
def mlflow_server(tmp_path):
    if not MLFLOW_SERVER.is_file():
        pytest.skip(f"no MLflow server at {MLFLOW_SERVER}: `make install` builds it (or set MOERL_MLFLOW_SERVER)")
    root = tmp_path / "mlflow-server"
    root.mkdir()
    server = MlflowServer(root, free_port())
    server.start()
    yield server
    server.stop()


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def history(client, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_mlflow_server_gets_points_params_tags_and_artifacts_once(tmp_path, mlflow_server):
    cfg = run_config(tmp_path / "run", mlflow={"tracking_uri": mlflow_server.uri, "experiment": "moerl-test"},
                     argo_ui_url="https://argo.example.com/", timeout_seconds=PATIENT)  # fmt: skip
    run = Store.open(cfg.run_store)
    for i in (1, 2):
        write_store_metrics(run, i)
        tracking.log_iteration(run, cfg, "score", i, score_metrics(i), log=print)
        tracking.log_iteration(run, cfg, "update", i, update_metrics(i), log=print)
    tracking.log_iteration(run, cfg, "score", 2, score_metrics(2), log=print)  # a retry: the ledger skips it
    # A retry of a step that died after the server took its points but before the ledger's record (its
    # pending record is there).
    run.delete(run_store.ledger_key("mlflow", "update", 2))
    assert run.exists(run_store.pending_key("mlflow", "update", 2))
    tracking.log_iteration(run, cfg, "update", 2, update_metrics(2), log=print)
    report = tmp_path / "report"
    report.mkdir()
    (report / "report.md").write_text("# report\n")
    (report / "report.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    status_file = tmp_path / "status.json"
    status_file.write_text(json.dumps(argo_status("demo-xyz", range(1, 3), {"update-1": 1})))
    os.environ[tracking.STATUS_FILE_ENV] = str(status_file)
    try:
        files = {"report.md": report / "report.md", "report.png": report / "report.png"}
        for _ in range(2):
            tracking.log_run_end(run, cfg, tracking.stored_step_metrics(run), "demo-xyz", "moerl", files, print)
    finally:
        del os.environ[tracking.STATUS_FILE_ENV]

    client = mlflow_client(mlflow_server.uri)
    run_id = run.get_json(run_store.MLFLOW_RUN_KEY)["run_id"]
    for key in ("score/reward_mean", "score/accuracy", "update/loss", "update/clip_fraction", "update/kl",
                "update/entropy", "update/is_weight/mean", "update/grad_norm", "update/tokens_per_s",
                "workflow/update_retries", "workflow/rollout_seconds"):
        assert history(client, run_id, key) == [1, 2], key  # fmt: skip
    assert [m.value for m in client.get_metric_history(run_id, "workflow/update_retries")] == [1.0, 0.0]
    got = client.get_run(run_id).data
    assert got.params["trainer.lr"] == "0.0002" and got.params["tracking.mlflow.experiment"] == "moerl-test"
    assert got.tags["argo.workflow"] == "demo-xyz"
    assert got.tags["argo.ui"] == "https://argo.example.com/workflows/moerl/demo-xyz"
    assert got.tags[RUN_STORE_TAG] == run.uri
    artifacts = sorted(a.path for a in client.list_artifacts(run_id, "report"))
    assert artifacts == ["report/report.md", "report/report.png"]
    # The MLflow run is found again from the store: one run in the experiment.
    experiment = client.get_experiment_by_name("moerl-test")
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_mlflow_outage_mid_run_warns_keeps_the_run_going_and_the_report_catches_up(tmp_path, mlflow_server):
    cfg = run_config(tmp_path / "run", tensorboard={}, timeout_seconds=PATIENT,
                     mlflow={"tracking_uri": mlflow_server.uri, "experiment": "outage"})  # fmt: skip
    run = Store.open(cfg.run_store)
    write_store_metrics(run, 1)
    tracking.log_iteration(run, cfg, "score", 1, score_metrics(1), log=print)
    mlflow_server.stop()  # the tracker goes down mid-run

    lines: list[str] = []
    write_store_metrics(run, 2)
    tracking.log_iteration(run, cfg, "score", 2, score_metrics(2), log=lines.append)
    tracking.log_iteration(run, cfg, "update", 2, update_metrics(2), log=lines.append)
    assert any("mlflow missed score points of iteration 2" in line and "stay in the run store" in line
               for line in lines), lines  # fmt: skip
    assert any("mlflow missed update points of iteration 2" in line for line in lines), lines
    assert not any(line.startswith("warning: tracking: tensorboard") for line in lines), lines
    assert [s for s, _ in scalars(tmp_path / "run" / "tensorboard")["score/accuracy"]] == [1, 2]
    assert not run.exists(run_store.ledger_key("mlflow", "score", 2))

    mlflow_server.start()  # back up, same store: the report logs what it missed
    tracking.log_run_end(run, cfg, tracking.stored_step_metrics(run), "wf", "moerl", log=print)
    client = mlflow_client(mlflow_server.uri)
    run_id = run.get_json(run_store.MLFLOW_RUN_KEY)["run_id"]
    assert history(client, run_id, "score/accuracy") == [1, 2]
    assert history(client, run_id, "update/loss") == [1, 2]


def test_mlflow_down_from_the_start_fails_nothing(tmp_path):
    port = free_port()  # nothing listens there
    cfg = run_config(tmp_path / "run", timeout_seconds=3, mlflow={"tracking_uri": f"http://127.0.0.1:{port}"})
    run = Store.open(cfg.run_store)
    lines: list[str] = []
    tracking.log_iteration(run, cfg, "score", 1, score_metrics(1), log=lines.append)
    assert any("mlflow is unavailable" in line for line in lines), lines
    assert any("mlflow missed score points of iteration 1" in line for line in lines), lines


def test_a_tracker_that_never_answers_is_cut_off_by_the_deadline(tmp_path):
    """A server that takes the connection and never answers (a hung proxy): the step goes on after the
    deadline, with a warning; the points stay in the store and no ledger record claims them."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # connections complete in the kernel's backlog; nothing ever reads or answers
        uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
        cfg = run_config(tmp_path / "run", tensorboard={}, timeout_seconds=2, mlflow={"tracking_uri": uri})
        run = Store.open(cfg.run_store)
        lines: list[str] = []
        tracking.log_iteration(run, cfg, "update", 4, update_metrics(4), log=lines.append)
    assert any(line.startswith("warning: tracking: mlflow is unavailable") for line in lines), lines
    assert any("mlflow missed update points of iteration 4" in line for line in lines), lines
    assert not run.exists(run_store.ledger_key("mlflow", "update", 4))
    assert run.exists(run_store.ledger_key("tensorboard", "update", 4))


# ------------------------------------------------------------------------------------------ W&B


def test_wandb_offline_run_files_hold_each_steps_points(tmp_path):
    cfg = run_config(tmp_path / "run", wandb={"mode": "offline", "project": "moerl-test"})
    run = Store.open(cfg.run_store)
    tracking.log_iteration(run, cfg, "score", 1, score_metrics(1), log=print)
    tracking.log_iteration(run, cfg, "update", 1, update_metrics(1), log=print)
    tracking.log_iteration(run, cfg, "score", 1, score_metrics(1), log=print)  # a retry: touches nothing

    run_id = tracking.wandb_run_id(run.uri)
    (score_dir,) = (tmp_path / "run" / "wandb" / "score-iter-000001").glob(f"offline-run-*-{run_id}")
    rows = history_rows(score_dir / f"run-{run_id}.wandb")
    assert len(rows) == 1
    assert json.loads(rows[0]["iteration"]) == 1
    assert json.loads(rows[0]["score/accuracy"]) == pytest.approx(0.1)
    (update_dir,) = (tmp_path / "run" / "wandb" / "update-iter-000001").glob(f"offline-run-*-{run_id}")
    update_rows = history_rows(update_dir / f"run-{run_id}.wandb")
    assert json.loads(update_rows[0]["update/is_weight/max"]) == pytest.approx(1.1)
    runs = [r for r in run_records(score_dir / f"run-{run_id}.wandb")]
    assert runs and all(r.run_id == run_id and r.project == "moerl-test" for r in runs)
    # define_metric: every key is plotted against `iteration`, so score and update of one iteration align.
    metrics = [r.metric for r in records(score_dir / f"run-{run_id}.wandb") if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "iteration" for m in metrics), metrics

    (tmp_path / "report.md").write_text("# report\n")
    tracking.log_run_end(run, cfg, tracking.stored_step_metrics(run), "wf-1", "moerl",
                         {"report.md": tmp_path / "report.md"}, print)  # fmt: skip
    (report_dir,) = (tmp_path / "run" / "wandb" / "report-wf-1").glob(f"offline-run-*-{run_id}")
    assert (report_dir / "files" / "report.md").read_text() == "# report\n"
    # `wandb sync` takes the copied directories for offline runs of one W&B run, to upload in order.
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(wandb_cli), "sync", "--dry-run", *map(str, (score_dir, update_dir, report_dir))],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert "Would sync 3 run(s)" in out.stdout + out.stderr, out.stdout + out.stderr


# ------------------------------------------------------------------------------------------ config, render


def test_no_tracking_imports_no_tracking_library(tmp_path):
    code = (
        "import sys\n"
        "from steps.run.config import validate_config\n"
        "from steps import score, report\n"
        "from steps.tracking import trackers as tracking\n"
        "from steps.store.object_store import Store\n"
        f"cfg = validate_config({{'sft_checkpoint': 'file:///x', 'run_store': '{(tmp_path / 'run').as_uri()}'}})\n"
        "tracking.log_iteration(Store.open(cfg.run_store), cfg, 'score', 1, {'accuracy': 1.0})\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'wandb', 'tensorboard'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("section", "path"),
    [
        ({"mlflow": {"tracking_uri": "mlflow.example.com"}}, "tracking.mlflow.tracking_uri"),
        ({"mlflow": {"secret": "Not_A_Name"}}, "tracking.mlflow.secret"),
        ({"wandb": {"api_key_secret": "wandb key"}}, "tracking.wandb.api_key_secret"),
        ({"wandb": {"mode": "cloud"}}, "tracking.wandb.mode"),
        ({"argo_ui_url": "argo"}, "tracking.argo_ui_url"),
        ({"tensorbord": {}}, "tracking.tensorbord"),
    ],
)
def test_bad_tracking_config_names_the_field(tmp_path, section, path):
    with pytest.raises(MoerlError) as err:
        run_config(tmp_path / "run", **section)
    assert path in str(err.value)


def test_rendered_credentials_are_secret_refs_never_values(tmp_path, monkeypatch):
    from pipelines.render import WORKFLOW_TEMPLATE, render

    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-that-must-not-leak")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "mlflow-password-that-must-not-leak")
    cfg = run_config(
        tmp_path / "run",
        mlflow={"secret": "mlflow-credentials", "experiment": "e"},
        wandb={"project": "p", "api_key_secret": "wandb", "api_key_secret_key": "api-key"},
    )
    paths = render(cfg, tmp_path / "out", kfp=False)
    text = Path(paths[WORKFLOW_TEMPLATE]).read_text()
    assert "must-not-leak" not in text
    templates = {t["name"]: t for t in yaml.safe_load(text)["spec"]["templates"]}
    for name in ("score", "update", "report"):
        env = {e["name"]: e for e in templates[name]["container"]["env"]}
        assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "wandb", "key": "api-key",
                                                                     "optional": True}  # fmt: skip
        assert env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-credentials"
        assert all("value" not in e for k, e in env.items() if k.startswith(("WANDB", "MLFLOW"))), name
    assert "WANDB_API_KEY" not in json.dumps(templates["rollout"])  # only the steps that log get credentials
    report_args = templates["report"]["container"]["args"]
    assert report_args[report_args.index("--workflow-name") + 1] == "{{workflow.name}}"
    # The Argo UI points at the trackers: the Workflow's description names them.
    description = yaml.safe_load(text)["metadata"]["annotations"]["workflows.argoproj.io/description"]
    assert "MLflow experiment `e`" in description and tracking.wandb_run_id(cfg.run_store) in description


def test_demo_config_writes_tensorboard_files_by_default():
    from pipelines.demo import DEMO_CONFIG

    cfg = validate_config({**yaml.safe_load(DEMO_CONFIG.read_text()), "sft_checkpoint": "file:///x",
                           "run_store": "file:///y"})  # fmt: skip
    assert tracking.configured(cfg) == ["tensorboard"]


# ------------------------------------------------------------------------------------------ the whole run


@pytest.mark.slow
def test_local_run_with_kills_logs_every_step_once_to_mlflow_and_tensorboard(tmp_path, mlflow_server, monkeypatch):
    """The tiny fault-test run, two iterations, through the local executor with hard kills in random steps:
    score and update log as they finish, the report adds the workflow's step times and retries from the
    executor's status; retried steps add no point."""
    from faults_helpers import make_sft_checkpoint, tiny_config

    from pipelines.demo import run_config as run_locally

    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")
    sft = make_sft_checkpoint(tmp_path / "sft")
    config = tiny_config(sft.as_uri(), (tmp_path / "run").as_uri(), iterations=2)
    config["tracking"] = {"tensorboard": {}, "argo_ui_url": "https://argo.example.com", "timeout_seconds": PATIENT,
                          "mlflow": {"tracking_uri": mlflow_server.uri, "experiment": "local-run"}}  # fmt: skip
    result = run_locally(validate_config(config), tmp_path / "work", chaos="kill=3,seed=7")
    assert result.succeeded, f"{result.message}; logs in {result.run_dir}/pods"

    status = json.loads((tmp_path / "work" / "status.json").read_text())
    expected = tracking.workflow_points(status)
    assert sorted(expected) == [1, 2]
    for i in (1, 2):  # a retry is an attempt that did not succeed, i.e. that chaos killed
        for step in tracking.WORKFLOW_STEPS:
            pods = [n for n in status["nodes"].values() if n["type"] == "Pod"]
            mine = [n for n in pods if n["displayName"] == f"{step}-{i}" or n["displayName"].startswith(f"{step}-{i}(")]
            failed = [n for n in mine if n["phase"] != "Succeeded"]
            assert expected[i][f"workflow/{step}_retries"] == len(failed), (step, i)
    found = scalars(tmp_path / "run" / "tensorboard")
    for tag in ("score/reward_mean", "score/accuracy", "update/loss", "update/clip_fraction", "update/entropy",
                "update/is_weight/mean", "update/grad_norm", "update/tokens_per_s", "workflow/update_seconds",
                "workflow/rollout_retries"):
        assert [s for s, _ in found[tag]] == [1, 2], tag  # fmt: skip
    for i in (1, 2):
        for key, value in expected[i].items():
            assert dict(found[key])[i] == pytest.approx(value), (key, i)

    client = mlflow_client(mlflow_server.uri)
    run_id = Store.open(config["run_store"]).get_json(run_store.MLFLOW_RUN_KEY)["run_id"]
    for key in ("score/accuracy", "update/loss", "update/kl", "workflow/score_retries", "workflow/publish_seconds"):
        assert history(client, run_id, key) == [1, 2], key
    tags = client.get_run(run_id).data.tags
    assert tags["argo.workflow"] == result.name
    assert tags["argo.ui"] == f"https://argo.example.com/workflows/moerl/{result.name}"
    assert sorted(a.path for a in client.list_artifacts(run_id, "report")) == ["report/report.md", "report/report.png"]


def test_report_role_grants_only_get_on_workflows_to_the_workflow_account():
    docs = list(yaml.safe_load_all((REPO / "manifests" / "moerl" / "rbac.yaml").read_text()))
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "moerl-report")
    assert role["rules"] == [{"apiGroups": ["argoproj.io"], "resources": ["workflows"], "verbs": ["get"]}]
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["name"] == "moerl-report")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "moerl-workflow"}]


def test_a_failure_inside_tracking_never_fails_the_step(tmp_path, monkeypatch):
    cfg = run_config(tmp_path / "run", tensorboard={})
    run = Store.open(cfg.run_store)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(TensorboardTracker, "log_points", broken)
    monkeypatch.setattr(Store, "put_json", broken)  # the ledger's writes too
    lines: list[str] = []
    tracking.log_iteration(run, cfg, "score", 1, score_metrics(1), lines.append)
    tracking.log_run_end(run, cfg, {1: {"score": score_metrics(1)}}, "wf", "moerl", None, lines.append)
    assert any("log_iteration failed (OSError: disk full)" in line for line in lines), lines
    assert any("log_run_end failed" in line or "tensorboard missed" in line for line in lines), lines


def test_kfp_pipeline_takes_the_tracking_credentials_from_secrets(tmp_path, monkeypatch):
    from pipelines.render import KFP_PIPELINE, render

    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-that-must-not-leak")
    cfg = run_config(tmp_path / "run", mlflow={"secret": "mlflow-credentials"},
                     wandb={"api_key_secret": "wandb", "api_key_secret_key": "api-key"})  # fmt: skip
    text = Path(render(cfg, tmp_path / "out", kfp=True)[KFP_PIPELINE]).read_text()
    assert "must-not-leak" not in text
    platform = [d for d in yaml.safe_load_all(text) if d and "platforms" in d][0]
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    with_secrets = {name: spec["secretAsEnv"] for name, spec in executors.items() if spec.get("secretAsEnv")}
    assert with_secrets and all(any(k in name for k in ("score", "update", "report")) for name in with_secrets)
    refs = {(s["secretNameParameter"]["runtimeValue"]["constant"], m["secretKey"], m["envVar"], s.get("optional"))
            for specs in with_secrets.values() for s in specs for m in s["keyToEnv"]}  # fmt: skip
    assert ("wandb", "api-key", "WANDB_API_KEY", True) in refs
    assert ("mlflow-credentials", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI", True) in refs
