"""Step rollout: generate one shard of an iteration's experience, chunk by chunk.

    python -m steps.rollout --run URI --iteration I --shard K --num-shards S [--policy-version V]
                            [--device cpu|cuda] [--threads N] [--workflow NAME]

Shard K generates chunks K, K+S, K+2S, ... of the iteration's plan (steps/experience/rollout_plan.py) with policy
v(I-1-staleness) and writes each finished chunk atomically as
<run>/experience/iter-I/rollout/chunk-C.parquet. A rerun skips the chunks already there, so a preempted or
killed shard resumes where it stopped and the union of all shards is exactly prompts x group size samples.

With rollout.servers > 0 and --workflow, the step holds no engine: it sends each of its chunks to one of the
Workflow's rollout servers (steps/rollout_server.py), found through the run store, and checks that the chunk
is on the store afterwards; then it verifies the chunk's samples and writes their verdicts beside it
(steps/scoring/verdicts.py) before its next request, so that score does not verify them after the last
chunk. A server lost mid-request ends the step with 75 (EX_TEMPFAIL), which the rollout's retryStrategy
retries like a reclaim; the retry skips the chunks already written.

On SIGTERM (a Spot reclaim) it stops at once — in the middle of generating a chunk, or right after the chunk
it is writing — keeps every finished chunk and exits with 143.

The torch engine on CPU runs on --threads intra-op threads (default 1): float results can depend on the
thread count, and bit-identical samples across shards and restarts need the same count everywhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from steps import progress
from steps.engines.remote import RemoteEngine
from steps.errors import MoerlError, run_cli
from steps.experience.rollout_chunks import (
    EXIT_PREEMPTED,
    IterationRollout,
    Preempted,
    Preemption,
    engine_settings,
    open_engine,
)
from steps.run import checkpoint, serving
from steps.run.keys import rollout_server_name
from steps.scoring.verdicts import write_chunk_verdicts
from steps.store.object_store import Store

__all__ = ["EXIT_PREEMPTED", "Preempted", "Preemption", "ShardResult", "rollout_shard"]
SERVER_KIND = rollout_server_name("")  # the prefix of the rollout servers' names


@dataclass
class ShardResult:
    chunks: list[int]  # this shard's chunks
    generated: list[int]  # the ones this call generated (the rest were already finished)
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0
    servers: list[str] | None = None  # the servers that generated them (None: this process's own engine)


def rollout_shard(
    run_uri: str,
    iteration: int,
    shard: int,
    num_shards: int,
    policy_version: int | None = None,
    device: str = "cpu",
    threads: int = 1,
    preemption: Preemption | None = None,
    log: Callable[[str], None] = print,
    workflow: str | None = None,
) -> ShardResult:
    """Generate the missing chunks of one shard; returns what it did. With `workflow` and rollout.servers > 0,
    the Workflow's rollout servers generate them (send_to_servers); otherwise this process's own engine."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise MoerlError(f"--shard {shard} --num-shards {num_shards}: need 0 <= shard < num-shards")
    preemption = preemption or Preemption()
    run = Store.open(run_uri)
    work = IterationRollout.open(run, iteration)
    work.check_version(policy_version)
    cfg, plan, version = work.cfg, work.plan, work.version
    mine = plan.shard_chunks(shard, num_shards)
    finished = work.finished(mine)
    todo = [c for c in mine if c not in finished]
    where = f"rollout iteration {iteration} shard {shard}/{num_shards}"
    served = bool(workflow and cfg.rollout.servers)
    by = f"{cfg.rollout.servers} rollout servers" if served else f"{cfg.rollout.engine} engine"
    log(
        f"{where}: policy v{version:06d}, {by}, {len(mine)} of {plan.num_chunks} chunks "
        f"({plan.chunk_size} prompts x {plan.group_size} samples each), {len(finished)} already finished"
    )
    result = ShardResult(chunks=mine, generated=[])
    progress.report(len(finished), len(mine))
    if not todo:
        return result
    start = time.monotonic()
    if served:
        send_to_servers(work, workflow, shard, todo, len(finished), len(mine), result, log, where, preemption)
    else:
        generate_here(work, device, threads, todo, len(finished), len(mine), preemption, result, log, where)
    result.seconds = time.monotonic() - start
    log(
        f"{where}: finished: {len(result.generated)} chunks, {result.samples} samples, {result.tokens} tokens "
        f"in {result.seconds:.1f}s ({result.tokens / max(result.seconds, 1e-9):.0f} tokens/s)"
    )
    return result


def _done(result: ShardResult, chunk: int, done: int, total: int, samples: int, tokens: int, seconds: float,
          log: Callable[[str], None], where: str, by: str = "") -> None:  # fmt: skip
    progress.report(done, total)
    result.generated.append(chunk)
    result.samples += samples
    result.tokens += tokens
    log(
        f"{where}: chunk {chunk:06d} done ({done}/{total}){by}: {samples} samples, {tokens} tokens in "
        f"{seconds:.1f}s, {tokens / max(seconds, 1e-9):.0f} tokens/s"
    )


def generate_here(
    work: IterationRollout, device: str, threads: int, todo: list[int], finished: int, total: int,
    preemption: Preemption, result: ShardResult, log: Callable[[str], None], where: str,
) -> None:  # fmt: skip
    """The chunks with an engine of this process's own, opened on the iteration's policy version."""
    cfg = work.cfg
    if cfg.rollout.engine == "torch" and device == "cpu":
        torch.set_num_threads(threads)
    engine = open_engine(cfg.rollout.engine, checkpoint.fetch(work.run, work.version), device, engine_settings(cfg),
                         record_routes=cfg.records_routes)  # fmt: skip
    try:
        for done, chunk in enumerate(todo, start=finished + 1):
            stats = work.generate(engine, chunk, preemption)
            _done(result, chunk, done, total, stats.samples, stats.tokens, stats.seconds, log, where)
    finally:
        engine.close()


