"""steps.errors.run_cli as a program's entry (`python -m steps.X`): the process ends as the interpreter ends
it up to its teardown (steps.errors.end_process): exit codes, MoerlError's one line, tracebacks, atexit,
non-daemon threads and buffered output all as before; only the teardown (and with it the native libraries'
destructors, apache/arrow#34314) is skipped. Called from another module it raises SystemExit as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from steps.errors import run_cli

REPO = Path(__file__).resolve().parents[1]

PROGRAM = '''
import atexit, sys, threading, time
from steps.errors import MoerlError, run_cli

def main():
    how = sys.argv[1]
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
    print("buffered line")
    if how == "moerl-error":
        raise MoerlError("--x 3: bad; pass --x 1")
    if how == "crash":
        raise RuntimeError("crashed on purpose")
    if how == "message":
        sys.exit("goodbye")
    return int(how)

if __name__ == "__main__":
    run_cli(main)
'''


@pytest.mark.parametrize(
    ("how", "code", "stderr_end"),
    [("0", 0, None), ("3", 3, None), ("moerl-error", 2, "error: --x 3: bad; pass --x 1"),
     ("crash", 1, "RuntimeError: crashed on purpose"), ("message", 1, "goodbye")],
)  # fmt: skip
def test_a_step_program_ends_as_the_interpreter_would(tmp_path, how, code, stderr_end):
    (tmp_path / "program.py").write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "PYTHONUNBUFFERED": ""}
    done = subprocess.run(
        [sys.executable, "-m", "program", how], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == code, done.stderr
    assert done.stdout.splitlines() == ["buffered line", "thread finished", "atexit ran"]
    last = done.stderr.strip().splitlines()[-1:] if done.stderr.strip() else []
    assert last == ([stderr_end] if stderr_end else []), done.stderr


def test_run_cli_called_from_a_module_raises_system_exit():
    def main() -> int:  # defined here, not in __main__: a test or the moerl entry point calls run_cli
        return 4

    with pytest.raises(SystemExit) as ended:
        run_cli(main)
    assert ended.value.code == 4
