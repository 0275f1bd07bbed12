"""Argo's duration strings and its retry backoff, as the controller computes them.

The local executor runs workflows by these rules; `moerl simulate` models the run's retries with them, so
both read them here (neither owns the other).
"""

from __future__ import annotations

import re

DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(text: str | int | float) -> float:
    """Argo's ParseStringToDuration: a bare integer is seconds, else a Go duration ("1m30s", "300ms")."""
    raw = str(text).strip()
    if re.fullmatch(r"[+-]?\d+", raw):
        return float(int(raw))
    sign = -1.0 if raw.startswith("-") else 1.0
    body = raw.lstrip("+-")
    if body == "0":
        return 0.0
    if not body or DURATION_RE.sub("", body) != "":
        raise ValueError(f'unable to parse {text} as a duration: use seconds ("30") or a Go duration ("1m30s")')
    return sign * sum(float(n) * DURATION_UNITS[u] for n, u in DURATION_RE.findall(body))


def backoff_seconds(backoff: dict, attempts: int) -> float:
    """duration * factor^(attempts-1), capped: the wait before the next attempt (unscaled)."""
    wait = parse_duration(backoff["duration"])
    factor = int(str(backoff.get("factor") or 0))
    if factor > 0:
        wait = wait * factor ** (attempts - 1)
    if backoff.get("cap"):
        wait = min(wait, parse_duration(backoff["cap"]))
    return wait
