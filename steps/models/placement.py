"""Expert placement: which experts each EP rank holds, per MoE layer (steps/expert_parallel/__init__.py).

`ExpertPlacement` lists, per MoE layer, the E global expert ids in slot order; `balanced_placement` chooses
the split that evens out the ranks' routed rows from the previous iteration's per-expert row counts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """slots[l]: MoE layer l's E global expert ids in slot order (l counts the MoE layers in model order);
    EP rank r holds slots [r*E/ep, (r+1)*E/ep) of every layer. Checkpoint tensors and optimizer state keep
    the global ids, so any placement reads and writes the same formats."""

    slots: tuple[tuple[int, ...], ...]
    ep_size: int

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("an expert placement needs at least one MoE layer")
        num_experts = len(self.slots[0])
        if self.ep_size < 1 or num_experts % self.ep_size:
            raise ValueError(f"EP size {self.ep_size} does not divide {num_experts} experts")
        for layer, row in enumerate(self.slots):
            if sorted(row) != list(range(num_experts)):
                raise ValueError(f"MoE layer {layer}: {list(row)} is not a permutation of 0..{num_experts - 1}")

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, ep_size: int) -> ExpertPlacement:
        """The identity: EP rank r holds experts [r*E/ep, (r+1)*E/ep) of every layer."""
        return cls(tuple(tuple(range(num_experts)) for _ in range(num_layers)), ep_size)

    @classmethod
    def from_lists(cls, slots: Sequence[Sequence[int]], ep_size: int) -> ExpertPlacement:
        return cls(tuple(tuple(int(e) for e in row) for row in slots), ep_size)

    @property
    def num_layers(self) -> int:
        return len(self.slots)

    @property
    def num_experts(self) -> int:
        return len(self.slots[0])

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def is_contiguous(self) -> bool:
        return all(row == tuple(range(self.num_experts)) for row in self.slots)

    def held(self, layer: int, ep_rank: int) -> tuple[int, ...]:
        """The global expert ids EP rank `ep_rank` holds in MoE layer `layer`, in slot order."""
        return self.slots[layer][ep_rank * self.per_rank : (ep_rank + 1) * self.per_rank]

    def rank_rows(self, loads: Sequence[Sequence[int]]) -> list[list[int]]:
        """Per MoE layer, the rows each EP rank's experts get under this placement, from per-expert loads."""
        return [
            [sum(int(layer_loads[e]) for e in self.held(layer, r)) for r in range(self.ep_size)]
            for layer, layer_loads in enumerate(loads)
        ]

    def to_lists(self) -> list[list[int]]:
        return [list(row) for row in self.slots]


def _max_group(loads: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    return max(sum(loads[e] for e in g) for g in groups)


def _balance_layer(loads: list[int], ep_size: int) -> tuple[int, ...]:
    """One layer's slots: ep groups of exactly E/ep experts with the largest group load as small as greedy
    plus pairwise swaps make it; the contiguous split when that is as good (no needless moves)."""
    num_experts = len(loads)
    per_rank = num_experts // ep_size
    contiguous = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep_size)]
    # Greedy (LPT with a size limit): heaviest expert first (ties: lower id), to the least-loaded group
    # that has room (ties: lower group index).
    groups: list[list[int]] = [[] for _ in range(ep_size)]
    sums = [0] * ep_size
    for e in sorted(range(num_experts), key=lambda e: (-loads[e], e)):
        g = min((g for g in range(ep_size) if len(groups[g]) < per_rank), key=lambda g: (sums[g], g))
        groups[g].append(e)
        sums[g] += loads[e]
    # Swaps out of the heaviest group while one lowers it without making the other group as heavy: each
    # lowers the sum of squared group loads, so this ends; the best swap (smallest resulting pair maximum,
    # then lowest ids) keeps it deterministic.
    while True:
        heavy = min(range(ep_size), key=lambda g: (-sums[g], g))
        best: tuple[int, int, int, int, int] | None = None  # (new max of the pair, a, b, group, delta)
        for g in range(ep_size):
            if g == heavy:
                continue
            for a in sorted(groups[heavy]):
                for b in sorted(groups[g]):
                    delta = loads[a] - loads[b]
                    if delta <= 0 or sums[g] + delta >= sums[heavy]:
                        continue
                    candidate = (max(sums[heavy] - delta, sums[g] + delta), a, b, g, delta)
                    if best is None or candidate < best:
                        best = candidate
        if best is None:
            break
        _, a, b, g, delta = best
        groups[heavy][groups[heavy].index(a)] = b
        groups[g][groups[g].index(b)] = a
        sums[heavy] -= delta
        sums[g] += delta
    if _max_group(loads, contiguous) <= max(sums):
        groups = contiguous
    # Groups in the order of their lowest expert id, ids ascending inside each: one canonical form.
    groups = sorted((sorted(g) for g in groups), key=lambda g: g[0])
    return tuple(e for g in groups for e in g)


