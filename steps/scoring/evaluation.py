"""Held-out accuracy of a published policy version: greedy generation on the run's held-out prompts, checked
by the run's verifier.

The held-out prompts are the task's held-out split, or the prompt file's (heldout_file, else the stable-hash
split that training never sees; steps/experience/rollout_plan.py). They are encoded by the version's own tokenizer in
the
run's prompt format, exactly as rollout encodes training prompts. The score step records the accuracy for the
behaviour policy of each iteration, and the report step for the final version, so that a run shows where it
started and where it ended. `steps.engines.torch_engine.evaluate_accuracy` does the measuring, the same for every
engine.
"""

from __future__ import annotations

from typing import Any

from steps.data.tokenizer import load_tokenizer
from steps.engines.torch_engine import TorchEngine, evaluate_accuracy
from steps.experience.rollout_plan import heldout_prompts, prompt_format
from steps.run import checkpoint
from steps.run.config import RunConfig
from steps.run.keys import version_prefix
from steps.scoring.rewards import sample_verifier
from steps.store.object_store import Store

HELDOUT_EVAL_MAX_BYTES = 512 << 20


def heldout_accuracy(run: Store, cfg: RunConfig, version: int, log: Any) -> float | None:
    """Greedy held-out accuracy of `version`, or None when there is no held-out set or the model is big."""
    prompts = heldout_prompts(cfg)
    if not prompts:
        return None
    manifest = checkpoint.require_manifest(run, version)
    weight_bytes = sum(int(m["size"]) for name, m in manifest.files.items() if name.endswith(".safetensors"))
    if weight_bytes > HELDOUT_EVAL_MAX_BYTES:
        log(f"held-out accuracy skipped: {weight_bytes / 2**30:.1f} GiB of weights is too big to evaluate on CPU")
        return None
    model_dir = checkpoint.fetch(run, version)
    tokenizer = load_tokenizer(model_dir, source=run.url(version_prefix(version)))
    engine = TorchEngine.from_checkpoint(model_dir)
    verifiers = {p.task: sample_verifier(p.task, cfg.rewards.verifier, cfg.rewards.answer_pattern) for p in prompts}
    return evaluate_accuracy(
        engine, tokenizer, prompts, lambda p: verifiers[p.task], prompt_format(cfg), cfg.sampling.max_new_tokens
    )
