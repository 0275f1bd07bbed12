"""An engine over HTTP: a rollout client's generate calls answered by a rollout server's engine (`POST /generate`).

A multi-turn rollout runs its environment next to the rollout client (the CPU pool) and sends each turn to the
rollout servers (steps/environments/conversation.py takes any Engine): `RemoteEngine.generate` is one request of
the turn's samples, which the server checks against the iteration's policy version before its engine touches
them (steps/experience/rollout_server.py `RolloutService.generate`). The wire format of both sides is written here
once: `request_body` / `read_requests` and `answer_body` / `read_generations`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from steps.engines.interface import FINISH_LENGTH, FINISH_STOP, Generation, GenerationRequest, SamplingParams
from steps.errors import MoerlError
from steps.run import serving

OPERATION = "generate"


def request_body(requests: Sequence[GenerationRequest], params: SamplingParams) -> dict[str, Any]:
    """The samples and the turn's token allowance (the other sampling settings are the iteration's plan's)."""
    return {
        "requests": [[r.prompt_id, list(r.prompt_ids), r.sample_index, r.seed] for r in requests],
        "max_new_tokens": params.max_new_tokens,
    }


def read_requests(body: dict[str, Any], plan_params: SamplingParams) -> tuple[list[GenerationRequest], SamplingParams]:
    """A generate request's samples and the plan's sampling settings with its allowance (MoerlError if malformed)."""
    try:
        requests = [GenerationRequest(str(p), tuple(int(t) for t in ids), int(k), int(seed))
                    for p, ids, k, seed in body["requests"]]  # fmt: skip
        allowance = int(body["max_new_tokens"])
    except (KeyError, TypeError, ValueError) as err:
        raise MoerlError(f"generate request: needs requests [[prompt_id, prompt_ids, sample_index, seed]] and "
                         f"max_new_tokens ({type(err).__name__}: {err})") from err  # fmt: skip
    if not 1 <= allowance <= plan_params.max_new_tokens:
        raise MoerlError(f"generate request: max_new_tokens {allowance} is outside 1..{plan_params.max_new_tokens} "
                         "(the run's sampling.max_new_tokens)")  # fmt: skip
    return requests, dataclasses.replace(plan_params, n=1, max_new_tokens=allowance)


def answer_body(generations: Sequence[Generation]) -> dict[str, Any]:
    return {"generations": [[g.response_ids, g.logprobs, g.finish_reason] for g in generations]}


def read_generations(answer: dict[str, Any], requests: Sequence[GenerationRequest], server: str) -> list[Generation]:
    rows = answer.get("generations")
    if not isinstance(rows, list) or len(rows) != len(requests):
        raise MoerlError(
            f"{server} answered {str(answer)[:200]} to a generate request of {len(requests)} samples: the server runs "
            "another moerl than this rollout client; run one image version for the servers and the clients"
        )
    out = []
    for r, (ids, logprobs, finish) in zip(requests, rows, strict=True):
        if len(ids) != len(logprobs) or finish not in (FINISH_STOP, FINISH_LENGTH):
            raise MoerlError(
                f"{server} answered a malformed generation for prompt {r.prompt_id} sample {r.sample_index}: the "
                "server runs another moerl than this rollout client; run one image version for both"
            )
        out.append(Generation(r.prompt_id, r.sample_index, [int(t) for t in ids], [float(x) for x in logprobs], finish))
    return out


class RemoteEngine:
    """The Engine interface over one rollout server, for one iteration's policy version. A lost server raises
    serving.ServerLost (the rollout step exits to be retried; its chunk in flight is generated again)."""

    name = "remote"

    def __init__(self, server: serving.Registration, run_uri: str, iteration: int, policy_version: int) -> None:
        self.server = server
        self.identity = {"run": run_uri, "iteration": iteration, "policy_version": policy_version}

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        answer = serving.call(self.server, OPERATION, self.identity | request_body(requests, params))
        if answer.get("policy_version") != self.identity["policy_version"]:
            raise MoerlError(f"{self.server.name} answered with policy version {answer.get('policy_version')}, "
                             f"not v{self.identity['policy_version']:06d}")  # fmt: skip
        return read_generations(answer, requests, self.server.name)

    def update_weights(self, model_dir: str | os.PathLike) -> None:
        raise MoerlError("a remote engine's weights are its server's: the server brings them to each request's version")

    def close(self) -> None:
        pass
