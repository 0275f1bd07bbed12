"""Retry nodes, as Argo's controller runs them (workflow/controller/operator.go processNodeRetries): the
attempts of a template with a retryStrategy, their limit, policy, expression and backoff, and a daemon lost after
it was ready. A mixin of the controller (workflow_controller.py), which is its only user."""

from __future__ import annotations

import copy
import os
import re
import time
from dataclasses import replace
from typing import Any

from pipelines.durations import backoff_seconds, parse_duration
from pipelines.local.api.fields import LEAF_TYPES, template_type
from pipelines.local.api.status import (
    ERROR,
    FAILED,
    RETRY,
    RUNNING,
    SUCCEEDED,
    Node,
    pod_name,
)
from pipelines.local.controller.calls import Call, Opts, TemplateError
from pipelines.local.controller.scope import last_attempt
from pipelines.local.lang import exprlang
from pipelines.local.lang.expressions import (
    expand,
    humanize_duration,
    substitute,
)

TRANSIENT_MESSAGES = (
    "etcdserver: leader changed", "etcdserver: request timed out", "etcdserver: too many requests",
    "unexpected error when reading response body", "stream error when reading response body",
    "Connection closed by foreign host", "net/http: TLS handshake timeout", "i/o timeout",
    "connection timed out", "connection reset by peer", "http2: client connection lost",
    "http2: server sent GOAWAY and closed the connection", "request did not complete within requested timeout",
    "connect: connection refused", "invalid connection", "client rate limiter Wait returned an error",
)  # fmt: skip


