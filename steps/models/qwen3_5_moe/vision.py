"""Qwen3.5-MoE's vision tower as moerl carries it (steps/models/carried.py): its tensors' names under `visual.` and
their shapes, from vision_config, as transformers 5.23's Qwen3_5MoeVisionModel builds them (the release holds the
same, under `model.visual.`). moerl never runs the tower; it checks the checkpoint holds exactly these tensors and
publishes them unchanged.

Per block i < depth: norm1/norm2 (LayerNorm weight and bias [D]), attn.qkv [3D, D] + bias, attn.proj [D, D] + bias,
mlp.linear_fc1 [F, D] + bias, mlp.linear_fc2 [D, F] + bias; and patch_embed.proj (a Conv3d [D, C, T, P, P] + bias),
pos_embed [num_position_embeddings, D], merger.norm [D] (+ bias), merger.linear_fc1 [D m^2, D m^2] + bias and
merger.linear_fc2 [out_hidden_size, D m^2] + bias, with D hidden_size, F intermediate_size, C in_channels,
T temporal_patch_size, P patch_size, m spatial_merge_size.
"""

from __future__ import annotations

from typing import Any

from steps.models import config_checks as checks

# Qwen3_5MoeVisionConfig's defaults, for the sizes a vision_config may leave out
VISION_DEFAULTS: dict[str, int] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}  # fmt: skip


def vision_sizes(vision_config: dict[str, Any]) -> dict[str, int]:
    """The tower's sizes: vision_config's, else Qwen3_5MoeVisionConfig's defaults."""
    return {name: vision_config.get(name, default) for name, default in VISION_DEFAULTS.items()}


def check_vision_config(vision_config: dict[str, Any], source: str) -> None:
    """Every size a positive integer and the heads dividing hidden_size (MoerlError naming the field)."""
    sizes = vision_sizes(vision_config)
    for name, value in sizes.items():
        if not checks.is_positive_int(value):
            raise checks.invalid(source, f"{name} = {value!r} must be a positive integer")
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise checks.invalid(
            source, f"hidden_size = {sizes['hidden_size']} is not a multiple of num_heads = {sizes['num_heads']}"
        )


def vision_shapes(vision_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower, by its name under the tower (`blocks.0.attn.qkv.weight`) -> shape."""
    s = vision_sizes(vision_config)
    d, f, merged = s["hidden_size"], s["intermediate_size"], s["hidden_size"] * s["spatial_merge_size"] ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, s["in_channels"], s["temporal_patch_size"], s["patch_size"], s["patch_size"]),
        "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (s["num_position_embeddings"], d),
    }
    for i in range(s["depth"]):
        p = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            shapes[p + f"{norm}.weight"] = shapes[p + f"{norm}.bias"] = (d,)
        for name, out_dim, in_dim in (("attn.qkv", 3 * d, d), ("attn.proj", d, d), ("mlp.linear_fc1", f, d),
                                      ("mlp.linear_fc2", d, f)):  # fmt: skip
            shapes[p + f"{name}.weight"], shapes[p + f"{name}.bias"] = (out_dim, in_dim), (out_dim,)
    shapes["merger.norm.weight"] = shapes["merger.norm.bias"] = (d,)
    shapes["merger.linear_fc1.weight"], shapes["merger.linear_fc1.bias"] = (merged, merged), (merged,)
    shapes["merger.linear_fc2.weight"] = (s["out_hidden_size"], merged)
    shapes["merger.linear_fc2.bias"] = (s["out_hidden_size"],)
    return shapes
