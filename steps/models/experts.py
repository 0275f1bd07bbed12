"""The routed experts' arithmetic, forward and backward, in one place: an expert declares its kind
(ExpertArithmetic: SwiGLU, as most families' experts, or gpt-oss's clamped SwiGLU with biases) and every dispatcher
(steps/models/moe.py LocalDispatch, the all-to-all backend steps/expert_parallel/alltoall.py, DeepEP
steps/expert_parallel/deepep.py) runs the experts through it: run_experts, or the kind's functions directly.
A family's expert class (steps/models/<family>/model.py) subclasses SwiGLUExpert or RoutedExpert and names its
weights as its checkpoint does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ExpertArithmetic(Protocol):
    """What a kind of expert computes, forward and backward, over rows grouped by expert: every dispatcher
    (LocalDispatch and DeepEP through run_experts, the all-to-all backend) and the torch engine call these and
    nothing of the kind's own. An expert module declares its kind (RoutedExpert.arithmetic) and lists its
    tensors in the kind's order (RoutedExpert.expert_weights).

    fuse:             the flat weights of the local experts (expert_weights of each, in slot order) -> the form
                      the other methods read, built once per call (weights change every optimizer step).
    forward:          out[s:e] = expert j on x[s:e] for each span (j, s, e); returns what the backward needs.
    backward_input:   writes the rows' input gradients into grad_x; returns what backward_weights needs.
    backward_weights: adds the rows' weight gradients into `grads` (grad_slots entries, None until an expert
                      has rows); split_grads turns them into one gradient per tensor of fuse's input."""

    def fuse(self, weights: Sequence[torch.Tensor]) -> Any: ...

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int, int]], fused: Any, out: torch.Tensor) -> Any: ...

    def backward_input(self, rows: Any, grad_out: torch.Tensor, fused: Any, grad_x: torch.Tensor) -> Any: ...

    def backward_weights(
        self, rows: Any, saved: Any, grad_out: torch.Tensor, x: torch.Tensor, grads: list[torch.Tensor | None]
    ) -> None: ...

    def grad_slots(self, num_experts: int) -> int: ...

    def split_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]: ...


class RoutedExpert(nn.Module):
    """An expert of some kind (ExpertArithmetic): `arithmetic` computes it, `expert_weights` lists its tensors
    in that kind's order. Its forward is the experts' one implementation (run_experts with this expert on all
    rows)."""

    arithmetic: ExpertArithmetic

    def expert_weights(self) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} must list its weights")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return run_experts([self], rows, [rows.shape[0]]).view(*x.shape[:-1], -1)


class SwiGLUExpert(RoutedExpert):
    """One SwiGLU feed-forward expert: down(silu(gate(x)) * up(x)) (the kind SWIGLU). A family's subclass
    creates the three bias-free projections under its checkpoint's names and returns them from `projections`, in
    the order (gate, up, down)."""

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        raise NotImplementedError(f"{type(self).__name__} must return its (gate, up, down) projections")

    def expert_weights(self) -> list[torch.Tensor]:
        return [p.weight for p in self.projections()]


class BlockSparseExpert(SwiGLUExpert):
    """One SwiGLU expert named as the `block_sparse_moe` checkpoints name it (Mixtral's, MiniMax-M2's): w1 the gate,
    w3 the up and w2 the down projection, w2(silu(w1(x)) * w3(x)) (transformers loads [w1; w3] as one fused
    tensor)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.w1, self.w3, self.w2


# The SwiGLU experts' arithmetic, forward and backward, in one place: run_experts (LocalDispatch, DeepEP,
# SwiGLUExpert.forward) and the all-to-all backend (steps.expert_parallel.alltoall) call these. The gate and up
# projections stay two parameters (checkpoint names), but every call multiplies the rows with their concatenation
# [gate; up] [2I, H] once: one matmul instead of two in the forward and in each half of the backward (the
# copy of the weights, done per call because they change every optimizer step, costs far less than a matmul).
# Rows are grouped by expert; the matmuls run per expert on its rows, the element-wise steps (silu, the
# product, their gradients) once over all the rows of a run.


@dataclass
class SwiGLURows:
    """One run of the experts over contiguous expert-grouped rows, and the activations its backward needs.

    spans: (local expert, start, end) per expert with rows, covering the rows of the run in order;
    gate_up [N, 2I]: [gate | up] pre-activations; silu_gate = silu(gate) and act = silu_gate * up [N, I]
    (kept from the forward, so the backward recomputes neither); grouped: the run's matmuls are grouped GEMMs."""

    spans: list[tuple[int, int, int]]
    gate_up: torch.Tensor
    silu_gate: torch.Tensor
    act: torch.Tensor
    grouped: bool = False


