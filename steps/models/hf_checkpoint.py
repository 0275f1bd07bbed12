"""Policy checkpoints in Hugging Face format, safetensors only, for every family: what a checkpoint holds, its
validation from config.json and the tensor headers alone, loading (all of it, or one expert-parallel rank's
experts) and saving. What is a family's own (its config, its tensor names, its model) this module asks the family
(steps/models/registry.py) for.

A checkpoint directory is what transformers' `save_pretrained` writes: config.json, generation_config.json and
model.safetensors (or model-0000i-of-0000n.safetensors shards and model.safetensors.index.json), with per-expert
tensor names. Pickle weights are refused, never read.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from steps.errors import MoerlError
from steps.models.family import dtype_name
from steps.models.moe import kept_as_integers, kept_in_float32, stored_dtype
from steps.models.placement import check_placement, is_expert_param
from steps.models.registry import config_from_hf, family_of, resolve

if TYPE_CHECKING:
    from torch import nn

    from steps.models.family import FusedExperts
    from steps.models.placement import ExpertPlacement

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
META_BUILD_MIN_PARAMS = 50_000_000  # see load_pretrained
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
SAFETENSORS_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
SAFETENSORS_INTEGER_DTYPES = ("I64", "I32")  # an integer table's (steps/models/moe.py kept_as_integers)
SAFETENSORS_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}  # an element's, of every dtype above
CONFIG_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """<directory>/config.json as a dict (not validated)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise MoerlError(
            f"{directory}: no {CONFIG_NAME}; a model checkpoint is a Hugging Face model directory "
            "(config.json + *.safetensors, as save_pretrained writes it)"
        )
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MoerlError(f"{path}: not valid JSON ({err}); fix or re-export the config") from err
    if not isinstance(d, dict):
        raise MoerlError(f"{path}: expected a JSON object; fix or re-export the config")
    return d


def load_config(directory: str | os.PathLike) -> Any:
    """Read and validate <directory>/config.json: its family's config (steps/models/registry.py)."""
    d = read_config_json(directory)
    return config_from_hf(d, source=str(Path(directory) / CONFIG_NAME))


# Config fields that neither the tensors' shapes nor a forward pass nor serving depend on: training-only
# knobs and token ids that no engine reads (generation stops on the tokenizer's stop ids, steps/engines/interface.py;
# eos_token_id stays in: SGLang also stops at the eos it read at start-up unless ignore_eos).
NOT_ARCHITECTURE = frozenset({"initializer_range", "router_aux_loss_coef", "bos_token_id", "pad_token_id"})


def model_architecture(config: dict[str, Any], source: str = CONFIG_NAME) -> dict[str, Any]:
    """What a model's shape and computation depend on, from a config.json dict, normalised across the layouts
    transformers writes (v4: top-level `rope_theta`, `torch_dtype`, no `rope_parameters`; v5: `dtype`,
    `rope_parameters`; `num_experts` or `num_local_experts`; `head_dim` implied or explicit; absent fields at
    their defaults), so that two configs of one model compare equal whoever wrote them. The dtype is left
    out (declared_dtype compares it). `source` names the file in errors."""
    fields = asdict(config_from_hf(config, source=source))
    architecture = {k: v for k, v in fields.items() if k not in NOT_ARCHITECTURE}
    architecture["architectures"] = list(config.get("architectures") or [])  # SGLang's model class
    return architecture


