"""gpt-oss's MXFP4 checkpoints (the Hub's openai/gpt-oss-20b and -120b) dequantized to bf16 on import: its
conversion in steps/models/import_conversions.py, which steps/import_sft.py runs on its temporary copy before
validating it, so that validation, v000000 and training see a plain bf16 checkpoint.

The format, as transformers 5.23 reads it (integrations/mxfp4.py; quantizers/quantizer_mxfp4.py maps the
checkpoint's `{proj}_blocks` and `{proj}_scales` onto the model's `{proj}`): config.json says
`quantization_config: {"quant_method": "mxfp4", ...}`, and each layer's two fused expert weights W [E, K, N] as the
model holds them (gate_up_proj: K = hidden_size, N = 2 * intermediate_size; down_proj: K = intermediate_size,
N = hidden_size) are stored transposed, each of the E * N rows of K values cut into blocks of 32:
`model.layers.L.mlp.experts.{proj}_blocks` uint8 [E, N, K/32, 16] (a block's 32 FP4 E2M1 codes, two a byte, the
low nibble first) and `{proj}_scales` uint8 [E, N, K/32] (a block's E8M0 exponent, biased by 127). A value is
FP4_VALUES[code] * 2 ** (scale - 127). The biases, the router, attention and embeddings are stored unquantized
(bf16 on the Hub).

The arithmetic is transformers' own convert_moe_packed_tensors (its table lookup, ldexp in bf16, the transpose back
to [E, K, N]), what transformers runs when it loads these checkpoints with Mxfp4Config(dequantize=True): called one
expert at a time (it is elementwise, so the bits are those of a whole-tensor call), so that moerl's bf16 experts
are transformers' bit for bit. The rewrite streams: one expert's blocks at a time are read, one fused bf16 tensor
at a time is built, output shards are written as they fill, and an input file is deleted once every tensor it held
has been written again, so memory stays near a shard and disk near the bf16 checkpoint's size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from steps.errors import MoerlError
from steps.models.checkpoint_rewrite import SHARD_BYTES, InputFiles, ShardWriter
from steps.models.gpt_oss.config import GptOssConfig
from steps.models.hf_checkpoint import (
    CONFIG_NAME,
    TensorEntry,
    read_config_json,
    tensor_index,
)
from steps.models.moe import kept_in_float32

QUANT_METHOD = "mxfp4"
PROJECTIONS = ("gate_up_proj", "down_proj")  # the expert weights the Hub's checkpoints quantize (not the biases)
BLOCK = 32  # values per block (one scale each); 16 bytes
DTYPE = torch.bfloat16
DTYPE_NAME = "bfloat16"
CAST_TO_BF16 = ("F32", "F16")  # unquantized tensors stored in these are cast to bf16 with the experts
CONVERTER = "transformers' convert_moe_packed_tensors"
_TMP_PREFIX = ".moerl-dequantized-"


def packed_shapes(cfg: GptOssConfig, proj: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of one layer's MXFP4 `proj` (gate_up_proj or down_proj) for config `cfg`."""
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    rows, k = (2 * i, h) if proj == "gate_up_proj" else (h, i)
    return (e, rows, k // BLOCK, BLOCK // 2), (e, rows, k // BLOCK)


def dequantize(blocks: Any, scales: Any) -> torch.Tensor:
    """One fused expert weight [E, K, N] in bf16 from its MXFP4 blocks [E, N, K/32, 16] and scales [E, N, K/32]
    (tensors, or safetensors slices: then only one expert's rows are in memory at a time): transformers'
    convert_moe_packed_tensors, one expert at a time."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    e, n, groups, _ = blocks.get_shape() if hasattr(blocks, "get_shape") else blocks.shape
    out = torch.empty(e, groups * BLOCK, n, dtype=DTYPE)
    for x in range(e):
        out[x] = convert_moe_packed_tensors(blocks[x : x + 1], scales[x : x + 1], dtype=DTYPE)[0]
    return out


def _quantization(d: dict[str, Any], source: str) -> bool:
    """Whether config.json dict `d` declares MXFP4 weights; one MoerlError line for any other quantization."""
    quant = d.get("quantization_config")
    if not quant:
        return False
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != QUANT_METHOD:
        raise MoerlError(
            f"{source}: quantization_config.quant_method = {method!r} is not supported by moerl (its import "
            f"dequantizes gpt-oss's MXFP4 experts only); dequantize the checkpoint with the library that quantized "
            "it and save it in bf16 (model.to(torch.bfloat16).save_pretrained(dir)), then import that"
        )
    return True


def _packed_pairs(
    cfg: GptOssConfig, entries: dict[str, TensorEntry], directory: Path, source: str
) -> dict[str, tuple[str, str]]:
    """fused expert tensor name -> (its blocks' name, its scales' name) for every MXFP4 pair the checkpoint holds,
    each checked against the config: uint8, the shapes packed_shapes gives, blocks and scales both there, and not
    beside the float tensor they stand for. One MoerlError line naming the file otherwise."""
    for size in ("hidden_size", "intermediate_size"):
        if getattr(cfg, size) % BLOCK:
            raise MoerlError(
                f"{source}: {size} = {getattr(cfg, size)} is not a multiple of {BLOCK}, which MXFP4 experts need; "
                "the weights do not match config.json: fix config.json or re-download the checkpoint"
            )
    pairs: dict[str, tuple[str, str]] = {}
    for layer in range(cfg.num_hidden_layers):
        for proj in PROJECTIONS:
            fused = f"model.layers.{layer}.mlp.experts.{proj}"
            names = (f"{fused}_blocks", f"{fused}_scales")
            present = [name for name in names if name in entries]
            if not present:
                continue  # stored unquantized (or missing: validation says so)
            if len(present) == 1:
                missing = (set(names) - set(present)).pop()
                raise MoerlError(
                    f"{directory}: tensor {missing} is missing beside {present[0]} (MXFP4 blocks come with their "
                    "scales); copy the whole checkpoint"
                )
            if fused in entries:
                raise MoerlError(
                    f"{entries[fused].file}: tensor {fused} is stored both unquantized and as MXFP4 ({names[0]}); "
                    "keep one of them"
                )
            for name, shape in zip(names, packed_shapes(cfg, proj), strict=True):
                entry = entries[name]
                if entry.dtype != "U8":
                    raise MoerlError(
                        f"{entry.file}: tensor {name} has dtype {entry.dtype}; MXFP4 blocks and scales are U8: "
                        "re-download the checkpoint"
                    )
                if entry.shape != shape:
                    raise MoerlError(
                        f"{entry.file}: tensor {name} has shape {list(entry.shape)}, expected {list(shape)} for "
                        f"MXFP4 experts of config.json (num_local_experts {cfg.num_local_experts}, hidden_size "
                        f"{cfg.hidden_size}, intermediate_size {cfg.intermediate_size}); the weights do not match "
                        "config.json: fix config.json or re-download the checkpoint"
                    )
            pairs[fused] = names
    return pairs


def dequantize_checkpoint(
    directory: str | os.PathLike, say: Callable[[str], None] = print, shard_bytes: int = SHARD_BYTES
) -> int:
    """Rewrite the gpt-oss checkpoint in `directory`, in place, from MXFP4 experts to a plain bf16 checkpoint: each
    `{proj}_blocks` / `{proj}_scales` pair becomes the fused bf16 `{proj}` [E, K, N] (dequantize), every other F32
    or F16 tensor is cast to bf16, and config.json loses its quantization_config and declares dtype bfloat16. Says
    so in one line and returns the number of expert tensors dequantized; a checkpoint without a
    quantization_config is left untouched (0). Any other quantization, or blocks and scales that do not match
    config.json, is one MoerlError line naming the file and the fix, raised before anything is written. Input
    weight files are deleted as they are consumed: a rewrite that fails midway leaves the directory unusable
    (the import's temporary copy)."""

    directory = Path(directory)
    source = str(directory / CONFIG_NAME)
    d = read_config_json(directory)
    if not _quantization(d, source):
        return 0
    plain = {k: v for k, v in d.items() if k != "quantization_config"}
    cfg = GptOssConfig.from_hf_dict(plain, source=source)
    entries = tensor_index(directory)
    pairs = _packed_pairs(cfg, entries, directory, source)

    packed_names = {name: fused for fused, names in pairs.items() for name in names}
    inputs = InputFiles(entries)
    consumed = inputs.consumed
    writer = ShardWriter(directory, shard_bytes, _TMP_PREFIX)
    cast: dict[str, int] = {}
    for name, entry in entries.items():  # by file, then by name
        if name in packed_names:
            fused = packed_names[name]
            blocks, scales = pairs[fused]
            if name != blocks:
                continue  # written with its blocks
            with safe_open(entry.file, framework="pt") as fb, safe_open(entries[scales].file, framework="pt") as fs:
                tensor = dequantize(fb.get_slice(blocks), fs.get_slice(scales))
            writer.add(fused, tensor)
            consumed(blocks)
            consumed(scales)
            continue
        with safe_open(entry.file, framework="pt") as f:
            tensor = f.get_tensor(name)
        if entry.dtype in CAST_TO_BF16 and not kept_in_float32(name):
            tensor = tensor.to(DTYPE)
            cast[entry.dtype] = cast.get(entry.dtype, 0) + 1
        writer.add(name, tensor)
        consumed(name)
    writer.finish()

    plain.update(dtype=DTYPE_NAME, torch_dtype=DTYPE_NAME)
    (directory / CONFIG_NAME).write_text(json.dumps(plain, indent=2) + "\n")
    casts = "".join(f", cast {n} other {code} tensors to bf16" for code, n in sorted(cast.items()))
    say(
        f"{directory}: dequantized {len(pairs)} MXFP4 expert tensors to bf16 with {CONVERTER}{casts}; the run "
        f"trains and publishes {DTYPE_NAME} (every version keeps v000000's dtype)"
    )
    return len(pairs)
