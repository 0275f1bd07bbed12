"""The printout of `moerl simulate`: the cluster and step times it assumed, and sync vs async side by side."""

from __future__ import annotations

from pipelines.simulate.model import SimResult
from pipelines.simulate.sizing import (
    Assumptions,
    Cluster,
    StepModel,
    busiest_write_gb,
    candidate_write_s,
    chunks_per_iteration,
    conversation_turns,
    delta_gb,
    delta_write_s,
    deltas_written,
    model_tokens,
    response_tokens,
    rollout_served,
    shard_gb,
    tokens_per_iteration,
    trainer_ep_size,
)
from pipelines.simulate.state import TRAINER_SERVER
from pipelines.workflow.graph import ROLLOUT_SERVER
from steps.run.config import RunConfig


def _fmt_s(seconds: float) -> str:
    return f"{seconds:,.1f} s"


def _fmt_h(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3 * 3600 else _fmt_s(seconds)


def table(results: dict[int, SimResult], configured: int) -> str:
    """Sync and async side by side; the config's own staleness is starred."""
    columns = [0, 1]
    heads = [f"{'sync' if s == 0 else 'async'} (staleness {s}){'*' if s == configured else ''}" for s in columns]
    rows: list[tuple[str, list[str]]] = [
        ("iteration time, mean", [_fmt_s(results[s].mean_iteration_s) for s in columns]),
        ("iteration time, p50", [_fmt_s(results[s].percentile(50)) for s in columns]),
        ("iteration time, p95", [_fmt_s(results[s].percentile(95)) for s in columns]),
        ("rollout tokens/s, whole run", [f"{results[s].tokens_per_s:,.0f}" for s in columns]),
        ("rollout tokens/s, while generating", [f"{results[s].generating_tokens_per_s:,.0f}" for s in columns]),
    ]
    for pool in ("rollout", "trainer"):
        rows.append((f"{pool} pool idle", [f"{results[s].usage[pool].idle_share:.0%}" for s in columns]))
    if results[0].usage["rollout"].startup_share is not None:
        rows.append(
            ("rollout pool in engine start-up", [f"{results[s].usage['rollout'].startup_share:.0%}" for s in columns])
        )
        if results[0].server_starts.get(ROLLOUT_SERVER):
            rows.append(
                ("rollout pool updating weights", [f"{results[s].usage['rollout'].sync_share:.0%}" for s in columns])
            )
    if any(results[0].server_starts.values()):
        rows.append(
            (
                "server starts (rollout / trainer)",
                [f"{results[s].server_starts[ROLLOUT_SERVER]} / {results[s].server_starts[TRAINER_SERVER]}"
                 for s in columns],
            )
        )  # fmt: skip
    rows.append(
        ("Spot interruptions / requeues", [f"{results[s].interruptions} / {results[s].requeues}" for s in columns])
    )
    if any(results[0].server_starts.values()):
        rows.append(
            (
                "clients / servers out of retries",
                [f"{r.retries_exhausted - r.servers_out_of_retries} / {r.servers_out_of_retries}"
                 for r in (results[s] for s in columns)],
            )
        )  # fmt: skip
    else:
        rows.append(("shards out of retries", [str(results[s].retries_exhausted) for s in columns]))
    rows.append(("whole run (with start and report)", [_fmt_h(results[s].makespan) for s in columns]))
    width = max(len(label) for label, _ in rows) + 2
    col = max(max(len(h) for h in heads), 14) + 2
    lines = ["".ljust(width) + "".join(h.rjust(col) for h in heads)]
    lines += [label.ljust(width) + "".join(v.rjust(col) for v in values) for label, values in rows]
    speedup = results[0].mean_iteration_s / results[1].mean_iteration_s
    lines.append(
        f"async vs sync: {speedup:.2f}x iterations per hour "
        f"({results[0].mean_iteration_s - results[1].mean_iteration_s:+.1f} s saved per iteration)"
    )
    return "\n".join(lines)


def describe(cfg: RunConfig, cluster: Cluster, steps: StepModel, a: Assumptions) -> str:
    chunks = chunks_per_iteration(cfg, a.tied_group_share)
    per_shard = chunks / cfg.rollout.num_shards
    shard_s = steps.rollout_startup_s + per_shard * steps.rollout_chunk_s
    chunks_text = f"{per_shard:g} chunk{'' if per_shard == 1 else 's'} x {steps.rollout_chunk_s:.2f} s"
    rollout = f"rollout {shard_s:.1f} s a shard = start-up {steps.rollout_startup_s:.1f} s + {chunks_text}"
    if rollout_served(cfg):
        rollout = (f"rollout a client of a server: {chunks_text}, {steps.served_chunk_s:.2f} s of each on the "
                   f"server and {steps.verdicts_s:.2f} s verifying its samples on the client (score reads the "
                   "verdicts)")  # fmt: skip
    if cfg.environment is not None:
        env = cfg.environment
        where = ("the client's (CPU) clock, the server meanwhile serving others" if rollout_served(cfg)
                 else "the rollout step's clock")  # fmt: skip
        rollout += (f" (environment: {conversation_turns(cfg, a):g} turns, {env.workers} workers, "
                    f"environment_step_s {a.environment_step_s:g}: {steps.environment_s:.2f} s of each chunk on "
                    f"{where})")  # fmt: skip
    update = f"update {steps.update_s:.1f} s"
    if cfg.trainer.server:
        update = f"update a client of the trainer server: {steps.train_s:.1f} s on the server"
    sampled = (f"{cfg.prompts_per_iteration} prompts x {cfg.group_size} samples x {cfg.sampling.max_new_tokens} "
               f"tokens (fill {a.response_fill:g})")  # fmt: skip
    if cfg.environment is not None:
        sampled = (f"{cfg.prompts_per_iteration} prompts x {cfg.group_size} conversations x "
                   f"{conversation_turns(cfg, a):g} turns x {cfg.sampling.max_new_tokens} tokens (fill "
                   f"{a.response_fill:g} a turn{_capped(cfg, a)})")  # fmt: skip
    lines = [
        f"cluster: rollout {cluster.rollout.label}; trainer {cluster.trainer.label}; cpu: {cluster.cpu.label}",
        f"per iteration: {sampled} = "
        f"{tokens_per_iteration(cfg, a):,.0f} tokens in {chunks} chunks over {cfg.rollout.num_shards} shards",
        *environment_lines(cfg, a),
        f"step times ({steps.source}):",
        f"  {rollout}; score {steps.score_s:.1f} s; {update}; publish {steps.publish_s:.1f} s",
        f"  plan {steps.plan_s:.1f} s; import-sft {steps.import_sft_s:.1f} s; report {steps.report_s:.1f} s",
        f"  the update writes its candidate ({a.checkpoint_gb:,.4g} GB of weights + {a.optimizer_gb:,.4g} GB of AdamW "
        f"state, ep {trainer_ep_size(cfg, a)}: each EP rank's files written by its dp replicas, spread over the "
        f"nodes); the busiest of {cfg.trainer.nodes} node(s) writes {busiest_write_gb(cfg, a):.1f} GB at "
        f"{a.s3_gb_per_s:g} GB/s: {candidate_write_s(cfg, a):.1f} s in the update's figure",
    ]
    lines += served_lines(cfg, steps, a)
    if cluster.local:
        lines.append(
            "note: on this machine overlapping steps share its cores and the model does not slow them down: "
            "measure staleness 1 for its real gain here"
        )
    return "\n".join(lines)


def _capped(cfg: RunConfig, a: Assumptions) -> str:
    whole = conversation_turns(cfg, a) * cfg.sampling.max_new_tokens * a.response_fill
    if model_tokens(cfg, a) < whole:
        return f", {model_tokens(cfg, a):,.0f} a conversation under environment.max_total_tokens"
    return ""


def environment_lines(cfg: RunConfig, a: Assumptions) -> list[str]:
    """A config with an environment: its turns, steps and workers, and what the trainer runs (nothing without)."""
    env = cfg.environment
    if env is None:
        return []
    turns = conversation_turns(cfg, a)
    conversations = cfg.rollout.chunk_size * cfg.group_size
    per_turn = -(-conversations // env.workers)
    return [
        f"  environment: {turns:g} turns a conversation (environment.max_turns {env.max_turns}); each turn a chunk's "
        f"{conversations:,} conversations step over {env.workers} workers: {per_turn:,} x environment_step_s "
        f"{a.environment_step_s:g} s, observations prefilled (not decoded)",
        f"  the trainer runs {response_tokens(cfg, a):,.0f} tokens a conversation after its prompt: the model's "
        f"{model_tokens(cfg, a):,.0f} and {max(turns - 1, 0):g} observations of {a.observation_tokens:g} tokens "
        f"(at most environment.max_total_tokens {env.max_total_tokens:,})",
    ]


def served_lines(cfg: RunConfig, steps: StepModel, a: Assumptions) -> list[str]:
    """How engines that stay up are modelled, with their figures (nothing for today's shape)."""
    lines = []
    if rollout_served(cfg):
        fetched = f"delta {delta_gb(a):g} GB (delta_fraction {a.delta_fraction:g})" if cfg.checkpoint.deltas else (
            f"whole checkpoint {a.checkpoint_gb:,.4g} GB (checkpoint.deltas false)")  # fmt: skip
        lines += [
            f"rollout servers: {cfg.rollout.servers} a segment, start-up {steps.rollout_startup_s:.1f} s once a "
            f"segment and once a replacement; rollout steps are clients ({steps.client_s:.1f} s to start)",
            f"  per new version a server fetches the {fetched} at {a.s3_gb_per_s:g} GB/s and applies it in place "
            f"({a.checkpoint_gb:,.4g} GB from local disk at {a.nvme_gb_per_s:g} GB/s + {a.engine_update_s:g} s): "
            f"{steps.weight_sync_s:.1f} s; any other version {steps.full_sync_s:.1f} s",
        ]
        if deltas_written(cfg):
            largest = max(s["weights"] for s in shard_gb(cfg, a))
            lines.append(
                f"  the writer of each weight file writes its delta against the v(i-1) bits it holds (its threads at "
                f"{a.delta_encode_gb_per_s:g} GB/s x {a.delta_encode_speedup:g}, the largest file {largest:.1f} GB; "
                f"{delta_gb(a):g} GB in all): +{delta_write_s(cfg, a):.1f} s on the candidate's write; the update "
                "indexes it"
            )
    if cfg.trainer.server:
        lines.append(
            f"trainer server: start-up {steps.trainer_startup_s:.1f} s once a segment and once a restart; per "
            f"update {steps.train_s:.1f} s until it answers (train, write the weights: {steps.weights_write_s:.1f} s), "
            f"then the optimizer shards {steps.optimizer_write_s:.1f} s beside the next update (the segment's last "
            f"update writes them before it answers); its update step a client ({steps.client_s:.1f} s to start)"
        )
    return lines
