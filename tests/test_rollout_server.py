"""Rollout servers (steps/rollout_server.py): chunks they generate are the bytes a shard's own engine writes,
whatever the number of servers and shards; a server killed mid-request loses nothing and doubles nothing; a
request for another version than its iteration's is refused."""

import signal
import subprocess
import sys
import time

import pytest
from experience_helpers import REPO, make_run, run_files, step_env, tiny_model, write_checkpoint
from test_update_experience import free_port

from steps.errors import MoerlError
from steps.progress import STRIKE_ENV
from steps.rollout import rollout_shard
from steps.run import serving
from steps.run.keys import chunk_key, rollout_prefix, server_key
from steps.store.object_store import Store

CONFIG = dict(prompts_per_iteration=14, group_size=3, rollout={"num_shards": 3, "chunk_size": 3},
              sampling={"max_new_tokens": 10}, heldout_size=0)  # fmt: skip
SERVED = CONFIG | {"rollout": {"num_shards": 3, "chunk_size": 3, "servers": 2, "server_wait_s": 120}}
WORKFLOW = "wf-test"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tiny_model(seed=2), tmp_path_factory.mktemp("policy") / "v0")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, checkpoint_dir):
    """Iteration 1's chunks as the shards' own engines write them."""
    run = make_run(tmp_path_factory.mktemp("reference"), checkpoint_dir, **CONFIG)
    for shard in range(3):
        rollout_shard(run, 1, shard, 3, log=lambda line: None)
    return run_files(run, rollout_prefix(1))


