"""User-facing errors: one clear message that names the input and the fix, then a non-zero exit."""

from __future__ import annotations

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
        sys.exit(err.exit_code)
    sys.exit(code or 0)
