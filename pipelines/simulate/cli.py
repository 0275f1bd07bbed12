"""`moerl simulate`: the command line."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
from pathlib import Path

from pipelines.config import load_config, parse_overrides
from pipelines.simulate import __doc__ as package_doc
from pipelines.simulate import published
from pipelines.simulate.floor import physical_floor
from pipelines.simulate.from_run import measured_assumptions
from pipelines.simulate.measured import load_step_times
from pipelines.simulate.memory_check import rollout_memory_problem, trainer_memory_problem
from pipelines.simulate.model import simulate_both
from pipelines.simulate.model_sizing import (
    REFERENCE_NAME,
    ModelSizing,
    fetch_model_config,
    model_sizing,
    read_model_config,
    reference_sizing,
)
from pipelines.simulate.sizing import (
    CPU_ASSUMPTIONS,
    GPU_ASSUMPTIONS,
    Assumptions,
    cluster_for,
    conversation_turns,
    derived_step_model,
    flops_seq_len,
    is_local,
    measured_step_model,
    model_assumptions,
    rollout_memory_table,
    tokens_per_iteration,
    trainer_memory_table,
)
from pipelines.simulate.sources import (
    CPU_SOURCES,
    GPU_SOURCES,
    MOVED_TO_THE_MODEL,
    TURNS_FROM_CONFIG,
    explain_lines,
    read_stated,
    stated_path,
)
from pipelines.simulate.tables import describe, table
from pipelines.simulate.timeline import plot_timeline
from steps.errors import MoerlError
from steps.run.config import RunConfig


def assumed_names(pairs: list[str]) -> list[str]:
    """The assumption names that --assume NAME=VALUE pairs set (parse_assumptions has checked them)."""
    return [pair.partition("=")[0] for pair in pairs]


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


ENVIRONMENT_ASSUMPTIONS = ("turns", "environment_step_s", "observation_tokens")


def environment_assumptions(cfg: RunConfig, a: Assumptions, sources: dict[str, str]
                            ) -> tuple[Assumptions, dict[str, str]]:  # fmt: skip
    """The multi-turn assumptions as the model uses them: with an environment, turns 0 (the default) said as the
    config's environment.max_turns, and any other as the model caps it (conversation_turns); without one, their
    sources say they are not used. The figures are the same either way: this is what --explain prints."""
    sources = dict(sources)
    if cfg.environment is None:
        for name in ENVIRONMENT_ASSUMPTIONS:
            sources[name] = f"not used (the config has no environment); {sources[name]}"
        return a, sources
    if a.turns == 0:
        sources["turns"] = TURNS_FROM_CONFIG
    elif a.turns > cfg.environment.max_turns:
        sources["turns"] += f"; capped at environment.max_turns (given {a.turns:g})"
    return dataclasses.replace(a, turns=conversation_turns(cfg, a)), sources


def model_of(cfg: RunConfig, model_config: Path | None) -> tuple[ModelSizing | None, str]:
    """The model to size (None: the built-in Qwen3-30B-A3B figures) and the line that says where it comes from:
    --model-config, else the checkpoint's config.json through the store, else the built-in figures."""
    if model_config is not None:
        source = str(model_config)
        return model_sizing(read_model_config(model_config), source=source), f"model: {source}"
    uri = cfg.sft_checkpoint
    try:
        d = fetch_model_config(uri)
    except Exception as err:  # noqa: BLE001  # an unreachable store (no credentials, no network) or no config.json
        reason = str(err).split(" — ")[0].split("\n")[0].removeprefix(f"{uri}/config.json: ")
        return None, (f"model: {uri}/config.json not readable here ({reason}); the built-in {REFERENCE_NAME} "
                      "figures (~3B active parameters, ~61 GB of bf16 weights); --model-config FILE to size another")
    return model_sizing(d, source=f"{uri}/config.json"), f"model: {uri}/config.json"


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, parse_overrides(args.set))
    base = CPU_ASSUMPTIONS if is_local(cfg) else GPU_ASSUMPTIONS
    sources = dict(CPU_SOURCES if is_local(cfg) else GPU_SOURCES)  # --explain: each value's source, as it moves
    run_line = stated_line = None
    stated = args.assumptions if args.assumptions is not None else stated_path(args.config)
    if args.assumptions is not None or stated.is_file():  # the config's own, with their sources
        values, stated_sources = read_stated(stated)
        base = base.override(values)
        sources.update(stated_sources)
        stated_line = f"stated in {stated}: " + ", ".join(f"{name} {value:g}" for name, value in values.items())
    if args.from_run:  # what the run measured, before the model moves the rates (they depend on the lengths)
        measured, run_line = measured_assumptions(args.from_run, cfg)
        base = base.override(measured)
        sources.update({name: f"measured: {run_line.removeprefix('from the run: ')}" for name in measured})
    a = parse_assumptions(args.assume, base)
    model: ModelSizing | None = None
    if is_local(cfg):
        model_line = ("model: the demo model's measured figures (a config without GPUs)"
                      + ("; --model-config is not used" if args.model_config else ""))  # fmt: skip
    else:
        model, model_line = model_of(cfg, args.model_config)
        if model is not None:  # the assumptions moved to the model, then the --assume overrides again on top
            moved = model_assumptions(base, model, reference_sizing(), flops_seq_len(cfg, a))
            a = parse_assumptions(args.assume, moved)
            sources.update({name: f"{how} ({model.name}), from: {sources[name]}"
                            for name, how in MOVED_TO_THE_MODEL.items()})  # fmt: skip
    sources.update({name: "--assume" for name in assumed_names(args.assume)})
    a, sources = environment_assumptions(cfg, a, sources)
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
    print(model_line)
    if stated_line:
        print(stated_line)
    if run_line:
        print(run_line)
    if not is_local(cfg):
        sized = model or reference_sizing()
        print(f"  {sized.summary()}; {sized.flops_per_token(flops_seq_len(cfg, a)):.3g} training FLOPs a token at"
              f" {flops_seq_len(cfg, a):,.0f} tokens of context")
        print("  trainer memory per GPU:")
        print("\n".join(trainer_memory_table(cfg, a, sized).lines()))
        problem = trainer_memory_problem(cfg, sized, a)
        if problem:
            print(f"  warning: {problem}; `moerl check` refuses this plan")
        engine, held = rollout_memory_table(cfg, a, sized)
        print("  rollout engine memory per GPU:")
        print("\n".join(engine.lines()))
        problem = rollout_memory_problem(cfg, sized, a)
        if problem:
            print(f"  warning: {problem}; `moerl check` refuses this plan")
        elif held < 1:
            print(f"  note: the engine's KV pool holds {held:.0%} of a chunk's sequences at full length at once: "
                  "the rest wait (lower rollout.chunk_size or group_size, or raise rollout.sglang.tp_size)")
    if args.explain:
        print("\n".join(explain_lines(a, sources)))
    print(describe(cfg, cluster, steps, a))
    print()
    print(table(results, cfg.staleness))
    if not is_local(cfg):
        sized = model or reference_sizing()
        floor = physical_floor(cfg, sized, a)
        if floor is not None:
            print("physical floor of an iteration (pipelines/simulate/floor.py):")
            print("\n".join(floor.lines(results[0].mean_iteration_s, results[1].mean_iteration_s)))
        gpus = cluster.rollout.nodes * cluster.rollout.gpus_per_node + cluster.trainer.gpus_per_node
        print("\n".join(published.lines(sized, tokens_per_iteration(cfg, a), gpus, results[0].mean_iteration_s,
                                        results[1].mean_iteration_s)))  # fmt: skip
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
    parser.add_argument(
        "--model-config", type=Path, metavar="FILE",
        help="the checkpoint's config.json (or its directory) when the run's store cannot be reached from here",
    )  # fmt: skip
    parser.add_argument(
        "--from-run", metavar="RUN_STORE",
        help="take the mean response and prompt lengths and the tied share (with an environment: the turns, a turn's "
        "fill and an observation's tokens) from a run's score metrics (file://, s3://)",
    )  # fmt: skip
    parser.add_argument(
        "--assumptions", type=Path, metavar="FILE.yaml",
        help="the workload's stated assumptions, {name: {value, source}} (default: the config's own beside it, "
        "CONFIG.assumptions.yaml, when there is one); --from-run and --assume go over them",
    )  # fmt: skip
    parser.add_argument(
        "--explain", action="store_true", help="print every assumption with its value and where it comes from",
    )  # fmt: skip
    parser.add_argument("--iterations", type=int, metavar="N", help="iterations to simulate (default: the config's)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the interruptions (default 0)")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="write a timeline of the first iterations")
    parser.set_defaults(func=main)