def expert_spans(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local expert, start, end) for each expert with rows, for rows grouped by expert: counts[j] for j."""
    spans, start = [], 0
    for j, count in enumerate(counts):
        if count:
            spans.append((j, start, start + count))
        start += count
    return spans


# One grouped GEMM for all the local experts (torch.nn.functional.grouped_mm: every expert's rows against its
# own weights in one call, the experts' weights stacked [E, ...]) where the device has it, the per-expert loop of
# torch.mm elsewhere. On the CPU grouped_mm runs each group with the same kernel as torch.mm, so both paths give
# the same bits; on CUDA it wants bf16 on sm80+ with 16-byte aligned strides (torch's _meta_grouped_mm_common,
# the rules of _grouped_mm_cuda; tests/test_grouped_gemm.py holds the calls to them on meta tensors).
_GROUPED_GEMM = {"enabled": True}


def set_grouped_gemm(enabled: bool) -> None:
    """trainer.grouped_gemm: run the local experts as one grouped GEMM where the device has it (True, the
    default) or always expert by expert (False)."""
    _GROUPED_GEMM["enabled"] = bool(enabled)


def grouped_gemm_usable(weights: Sequence[torch.Tensor]) -> bool:
    """Whether torch.nn.functional.grouped_mm can run these experts' weights (all of one device and dtype):
    the CPU in float32 or bf16, CUDA in bf16 on sm80+; on both, every stride a multiple of 16 bytes, so every
    dimension of the weights (hidden and intermediate sizes, which are the rows' strides too) a multiple of
    16 bytes' worth of elements (4 in float32, 8 in bf16)."""
    if not _GROUPED_GEMM["enabled"] or not weights or not hasattr(F, "grouped_mm"):
        return False
    first = weights[0]
    if first.device.type == "cpu":
        if first.dtype not in (torch.float32, torch.bfloat16):
            return False
    elif first.device.type != "cuda" or first.dtype != torch.bfloat16:
        return False
    elif torch.cuda.get_device_capability(first.device) < (8, 0):
        return False
    aligned = 16 // first.element_size()
    return all(size % aligned == 0 for w in weights if w.dim() == 2 for size in w.shape)


def group_offsets(spans: list[tuple[int, int, int]], num_experts: int, device: torch.device) -> torch.Tensor:
    """grouped_mm's offs: the end row of each local expert's rows (experts without rows repeat the previous
    end), int32, from the spans (local expert, start, end) of rows grouped by expert."""
    ends, end, by_expert = [], 0, {j: e for j, _, e in spans}
    for j in range(num_experts):
        end = by_expert.get(j, end)
        ends.append(end)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def add_expert_grads(
    grads: list[torch.Tensor | None], stacked: torch.Tensor, spans: list, slot: int, every: int
) -> None:
    """Add a grouped weight gradient [E, ...] into grads[every * j + slot] for each expert j with rows (the
    others stay None, as the per-expert path leaves them)."""
    for j, _, _ in spans:
        k = every * j + slot
        grad = grads[k]
        grads[k] = stacked[j] if grad is None else grad.add_(stacked[j])


@dataclass
class SwiGLUWeights:
    """The SwiGLU experts' weights for one call: [gate; up] [2I, H] and down [H, I] per local expert, as lists
    (the per-expert path) or stacked [E, 2I, H] / [E, H, I] (grouped: one grouped GEMM per matmul)."""

    gate_up: Sequence[torch.Tensor] | torch.Tensor
    down: Sequence[torch.Tensor] | torch.Tensor
    grouped: bool


def fuse_expert_weights(weights: Sequence[torch.Tensor]) -> SwiGLUWeights:
    """Flat (gate, up, down) per local expert -> their [gate; up] [2I, H] and down [H, I] per expert, stacked
    when the experts run as one grouped GEMM (grouped_gemm_usable)."""
    gates, ups, downs = weights[0::3], weights[1::3], weights[2::3]
    if grouped_gemm_usable(weights):
        return SwiGLUWeights(torch.cat([torch.stack(gates), torch.stack(ups)], dim=1), torch.stack(downs), True)
    return SwiGLUWeights([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)], list(downs), False)


