"""The policy model's hand-written autograd Functions, each with the public function the model calls.

autograd's graph of these formulas is many small ops per layer, and the training step on the demo model is
bound by their count, so each is one node with a backward written out:
  rms_norm          weight * (x / rms(x)), computed in fp32 (RMSNormFunction);
  QKVHeads          the fused q/k/v projection's output -> per-head RMSNormed, rotated q and k, and v;
  grouped_attention softmax(q k^T * scale, masked) v with the kv heads shared by their query groups (the CPU
                    path of steps.models.layers.softmax_attention);
  token_logprobs    log p(target) under the logits, log_softmax in fp32 (TokenLogprobs).
Each computes exactly the arithmetic of the plain formulas (tests/test_model_fused_training.py); the modules
that use them are the families' (steps/models/qwen3_moe/model.py) and the shared layers (steps/models/layers.py).
"""

from __future__ import annotations

from typing import Any

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms are computed in: fp32 for fp32 and narrower inputs (as Qwen3MoeRMSNorm), fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _rms_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x / rms(x) over the last dim, 1 / rms(x)), both in the compute dtype."""
    x32 = x.to(_compute_dtype(x.dtype))
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * rstd, rstd


def _rms_normalize_backward(
    grad: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """d/dx of normed = x * rstd(x), given the gradient of normed (all in the compute dtype):
    rstd * (grad - normed * mean(grad * normed)), written into `out` when given."""
    dot = (grad * normed).mean(-1, keepdim=True)
    return torch.addcmul(grad * rstd, normed, dot * rstd, value=-1, out=out)


class RMSNormFunction(torch.autograd.Function):
    """weight * (x / rms(x)).to(x.dtype), with a hand-written backward: autograd's graph of the formula is
    about twenty small ops per norm, and the training step on the demo model is bound by their count."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed, rstd = _rms_normalize(x, eps)
        normed_x = normed.to(x.dtype)
        ctx.save_for_backward(normed, rstd, normed_x, weight)
        ctx.x_dtype = x.dtype
        return weight * normed_x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        normed, rstd, normed_x, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed_x).sum_to_size(weight.shape).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = (grad * weight).to(ctx.x_dtype).to(normed.dtype)
            grad_x = _rms_normalize_backward(grad_normed, normed, rstd).to(ctx.x_dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim: computed in fp32, cast back to x's dtype before the weight."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps)
    # Inference (the rollout engine calls the norms token by token): the same ops, without a Function's cost.
    return weight * _rms_normalize(x, eps)[0].to(x.dtype)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> None:
    """RoPE in Qwen3's rotate-half form, out = x * cos + sign * (-x2, x1) * sin for x = (x1, x2) halves,
    written half by half into `out` (any strides): no rotated copy of x. sign -1 gives the transpose (the
    backward of the rotation)."""
    half = x.shape[-1] // 2
    x1, x2, out1, out2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos[..., :half], out=out1)
    out1.addcmul_(x2, sin[..., :half], value=-sign)
    torch.mul(x2, cos[..., half:], out=out2)
    out2.addcmul_(x1, sin[..., half:], value=sign)


