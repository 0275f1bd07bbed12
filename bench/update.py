"""Trainer throughput: 2 expert-parallel ranks (alltoall over gloo) against 1 rank, in one run.

    .venv/bin/python bench/update.py [--steps 6] [--samples 256] [--micro-batch 64] [--model demo|moe-heavy]
                                     [--no-dp-reference] [--sft DIR [--scored FILE]]

Both configurations train the same Qwen3-MoE (default: the demo model, steps.demo.sft.demo_model_config: 8 experts,
top-2) with the real update path (PolicyTrainer: PPO loss, truncated IS, gradient sync, clipping, AdamW) on
the same synthetic global batch (256 sequences, as one optimizer step of configs/demo.yaml), with the same
micro-batch per rank (64; configs/demo.yaml now uses 128), for the same number of optimizer steps after one warm-up
step. Every rank is one process limited to ONE torch thread (torch.set_num_threads(1)), for both
configurations, so the comparison is 1 core against 2 cores and not 1 process using both cores against 2
processes fighting over them.

Prints tokens/s (model positions of the global batch per second of step time) on the fastest and on the
median step, the CPU seconds each rank used per step, the speed-ups, the share of the 2-rank step time spent
in the MoE dispatch/combine exchanges (forward and backward: the time blocked starting and waiting for each
all_to_all_single, waiting for the peer included; exchange time hidden behind expert work is not counted),
and the share of the (token, expert) rows that the busier EP rank's experts ran. The 2 EP ranks run twice:
with the contiguous expert placement (rank r holds experts [r*E/2, (r+1)*E/2) of every layer) and with the
balanced one (steps.models.placement.balanced_placement of the per-expert row counts of the bench's
own batch, counted in a first forward pass, as the update does with the previous iteration's counts). A further
configuration, 2 data-parallel ranks (EP=1: every rank holds every expert, no dispatch/combine), shows what
this machine gives two processes at all: the ceiling of any 2-rank speed-up here.
--sft DIR trains that checkpoint (e.g. the demo's SFT policy, whose trained router is far less even than a
random one) instead of a randomly initialised model; --scored FILE (a scored.parquet of a run) trains on that
experience instead of synthetic sequences.
The configurations alternate --repeats times, each repeat starting one configuration later (in a fixed order
the balanced placement always ran right after the contiguous one, which cost it a few percent: README);
the fastest step of each is the headline, the estimate least
distorted by other load on a shared machine (the median step is printed next to it). Target: a speed-up of
at least 1.6x.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def synthetic_samples(count: int, seed: int = 0) -> list:
    """Demo-task-shaped sequences: a 10-16 token prompt and an 8-16 token response ending in EOS."""
    from steps.demo.char_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE
    from steps.experience.tables import Sample

    rng = random.Random(seed)
    samples = []
    for i in range(count):
        prompt = [BOS_ID] + [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(10, 16))]
        response = [rng.randrange(4, VOCAB_SIZE) for _ in range(rng.randint(7, 15))] + [EOS_ID]
        samples.append(
            Sample(f"p{i // 8:04d}", i % 8, prompt, response, [rng.uniform(-4.0, -1.0) for _ in response],
                   rng.gauss(0.0, 1.0))
        )  # fmt: skip
    return samples


def scored_samples(path: str, count: int) -> list:
    """The first `count` rows of a scored.parquet, as the trainer reads them (cycled if there are fewer)."""
    import pyarrow.parquet as pq

    from steps.experience.tables import Sample

    rows = pq.read_table(path).to_pylist()
    rows.sort(key=lambda r: (r["prompt_id"], r["sample_index"]))
    return [
        Sample(r["prompt_id"], r["sample_index"], r["prompt_ids"], r["response_ids"], r["behavior_logprobs"],
               r["advantage"])
        for r in (rows[i % len(rows)] for i in range(count))
    ]  # fmt: skip


def bench_samples(args: argparse.Namespace) -> list:
    return scored_samples(args.scored, args.samples) if args.scored else synthetic_samples(args.samples)


def bench_model(args: argparse.Namespace, placement=None, ep_rank: int = 0):  # -> MoeForCausalLM
    """The bench's model (the same weights in every process), holding the experts `placement` gives ep_rank."""
    import torch

    from steps.models.hf_checkpoint import load_pretrained
    from steps.models.qwen3_moe.model import MoeForCausalLM

    if args.sft:
        return load_pretrained(args.sft, torch.float32, "cpu", placement, ep_rank)
    cfg = bench_model_config(args.model)
    torch.manual_seed(0)
    full = MoeForCausalLM(cfg)
    model = MoeForCausalLM(cfg, placement, ep_rank)
    model.load_state_dict({k: v for k, v in full.state_dict().items() if k in model.state_dict()})
    return model


