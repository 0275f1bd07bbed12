"""The user's code named by dotted path ('package.module:name'), as the reward function's and the environment's
worker processes load it and talk to their step (steps/scoring/user_reward.py, steps/environments/worker.py)."""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from typing import Any, TextIO

from steps.errors import MoerlError

IMPORT_TIMEOUT_S = 120.0  # importing the user's package (it may import torch or a tokenizer) is not one call


def resolve(spec: str, label: str, setting: str, kind: str) -> Any:
    """The callable `spec` names; errors name it as `label` (e.g. 'rewards.reward_fn', 'environment'), the config
    field that holds it as `setting` and what it is as `kind` ('function', 'class')."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise MoerlError(f"{setting} {spec!r}: write package.module:{kind.capitalize() if kind == 'class' else kind}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise MoerlError(
            f"{label} {spec}: cannot import {module_name} ({err}); install the package into the cpu image (and into "
            "this environment for moerl check and moerl run)"
        ) from None
    except Exception as err:  # the user's module raised while being imported
        raise MoerlError(
            f"{label} {spec}: importing {module_name} raised {type(err).__name__}: {str(err)[:200]}; fix the module"
        ) from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise MoerlError(f"{label} {spec}: {module_name} has no {kind} {attr!r}; check the name")
    return found


def protocol_stream() -> TextIO:
    """A worker's reply stream: stdout as it started (the pipe its step reads), after which fd 1 and sys.stdout go
    to stderr, so that what the user's code or a program it runs prints reaches the log, never the protocol."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol


def start_worker(module: str, *args: str) -> subprocess.Popen[bytes]:
    """`python -m module args...` in this directory, speaking on its stdin and stdout (its stderr is the step's)."""
    return subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=None, cwd=os.getcwd())  # fmt: skip


def kill_worker(process: subprocess.Popen[bytes]) -> None:
    """Kill a worker (if it still runs), reap it and close its pipes."""
    if process.poll() is None:
        process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
