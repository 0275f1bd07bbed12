"""Tensors a model keeps and publishes unchanged without computing with them: the vision tower of a vision-language
checkpoint (Qwen3.5-MoE) while RL trains its language model on text. They are buffers, not parameters, so the
trainer gives them no gradient and no optimizer state, while everything that reads a model's state_dict (the
checkpoint loader, the candidate writer, the trainer's held state, the weight deltas) reads, writes and checks them
with the rest: every published version holds them, bit for bit as imported.

A family lists the tensors (their names under the carrying module, and shapes: from its config, so that a damaged
tower is refused like any other tensor) and maps the names to its checkpoint's in its state-dict adapter.
"""

from __future__ import annotations

import torch
from torch import nn


class CarriedTensors(nn.Module):
    """Buffers of the given shapes under dotted names: shapes {"blocks.0.attn.qkv.weight": (3 * D, D)} gives
    the buffer `blocks.0.attn.qkv.weight` of this module (a child module per dotted step, as the tower's own
    modules would nest). Zero until loaded (load_state_dict assigns the checkpoint's)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            *path, leaf = name.split(".")
            module: nn.Module = self
            for step in path:
                child = module._modules.get(step)
                if child is None:
                    child = nn.Module()
                    module.add_module(step, child)
                module = child
            module.register_buffer(leaf, torch.zeros(shape))
