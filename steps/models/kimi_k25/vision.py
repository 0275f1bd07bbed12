"""Kimi-K2.5's vision tower (MoonViT) and multimodal projector as moerl carries them: their tensors' names, as the
release holds them (under vision_tower. and mm_projector.), and shapes from vision_config, whose sizes the release
writes under MoonViT's own keys (vt_hidden_size, ...) and transformers 5.23's Kimi_K25VisionConfig under its own
(hidden_size, ...): either is read. moerl never runs them; it checks the checkpoint holds exactly these tensors and
publishes them unchanged.

Per block i < layers: norm0/norm1 (LayerNorm weight and bias [D]), wqkv [3D, D] + bias, wo [D, D] + bias,
mlp.fc0 [F, D] + bias, mlp.fc1 [D, F] + bias; then encoder.final_layernorm [D] + bias, patch_embed.proj (a Conv2d
[D, 3, P, P] + bias), patch_embed.pos_emb [pos height, pos width, D]; the projector's pre_norm [D] + bias, proj.0
[D m, D m] + bias and proj.2 [text hidden, D m] + bias, with m the merge kernel's area.
"""

from __future__ import annotations

from typing import Any

from steps.models import config_checks as checks

# (the release's key, transformers' key, Kimi_K25VisionConfig's default)
SIZES: dict[str, tuple[str, str, int]] = {
    "hidden": ("vt_hidden_size", "hidden_size", 1152),
    "intermediate": ("vt_intermediate_size", "intermediate_size", 4304),
    "heads": ("vt_num_attention_heads", "num_attention_heads", 16),
    "layers": ("vt_num_hidden_layers", "num_hidden_layers", 27),
    "pos_height": ("init_pos_emb_height", "pos_emb_height", 64),
    "pos_width": ("init_pos_emb_width", "pos_emb_width", 64),
    "patch": ("patch_size", "patch_size", 14),
}
IN_CHANNELS = 3  # MoonViT's patch embedding: RGB


def vision_sizes(vision_config: dict[str, Any]) -> dict[str, int]:
    """The tower's sizes: the release's keys, else transformers', else Kimi_K25VisionConfig's defaults."""
    return {name: vision_config.get(ours, vision_config.get(theirs, default))
            for name, (ours, theirs, default) in SIZES.items()}  # fmt: skip


def merge_area(vision_config: dict[str, Any]) -> Any:
    kernel = vision_config.get("merge_kernel_size", [2, 2])
    return kernel[0] * kernel[1] if isinstance(kernel, list | tuple) and len(kernel) == 2 else kernel


def check_vision_config(vision_config: dict[str, Any], source: str) -> None:
    """Every size a positive integer, the heads dividing the width, a 2-d merge kernel (MoerlError naming it)."""
    for name, value in vision_sizes(vision_config).items():
        if not checks.is_positive_int(value):
            raise checks.invalid(source, f"{SIZES[name][0]} = {value!r} must be a positive integer")
    sizes = vision_sizes(vision_config)
    if sizes["hidden"] % sizes["heads"]:
        raise checks.invalid(source, f"{SIZES['hidden'][0]} = {sizes['hidden']} is not a multiple of the heads")
    if not checks.is_positive_int(merge_area(vision_config)):
        raise checks.invalid(
            source, f"merge_kernel_size = {vision_config.get('merge_kernel_size')!r} must be two positive integers"
        )


def carried_shapes(
    vision_config: dict[str, Any], text_hidden: int, projection_hidden: int
) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower and the projector, by its release name -> shape (projection_hidden: the projector's
    pre_norm width, Kimi_K25Config.projection_hidden_size, the release's mm_hidden_size)."""
    s = vision_sizes(vision_config)
    d, f, merged = s["hidden"], s["intermediate"], s["hidden"] * merge_area(vision_config)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(s["layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            shapes[p + f"{norm}.weight"] = shapes[p + f"{norm}.bias"] = (d,)
        for name, out_dim, in_dim in (("wqkv", 3 * d, d), ("wo", d, d), ("mlp.fc0", f, d), ("mlp.fc1", d, f)):
            shapes[p + f"{name}.weight"], shapes[p + f"{name}.bias"] = (out_dim, in_dim), (out_dim,)
    shapes["vision_tower.encoder.final_layernorm.weight"] = shapes["vision_tower.encoder.final_layernorm.bias"] = (d,)
    shapes["vision_tower.patch_embed.proj.weight"] = (d, IN_CHANNELS, s["patch"], s["patch"])
    shapes["vision_tower.patch_embed.proj.bias"] = (d,)
    shapes["vision_tower.patch_embed.pos_emb.weight"] = (s["pos_height"], s["pos_width"], d)
    shapes["mm_projector.pre_norm.weight"] = shapes["mm_projector.pre_norm.bias"] = (projection_hidden,)
    shapes["mm_projector.proj.0.weight"], shapes["mm_projector.proj.0.bias"] = (merged, merged), (merged,)
    shapes["mm_projector.proj.2.weight"], shapes["mm_projector.proj.2.bias"] = (text_hidden, merged), (text_hidden,)
    return shapes
