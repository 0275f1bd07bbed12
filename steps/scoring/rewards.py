"""Rewards on CPU: the verifiers, the user's reward function, a reward model, their weighted sum, and GRPO
advantages.

    reward = exact_match_weight * correct + format_weight * well_formed
             + reward_fn_weight * reward_fn + reward_model_weight * rm_score

correct / well_formed come from the sample's verifier (`sample_verifier`: rewards.verifier, else a built-in
task's own, else exact; the response ends at its first stop token, and one that never ended is neither).
reward_fn is the user's function (steps/scoring/user_reward.py). rm_score is the single logit of a transformers
sequence-classification checkpoint on the text the policy saw (the prompt as formatted: raw, or through the
chat template) followed by the response text.

GRPO advantages, per group (the samples of one prompt): advantage = reward - mean(group rewards), divided by
(std(group rewards) + eps) when normalize_std; std is the population std (ddof 0), so a group whose rewards
all tie gets advantage 0 and no gradient, and a group of one sample too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from steps.data.prompt_data import PROMPT_FILE_TASK
from steps.data.tasks import Task, get_task, verify_ids
from steps.data.tokenizer import CheckpointTokenizer
from steps.data.verifiers import ExactVerifier, Verifier, get_verifier
from steps.errors import MoerlError
from steps.models.checkpoint_validation import refuse_pickled
from steps.store.object_store import Store

if TYPE_CHECKING:
    from steps.run.config import RewardsConfig

ADVANTAGE_EPS = 1e-6


@dataclass(frozen=True)
class RewardWeights:
    """A sample's reward is the weighted sum of its verdicts and scores (combine); `<name>` is weighted by the
    run config's `rewards.<name>_weight`."""

    exact_match: float = 1.0
    format: float = 0.1
    reward_model: float = 0.0
    reward_fn: float = 1.0
    environment: float = 1.0

    @classmethod
    def from_config(cls, rewards: RewardsConfig) -> RewardWeights:
        """The `*_weight` fields of the run's `rewards` section, by name."""
        return cls(**{k.removesuffix("_weight"): v for k, v in dict(rewards).items() if k.endswith("_weight")})


def sample_verifier(task_name: str, verifier: str | None = None, answer_pattern: str | None = None) -> Verifier | Task:
    """What checks a sample of `task_name`: the run's rewards.verifier when set, else a built-in task's own
    verifier, else (a prompt file) exact match."""
    if verifier is not None:
        return get_verifier(verifier, answer_pattern)
    if task_name == PROMPT_FILE_TASK:
        return ExactVerifier()
    return get_task(task_name)


def verify_samples(
    tok: CheckpointTokenizer,
    tasks: Sequence[str],
    answers: Sequence[str],
    responses: Sequence[Sequence[int]],
    verifier: str | None = None,
    answer_pattern: str | None = None,
) -> tuple[list[bool], list[bool]]:
    """(correct, well_formed) of each sample, by its verifier (sample_verifier)."""
    verifiers: dict[str, Verifier | Task] = {}
    correct, well_formed = [], []
    for task_name, answer, response in zip(tasks, answers, responses, strict=True):
        if task_name not in verifiers:
            verifiers[task_name] = sample_verifier(task_name, verifier, answer_pattern)
        verdict = verify_ids(verifiers[task_name], tok, list(response), answer)  # type: ignore[arg-type]
        correct.append(verdict.correct)
        well_formed.append(verdict.well_formed)
    return correct, well_formed


def combine(
    correct: Sequence[bool],
    well_formed: Sequence[bool],
    rm_scores: Sequence[float] | None,
    weights: RewardWeights,
    fn_rewards: Sequence[float] | None = None,
    env_rewards: Sequence[float] | None = None,
) -> np.ndarray:
    """The weighted sum per sample, float64 (NaN or inf pass through: check_finite reports them)."""
    with np.errstate(invalid="ignore", over="ignore"):
        rewards = weights.exact_match * np.asarray(correct, dtype=np.float64)
        rewards += weights.format * np.asarray(well_formed, dtype=np.float64)
        if fn_rewards is not None:
            rewards += weights.reward_fn * np.asarray(fn_rewards, dtype=np.float64)
        if env_rewards is not None:
            rewards += weights.environment * np.asarray(env_rewards, dtype=np.float64)
        if rm_scores is not None:
            rewards += weights.reward_model * np.asarray(rm_scores, dtype=np.float64)
    return rewards


def last_turns(responses: Sequence[Sequence[int]], masks: Sequence[Sequence[int] | None]) -> list[list[int]]:
    """What the verifier, the reward function and the reward model read of each sample: the whole response, or a
    conversation's last model turn (the last run of ones in its loss mask: steps/environments/conversation.py)."""
    out = []
    for response, mask in zip(responses, masks, strict=True):
        if mask is None:
            out.append(list(response))
            continue
        end = max(i for i, m in enumerate(mask) if m) + 1
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        out.append(list(response[start:end]))
    return out


def check_finite(rewards: np.ndarray, where: Sequence[str], what: str = "reward") -> None:
    """One MoerlError naming the first sample whose value is NaN or infinite (and how many there are)."""
    bad = np.flatnonzero(~np.isfinite(rewards))
    if bad.size:
        first = int(bad[0])
        raise MoerlError(
            f"{what} of {where[first]} is {rewards[first]} ({bad.size} non-finite in all); nothing was written. "
            "Check the reward model (its outputs must be finite) and the reward weights in the run config"
        )


