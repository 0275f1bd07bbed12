"""The user's environment (`environment.class_path: package.module:Class`), run in worker processes.

The contract (README, "Environments: multi-turn and tools"):

    class Env:
        tools = [...]      # optional: the tools' JSON schemas (OpenAI function format), which the chat template
                           # is rendered with (tools=); may be set by __init__ or reset
        def __init__(self, **params): ...                # environment.params; one instance per conversation
        def reset(self, prompt, answer, metadata, seed) -> list[dict] | None
            # the conversation's first messages; None keeps the prompt's own (a string prompt is one user message,
            # after the run's system_prompt, which goes first in either case). seed: an int of this prompt, the
            # same for every sample of it (a GRPO group starts from one first prompt), for any randomness the
            # environment has (it must be a function of its arguments: a retried chunk is generated again)
        def step(self, messages) -> (observation, reward, done, metrics)
            # messages: the conversation so far, the model's last turn last, as the chat template reads it
            # ({"role": "assistant", "content": ..., "tool_calls": [{"type": "function", "function": {"name",
            # "arguments"}}]}: steps/environments/tool_calls.py); observation: the messages to append ('tool'
            # messages answer tool calls, 'user' messages talk), [] when done; reward: a finite number (this
            # step's, summed over the conversation); done: True ends the conversation; metrics: named finite
            # numbers, whose means over the iteration's conversations land in the metrics as env/<name>
        def close(self): ...   # optional, called once the chunk's conversations have all ended (not after an
                               # error: the workers are then killed)

Each call must return within environment.step_timeout_s. The worker is a separate Python process (`python -m
steps.environments.worker SPEC PARAMS_JSON`, one JSON object a line on stdin/stdout, the environment's prints going
to the log): a call that raises, hangs or returns anything else ends the rollout step with one error that names the
environment, the prompt, the sample and the turn, and every worker is killed. An `EnvironmentPool` runs
`environment.workers` of them and spreads the conversations over them, one request in flight per worker, so that
one turn's steps run side by side.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from steps.data import user_code
from steps.errors import MoerlError

OBSERVATION_ROLES = ("tool", "user", "system")


def resolve(spec: str) -> Any:
    """The class named by 'package.module:Class' (raises MoerlError naming what is missing)."""
    return user_code.resolve(spec, "environment", "environment.class_path", "class")


def _messages_problem(value: Any, what: str, roles: Sequence[str] | None) -> str | None:
    if not isinstance(value, list):
        return f"{what} is {type(value).__name__}, not a list of messages"
    for message in value:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            return f"{what} holds {str(message)[:80]!r}, not a message dict with a 'role'"
        if not isinstance(message.get("content", ""), str):
            return f"{what} holds a message whose content is {type(message.get('content')).__name__}, not text"
        if roles is not None and message["role"] not in roles:
            return f"{what} holds a {message['role']!r} message; observations are {', '.join(roles)} messages"
    return None


def _numbers_problem(value: Any, what: str) -> str | None:
    if not isinstance(value, Mapping):
        return f"{what} is {type(value).__name__}, not a dict of numbers"
    for name, number in value.items():
        if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
            return f"{what}[{name!r}] = {number!r}; every metric must be a finite number"
    return None


def step_result(value: Any) -> dict[str, Any] | str:
    """A step's return value as {'observation', 'reward', 'done', 'metrics'}, or what is wrong with it."""
    if not isinstance(value, tuple | list) or len(value) != 4:
        return f"returned {str(value)[:80]!r}; step must return (observation messages, reward, done, metrics)"
    observation, reward, done, metrics = value
    if problem := _messages_problem(observation, "the observation", OBSERVATION_ROLES):
        return problem
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        return f"returned reward {reward!r}; a step's reward is a finite number"
    if not isinstance(done, bool):
        return f"returned done {done!r}; done is True or False"
    metrics = {} if metrics is None else metrics
    if problem := _numbers_problem(metrics, "metrics"):
        return problem
    if "tool_calls" in metrics:
        return "returned a metric named 'tool_calls', which is moerl's own count of the model's calls; rename it"
    if not done and not observation:
        return "returned no observation and done False; a conversation that goes on needs the next message"
    return {"observation": [dict(m) for m in observation], "reward": float(reward), "done": done,
            "metrics": {str(k): float(v) for k, v in metrics.items()}}  # fmt: skip


def reset_result(env: Any, value: Any) -> dict[str, Any] | str:
    if value is not None and (problem := _messages_problem(value, "reset's messages", None)):
        return problem
    if value is not None and not value:
        return "reset returned no messages; return the first messages, or None for the prompt's own"
    tools = getattr(env, "tools", None)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        return f"its tools are {str(tools)[:80]!r}; tools is a list of JSON schema dicts"
    return {"messages": None if value is None else [dict(m) for m in value], "tools": tools}