def start_server(run: str, name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "steps.rollout_server", "--run", run, "--workflow", WORKFLOW, "--name", name]
    return subprocess.Popen(argv, cwd=REPO, env=step_env() | (env or {}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def wait_ready(run: str, names: set[str], proc: list[subprocess.Popen]) -> None:
    while {e.name for e in serving.live_servers(Store.open(run), WORKFLOW, "rollout-server-")} != names:
        for p in proc:
            assert p.poll() is None, p.stdout.read()
        time.sleep(0.1)


def stop(server: subprocess.Popen) -> str:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
    out, _ = server.communicate(timeout=60)
    return out


def rollout_step(run: str, shard: int, num_shards: int) -> subprocess.CompletedProcess:
    argv = ["--run", run, "--iteration", "1", "--shard", str(shard), "--num-shards", str(num_shards),
            "--workflow", WORKFLOW]  # fmt: skip
    return subprocess.run([sys.executable, "-m", "steps.rollout", *argv], cwd=REPO, env=step_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("num_shards", [1, 3])
def test_chunks_from_two_servers_are_the_bytes_of_the_shards_own_engines(
    tmp_path, checkpoint_dir, reference, num_shards
):
    run = make_run(tmp_path, checkpoint_dir, **SERVED)
    servers = [start_server(run, f"rollout-server-{k}") for k in range(2)]
    try:
        wait_ready(run, {"rollout-server-0", "rollout-server-1"}, servers)
        results = [rollout_shard(run, 1, s, num_shards, workflow=WORKFLOW, log=lambda line: None)
                   for s in range(num_shards)]  # fmt: skip
    finally:
        logs = [stop(s) for s in servers]
    assert [s.returncode for s in servers] == [143, 143], logs
    assert run_files(run, rollout_prefix(1)) == reference
    assert {name for r in results for name in r.servers} == ({"rollout-server-0"} if num_shards == 1
                                                             else {"rollout-server-0", "rollout-server-1"})  # fmt: skip
    assert not Store.open(run).exists(server_key(WORKFLOW, "rollout-server-0"))  # unregistered on SIGTERM


def test_a_server_killed_mid_request_loses_and_doubles_nothing(tmp_path, checkpoint_dir, reference):
    """The server stops itself after generating its first chunk and before writing it (a chaos strike);
    SIGKILL then: the client's attempt exits 75, nothing of that chunk is on the store; the replacement
    serves the retry, which skips the chunks already written."""
    run = make_run(tmp_path, checkpoint_dir, **SERVED | {"rollout": SERVED["rollout"] | {"servers": 1}})
    marker = tmp_path / "struck"
    server = start_server(run, "rollout-server-0", {STRIKE_ENV: f"0.5:{marker}"})
    try:
        wait_ready(run, {"rollout-server-0"}, [server])
        client = subprocess.Popen(
            [sys.executable, "-m", "steps.rollout", "--run", run, "--iteration", "1", "--shard", "0",
             "--num-shards", "1", "--workflow", WORKFLOW],
            cwd=REPO, env=step_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        while not marker.exists():
            assert client.poll() is None, client.communicate()
            time.sleep(0.05)
        assert int(marker.read_text()) == server.pid
        assert not Store.open(run).exists(chunk_key(1, 0))  # generated, not written
        server.kill()
        _, err = client.communicate(timeout=120)
        assert client.returncode == serving.EXIT_SERVER_LOST, err
        assert "a retry sends the rest" in err
        assert not run_files(run, rollout_prefix(1))
    finally:
        stop(server)
    replacement = start_server(run, "rollout-server-0")  # what the daemon's retryStrategy starts
    try:
        wait_ready(run, {"rollout-server-0"}, [replacement])
        retry = rollout_step(run, 0, 1)
        assert retry.returncode == 0, retry.stderr
    finally:
        stop(replacement)
    assert run_files(run, rollout_prefix(1)) == reference


def test_a_server_refuses_a_request_for_another_version_or_run(tmp_path, checkpoint_dir):
    run = make_run(tmp_path, checkpoint_dir, **SERVED)
    server = start_server(run, "rollout-server-0")
    try:
        wait_ready(run, {"rollout-server-0"}, [server])
        [entry] = serving.live_servers(Store.open(run), WORKFLOW, "rollout-server-")
        request = {"run": Store.open(run).uri, "iteration": 1, "chunk": 0, "policy_version": 3}
        with pytest.raises(MoerlError, match="samples from v000000"):
            serving.call(entry, "chunk", request)
        with pytest.raises(MoerlError, match="this server serves"):
            serving.call(entry, "chunk", request | {"run": "file:///elsewhere", "policy_version": 0})
        assert not run_files(run, rollout_prefix(1))
    finally:
        stop(server)


def test_a_rollout_step_with_no_server_exits_to_be_retried(tmp_path, checkpoint_dir):
    run = make_run(tmp_path, checkpoint_dir, **SERVED | {"rollout": SERVED["rollout"] | {"server_wait_s": 0}})
    done = rollout_step(run, 0, 1)
    assert done.returncode == serving.EXIT_SERVER_LOST
    assert "no rollout server of workflow wf-test answered" in done.stderr


def test_a_stale_registration_is_not_a_live_server(tmp_path):
    run = Store.open(tmp_path.as_uri())
    entry = serving.register(run, WORKFLOW, "rollout-server-0", port=free_port())  # nobody listens there
    assert serving.registrations(run, WORKFLOW, "rollout-server-") == [entry]
    assert serving.live_servers(run, WORKFLOW, "rollout-server-") == []


def test_the_probe_says_ready_only_for_a_ready_server(tmp_path, checkpoint_dir):
    run = make_run(tmp_path, checkpoint_dir, **SERVED)

    def probe(name: str) -> int:
        argv = ["--run", run, "--workflow", WORKFLOW, "--server", name]
        return subprocess.run([sys.executable, "-m", "steps.server_probe", *argv], cwd=REPO, env=step_env()).returncode

    assert probe("rollout-server-0") == 1
    server = start_server(run, "rollout-server-0")
    try:
        wait_ready(run, {"rollout-server-0"}, [server])
        assert probe("rollout-server-0") == 0 and probe("rollout-server-1") == 1
    finally:
        stop(server)
    assert probe("rollout-server-0") == 1
