"""The engine's recorded routes as the trainer reads them (routing replay, trainer.routing_replay; the routers'
disagreement in the update metrics): checked against the model, cut per sample, and laid out for a micro-batch
(steps/training/trainer.py collate and collate_groups put them in the order the MoE layers see the tokens). For a
model with DeepSeek sparse attention, the same for the keys its indexers selected (selected_keys): checked, and laid
out as each forward call's queries and keys (selection_grid)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steps.errors import MoerlError
from steps.experience.tables import Sample


def sample_routes(sample: Sample, route_shape: tuple[int, int]) -> np.ndarray:
    """The sample's recorded routes as [len(prompt) + len(response) - 1, MoE layers, top_k] (check_routes has
    checked the size)."""
    assert sample.routed_experts is not None
    return sample.routed_experts.reshape(-1, *route_shape)


def routes_tensor(routes: np.ndarray | None, device: torch.device) -> torch.Tensor | None:
    """[T, MoE layers, k] int16 -> [MoE layers, T, k] int64 on the device (MicroBatch.routes)."""
    if routes is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(routes.transpose(1, 0, 2))).to(device=device, dtype=torch.long)


def check_routes(samples: list[Sample], layers: int, top_k: int, num_experts: int, replay: bool) -> bool:
    """Whether the samples carry routes the trainer can compare with its routers' (and replay): every sample
    (len(prompt) + len(response) - 1) x layers x top_k expert ids in [-1, num_experts). Samples without routes:
    False, refused when `replay` (trainer.routing_replay: rollout); routes of another shape or range: refused."""
    missing = [s for s in samples if s.routed_experts is None]
    if missing:
        if replay:
            s = missing[0]
            raise MoerlError(
                f"sample {s.prompt_id!r}/{s.sample_index}: the experience records no routed experts, which "
                "trainer.routing_replay: rollout replays; rerun its rollout with this run config (it records them)"
            )
        return False
    per_position = layers * top_k
    for s in samples:
        routes = s.routed_experts
        assert routes is not None
        positions = len(s.prompt_ids) + len(s.response_ids) - 1
        in_range = not routes.size or -1 <= routes.min() <= routes.max() < num_experts
        if routes.size != positions * per_position or not in_range:
            raise MoerlError(
                f"sample {s.prompt_id!r}/{s.sample_index}: routed_experts holds {routes.size} ids in "
                f"[{routes.min() if routes.size else '-'}, {routes.max() if routes.size else '-'}], not {positions} "
                f"tokens x {layers} MoE layers x top-{top_k} expert ids in [-1, {num_experts}): the experience was "
                "recorded for another model; rerun its rollout"
            )
    return True


# ---------------------------------------------------------------------------------------------------------------
# The engine's recorded key selections (DeepSeek sparse attention; Generation.selected_keys), replayed with the routes


def selection_queries(sample: Sample, topk: int) -> int:
    """The sample's queries with a recorded selection: those at positions topk .. fed - 1 (fed = prompt + response
    - 1 tokens run through the model), each seeing more than topk keys."""
    return max(0, len(sample.prompt_ids) + len(sample.response_ids) - 1 - topk)


def sample_selection(sample: Sample, layers: int, topk: int) -> np.ndarray:
    """The sample's recorded selections as [queries, indexer layers, ceil(fed / 8)] uint8 key bits
    (check_selections has checked the size)."""
    assert sample.selected_keys is not None
    fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
    return sample.selected_keys.reshape(selection_queries(sample, topk), layers, (fed + 7) // 8)


def check_selections(samples: list[Sample], layers: int, topk: int, replay: bool) -> bool:
    """Whether the samples carry the key selections the trainer can compare with its indexers' (and replay): every
    sample's queries past topk x layers rows of key bits, each query selecting exactly topk keys at or before its
    own position. Samples without them: False, refused when `replay`; another size or selection: refused."""
    missing = [s for s in samples if s.selected_keys is None]
    if missing:
        if replay:
            s = missing[0]
            raise MoerlError(
                f"sample {s.prompt_id!r}/{s.sample_index}: the experience records no selected keys, which "
                "trainer.routing_replay: rollout replays for a model with DeepSeek sparse attention; rerun its "
                "rollout with this run config (its engine records them)"
            )
        return False
    for s in samples:
        assert s.selected_keys is not None
        fed, queries = len(s.prompt_ids) + len(s.response_ids) - 1, selection_queries(s, topk)
        problem = None
        if s.selected_keys.size != queries * layers * ((fed + 7) // 8):
            problem = f"holds {s.selected_keys.size} bytes, not {queries} queries x {layers} indexer layers x " \
                      f"{(fed + 7) // 8} bytes of key bits"  # fmt: skip
        else:
            rows = sample_selection(s, layers, topk)
            later = np.arange(fed)[None, :] > np.arange(topk, fed)[:, None]  # [queries, keys]: after the query
            for layer in range(layers):
                chosen = np.unpackbits(rows[:, layer], axis=-1, count=fed).astype(bool)
                if (chosen.sum(axis=-1) != topk).any() or (chosen & later).any():
                    problem = f"selects other than {topk} keys at or before a query's position in indexer layer {layer}"
                    break
        if problem:
            raise MoerlError(
                f"sample {s.prompt_id!r}/{s.sample_index}: selected_keys {problem}: the experience was recorded "
                "for another model; rerun its rollout"
            )
    return True


@dataclass
class SelectionEntry:
    """One sample's recorded queries in a forward call's layout: `record` [queries, layers, bytes] (the rows of
    sample_selection it contributes), their query slots `slots` [queries] in batch row `row`, and the key column of
    each key position s < len(columns)."""

    record: np.ndarray
    row: int
    slots: np.ndarray
    columns: np.ndarray


def selection_grid(
    entries: list[SelectionEntry], layers: int, shape: tuple[int, int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries laid out for a forward call of `shape` (rows, queries, keys): (bits [layers, rows, queries,
    ceil(keys / 8)] uint8, recorded [rows, queries] bool), as MoeCausalLM.set_engine_selections takes them. One
    layer's bool grid at a time: the host holds rows x queries x keys bytes, not that times the layers."""
    rows, queries, keys = shape
    bits = np.zeros((layers, rows, queries, (keys + 7) // 8), dtype=np.uint8)
    recorded = np.zeros((rows, queries), dtype=bool)
    for layer in range(layers):
        grid = np.zeros(shape, dtype=bool)
        for e in entries:
            chosen = np.unpackbits(e.record[:, layer], axis=-1, count=len(e.columns)).astype(bool)
            grid[e.row, e.slots[:, None], e.columns[None, :]] = chosen
        bits[layer] = np.packbits(grid, axis=-1)
    for e in entries:
        recorded[e.row, e.slots] = True
    return torch.from_numpy(bits).to(device), torch.from_numpy(recorded).to(device)