class QKVHeads(torch.autograd.Function):
    """The fused q/k/v projection output [B, T, (heads + 2 kv_heads) * D] -> q [B, heads, T, D] and k, v
    [B, kv_heads, T, D] (contiguous): q and k per-head RMSNormed (q_weight, k_weight) then rotated (cos, sin
    [B, T, D]), v as is. One node with a hand-written backward instead of autograd's graph of two norms,
    two rotations (negations, concatenations) and the transposes; the same arithmetic as rms_norm then
    rotate-half RoPE, and the rotated heads are written straight into the [B, heads, T, D] layout attention
    wants."""

    @staticmethod
    def forward(
        ctx: Any,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = qkv.shape
        dim = q_weight.shape[0]
        qk = qkv[..., : (heads + kv_heads) * dim].view(batch, seq, heads + kv_heads, dim)
        normed, rstd = _rms_normalize(qk, eps)
        normed_x = normed.to(qkv.dtype)
        weight = torch.cat([q_weight.expand(heads, dim), k_weight.expand(kv_heads, dim)])  # [heads + kv, D]
        y = weight * normed_x
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]
        q = y.new_empty(batch, heads, seq, dim)
        k = y.new_empty(batch, kv_heads, seq, dim)
        _rotate_into(q.transpose(1, 2), y[:, :, :heads], cos, sin, 1)
        _rotate_into(k.transpose(1, 2), y[:, :, heads:], cos, sin, 1)
        v = qkv[..., (heads + kv_heads) * dim :].view(batch, seq, kv_heads, dim).transpose(1, 2).contiguous()
        ctx.save_for_backward(normed, rstd, normed_x, weight, cos, sin)
        ctx.heads, ctx.qkv_dtype = heads, qkv.dtype
        return q, k, v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        normed, rstd, normed_x, weight, cos, sin = ctx.saved_tensors
        heads = ctx.heads
        batch, seq, qk_heads, dim = normed.shape
        grad_y = grad_q.new_empty(batch, seq, qk_heads, dim)  # the gradient of weight * normed_x
        _rotate_into(grad_y[:, :, :heads], grad_q.transpose(1, 2), cos, sin, -1)
        _rotate_into(grad_y[:, :, heads:], grad_k.transpose(1, 2), cos, sin, -1)
        grad_q_weight = grad_k_weight = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            per_head = (grad_y * normed_x).sum((0, 1))  # [heads + kv, D]
            grad_q_weight = per_head[:heads].sum(0).to(weight.dtype)
            grad_k_weight = per_head[heads:].sum(0).to(weight.dtype)
        grad_normed = (grad_y * weight).to(ctx.qkv_dtype).to(normed.dtype)
        grad_qkv = grad_q.new_empty(batch, seq, (qk_heads + grad_v.shape[1]) * dim, dtype=ctx.qkv_dtype)
        grad_qk = grad_qkv[..., : qk_heads * dim].view(batch, seq, qk_heads, dim)
        if grad_qk.dtype == normed.dtype:
            _rms_normalize_backward(grad_normed, normed, rstd, out=grad_qk)
        else:
            grad_qk.copy_(_rms_normalize_backward(grad_normed, normed, rstd))
        grad_qkv[..., qk_heads * dim :].view(batch, seq, grad_v.shape[1], dim).copy_(grad_v.transpose(1, 2))
        return grad_qkv, grad_q_weight, grad_k_weight, None, None, None, None, None


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B, heads, T, D], k [B, kv_heads, S, D], v [B, kv_heads, S, Dv],
    mask [B, 1, T, S] (True: attend) -> [B, heads, T, Dv]; query head h reads kv head h // (heads / kv_heads), as
    SDPA with the kv heads repeated. The CPU path of Attention.attend: the queries of a kv head's group are one matrix
    against its keys, never expanded; at the demo's sizes (20 tokens, 24-dim heads) SDPA's CPU kernel took
    twice as long, forward and backward (bench/README.md, "update")."""
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return GroupedAttention.apply(q, k, v, bias, scale)


class GroupedAttention(torch.autograd.Function):
    """grouped_attention's arithmetic as one node: the scale and the mask bias go into the scores in one pass,
    and the backward folds the scale into its matrix products (autograd's graph adds a scaling pass, a bias
    pass and their backward nodes per layer)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
    ) -> torch.Tensor:
        batch, heads, seq, dim = q.shape
        kv_heads, keys, value_dim = k.shape[1], k.shape[2], v.shape[-1]  # value_dim: MLA's differs from dim
        groups = heads // kv_heads
        # The queries of a kv head's group are one [groups * seq, D] matrix against its keys.
        q3 = q.reshape(batch * kv_heads, groups * seq, dim)
        k3, v3 = k.reshape(batch * kv_heads, keys, dim), v.reshape(batch * kv_heads, keys, value_dim)
        scores = torch.bmm(q3, k3.transpose(1, 2))
        grouped = scores.view(batch, kv_heads, groups, seq, keys)
        torch.add(bias[:, :, None], grouped, alpha=scale, out=grouped)  # bias + scale * q k^T, in place
        weights = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(q3, k3, v3, weights)
        ctx.scale, ctx.shapes = scale, (q.shape, k.shape, v.shape)
        return torch.bmm(weights, v3).view(batch, heads, seq, value_dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q3, k3, v3, weights = ctx.saved_tensors
        batch_heads, rows, _ = q3.shape
        grad3 = grad_out.reshape(batch_heads, rows, v3.shape[-1])
        grad_v = torch.bmm(weights.transpose(1, 2), grad3)
        grad_scores = torch._softmax_backward_data(torch.bmm(grad3, v3.transpose(1, 2)), weights, -1, weights.dtype)
        # beta=0 ignores the (uninitialised) input: scale * (grad_scores @ k), the scale inside the GEMM
        grad_q = torch.baddbmm(torch.empty_like(q3), grad_scores, k3, beta=0, alpha=ctx.scale)
        grad_k = torch.baddbmm(torch.empty_like(k3), grad_scores.transpose(1, 2), q3, beta=0, alpha=ctx.scale)
        q_shape, k_shape, v_shape = ctx.shapes
        return grad_q.view(q_shape), grad_k.view(k_shape), grad_v.view(v_shape), None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under logits: logits [..., V], targets [...] -> [...] float32 (log_softmax in fp32)."""
    return TokenLogprobs.apply(logits.float(), targets.unsqueeze(-1).long())


class TokenLogprobs(torch.autograd.Function):
    """picked logit - logsumexp as one node: the backward is (one-hot - softmax) * grad, one softmax, one
    scaling and a scatter, where autograd's graph recomputes exp(logits - lse) and scatters into zeros."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        picked = logits.gather(-1, targets).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets = ctx.saved_tensors
        grad = grad.unsqueeze(-1)
        grad_logits = torch.softmax(logits, dim=-1).mul_(-grad)
        return grad_logits.scatter_add_(-1, targets, grad), None
