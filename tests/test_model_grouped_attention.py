"""steps.models.kernels.grouped_attention (Attention.attend on CPU) equals SDPA over the kv heads repeated to the query
heads, forward and backward, with padding and causal masks and with more keys than queries (shared prompts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from steps.models.kernels import grouped_attention


@pytest.mark.parametrize(("seq", "keys"), [(7, 7), (5, 12)])
def test_grouped_attention_equals_sdpa_with_repeated_kv_heads(seq, keys):
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, scale = 3, 4, 2, 8, 8**-0.5
    q = torch.randn(batch, heads, seq, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, keys, dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, keys, dim, requires_grad=True)
    query_slot = torch.arange(keys - seq, keys)[:, None]
    key_slot = torch.arange(keys)[None, :]
    valid = torch.rand(batch, keys) > 0.3
    mask = ((key_slot <= query_slot)[None] & valid[:, None, :]) | (key_slot == query_slot)[None]
    mask = mask[:, None]  # [B, 1, T, S]; every query sees its own slot
    grad = torch.randn(batch, heads, seq, dim)

    out = grouped_attention(q, k, v, mask, scale)
    got = torch.autograd.grad(out, (q, k, v), grad)
    groups = heads // kv_heads
    reference = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), attn_mask=mask, scale=scale
    )
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)
    for name, a, b in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)


def test_values_narrower_than_keys_as_multi_head_latent_attention_has():
    """MLA's keys (nope + rope dims) are wider than its values: the output and the gradients take each's size."""
    torch.manual_seed(1)
    batch, heads, seq, dim, value_dim, scale = 2, 4, 5, 12, 8, 12**-0.5
    q = torch.randn(batch, heads, seq, dim, requires_grad=True)
    k = torch.randn(batch, heads, seq, dim, requires_grad=True)
    v = torch.randn(batch, heads, seq, value_dim, requires_grad=True)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None].expand(batch, 1, seq, seq)
    grad = torch.randn(batch, heads, seq, value_dim)
    out = grouped_attention(q, k, v, mask, scale)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    assert out.shape == (batch, heads, seq, value_dim)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=0)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(reference, (q, k, v), grad)
    for name, a, b in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
