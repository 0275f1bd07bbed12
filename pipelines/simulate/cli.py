"""`moerl simulate`: the command line."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
from pathlib import Path

from pipelines.config import load_config, parse_overrides
from pipelines.simulate import __doc__ as package_doc
from pipelines.simulate.measured import load_step_times
from pipelines.simulate.model import simulate_both
from pipelines.simulate.sizing import (
    CPU_ASSUMPTIONS,
    GPU_ASSUMPTIONS,
    Assumptions,
    cluster_for,
    derived_step_model,
    is_local,
    measured_step_model,
)
from pipelines.simulate.tables import describe, table
from pipelines.simulate.timeline import plot_timeline
from steps.errors import MoerlError


def parse_assumptions(pairs: list[str], base: Assumptions) -> Assumptions:
    names = [f.name for f in dataclasses.fields(Assumptions)]
    values: dict[str, float] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in names:
            guess = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else f"known: {', '.join(names)}"
            raise MoerlError(f"--assume {pair!r}: not NAME=VALUE with a known name; {hint}")
        try:
            value = float(text)
        except ValueError:
            raise MoerlError(f"--assume {pair!r}: {text!r} is not a number") from None
        throughput = name.endswith("_per_gpu_s") or name.endswith("_per_s")
        if not math.isfinite(value) or value < 0 or (throughput and value == 0):
            raise MoerlError(f"--assume {pair!r}: must be a finite number >= 0 (a throughput > 0)")
        values[name] = int(value) if name == "rollout_nodes" else value
    return base.override(values)


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, parse_overrides(args.set))
    base = CPU_ASSUMPTIONS if is_local(cfg) else GPU_ASSUMPTIONS
    a = parse_assumptions(args.assume, base)
    cluster = cluster_for(cfg, a)
    if args.step_times:
        steps = measured_step_model(cfg, a, load_step_times(args.step_times), str(args.step_times))
    else:
        steps = derived_step_model(cfg, a)
    if args.iterations is not None and args.iterations < 1:
        raise MoerlError(f"--iterations {args.iterations}: simulate at least 1 iteration")
    iterations = args.iterations or cfg.iterations
    results = simulate_both(
        cfg, steps, cluster, a, iterations=iterations, interruptions_per_hour=args.spot_interruptions_per_hour,
        seed=args.seed,
    )  # fmt: skip
    rate = args.spot_interruptions_per_hour
    print(
        f"moerl simulate {args.config}: {iterations} iterations, seed {args.seed}, "
        + (f"{rate:g} Spot interruptions per rollout node-hour" if rate else "no Spot interruptions")
    )
    print(describe(cfg, cluster, steps, a))
    print()
    print(table(results, cfg.staleness))
    if any(r.retries_exhausted - r.servers_out_of_retries for r in results.values()):
        print(
            f"warning: some rollout shards ran out of retries (retries.rollout limit {cfg.retries['rollout'].limit}):"
            " the real run would have failed there"
        )
    if any(r.servers_out_of_retries for r in results.values()):
        print(
            "warning: some servers ran out of retries (their role's retries: limit, or backoff.max_duration counted"
            " from the segment's start): the real run would have failed there"
        )
    if args.plot:
        print(f"wrote {plot_timeline(results, args.plot)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="model the run's workflow on a cluster: iteration time, throughput, idle GPUs, sync vs async",
        description=package_doc.split("\n\n")[1],
    )
    parser.add_argument("config", type=Path, help="run config YAML (e.g. configs/eks-p5en.yaml)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override a config field, e.g. --set trainer.nodes=8 (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--step-times", type=Path, metavar="FILE.json",
        help="measured seconds per step ({\"rollout\": 12.5, ...}) or a `moerl local --status-out` status",
    )  # fmt: skip
    parser.add_argument(
        "--assume", action="append", default=[], metavar="NAME=VALUE",
        help="override an assumption, e.g. --assume rollout_tokens_per_gpu_s=3000 (see pipelines/simulate/sizing.py)",
    )  # fmt: skip
    parser.add_argument(
        "--spot-interruptions-per-hour", type=float, default=0.0, metavar="X",
        help="Spot interruptions per rollout node-hour (Poisson; default 0)",
    )  # fmt: skip
    parser.add_argument("--iterations", type=int, metavar="N", help="iterations to simulate (default: the config's)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the interruptions (default 0)")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="write a timeline of the first iterations")
    parser.set_defaults(func=main)
