"""A step's progress, N/M units of its work done: for Argo's UI, and as the local executor's strike points.

Argo's executor reads `$ARGO_PROGRESS_FILE` every few seconds and shows the last `N/M` written there as the
node's progress (argo-workflows docs/progress.md); a template that reports progress says so with the pod
annotation `workflows.argoproj.io/progress` (PROGRESS_ANNOTATION), which Argo takes as the initial value.
Each step reports `0/M` once it knows its work, then after each unit: rollout after each chunk written, score
after the rewards and after the evaluation, update after each optimizer step, publish after each stage.

`moerl local --chaos` strikes such a pod at one of these reports, so that a fault always lands in the middle
of the attempt's work, however fast the machine: the executor passes STRIKE_ENV = "<fraction>:<marker path>"
to the attempt it targets; at the first report at or past the strike point the process writes its pid to
the marker and stops itself (SIGSTOP), and the executor, seeing it stopped, delivers the fault: SIGKILL, or
SIGTERM then SIGCONT (a Spot reclaim). Only rank 0 of a torchrun group reports.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

PROGRESS_FILE_ENV = "ARGO_PROGRESS_FILE"
PROGRESS_ANNOTATION = "workflows.argoproj.io/progress"
STRIKE_ENV = "MOERL_LOCAL_CHAOS_STRIKE"


def strike_point(total: int, fraction: float) -> int:
    """The report N (of N/total) at which a struck attempt stops: strictly inside its work when it has two
    units or more (some done, some left), at its start when it has one."""
    if total <= 1:
        return 0
    return min(total - 1, max(1, math.ceil(fraction * total)))


def strike_due(done: int, total: int, fraction: float) -> bool:
    """Whether the report done/total is at or past the strike point, with work still left."""
    return strike_point(total, fraction) <= done < total


def report(done: int, total: int) -> None:
    """Record that `done` of `total` units of this step's work are done."""
    if os.environ.get("RANK", "0") != "0":
        return
    path = os.environ.get(PROGRESS_FILE_ENV)
    if path:
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp")
        try:  # whole or not at all: Argo's executor may read it at any moment
            tmp.write_text(f"{done}/{total}\n")
            os.replace(tmp, target)
        except OSError:
            pass  # progress is for people to watch; it never fails a step
    strike = os.environ.get(STRIKE_ENV)
    if strike:
        fraction, _, marker = strike.partition(":")
        if strike_due(done, total, float(fraction)):
            del os.environ[STRIKE_ENV]  # once: the process resumes only to be stopped for good
            tmp = Path(f"{marker}.tmp")
            tmp.write_text(f"{os.getpid()}\n")
            os.replace(tmp, marker)  # the executor reads it whole or not at all
            os.kill(os.getpid(), signal.SIGSTOP)
