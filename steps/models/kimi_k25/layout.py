"""A Kimi-K2.5 checkpoint as transformers 5.23's save_pretrained writes it, renamed on import to the release's layout,
which transformers, SGLang and moerl read. transformers' conversion mapping "kimi_k25" renames the release's tensors
when it loads them (language_model.model -> model.language_model, a vision block's blocks -> layers, ...) and saves
by reversing those renames one by one, which turns three groups into names the release never had:
language_model.model.blocks.N (the vision tower's blocks -> layers reversed on the language model's layers too),
model.mm_projector.pre_norm, vision_tower.encoder.patch_embed. They are renamed back (RENAMES); the tensors are
unchanged. Its config.json names the architecture by transformers' class, Kimi_K25ForConditionalGeneration, which
SGLang 0.5.17 does not register: it gets the release's name, KimiK25ForConditionalGeneration (SGLang's, and what
moerl writes); and its vision_config holds transformers' size keys only, where SGLang's projector reads the
release's (vt_hidden_size, text_hidden_size, mm_hidden_size: models/kimi_k25.py:604, :615): they are added, with
the same values. Its conversion in steps/models/import_conversions.py; a checkpoint in the release's layout is
untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from steps.models.checkpoint_rewrite import SHARD_BYTES, rename_tensors
from steps.models.hf_checkpoint import CONFIG_NAME, read_config_json
from steps.models.kimi_k25.config import ARCHITECTURE

_TMP_PREFIX = ".moerl-renamed-"
TRANSFORMERS_ARCHITECTURE = "Kimi_K25ForConditionalGeneration"  # transformers 5.23's class name
# transformers' vision_config key -> the release's (what SGLang's projector reads)
RELEASE_VISION_KEYS = (
    ("hidden_size", "vt_hidden_size"),
    ("intermediate_size", "vt_intermediate_size"),
    ("num_attention_heads", "vt_num_attention_heads"),
    ("num_hidden_layers", "vt_num_hidden_layers"),
)
# transformers 5.23's saved prefix -> the release's
RENAMES = (
    ("language_model.model.blocks.", "language_model.model.layers."),
    ("model.mm_projector.", "mm_projector."),
    ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
)


def release_name(name: str) -> str:
    for saved, released in RENAMES:
        if name.startswith(saved):
            return released + name.removeprefix(saved)
    return name


def rename_to_release_layout(
    directory: str | os.PathLike, say: Callable[[str], None] = print, shard_bytes: int = SHARD_BYTES
) -> int:
    """Rewrite the checkpoint in `directory` in place under the release's names (and config.json's architecture);
    says so in one line and returns the number of tensors renamed (0: already the release's layout)."""
    directory = Path(directory)
    config = read_config_json(directory)
    if config.get("architectures") == [TRANSFORMERS_ARCHITECTURE]:
        config["architectures"] = [ARCHITECTURE]
        vision, text = config.get("vision_config"), config.get("text_config")
        if isinstance(vision, dict) and isinstance(text, dict):
            released = {release_key: vision[key] for key, release_key in RELEASE_VISION_KEYS if key in vision}
            released["text_hidden_size"] = text.get("hidden_size")
            released["mm_hidden_size"] = config.get("projection_hidden_size", vision.get("hidden_size"))
            config["vision_config"] = {**released, **vision}  # a key the config already has keeps its value
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        say(
            f"{directory}: config.json as the release writes it (architectures {ARCHITECTURE}, vision_config's "
            "vt_* sizes beside transformers' keys)"
        )
    renamed = rename_tensors(directory, release_name, shard_bytes, _TMP_PREFIX)
    if renamed:
        say(f"{directory}: renamed {renamed} tensors from transformers' saved layout to the Kimi-K2.5 release's")
    return renamed