def verdicts(
    work: IterationRollout, chunk: int, preemption: Preemption | None, log: Callable[[str], None], where: str
) -> None:
    """The verifier's verdicts of a chunk this client's server wrote (steps/scoring/verdicts.py): an optimisation,
    so a failure is said and the chunk left to score; a SIGTERM during it writes none and stops the step."""
    interrupted = (lambda: preemption.requested) if preemption is not None else (lambda: False)
    try:
        write_chunk_verdicts(work.run, work.cfg, work.plan, work.tok, chunk, interrupted)
    except Preempted:
        raise
    except Exception as err:  # noqa: BLE001 - score verifies the chunk itself, and says what fails there
        log(f"{where}: chunk {chunk:06d}: verdicts not written ({type(err).__name__}: {err}); score verifies it")
    if preemption is not None:
        preemption.check()


def send_to_servers(
    work: IterationRollout, workflow: str, shard: int, todo: list[int], finished: int, total: int,
    result: ShardResult, log: Callable[[str], None], where: str, preemption: Preemption | None = None,
) -> None:  # fmt: skip
    """The chunks sent, one request each, to rollout server K mod rollout.servers (or its replacement, which
    registers under its name) when it is ready, else to any ready server, else to the first that is ready
    within rollout.server_wait_s. The workflow starts a rollout once every server is ready, so the first
    attempts go to their own servers. A server lost mid-request raises ServerLost: the step exits with
    EXIT_SERVER_LOST and its retry sends the chunks left to a server alive then."""
    run, wait_s = work.run, work.cfg.rollout.server_wait_s
    mine = rollout_server_name(shard % work.cfg.rollout.servers)
    servers = serving.live_servers(run, workflow, mine, exact=True) or serving.live_servers(run, workflow, SERVER_KIND)
    servers = servers or serving.wait_for_servers(run, workflow, SERVER_KIND, wait_s, log)
    if not servers:
        raise serving.ServerLost(
            f"no rollout server of workflow {workflow} answered within rollout.server_wait_s={wait_s:.0f}s "
            f"(their pods: the Workflow's {SERVER_KIND}K tasks; `argo retry` does not restart daemons, "
            "argoproj/argo-workflows#13484: resubmit the run instead)"
        )
    server = servers[0]
    log(f"{where}: sending its chunks to {server.name} at {server.address}")
    result.servers = [server.name]
    if work.plan.environment is not None:  # the environment runs here, each turn goes to the server
        engine = RemoteEngine(server, work.run.uri, work.iteration, work.version)
        for done, chunk in enumerate(todo, start=finished + 1):
            stats = work.generate(engine, chunk, preemption)  # this client writes the chunk: a protected write
            verdicts(work, chunk, preemption, log, where)
            _done(result, chunk, done, total, stats.samples, stats.tokens, stats.seconds, log, where,
                  f" with {server.name}")  # fmt: skip
        return
    request = {"run": work.run.uri, "iteration": work.iteration, "policy_version": work.version}
    for done, chunk in enumerate(todo, start=finished + 1):
        answer = serving.call(server, "chunk", request | {"chunk": chunk})
        if answer.get("policy_version") != work.version or answer.get("chunk") != chunk:
            raise MoerlError(f"{server.name} answered {answer} to a request for chunk {chunk} of v{work.version:06d}")
        if not work.finished([chunk]):  # read back: the chunk must now be on the store, as this plan's
            raise serving.ServerLost(f"{server.name} answered chunk {chunk} but it is not on the store")
        verdicts(work, chunk, preemption, log, where)  # score reads them instead of verifying the chunk
        by = f" by {server.name}"
        _done(result, chunk, done, total, answer.get("samples", 0), answer.get("tokens", 0),
              answer.get("seconds", 0.0), log, where, by)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI (file://, plain path or s3://bucket/prefix)")
    parser.add_argument("--iteration", type=int, required=True, help="RL iteration, from 1")
    parser.add_argument("--shard", type=int, required=True, help="this shard's index, 0 .. num-shards-1")
    parser.add_argument("--num-shards", type=int, required=True, help="rollout shards of the iteration")
    parser.add_argument(
        "--policy-version", type=int, help="check: the version to sample from (default v(I-1-staleness))"
    )
    parser.add_argument("--device", default="cpu", help="torch engine device: cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; see above)")
    parser.add_argument(
        "--workflow", help="the Workflow whose rollout servers generate the chunks (with rollout.servers > 0)"
    )
    args = parser.parse_args()
    preemption = Preemption()
    preemption.install()
    log = lambda line: print(line, flush=True)  # noqa: E731
    try:
        rollout_shard(
            args.run, args.iteration, args.shard, args.num_shards, args.policy_version,
            args.device, args.threads, preemption, log, args.workflow,
        )  # fmt: skip
    except Preempted:
        print(
            f"rollout iteration {args.iteration} shard {args.shard}/{args.num_shards}: SIGTERM: stopped; its "
            "finished chunks are kept and a rerun resumes after them",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
    except serving.ServerLost as err:
        print(
            f"rollout iteration {args.iteration} shard {args.shard}/{args.num_shards}: {err}; its finished chunks "
            "are kept and a retry sends the rest to the servers alive then",
            file=sys.stderr,
            flush=True,
        )
        return serving.EXIT_SERVER_LOST
    return 0


if __name__ == "__main__":
    run_cli(main)
