"""A rollout server on SGLang (tests/fake_sglang, which carries SGLang 0.5.17's rules): an in-place update that
SGLang fails leaves its weights no version's, so the request is answered 503 (the client retries it), the
server says it is not ready and answers 503 while it opens a new engine from the run store, then serves
again; a SIGTERM while SGLang generates a chunk aborts SGLang's requests and answers 503 at once, instead of
finishing the chunk first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from delta_helpers import moved
from experience_helpers import REPO, make_run, step_env, tiny_model, write_checkpoint

from steps.errors import MoerlError
from steps.run import checkpoint, serving
from steps.run.keys import chunk_key
from steps.store.object_store import Store

FAKE_SGLANG = Path(__file__).parent / "fake_sglang"
WORKFLOW = "wf-sglang"
NAME = "rollout-server-0"
CONFIG = dict(
    prompts_per_iteration=6, group_size=2, heldout_size=0, sampling={"max_new_tokens": 4},
    rollout={"num_shards": 1, "chunk_size": 3, "servers": 1, "server_wait_s": 60, "engine": "sglang"},
    placement={"rollout": {"resources": {"limits": {"nvidia.com/gpu": 1}}}},
)  # fmt: skip

# steps.rollout_server's main with the fake SGLang, which needs no GPU.
SERVER = """
import sys
sys.path.insert(0, sys.argv[1])
import steps.engines.sglang_engine as se
se.sglang_unavailable_reason = lambda: None
from steps.errors import run_cli
from steps.rollout_server import main
sys.argv = ["steps.rollout_server", *sys.argv[2:]]
run_cli(main)
"""


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


@pytest.fixture
def run(tmp_path, model) -> str:
    return make_run(tmp_path, write_checkpoint(model, tmp_path / "sft"), **CONFIG)


def start_server(run: str, tmp_path: Path, **fake: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", SERVER, str(FAKE_SGLANG), "--run", run, "--workflow", WORKFLOW, "--name", NAME]
    env = step_env() | {"MOERL_NODE_CACHE": str(tmp_path / "node-cache"), "PYTHONPATH": str(REPO)} | fake
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ready_entry(run: str, server: subprocess.Popen, timeout: float = 60) -> serving.Registration:
    deadline = time.monotonic() + timeout
    while not (found := serving.live_servers(Store.open(run), WORKFLOW, NAME, exact=True)):
        assert server.poll() is None, server.stdout.read()
        assert time.monotonic() < deadline, "the server was not ready in time"
        time.sleep(0.05)
    return found[0]


def health(entry: serving.Registration) -> dict:
    state = serving.health(entry)
    assert state is not None
    return state


def stop(server: subprocess.Popen) -> str:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    try:
        out, _ = server.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        out, _ = server.communicate()
    return out


def publish_v1(run: str, model, tmp_path: Path) -> None:
    """v000001: other weights of the same model (its config.json is v000000's, as publish keeps it)."""
    v1 = write_checkpoint(moved(model, seed=1), tmp_path / "v1")
    (v1 / "config.json").write_bytes(checkpoint.read_file(Store.open(run), 0, "config.json"))
    checkpoint.publish_dir(Store.open(run), v1, 1, parent=0, iteration=1)


def request(run: str, iteration: int, chunk: int, version: int) -> dict:
    return {"run": Store.open(run).uri, "iteration": iteration, "chunk": chunk, "policy_version": version}


def test_a_failed_sglang_load_is_answered_503_and_the_server_reopens_its_engine(tmp_path, run, model):
    """SGLang's load fails once (weight_updater: "Failed to update weights: ... Rolling back"): 503, not a 400
    that fails the client for good; not ready and 503 while the new engine opens; then the retry is served."""
    server = start_server(run, tmp_path, FAKE_SGLANG_UPDATE_FAILS="1", FAKE_SGLANG_START_S="2")
    try:
        entry = ready_entry(run, server)
        publish_v1(run, model, tmp_path)
        with pytest.raises(serving.ServerLost, match=r"(?s)Failed to update weights.*opens a new engine on v000001"):
            serving.call(entry, "chunk", request(run, 2, 0, 1))
        with pytest.raises(serving.ServerLost, match="is opening a new engine on v000001"):  # meanwhile
            serving.call(entry, "chunk", request(run, 2, 1, 1))
        assert health(entry)["ready"] is False
        entry = ready_entry(run, server)
        assert health(entry)["version"] == 1
        answer = serving.call(entry, "chunk", request(run, 2, 0, 1))
        assert answer["generated"] is True and answer["policy_version"] == 1
        assert Store.open(run).exists(chunk_key(2, 0))
    finally:
        log = stop(server)
    assert server.returncode == 143, log
    assert "sglang engine ready with v000001" in log, log


def test_a_refused_update_is_still_a_bad_request(tmp_path, run):
    """A dir of another model is refused before SGLang sees it: the engine is not broken, nothing reopens,
    and the answer is 400 (it fails the same on every server)."""
    server = start_server(run, tmp_path)
    try:
        entry = ready_entry(run, server)
        other = write_checkpoint(tiny_model(seed=5, num_experts=8), tmp_path / "other")
        checkpoint.publish_dir(Store.open(run), other, 1, parent=0, iteration=1)
        with pytest.raises(MoerlError, match="another model or dtype than this SGLang engine serves"):
            serving.call(entry, "chunk", request(run, 2, 0, 1))
        assert health(entry)["ready"] is True and health(entry)["version"] == 0
    finally:
        log = stop(server)
    assert server.returncode == 143, log


def test_a_sigterm_during_an_sglang_chunk_aborts_it_and_answers_503(tmp_path, run):
    """The chunk would take 60 s; SIGTERM aborts SGLang's requests (TokenizerManager.abort_request): the
    client hears 503 within seconds, nothing is written, the server exits 143."""
    generating = tmp_path / "generating"
    server = start_server(run, tmp_path, FAKE_SGLANG_GENERATE_S="60", FAKE_SGLANG_GENERATING=str(generating))
    outcome: dict = {}

    def client() -> None:
        try:
            outcome["answer"] = serving.call(entry, "chunk", request(run, 1, 0, 0))
        except (serving.ServerLost, MoerlError) as err:
            outcome["error"] = err

    try:
        entry = ready_entry(run, server)
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not generating.exists():
            assert time.monotonic() < deadline and thread.is_alive(), outcome
            time.sleep(0.02)
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        thread.join(timeout=15)
        answered_s = time.monotonic() - signalled
        assert not thread.is_alive(), "SGLang's chunk was not interrupted: no answer 15 s after SIGTERM"
        log = stop(server)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert isinstance(outcome.get("error"), serving.ServerLost), outcome
    assert "is stopping: chunk 0 not generated" in str(outcome["error"]) and "aborted" in str(outcome["error"])
    assert answered_s < 10
    assert server.returncode == 143, log
    assert not Store.open(run).exists(chunk_key(1, 0))


ABORT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import steps.engines.sglang_engine as se
from steps.engines.interface import GenerationInterrupted, GenerationRequest, SamplingParams
se.sglang_unavailable_reason = lambda: None
engine = se.SGLangEngine(sys.argv[2], se.SGLangSettings())
requests = [GenerationRequest("p", (1, 2), k, seed=k) for k in range(3)]
said = {}
stop_at = time.monotonic() + 0.3
began = time.monotonic()
try:
    engine.generate(requests, SamplingParams(stop_token_ids=(2,)), should_stop=lambda: time.monotonic() > stop_at)
    said["stopped"] = "not interrupted"
except GenerationInterrupted as err:
    said["stopped"] = str(err)
said["seconds"] = time.monotonic() - began
said["aborts"] = engine.engine.tokenizer_manager.aborts
print(json.dumps(said))
"""


def test_should_stop_aborts_sglangs_requests_in_flight(tmp_path, model):
    """generate polls should_stop on SGLang's loop and aborts with abort_request(abort_all=True); the aborted
    outputs (finish_reason "abort") become GenerationInterrupted, not an error about the samples."""
    ckpt = write_checkpoint(model, tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_SGLANG_GENERATE_S": "30"}
    done = subprocess.run([sys.executable, "-c", ABORT, str(FAKE_SGLANG), str(ckpt)], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said["aborts"] == [["", True]]
    assert "SGLang aborted the batch" in said["stopped"] and said["seconds"] < 5