def expected_tensor_shapes(
    cfg: Any, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of `cfg` holds -> shape; with a placement, only the experts EP rank
    ep_rank holds (its family's state-dict adapter names them)."""
    return family_of(cfg).state_dict_adapter.expected_shapes(cfg, placement, ep_rank)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a checkpoint lives, read from the safetensors headers only."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: F32, BF16, F16, ...


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint dir, and the index's weight_map when it is sharded."""
    if not directory.is_dir():
        raise MoerlError(f"{directory}: checkpoint directory not found")
    single, index = directory / SAFE_WEIGHTS_NAME, directory / SAFE_WEIGHTS_INDEX_NAME
    if single.is_file():  # the same preference as transformers' from_pretrained
        return [single], None
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise MoerlError(f"{index}: not a safetensors index (no 'weight_map' object); re-save it")
        files = sorted({directory / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise MoerlError(f"{index} names shard {f.name}, which is missing; copy the whole checkpoint")
        return files, weight_map
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_WEIGHT_SUFFIXES)
    if pickles:
        raise MoerlError(
            f"{directory} holds only pickle weights ({', '.join(pickles)}): moerl reads safetensors only; "
            'convert with `python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{directory}').save_pretrained('OUT_DIR')\"` in an environment you trust "
            "(unpickling can run code), then use OUT_DIR"
        )
    raise MoerlError(
        f"{directory}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}; save the model with "
        "save_pretrained"
    )


def tensor_index(directory: str | os.PathLike) -> dict[str, TensorEntry]:
    """name -> TensorEntry for every tensor of the checkpoint in `directory` (reads headers only)."""
    directory = Path(directory)
    files, weight_map = _weight_files(directory)
    entries: dict[str, TensorEntry] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if weight_map is not None and weight_map.get(name) != path.name:
                        continue  # the index is authoritative, as in transformers
                    info = f.get_slice(name)
                    entries[name] = TensorEntry(path, tuple(info.get_shape()), info.get_dtype())
        except (SafetensorError, OSError) as err:
            raise MoerlError(f"{path}: not a readable safetensors file ({err}); re-save it") from err
    if weight_map is not None:
        for name, file_name in weight_map.items():
            if name not in entries:
                raise MoerlError(
                    f"{directory / SAFE_WEIGHTS_INDEX_NAME} maps tensor {name} to {file_name}, which does "
                    "not hold it; re-save the checkpoint"
                )
    return entries


def _check_float(name: str, entry: TensorEntry) -> None:
    if kept_as_integers(name):
        if entry.dtype not in SAFETENSORS_INTEGER_DTYPES:
            raise MoerlError(
                f"{entry.file}: tensor {name} has dtype {entry.dtype}; it is an integer table (moerl reads it as "
                f"{' or '.join(SAFETENSORS_INTEGER_DTYPES)}): re-export the checkpoint with the release's table"
            )
        return
    if entry.dtype not in SAFETENSORS_FLOAT_DTYPES:
        raise MoerlError(
            f"{entry.file}: tensor {name} has dtype {entry.dtype}; moerl loads F32, BF16 or F16 weights "
            "(dequantize the checkpoint first)"
        )


def dropped_tensors(cfg: Any, entries: dict[str, TensorEntry] | Iterable[str]) -> dict[str, str]:
    """The checkpoint's tensors its family skips on import (name -> why: multi-token-prediction layers)."""
    adapter = family_of(cfg).state_dict_adapter
    dropped = {name: adapter.dropped_on_import(cfg, name) for name in entries}
    return {name: why for name, why in dropped.items() if why is not None}


def check_tensors(cfg: Any, entries: dict[str, TensorEntry], directory: str | os.PathLike) -> None:
    """Every expected tensor present with the config's shape and a float dtype; nothing unexpected but what the
    family drops on import (dropped_tensors)."""
    expected = expected_tensor_shapes(cfg)
    for name, shape in expected.items():
        entry = entries.get(name)
        if entry is None:
            raise MoerlError(
                f"{directory}: tensor {name} is missing (expected shape {list(shape)} from config.json); "
                "the weights do not match config.json: re-export the checkpoint"
            )
        if entry.shape != shape:
            raise MoerlError(
                f"{entry.file}: tensor {name} has shape {list(entry.shape)}, expected {list(shape)} from "
                "config.json; the weights do not match config.json: re-export the checkpoint"
            )
        _check_float(name, entry)
    unexpected = sorted(set(entries) - set(expected) - set(dropped_tensors(cfg, entries)))
    if unexpected:
        name = unexpected[0]
        raise MoerlError(
            f"{entries[name].file}: unexpected tensor {name} ({len(unexpected)} unexpected in all) for a "
            f"{family_of(cfg).name} model of this config.json; remove it or fix config.json"
        )


def declared_dtype(config: dict[str, Any], source: str) -> torch.dtype | None:
    """The weights' dtype that a config.json dict declares (transformers v5 writes `dtype`, v4 `torch_dtype`;
    moerl writes both), or None when it declares none. `source` names the file in errors."""
    declared = {key: config[key] for key in ("dtype", "torch_dtype") if config.get(key) is not None}
    for key, value in declared.items():
        if value not in CONFIG_DTYPES:
            raise MoerlError(
                f"{source}: {key} = {value!r} is not supported; moerl trains float32, bfloat16 or float16 "
                "checkpoints — save the model in one of them (model.to(torch.bfloat16).save_pretrained(dir))"
            )
    if len(set(declared.values())) > 1:
        raise MoerlError(
            f"{source}: dtype = {declared['dtype']!r} but torch_dtype = {declared['torch_dtype']!r}; they "
            "must agree — set both to the dtype the weights are stored in"
        )
    return CONFIG_DTYPES[next(iter(declared.values()))] if declared else None


def float32_tensors(config: Any) -> tuple[str, ...]:
    """The float32 tensor names of the family of `config` (a config or a config.json dict; ModelFamily.float32_tensors),
    () for a config no family takes (refused elsewhere)."""
    try:
        return (family_of(config) if not isinstance(config, dict) else resolve(config)).float32_tensors
    except MoerlError:
        return ()


def weights_dtype(config: dict[str, Any], entries: dict[str, TensorEntry], source: str) -> torch.dtype:
    """The one dtype every tensor is stored in, which config.json's dtype (when declared) must name.

    A checkpoint is trained and published in one dtype (published versions keep the SFT checkpoint's):
    mixed dtypes, or a config.json that says another dtype than the weights have, are refused, because
    loaders that follow config.json (transformers' dtype="auto", SGLang's dtype auto) would cast them."""
    stored: dict[str, list[str]] = {}
    own = float32_tensors(config)
    for name, entry in sorted(entries.items()):
        _check_float(name, entry)
        if kept_in_float32(name, own) and entry.dtype == "F32" or kept_as_integers(name):
            continue  # float32 or integers beside any weights' dtype (steps/models/moe.py stored_dtype)
        stored.setdefault(entry.dtype, []).append(name)
    if not stored:
        raise MoerlError(f"{source}: the checkpoint holds no tensors; re-export it with save_pretrained")
    if len(stored) > 1:
        counts = ", ".join(
            f"{code}: {len(names)} tensor{'s' if len(names) > 1 else ''} (e.g. {names[0]})"
            for code, names in sorted(stored.items())
        )
        raise MoerlError(
            f"{source}: the weights are stored in several dtypes ({counts}); moerl trains and publishes one "
            "dtype — save the model in one (model.to(torch.bfloat16).save_pretrained(dir))"
        )
    dtype = SAFETENSORS_FLOAT_DTYPES[next(iter(stored))]
    declared = declared_dtype(config, f"{source}/{CONFIG_NAME}")
    if declared is not None and declared != dtype:
        raise MoerlError(
            f"{source}/{CONFIG_NAME}: declares dtype {dtype_name(declared)} but the weights are stored as "
            f"{dtype_name(dtype)}; set dtype and torch_dtype in config.json to {dtype_name(dtype)!r}"
        )
    return dtype


def checkpoint_dtype(directory: str | os.PathLike) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in (see weights_dtype); reads config.json and headers only."""
    entries = tensor_index(directory)
    dropped = dropped_tensors(load_config(directory), entries)
    kept = {name: entry for name, entry in entries.items() if name not in dropped}
    return weights_dtype(read_config_json(directory), kept, str(directory))


def _checked(directory: str | os.PathLike) -> tuple[Any, dict[str, TensorEntry], torch.dtype]:
    """(config, tensor index without the dropped tensors, stored dtype) of a checkpoint whose config and tensor
    headers all check out."""
    cfg = load_config(directory)
    entries = tensor_index(directory)
    check_tensors(cfg, entries, directory)
    dropped = dropped_tensors(cfg, entries)
    entries = {name: entry for name, entry in entries.items() if name not in dropped}
    return cfg, entries, weights_dtype(read_config_json(directory), entries, str(directory))


def check_checkpoint(directory: str | os.PathLike) -> Any:
    """Validate config.json (its dtype included) and every tensor header of a checkpoint without reading
    the weights."""
    return _checked(directory)[0]


def load_state_dict_from_dir(
    directory: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Read the checkpoint's tensors (all, or only `names`) from its safetensors file(s), as stored."""
    entries = tensor_index(directory)
    wanted = list(entries) if names is None else list(names)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name not in entries:
            raise MoerlError(f"{directory}: tensor {name} is missing; re-export the checkpoint")
        by_file.setdefault(entries[name].file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in file_names:
                state[name] = f.get_tensor(name)
    return state


def _runs(ids: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted ids as [start, stop) runs of consecutive ids: [0, 1, 3] -> [(0, 2), (3, 4)]."""
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def read_expert_rows(
    entries: dict[str, TensorEntry], fused: Iterable[FusedExperts], placement: ExpertPlacement, ep_rank: int
) -> dict[str, torch.Tensor]:
    """EP rank ep_rank's slices of the checkpoint's fused expert tensors (FusedExperts), under the model's names:
    only the rows of the experts the placement gives it are read from disk (safetensors slices, one read per run
    of consecutive expert ids), never the whole tensor."""
    by_file: dict[Path, list[FusedExperts]] = {}
    for f in fused:
        by_file.setdefault(entries[f.name].file, []).append(f)
    out: dict[str, torch.Tensor] = {}
    for path, tensors in by_file.items():
        with safe_open(path, framework="pt") as handle:
            for f in tensors:
                stored = handle.get_slice(f.name)
                for start, stop in _runs(placement.held(f.moe_layer, ep_rank)):
                    rows = stored[(slice(None),) * f.dim + (slice(start, stop),)]
                    for i, expert in enumerate(range(start, stop)):
                        out[f.experts[expert]] = rows.select(f.dim, i)
    return out


def load_pretrained(
    directory: str | os.PathLike,
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
    placement: ExpertPlacement | None = None,
    ep_rank: int = 0,
) -> nn.Module:
    """Build the model of a Hugging Face checkpoint directory (safetensors only) as its family builds it, its
    weights cast to `dtype` (None: the dtype they are stored in; an upcast to float32 is exact).

    The whole checkpoint is validated first (config, every tensor's presence, shape and dtype, one dtype
    that config.json agrees with, nothing extra); with a placement only the experts EP rank ep_rank holds
    are then read from disk (by name, from whichever files hold them; of a tensor that fuses a layer's experts,
    as gpt-oss's do, only their rows: read_expert_rows).
    """
    cfg, entries, stored = _checked(directory)
    check_placement(cfg, placement, ep_rank)
    wanted = expected_tensor_shapes(cfg, placement, ep_rank)
    experts: dict[str, torch.Tensor] = {}
    if placement is not None:
        fused = family_of(cfg).state_dict_adapter.fused_experts(cfg)
        experts = read_expert_rows(entries, fused, placement, ep_rank)
        wanted = {name: shape for name, shape in wanted.items() if name not in {f.name for f in fused}}
    state = load_state_dict_from_dir(directory, wanted)
    return model_from_state(cfg, state, dtype or stored, device, placement, ep_rank, experts)


def parameter_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """The full model's parameters (every expert), by the model's own names -> shape: what optimizer state is
    named by (steps/training/optimizer_state.py). Built on the meta device: no memory, whatever the size."""
    with torch.device("meta"):
        model = family_of(cfg).build(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def model_from_state(
    cfg: Any,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    placement: ExpertPlacement | None = None,
    ep_rank: int = 0,
    experts: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """The model of `cfg` (its family's; EP rank ep_rank's experts under `placement`) holding copies of `state`'s
    tensors, cast to `dtype`: load_pretrained's last half, and how a trainer that stays up rebuilds its model
    from the tensors it holds (the same construction, so the same bits). `experts`: tensors already under the
    model's names, beside `state`'s checkpoint names (an EP rank's slices of fused expert tensors, read on their
    own: read_expert_rows)."""

    own = float32_tensors(cfg)

    # Always a copy into torch's own (64-byte aligned) memory: a tensor as safetensors hands it over may sit at
    # any offset, and CPU kernels round differently on unaligned data, so the same weights would train other bits.
    def copied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            name: t.to(device=device, dtype=stored_dtype(name, dtype, own), copy=True)
            for name, t in tensors.items()
        }

    state, experts = copied(state), copied(experts or {})
    # The meta device skips allocating and initialising weights that are about to be replaced, but its
    # first use imports torch's reference ops (~2 s per process); a small model is cheaper to build plainly.
    numel = sum(t.numel() for t in (*state.values(), *experts.values()))
    family = family_of(cfg)
    with torch.device("meta") if numel > META_BUILD_MIN_PARAMS else contextlib.nullcontext():
        model = family.build(cfg, placement, ep_rank)
    state = family.state_dict_adapter.from_hf(state)
    twice = sorted(set(state) & set(experts))
    if twice:
        raise ValueError(f"tensors given both in the checkpoint's and in the model's names: {twice[:3]}")
    state.update(experts)
    if placement is not None:
        # A fused expert tensor given whole (gpt-oss's, by a caller that read the whole checkpoint) splits into
        # every expert's slice: keep the experts this rank holds.
        held = set(model.state_dict())
        state = {name: t for name, t in state.items() if name in held or not is_expert_param(name)}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_pretrained(
    model: nn.Module, directory: str | os.PathLike, max_shard_bytes: int | None = None
) -> list[Path]:
    """Write config.json, generation_config.json and the weights (model.safetensors, or
    model-0000i-of-0000n.safetensors + model.safetensors.index.json above max_shard_bytes). Each file is
    written to a temporary name and renamed into place. Returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg: Any = model.config
    named = family_of(cfg).state_dict_adapter.to_hf(model.state_dict())
    state = {name: t.detach().to("cpu").contiguous() for name, t in named.items()}
    own = float32_tensors(cfg)
    dtype = next(t.dtype for name, t in state.items() if not kept_in_float32(name, own) and not kept_as_integers(name))
    written: list[Path] = []

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size

    if len(shards) == 1:
        written.append(_atomic_save(shards[0], directory / SAFE_WEIGHTS_NAME))
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            written.append(_atomic_save(shard, directory / file_name))
            weight_map.update(dict.fromkeys(shard, file_name))
        index = {
            "metadata": {
                "total_size": sum(t.numel() * t.element_size() for t in state.values()),
                "total_parameters": sum(t.numel() for t in state.values()),
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        written.append(_atomic_write_text(directory / SAFE_WEIGHTS_INDEX_NAME, json.dumps(index, indent=2)))

    written.append(_atomic_write_text(directory / CONFIG_NAME, json.dumps(cfg.to_hf_dict(dtype), indent=2)))
    generation: dict[str, Any] = {"_from_model_config": True}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, name) is not None:
            generation[name] = getattr(cfg, name)
    written.append(_atomic_write_text(directory / GENERATION_CONFIG_NAME, json.dumps(generation, indent=2)))

    # Stale weight files of an earlier save would confuse loaders (a single file wins over an index).
    keep = {p.name for p in written}
    for stale in directory.glob("model*.safetensors*"):
        if stale.name not in keep:
            stale.unlink()
    return written


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def _atomic_write_text(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path
