"""Resume from LATEST: the plan step tells the workflow which iterations are done, refuses gaps and changed
training configs, and the guard that KFP steps run behind skips published iterations."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from steps.errors import MoerlError
from steps.plan import Plan, check_config, plan_segment
from steps.run import keys as run_store
from steps.run.config import validate_config
from steps.store.object_store import Store

CONFIG = validate_config({"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"})


def plan_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steps.plan", *args], capture_output=True, text=True, timeout=60)


def set_latest(run: Store, version: int) -> None:
    run.put_bytes(run_store.LATEST, run_store.version_name(version).encode())


def test_plan_segment_resumes_after_latest():
    assert plan_segment(None, 1, 5) == Plan(-1, 1, 5)
    assert list(plan_segment(3, 1, 5).todo) == [4, 5]
    assert list(plan_segment(9, 6, 9).todo) == []
    assert list(plan_segment(5, 6, 9).todo) == [6, 7, 8, 9]


@pytest.mark.parametrize(
    ("latest", "first", "message"),
    [(None, 6, "the run has no LATEST checkpoint"), (3, 6, "LATEST is v000003 but this segment starts at 6")],
)
def test_plan_refuses_a_gap(latest, first, message):
    with pytest.raises(MoerlError, match=message.replace("starts at 6", "starts at iteration 6")):
        plan_segment(latest, first, first + 4)


def test_a_changed_training_config_is_refused_but_operational_changes_pass():
    stored = CONFIG.model_dump(mode="json")
    longer = {**stored, "iterations": 50, "rollout": {**stored["rollout"], "num_shards": 1}}
    check_config(stored, longer, "run.json")  # more iterations, other shard count: same training
    hotter = {**stored, "sampling": {**stored["sampling"], "temperature": 0.7}}
    with pytest.raises(MoerlError, match=r"run\.json holds a different training config \(changed: sampling\)"):
        check_config(stored, hotter, "run.json")


def test_plan_cli_writes_latest_for_the_workflow(tmp_path):
    run_uri = (tmp_path / "run").as_uri()
    out = tmp_path / "plan"
    done = plan_cli(
        "--run", run_uri, "--first", "1", "--last", "4", "--out", str(out), "--next-out", str(tmp_path / "n")
    )
    assert done.returncode == 0, done.stderr
    assert (out / "latest").read_text() == "-1" and (tmp_path / "n").read_text() == "0"
    assert "nothing published yet: running iterations 1-4" in done.stdout
    set_latest(Store.open(run_uri), 2)
    done = plan_cli("--run", run_uri, "--first", "1", "--last", "4", "--out", str(out))
    assert (out / "latest").read_text() == "2" and "running iterations 3-4" in done.stdout


def test_plan_cli_checks_the_stored_config(tmp_path):
    run = Store.open((tmp_path / "run").as_uri())
    run.put_bytes("run.json", json.dumps(CONFIG.model_dump(mode="json")).encode())
    changed = CONFIG.model_copy(update={"seed": 7}).model_dump(mode="json")
    done = plan_cli("--run", run.uri, "--first", "1", "--last", "2", "--out", str(tmp_path / "p"),
                    "--run-config-json", json.dumps(changed))  # fmt: skip
    assert done.returncode == 2
    assert "error:" in done.stderr and "holds a different training config (changed: seed)" in done.stderr


def test_the_guard_skips_published_iterations_and_fills_in_the_rest(tmp_path):
    run = Store.open((tmp_path / "run").as_uri())
    set_latest(run, 3)
    echo = [sys.executable, "-c", "import sys; print('RAN', *sys.argv[1:])", "{iteration}", "{policy_version}"]
    skipped = plan_cli("--run", run.uri, "--unless-published", "3", "--", *echo)
    assert skipped.returncode == 0 and "RAN " not in skipped.stdout and "skipping" in skipped.stdout
    ran = plan_cli("--run", run.uri, "--first-iteration", "4", "--slot", "1", "--staleness", "1", "--", *echo)
    assert ran.stdout.strip() == "RAN 5 3"  # iteration 4 + 1; staleness 1 samples from v(5-2)
    past = plan_cli("--run", run.uri, "--first-iteration", "4", "--slot", "2", "--iterations", "5", "--", *echo)
    assert past.returncode == 0 and "past the run's 5 iterations" in past.stdout


def test_the_guard_passes_on_the_steps_exit_code(tmp_path):
    run = Store.open((tmp_path / "run").as_uri())
    failing = [sys.executable, "-c", "import sys; sys.exit(143)"]
    assert plan_cli("--run", run.uri, "--unless-published", "1", "--", *failing).returncode == 143
