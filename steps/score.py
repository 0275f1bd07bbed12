"""Step score: rewards and GRPO advantages for one iteration's experience, on CPU.

    python -m steps.score --run URI --iteration I [--metrics-out PATH] [--skip-heldout]

Reads every rollout chunk of the iteration's plan (each must be there exactly once and match the plan; a
missing or mismatched one is named with the shard that writes it), in canonical order (prompt_id,
sample_index); scores each sample (steps/scoring/rewards.py; the verifier's verdicts that rollout clients of
rollout servers wrote as their chunks landed are read instead of verifying those samples again,
steps/scoring/verdicts.py); writes

    <run>/experience/iter-I/scored.parquet   the rollout columns + correct, well_formed, rm_score, reward,
                                             advantage (with rollout.dynamic_sampling: the groups the update
                                             trains on, select_groups; the chunks keep them all)
    <run>/metrics/iter-I.json                reward mean/std, accuracy and format rate of the samples,
                                             response and prompt length (moerl simulate --from-run reads them),
                                             truncated share, share of groups whose rewards all tie (over every
                                             generated group), dynamic sampling's counts, and held-out greedy
                                             accuracy of the behaviour policy
    PATH (default /tmp/metrics.json)         the same metrics, for the workflow's output parameter

and then hands the metrics to the run's experiment trackers (steps/tracking/trackers.py; none by default).

Held-out accuracy (heldout_accuracy) is greedy exact match of the behaviour policy v(I-1-staleness) on
`heldout_size` prompts of the task's held-out split, run with the torch engine when its weights are small
enough to be cheap on CPU (at most HELDOUT_EVAL_MAX_BYTES); for bigger models it is left out.

Any bad input (missing chunks, a reward model that does not load, a NaN or infinite reward) ends in one
error and nothing is written. A rerun writes the same bytes again.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from steps import progress
from steps.errors import MoerlError, run_cli
from steps.experience.rollout_plan import RolloutPlan, read_rollout, version_tokenizer
from steps.experience.tables import SCORED_SCHEMA, table_bytes
from steps.run.config import load_run_config
from steps.run.keys import behaviour_version, metrics_key, scored_key
from steps.scoring.evaluation import heldout_accuracy
from steps.scoring.rewards import (
    RewardModel,
    RewardWeights,
    check_finite,
    combine,
    group_advantages,
    last_turns,
    reward_model_texts,
    select_groups,
)
from steps.scoring.user_reward import RewardFunction
from steps.scoring.verdicts import sample_verdicts
from steps.store.object_store import Store, json_text
from steps.tracking import trackers as tracking

DEFAULT_METRICS_OUT = "/tmp/metrics.json"


def user_rewards(
    spec: str, timeout_s: float, prompts: list[Any], response_texts: list[str], where: list[str]
) -> tuple[list[float], dict[str, float]]:
    """The user's reward function on every sample (steps/scoring/user_reward.py): its rewards, and the means of the
    reward and of every named value it returned, as reward_fn/<name> metrics."""
    function = RewardFunction(spec, timeout_s)
    values: list[dict[str, float]] = []
    try:
        for prompt, text, sample in zip(prompts, response_texts, where, strict=True):
            values.append(function.call(sample, prompt.content, text, prompt.answer, prompt.metadata))
    finally:
        function.close()
    names = dict.fromkeys(name for value in values for name in value)
    metrics = {f"reward_fn/{name}": float(np.mean([v[name] for v in values if name in v])) for name in names}
    return [v["reward"] for v in values], metrics


def conversation_metrics(table: pa.Table, masks: list[list[int]], env_rewards: list[float]) -> dict[str, float]:
    """A multi-turn iteration's figures: turns, the model's tokens, the environment's reward and the means of its
    named metrics (env/<name>, tool_calls included) over the conversations that reported them."""
    named: dict[str, list[float]] = {}
    for text in table.column("env_metrics").to_pylist():
        for name, value in json.loads(text).items():
            named.setdefault(name, []).append(float(value))
    return {
        "turns_mean": float(np.mean(table.column("turns").to_numpy())),
        "model_tokens_mean": float(np.mean([sum(m) for m in masks])),
        "env_reward_mean": float(np.mean(env_rewards)),
        **{f"env/{name}": float(np.mean(values)) for name, values in sorted(named.items())},
    }


def score_iteration(
    run_uri: str,
    iteration: int,
    metrics_out: str | None = DEFAULT_METRICS_OUT,
    heldout: bool = True,
    log: Any = print,
) -> dict[str, Any]:
    """Score one iteration; returns its metrics. Everything is checked before the first write."""
    started = time.monotonic()
    if iteration < 1:
        raise MoerlError(f"--iteration {iteration}: iterations count from 1")
    run = Store.open(run_uri)
    cfg = load_run_config(run)
    version = behaviour_version(iteration, cfg.staleness)
    tok = version_tokenizer(run, version)
    plan = RolloutPlan.for_iteration(cfg, iteration, version, stop_token_ids=tok.stop_ids, run=run)
    table = read_rollout(run, plan, cfg.rollout.num_shards)
    progress.report(0, 2)

    masks = table.column("loss_mask").to_pylist()
    responses = last_turns(table.column("response_ids").to_pylist(), masks)  # what is verified: the last turn
    prompt_ids = table.column("prompt_id").to_pylist()
    where = [f"prompt {p!r} sample {k}" for p, k in zip(prompt_ids, table.column("sample_index").to_pylist(),
                                                        strict=True)]  # fmt: skip
    # the verifier's verdicts the rollout clients wrote as their chunks landed, the rest verified here
    correct, well_formed, verdicts_read = sample_verdicts(run, cfg, plan, tok, table)
    if verdicts_read:
        log(f"score {iteration}: {verdicts_read} of {table.num_rows} samples verified by the rollout clients")
    by_id = {p.prompt_id: p for p in plan.prompts}
    fn_rewards, fn_metrics = None, {}
    if cfg.rewards.reward_fn or cfg.rewards.reward_model:
        response_texts = [tok.response_text(ids)[0] for ids in responses]
    if cfg.rewards.reward_fn:
        fn_rewards, fn_metrics = user_rewards(cfg.rewards.reward_fn, cfg.rewards.reward_fn_timeout_s,
                                              [by_id[p] for p in prompt_ids], response_texts, where)  # fmt: skip
    rm_scores = None
    if cfg.rewards.reward_model:
        reward_model = RewardModel.load(cfg.rewards.reward_model)
        seen = {p: tok.prompt_text(by_id[p].content, plan.prompt_format) for p in by_id}
        rm_scores = reward_model.score(reward_model_texts([seen[p] for p in prompt_ids], response_texts))
        check_finite(
            np.asarray(rm_scores, dtype=np.float64), where, what=f"reward model score ({cfg.rewards.reward_model})"
        )
    weights = RewardWeights.from_config(cfg.rewards)
    multi_turn = plan.environment is not None
    env_rewards = [float(r) for r in table.column("env_reward").to_pylist()] if multi_turn else None
    rewards = combine(correct, well_formed, rm_scores, weights, fn_rewards, env_rewards)
    check_finite(rewards, where)
    advantages, tied = group_advantages(prompt_ids, rewards, cfg.rewards.normalize_std)

    scored = table
    for name, values in (
        ("correct", correct),
        ("well_formed", well_formed),
        ("rm_score", rm_scores if rm_scores is not None else [None] * table.num_rows),
        ("reward", rewards),
        ("advantage", advantages),
    ):
        field = SCORED_SCHEMA.field(name)
        scored = scored.append_column(field, pa.array(values, type=field.type, from_pandas=False))
    scored = scored.cast(SCORED_SCHEMA)
    dynamic = None
    if cfg.rollout.dynamic_sampling:  # the update trains on the kept groups only; the chunks keep every sample
        keep, dynamic = select_groups(prompt_ids, rewards, [p.prompt_id for p in plan.prompts],
                                      cfg.prompts_per_iteration)  # fmt: skip
        scored = scored.filter(pa.array(keep))

    progress.report(1, 2)
    lengths = np.array([len(r) for r in table.column("response_ids").to_pylist()], dtype=np.float64)
    metrics: dict[str, Any] = {
        "iteration": iteration,
        "policy_version": version,
        "samples": table.num_rows,
        "prompts": len(plan.prompts),
        "group_size": plan.group_size,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "accuracy": float(np.mean(correct)),
        "format_rate": float(np.mean(well_formed)),
        "response_length_mean": float(lengths.mean()),
        "prompt_length_mean": float(np.mean(pc.list_value_length(table.column("prompt_ids")).to_numpy())),
        "truncated_fraction": float(np.mean([f == "length" for f in table.column("finish_reason").to_pylist()])),
        "tied_group_fraction": tied,
    }
    if multi_turn:
        metrics.update(conversation_metrics(table, masks, env_rewards or []))
    if dynamic is not None:
        metrics["dynamic_sampling"] = {**dynamic, "trained_samples": scored.num_rows}
    if rm_scores is not None:
        metrics["rm_score_mean"] = float(np.mean(rm_scores))
    metrics.update(fn_metrics)
    if heldout:
        evaluation_started = time.monotonic()
        accuracy = heldout_accuracy(run, cfg, version, log)
        if accuracy is not None:
            metrics["heldout_accuracy"] = accuracy
            # what the evaluation cost, apart from scoring: benchmarks take it off the training clock
            metrics["heldout_seconds"] = round(time.monotonic() - evaluation_started, 3)
    metrics["score_seconds"] = round(time.monotonic() - started, 3)

    run.put_bytes(scored_key(iteration), table_bytes(scored))
    run.put_json(metrics_key(iteration), metrics)
    if metrics_out:
        out = Path(metrics_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json_text(metrics, indent=None))
    progress.report(2, 2)
    summary = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
    log(f"score iteration {iteration}: {summary}")
    tracking.log_iteration(run, cfg, "score", iteration, metrics, log)
    return metrics


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.score", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI (file://, plain path or s3://bucket/prefix)")
    parser.add_argument("--iteration", type=int, required=True, help="RL iteration, from 1")
    parser.add_argument(
        "--metrics-out", default=DEFAULT_METRICS_OUT, help=f"local copy of the metrics (default {DEFAULT_METRICS_OUT})"
    )
    parser.add_argument("--skip-heldout", action="store_true", help="do not evaluate held-out accuracy")
    args = parser.parse_args()
    score_iteration(args.run, args.iteration, args.metrics_out, heldout=not args.skip_heldout,
                    log=lambda line: print(line, flush=True))  # fmt: skip
    return 0


if __name__ == "__main__":
    run_cli(main)
