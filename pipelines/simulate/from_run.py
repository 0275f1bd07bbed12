"""`moerl simulate --from-run RUN_STORE`: what a run measured, in place of the assumptions of the same name.

The score step records, for every iteration, the samples' mean response and prompt lengths and the share of groups
whose rewards all tie (steps/score.py). Their mean over the last LAST_ITERATIONS scored iterations of the run sets

    response_fill      the mean response length / the simulated config's sampling.max_new_tokens (at most 1)
    prompt_tokens      the mean prompt length
    tied_group_share   the share of tied groups (what dynamic sampling generates beyond prompts_per_iteration)

and, where the simulated config has an environment and the metrics are a multi-turn run's (turns_mean and
model_tokens_mean: steps/score.py conversation_metrics), a response is a conversation after its first prompt, so

    turns              the mean model turns per conversation (turns_mean)
    response_fill      a turn's share instead: model_tokens_mean / turns_mean / sampling.max_new_tokens (at most 1)
    observation_tokens (response_length_mean - model_tokens_mean) / max(turns_mean - 1, 1): an observation's tokens

A run does not time its environment's steps: environment_step_s stays an assumption (sources.py).

Each is printed with the run and the iterations it comes from. An --assume of the same name still wins.
"""

from __future__ import annotations

from typing import Any

from steps.errors import MoerlError
from steps.run.config import RunConfig
from steps.run.keys import METRICS_KEY_PATTERN, METRICS_PREFIX
from steps.store.object_store import Store

LAST_ITERATIONS = 3  # the latest policies' lengths: responses grow or shrink as a run trains


def measured_assumptions(run_uri: str, cfg: RunConfig) -> tuple[dict[str, float], str]:
    """(assumption name -> value, the line that says what they are and where they come from) from the score
    metrics of the run at `run_uri`, for the simulated config `cfg`; one MoerlError when there are none."""
    try:
        run = Store.open(run_uri)
        keys = [k for k in run.list(METRICS_PREFIX) if METRICS_KEY_PATTERN.match(k)]
    except MoerlError:
        raise
    except Exception as err:  # noqa: BLE001  # a store error of any kind: one line, never a traceback
        raise MoerlError(f"--from-run {run_uri}: the run store cannot be read ({err})") from err
    by_iteration = {int(METRICS_KEY_PATTERN.match(k).group(1)): k for k in keys}  # type: ignore[union-attr]
    last = sorted(by_iteration)[-LAST_ITERATIONS:]
    metrics: list[dict[str, Any]] = [run.get_json(by_iteration[i]) for i in last]
    lengths = [m["response_length_mean"] for m in metrics if _number(m.get("response_length_mean"))]
    if not lengths:
        raise MoerlError(
            f"--from-run {run_uri}: no score metrics with response_length_mean under {run.url(METRICS_PREFIX)}/; "
            "point it at a run store whose score step has run"
        )
    values: dict[str, float] = {}
    response = sum(lengths) / len(lengths)
    conversations = [m for m in metrics if _number(m.get("response_length_mean")) and _number(m.get("turns_mean"))
                     and _number(m.get("model_tokens_mean")) and m["turns_mean"] > 0]  # fmt: skip
    if cfg.environment is not None and conversations:
        parts = _conversation_values(conversations, cfg, values)
    else:
        values["response_fill"] = min(1.0, response / cfg.sampling.max_new_tokens)
        parts = [f"responses {response:,.0f} tokens on average (fill {values['response_fill']:.2f} of "
                 f"{cfg.sampling.max_new_tokens:,})"]  # fmt: skip
    prompts = [m["prompt_length_mean"] for m in metrics if _number(m.get("prompt_length_mean"))]
    if prompts:
        values["prompt_tokens"] = sum(prompts) / len(prompts)
        parts.append(f"prompts {values['prompt_tokens']:,.0f} tokens")
    tied = [m["tied_group_fraction"] for m in metrics if _number(m.get("tied_group_fraction"))]
    if tied:
        values["tied_group_share"] = sum(tied) / len(tied)
        parts.append(f"{values['tied_group_share']:.0%} of groups tied")
    span = f"iteration {last[0]}" if len(last) == 1 else f"iterations {last[0]}-{last[-1]}"
    return values, f"from the run: {', '.join(parts)} ({run_uri}, score metrics of {span})"


def _conversation_values(metrics: list[dict[str, Any]], cfg: RunConfig, values: dict[str, float]) -> list[str]:
    """turns, response_fill (a turn's) and observation_tokens from multi-turn score metrics (module docstring)."""

    def mean(name: str) -> float:
        return sum(m[name] for m in metrics) / len(metrics)

    turns, own, response = mean("turns_mean"), mean("model_tokens_mean"), mean("response_length_mean")
    max_new = cfg.sampling.max_new_tokens
    values["turns"] = turns
    values["response_fill"] = min(1.0, own / turns / max_new)
    values["observation_tokens"] = max(response - own, 0.0) / max(turns - 1, 1.0)
    return [f"conversations of {turns:.2f} model turns and {response:,.0f} tokens after the prompt on average, "
            f"{own:,.0f} of them the model's (fill {values['response_fill']:.2f} of {max_new:,} a turn), "
            f"{values['observation_tokens']:,.0f} an observation"]  # fmt: skip


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
