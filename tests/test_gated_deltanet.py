"""Gated DeltaNet (steps/models/gated_deltanet.py) against transformers' own code: the chunked delta rule equals
torch_recurrent_gated_delta_rule and the module's own token-by-token recurrence; packed rows give each sequence
what it gets alone (conv and delta rule, outputs and final states); the module loaded through either converter
matches Qwen3NextGatedDeltaNet and Qwen3_5MoeGatedDeltaNet, in a forward and decoding token by token; the
converters round-trip exactly.

Tolerances: transformers' delta rule computes in fp32 whatever its inputs, so comparisons with it hold atol 1e-5;
moerl against itself in fp64 holds atol 1e-10."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf35
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

from steps.models.gated_deltanet import (
    GatedDeltaNet,
    causal_conv1d,
    causal_conv1d_step,
    from_grouped_projections,
    from_separate_projections,
    gated_delta_rule_chunked,
    gated_delta_rule_step,
    l2norm,
    to_grouped_projections,
    to_separate_projections,
)

HF_TOL = dict(atol=1e-5, rtol=1e-5)
OWN_TOL = dict(atol=1e-10, rtol=1e-10)
SIZES = dict(hidden_size=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)  # fmt: skip
HEADS = (2, 4, 8, 6)  # Hk, Hv, Dk, Dv


def delta_inputs(batch: int, seq: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    """q, k [B, T, Hk, Dk] (L2-normalised), v [B, T, Hv, Dv], g <= 0 and beta in (0, 1) [B, T, Hv]."""
    gen = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv = HEADS
    q = l2norm(torch.randn(batch, seq, hk, dk, generator=gen, dtype=dtype))
    k = l2norm(torch.randn(batch, seq, hk, dk, generator=gen, dtype=dtype))
    v = torch.randn(batch, seq, hv, dv, generator=gen, dtype=dtype)
    g = -F.softplus(torch.randn(batch, seq, hv, generator=gen, dtype=dtype)) * 0.3
    beta = torch.rand(batch, seq, hv, generator=gen, dtype=dtype)
    return q, k, v, g, beta


def recurrence(q, k, v, g, beta, state):
    """gated_delta_rule_step token by token -> (out [B, T, Hv, Dv], final state)."""
    outs = []
    for t in range(q.shape[1]):
        out, state = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(out)
    return torch.stack(outs, dim=1), state


def test_chunked_equals_transformers_recurrence_and_the_step_recurrence():
    """T = 150 (two full chunks of 64 and a partial one), from a non-zero state."""
    q, k, v, g, beta = delta_inputs(2, 150)
    hv, dk, dv = HEADS[1:]
    state0 = torch.randn(2, hv, dk, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 0.1
    out, final = gated_delta_rule_chunked(q, k, v, g, beta, initial_state=state0)
    assert out.shape == v.shape and out.dtype == torch.float64 and final.shape == (2, hv, dk, dv)

    step_out, step_final = recurrence(q, k, v, g, beta, state0)
    torch.testing.assert_close(out, step_out, **OWN_TOL)
    torch.testing.assert_close(final, step_final, **OWN_TOL)

    hf_out, hf_final = hf_next.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state0, output_final_state=True
    )
    torch.testing.assert_close(out, hf_out, **HF_TOL)
    torch.testing.assert_close(final, hf_final.double(), **HF_TOL)
    hf_chunk_out, hf_chunk_final = hf_next.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=state0, output_final_state=True
    )
    torch.testing.assert_close(out, hf_chunk_out, **HF_TOL)
    torch.testing.assert_close(final, hf_chunk_final.double(), **HF_TOL)

    # a smaller chunk size, and fp32 inputs: the state stays fp32, the output comes back in v's dtype
    torch.testing.assert_close(gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=16, initial_state=state0)[0],
                               out, **OWN_TOL)  # fmt: skip
    out32, final32 = gated_delta_rule_chunked(*(x.float() for x in (q, k, v, g, beta)))
    assert out32.dtype == final32.dtype == torch.float32
    torch.testing.assert_close(out32, gated_delta_rule_chunked(q, k, v, g, beta)[0].float(), **HF_TOL)


def test_a_packed_row_gives_each_sequence_what_it_gets_alone():
    """Three sequences (70, 5 and 61 tokens: across chunk boundaries, and one shorter than the conv) in one row
    [1, 136], and the same with a second row of two sequences: outputs and per-sequence final states."""
    lengths = [[70, 5, 61], [100, 36]]
    q, k, v, g, beta = delta_inputs(2, 136, seed=3)
    segment_ids = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    out, finals = gated_delta_rule_chunked(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=32)
    assert finals.shape[0] == 5
    conv_x = torch.randn(2, 136, 12, dtype=torch.float64)
    weight = torch.randn(12, 4, dtype=torch.float64)
    conv = causal_conv1d(conv_x, weight, segment_ids)
    sequence = 0
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            part = slice(start, start + n)
            alone_out, alone_final = gated_delta_rule_chunked(
                *(x[row : row + 1, part] for x in (q, k, v, g, beta)), chunk_size=32
            )
            torch.testing.assert_close(out[row : row + 1, part], alone_out, **OWN_TOL)
            torch.testing.assert_close(finals[sequence : sequence + 1], alone_final, **OWN_TOL)
            step_out, step_final = recurrence(*(x[row : row + 1, part] for x in (q, k, v, g, beta)),
                                              torch.zeros_like(alone_final))  # fmt: skip
            torch.testing.assert_close(out[row : row + 1, part], step_out, **OWN_TOL)
            torch.testing.assert_close(finals[sequence : sequence + 1], step_final, **OWN_TOL)
            torch.testing.assert_close(conv[row : row + 1, part], causal_conv1d(conv_x[row : row + 1, part], weight),
                                       **OWN_TOL)  # fmt: skip
            start, sequence = start + n, sequence + 1
    # without segment_ids the state and the conv do run on from one sequence into the next
    assert not torch.allclose(gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=32)[0][0, 70:75], out[0, 70:75])
    assert not torch.allclose(causal_conv1d(conv_x, weight)[0, 70:73], conv[0, 70:73])
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_chunked(q, k, v, g, beta, segment_ids=segment_ids, initial_state=finals[:2])


def test_the_conv_matches_transformers_and_its_step():
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    weight = torch.randn(12, 4, dtype=torch.float64)
    out = causal_conv1d(x, weight)
    hf = hf_next.causal_conv1d_fn(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(out, hf, **OWN_TOL)
    state = torch.zeros(2, 12, 4, dtype=torch.float64)
    hf_state = state.clone()
    for t in range(9):
        step, state = causal_conv1d_step(x[:, t], state, weight)
        hf_step = hf_next.causal_conv1d_update(x[:, t, :, None], hf_state, weight, None, "silu")[..., 0]
        torch.testing.assert_close(step, out[:, t], **OWN_TOL)
        torch.testing.assert_close(step, hf_step, **OWN_TOL)
        torch.testing.assert_close(state, hf_state, **OWN_TOL)  # the same K inputs kept


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norm weights away from 1, so a (1 + w) norm would show), decays moderate."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
            if name == "A_log":
                p.copy_(torch.rand(p.shape, generator=gen).mul(2.0).log())


def copy_common(ours: GatedDeltaNet, hf: torch.nn.Module) -> None:
    """The parameters both layouts name alike: conv, A_log, dt_bias, norm, out_proj."""
    with torch.no_grad():
        ours.conv_weight.copy_(hf.conv1d.weight)
        ours.A_log.copy_(hf.A_log)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.norm_weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)


def check_forward_and_decode(ours: GatedDeltaNet, hf: torch.nn.Module) -> None:
    """Full forward (no cache) == transformers'; with left padding too; decode from init_state token by token ==
    the forward at each step; prefill half then decode == the forward."""
    hidden = torch.randn(2, 37, SIZES["hidden_size"], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(hidden)
        out = ours(hidden)
        torch.testing.assert_close(out, expected, **HF_TOL)

        mask = torch.ones(2, 37, dtype=torch.long)
        mask[1, :5] = 0  # left padding
        torch.testing.assert_close(ours(hidden, attention_mask=mask), hf(hidden, attention_mask=mask), **HF_TOL)

        state = ours.init_state(2)
        for t in range(37):
            step, state = ours.step(hidden[:, t], state)
            torch.testing.assert_close(step, expected[:, t], **HF_TOL)

        first, state = ours.prefill(hidden[:, :20])
        rest, _ = ours.prefill(hidden[:, 20:], state)
        torch.testing.assert_close(torch.cat([first, rest], dim=1), expected, **HF_TOL)
        step, _ = ours.step(hidden[:, 20], state)
        torch.testing.assert_close(step, expected[:, 20], **HF_TOL)


def test_the_module_loads_qwen3_next_and_matches_it():
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(num_hidden_layers=1, layer_types=["linear_attention"], **SIZES)
    hf = hf_next.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    randomize(hf, 1)
    ours = GatedDeltaNet.from_config(cfg, chunk_size=16)
    copy_common(ours, hf)
    with torch.no_grad():
        ours.projection.weight.copy_(from_grouped_projections(hf.in_proj_qkvz.weight, hf.in_proj_ba.weight, *HEADS))
    check_forward_and_decode(ours, hf)


def test_the_module_loads_qwen3_5_moe_and_matches_it():
    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(num_hidden_layers=1, layer_types=["linear_attention"], **SIZES)
    hf = hf35.Qwen3_5MoeGatedDeltaNet(cfg, layer_idx=0)
    randomize(hf, 2)
    ours = GatedDeltaNet.from_config(cfg, chunk_size=16)
    copy_common(ours, hf)
    weights = (hf.in_proj_qkv.weight, hf.in_proj_z.weight, hf.in_proj_b.weight, hf.in_proj_a.weight)
    with torch.no_grad():
        ours.projection.weight.copy_(from_separate_projections(*weights, *HEADS))
    check_forward_and_decode(ours, hf)


def test_a_packed_row_through_the_module():
    torch.manual_seed(0)
    ours = GatedDeltaNet(**SIZES, chunk_size=16)
    randomize(ours, 4)
    hidden = torch.randn(1, 50, SIZES["hidden_size"])
    segment_ids = torch.tensor([[0] * 20 + [1] * 3 + [2] * 27])
    with torch.no_grad():
        out = ours(hidden, segment_ids=segment_ids)
        for part in (slice(0, 20), slice(20, 23), slice(23, 50)):
            torch.testing.assert_close(out[:, part], ours(hidden[:, part]), atol=1e-6, rtol=1e-6)


def test_the_converters_round_trip_exactly():
    hk, hv, dk, dv = HEADS
    hidden = 5
    fused = torch.randn(2 * hk * dk + 2 * hv * dv + 2 * hv, hidden)
    qkvz, ba = to_grouped_projections(fused, *HEADS)
    assert qkvz.shape == (2 * hk * dk + 2 * hv * dv, hidden) and ba.shape == (2 * hv, hidden)
    assert torch.equal(from_grouped_projections(qkvz, ba, *HEADS), fused)
    assert torch.equal(torch.cat(to_grouped_projections(from_grouped_projections(qkvz, ba, *HEADS), *HEADS)),
                       torch.cat([qkvz, ba]))  # fmt: skip
    separate = to_separate_projections(fused, *HEADS)
    assert [t.shape[0] for t in separate] == [2 * hk * dk + hv * dv, hv * dv, hv, hv]
    assert torch.equal(from_separate_projections(*separate, *HEADS), fused)
    # the grouped layout: key group 1's rows start with its q head, then its k head, then its two value heads' v
    group = 2 * dk + 2 * (hv // hk) * dv
    assert torch.equal(qkvz[group : group + dk], fused[dk : 2 * dk])
    assert torch.equal(qkvz[group + dk : group + 2 * dk], fused[hk * dk + dk : hk * dk + 2 * dk])
    v_start = 2 * hk * dk + (hv // hk) * dv
    assert torch.equal(qkvz[group + 2 * dk : group + 2 * dk + 2 * dv], fused[v_start : v_start + 2 * dv])
    with pytest.raises(ValueError, match="do not fit"):
        from_separate_projections(*separate, 2, 4, 8, 5)


def test_the_chunked_gradients_are_the_recurrences():
    """Training differentiates the chunked form (the triangular solves, the realigned packed row): its gradients
    equal those of the token-by-token recurrence, each sequence from zero."""
    inputs = [x.requires_grad_() for x in delta_inputs(1, 40, seed=5)]
    segment_ids = torch.tensor([[0] * 25 + [1] * 15])
    weights = torch.randn(1, 40, HEADS[1], HEADS[3], dtype=torch.float64)
    out, finals = gated_delta_rule_chunked(*inputs, segment_ids=segment_ids, chunk_size=16)
    grads = torch.autograd.grad((out * weights).sum() + finals.sum(), inputs)
    loss = 0
    for part in (slice(0, 25), slice(25, 40)):
        step_out, step_final = recurrence(*(x[:, part] for x in inputs), torch.zeros_like(finals[:1]))
        loss = loss + (step_out * weights[:, part]).sum() + step_final.sum()
    for got, want in zip(grads, torch.autograd.grad(loss, inputs), strict=True):
        torch.testing.assert_close(got, want, **OWN_TOL)
