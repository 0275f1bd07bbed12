"""Warm starts (pipelines/local/pods/warm.py): a `python -m` pod forked from a Python that has imported torch
behaves as the fresh process it replaces: argv, cwd, sys.path[0], environment, stdio, exit codes, process
group, fresh random seeds, torchrun's ranks and its failure handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.local import run_workflow
from pipelines.local.pods.pod import warm_start_candidates
from pipelines.local.pods.warm import LIBRARIES, PER_POD_ENV, WarmStarter, python_program
from pipelines.workflow.commands import warm_preload
from steps.store.object_store import Store

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
# Light preloads keep these tests fast; the demo's own preload is checked by the import scan below.
LIGHT = ("json", "numpy", "torch")
DEMO_PRELOAD = (*LIBRARIES, *warm_preload())


def workflow(templates: list[dict], steps: list[list[str]]) -> dict:
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": "warm-"},
        "spec": {
            "entrypoint": "main",
            "templates": [
                {"name": "main", "steps": [[{"name": n, "template": n} for n in group] for group in steps]},
                *templates,
            ],
        },
    }


def probe(name: str, command: list[str], env: dict[str, str] | None = None, **extra) -> dict:
    env = {"PROBE": "hello", "PYTHONUNBUFFERED": "1", **(env or {})}
    container = {"image": "python:3.11", "command": command, "env": [{"name": k, "value": v} for k, v in env.items()]}
    return {"name": name, "container": container, **extra}


def pods(result) -> dict[str, dict]:
    """Node display name -> its node, whether it started warm, its stdout and stderr."""
    nodes = {node["name"]: node for node in result.status["nodes"].values() if node["type"] == "Pod"}
    found = {}
    for pod_dir in (result.run_dir / "pods").iterdir():
        record = json.loads((pod_dir / "pod.json").read_text())
        node = nodes[record["metadata"]["annotations"]["workflows.argoproj.io/node-name"]]
        found[node["displayName"]] = {
            "node": node,
            "warm": record["local"]["warmStart"],
            "stdout": (pod_dir / "stdout.log").read_text(),
            "stderr": (pod_dir / "stderr.log").read_text(),
        }
    return found


def run(manifest: dict, tmp_path: Path, warm: bool):
    starter = WarmStarter(LIGHT, wait_for_server=True) if warm else False
    return run_workflow(manifest, workdir=tmp_path / ("warm" if warm else "cold"), view=None, warm_start=starter)


def test_python_program_recognises_python_m_and_single_node_torchrun():
    plain = python_program([PY, "-m", "steps.rollout", "--run", "x"])
    assert (plain.module, plain.args, plain.ranks) == ("steps.rollout", ["--run", "x"], None)
    ranks = python_program(
        [TORCHRUN, "--nproc-per-node", "2", "--standalone", "--nnodes", "1", "-m", "a.b", "--", "--x"]
    )
    assert (ranks.module, ranks.args, ranks.ranks) == ("a.b", ["--x"], 2)
    launched = python_program([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", "-m", "m"])
    assert (launched.module, launched.ranks) == ("m", 3)
    cold = [
        [PY, "-c", "print(1)"],  # not a module
        [PY, "script.py"],
        ["/usr/bin/python3", "-m", "m"],  # another interpreter: its own libraries
        [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "-m", "m"],  # a rendezvous across nodes
        [TORCHRUN, "--nproc-per-node", "gpu", "-m", "m"],  # torchrun's own reading of the machine
        [TORCHRUN, "--max-restarts", "3", "--nproc-per-node", "2", "-m", "m"],  # restarts: torchrun's agent
        [TORCHRUN, "--nproc-per-node", "2", "train.py"],
        [TORCHRUN, "--no-python", "--nproc-per-node", "2", "-m", "m"],
        ["bash", "-c", "python -m m"],
    ]
    for argv in cold:
        assert python_program(argv) is None, argv


def test_a_warm_pod_sees_what_a_fresh_python_m_process_sees(tmp_path):
    manifest = workflow(
        [
            probe("a", [PY, "-m", "tests.warm_probe", "x", "--y"]),
            probe("b", [PY, "-m", "tests.warm_probe", "x", "--y"]),
            probe("ranks", [TORCHRUN, "--nproc-per-node", "2", "--standalone", "-m", "tests.warm_probe", "--", "--r"]),
        ],
        [["a", "b", "ranks"]],
    )
    cold, warm = run(manifest, tmp_path, warm=False), run(manifest, tmp_path, warm=True)
    assert cold.succeeded and warm.succeeded, (cold.message, warm.message)
    cold_pods, warm_pods = pods(cold), pods(warm)
    assert all(p["warm"] for p in warm_pods.values()) and not any(p["warm"] for p in cold_pods.values())

    def seen(pod: dict) -> list[dict]:
        lines = [json.loads(line) for line in pod["stdout"].splitlines()]
        return sorted(lines, key=lambda line: str(line["env"]["RANK"]))

    draws = []
    for name in ("a", "b", "ranks"):
        cold_seen, warm_seen = seen(cold_pods[name]), seen(warm_pods[name])
        assert len(cold_seen) == len(warm_seen) == (2 if name == "ranks" else 1)
        for c, w in zip(cold_seen, warm_seen, strict=True):
            draws += [(w["random"], w["numpy"])]
            for line in (c, w):
                del line["random"], line["numpy"]
            assert w == c, name
        assert warm_pods[name]["stderr"].count("Traceback") == 0
    assert len(set(draws)) == len(draws)  # forked siblings do not repeat each other's random numbers
    ranks = seen(warm_pods["ranks"])
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"] and {r["threads"] for r in ranks} == {1}
    assert ranks[0]["argv"][1:] == ["--r"] and all(r["pgid_is_own"] for r in ranks)


def test_a_warm_pod_fails_with_its_exit_code_and_traceback(tmp_path):
    manifest = workflow(
        [
            probe("crash", [PY, "-m", "tests.warm_probe"], {"PROBE": "fail"}),
            probe("exit3", [PY, "-m", "tests.warm_probe"], {"PROBE_EXIT": "3"}),
        ],
        [["crash", "exit3"]],
    )
    result = run(manifest, tmp_path, warm=True)
    found = pods(result)
    assert found["crash"]["warm"] and found["exit3"]["warm"]
    assert found["crash"]["node"]["message"] == "main: Error (exit code 1)"
    assert "RuntimeError: probe failed on purpose" in found["crash"]["stderr"]
    assert found["exit3"]["node"]["message"] == "main: Error (exit code 3)"


def test_a_warm_pod_ends_as_a_fresh_interpreter_does(tmp_path):
    """The warm child skips the interpreter's teardown (warm_server.exit_without_teardown) but not what comes
    before it: atexit callbacks, non-daemon threads, buffered output, sys.exit's message, KeyboardInterrupt's
    death by SIGINT. Cold and warm runs of each ending show the same exit, output and last line of stderr."""
    endings = {
        "atexit": {}, "thread": {}, "buffered": {"PYTHONUNBUFFERED": ""}, "message": {}, "interrupt": {},
        "exit-code": {},
    }  # fmt: skip
    manifest = workflow(
        [probe(name, [PY, "-m", "tests.warm_probe", "--end", name], env) for name, env in endings.items()],
        [list(endings)],
    )
    cold, warm = pods(run(manifest, tmp_path, warm=False)), pods(run(manifest, tmp_path, warm=True))

    def ending(pod: dict) -> tuple:
        stderr = pod["stderr"].strip().splitlines()
        return pod["node"]["phase"], pod["node"].get("message"), pod["stdout"].splitlines()[1:], stderr[-1:]

    for name in endings:
        assert warm[name]["warm"] and not cold[name]["warm"]
        assert ending(warm[name]) == ending(cold[name]), name
    assert ending(warm["atexit"])[2] == ["atexit callback ran"]
    assert ending(warm["thread"])[2] == ["thread finished"]
    assert ending(warm["buffered"])[2] == ["buffered line"]
    assert ending(warm["message"])[1:] == ("main: Error (exit code 1)", [], ["probe says goodbye"])
    assert ending(warm["interrupt"])[1] == "main: Error (exit code 130)"  # 128 + SIGINT
    assert ending(warm["interrupt"])[3] == ["KeyboardInterrupt"]
    assert ending(warm["exit-code"])[1] == "main: Error (exit code 7)"


def test_a_failed_warm_rank_stops_the_others_as_torchrun_does(tmp_path):
    # rank 1 exits 5 at once; rank 0 would sleep a minute: the launcher must SIGTERM it and fail the pod
    command = [TORCHRUN, "--nproc-per-node", "2", "--standalone", "-m", "tests.warm_probe"]
    manifest = workflow([probe("ranks", command, {"PROBE": "rank-fail"})], [["ranks"]])
    started = time.monotonic()
    result = run(manifest, tmp_path, warm=True)
    found = pods(result)["ranks"]
    assert found["warm"] and found["node"]["message"] == "main: Error (exit code 1)"
    assert "rank 1 failed (exit code 5)" in found["stderr"]
    assert time.monotonic() - started < 50  # not the sleeping rank's 60 s: it was stopped


def test_a_warm_pod_past_its_deadline_is_killed_with_its_process_group(tmp_path):
    command = [TORCHRUN, "--nproc-per-node", "2", "--standalone", "-m", "tests.warm_probe"]
    # The deadline is generous so that on a loaded machine the ranks have printed their pids before it; the
    # assertions hold for however many did (a rank still starting is in the same process group).
    manifest = workflow([probe("slow", command, {"PROBE": "sleep"}, activeDeadlineSeconds=30)], [["slow"]])
    result = run(manifest, tmp_path, warm=True)
    found = pods(result)["slow"]
    assert found["warm"] and "deadline" in found["node"]["message"]
    pids = [int(line) for line in found["stderr"].splitlines() if line.isdigit()]
    assert 1 <= len(pids) <= 2
    for pid in pids:  # the ranks are gone (the launcher's process group was killed)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_preloaded_modules_read_no_per_pod_variable_at_import():
    """The warm server imports DEMO_PRELOAD once with its own HOME and no sandbox; a pod's values of PER_POD_ENV must
    not have been captured by those imports, or a warm pod would see the server's."""
    scan = """
import os, sys, importlib
for name in sys.argv[1:]:
    try:  # as the server does: a module this environment lacks (pandas without the bench extra) is skipped
        importlib.import_module(name)
    except ImportError:
        pass
hits = []
for module_name, module in list(sys.modules.items()):
    if module_name in ("site", "sys", "__main__"):  # USER_SITE (off in a venv), orig_argv
        continue
    for key, value in list(getattr(module, "__dict__", {}).items()):
        text = value if isinstance(value, str) else str(value) if type(value).__name__ == "PosixPath" else ""
        if "zz-per-pod-probe" in text:
            hits.append(f"{module_name}.{key}")
print(hits)
"""
    env = {**os.environ, **{name: "/zz-per-pod-probe" for name in PER_POD_ENV if "THREADS" not in name}}
    out = subprocess.run([PY, "-c", scan, *DEMO_PRELOAD], env=env, cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_tiny_run_started_warm_and_cold_leaves_the_same_bytes(fault_free_run, tmp_path, monkeypatch):
    """Every step of the tiny run (import-sft, rollout shards, score, torchrun update, publish, report) forked
    from one warm Python, and every step a new interpreter: bit-identical checkpoints, experience and scores."""
    from faults_helpers import assert_same_result

    from pipelines.workflow import workflow as build_workflow

    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")
    stores = {}
    for mode in ("warm", "cold"):
        run_dir = tmp_path / f"run-{mode}"
        cfg = fault_free_run.config_for(run_dir.as_uri())
        starter = WarmStarter(DEMO_PRELOAD, wait_for_server=True) if mode == "warm" else False
        result = run_workflow(
            build_workflow(cfg).to_dict(), workdir=tmp_path / f"work-{mode}", view=None, warm_start=starter
        )
        assert result.succeeded, (mode, result.message)
        records = [json.loads(p.read_text()) for p in (result.run_dir / "pods").glob("*/pod.json")]
        assert {r["local"]["warmStart"] for r in records} == {mode == "warm"}
        stores[mode] = Store.open(run_dir.as_uri())
    assert_same_result(stores["warm"], stores["cold"])
    assert_same_result(stores["warm"], fault_free_run.store)


def test_a_dead_server_sends_pods_back_to_cold_starts(tmp_path):
    starter = WarmStarter(LIGHT, wait_for_server=True)
    argv = [PY, "-m", "tests.warm_probe"]
    env = {**os.environ, "PROBE": "hello"}
    try:
        first = starter.start(argv, REPO, env, tmp_path / "out1", tmp_path / "err1")
        assert first is not None and first.wait(timeout=60) == 0
        assert json.loads((tmp_path / "out1").read_text())["env"]["PROBE"] == "hello"
        (server,) = starter.servers.values()
        server.process.kill()
        server.process.wait()
        assert starter.start(argv, REPO, env, tmp_path / "out2", tmp_path / "err2") is None  # the caller starts it cold
        assert not (tmp_path / "out2").exists()  # and nothing was started warm behind its back
    finally:
        starter.close()
    assert starter.dir is None  # the status files and server logs are gone


def test_pods_wait_for_an_importing_server_and_one_stopped_meanwhile_never_starts(tmp_path, monkeypatch):
    # With servers started on first need (no prestart), the first Python pod starts the server (whose
    # imports take 8 s here) and itself cold; the next two, of the same environment (so of the same server),
    # come while it imports: "late" waits and then starts warm, "stopped" reaches its 2 s deadline while
    # waiting, so no process of it ever runs (whatever the machine's speed: its server is still importing).
    monkeypatch.setenv("WARM_SLOW_IMPORT", "8")
    quick = [PY, "-m", "json.tool", "--help"]
    manifest = workflow(
        [
            probe("first", quick),
            probe("late", [PY, "-m", "tests.warm_probe"]),
            probe("stopped", [PY, "-m", "tests.warm_probe", "--behave", "sleep"], activeDeadlineSeconds=2),
        ],
        [["first"], ["late", "stopped"]],
    )
    starter = WarmStarter(("json", "torch", "tests.warm_slow_import"))
    starter.prestart = lambda argv, env: False  # type: ignore[method-assign]
    result = run_workflow(manifest, workdir=tmp_path, view=None, warm_start=starter)
    found = pods(result)
    assert not found["first"]["warm"] and found["first"]["node"]["phase"] == "Succeeded"
    assert found["late"]["warm"] and found["late"]["node"]["phase"] == "Succeeded"
    assert json.loads(found["late"]["stdout"])["env"]["PROBE"] == "hello"
    stopped = found["stopped"]
    assert not stopped["warm"] and stopped["stdout"] == "" and "deadline" in stopped["node"]["message"]


def test_servers_start_with_the_workflow_so_its_first_python_pod_starts_warm(tmp_path, monkeypatch):
    # The server of the templates' environment imports (3 s here) from the moment the run starts; the
    # shell pod before the first Python pod does not hold it up, and that pod waits for it, then starts warm.
    monkeypatch.setenv("WARM_SLOW_IMPORT", "3")
    shell = {"name": "shell", "container": {"image": "alpine", "command": ["sh", "-c", "true"]}}
    manifest = workflow([shell, probe("first", [PY, "-m", "tests.warm_probe"])], [["shell"], ["first"]])
    starter = WarmStarter(("json", "torch", "tests.warm_slow_import"))
    result = run_workflow(manifest, workdir=tmp_path, view=None, warm_start=starter)
    assert result.succeeded, result.message
    found = pods(result)
    assert found["first"]["warm"] and json.loads(found["first"]["stdout"])["env"]["PROBE"] == "hello"


def test_only_templates_whose_environment_is_known_before_their_pods_get_a_server_early():
    def template(name: str, env: list[dict], command: list[str] | None = None) -> dict:
        return {"name": name, "container": {"image": "x", "command": command or ["python", "-m", "m"], "env": env}}

    templates = [
        template("plain", [{"name": "A", "value": "1"}, {"name": "HOME", "value": "/tmp"}]),  # HOME: per pod
        template("parameter", [{"name": "A", "value": "{{inputs.parameters.a}}"}]),
        template("field", [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]),
        template("path", [{"name": "DATA", "value": "/mnt/data"}]),  # the sandbox may map it per pod
        {"name": "steps", "steps": [[{"name": "a", "template": "plain"}]]},
    ]
    (argv, env), *rest = warm_start_candidates(templates)
    assert rest == [] and argv == [PY, "-m", "m"] and env["A"] == "1" and env.get("HOME") == os.environ.get("HOME")
    starter = WarmStarter(LIGHT)
    try:
        assert not starter.prestart(["sh", "-c", "true"], env) and starter.servers == {}
        assert starter.prestart(argv, env) and starter.prestart(argv, {**env, "HOME": "/elsewhere"})
        assert len(starter.servers) == 1  # one environment
    finally:
        starter.close()


def test_moerl_run_starts_the_step_pods_server_before_it_renders_and_closes_it_when_the_run_never_starts(
    tmp_path, monkeypatch
):
    import yaml

    import pipelines.demo as demo
    import pipelines.local.run
    import pipelines.render
    from pipelines.config import load_config
    from steps.errors import MoerlError
    from steps.tracking.trackers import STATUS_FILE_ENV

    seen: dict = {}

    class Recording(WarmStarter):
        def __init__(self, preload: tuple[str, ...]):
            super().__init__(LIGHT)
            seen["starter"] = self

    def render(cfg, out, **options):
        seen["keys"] = set(seen["starter"].servers)
        seen["rendered"] = real_render(cfg, out, **options)
        raise MoerlError("stopped after rendering")

    real_render = pipelines.render.render
    monkeypatch.setattr(pipelines.local.run, "WarmStarter", Recording)
    monkeypatch.setattr(pipelines.local.run, "warm_starts_enabled", lambda: True)
    monkeypatch.setattr(pipelines.render, "render", render)
    cfg = load_config(demo.DEMO_CONFIG, {"sft_checkpoint": str(tmp_path / "sft"), "run_store": str(tmp_path / "run")})
    # run_config gives its pods the path of the status file; the same path before and after, so that the
    # rendered pods' environment below is the one the server was started with
    monkeypatch.setenv(STATUS_FILE_ENV, str(tmp_path / "status.json"))
    with pytest.raises(MoerlError, match="stopped after rendering"):
        demo.run_config(cfg, tmp_path)
    assert len(seen["keys"]) == 1 and seen["starter"].servers == {}  # started before rendering; closed
    # ... with the environment of every Python pod of the rendered workflow: they will use that server
    manifest = yaml.safe_load(Path(seen["rendered"][pipelines.render.WORKFLOW]).read_text())
    candidates = warm_start_candidates(manifest["spec"]["templates"])
    assert candidates and {WarmStarter._key(env) for _, env in candidates} == seen["keys"]
