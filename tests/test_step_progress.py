"""steps/progress.py: what a step writes to $ARGO_PROGRESS_FILE (Argo's N/M, whole or not at all, rank 0 only),
and the chaos strike point at which a targeted step stops itself for `moerl local --chaos` to strike."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from steps import progress

REPO = Path(__file__).resolve().parents[1]


def test_progress_goes_to_argos_file_as_n_over_m(tmp_path, monkeypatch):
    target = tmp_path / "progress"
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(target))
    monkeypatch.delenv(progress.STRIKE_ENV, raising=False)
    progress.report(0, 4)
    assert target.read_text() == "0/4\n"
    progress.report(3, 4)
    assert target.read_text() == "3/4\n"
    assert [p.name for p in tmp_path.iterdir()] == ["progress"]  # no temporary file left behind


def test_only_rank_0_reports_and_no_file_means_no_report(tmp_path, monkeypatch):
    target = tmp_path / "progress"
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(target))
    monkeypatch.setenv("RANK", "1")
    progress.report(1, 2)
    assert not target.exists()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv(progress.PROGRESS_FILE_ENV)
    progress.report(1, 2)  # outside Argo: nothing to write, nothing fails


def test_an_unwritable_progress_file_never_fails_the_step(tmp_path, monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_FILE_ENV, str(tmp_path / "missing-dir" / "progress"))
    progress.report(1, 2)


def test_a_struck_step_stops_itself_at_its_strike_point_and_says_where(tmp_path):
    marker = tmp_path / "strike"
    script = "from steps import progress\nfor n in range(5):\n    print(n, flush=True)\n    progress.report(n, 4)"
    env = {**os.environ, "PYTHONPATH": str(REPO), progress.STRIKE_ENV: f"0.5:{marker}"}
    env.pop(progress.PROGRESS_FILE_ENV, None)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(2400):  # bounded by count, not by a time target: the process may be slow to start
            if marker.exists():
                break
            time.sleep(0.05)
        pid = int(marker.read_text())
        assert pid == proc.pid
        state = ""
        for _ in range(2400):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
            if state in ("T", "t"):
                break
            time.sleep(0.05)
        assert state in ("T", "t")  # stopped, not running on
        os.kill(pid, signal.SIGCONT)  # resumed, it goes on: the strike fires once
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert out.split() == ["0", "1", "2", "3", "4"]
    assert progress.strike_point(4, 0.5) == 2
