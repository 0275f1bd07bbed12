"""A Qwen3.5-MoE checkpoint with one tensor per routed expert, as transformers 5.23's save_pretrained writes it (its
conversion mapping "qwen3_5_moe_text" splits the in-memory fused experts back per expert on save:
`model.language_model.layers.L.mlp.experts.{e}.{gate,up,down}_proj.weight`), rewritten on import into the released
layout, one fused tensor per weight and layer (`mlp.experts.gate_up_proj` [E, 2I, H]: per expert its gate rows,
then its up rows; `mlp.experts.down_proj` [E, H, I]), which transformers and SGLang load and moerl trains and
publishes. Its conversion in steps/models/import_conversions.py; a checkpoint in the released layout is untouched.

The rewrite streams (steps/models/checkpoint_rewrite.py): one fused tensor is filled expert by expert, written when
its shard fills, and an input file is deleted once every tensor it held has been written again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from steps.errors import MoerlError
from steps.models.checkpoint_rewrite import InputFiles, ShardWriter
from steps.models.hf_checkpoint import CONFIG_NAME, read_config_json, tensor_index
from steps.models.qwen3_5_moe.config import Qwen3_5MoeConfig
from steps.models.qwen3_5_moe.state_dict_adapter import LANGUAGE_MODEL

SHARD_BYTES = 5 * 2**30  # the output shards' size bound (one tensor larger than it is a shard of its own)
_TMP_PREFIX = ".moerl-fused-"


def per_expert_names(layer: int, expert: int) -> dict[str, str]:
    """One routed expert's tensors as save_pretrained names them: projection -> name."""
    prefix = f"{LANGUAGE_MODEL}layers.{layer}.mlp.experts.{expert}."
    return {proj: f"{prefix}{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")}


def fuse_per_expert_checkpoint(
    directory: str | os.PathLike, say: Callable[[str], None] = print, shard_bytes: int = SHARD_BYTES
) -> int:
    """Rewrite the Qwen3.5-MoE checkpoint in `directory`, in place, from per-expert tensors to the released fused
    layout; says so in one line and returns the number of layers fused (0: already fused, nothing done). A layer
    holding only some of its experts, or both layouts, or a per-expert tensor of another shape than config.json
    gives, is one MoerlError line naming the tensor and the fix, raised before anything is written."""
    directory = Path(directory)
    source = str(directory / CONFIG_NAME)
    cfg = Qwen3_5MoeConfig.from_hf_dict(read_config_json(directory), source=source)
    entries = tensor_index(directory)
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    layers = [layer for layer in range(cfg.num_hidden_layers) if per_expert_names(layer, 0)["gate_proj"] in entries]
    if not layers:
        return 0
    for layer in range(cfg.num_hidden_layers):
        fused = f"{LANGUAGE_MODEL}layers.{layer}.mlp.experts.gate_up_proj"
        if layer in layers and fused in entries:
            raise MoerlError(
                f"{entries[fused].file}: layer {layer}'s experts are stored both fused ({fused}) and per expert; "
                "keep one layout (re-save the checkpoint)"
            )
        if layer not in layers:
            continue
        for expert in range(e):
            for proj, name in per_expert_names(layer, expert).items():
                entry = entries.get(name)
                if entry is None:
                    raise MoerlError(
                        f"{directory}: tensor {name} is missing (layer {layer} stores its {e} experts one tensor "
                        "each); copy the whole checkpoint"
                    )
                if entry.shape != shapes[proj]:
                    raise MoerlError(
                        f"{entry.file}: tensor {name} has shape {list(entry.shape)}, expected {list(shapes[proj])} "
                        "from config.json; the weights do not match config.json: re-export the checkpoint"
                    )
    per_expert = {name for layer in layers for x in range(e) for name in per_expert_names(layer, x).values()}
    inputs = InputFiles(entries)
    writer = ShardWriter(directory, shard_bytes, _TMP_PREFIX)
    codes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for layer in layers:
        dtype = codes.get(entries[per_expert_names(layer, 0)["gate_proj"]].dtype, torch.float32)
        gate_up, down = torch.empty(e, 2 * inter, h, dtype=dtype), torch.empty(e, h, inter, dtype=dtype)
        for expert in range(e):
            names = per_expert_names(layer, expert)
            rows = {"gate_proj": gate_up[expert, :inter], "up_proj": gate_up[expert, inter:], "down_proj": down[expert]}
            for proj, name in names.items():
                with safe_open(entries[name].file, framework="pt") as f:
                    rows[proj].copy_(f.get_tensor(name))
        prefix = f"{LANGUAGE_MODEL}layers.{layer}.mlp.experts."
        writer.add(prefix + "gate_up_proj", gate_up)
        writer.add(prefix + "down_proj", down)
        for expert in range(e):
            for name in per_expert_names(layer, expert).values():
                inputs.consumed(name)
    for name, entry in entries.items():
        if name not in per_expert:
            with safe_open(entry.file, framework="pt") as f:
                writer.add(name, f.get_tensor(name))
            inputs.consumed(name)
    writer.finish()
    say(
        f"{directory}: fused the per-expert tensors of {len(layers)} layers into the released layout "
        "(mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]), which moerl trains and publishes"
    )
    return len(layers)
