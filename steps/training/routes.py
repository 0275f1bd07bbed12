"""The engine's recorded routes as the trainer reads them (routing replay, trainer.routing_replay; the routers'
disagreement in the update metrics): checked against the model, cut per sample, and laid out for a micro-batch
(steps/training/trainer.py collate and collate_groups put them in the order the MoE layers see the tokens)."""

from __future__ import annotations

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