def swiglu_forward(
    x: torch.Tensor, spans: list[tuple[int, int, int]], w: SwiGLUWeights, out: torch.Tensor, limit: float | None = None
) -> SwiGLURows:
    """out[s:e] = down(silu(gate(x[s:e])) * up(x[s:e])) with expert j's weights, for each span (j, s, e).
    The spans must cover x's rows; writes `out` (same rows as x) and returns what the backward needs. With a
    `limit` (LimitedSwiGLU), gate clamped to at most limit and up to [-limit, limit] first."""
    inter = w.down[0].shape[1]
    if w.grouped and spans:
        offs = group_offsets(spans, len(w.down), x.device)
        gate_up = F.grouped_mm(x, w.gate_up.transpose(1, 2), offs=offs)  # type: ignore[union-attr]
    else:
        gate_up = x.new_empty((x.shape[0], 2 * inter))
        for j, s, e in spans:
            torch.mm(x[s:e], w.gate_up[j].t(), out=gate_up[s:e])
    if limit is None:
        silu_gate = F.silu(gate_up[:, :inter])
        act = silu_gate * gate_up[:, inter:]
    else:
        silu_gate = F.silu(gate_up[:, :inter].clamp(max=limit))
        act = silu_gate * gate_up[:, inter:].clamp(min=-limit, max=limit)
    if w.grouped and spans:
        out.copy_(F.grouped_mm(act, w.down.transpose(1, 2), offs=offs))  # type: ignore[union-attr]
    else:
        for j, s, e in spans:
            torch.mm(act[s:e], w.down[j].t(), out=out[s:e])
    return SwiGLURows(spans, gate_up, silu_gate, act, grouped=w.grouped and bool(spans))


def swiglu_backward_input(
    run: SwiGLURows, grad_out: torch.Tensor, w: SwiGLUWeights, grad_x: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    """Writes the input gradient of the run's rows into grad_x (same rows as grad_out); returns the
    gradient of [gate | up] [N, 2I], which the weight gradients need. With a `limit`, as clamp's backward: no
    gradient through a gate above it or an up outside [-limit, limit]."""
    inter = run.act.shape[1]
    grouped = w.grouped and bool(run.spans)
    offs = group_offsets(run.spans, len(w.down), grad_out.device) if grouped else None
    if grouped:
        d_act = F.grouped_mm(grad_out, w.down, offs=offs)  # type: ignore[arg-type]
    else:
        d_act = torch.empty_like(run.act)
        for j, s, e in run.spans:
            torch.mm(grad_out[s:e], w.down[j], out=d_act[s:e])
    d_gate_up = torch.empty_like(run.gate_up)
    if limit is None:
        torch.mul(d_act, run.silu_gate, out=d_gate_up[:, inter:])  # d up
        d_silu_gate = d_act.mul_(run.gate_up[:, inter:])
        torch.ops.aten.silu_backward.grad_input(d_silu_gate, run.gate_up[:, :inter], grad_input=d_gate_up[:, :inter])
    else:
        gate, up = run.gate_up[:, :inter], run.gate_up[:, inter:]
        torch.mul(d_act, run.silu_gate, out=d_gate_up[:, inter:])
        d_gate_up[:, inter:].mul_((up >= -limit) & (up <= limit))
        d_silu_gate = d_act.mul_(up.clamp(min=-limit, max=limit))
        clamped = gate.clamp(max=limit)
        torch.ops.aten.silu_backward.grad_input(d_silu_gate, clamped, grad_input=d_gate_up[:, :inter])
        d_gate_up[:, :inter].mul_(gate <= limit)
    if grouped:
        grad_x.copy_(F.grouped_mm(d_gate_up, w.gate_up, offs=offs))  # type: ignore[arg-type]
    else:
        for j, s, e in run.spans:
            torch.mm(d_gate_up[s:e], w.gate_up[j], out=grad_x[s:e])
    return d_gate_up


def swiglu_backward_weights(
    run: SwiGLURows,
    d_gate_up: torch.Tensor,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    grads: list[torch.Tensor | None],
    grouped: bool = False,
) -> None:
    """Add the run's weight gradients to grads: 2 per local expert, ([gate; up] [2I, H], down [H, I]),
    None until an expert has rows (split_expert_grads turns them into the parameters' gradients). A run's
    gradient is computed, then added: the same bits whether it comes from the loop or one grouped GEMM."""
    if grouped:
        offs = group_offsets(run.spans, len(grads) // 2, x.device)
        add_expert_grads(grads, F.grouped_mm(d_gate_up.t(), x, offs=offs), run.spans, 0, 2)
        add_expert_grads(grads, F.grouped_mm(grad_out.t(), run.act, offs=offs), run.spans, 1, 2)
        return
    for j, s, e in run.spans:
        for k, a, b in ((2 * j, d_gate_up[s:e], x[s:e]), (2 * j + 1, grad_out[s:e], run.act[s:e])):
            grad = grads[k]
            grads[k] = a.t() @ b if grad is None else grad.add_(a.t() @ b)


def split_expert_grads(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """(grad [gate; up], grad down) per local expert -> (grad gate, grad up, grad down) per local expert."""
    flat: list[torch.Tensor | None] = []
    for gate_up, down in zip(grads[0::2], grads[1::2], strict=True):
        flat += [None, None] if gate_up is None else list(gate_up.chunk(2))
        flat.append(down)
    return flat


class SwiGLU:
    """The SwiGLU kind (ExpertArithmetic): swiglu_forward / swiglu_backward_input / swiglu_backward_weights on
    [gate; up] fused per call (fuse_expert_weights); weights (gate, up, down) per expert."""

    def fuse(self, weights: Sequence[torch.Tensor]) -> SwiGLUWeights:
        return fuse_expert_weights(weights)

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int, int]], fused: Any, out: torch.Tensor) -> Any:
        return swiglu_forward(x, spans, fused, out)

    def backward_input(self, rows: Any, grad_out: torch.Tensor, fused: Any, grad_x: torch.Tensor) -> Any:
        return swiglu_backward_input(rows, grad_out, fused, grad_x)

    def backward_weights(
        self, rows: Any, saved: Any, grad_out: torch.Tensor, x: torch.Tensor, grads: list[torch.Tensor | None]
    ) -> None:
        swiglu_backward_weights(rows, saved, grad_out, x, grads, grouped=rows.grouped)

    def grad_slots(self, num_experts: int) -> int:
        return 2 * num_experts  # ([gate; up], down) per expert

    def split_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return split_expert_grads(grads)


