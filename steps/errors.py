"""User-facing errors: one clear message that names the input and the fix, then a non-zero exit."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable


class MoerlError(Exception):
    """An error the user can fix. The message names the bad input and says what to do."""

    exit_code = 2


def run_cli(main: Callable[[], int | None]) -> None:
    """Run a step's or the CLI's main(): a MoerlError becomes one line on stderr and exit code 2."""
    try:
        code = main()
    except MoerlError as err:
        print(f"error: {err}", file=sys.stderr)
        code = err.exit_code
    finally:
        # Tearing down the objects torch created costs 2.5-4.5 s per process in the garbage collector's
        # final passes (bench/README.md, profile of one demo iteration); frozen objects are skipped there.
        # atexit handlers and finalizers still run.
        gc.freeze()
    sys.exit(code or 0)
