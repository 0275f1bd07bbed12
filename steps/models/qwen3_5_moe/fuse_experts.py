"""A Qwen3.5-MoE checkpoint with one tensor per routed expert, as transformers 5.23's save_pretrained writes it (its
conversion mapping "qwen3_5_moe_text" splits the in-memory fused experts back per expert on save:
`model.language_model.layers.L.mlp.experts.{e}.{gate,up,down}_proj.weight`), rewritten on import into the released
layout, one fused tensor per weight and layer (`mlp.experts.gate_up_proj` [E, 2I, H]: per expert its gate rows,
then its up rows; `mlp.experts.down_proj` [E, H, I]), which transformers and SGLang load and moerl trains and
publishes. Its conversion in steps/models/import_conversions.py; a checkpoint in the released layout is untouched.

The rewrite streams (steps/models/checkpoint_rewrite.py), layer by layer: a layer's fused tensors are filled expert by
expert, then the layer's other tensors follow, so that an input file (save_pretrained shards by layer) is deleted as
soon as every tensor it held has been written again: disk stays near the checkpoint's size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from steps.errors import MoerlError
from steps.models.checkpoint_rewrite import SHARD_BYTES, InputFiles, ShardWriter
from steps.models.hf_checkpoint import CONFIG_NAME, SAFETENSORS_FLOAT_DTYPES, read_config_json, tensor_index
from steps.models.qwen3_5_moe.config import Qwen3_5MoeConfig
from steps.models.qwen3_5_moe.state_dict_adapter import LANGUAGE_MODEL

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
                first = entries[per_expert_names(layer, 0)["gate_proj"]].dtype
                if entry.dtype != first or entry.dtype not in SAFETENSORS_FLOAT_DTYPES:
                    raise MoerlError(
                        f"{entry.file}: tensor {name} has dtype {entry.dtype} beside {first}; the experts are fused "
                        f"in one of {sorted(SAFETENSORS_FLOAT_DTYPES)}: re-save the checkpoint in one dtype"
                    )
    per_expert = {name for layer in layers for x in range(e) for name in per_expert_names(layer, x).values()}
    inputs = InputFiles(entries)
    writer = ShardWriter(directory, shard_bytes, _TMP_PREFIX)

    def write_others(prefix: str | None) -> None:
        """The tensors other than the per-expert ones, under `prefix` (None: all that remain), so that an input
        file is deleted as soon as the layers it holds are written (save_pretrained shards by layer)."""
        for name, entry in entries.items():
            if name in per_expert or name in written or (prefix is not None and not name.startswith(prefix)):
                continue
            with safe_open(entry.file, framework="pt") as f:
                writer.add(name, f.get_tensor(name))
            written.add(name)
            inputs.consumed(name)

    written: set[str] = set()
    for layer in layers:
        dtype = SAFETENSORS_FLOAT_DTYPES[entries[per_expert_names(layer, 0)["gate_proj"]].dtype]
        gate_up, down = torch.empty(e, 2 * inter, h, dtype=dtype), torch.empty(e, h, inter, dtype=dtype)
        by_file: dict[Path, list[tuple[int, str, str]]] = {}
        for expert in range(e):
            for proj, name in per_expert_names(layer, expert).items():
                by_file.setdefault(entries[name].file, []).append((expert, proj, name))
        for file, tensors in by_file.items():  # one open of each file a layer's experts are in
            with safe_open(file, framework="pt") as f:
                for expert, proj, name in tensors:
                    rows = {"gate_proj": gate_up[expert, :inter], "up_proj": gate_up[expert, inter:],
                            "down_proj": down[expert]}  # fmt: skip
                    rows[proj].copy_(f.get_tensor(name))
        prefix = f"{LANGUAGE_MODEL}layers.{layer}."
        writer.add(prefix + "mlp.experts.gate_up_proj", gate_up)
        writer.add(prefix + "mlp.experts.down_proj", down)
        for _, _, name in (t for tensors in by_file.values() for t in tensors):
            inputs.consumed(name)
        write_others(prefix)
    write_others(None)
    writer.finish()
    say(
        f"{directory}: fused the per-expert tensors of {len(layers)} layers into the released layout "
        "(mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]), which moerl trains and publishes"
    )
    return len(layers)
