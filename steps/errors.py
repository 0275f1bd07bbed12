"""User-facing errors: one clear message that names the input and the fix, then a non-zero exit.

And how a step's process ends: everything the interpreter does at exit up to its teardown, then _exit.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn


class MoerlError(Exception):
    """An error the user can fix. The message names the bad input and says what to do."""

    exit_code = 2


def run_cli(main: Callable[[], int | None]) -> None:
    """Run a step's or the CLI's main(): a MoerlError becomes one line on stderr and exit code 2.

    When main is the program's own (defined in `__main__`: `python -m steps.X`), the process then ends with
    end_process, without the interpreter's teardown; called any other way (a test, the `moerl` entry point),
    it raises SystemExit as sys.exit does.
    """
    program = getattr(main, "__module__", None) == "__main__"
    try:
        code = main()
    except MoerlError as err:
        print(f"error: {err}", file=sys.stderr)
        code = err.exit_code
    except BaseException as err:
        if not program:
            raise
        code = uncaught_exit_code(err)
    finally:
        # Tearing down the objects torch created costs 2.5-4.5 s per process in the garbage collector's
        # final passes (bench/README.md, profile of one demo iteration); frozen objects are skipped there.
        # atexit handlers and finalizers still run.
        gc.freeze()
    if program:
        end_process(code or 0)
    sys.exit(code or 0)


def system_exit_code(code: object) -> int:
    """The exit status of `sys.exit(code)`: None is 0, an int itself, anything else is printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stdout.flush()
    print(code, file=sys.stderr)
    return 1


def uncaught_exit_code(err: BaseException) -> int:
    """What the interpreter does with an exception that ends the program: SystemExit's code; else the
    traceback and 1, or death by SIGINT for KeyboardInterrupt (as -SIGINT, see end_process)."""
    if isinstance(err, SystemExit):
        return system_exit_code(err.code)
    sys.excepthook(type(err), err, err.__traceback__)
    return -signal.SIGINT if isinstance(err, KeyboardInterrupt) else 1


def end_process(code: int) -> NoReturn:
    """End the process as the interpreter does, up to its teardown: wait for non-daemon threads, run the
    atexit callbacks, flush stdout and stderr (exit code 120 if that fails); then os._exit.

    The teardown is skipped on purpose. It frees every Python object and runs the C++ static destructors
    of the native libraries: in a warm pod (a fork of the local executor's warm server) freeing the server's
    preloaded objects copies every copy-on-write page they sit on (0.4-0.9 s a pod), and Arrow's thread
    pools can abort the process from their destructors (std::terminate, SIGABRT: apache/arrow#34314).
    """
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as Py_Finalize does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = 120  # the interpreter's exit code when flushing stdout/stderr fails
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends the process by the signal itself
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)