def balanced_placement(loads: Sequence[Sequence[int]] | torch.Tensor, ep_size: int) -> ExpertPlacement:
    """Per MoE layer, split the experts into ep_size groups of exactly E/ep so that the largest group's load
    (routed (token, expert) rows) is as small as possible (greedy by descending load, then improving swaps;
    deterministic; never worse than the contiguous split, which is kept when it is as good).

    loads: [num MoE layers][num_experts] non-negative row counts (a list of lists or an integer tensor)."""
    rows = loads.tolist() if isinstance(loads, torch.Tensor) else [list(r) for r in loads]
    if not rows or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("loads must be a non-empty [layers][experts] table")
    if len(rows[0]) % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide {len(rows[0])} experts")
    if any(int(x) != x or x < 0 for r in rows for x in r):
        raise ValueError("loads must be non-negative integers")
    return ExpertPlacement(tuple(_balance_layer([int(x) for x in r], ep_size) for r in rows), ep_size)


def moe_layer_indices(cfg: Any) -> list[int]:
    """The decoder layers of a family's config that are MoE layers, in order (an ExpertPlacement's layer l is the
    l-th of them)."""
    return [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)]


def layer_share(cfg: Any, placement: ExpertPlacement | None, layer: int) -> tuple[tuple[int, ...] | None, int]:
    """(slots, ep_size) of decoder layer `layer`'s MoE block under `placement`: its MoE layer's slot order and the
    EP size; (None, 1) without a placement (every expert, in id order)."""
    if placement is None:
        return None, 1
    return placement.slots[moe_layer_indices(cfg).index(layer)], placement.ep_size


def check_placement(cfg: Any, placement: ExpertPlacement | None, ep_rank: int) -> None:
    """A placement must describe this config's MoE layers and experts, and ep_rank be one of its ranks."""
    if placement is None:
        if ep_rank != 0:
            raise ValueError(f"ep_rank {ep_rank} without an expert placement")
        return
    num_moe = len(moe_layer_indices(cfg))
    if (placement.num_layers, placement.num_experts) != (num_moe, cfg.num_experts):
        raise ValueError(
            f"expert placement for {placement.num_layers} MoE layers x {placement.num_experts} experts, the "
            f"model has {num_moe} x {cfg.num_experts}"
        )
    if not 0 <= ep_rank < placement.ep_size:
        raise ValueError(f"ep_rank {ep_rank} is not in [0, {placement.ep_size})")


_EXPERT_PARAM = re.compile(r"(^|\.)experts\.\d+\.")


def is_expert_param(name: str) -> bool:
    """A routed expert's parameter: `<...>.experts.17.<projection>.weight`, the experts of a SparseMoeBlock (or
    `experts.17...` inside a bare block), whatever the family names the block and the projections."""
    return _EXPERT_PARAM.search(name) is not None
