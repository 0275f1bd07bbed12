"""A DeepSeek-V4 checkpoint as transformers 5.23's save_pretrained writes it, renamed on import to the release's
names, which moerl, SGLang and transformers read. transformers' conversion mapping "deepseek_v4" renames the release's
tensors when it loads them and saves by reversing the renames, which leaves its own prefix and a few of its names
(model.layers.N..., model.embed_tokens, model.norm, model.hc_head.hc_fn) and turns the attention's kv_norm into
attn.norm (its reversal of the compressors' norm -> kv_norm): they are renamed back (release_name); the tensors are
unchanged. Its conversion in steps/models/import_conversions.py; a checkpoint in the release's layout is untouched.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from steps.models.checkpoint_rewrite import SHARD_BYTES, rename_tensors

_TMP_PREFIX = ".moerl-renamed-"
_WHOLE = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
_HEAD = re.compile(r"^model\.hc_head\.hc_(fn|base|scale)$")
_KV_NORM = re.compile(r"^(layers\.\d+\.attn\.)norm\.weight$")  # the attention's own, not a compressor's


def release_name(name: str) -> str:
    """The release's name of a tensor transformers saved as `name` (itself when it already is one)."""
    if name in _WHOLE:
        return _WHOLE[name]
    name = _HEAD.sub(r"hc_head_\1", name)
    name = name.removeprefix("model.") if name.startswith("model.layers.") else name
    return _KV_NORM.sub(r"\1kv_norm.weight", name)


def rename_to_release_layout(
    directory: str | os.PathLike, say: Callable[[str], None] = print, shard_bytes: int = SHARD_BYTES
) -> int:
    """Rewrite the checkpoint in `directory` in place under the release's names; says so in one line and returns the
    number of tensors renamed (0: already the release's layout)."""
    renamed = rename_tensors(directory, release_name, shard_bytes, _TMP_PREFIX)
    if renamed:
        say(f"{directory}: renamed {renamed} tensors from transformers' saved layout to the DeepSeek-V4 release's")
    return renamed