SWIGLU = SwiGLU()
SwiGLUExpert.arithmetic = SWIGLU


@dataclass(frozen=True)
class LimitedSwiGLU(SwiGLU):
    """SwiGLU with its pre-activations clamped (DeepSeek-V4's experts, transformers' DeepseekV4Experts._apply_gate):
    down(silu(min(gate, limit)) * clamp(up, -limit, limit)); the same weights (gate, up, down) per expert, no biases
    (gpt-oss's clamped kind, ClampedSwiGLU, has biases and another activation)."""

    limit: float

    def forward(self, x: torch.Tensor, spans: list[tuple[int, int, int]], fused: Any, out: torch.Tensor) -> Any:
        return swiglu_forward(x, spans, fused, out, self.limit)

    def backward_input(self, rows: Any, grad_out: torch.Tensor, fused: Any, grad_x: torch.Tensor) -> Any:
        return swiglu_backward_input(rows, grad_out, fused, grad_x, self.limit)


@dataclass
class ClampedSwiGLURows:
    """One run of ClampedSwiGLU experts: spans as SwiGLURows; gate_up [N, 2I] the biased pre-activations
    (gate and up interleaved: gate = [:, ::2], up = [:, 1::2]); sig = sigmoid(alpha * clamped gate), glu =
    clamped gate * sig, act = (clamped up + 1) * glu [N, I]; grouped: the run's matmuls are grouped GEMMs."""

    spans: list[tuple[int, int, int]]
    gate_up: torch.Tensor
    sig: torch.Tensor
    glu: torch.Tensor
    act: torch.Tensor
    grouped: bool = False


