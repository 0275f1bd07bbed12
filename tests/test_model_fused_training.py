"""The training forward/backward of MoeForCausalLM's non-expert part (fused q/k/v projection, RMSNorm, per-head
norm + RoPE, grouped attention and token log-probs as autograd Functions with hand-written backwards) gives
the logits and the gradient of every parameter that the plain autograd formulas give, and each Function
passes torch.autograd.gradcheck in float64."""

import pytest
import torch
import torch.nn.functional as F

from steps.models.hf_checkpoint import expected_tensor_shapes
from steps.models.kernels import QKVHeads, TokenLogprobs, grouped_attention, rms_norm, token_logprobs
from steps.models.layers import attention_mask_for, rotary_cos_sin
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM


def tiny_config(attention_bias: bool) -> MoeConfig:
    return MoeConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        attention_bias=attention_bias, pad_token_id=0,
    )  # fmt: skip


# -- the reference: the formulas in plain autograd ops, as Qwen3MoeForCausalLM writes them -------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def reference_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def reference_logits(model: MoeForCausalLM, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    cfg = model.config
    batch, seq = ids.shape
    heads, kv_heads, dim, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    valid = attention_mask.bool()
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = ((causal[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)[None])[:, None]
    cos, sin = rotary_cos_sin(positions, dim, cfg.rope_theta, torch.float32)
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        attn = layer.self_attn
        h = reference_rms_norm(x, layer.input_layernorm.weight, eps)
        q = F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(batch, seq, heads, dim)
        k = F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(batch, seq, kv_heads, dim)
        v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(batch, seq, kv_heads, dim).transpose(1, 2)
        q = reference_rotary(reference_rms_norm(q, attn.q_norm.weight, eps).transpose(1, 2), cos, sin)
        k = reference_rotary(reference_rms_norm(k, attn.k_norm.weight, eps).transpose(1, 2), cos, sin)
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = (q @ k.transpose(-1, -2) * dim**-0.5).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * dim))
        x = x + layer.mlp(reference_rms_norm(x, layer.post_attention_layernorm.weight, eps))
    x = reference_rms_norm(x, model.model.norm.weight, eps)
    return F.linear(x, model.lm_head.weight).float()


def reference_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def perturbed_model(cfg: MoeConfig) -> MoeForCausalLM:
    """Norm weights away from 1 and non-zero biases, so that their gradients and effects are exercised."""
    torch.manual_seed(0)
    model = MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def gradients(model: MoeForCausalLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone() for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("attention_bias", [False, True])
def test_fused_training_forward_and_gradients_match_plain_autograd(attention_bias: bool) -> None:
    cfg = tiny_config(attention_bias)
    model = perturbed_model(cfg)
    torch.manual_seed(1)
    batch, seq = 6, 9
    ids = torch.randint(3, cfg.vocab_size, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    for row, padding in enumerate([0, 3, 1, 5, 0, 2]):  # left-padded prompts of different lengths
        attention_mask[row, :padding] = 0
        ids[row, :padding] = 0
    targets = torch.randint(3, cfg.vocab_size, (batch, seq))
    loss_weights = torch.randn(batch, seq) * attention_mask

    logits = model(ids, attention_mask)
    logprobs = token_logprobs(logits, targets)
    grads = gradients(model, (logprobs * loss_weights).sum())

    expected_logits = reference_logits(model, ids, attention_mask)
    expected_logprobs = reference_token_logprobs(expected_logits, targets)
    expected_grads = gradients(model, (expected_logprobs * loss_weights).sum())

    torch.testing.assert_close(logits, expected_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-6, rtol=0)
    assert grads.keys() == expected_grads.keys()
    checked = 0
    for name, expected in expected_grads.items():
        scale = expected.norm()
        if scale == 0:  # an expert no token was routed to, or the padding row of the embedding
            assert grads[name].norm() == 0, name
            continue
        relative = ((grads[name] - expected).norm() / scale).item()
        assert relative <= 1e-5, f"{name}: relative gradient error {relative:.2e}"
        checked += 1
    attention_params = 4 * (2 if attention_bias else 1) + 2
    assert checked >= cfg.num_hidden_layers * (attention_params + 3) + 2  # every non-expert parameter at least


def test_state_dict_names_are_the_checkpoint_names() -> None:
    cfg = tiny_config(attention_bias=True)
    model = MoeForCausalLM(cfg)
    assert set(model.state_dict()) == set(expected_tensor_shapes(cfg))
    assert {name for name, _ in model.named_parameters()} == set(expected_tensor_shapes(cfg))


def test_rms_norm_gradcheck_float64() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = (1 + 0.3 * torch.randn(8, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, weight))


def test_rms_norm_forward_is_the_formula_bit_for_bit() -> None:
    """With and without autograd (the rollout engine calls the norms under no_grad)."""
    torch.manual_seed(0)
    x = torch.randn(5, 7, 24)
    weight = (1 + 0.3 * torch.randn(24)).requires_grad_()
    expected = reference_rms_norm(x, weight, 1e-6)
    assert torch.equal(rms_norm(x, weight, 1e-6), expected)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, weight, 1e-6), expected)


