"""Shared by the weight delta and weight sync tests: a run with v000000 imported and versions published directly
(checkpoint.publish_dir, no update step), each a small AdamW-like move of its parent."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from experience_helpers import make_run, tiny_model, write_checkpoint

from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.run import checkpoint
from steps.store.object_store import Store


def moved(model: MoeForCausalLM, seed: int, lr: float = 1e-5) -> MoeForCausalLM:
    """A copy with every weight moved by up to lr (most fp32 bits change; as an optimizer step does), and one
    norm weight replaced outright."""
    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.add_((torch.rand(p.shape, generator=gen) * 2 - 1).to(p.dtype) * lr)
        out.model.norm.weight.copy_(
            torch.rand(out.model.norm.weight.shape, generator=gen).to(out.model.norm.weight.dtype)
        )
    return out


class VersionedRun:
    """A run store and the local dirs of its published versions."""

    def __init__(
        self,
        tmp_path: Path,
        dtype: torch.dtype = torch.float32,
        max_shard_bytes: int | None = None,
        seed: int = 0,
        lr: float = 1e-5,
    ):
        self.tmp, self.seed, self.lr = tmp_path, seed, lr  # of the moves (another seed: other versions of one v0)
        self.max_shard_bytes = max_shard_bytes
        self.models = [tiny_model(seed=3).to(dtype)]
        self.dirs = [self._write(self.models[0], 0)]
        self.uri = make_run(tmp_path, self.dirs[0], checkpoint={"keep_last": 10}, rollout={"servers": 2})
        self.run = Store.open(self.uri)

    def _write(self, model: MoeForCausalLM, version: int) -> Path:
        directory = self.tmp / f"local-v{version}"
        if self.max_shard_bytes is None:
            return write_checkpoint(model, directory)
        from steps.demo.char_tokenizer import save_tokenizer
        from steps.models.hf_checkpoint import save_pretrained

        save_pretrained(model, directory, max_shard_bytes=self.max_shard_bytes)
        save_tokenizer(directory)
        return directory

    def next_dir(self) -> Path:
        """The next version's local dir (not published yet)."""
        version = len(self.models)
        self.models.append(moved(self.models[-1], seed=1000 * self.seed + version, lr=self.lr))
        self.dirs.append(self._write(self.models[-1], version))
        return self.dirs[-1]

    def publish_next(self, delta: bool = True) -> int:
        from steps.run.weight_delta import write_delta

        directory = self.next_dir()
        version = len(self.models) - 1
        if delta:
            write_delta(self.run, version, directory)
        checkpoint.publish_dir(self.run, directory, version, parent=version - 1, iteration=version)
        return version


def same_files(a: Path, b: Path) -> bool:
    """Every file of a (but the store's bookkeeping) is in b with the same bytes, and nothing else is."""
    names = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    return names(a) == names(b) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names(a))


def assert_the_ranks_delta_is_the_one_publish_would_write(run: Store, version: int) -> None:
    """v(version)'s delta as published (the update's ranks wrote its blobs, publish indexed them) is, byte for
    byte, what publish writes itself from both versions (weight_delta.write_delta)."""
    from steps.run.keys import delta_index_key, delta_prefix
    from steps.run.weight_delta import write_delta

    stored = {key: run.get_bytes(key) for key in run.list(delta_prefix(version))}
    assert delta_index_key(version) in stored, f"v{version}: no delta published"
    run.delete_prefix(delta_prefix(version))
    write_delta(run, version)
    assert {key: run.get_bytes(key) for key in run.list(delta_prefix(version))} == stored
