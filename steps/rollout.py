"""Step rollout: generate one shard of an iteration's experience, chunk by chunk.

    python -m steps.rollout --run URI --iteration I --shard K --num-shards S [--policy-version V]
                            [--device cpu|cuda] [--threads N]

Shard K generates chunks K, K+S, K+2S, ... of the iteration's plan (steps/experience.py) with policy
v(I-1-staleness) and writes each finished chunk atomically as
<run>/experience/iter-I/rollout/chunk-C.parquet. A rerun skips the chunks already there, so a preempted or
killed shard resumes where it stopped and the union of all shards is exactly prompts x group size samples.

On SIGTERM (a Spot reclaim) it stops at once — in the middle of generating a chunk, or right after the chunk
it is writing — keeps every finished chunk and exits with 143.

The torch engine on CPU runs on --threads intra-op threads (default 1): float results can depend on the
thread count, and bit-identical samples across shards and restarts need the same count everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

import torch

from steps import checkpoint, progress
from steps.errors import MoerlError, run_cli
from steps.experience import (
    RolloutPlan,
    chunk_problem,
    chunk_table,
    finished_chunks,
    load_run_config,
    read_table,
    version_tokenizer,
    write_chunk,
)
from steps.generation import Engine, sample_requests, sample_seed
from steps.run_store import behaviour_version, chunk_key
from steps.sglang_engine import SGLangSettings
from steps.store import Store
from steps.tasks import Prompt
from steps.tokenizer import CheckpointTokenizer

EXIT_PREEMPTED = 143  # 128 + SIGTERM, what Kubernetes and Argo expect from a terminated container


def open_engine(
    kind: str,
    model_dir: str | os.PathLike,
    device: str = "cpu",
    sglang_settings: SGLangSettings | None = None,
) -> Engine:
    """The engine `kind` ("torch" or "sglang", as rollout.engine in the run config) on a checkpoint dir."""
    if kind == "torch":
        from steps.engine import TorchEngine  # lazy: an SGLang rollout pod never loads the torch engine

        return TorchEngine.from_checkpoint(model_dir, device=device)
    if kind == "sglang":
        from steps.sglang_engine import SGLangEngine  # lazy: sglang is a GPU-image dependency only

        return SGLangEngine(model_dir, sglang_settings or SGLangSettings())
    raise MoerlError(f"rollout.engine {kind!r} is not an engine; use 'torch' or 'sglang'")


class Preempted(Exception):
    """SIGTERM arrived: stop now, keep what is finished."""


class Preemption:
    """SIGTERM handling: the handler raises Preempted at once (Python runs it between two bytecodes, so in a
    decode loop between two tensor ops), except inside a protected section (writing a chunk), where it only
    records the request, honoured as soon as the section ends. Nothing but a chunk write changes the store,
    so stopping anywhere else loses only the unfinished chunk."""

    def __init__(self) -> None:
        self.requested = False
        self._protected = 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self._protected == 0:
            raise Preempted()

    @contextlib.contextmanager
    def protected(self) -> Iterator[None]:
        self._protected += 1
        try:
            yield
        finally:
            self._protected -= 1
        self.check()

    def check(self) -> None:
        if self.requested:
            raise Preempted()


@dataclass
class ShardResult:
    chunks: list[int]  # this shard's chunks
    generated: list[int]  # the ones this call generated (the rest were already finished)
    samples: int = 0
    tokens: int = 0
    seconds: float = 0.0


def encoded_prompt(tok: CheckpointTokenizer, prompt: Prompt, plan: RolloutPlan) -> list[int]:
    """The prompt's ids as the policy sees them; a prompt the checkpoint's tokenizer cannot encode is refused
    (moerl check reports every such prompt before a run starts)."""
    ids, problem = tok.checked_prompt_ids(prompt.content, plan.prompt_format)
    if problem:
        raise MoerlError(f"prompt {prompt.prompt_id!r}: {problem}; fix the prompt or use a checkpoint whose tokenizer "
                         "covers it")  # fmt: skip
    return ids


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
) -> ShardResult:
    """Generate the missing chunks of one shard; returns what it did."""
    if iteration < 1:
        raise MoerlError(f"--iteration {iteration}: iterations count from 1")
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise MoerlError(f"--shard {shard} --num-shards {num_shards}: need 0 <= shard < num-shards")
    preemption = preemption or Preemption()
    run = Store.open(run_uri)
    cfg = load_run_config(run)
    version = behaviour_version(iteration, cfg.staleness)
    if policy_version is not None and policy_version != version:
        raise MoerlError(
            f"--policy-version {policy_version}: iteration {iteration} with staleness {cfg.staleness} samples "
            f"from v{version:06d} (DESIGN: rollout[i] uses v(i-1-staleness)); pass {version} or leave it out"
        )
    tok = version_tokenizer(run, version)  # its stop tokens are part of the plan

    plan = RolloutPlan.for_iteration(cfg, iteration, version, stop_token_ids=tok.stop_ids)
    mine = plan.shard_chunks(shard, num_shards)
    finished = sorted(finished_chunks(run, plan) & set(mine))
    for chunk in finished:  # a finished chunk must be exactly this plan's chunk, or nothing can be trusted
        problem = chunk_problem(plan, chunk, read_table(run, chunk_key(iteration, chunk)))
        if problem:
            raise MoerlError(f"{run.url(chunk_key(iteration, chunk))}: {problem}; delete it and rerun this shard")
    todo = [c for c in mine if c not in finished]
    where = f"rollout iteration {iteration} shard {shard}/{num_shards}"
    log(
        f"{where}: policy v{version:06d}, {cfg.rollout.engine} engine, {len(mine)} of {plan.num_chunks} chunks "
        f"({plan.chunk_size} prompts x {plan.group_size} samples each), {len(finished)} already finished"
    )
    result = ShardResult(chunks=mine, generated=[])
    progress.report(len(finished), len(mine))
    if not todo:
        return result

    if cfg.rollout.engine == "torch" and device == "cpu":
        torch.set_num_threads(threads)
    model_dir = checkpoint.fetch(run, version)
    settings = SGLangSettings.from_config(cfg.rollout.sglang, random_seed=cfg.seed)
    engine = open_engine(cfg.rollout.engine, model_dir, device=device, sglang_settings=settings)
    try:
        start = time.monotonic()
        for done, chunk in enumerate(todo, start=len(finished) + 1):
            prompts = plan.chunk_prompts(chunk)
            prompt_ids = {p.prompt_id: encoded_prompt(tok, p, plan) for p in prompts}
            requests = sample_requests(
                [(p.prompt_id, prompt_ids[p.prompt_id]) for p in prompts],
                plan.sampling,
                seed_of=lambda prompt_id, k: sample_seed(cfg.seed, iteration, prompt_id, k),
            )
            chunk_start = time.monotonic()
            preemption.check()
            generations = engine.generate(requests, plan.sampling)
            table = chunk_table(plan, chunk, prompt_ids, generations)
            with preemption.protected():
                write_chunk(run, plan, chunk, table)
            progress.report(done, len(mine))
            tokens = sum(len(g.response_ids) for g in generations)
            seconds = time.monotonic() - chunk_start
            result.generated.append(chunk)
            result.samples += len(generations)
            result.tokens += tokens
            log(
                f"{where}: chunk {chunk:06d} done ({done}/{len(mine)}): {len(generations)} samples, "
                f"{tokens} tokens in {seconds:.1f}s, {tokens / max(seconds, 1e-9):.0f} tokens/s"
            )
        result.seconds = time.monotonic() - start
    finally:
        engine.close()
    log(
        f"{where}: finished: {len(result.generated)} chunks, {result.samples} samples, {result.tokens} tokens "
        f"in {result.seconds:.1f}s ({result.tokens / max(result.seconds, 1e-9):.0f} tokens/s)"
    )
    return result


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
    args = parser.parse_args()
    preemption = Preemption()
    preemption.install()
    log = lambda line: print(line, flush=True)  # noqa: E731
    try:
        rollout_shard(
            args.run, args.iteration, args.shard, args.num_shards, args.policy_version,
            args.device, args.threads, preemption, log,
        )  # fmt: skip
    except Preempted:
        print(
            f"rollout iteration {args.iteration} shard {args.shard}/{args.num_shards}: SIGTERM: stopped; its "
            "finished chunks are kept and a rerun resumes after them",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
    return 0


if __name__ == "__main__":
    run_cli(main)