def test_rms_norm_bfloat16_keeps_qwen3_semantics() -> None:
    """fp32 statistics, cast back to bf16 before the (bf16) weight multiply: the same output as the formula,
    and gradients as autograd of the formula computes them."""
    torch.manual_seed(0)
    x = torch.randn(4, 7, 32).to(torch.bfloat16).requires_grad_()
    weight = (1 + 0.3 * torch.randn(32)).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(4, 7, 32).to(torch.bfloat16)
    out = rms_norm(x, weight, 1e-6)
    expected = reference_rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    got = torch.autograd.grad(out, (x, weight), grad)
    want = torch.autograd.grad(expected, (x, weight), grad)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


def test_qk_norm_rotary_gradcheck_float64() -> None:
    torch.manual_seed(0)
    batch, seq, heads, kv_heads, dim = 2, 3, 4, 2, 6
    qkv = torch.randn(batch, seq, (heads + 2 * kv_heads) * dim, dtype=torch.float64, requires_grad=True)
    q_weight = (1 + 0.3 * torch.randn(dim, dtype=torch.float64)).requires_grad_()
    k_weight = (1 + 0.3 * torch.randn(dim, dtype=torch.float64)).requires_grad_()
    positions = torch.tensor([[0, 1, 2], [0, 0, 1]])
    cos, sin = rotary_cos_sin(positions, dim, 10000.0, torch.float64)

    def heads_of(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return QKVHeads.apply(qkv, q_weight, k_weight, cos, sin, heads, kv_heads, 1e-6)

    assert torch.autograd.gradcheck(heads_of, (qkv, q_weight, k_weight))
    # and the forward is rms_norm then rotate_half RoPE, per head
    q, k, v = heads_of(qkv, q_weight, k_weight)
    split = qkv.detach().view(batch, seq, heads + 2 * kv_heads, dim)
    want_q = reference_rotary(reference_rms_norm(split[:, :, :heads], q_weight, 1e-6).transpose(1, 2), cos, sin)
    want_k = reference_rotary(
        reference_rms_norm(split[:, :, heads : heads + kv_heads], k_weight, 1e-6).transpose(1, 2), cos, sin
    )
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(v, split[:, :, heads + kv_heads :].transpose(1, 2))


def test_grouped_attention_and_token_logprobs_gradcheck_float64() -> None:
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 5, 6
    q = torch.randn(batch, heads, seq, dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, dim, dtype=torch.float64, requires_grad=True)
    valid = torch.tensor([[True] * seq, [False, False] + [True] * (seq - 2)])
    mask = attention_mask_for(valid, 0, seq)
    assert torch.autograd.gradcheck(lambda q, k, v: grouped_attention(q, k, v, mask, dim**-0.5), (q, k, v))

    logits = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 7, (3, 4))
    # token_logprobs casts to float32: check its Function in float64, and token_logprobs against the formula
    assert torch.autograd.gradcheck(lambda logits: TokenLogprobs.apply(logits, targets.unsqueeze(-1)), (logits,))
    torch.testing.assert_close(token_logprobs(logits, targets), reference_token_logprobs(logits.float(), targets))


def test_project_bfloat16_matches_the_formulas() -> None:
    """The fused q/k/v path keeps the dtypes of the unfused one in bf16: per-head norm statistics in fp32,
    the weight multiply and RoPE in bf16, gradients back in bf16."""
    cfg = tiny_config(attention_bias=True)
    attn = perturbed_model(cfg).to(torch.bfloat16).model.layers[0].self_attn
    torch.manual_seed(2)
    batch, seq, heads, kv_heads, dim = 3, 5, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = torch.randn(batch, seq, cfg.hidden_size).to(torch.bfloat16).requires_grad_()
    cos, sin = rotary_cos_sin(torch.arange(seq)[None].expand(batch, seq), dim, cfg.rope_theta, torch.bfloat16)
    params = (x, attn.q_proj.weight, attn.k_proj.bias, attn.v_proj.weight, attn.q_norm.weight, attn.k_norm.weight)

    q, k, v = attn.project(x, (cos, sin))
    want_q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(batch, seq, heads, dim)
    want_k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(batch, seq, kv_heads, dim)
    want_v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(batch, seq, kv_heads, dim).transpose(1, 2)
    want_q = reference_rotary(reference_rms_norm(want_q, attn.q_norm.weight, 1e-6).transpose(1, 2), cos, sin)
    want_k = reference_rotary(reference_rms_norm(want_k, attn.k_norm.weight, 1e-6).transpose(1, 2), cos, sin)
    for got, want in ((q, want_q), (k, want_k), (v, want_v)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    grad_q, grad_k, grad_v = (torch.randn(t.shape).to(torch.bfloat16) for t in (q, k, v))
    got = torch.autograd.grad((q, k, v), params, (grad_q, grad_k, grad_v))
    want = torch.autograd.grad((want_q, want_k, want_v), params, (grad_q, grad_k, grad_v))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 2e-2
