"""The rendered workflow run by the local executor, each step replaced by a stub that records its call:
published iterations are skipped, preemptions of Spot steps are retried, bugs are not, and the report runs
however the run ends."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pipelines.workflow import workflow
from steps.run.config import validate_config

local = pytest.importorskip("pipelines.local")

FAST = {"limit": 2, "backoff": {"duration": "1s", "factor": 1, "max_duration": "1m"}}


def stubbed(tmp_path: Path, latest: int, fail: dict[str, int] | None = None) -> dict:
    """The demo-shaped workflow with every container replaced by a Python stub.

    Each call appends its template name and args to calls.jsonl; plan reports `latest`; `fail` maps a
    template to an exit code that its first attempt (per iteration and shard) exits with.
    """
    cfg = validate_config({
        "sft_checkpoint": "file:///tmp/sft", "run_store": (tmp_path / "run").as_uri(), "iterations": 3,
        "argo": {"semaphore": None, "run_mutex": False, "report_artifact": False},
        "retries": {role: FAST for role in ("rollout", "score", "trainer", "control")},
    })  # fmt: skip
    manifest = workflow(cfg).to_dict()
    calls, marks = tmp_path / "calls.jsonl", tmp_path / "marks"
    marks.mkdir()
    for template in manifest["spec"]["templates"]:
        container = template.get("container")
        if container is None:
            continue
        name = template["name"]
        code = [
            "import hashlib, json, os, sys",
            f"args = sys.argv[1:]; open({str(calls)!r}, 'a').write(json.dumps([{name!r}, args]) + '\\n')",
        ]
        if name == "plan":
            code.append(f"os.makedirs(args[0], exist_ok=True); open(args[0] + '/latest', 'w').write('{latest}')")
        if name in (fail or {}):
            digest = "hashlib.sha256(repr(args).encode()).hexdigest()"
            code.append(f"mark = os.path.join({str(marks)!r}, {name!r} + {digest})")
            code.append(f"if not os.path.exists(mark): open(mark, 'w').close(); sys.exit({fail[name]})")
        container["command"] = [sys.executable, "-c", "\n".join(code)]
        if name == "plan":
            container["args"] = ["/tmp/plan"]  # named in the args, so the executor maps it into the pod
        else:
            container["args"] = [a for a in container["args"] if not a.startswith('{"')]  # not the config JSON
    return manifest


def run(tmp_path: Path, manifest: dict) -> tuple[str, list[tuple[str, list[str]]]]:
    result = local.run_workflow(manifest, view=None, workdir=tmp_path / "work")
    calls = [tuple(json.loads(line)) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    return result.phase, calls


def iterations_run(calls: list, step: str) -> list[str]:
    return sorted({args[args.index("--iteration") + 1] for name, args in calls if name == step})


def test_a_resumed_run_skips_what_latest_covers(tmp_path):
    phase, calls = run(tmp_path, stubbed(tmp_path, latest=1))
    assert phase == "Succeeded"
    assert "import-sft" not in [name for name, _ in calls]
    for step in ("rollout", "score", "update", "publish"):
        assert iterations_run(calls, step) == ["2", "3"], step
    assert [name for name, _ in calls][-1] == "report"


def test_a_preempted_rollout_is_retried(tmp_path):
    phase, calls = run(tmp_path, stubbed(tmp_path, latest=-1, fail={"rollout": 143}))
    assert phase == "Succeeded"
    rollouts = [args for name, args in calls if name == "rollout"]
    assert len(rollouts) == 2 * 3 * 2  # 3 iterations x 2 shards, each preempted once and retried once


def test_a_rollout_bug_is_not_retried_and_the_report_still_runs(tmp_path):
    phase, calls = run(tmp_path, stubbed(tmp_path, latest=-1, fail={"rollout": 1}))
    assert phase == "Failed"
    names = [name for name, _ in calls]
    assert names.count("rollout") == 2 and "score" not in names  # one attempt per shard, then stop
    assert names[-1] == "report"


def test_a_failed_update_is_not_retried(tmp_path):
    phase, calls = run(tmp_path, stubbed(tmp_path, latest=-1, fail={"update": 1}))
    assert phase == "Failed"
    assert [name for name, _ in calls].count("update") == 1
