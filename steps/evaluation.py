"""Held-out accuracy of a published policy version: greedy exact match on the run's held-out prompts.

The score step records it for the behaviour policy of each iteration, and the report step for the final
version, so that a run shows where it started and where it ended. `steps.engine.evaluate_accuracy` does the
measuring (greedy generation checked by the task's verifier), the same for every engine.
"""

from __future__ import annotations

from typing import Any

from pipelines.config import RunConfig
from steps import checkpoint
from steps.engine import TorchEngine, evaluate_accuracy
from steps.experience import heldout_prompts
from steps.store import Store

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
    engine = TorchEngine.from_checkpoint(checkpoint.fetch(run, version))
    return evaluate_accuracy(engine, None, prompts, max_new_tokens=cfg.sampling.max_new_tokens)
