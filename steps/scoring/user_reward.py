"""The user's reward function (`rewards.reward_fn: package.module:function`), run in a worker process.

The contract (README, "Your own checkpoint and data"):

    def function(prompt, response, answer, metadata) -> float | dict
        prompt    the prompt as the prompt file gave it: a string, or a list of chat messages
        response  the response text, up to (not including) its stop token
        answer    the reference answer (a string)
        metadata  the record's other fields (a dict; {} for a built-in task)
    returns a finite number, or a dict with a finite number under "reward" and any other named finite
    numbers, whose means over the iteration's samples land in its metrics as reward_fn/<name>

It is called with keyword arguments, once per sample, and must be installed in the cpu image (the score step
imports it there). The worker is a separate Python process (`python -m steps.scoring.user_reward SPEC`, speaking one
JSON object a line on its stdin/stdout), so the score step can bound each call: a call that raises, runs
longer than rewards.reward_fn_timeout_s, or returns anything but finite numbers ends the step with one error
that names the function and the sample, and the worker is killed. What the function prints goes to the step's
log (stderr), never into the protocol.
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import time
from collections.abc import Mapping
from typing import Any

from steps.data import user_code
from steps.errors import MoerlError


def resolve(spec: str) -> Any:
    """The function named by 'package.module:function' (raises MoerlError naming what is missing)."""
    return user_code.resolve(spec, "rewards.reward_fn", "rewards.reward_fn", "function")


def reward_value(value: Any) -> dict[str, float] | str:
    """A function's return value as {'reward': r, name: v, ...}, or what is wrong with it."""
    if isinstance(value, bool) or not isinstance(value, int | float | Mapping):
        return f"returned {type(value).__name__}; return a number or a dict with 'reward'"
    if not isinstance(value, Mapping):
        value = {"reward": value}
    if "reward" not in value:
        return f"returned a dict without 'reward' (keys: {', '.join(map(str, list(value)[:8]))})"
    out = {}
    for name, number in value.items():
        if isinstance(number, bool) or not isinstance(number, int | float):
            return f"returned {name!r} = {number!r}; every value of the dict must be a number"
        if not math.isfinite(number):
            return f"returned {name!r} = {number}; rewards must be finite"
        out[str(name)] = float(number)
    return out


def serve(spec: str) -> int:
    """The worker: import the function, then answer one JSON request a line until stdin closes."""
    protocol = user_code.protocol_stream()
    try:
        fn = resolve(spec)
    except MoerlError as err:
        protocol.write(json.dumps({"error": str(err)}) + "\n")
        return 0
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result: Any = fn(**request)
            answer = reward_value(result)
            reply = {"value": answer} if isinstance(answer, dict) else {"bad": answer}
        except Exception as err:
            reply = {"raised": f"{type(err).__name__}: {str(err)[:300]}"}
        protocol.write(json.dumps(reply) + "\n")
    return 0


class RewardFunction:
    """The score step's handle on the worker: `call(where, ...)` one sample at a time, each within its limit."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.process = user_code.start_worker("steps.scoring.user_reward", spec)
        self._buffer = b""
        ready = self._read(user_code.IMPORT_TIMEOUT_S, "while importing it")
        if "error" in ready:
            self.close()
            raise MoerlError(ready["error"])

    def _read(self, limit: float, what: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + limit
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise MoerlError(
                    f"rewards.reward_fn {self.spec}: took longer than {limit:g}s {what}; make it faster or raise "
                    "rewards.reward_fn_timeout_s"
                )
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    code = self.process.wait()
                    raise MoerlError(
                        f"rewards.reward_fn {self.spec}: its worker process ended (exit code {code}) {what}; see "
                        "the log above for what the function did"
                    )
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def call(
        self, where: str, prompt: Any, response: str, answer: str, metadata: Mapping[str, Any]
    ) -> dict[str, float]:
        """{'reward': r, ...} of one sample; `where` ('prompt 'q1' sample 3') names it in errors."""
        assert self.process.stdin is not None
        request = {"prompt": prompt, "response": response, "answer": answer, "metadata": dict(metadata)}
        try:
            self.process.stdin.write((json.dumps(request, default=str) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: _read reports it
        reply = self._read(self.timeout_s, f"on {where}")
        if "value" in reply:
            return reply["value"]
        self.close()
        if "raised" in reply:
            raise MoerlError(f"rewards.reward_fn {self.spec} raised on {where}: {reply['raised']}; fix the function")
        raise MoerlError(f"rewards.reward_fn {self.spec} on {where}: {reply['bad']}")

    def close(self) -> None:
        user_code.kill_worker(self.process)


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
