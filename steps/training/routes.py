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
from steps.models.layers import SelectionShape


def fed_tokens(sample: Sample) -> int:
    """The tokens run through the model for a sample: prompt + response - 1 (the last sampled one never is)."""
    return len(sample.prompt_ids) + len(sample.response_ids) - 1


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
        positions = fed_tokens(s)
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


def sample_selection(sample: Sample, shape: SelectionShape) -> np.ndarray:
    """The sample's recorded selections as [queries, indexer layers, ceil(keys / 8)] uint8 key bits
    (check_selections has checked the size)."""
    assert sample.selected_keys is not None
    fed = fed_tokens(sample)
    return sample.selected_keys.reshape(shape.queries(fed), shape.layers, (shape.keys(fed) + 7) // 8)


def check_selections(samples: list[Sample], shape: SelectionShape, replay: bool) -> bool:
    """Whether the samples carry the key selections the trainer can compare with its indexers' (and replay): every
    sample's recorded queries (SelectionShape.queries) x layers rows of key bits, each query selecting exactly topk
    keys among those it sees. Samples without them: False, refused when `replay`; another size or selection:
    refused."""
    missing = [s for s in samples if s.selected_keys is None]
    if missing:
        if replay:
            s = missing[0]
            raise MoerlError(
                f"sample {s.prompt_id!r}/{s.sample_index}: the experience records no selected keys, which "
                "trainer.routing_replay: rollout replays for a model with indexers (DeepSeek sparse attention, "
                "DeepSeek-V4); rerun its rollout with this run config (its engine records them)"
            )
        return False
    for s in samples:
        assert s.selected_keys is not None
        fed = fed_tokens(s)
        queries, keys, layers = shape.queries(fed), shape.keys(fed), shape.layers
        problem = None
        if s.selected_keys.size != queries * layers * ((keys + 7) // 8):
            problem = f"holds {s.selected_keys.size} bytes, not {queries} queries x {layers} indexer layers x " \
                      f"{(keys + 7) // 8} bytes of key bits"  # fmt: skip
        else:
            rows = sample_selection(s, shape)
            positions = np.arange(shape.first_query, fed)
            unseen = np.arange(keys)[None, :] >= ((positions + 1) // shape.rate)[:, None]  # [queries, keys]
            for layer in range(layers):
                chosen = np.unpackbits(rows[:, layer], axis=-1, count=keys).astype(bool)
                if (chosen.sum(axis=-1) != shape.topk).any() or (chosen & unseen).any():
                    problem = f"selects other than {shape.topk} keys a query sees in indexer layer {layer}"
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


def forward_selections(
    rows: list[Sample], fed: np.ndarray, width: int, packed: bool, shape: SelectionShape, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded key selections of a plain micro-batch (collate) for `forward`: its rows [B, width] (row b's slot
    p its position p), or the packed row [1, sum(fed)] (each sequence after the earlier ones); keys as the queries'
    slots, or (over_windows: DeepSeek-V4's entries) the sequence's window index."""
    entries = []
    starts = np.concatenate([[0], np.cumsum(fed)[:-1]])
    for b, s in enumerate(rows):
        row, offset = (0, int(starts[b])) if packed else (b, 0)
        keys = np.arange(shape.keys(int(fed[b])))
        entries.append(SelectionEntry(sample_selection(s, shape), row, offset + np.arange(shape.first_query, fed[b]),
                                      keys if shape.over_windows else offset + keys))  # fmt: skip
    queries = int(fed.sum()) if packed else width
    columns = max((shape.keys(int(n)) for n in fed), default=0) if shape.over_windows else queries
    return selection_grid(entries, shape.layers, (1 if packed else len(rows), queries, columns), device)


def shared_prompt_selections(
    samples: list[Sample],
    ids: list[int],
    prompt_order: list[str],
    prompt_len: int,
    response_len: int,
    shape: SelectionShape,
    device: torch.device,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The recorded key selections of a shared-prompt micro-batch (collate_groups): "prompts" [G, P, keys] from each
    prompt's first sample (the queries of the left-padded prompt row), "responses" [B, T, keys] (a response query's
    keys: its prompt's columns, then its own; over_windows: the sequence's windows)."""
    first: dict[str, Sample] = {}
    for i in ids:
        first.setdefault(samples[i].prompt_id, samples[i])
    prompt_entries, prompt_keys = [], 0
    for row, prompt_id in enumerate(prompt_order):
        s = first[prompt_id]
        n, pad = len(s.prompt_ids), prompt_len - len(s.prompt_ids)
        queries, keys = np.arange(shape.first_query, n), np.arange(shape.keys(n))
        prompt_keys = max(prompt_keys, len(keys))
        prompt_entries.append(SelectionEntry(sample_selection(s, shape)[: len(queries)], row, pad + queries,
                                             keys if shape.over_windows else pad + keys))  # fmt: skip
    response_entries, response_keys = [], 0
    for row, i in enumerate(ids):
        s = samples[i]
        n, fed = len(s.prompt_ids), fed_tokens(s)
        queries, keys = np.arange(max(n, shape.first_query), fed), np.arange(shape.keys(fed))
        response_keys = max(response_keys, len(keys))
        columns = keys if shape.over_windows else np.where(keys < n, prompt_len - n + keys, prompt_len + keys - n)
        response_entries.append(SelectionEntry(sample_selection(s, shape)[queries - shape.first_query], row,
                                               queries - n, columns))  # fmt: skip
    if not shape.over_windows:
        prompt_keys, response_keys = prompt_len, prompt_len + response_len
    return {
        "prompts": selection_grid(prompt_entries, shape.layers, (len(prompt_order), prompt_len, prompt_keys), device),
        "responses": selection_grid(response_entries, shape.layers, (len(ids), response_len, response_keys), device),
    }
