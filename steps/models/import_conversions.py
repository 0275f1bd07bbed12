"""Checkpoints a family's publisher stores in a form moerl does not train, rewritten on import as plain float ones:
steps/import_sft.py runs `convert_on_import` on its temporary copy before it validates it. Each conversion rewrites
the directory in place, says what it did in one line, and does nothing to a checkpoint that needs nothing.

    gpt_oss      the Hub's MXFP4 experts -> bf16 (steps/models/gpt_oss/mxfp4.py); the run then trains bf16
    qwen3_5_moe  transformers' per-expert tensors -> the release's fused experts (steps/models/qwen3_5_moe/
                 fuse_experts.py)
    kimi_k25     transformers' saved names -> the release's (steps/models/kimi_k25/layout.py)
    deepseek_v4  transformers' saved names -> the release's (steps/models/deepseek_v4/layout.py)

A conversion sits here, above the loader (it uses steps/models/hf_checkpoint.py's file helpers, which ask the
registry, which lists the families' specs), not in a family's spec.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from steps.models.deepseek_v4.layout import rename_to_release_layout as deepseek_v4_release_layout
from steps.models.gpt_oss.mxfp4 import dequantize_checkpoint
from steps.models.hf_checkpoint import read_config_json
from steps.models.kimi_k25.layout import rename_to_release_layout
from steps.models.qwen3_5_moe.fuse_experts import fuse_per_expert_checkpoint

CONVERSIONS: dict[str, Callable[[Path, Callable[[str], None]], None]] = {
    "gpt_oss": dequantize_checkpoint,
    "qwen3_5_moe": fuse_per_expert_checkpoint,
    "kimi_k25": rename_to_release_layout,
    "deepseek_v4": deepseek_v4_release_layout,
}


def convert_on_import(directory: Path, say: Callable[[str], None] = print) -> None:
    """Rewrite the checkpoint in `directory` in place where its model_type has a conversion; nothing otherwise."""
    conversion = CONVERSIONS.get(read_config_json(directory).get("model_type"))
    if conversion is not None:
        conversion(directory, say)