def _row_bias(bias: torch.Tensor, spans: list[tuple[int, int, int]], rows: int) -> torch.Tensor:
    """Each row's expert bias [rows, D] from the stacked biases [E, D], for rows grouped by expert (spans)."""
    counts = torch.zeros(bias.shape[0], dtype=torch.long)
    for j, s, e in spans:
        counts[j] = e - s
    return bias.repeat_interleave(counts.to(bias.device), dim=0, output_size=rows)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts (transformers' GptOssExperts), the kind ExpertArithmetic "clamped SwiGLU with biases":
    gate_up = x @ W_gate_up + b_gate_up (W [H, 2I], gate and up interleaved), gate = min(gate, limit),
    up = clamp(up, -limit, limit), out = ((up + 1) * gate * sigmoid(alpha * gate)) @ W_down + b_down (W_down
    [I, H]). Weights per expert: (W_gate_up, b_gate_up, W_down, b_down), in the x @ W layout gpt-oss stores.
    The backward is written by hand (tests/test_moe_fused_experts.py checks it against autograd). fuse stacks
    the four per expert [E, ...] when the experts run as one grouped GEMM (grouped_gemm_usable)."""

    alpha: float = 1.702
    limit: float = 7.0

    def fuse(self, weights: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        parts = tuple(weights[i::4] for i in range(4))  # (W_gu, b_gu, W_down, b_down) per expert
        if grouped_gemm_usable(weights[0::4]) and grouped_gemm_usable(weights[2::4]):
            return (*(torch.stack(p) for p in parts), True)
        return (*parts, False)

    def forward(
        self, x: torch.Tensor, spans: list[tuple[int, int, int]], fused: Any, out: torch.Tensor
    ) -> ClampedSwiGLURows:
        w_gate_up, b_gate_up, w_down, b_down, grouped = fused
        grouped = grouped and bool(spans)
        if grouped:
            offs = group_offsets(spans, len(w_down), x.device)
            gate_up = F.grouped_mm(x, w_gate_up, offs=offs).add_(_row_bias(b_gate_up, spans, x.shape[0]))
        else:
            gate_up = x.new_empty((x.shape[0], w_gate_up[0].shape[1]))
            for j, s, e in spans:
                torch.mm(x[s:e], w_gate_up[j], out=gate_up[s:e]).add_(b_gate_up[j])
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        sig = torch.sigmoid(gate * self.alpha)
        glu = gate * sig
        act = (up + 1) * glu
        if grouped:
            out.copy_(F.grouped_mm(act, w_down, offs=offs).add_(_row_bias(b_down, spans, x.shape[0])))
        else:
            for j, s, e in spans:
                torch.mm(act[s:e], w_down[j], out=out[s:e]).add_(b_down[j])
        return ClampedSwiGLURows(spans, gate_up, sig, glu, act, grouped)

    def backward_input(
        self, rows: ClampedSwiGLURows, grad_out: torch.Tensor, fused: Any, grad_x: torch.Tensor
    ) -> torch.Tensor:
        """Writes the rows' input gradients into grad_x; returns the gradient of the pre-activations gate_up."""
        w_gate_up, _, w_down, _, _ = fused
        offs = group_offsets(rows.spans, len(w_down), grad_out.device) if rows.grouped else None
        if rows.grouped:
            d_act = F.grouped_mm(grad_out, w_down.transpose(1, 2), offs=offs)
        else:
            d_act = torch.empty_like(rows.act)
            for j, s, e in rows.spans:
                torch.mm(grad_out[s:e], w_down[j].t(), out=d_act[s:e])
        gate_raw, up_raw = rows.gate_up[:, ::2], rows.gate_up[:, 1::2]
        gate = gate_raw.clamp(max=self.limit)
        up = up_raw.clamp(min=-self.limit, max=self.limit)
        d_gate_up = torch.empty_like(rows.gate_up)
        # d up = d_act * glu where -limit <= up <= limit (clamp's gradient), else 0
        torch.mul(d_act, rows.glu, out=d_gate_up[:, 1::2])
        d_gate_up[:, 1::2].mul_((up_raw >= -self.limit) & (up_raw <= self.limit))
        # d gate = d_act * (up + 1) * (sig + alpha * gate * sig * (1 - sig)) where gate <= limit, else 0
        d_glu = d_act.mul_(up + 1)
        local = torch.addcmul(rows.sig, gate * self.alpha, rows.sig * (1 - rows.sig))
        torch.mul(d_glu, local, out=d_gate_up[:, ::2])
        d_gate_up[:, ::2].mul_(gate_raw <= self.limit)
        if rows.grouped:
            grad_x.copy_(F.grouped_mm(d_gate_up, w_gate_up.transpose(1, 2), offs=offs))
        else:
            for j, s, e in rows.spans:
                torch.mm(d_gate_up[s:e], w_gate_up[j].t(), out=grad_x[s:e])
        return d_gate_up

    def backward_weights(
        self,
        rows: ClampedSwiGLURows,
        saved: torch.Tensor,
        grad_out: torch.Tensor,
        x: torch.Tensor,
        grads: list[torch.Tensor | None],
    ) -> None:
        """Adds (W_gate_up, b_gate_up, W_down, b_down) gradients per local expert with rows into grads."""
        if rows.grouped:
            offs = group_offsets(rows.spans, len(grads) // 4, x.device)
            add_expert_grads(grads, F.grouped_mm(x.t(), saved, offs=offs), rows.spans, 0, 4)
            add_expert_grads(grads, F.grouped_mm(rows.act.t(), grad_out, offs=offs), rows.spans, 2, 4)
            for j, s, e in rows.spans:
                for k, part in ((1, saved[s:e].sum(0)), (3, grad_out[s:e].sum(0))):
                    grad = grads[4 * j + k]
                    grads[4 * j + k] = part if grad is None else grad.add_(part)
            return
        for j, s, e in rows.spans:
            parts = (x[s:e].t() @ saved[s:e], saved[s:e].sum(0), rows.act[s:e].t() @ grad_out[s:e],
                     grad_out[s:e].sum(0))  # fmt: skip
            for k, part in enumerate(parts):
                grad = grads[4 * j + k]
                grads[4 * j + k] = part if grad is None else grad.add_(part)

    def grad_slots(self, num_experts: int) -> int:
        return 4 * num_experts

    def split_grads(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return grads


class _Experts(torch.autograd.Function):
    """run_experts: every local expert on its contiguous rows in one Function, with the hand-written
    backward of the experts' kind (ExpertArithmetic)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grouped: torch.Tensor,
        spans: list[tuple[int, int, int]],
        arithmetic: ExpertArithmetic,
        num_experts: int,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        fused = arithmetic.fuse(weights)
        out = grouped.new_empty(grouped.shape)
        run = arithmetic.forward(grouped, spans, fused, out) if spans else None
        ctx.save_for_backward(grouped)
        ctx.run, ctx.fused, ctx.arithmetic, ctx.num_experts = run, fused, arithmetic, num_experts  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (grouped,) = ctx.saved_tensors  # type: ignore[attr-defined]
        run, fused = ctx.run, ctx.fused  # type: ignore[attr-defined]
        arithmetic: ExpertArithmetic = ctx.arithmetic  # type: ignore[attr-defined]
        grads: list[torch.Tensor | None] = [None] * arithmetic.grad_slots(ctx.num_experts)  # type: ignore[attr-defined]
        grad_grouped = grouped.new_empty(grouped.shape)
        if run is not None:
            grad = grad.contiguous()
            saved = arithmetic.backward_input(run, grad, fused, grad_grouped)
            if any(ctx.needs_input_grad[4:]):  # type: ignore[attr-defined]
                arithmetic.backward_weights(run, saved, grad, grouped, grads)
        return grad_grouped, None, None, None, *arithmetic.split_grads(grads)


def expert_arithmetic(experts: Sequence[nn.Module]) -> ExpertArithmetic:
    """The one kind (ExpertArithmetic) of a list of local experts."""
    if not experts:
        raise ValueError("expert_arithmetic: no experts")
    arithmetic = experts[0].arithmetic  # type: ignore[union-attr]
    if any(ex.arithmetic != arithmetic for ex in experts):  # type: ignore[union-attr]
        raise ValueError("expert_arithmetic: the experts of one block are of different kinds")
    return arithmetic  # type: ignore[return-value]


def run_experts(experts: Sequence[nn.Module], grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Run local expert j (a `RoutedExpert`) on its counts[j] contiguous rows of `grouped`, each expert once;
    returns the outputs in the same row order. One autograd Function for all the experts (_Experts), computed
    by their kind (ExpertArithmetic). Rows without experts (no rows at all, or experts without rows) stay
    connected to `grouped`, so the result is part of the graph even when no expert has rows (the all-to-all
    backward is collective and must run on every rank)."""
    if sum(counts) != grouped.shape[0] or len(counts) != len(experts):
        raise ValueError(
            f"run_experts: counts {counts} do not split {grouped.shape[0]} rows among {len(experts)} experts"
        )
    arithmetic = expert_arithmetic(experts)
    weights = [w for ex in experts for w in ex.expert_weights()]  # type: ignore[operator]
    return _Experts.apply(grouped, expert_spans(counts), arithmetic, len(experts), *weights)