def expert_loads(args: argparse.Namespace) -> list[list[int]]:
    """First pass: the (token, expert) rows each expert of each MoE layer gets from the bench's batch (one
    forward pass, as the update counts them)."""
    import torch

    from steps.training.micro_batch import collate

    torch.set_num_threads(1)
    model = bench_model(args)
    model.count_routed_rows()
    samples = bench_samples(args)
    with torch.no_grad():
        for start in range(0, len(samples), args.micro_batch):
            mb = collate(samples, list(range(start, min(start + args.micro_batch, len(samples)))), torch.device("cpu"))
            model(mb.input_ids, mb.attention_mask)
    return model.routed_rows().tolist()


def bench_model_config(name: str):  # -> steps.models.qwen3_moe.config.MoeConfig
    """The demo model, or the same model with Qwen3-MoE's expert width (see bench/README.md, update)."""
    import dataclasses

    from steps.demo.sft import demo_model_config

    cfg = demo_model_config()
    if name == "moe-heavy":
        # active expert width (top-k x moe_intermediate_size) = 3 x hidden, as Qwen3-30B-A3B (8 x 768 = 3 x 2048)
        # and Qwen3-235B-A22B (8 x 1536 = 3 x 4096); the demo model has 2 x 64 = 1.33 x 96
        cfg = dataclasses.replace(cfg, moe_intermediate_size=3 * cfg.hidden_size // cfg.num_experts_per_tok)
    return cfg


def worker(
    rank: int, world: int, ep: int, slots: list[list[int]] | None, port: int, args: argparse.Namespace, out: str
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from steps.expert_parallel.dispatch import make_dispatch
    from steps.expert_parallel.mesh import build_mesh
    from steps.expert_parallel.timing import CommTimer
    from steps.models.placement import ExpertPlacement
    from steps.training.micro_batch import collate
    from steps.training.trainer import PolicyTrainer, TrainSettings, rank_micro_batches

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = build_mesh(rank, world, ep, torch.device("cpu"))
    placement = ExpertPlacement.from_lists(slots, ep) if slots is not None and ep > 1 else None
    model = bench_model(args, placement, mesh.ep_rank if placement else 0)
    cfg = model.config
    timer = CommTimer(enabled=True)
    dispatch = make_dispatch(args.backend if world > 1 else "local", mesh, cfg.num_experts, timer=timer)
    model.set_dispatch(dispatch)
    settings = TrainSettings(micro_batch_size=args.micro_batch, lr=1e-4)
    trainer = PolicyTrainer(model, mesh, settings)

    samples = bench_samples(args)
    everything = list(range(len(samples)))
    micro = [collate(samples, ids, mesh.device) for ids in rank_micro_batches(everything, mesh, args.micro_batch)]
    normalizer = trainer.normalizer(samples, everything)
    tokens = sum(s.num_tokens - 1 for s in samples)  # positions fed to the model, whole global batch

    trainer.step(micro, normalizer)  # warm-up
    if world > 1:
        dist.barrier()
    timer.seconds = 0.0
    # the (token, expert) rows this rank's experts ran (AllToAllDispatch counts them): the busiest rank sets
    # the pace of every exchange
    rows_before = getattr(dispatch, "expert_rows", 0)
    step_seconds = []
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step_start = time.perf_counter()
        trainer.step(micro, normalizer)
        step_seconds.append(time.perf_counter() - step_start)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    result = {"rank": rank, "seconds": seconds, "cpu_seconds": cpu_seconds, "comm_seconds": timer.seconds,
              "step_seconds": step_seconds, "tokens": tokens,
              "expert_rows": getattr(dispatch, "expert_rows", 0) - rows_before}  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def measure(world: int, ep: int, slots: list[list[int]] | None, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=worker, args=(r, world, ep, slots, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a {world}-rank worker failed")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    # The ranks meet in collectives every step, so step i ends at about the same time on each: a step's time
    # is the slowest rank's.
    steps = [max(per_rank) for per_rank in zip(*(r["step_seconds"] for r in ranks), strict=True)]
    return {
        "ranks": world,
        "tokens": ranks[0]["tokens"],
        "steps": steps,
        "comm_share": max(r["comm_seconds"] / r["seconds"] for r in ranks),
        "cpu_s": max(r["cpu_seconds"] for r in ranks) / args.steps,
        "busiest_expert_share": max(r["expert_rows"] for r in ranks) / max(1, sum(r["expert_rows"] for r in ranks)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps (after one warm-up)")
    parser.add_argument("--samples", type=int, default=256, help="sequences in the global batch")
    parser.add_argument(
        "--micro-batch", type=int, default=64, help="sequences per micro-batch per rank (configs/demo.yaml: 128)"
    )
    parser.add_argument("--model", default="demo", choices=["demo", "moe-heavy"], help="model config (README)")
    parser.add_argument("--backend", default="alltoall", choices=["alltoall"], help="EP backend of the 2-rank run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements; the best of each is kept")
    parser.add_argument(
        "--dp-reference", default=True, action=argparse.BooleanOptionalAction,
        help="also measure 2 data-parallel ranks (EP=1, no exchanges): the ceiling this machine gives 2 processes",
    )  # fmt: skip
    parser.add_argument("--sft", default=None, help="train this checkpoint dir (e.g. a demo SFT policy) instead")
    parser.add_argument("--scored", default=None, help="train on this scored.parquet instead of synthetic samples")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from steps.models.placement import ExpertPlacement, balanced_placement

    # First pass: the per-expert rows of the bench's batch, and the placements they give.
    loads = expert_loads(args)
    contiguous = ExpertPlacement.contiguous(len(loads), len(loads[0]), 2)
    balanced = balanced_placement(loads, 2)

    def shares(placement: ExpertPlacement) -> str:
        return ", ".join(f"{max(r) / sum(r):.0%}" for r in placement.rank_rows(loads))

    model_name = f"--sft {args.sft}" if args.sft else f"{args.model} model"
    print(f"{model_name}, {'--scored ' + args.scored if args.scored else 'synthetic sequences'}")
    print(f"per-expert rows of the batch, per MoE layer: {loads}")
    print(f"busier EP rank's share of the rows per MoE layer: contiguous {shares(contiguous)}; "
          f"balanced {shares(balanced)} (slots {balanced.to_lists()})")  # fmt: skip

    # The configurations alternate, so that a shared machine's other load falls on all of them alike. Each
    # step is timed: the fastest step of each configuration (over all its repeats) is the estimate least
    # distorted by other processes (as timeit's min), and the median step shows what the load did.
    configs = {
        "1 rank": (1, 1, None),
        "EP=2 contiguous": (2, 2, contiguous.to_lists()),
        "EP=2 balanced": (2, 2, balanced.to_lists()),
    }
    if args.dp_reference:
        configs["2 ranks, EP=1"] = (2, 1, None)  # data parallel, every rank all experts: no dispatch/combine
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)
    for repeat in range(args.repeats):
        # each repeat starts one configuration later: none always runs right after another
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            world, ep, slots = configs[name]
            runs[name].append(measure(world, ep, slots, args))
    load_after = os.getloadavg()[0]
    rows = {}
    for name, measured in runs.items():
        steps = sorted(t for r in measured for t in r["steps"])
        tokens = measured[0]["tokens"]
        rows[name] = {
            "best_step": steps[0],
            "median_step": statistics.median(steps),
            "best": tokens / steps[0],
            "median": tokens / statistics.median(steps),
            "cpu_s": min(r["cpu_s"] for r in measured),
            "comm_share": statistics.median(r["comm_share"] for r in measured),
        }
    print(
        f"{model_name}, {args.samples} sequences per step, micro-batch {args.micro_batch}, "
        f"1 torch thread per rank, "
        f"{args.repeats} x {args.steps} steps each, load average {load_before:.1f} -> {load_after:.1f}"
    )
    print(
        f"{'configuration':>15}  {'tokens/s best':>13}  {'tokens/s median':>15}  {'step best (s)':>13}  "
        f"{'CPU/rank/step (s)':>17}  {'dispatch/combine':>16}  {'busier rank rows':>16}"
    )
    for name, r in rows.items():
        ep2 = name.startswith("EP=2")
        share = f"{100 * r['comm_share']:.1f}%" if ep2 else "-"
        busiest = f"{100 * runs[name][0]['busiest_expert_share']:.1f}%" if ep2 else "-"
        print(
            f"{name:>15}  {r['best']:>13.0f}  {r['median']:>15.0f}  {r['best_step']:>13.3f}  {r['cpu_s']:>17.3f}  "
            f"{share:>16}  {busiest:>16}"
        )
    one = rows["1 rank"]
    for name in ("EP=2 contiguous", "EP=2 balanced"):
        ep2 = rows[name]
        speedup = ep2["best"] / one["best"]
        print(
            f"{name} vs 1 rank: {speedup:.2f}x on the best step (target >= 1.6x: "
            f"{'met' if speedup >= 1.6 else 'NOT met'}); {ep2['median'] / one['median']:.2f}x on the median "
            f"step; {one['cpu_s'] / ep2['cpu_s']:.2f}x in CPU seconds per rank"
            + (f"; {ep2['best'] / rows['2 ranks, EP=1']['best']:.0%} of 2 DP ranks" if args.dp_reference else "")
        )
    balanced_gain = rows["EP=2 balanced"]["best"] / rows["EP=2 contiguous"]["best"]
    print(f"balanced vs contiguous placement: {balanced_gain:.2f}x on the best step, "
          f"{rows['EP=2 balanced']['median'] / rows['EP=2 contiguous']['median']:.2f}x on the median step")  # fmt: skip
    if args.dp_reference:
        dp = rows["2 ranks, EP=1"]
        print(
            f"reference, 2 data-parallel ranks without any exchange: {dp['best'] / one['best']:.2f}x on the best "
            f"step, {dp['median'] / one['median']:.2f}x on the median step (what this machine gives 2 processes)"
        )
    print(
        "dispatch/combine: share of the 2-rank step time blocked in the exchanges (median of the repeats; "
        "waiting for the peer included); busier rank rows: the share of the (token, expert) rows the busier "
        "EP rank's experts ran, all layers together"
    )


if __name__ == "__main__":
    main()
