"""Shared by the fault-injection tests (tests/test_faults_*.py): one tiny run config, a fault-free reference
run of it, ways to run its steps as the workflow runs them (with faults), and checks of what a run store holds.

The tiny run: the demo model after 30 SFT steps (it gets the answer format right about half the time, so
rewards vary within groups and the update really changes the weights), 8 prompts x 4 samples cut into 4
chunks over 2 rollout shards, responses of at most 5 tokens, one iteration, the update on one rank.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipelines.local import RunResult, run_workflow
from pipelines.workflow import workflow
from pipelines.workflow.commands import Slots, step_command
from steps.run import checkpoint
from steps.run import keys as run_store
from steps.run.config import RunConfig, validate_config
from steps.run.keys import chunk_key, metrics_key, rollout_prefix, scored_key
from steps.store.backend import RESERVED_PREFIX, SIDECAR_PREFIX
from steps.store.object_store import Store

REPO = Path(__file__).resolve().parents[1]
HOOKS = REPO / "tests" / "fault_hooks"  # sitecustomize.py: crash points inside a step's own process
ITERATION = 1
NUM_CHUNKS = 4
SHARDS = 2
# Put into the environment of the fault-free run and of `moerl render`: it must never show up in any output.
SECRET_MARKER = "moerl-secret-marker-0c9e7a41"
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "ARGO_TOKEN")
FAST_RETRY = {"limit": 3, "backoff": {"duration": "1s", "factor": 1, "max_duration": "10m"}}


def tiny_config(sft_uri: str, run_uri: str, **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "faults",
        "seed": 0,
        "sft_checkpoint": sft_uri,
        "run_store": run_uri,
        "iterations": 1,
        "task": {"name": "addition"},
        "prompts_per_iteration": 8,
        "group_size": 4,
        "heldout_size": 0,
        "rollout": {"num_shards": SHARDS, "chunk_size": 2, "engine": "torch"},
        "sampling": {"max_new_tokens": 5},
        "trainer": {"ep_backend": "local", "nproc_per_node": 1, "micro_batch_size": 32},
        "argo": {"semaphore": None, "run_mutex": False, "report_artifact": False, "pod_gc": "OnWorkflowSuccess"},
        "retries": {role: FAST_RETRY for role in ("rollout", "score", "trainer", "control")},
    }
    data.update(overrides)
    return data


def make_sft_checkpoint(directory: Path) -> Path:
    """The demo model after 30 SFT steps (a few seconds), deterministic."""
    from steps.demo.sft import SftSettings, train_sft, write_checkpoint

    return write_checkpoint(train_sft(SftSettings(steps=30, batch_size=32, train_prompts=512)), directory)


def step_env(fault: list[dict] | None = None, **extra: str) -> dict[str, str]:
    """The environment the workflow gives a step, plus crash points for tests/fault_hooks/sitecustomize.py."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("MOERL_FAULT", None)
    if fault:
        env["PYTHONPATH"] = os.pathsep.join([str(HOOKS), *filter(None, [os.environ.get("PYTHONPATH")])])
        env["MOERL_FAULT"] = json.dumps(fault)
    return env


def kill_at(on: str, match: str, nth: int = 1, when: str = "after", sig: str = "KILL") -> list[dict]:
    return [{"kill": sig, "on": on, "match": match, "nth": nth, "when": when}]


def step_argv(step: str, run_uri: str, cfg: RunConfig, shard: int | None = None) -> list[str]:
    """The command line of a step as the workflow's container runs it (torchrun for the update), from the
    workflow's own builder, with this interpreter's python and torchrun."""
    at = Slots(iteration=str(ITERATION), shard=str(shard), policy_version="0")
    more = {"metrics_out": os.devnull} if step == "score" else {}
    command = step_command(cfg.model_copy(update={"run_store": run_uri}), step, at, **more)
    program = {"python": sys.executable, "torchrun": str(Path(sys.executable).parent / "torchrun")}
    return [program.get(command.argv[0], command.argv[0]), *command.argv[1:]]


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str