class RetryNodes:
    """Methods of the controller; `self` is a Controller."""

    def retry_strategy(self, template: dict) -> dict | None:
        """Argo's retryStrategy(): the template's, else the workflow's. `retryStrategy: {}` is a strategy
        (retry until success), not none."""
        if template.get("retryStrategy") is not None:
            return template["retryStrategy"]
        return self.wf.spec.get("retryStrategy")

    def execute_retries(
        self, node: Node | None, node_name: str, template: dict, call: Call, opts: Opts, scope: Any, retry: dict
    ) -> Node | None:
        """A Retry node whose children are the attempts `<name>(0)`, `<name>(1)`, ..."""
        if node is None:
            node = self.create_node(node_name, RETRY, template, opts, RUNNING)
        attempt_opts = replace(opts, display_parent=node.id, retried=True, hooked=False)
        try:
            proceed = self.process_retries(node, retry, attempt_opts)
        except (TemplateError, exprlang.ExprError, ValueError) as err:
            return self.nodes.mark(node, ERROR, str(err))
        last = last_attempt(node, self.nodes)
        if node.fulfilled and last is not None:  # a Retry node shows its last attempt's outputs
            node.outputs = copy.deepcopy(last.outputs)
        if not proceed or self.settled(node):
            return node
        attempts = [a for a in (self.nodes.get(c) for c in node.children) if a is not None and not a.hooked]
        if last is not None and not last.fulfilled:
            attempt_name, number = last.name, len(attempts) - 1
        else:
            attempt_name, number = f"{node_name}({len(attempts)})", len(attempts)
        local = {
            "retries": str(number),
            "lastRetry.exitCode": ((last.outputs or {}).get("exitCode") if last else None) or "0",
            "lastRetry.status": last.phase if last else "",
            "lastRetry.duration": go_seconds(last.duration()) if last else "0",
            "lastRetry.message": last.message if last else "",
        }
        if template_type(template) in LEAF_TYPES:
            local["pod.name"] = pod_name(self.wf.name, attempt_name, template.get("name", ""))
        attempt_template = substitute(template, {**self.globals(), **local})
        attempt_template.pop("retryStrategy", None)  # the attempt itself is not retried again
        if self.dispatch(attempt_name, attempt_template, call, attempt_opts, scope) is not None:
            self.nodes.add_child(node_name, attempt_name)
        return node  # an attempt that ended is settled by the next pass

    def daemon_lost(self, node: Node) -> bool:
        """A daemon's Retry node whose attempt's pod ended while some node below that attempt (a dependent's)
        is unfinished: Argo keeps it daemoned, so its dependents go on, and starts a new attempt (operator.go
        executeTemplate and processNodeRetries, v4.1.2). With every node below it done, Argo starts none."""
        if node.type != RETRY or not node.daemoned or node.failed_or_error:
            return False
        last = last_attempt(node, self.nodes)
        return last is not None and last.failed_or_error and not self.descendants_fulfilled(last)

    def descendants_fulfilled(self, node: Node) -> bool:
        """Argo's childrenFulfilled: every node below `node` is fulfilled."""
        queue, seen = list(node.children), set()
        while queue:
            child = self.nodes.get(queue.pop())
            if child is None or child.id in seen:
                continue
            seen.add(child.id)
            if not child.fulfilled:
                return False
            queue += child.children
        return True

    def process_retries(self, node: Node, retry: dict, opts: Opts) -> bool:
        """Argo's processNodeRetries: settle the Retry node from its last attempt, or decide that
        another attempt may start (True) or must wait for its backoff (False)."""
        attempts = [a for a in (self.nodes.get(c) for c in node.children) if a is not None and not a.hooked]
        if not attempts or not attempts[-1].fulfilled:
            return True
        last = attempts[-1]
        if last.daemoned:  # a daemon attempt runs on: the Retry node is daemoned with it
            node.daemoned = True
            return False
        now = time.time()
        if not last.failed_or_error:
            self.nodes.mark(node, SUCCEEDED)
            return True
        if self.deadline is not None and now > self.deadline and not opts.on_exit:
            self.nodes.mark(node, last.phase, f"retry exceeded workflow deadline {go_time(self.deadline)}")
            return True
        backoff = retry.get("backoff")
        limit = retry.get("limit")
        if backoff:
            max_deadline = None
            if backoff.get("maxDuration"):
                # a budget for the whole retry, like a deadline: not scaled by MOERL_LOCAL_TIME_SCALE
                max_deadline = attempts[0].started_at + parse_duration(backoff["maxDuration"])
                if now > max_deadline:
                    self.nodes.mark(node, last.phase, "Max duration limit exceeded")
                    return True
            wait = backoff_seconds(backoff, len(attempts))
            waiting_deadline = (last.finished_at or now) + wait * self.time_scale
            if max_deadline is not None and waiting_deadline > max_deadline:
                self.nodes.mark(node, last.phase, "Backoff would exceed max duration limit")
                return True
            if now < waiting_deadline and limit is not None and len(attempts) <= int(limit):
                node.message = f"Backoff for {humanize_duration(wait)}"
                return False
            opts.execution_deadline = max_deadline
            node.message = ""
        policy = retry.get("retryPolicy") or ("Always" if retry.get("expression") else "OnFailure")
        retry_failed = policy in ("Always", "OnFailure")
        retry_error = policy in ("Always", "OnError")
        if policy == "OnTransientError":
            retry_failed = retry_error = is_transient(last.message)
        if (last.phase == FAILED and not retry_failed) or (last.phase == ERROR and not retry_error):
            self.nodes.mark(node, last.phase, last.message)
            return True
        if limit is not None and len(attempts) > int(limit):
            self.nodes.mark(node, last.phase, "No more retries left")
            return True
        if retry.get("expression"):
            env = expand(retry_scope(attempts))
            if not exprlang.evaluate_bool(retry["expression"], env):
                self.nodes.mark(node, last.phase, "retryStrategy.expression evaluated to false")
                return True
        return True


def retry_scope(attempts: list[Node]) -> dict[str, str]:
    """Variables of retryStrategy.expression (Argo's buildRetryStrategyLocalScope)."""
    last = attempts[-1]
    return {
        "retries": str(len(attempts) - 1),
        "lastRetry.exitCode": (last.outputs or {}).get("exitCode") or "-1",
        "lastRetry.status": last.phase,
        "lastRetry.duration": go_seconds(last.duration()),
        "lastRetry.message": last.message,
    }


def is_transient(message: str) -> bool:
    """Argo's IsTransientErr on a node message: network and API-server hiccups, or the operator's
    TRANSIENT_ERROR_PATTERN. A preemption ("pod deleted") is not transient unless the pattern says so."""
    pattern = os.environ.get("TRANSIENT_ERROR_PATTERN")
    if pattern and re.search(pattern, message):
        return True
    return any(text in message for text in TRANSIENT_MESSAGES) or message.endswith("EOF")


def go_seconds(seconds: float) -> str:
    """fmt.Sprint of a float64 number of seconds: "3", "0.5"."""
    return str(int(seconds)) if seconds == int(seconds) else repr(seconds)


def go_time(seconds: float) -> str:
    """time.Time's String(): "2024-05-01 12:00:00 +0000 UTC"."""
    return time.strftime("%Y-%m-%d %H:%M:%S +0000 UTC", time.gmtime(int(seconds)))
