"""Left padding: positions come from the attention mask, so a padded row computes what it computes alone."""

import pytest
import torch
from model_helpers import randomize_

from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM

CONFIG = MoeConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
    mlp_only_layers=[1], norm_topk_prob=True, rope_theta=1000.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = MoeForCausalLM(CONFIG)
    randomize_(m, seed=1)
    return m.eval()


def left_padded_prompts(lengths, width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab_size, (len(lengths), width), generator=gen)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return ids, mask


@torch.no_grad()
def test_left_padded_row_equals_the_same_prompt_alone(model):
    """Positions come from the mask: padding shifts nothing, so a padded row equals its unpadded forward."""
    ids, mask = left_padded_prompts([9, 4], width=9, seed=3)
    batched = model(ids, mask)
    alone = model(ids[1:, 5:])
    torch.testing.assert_close(batched[1, 5:], alone[0], atol=1e-5, rtol=0)
    assert not torch.isnan(batched).any()  # padding queries see their own slot, never an empty row