def start(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> Finished:
    out, err = proc.communicate(timeout=timeout)
    return Finished(proc.returncode, "".join(getattr(proc, "early_stdout", [])) + out, err)


def wait_for_line(proc: subprocess.Popen, text: str) -> None:
    """Read the step's stdout until a line containing `text` (a moment inside its work, past its start-up)."""
    proc.early_stdout = []  # type: ignore[attr-defined]  # finish() puts these lines back in front
    for line in proc.stdout:  # type: ignore[union-attr]
        proc.early_stdout.append(line)  # type: ignore[attr-defined]
        if text in line:
            return
    raise AssertionError(f"the step ended before it printed {text!r}")


def run(argv: list[str], env: dict[str, str], timeout: float = 240) -> Finished:
    return finish(start(argv, env), timeout)


def preempt_after(proc: subprocess.Popen, delay: float, grace: float = 1.0) -> Finished:
    """A Spot reclaim at `delay` seconds: SIGTERM to the process group (torchrun passes it on to its workers),
    then SIGKILL to everything the step started once the grace period is over."""
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        tree = process_tree(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            kill_tree(tree)
    return finish(proc)


def process_tree(pid: int) -> list[int]:
    """pid and its descendants (Linux /proc), read before any of them is killed: torchrun starts each worker
    in a session of its own, so a worker is in no process group of torchrun's."""
    tree, i = [pid], 0
    while i < len(tree):
        for task in Path(f"/proc/{tree[i]}/task").glob("*/children"):
            try:
                tree += [int(child) for child in task.read_text().split()]
            except OSError:
                pass  # the task ended meanwhile
        i += 1
    return tree


def kill_after(proc: subprocess.Popen, delay: float) -> Finished:
    """A hard kill at `delay` seconds of everything the step started (torchrun's workers included), as a
    container's end kills all of its processes."""
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        kill_tree(process_tree(proc.pid))
    return finish(proc)


def kill_tree(pids: list[int]) -> None:
    """SIGKILL to the process group of each of pids."""
    for pid in pids:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


# ----------------------------------------------------------------------------------------------------
# The fault-free reference run and copies of its stages
# ----------------------------------------------------------------------------------------------------


@dataclass
class ReferenceRun:
    sft_dir: Path
    run_uri: str
    run_dir: Path
    work_dir: Path
    result: RunResult
    config: dict[str, Any]

    @property
    def store(self) -> Store:
        return Store.open(self.run_uri)

    def config_for(self, run_uri: str, **overrides: Any) -> RunConfig:
        return validate_config({**self.config, "run_store": run_uri, **overrides}, "fault test config")

    def copy_stage(self, run_uri: str, stage: str) -> Store:
        """A new run store holding what the reference held just before `stage` ran (objects copied through
        the store, digests included): "rollout", "score", "update" or "publish"."""
        stages = ["rollout", "score", "update", "publish"]
        prefixes = ["run.json", "checkpoints/v000000/"]
        prefixes += [rollout_prefix(ITERATION) + "/"] if stages.index(stage) >= 1 else []
        prefixes += [scored_key(ITERATION), metrics_key(ITERATION)] if stages.index(stage) >= 2 else []
        if stage == "publish":
            raise ValueError("the reference keeps no candidate: make one with the update step")
        src, dst = self.store, Store.open(run_uri)
        for prefix in prefixes:
            keys = src.list(prefix) if prefix.endswith("/") else [prefix]
            for key in keys:
                dst.put_bytes(key, src.get_bytes(key))
        dst.put_bytes(run_store.LATEST, b"v000000\n")  # as import-sft left it
        return dst


def run_reference(base: Path) -> ReferenceRun:
    """The tiny run, fault-free, through the local executor; the secret marker is in its environment."""
    sft_dir = make_sft_checkpoint(base / "sft")
    run_dir = base / "run"
    config = tiny_config(sft_dir.as_uri(), run_dir.as_uri())
    saved = {name: os.environ.get(name) for name in (*SECRET_ENV, "MOERL_LOCAL_TIME_SCALE")}
    os.environ.update(dict.fromkeys(SECRET_ENV, SECRET_MARKER), MOERL_LOCAL_TIME_SCALE="0.05")
    try:
        result = run_local(validate_config(config), base / "work")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert result.succeeded, f"the fault-free run failed: {result.message}; logs in {result.run_dir}/pods"
    return ReferenceRun(sft_dir, run_dir.as_uri(), run_dir, base / "work", result, config)


def run_local(cfg: RunConfig, work_dir: Path, chaos: str | None = None) -> RunResult:
    """The run's self-contained Workflow through the local executor (what `moerl run` does, minus KFP)."""
    return run_workflow(
        workflow(cfg).to_dict(), chaos=chaos, workdir=work_dir, view=None, status_out=work_dir / "status.json"
    )


# ----------------------------------------------------------------------------------------------------
# What a run store holds
# ----------------------------------------------------------------------------------------------------


def manifest_files(run: Store, version: int) -> dict[str, dict]:
    manifest = checkpoint.read_manifest(run, version)
    assert manifest is not None, f"{run.url(run_store.version_prefix(version))}: not published"
    return manifest.files


def published(run: Store) -> tuple[str | None, list[int]]:
    return checkpoint.read_latest(run), checkpoint.published_versions(run)


def assert_nothing_half_published(run: Store) -> None:
    """Every version with a MANIFEST has all its files, each with the manifest's size and digest; LATEST names
    a published version; a version without MANIFEST is never named by LATEST."""
    latest, versions = published(run)
    for version in versions:
        prefix = run_store.version_prefix(version)
        for name, meta in manifest_files(run, version).items():
            key = f"{prefix}/{name}"
            assert run.exists(key), f"{run.url(key)}: listed in the manifest but missing"
            assert (run.size(key), run.sha256(key)) == (meta["size"], meta["sha256"]), f"{run.url(key)} differs"
    if latest is not None:
        assert run_store.parse_version(latest) in versions, f"LATEST names unpublished {latest}"


def assert_store_objects_intact(run: Store, prefix: str = "") -> None:
    """Every visible object reads back verified against the digest recorded when it was written."""
    for key in run.list(prefix):
        run.get_bytes(key)


def chunk_bytes(run: Store) -> dict[int, bytes]:
    out = {}
    for chunk in range(NUM_CHUNKS):
        if run.exists(chunk_key(ITERATION, chunk)):
            out[chunk] = run.get_bytes(chunk_key(ITERATION, chunk))
    return out


def metrics_without_timing(run: Store) -> dict[str, Any]:
    return {k: v for k, v in run.get_json(metrics_key(ITERATION)).items() if not k.endswith("_seconds")}


def assert_rows_exactly_once(run: Store) -> None:
    table = pq.read_table(io.BytesIO(run.get_bytes(scored_key(ITERATION))))
    rows = list(zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True))
    assert len(rows) == len(set(rows)) == 8 * 4, "samples lost or doubled"


def assert_same_result(run: Store, reference: Store) -> None:
    """The run ended where the fault-free run did: same versions and LATEST, bit-identical checkpoints, the same
    experience and scores, each sample exactly once, nothing half published."""
    assert published(run) == published(reference)
    for version in checkpoint.published_versions(reference):
        ours, theirs = manifest_files(run, version), manifest_files(reference, version)
        differing = sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))
        assert not differing, f"v{version:06d} differs in {differing}: {run.url('')} against {reference.url('')}"
    assert chunk_bytes(run) == chunk_bytes(reference)
    assert run.get_bytes(scored_key(ITERATION)) == reference.get_bytes(scored_key(ITERATION))
    assert metrics_without_timing(run) == metrics_without_timing(reference)
    assert_rows_exactly_once(run)
    assert_nothing_half_published(run)


def leftovers(directory: Path) -> list[Path]:
    """The local store's staging files that a killed writer left (hidden from readers, never read)."""
    return sorted(p for p in Path(directory).rglob(f"{RESERVED_PREFIX}*") if not p.name.startswith(SIDECAR_PREFIX))


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst

