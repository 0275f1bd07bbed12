"""DeepSeek-V3.2's layers, matching transformers 5.23's DeepseekV32ForCausalLM: DeepSeek-V3's model
(steps/models/deepseek_v3/model.py: its MoE block and dense MLP) with the shared indexed multi-head latent attention
and decoder layer (steps/models/dsa.py: the lightning indexer's selection applied in every layer, in training, over
packed rows and shared prompts, and in the torch engine's decode). Module names are the checkpoint's tensor names
(the indexer's under self_attn.indexer.), so the state-dict adapter maps them one to one.
"""

from __future__ import annotations

from torch import nn

from steps.models.deepseek_v3.model import DeepseekV3ForCausalLM
from steps.models.deepseek_v32.config import DeepseekV32Config
from steps.models.dsa import IndexedDecoderLayer, IndexedMlaAttention


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 causal LM: DeepSeek-V3's, its layers indexed; without its multi-token-prediction layer; the
    indexers are frozen (steps/models/dsa.py), the routers' correction bias a buffer."""

    config: DeepseekV32Config
    layer_class = IndexedDecoderLayer
    attention_class = IndexedMlaAttention

    def init_extra(self, module: nn.Module) -> None:
        """DeepSeek-V3's rule, and the indexer's LayerNorm at (1, 0), as DeepseekV32PreTrainedModel."""
        super().init_extra(module)
        if isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
