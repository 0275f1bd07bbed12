"""Kimi-K2.5's Hugging Face tensor names, as the release holds them: DeepSeek-V3's language model
(steps/models/deepseek_v3/state_dict_adapter.py) under `language_model.` (language_model.model.layers.N...,
language_model.lm_head.weight), and the vision tower and projector as vision.py names them (vision_tower.*,
mm_projector.*), carried. The model names its language model as DeepSeek-V3's does (model.*, lm_head) and the carried
tensors under `vision.`; to_hf and from_hf add and strip the prefixes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from steps.models.deepseek_v3.state_dict_adapter import DeepseekV3StateDictAdapter
from steps.models.kimi_k25.config import KimiK25Config
from steps.models.kimi_k25.vision import carried_shapes

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement

LANGUAGE_MODEL = "language_model."  # the release's prefix of DeepSeek-V3's names
CARRIED = "vision."  # the model's module of the carried tensors


def carried(cfg: KimiK25Config) -> dict[str, tuple[int, ...]]:
    """The vision tower's and projector's checkpoint tensors -> shape: what the family carries unchanged."""
    return carried_shapes(cfg.vision_config, cfg.hidden_size, cfg.projection_hidden_size)


def _to_hf_name(name: str) -> str:
    return name.removeprefix(CARRIED) if name.startswith(CARRIED) else LANGUAGE_MODEL + name


class KimiK25StateDictAdapter(DeepseekV3StateDictAdapter):
    """Kimi-K2.5 checkpoint names (steps/models/family.py StateDictAdapter)."""

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """DeepSeek-V3's (multi-token-prediction layers) for the language model's names."""
        return (
            super().dropped_on_import(cfg, name.removeprefix(LANGUAGE_MODEL))
            if name.startswith(LANGUAGE_MODEL)
            else None
        )

    def expected_shapes(
        self, cfg: KimiK25Config, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """DeepSeek-V3's tensors under language_model., then the carried tower and projector."""
        shapes = {
            LANGUAGE_MODEL + name: shape for name, shape in super().expected_shapes(cfg, placement, ep_rank).items()
        }
        shapes.update(carried(cfg))
        return shapes

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_to_hf_name(name): tensor for name, tensor in state.items()}

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            name.removeprefix(LANGUAGE_MODEL) if name.startswith(LANGUAGE_MODEL) else CARRIED + name: tensor
            for name, tensor in state.items()
        }
