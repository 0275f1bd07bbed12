"""Kimi-K2.5's model: DeepSeek-V3's language model (steps/models/deepseek_v3/model.py) trained on text, and `vision`,
the vision tower's and projector's tensors carried unchanged (steps/models/carried.py; names: vision.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from steps.models.carried import CarriedTensors
from steps.models.deepseek_v3.model import DeepseekV3ForCausalLM
from steps.models.kimi_k25.config import KimiK25Config
from steps.models.kimi_k25.vision import carried_shapes

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class KimiK25ForCausalLM(DeepseekV3ForCausalLM):
    """Kimi-K2.5's language model with its vision tower and projector carried (module `vision`)."""

    config: KimiK25Config

    def __init__(self, config: KimiK25Config, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__(config, placement, ep_rank)
        self.vision = CarriedTensors(
            carried_shapes(config.vision_config, config.hidden_size, config.projection_hidden_size)
        )
