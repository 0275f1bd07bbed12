"""Rewriting a checkpoint directory in place, tensor by tensor, as the import conversions do
(steps/models/import_conversions.py): output tensors gathered into shards written as they fill (ShardWriter), and
each input weight file deleted once every tensor it held has been written again (InputFiles), so that memory stays
near a shard and disk near the checkpoint's size. A rewrite that fails midway leaves the directory unusable: the
conversions run on the import's temporary copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from steps.models.hf_checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, TensorEntry, tensor_index

SHARD_BYTES = 5 * 2**30  # a rewrite's output shards' size bound (one tensor larger than it is a shard of its own)


class InputFiles:
    """The input weight files of a rewrite: consumed(name) once tensor `name` has been written again; a file is
    deleted when every tensor it held has been."""

    def __init__(self, entries: dict[str, TensorEntry]) -> None:
        self.entries = entries
        self.remaining: dict[Path, int] = {}
        for entry in entries.values():
            self.remaining[entry.file] = self.remaining.get(entry.file, 0) + 1

    def consumed(self, name: str) -> None:
        file = self.entries[name].file
        self.remaining[file] -= 1
        if self.remaining[file] == 0:
            file.unlink()


class ShardWriter:
    """Output tensors gathered into shards of at most `limit` bytes (a larger tensor alone), each written under a
    temporary name (`prefix` + its number) as soon as it is full."""

    def __init__(self, directory: Path, limit: int, prefix: str) -> None:
        self.directory, self.limit, self.prefix = directory, limit, prefix
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []  # tensor names per written shard
        self.total_bytes = 0

    def temporary(self, i: int) -> Path:
        return self.directory / f"{self.prefix}{i:05d}.safetensors"

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if self.pending:
            save_file(self.pending, str(self.temporary(len(self.shards))), metadata={"format": "pt"})
            self.shards.append(sorted(self.pending))
            self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """The shards moved to their final names (model.safetensors, or model-0000i-of-0000n.safetensors and
        model.safetensors.index.json), once every input weight file is gone."""
        self.flush()
        index = self.directory / SAFE_WEIGHTS_INDEX_NAME
        index.unlink(missing_ok=True)  # every file it named is gone
        if not self.shards:
            return  # no tensors: validation says so
        if len(self.shards) == 1:
            os.replace(self.temporary(0), self.directory / SAFE_WEIGHTS_NAME)
            return
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            os.replace(self.temporary(i), self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        (self.directory / SAFE_WEIGHTS_NAME).unlink(missing_ok=True)
        index_json = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        index.write_text(json.dumps(index_json, indent=2) + "\n")


def rename_tensors(
    directory: str | os.PathLike, rename: Callable[[str], str], shard_bytes: int, tmp_prefix: str
) -> int:
    """Rewrite the checkpoint in `directory` in place with each tensor under rename(name), the tensors unchanged;
    returns how many were renamed (0: nothing to do, nothing written)."""
    entries = tensor_index(directory)
    renamed = {name: rename(name) for name in entries if rename(name) != name}
    if not renamed:
        return 0
    inputs = InputFiles(entries)
    writer = ShardWriter(Path(directory), shard_bytes, tmp_prefix)
    for name, entry in entries.items():
        with safe_open(entry.file, framework="pt") as f:
            writer.add(renamed.get(name, name), f.get_tensor(name))
        inputs.consumed(name)
    writer.finish()
    return len(renamed)