def serve(spec: str, params_json: str) -> int:
    """The worker: import the class, then answer one JSON request a line until stdin closes."""
    protocol = user_code.protocol_stream()
    try:
        cls = resolve(spec)
    except MoerlError as err:
        protocol.write(json.dumps({"error": str(err)}) + "\n")
        return 0
    params = json.loads(params_json)
    protocol.write(json.dumps({"ready": True}) + "\n")
    envs: dict[str, Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        op, cid = request["op"], request["id"]
        try:
            if op == "reset":
                envs[cid] = cls(**params)
                answer = reset_result(envs[cid], envs[cid].reset(
                    prompt=request["prompt"], answer=request["answer"], metadata=request["metadata"],
                    seed=request["seed"]))  # fmt: skip
            elif op == "step":
                answer = step_result(envs[cid].step(request["messages"]))
            else:  # close
                env = envs.pop(cid, None)
                if env is not None and callable(getattr(env, "close", None)):
                    env.close()
                answer = {}
            reply = {"value": answer} if isinstance(answer, dict) else {"bad": answer}
        except Exception as err:
            reply = {"raised": f"{type(err).__name__}: {str(err)[:300]}"}
        protocol.write(json.dumps(reply, default=str) + "\n")
    return 0


@dataclass
class Call:
    """One request to a conversation's environment: `where` names the prompt, the sample and the turn in errors."""

    conversation: int  # the conversation's index in the pool's numbering (it picks the worker)
    op: str  # "reset", "step" or "close"
    body: dict[str, Any]
    where: str


class _Worker:
    def __init__(self, spec: str, params: Mapping[str, Any]) -> None:
        self.process = user_code.start_worker("steps.environments.worker", spec, json.dumps(dict(params), default=str))
        self.buffer = b""

    @property
    def fd(self) -> int:
        assert self.process.stdout is not None
        return self.process.stdout.fileno()

    def send(self, request: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(request, default=str) + "\n").encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died: reading its reply reports it

    def line(self) -> dict[str, Any] | None:
        """The next reply if a whole line is buffered."""
        if b"\n" not in self.buffer:
            return None
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        user_code.kill_worker(self.process)


class EnvironmentPool:
    """`workers` worker processes of one environment class; `run(calls)` answers each call (in call order)."""

    def __init__(self, spec: str, params: Mapping[str, Any], workers: int, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self.workers: list[_Worker] = []
        try:
            for _ in range(workers):  # each kept as it starts: a failure or a SIGTERM here kills those started
                self.workers.append(_Worker(spec, params))
            for worker in self.workers:
                reply = self._wait(worker, time.monotonic() + user_code.IMPORT_TIMEOUT_S, "while importing it")
                if "error" in reply:
                    raise MoerlError(reply["error"])
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> EnvironmentPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, calls: Sequence[Call]) -> list[dict[str, Any]]:
        """Every call's answer; the calls of one worker run one after another, each within the time limit."""
        queues: dict[int, list[int]] = {}
        for index, call in enumerate(calls):
            queues.setdefault(call.conversation % len(self.workers), []).append(index)
        answers: list[dict[str, Any] | None] = [None] * len(calls)
        deadlines: dict[int, tuple[float, int]] = {}  # worker -> (deadline, call index) of its call in flight

        def send_next(w: int) -> None:
            if queues.get(w):
                index = queues[w].pop(0)
                self.workers[w].send({"op": calls[index].op, "id": str(calls[index].conversation),
                                      **calls[index].body})  # fmt: skip
                deadlines[w] = (time.monotonic() + self.timeout_s, index)

        try:
            for w in list(queues):
                send_next(w)
            while deadlines:
                soonest = min(d for d, _ in deadlines.values())
                by_fd = {self.workers[w].fd: w for w in deadlines}
                ready, _, _ = select.select(list(by_fd), [], [], max(soonest - time.monotonic(), 0))
                for fd in ready:
                    w = by_fd[fd]
                    chunk = os.read(fd, 1 << 16)
                    index = deadlines[w][1]
                    if not chunk:
                        code = self.workers[w].process.wait()
                        raise MoerlError(
                            f"environment {self.spec}: its worker process ended (exit code {code}) on "
                            f"{calls[index].where} ({calls[index].op}); see the log above for what it did"
                        )
                    self.workers[w].buffer += chunk
                    reply = self.workers[w].line()
                    if reply is not None:
                        answers[index] = self._answer(reply, calls[index])
                        del deadlines[w]
                        send_next(w)
                now = time.monotonic()
                for deadline, index in list(deadlines.values()):
                    if now >= deadline:
                        raise MoerlError(
                            f"environment {self.spec}: {calls[index].op} took longer than {self.timeout_s:g}s on "
                            f"{calls[index].where}; make it faster or raise environment.step_timeout_s"
                        )
        except BaseException:
            self.close()
            raise
        return [a for a in answers if a is not None]

    def _answer(self, reply: dict[str, Any], call: Call) -> dict[str, Any]:
        if "value" in reply:
            return reply["value"]
        if "raised" in reply:
            raise MoerlError(
                f"environment {self.spec} raised in {call.op} on {call.where}: {reply['raised']}; fix the environment"
            )
        raise MoerlError(f"environment {self.spec}: {call.op} on {call.where} {reply['bad']}; fix the environment")

    def _wait(self, worker: _Worker, deadline: float, what: str) -> dict[str, Any]:
        while (reply := worker.line()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise MoerlError(
                    f"environment {self.spec}: took longer than {user_code.IMPORT_TIMEOUT_S:g}s {what}; make the "
                    "import faster"
                )
            ready, _, _ = select.select([worker.fd], [], [], remaining)
            if ready:
                chunk = os.read(worker.fd, 1 << 16)
                if not chunk:
                    code = worker.process.wait()
                    raise MoerlError(
                        f"environment {self.spec}: its worker process ended (exit code {code}) {what}; see the log "
                        "above"
                    )
                worker.buffer += chunk
        return reply

    def close(self) -> None:
        for worker in self.workers:
            with contextlib.suppress(Exception):  # the others are killed whatever one does
                worker.kill()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2]))
