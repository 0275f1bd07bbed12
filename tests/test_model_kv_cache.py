"""Incremental decoding with the KV cache gives the logits of one full forward, left padding included."""

import copy

import pytest
import torch
from model_helpers import randomize_

from steps.model import MoeConfig, MoeForCausalLM

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
def test_prefill_then_decode_equals_full_forward(model):
    ids, mask = left_padded_prompts([7, 3, 5], width=7)
    steps = 6
    new_tokens = torch.randint(0, CONFIG.vocab_size, (3, steps), generator=torch.Generator().manual_seed(2))

    cache = model.new_kv_cache(batch_size=3, max_len=7 + steps)
    step_logits = [model(ids, mask, kv_cache=cache)[:, -1]]
    for i in range(steps):
        step_logits.append(model(new_tokens[:, i : i + 1], kv_cache=cache)[:, -1])
    assert cache.length == 7 + steps
    assert cache.next_position.tolist() == [7 + steps, 3 + steps, 5 + steps]

    full_ids = torch.cat([ids, new_tokens], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(new_tokens)], dim=1)
    full = model(full_ids, full_mask)
    for i, logits in enumerate(step_logits):
        torch.testing.assert_close(logits, full[:, 6 + i], atol=1e-5, rtol=0)
    assert full.abs().mean() > 0.1


@torch.no_grad()
def test_left_padded_row_equals_the_same_prompt_alone(model):
    """Positions come from the mask: padding shifts nothing, so a padded row equals its unpadded forward."""
    ids, mask = left_padded_prompts([9, 4], width=9, seed=3)
    batched = model(ids, mask)
    alone = model(ids[1:, 5:])
    torch.testing.assert_close(batched[1, 5:], alone[0], atol=1e-5, rtol=0)
    assert not torch.isnan(batched).any()  # padding queries see their own slot, never an empty row


@torch.no_grad()
def test_chunked_prefill_and_padding_steps_equal_full_forward(model):
    """Prefill in two chunks, then a step where row 0 is finished and feeds padding (mask 0)."""
    ids, mask = left_padded_prompts([8, 2], width=8, seed=4)
    cache = model.new_kv_cache(batch_size=2, max_len=12)
    model(ids[:, :5], mask[:, :5], kv_cache=cache)
    chunk_logits = model(ids[:, 5:], mask[:, 5:], kv_cache=cache)
    full = model(ids, mask)
    torch.testing.assert_close(chunk_logits, full[:, 5:], atol=1e-5, rtol=0)

    step_ids = torch.tensor([[0, 11], [0, 12]])  # row 0 pads both steps, row 1 decodes
    step_mask = torch.tensor([[0, 0], [1, 1]])
    out = [model(step_ids[:, i : i + 1], step_mask[:, i : i + 1], kv_cache=cache)[:, -1] for i in range(2)]
    assert cache.next_position.tolist() == [8, 4]
    full = model(torch.cat([ids, step_ids], dim=1), torch.cat([mask, step_mask], dim=1))
    torch.testing.assert_close(out[1][1], full[1, -1], atol=1e-5, rtol=0)
    # Row 0's padding slots are invisible to its next real token.
    follow = model(torch.tensor([[5], [6]]), kv_cache=cache)[:, -1]
    alone = model(torch.cat([ids[:1], torch.tensor([[5]])], dim=1))
    torch.testing.assert_close(follow[0], alone[0, -1], atol=1e-5, rtol=0)


@torch.no_grad()
def test_select_keeps_rows_and_their_state(model):
    ids, mask = left_padded_prompts([6, 3, 4], width=6, seed=5)
    cache = model.new_kv_cache(batch_size=3, max_len=8)
    model(ids, mask, kv_cache=cache)
    kept = cache.select(torch.tensor([0, 2]))
    nxt = torch.tensor([[7], [9]])
    got = model(nxt, kv_cache=kept)[:, -1]
    rows = torch.tensor([0, 2])
    full_mask = torch.cat([mask[rows], torch.ones(2, 1, dtype=torch.long)], dim=1)
    full = model(torch.cat([ids[rows], nxt], dim=1), full_mask)
    torch.testing.assert_close(got, full[:, -1], atol=1e-5, rtol=0)


def test_cache_overflow_is_an_error(model):
    cache = model.new_kv_cache(batch_size=1, max_len=4)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="KVCache full: 4 \\+ 1 > max_len 4"):
            model(torch.zeros(1, 1, dtype=torch.long), kv_cache=cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.no_grad()
def test_cuda_decode_matches_cpu_full_forward(model):
    """On CUDA, SDPA picks a different kernel for the masked attention; fp32 results stay close to the CPU."""
    cuda_model = copy.deepcopy(model).cuda()
    ids, mask = left_padded_prompts([6, 2, 4], width=6, seed=6)
    new_tokens = torch.randint(0, CONFIG.vocab_size, (3, 4), generator=torch.Generator().manual_seed(7))
    cache = cuda_model.new_kv_cache(batch_size=3, max_len=10)
    step_logits = [cuda_model(ids.cuda(), mask.cuda(), kv_cache=cache)[:, -1]]
    for i in range(4):
        step_logits.append(cuda_model(new_tokens[:, i : i + 1].cuda(), kv_cache=cache)[:, -1])
    full = model(torch.cat([ids, new_tokens], dim=1), torch.cat([mask, torch.ones_like(new_tokens)], dim=1))
    for i, logits in enumerate(step_logits):
        torch.testing.assert_close(logits.cpu(), full[:, 5 + i], atol=1e-4, rtol=0)
    bf16 = copy.deepcopy(model).cuda().to(torch.bfloat16)
    assert torch.isfinite(bf16(ids.cuda(), mask.cuda())).all()