def group_advantages(
    group_ids: Sequence[str], rewards: np.ndarray, normalize_std: bool, eps: float = ADVANTAGE_EPS
) -> tuple[np.ndarray, float]:
    """GRPO advantages (see module docstring) and the share of groups whose rewards all tie."""
    advantages = np.zeros_like(rewards, dtype=np.float64)
    members: dict[str, list[int]] = {}
    for row, group in enumerate(group_ids):
        members.setdefault(group, []).append(row)
    tied = tied_groups(group_ids, rewards)
    for group, rows in members.items():
        values = rewards[rows]
        centred = values - values.mean()
        if group in tied:
            centred[:] = 0.0  # exactly zero, not rounding noise of the mean
        elif normalize_std:
            centred /= values.std() + eps
        advantages[rows] = centred
    return advantages, len(tied) / max(len(members), 1)


def tied_groups(group_ids: Sequence[str], rewards: np.ndarray) -> set[str]:
    """The groups whose samples all got the same reward (group_advantages' tie: advantage exactly 0)."""
    first: dict[str, float] = {}
    mixed: set[str] = set()
    for group, reward in zip(group_ids, rewards.tolist(), strict=True):
        if first.setdefault(group, reward) != reward:
            mixed.add(group)
    return set(first) - mixed


def select_groups(
    group_ids: Sequence[str], rewards: np.ndarray, plan_order: Sequence[str], keep: int
) -> tuple[np.ndarray, dict[str, int]]:
    """Dynamic sampling (DAPO, Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    section 3.2: keep sampling until the batch is filled with groups whose accuracy is neither 0 nor 1; verl's
    filter_groups, slime's dynamic_sampling_filter): the first `keep` groups in plan order whose rewards are not all
    equal. When fewer are mixed, the batch is topped up with the first tied groups in plan order (advantage 0: they
    move no weight, and the update keeps prompts_per_iteration groups). Returns the row mask of the kept groups and
    the counts (generated, mixed, trained mixed, trained tied, unused mixed groups)."""
    tied = tied_groups(group_ids, rewards)
    mixed_order = [g for g in plan_order if g not in tied]
    kept = set(mixed_order[:keep])
    filled = [g for g in plan_order if g in tied][: max(keep - len(kept), 0)]
    kept.update(filled)
    mask = np.array([g in kept for g in group_ids], dtype=bool)
    counts = {
        "generated_groups": len(plan_order),
        "mixed_groups": len(mixed_order),
        "trained_mixed_groups": min(len(mixed_order), keep),
        "trained_tied_groups": len(filled),
        "unused_mixed_groups": max(len(mixed_order) - keep, 0),
    }
    return mask, counts


class RewardModel:
    """A transformers AutoModelForSequenceClassification checkpoint (safetensors) scored offline on CPU."""

    def __init__(self, model: object, tokenizer: object, uri: str) -> None:
        self.model, self.tokenizer, self.uri = model, tokenizer, uri

    @classmethod
    def load(cls, uri: str) -> RewardModel:
        """Download the checkpoint from its store URI and load it with transformers, offline."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub, whatever the files say
        source = Store.open(uri)
        names = source.list()
        if not names:
            raise MoerlError(
                f"reward model {uri}: no files there; rewards.reward_model must name a transformers "
                "sequence-classification checkpoint directory (config.json, *.safetensors, tokenizer files)"
            )
        refuse_pickled(names, f"reward model {uri}")
        local = Path(tempfile.mkdtemp(prefix="moerl-reward-model-"))
        source.download_dir("", local)
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            model = AutoModelForSequenceClassification.from_pretrained(
                local, local_files_only=True, use_safetensors=True, dtype=torch.float32
            )
            tokenizer = AutoTokenizer.from_pretrained(local, local_files_only=True)
        except Exception as err:  # transformers raises many kinds: OSError, ValueError, KeyError, ...
            raise MoerlError(
                f"reward model {uri}: cannot be loaded ({type(err).__name__}: {str(err)[:300]}); it must be a "
                "transformers sequence-classification checkpoint saved with save_pretrained (safetensors) "
                "together with its tokenizer"
            ) from err
        if model.config.num_labels != 1:
            raise MoerlError(
                f"reward model {uri}: has {model.config.num_labels} labels; a reward model outputs one score "
                "(num_labels 1)"
            )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        model.config.pad_token_id = tokenizer.pad_token_id
        return cls(model.eval(), tokenizer, uri)

    def score(self, texts: Sequence[str], batch_size: int = 32) -> list[float]:
        """One score per text: the model's single logit."""
        import torch

        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = list(texts[start : start + batch_size])
                inputs = self.tokenizer(batch, return_tensors="pt", padding=True)  # type: ignore[operator]
                logits = self.model(**inputs).logits  # type: ignore[operator]
                scores.extend(float(x) for x in logits[:, 0].float())
        return scores


def reward_model_texts(prompt_texts: Sequence[str], response_texts: Sequence[str]) -> list[str]:
    """What the reward model reads: the text the policy saw (the formatted prompt) followed by the response."""
    return [prompt + response for prompt, response in zip(prompt_texts, response_texts, strict=True)]
