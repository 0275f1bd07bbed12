"""A pod's end ends every process of it, as a container's end does on Kubernetes (its cgroup goes with it),
however the pod was started: a cold torchrun, whose workers each run in a session of their own, killed by
`--chaos kill=1@TEMPLATE`, leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from pipelines.local import run_workflow
from pipelines.local.pods import pod as pods
from steps.progress import PROGRESS_ANNOTATION

TORCHRUN = str(Path(sys.executable).parent / "torchrun")

# Rank 0 reports progress (where chaos strikes: it stops itself, then the executor kills the pod); rank 1 only
# waits for this pod's rank 0 to finish, so a rank 1 left behind by a killed attempt waits on for minutes.
RANKS = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from steps import progress
    pids = Path(sys.argv[1])
    with open(pids, "a") as out:  # one short append per rank
        out.write(f"{os.environ['ARGO_PROGRESS_FILE']} {os.environ['RANK']} {os.getpid()}\\n")
    finished = Path(os.environ["ARGO_PROGRESS_FILE"]).with_name("finished")
    if os.environ["RANK"] == "0":
        while len(pids.read_text().splitlines()) % 2:  # both ranks of this pod have written their pid
            time.sleep(0.01)
        for done in range(1, 11):
            progress.report(done, 10)
            time.sleep(0.05)
        finished.write_text("")
    else:
        deadline = time.monotonic() + 300
        while not finished.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def test_a_cold_torchrun_pod_killed_by_chaos_leaves_no_process_behind(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.01")
    script, pids = tmp_path / "ranks.py", tmp_path / "pids"
    script.write_text(RANKS)
    pids.write_text("")
    command = [TORCHRUN, "--nproc-per-node", "2", "--standalone", str(script), str(pids)]
    manifest = {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "pod-end-"},
        "spec": {
            "entrypoint": "main",
            "templates": [
                {"name": "main", "steps": [[{"name": "update", "template": "update"}]]},
                {
                    "name": "update",
                    "metadata": {"annotations": {PROGRESS_ANNOTATION: "true"}},  # chaos strikes at its reports
                    "retryStrategy": {"limit": 1, "retryPolicy": "Always"},
                    "container": {"image": "trainer", "command": command},
                },
            ],
        },
    }
    try:
        result = run_workflow(
            manifest, chaos="kill=1@update,seed=2", workdir=tmp_path / "work", view=None, warm_start=False
        )
        assert result.succeeded, result.message
        attempts = {}
        for line in pids.read_text().splitlines():
            pod, rank, pid = line.split()
            attempts.setdefault(pod, {})[rank] = int(pid)
        assert len(attempts) == 2 and all(set(ranks) == {"0", "1"} for ranks in attempts.values()), attempts
        left = [pid for ranks in attempts.values() for pid in ranks.values() if alive(pid)]
        assert left == [], f"processes of the killed pod still running: {left}"
    finally:
        for line in pids.read_text().splitlines():
            pid = int(line.split()[2])
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_process_that_left_its_group_after_it_was_found_is_killed_too(tmp_path: Path, monkeypatch):
    """The race the kill closes: a worker found while still in its launcher's process group, which then
    calls setsid (torchrun's start_new_session) before that group is killed. Here the group lookup returns
    the launcher's group, as it would have a moment before the worker's setsid."""
    env = {**os.environ, "MOERL_LOCAL_SANDBOX": str(tmp_path / "sandbox")}
    launcher = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    worker = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)  # a session of its own
    try:
        pods.forget_container_processes()
        monkeypatch.setattr(pods, "_pgid", lambda pid: launcher.pid)  # found before its setsid
        pod = object.__new__(pods.Pod)
        pod.process, pod.plan = launcher, SimpleNamespace(env=env)
        pod._signal_container(signal.SIGKILL)
        assert launcher.wait(timeout=60) == -signal.SIGKILL
        assert worker.wait(timeout=60) == -signal.SIGKILL
    finally:
        for process in (launcher, worker):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_a_process_that_ends_while_proc_is_read_is_skipped(monkeypatch):
    """The process index lists /proc and reads each environ: a pid that is gone by then (ESRCH, ENOENT) is skipped,
    where Path.glob's stat of it raised ProcessLookupError and stopped the controller."""
    listed = os.listdir("/proc")
    monkeypatch.setattr(pods.os, "listdir", lambda path: ["999999999", "self", *listed])
    index = pods._read_process_index()
    assert all(pids for pids in index.values())
