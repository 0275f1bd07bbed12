"""Validation of a Hugging Face format SFT checkpoint before it enters a run.

Only config.json, the tokenizer and the safetensors headers are read, so a multi-hundred-GB
checkpoint validates in seconds (steps.models.hf_checkpoint.check_checkpoint does the tensor part).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from steps.data.tokenizer import TOKENIZER_FILE, CheckpointTokenizer
from steps.errors import MoerlError
from steps.models.family import dtype_name
from steps.models.hf_checkpoint import (
    CONFIG_NAME,
    PICKLE_WEIGHT_SUFFIXES,
    check_checkpoint,
    checkpoint_dtype,
    declared_dtype,
    dropped_tensors,
    read_config_json,
    tensor_index,
)


def refuse_pickled(names: list[str], where: str) -> None:
    """Weights that exist only as pickles are refused: unpickling can run arbitrary code."""
    if any(n.endswith(".safetensors") for n in names):
        return
    pickled = sorted(n for n in names if Path(n).suffix in PICKLE_WEIGHT_SUFFIXES)
    if pickled:
        raise MoerlError(
            f"{where}: weights are pickled ({', '.join(pickled[:3])}); moerl reads safetensors only — convert "
            "them in an environment you trust: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out)"
        )


def check_tokenizer(directory: Path, config: Any) -> None:
    path = Path(directory) / TOKENIZER_FILE
    if not path.is_file():
        raise MoerlError(
            f"{directory}: missing {TOKENIZER_FILE}; save the tokenizer beside the weights "
            "(tokenizer.save_pretrained(dir))"
        )
    vocab = CheckpointTokenizer.load(directory).vocab_size  # also: its special and stop tokens are readable
    if vocab > config.vocab_size:
        raise MoerlError(
            f"{path}: the tokenizer has {vocab} tokens but config.json has vocab_size {config.vocab_size}; "
            "they must come from the same checkpoint"
        )


def check_finite(directory: Path, skip: Iterable[str] = ()) -> None:
    """Every weight is finite (but the tensors in `skip`): a NaN or inf in the SFT policy would poison every
    rollout and update.

    Reads one tensor at a time, so memory stays at the largest tensor whatever the checkpoint's size."""
    skipped = set(skip)
    for name, entry in tensor_index(directory).items():
        if name in skipped:
            continue
        with safe_open(entry.file, framework="pt") as f:
            if not torch.isfinite(f.get_tensor(name)).all():
                raise MoerlError(
                    f"{entry.file}: tensor {name} holds NaN or inf values; re-export the SFT checkpoint from a "
                    "healthy training run"
                )


def validate_checkpoint_dir(directory: Path, say: Callable[[str], None] = print) -> Any:
    """Check that `directory` is a complete checkpoint of a family moerl can train; return its config. Tensors its
    family drops on import (multi-token-prediction layers) are said, in one line."""
    config = check_checkpoint(directory)
    check_tokenizer(directory, config)
    dropped = dropped_tensors(config, tensor_index(directory))
    if dropped:
        reasons = sorted(set(dropped.values()))
        say(f"{directory}: {len(dropped)} tensors dropped on import ({'; '.join(reasons)}), e.g. {min(dropped)}")
    check_finite(directory, skip=dropped)
    return config


def declare_dtype(directory: Path) -> torch.dtype:
    """The dtype the checkpoint's weights are stored in, written into its config.json (`dtype` and
    `torch_dtype`) when config.json declares none: every version of the run is published in it, and
    loaders that follow config.json (SGLang's dtype auto reads a missing one as float32, then serves
    float16) then serve the weights as they are. A declared dtype was already checked against the weights."""
    dtype = checkpoint_dtype(directory)
    config = read_config_json(directory)
    if declared_dtype(config, CONFIG_NAME) is None:
        config.update(dtype=dtype_name(dtype), torch_dtype=dtype_name(dtype))
        (Path(directory) / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return dtype
