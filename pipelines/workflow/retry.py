"""Retry strategies: Spot pods retry preemptions and nothing else; on-demand pods retry Argo errors only.

When EC2 reclaims a Spot node, Argo records the attempt in one of a few ways, depending on how far the
node got before it went away:

    Error   "pod deleted"                                         the node vanished with the pod
    Failed  "Pod was terminated in response to imminent node shutdown."   kubelet's graceful node shutdown
    Failed  "The node was low on resource: memory. ..."           kubelet eviction while the node drains
    Failed  exit code 143 (SIGTERM) or 137 (SIGKILL)              the container was stopped mid-run

A client of a long-lived server (a rollout step sending its chunks to a rollout server) whose server was lost
mid-request exits with 75 (steps/run/serving.py EXIT_SERVER_LOST): that is a reclaim one hop away, retried the
same way wherever the client runs, so that the retry reaches another server or the replacement.

A long-lived server (a daemon task: rollout servers, the trainer) is retried on any failure when it is on
demand: losing it never changes what the run computes, and a trainer whose rank dies ends with torchrun's own
exit 1, not a signal's code. Its clients never wait for it forever (they are retried), the retry limit
bounds a server that fails by itself, and its backoff has no maxDuration (counted from a daemon's first start,
at its segment's, it would refuse a replacement hours later).

A step that fails by itself (a bug, a bad input: exit 1, or 2 for a MoerlError) fails the same way on any
node, so retrying it only burns the retry budget and hides the message: it is not retried.
`retryPolicy: Always` lets the expression see Failed as well as Error attempts; `nodeAntiAffinity` sends
the retry to another node than the one that was reclaimed.
"""

from __future__ import annotations

from hera.workflows import RetryStrategy
from hera.workflows.models import Backoff, RetryAffinity, RetryNodeAntiAffinity

from steps.run.config import Retry
from steps.run.serving import EXIT_SERVER_LOST

# Argo evaluates this with expr-lang over lastRetry.{status,exitCode,message,duration}; exitCode is a string.
SPOT_RETRY_EXPRESSION = (
    'lastRetry.status == "Error" || (lastRetry.status == "Failed" && ('
    'lastRetry.message matches "imminent node shutdown|low on resource" || '
    f'lastRetry.exitCode in ["137", "143", "{EXIT_SERVER_LOST}"]))'
)
# An on-demand client of a server: Argo's errors and a lost server.
CLIENT_RETRY_EXPRESSION = f'lastRetry.status == "Error" || lastRetry.exitCode == "{EXIT_SERVER_LOST}"'


def _backoff(retry: Retry, timed: bool = True) -> Backoff:
    """The role's backoff; `timed` False leaves out maxDuration, which Argo counts from the first attempt's
    start: a server's first attempt starts with its segment, so hours later it would refuse any replacement."""
    b = retry.backoff
    return Backoff(duration=b.duration, factor=b.factor, max_duration=b.max_duration if timed else None, cap=b.cap)


def spot_retry(retry: Retry, server: bool = False) -> RetryStrategy:
    """Retry preemptions of a Spot pod on another node, with exponential backoff (a server's: not timed)."""
    return RetryStrategy(
        limit=retry.limit,
        retry_policy="Always",
        expression=SPOT_RETRY_EXPRESSION,
        backoff=_backoff(retry, timed=not server),
        affinity=RetryAffinity(node_anti_affinity=RetryNodeAntiAffinity()),
    )


def on_demand_retry(retry: Retry) -> RetryStrategy:
    """Retry only what Argo calls an error (pod deleted, init or wait container failure), never a failure."""
    return RetryStrategy(limit=retry.limit, retry_policy="OnError", backoff=_backoff(retry))


def client_retry(retry: Retry) -> RetryStrategy:
    """Retry what Argo calls an error and a lost server (exit 75), never another failure."""
    return RetryStrategy(
        limit=retry.limit, retry_policy="Always", expression=CLIENT_RETRY_EXPRESSION, backoff=_backoff(retry)
    )


def server_retry(retry: Retry) -> RetryStrategy:
    """An on-demand long-lived server: restarted after any failure or error, with backoff (not timed)."""
    return RetryStrategy(limit=retry.limit, retry_policy="Always", backoff=_backoff(retry, timed=False))


def retry_for(retry: Retry, spot: bool, client: bool = False, server: bool = False) -> RetryStrategy:
    """The retryStrategy of a pod of a role (its retries and whether it is on Spot); `client`: it calls a
    long-lived server; `server`: it is one."""
    if spot:
        return spot_retry(retry, server)
    if server:
        return server_retry(retry)
    return client_retry(retry) if client else on_demand_retry(retry)
