"""The MoE slot plumbing (steps.models.moe.SlotOrder): gathering tokens into expert-grouped slots and combining the
experts' outputs with the router weights give the values and gradients of plain indexing, for any top-k."""

from __future__ import annotations

import pytest
import torch

from steps.models.moe import SlotOrder


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_gather_and_combine_match_plain_indexing(top_k):
    gen = torch.Generator().manual_seed(top_k)
    tokens, hidden, experts = 11, 5, 6
    topk_idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.rand(tokens, top_k, generator=gen, dtype=torch.float64)
    scale = torch.randn(experts, hidden, generator=gen, dtype=torch.float64)  # a per-expert "expert"
    probe = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)

    def run(use_slots: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if use_slots:
            slots = SlotOrder.of(topk_idx, experts)
            grouped = slots.gather(xs)  # [T*k, H], grouped by expert
            assert torch.equal(slots.counts, torch.bincount(topk_idx.reshape(-1), minlength=experts))
            expert_of_row = topk_idx.reshape(-1)[slots.order]
            assert torch.equal(expert_of_row, expert_of_row.sort().values)  # grouped by expert id
            out = slots.combine(grouped * scale[expert_of_row], ws)
        else:
            per_slot = xs.unsqueeze(1) * scale[topk_idx]  # [T, k, H]
            out = (per_slot * ws.unsqueeze(-1)).sum(1)
        (out * probe).sum().backward()
        return out.detach(), xs.grad, ws.grad

    for got, expected in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_no_tokens_give_empty_outputs_and_gradients():
    slots = SlotOrder.of(torch.zeros((0, 2), dtype=torch.long), 4)
    x = torch.zeros((0, 3), requires_grad=True)
    w = torch.zeros((0, 2), requires_grad=True)
    out = slots.combine(slots.gather(x), w)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert x.grad.shape == (0, 3) and w.grad.shape == (0, 2)
