"""The exit handler's report: a per-iteration table from the run's metrics (missing fields and unreadable
files tolerated), report.md and report.png in --out and in <run>/report/."""

from __future__ import annotations

import json
import subprocess
import sys

from steps.report import flatten, write_report
from steps.store.object_store import Store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(tmp_path) -> Store:
    run = Store.open((tmp_path / "run").as_uri())
    run.put_bytes("metrics/iter-000001.json", json.dumps(
        {"reward_mean": 0.25, "heldout_accuracy": 0.31, "accuracy": 0.2, "update": {"kl": 0.002, "step_seconds": 4.5},
         "rollout_seconds": 11}
    ).encode())  # fmt: skip
    second = {"score": {"reward_mean": 0.5, "heldout_accuracy": 0.44}}
    run.put_bytes("metrics/iter-000002.json", json.dumps(second).encode())
    run.put_bytes("metrics/iter-000003.json", b"{not json")
    run.put_bytes("metrics/notes.txt", b"ignored")
    run.put_bytes("checkpoints/LATEST", b"v000002")
    return run


def test_the_report_tabulates_what_each_iteration_wrote(tmp_path):
    run = make_run(tmp_path)
    report = write_report(run.uri, tmp_path / "out", status="Failed")
    assert [r["iteration"] for r in report.rows] == [1.0, 2.0]
    first, second = report.rows
    assert (first["reward"], first["accuracy"], first["kl"]) == (0.25, 0.31, 0.002)
    assert (second["reward"], second["accuracy"], second["kl"]) == (0.5, 0.44, None)
    assert first["update.step_seconds"] == 4.5 and second.get("rollout_seconds") is None
    assert report.series("accuracy") == ([1, 2], [0.31, 0.44])
    # the samples' own accuracy is its own column, never the held-out one
    assert (first["sample_accuracy"], second["sample_accuracy"]) == (0.2, None)
    assert any("iter-000003.json: left out" in note for note in report.notes)
    lines = report.table().splitlines()
    assert lines[0].split()[:4] == ["iteration", "reward", "accuracy", "kl"]
    assert lines[2].split()[:4] == ["2", "0.500", "0.440", "-"]


def test_the_report_lands_in_out_and_in_the_store(tmp_path):
    run = make_run(tmp_path)
    write_report(run.uri, tmp_path / "out", status="Succeeded")
    for png in ((tmp_path / "out" / "report.png").read_bytes(), run.get_bytes("report/report.png")):
        assert png.startswith(PNG_MAGIC) and len(png) > 5000
    md = run.get_bytes("report/report.md").decode()
    assert "Workflow status: **Succeeded**" in md and "checkpoints/v000002" in md
    assert "| 1 | 0.250 | 0.310 | 0.002 |" in md and "](report.png)" in md


def test_a_run_without_metrics_still_gets_a_report(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "steps.report", "--run", str(tmp_path / "empty"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no iteration has written metrics yet" in done.stdout
    assert (tmp_path / "out" / "report.png").read_bytes().startswith(PNG_MAGIC)


def test_nested_fields_flatten_to_dotted_names():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a.b": 1, "a.c.d": 2, "e": 3}
