"""The sparse Mixture-of-Experts block: a top-k softmax router, SwiGLU experts, and a swappable dispatcher.

The block routes tokens itself (router -> top-k expert ids and weights) and hands the expert computation to a
dispatcher object. `LocalDispatch` runs every expert on this process; an expert-parallel backend (all-to-all,
DeepEP) implements the same `ExpertDispatch` contract while each rank holds only E/ep of the experts.
Experts live in an `nn.ModuleDict` keyed by their *global* index, so a rank holding experts {1, 4, 6, 7} has
state_dict names `experts.1.<projection>.weight` ... exactly as in the full checkpoint: a per-rank shard is a
plain subset of the Hugging Face tensors, with no renaming. The block, its router and the experts' arithmetic are
shared by every family; a family's subclass (steps/models/<family>/model.py) names the experts' projections.

Expert placement. Each MoE layer lists its E global expert ids in "slot" order (ExpertPlacement, in
steps/models/placement.py; identity unless the trainer balances the ranks' loads); EP rank r holds
slots [r*E/ep, (r+1)*E/ep). The block maps its router's global expert ids to slot ids before dispatch, so every
dispatcher sees contiguous slot ranges per rank (the contract DeepEP needs too), whatever the placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLUExpert(nn.Module):
    """One SwiGLU feed-forward expert: down(silu(gate(x)) * up(x)). A family's subclass creates the three
    bias-free projections under its checkpoint's names and returns them from `projections`, in the order
    (gate, up, down). Its forward is the experts' one implementation (run_experts with this expert on all rows)."""

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        raise NotImplementedError(f"{type(self).__name__} must return its (gate, up, down) projections")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return run_experts([self], rows, [rows.shape[0]]).view(*x.shape[:-1], -1)


class ExpertDispatch(Protocol):
    """Runs the routed experts for a batch of tokens and combines their outputs.

    Contract, for every backend:
      hidden       [T, H]  this rank's tokens (T may be 0; expert-parallel backends are collective, so every
                           rank calls dispatch once per MoE layer and step, even with no tokens).
      topk_idx     [T, k]  int64 *slot* ids in [0, num_experts) (SparseMoeBlock.to_slots: the global expert ids
                           mapped through the layer's placement; the identity for a full model).
      topk_weight  [T, k]  combine weights, in hidden's dtype.
      experts      the experts this rank holds, in slot order: local expert j is slot first + j, where
                   LocalDispatch holds all E slots (first = 0) and an expert-parallel backend with ep ranks
                   holds E/ep slots on each rank (first = ep_rank * E/ep) and sends each slot to its owner
                   (owner of slot s: s // (E/ep)).
      returns      [T, H]  out[t] = sum_j topk_weight[t, j] * expert_{topk_idx[t, j]}(hidden[t]), rows in the
                   same order as hidden, in hidden's dtype; differentiable with respect to hidden, topk_weight
                   and the expert parameters.
    """

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        experts: Sequence[nn.Module],
    ) -> torch.Tensor: ...


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes `order`: x[order][inverse] == x."""
    positions = torch.arange(order.numel(), device=order.device)
    return torch.empty_like(order).scatter_(0, order, positions)


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group routed rows by expert: expert_ids [N] (ids in [0, num_experts)) ->
    (order, inverse, counts): rows[order] lists expert 0's rows first, then expert 1's, ..., each expert's in
    their original order (a stable sort, so the grouping is deterministic); inverse undoes order; counts [E]
    is how many rows each expert got. Every dispatcher groups this way (LocalDispatch, both sides of the
    all-to-all, the DeepEP owner)."""
    order = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=num_experts)
    return order, inverse_permutation(order), counts


# Row permutations. Every reordering of routed rows is a gather with index_select (a row copy: 4-6x faster on
# CPU than x[perm], whose kernel indexes element by element), and its backward is the gather with the inverse
# permutation, where autograd's own backward would zero-fill a gradient and scatter-add into it (slower, and
# atomics on CUDA).


@dataclass
class SlotOrder:
    """Where each of the T*k (token, expert) slots of a batch goes when the slots are grouped by expert.

    Slot t*k + j is token t's j-th choice. `order` lists the slots grouped by expert (group_by_expert);
    `counts[e]` is expert e's number of slots. For the combine, the grouped rows are put in "choice-major"
    layout, row j*T + t = slot t*k + j, so that summing over the k choices adds k contiguous [T, H] blocks
    (one add each, where a sum over the middle dim of [T, k, H] costs 3-5x more on CPU):
    `to_choice_major` gathers grouped rows into that layout, `from_choice_major` is its inverse.
    """

    order: torch.Tensor
    counts: torch.Tensor
    to_choice_major: torch.Tensor
    from_choice_major: torch.Tensor
    num_tokens: int
    top_k: int

    @classmethod
    def of(cls, topk_idx: torch.Tensor, num_experts: int) -> SlotOrder:
        num_tokens, top_k = topk_idx.shape
        order, inverse, counts = group_by_expert(topk_idx.reshape(-1), num_experts)
        to_choice_major = inverse.view(num_tokens, top_k).t().reshape(-1)
        from_choice_major = (order % top_k) * num_tokens + order // top_k
        return cls(order, counts, to_choice_major, from_choice_major, num_tokens, top_k)

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> [T*k, H]: each slot's token row, grouped by expert (differentiable)."""
        return _TokensToSlots.apply(hidden, self)

    def combine(self, grouped_out: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """Expert outputs of the grouped slots [T*k, H] -> [T, H]: sum_j topk_weight[t, j] * out(slot t*k+j),
        added in choice order j = 0..k-1 (for k = 2 bit-identical to transformers' per-expert index_add_)
        (differentiable)."""
        return _CombineSlots.apply(grouped_out, topk_weight, self)

    # The arithmetic of gather and combine, forward and backward, for autograd Functions that call them.

    def gather_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.index_select(0, torch.div(self.order, self.top_k, rounding_mode="floor"))

    def gather_rows_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Each token's k slot gradients, gathered choice-major and added in choice order (deterministic)."""
        per_choice = grad.index_select(0, self.to_choice_major).view(self.top_k, self.num_tokens, grad.shape[-1])
        total = per_choice[0]
        for j in range(1, self.top_k):
            total = total + per_choice[j]
        return total

    def combine_rows(
        self, grouped_out: torch.Tensor, topk_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(out [T, H], and for the backward: the outputs per choice [k, T, H], the weights [k, T, 1])."""
        per_choice = grouped_out.index_select(0, self.to_choice_major)
        per_choice = per_choice.view(self.top_k, self.num_tokens, grouped_out.shape[-1])
        weights = topk_weight.t().contiguous().unsqueeze(-1).to(per_choice.dtype)  # [k, T, 1]
        out = per_choice[0] * weights[0]
        for j in range(1, self.top_k):
            out += per_choice[j] * weights[j]  # in place: one [T, H] buffer fewer, the same sums
        return out, per_choice, weights

    def combine_rows_backward(
        self, grad: torch.Tensor, per_choice: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradient of the grouped outputs [T*k, H], gradient of topk_weight [T, k])."""
        grad = grad.contiguous()
        # grouped row r = slot t*k + j: grad[t] * weight[t, j], gathered from grad and scaled in place (one
        # [T*k, H] buffer, where scaling per choice first would write a second one)
        weight_grouped = weights.view(-1).index_select(0, self.from_choice_major).unsqueeze(-1)
        grad_grouped = self.gather_rows(grad).mul_(weight_grouped)
        grad_weight = torch.stack([(grad * per_choice[j]).sum(-1) for j in range(self.top_k)], dim=1)
        return grad_grouped, grad_weight


class _TokensToSlots(torch.autograd.Function):
    """SlotOrder.gather: index_select forward; backward sums each token's k slot gradients (no scatter-add)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor, slots: SlotOrder
    ) -> torch.Tensor:
        ctx.slots = slots  # type: ignore[attr-defined]
        return slots.gather_rows(hidden)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return ctx.slots.gather_rows_backward(grad), None  # type: ignore[attr-defined]


class _CombineSlots(torch.autograd.Function):
    """SlotOrder.combine with a hand-written backward: autograd's would zero-fill a [k, T, H] gradient for
    every choice it selects (k full-size fills per layer and micro-batch)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grouped_out: torch.Tensor, topk_weight: torch.Tensor,
        slots: SlotOrder,
    ) -> torch.Tensor:
        out, per_choice, weights = slots.combine_rows(grouped_out, topk_weight)
        ctx.save_for_backward(per_choice, weights)
        ctx.slots, ctx.weight_dtype = slots, topk_weight.dtype  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        per_choice, weights = ctx.saved_tensors  # type: ignore[attr-defined]
        slots: SlotOrder = ctx.slots  # type: ignore[attr-defined]
        grad_grouped, grad_weight = slots.combine_rows_backward(grad, per_choice, weights)
        return grad_grouped, grad_weight.to(ctx.weight_dtype), None  # type: ignore[attr-defined]


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
    (kept from the forward, so the backward recomputes neither)."""

    spans: list[tuple[int, int, int]]
    gate_up: torch.Tensor
    silu_gate: torch.Tensor
    act: torch.Tensor


def expert_spans(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local expert, start, end) for each expert with rows, for rows grouped by expert: counts[j] for j."""
    spans, start = [], 0
    for j, count in enumerate(counts):
        if count:
            spans.append((j, start, start + count))
        start += count
    return spans


def fuse_expert_weights(weights: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Flat (gate, up, down) per local expert -> ([gate; up] [2I, H] per expert, down [H, I] per expert)."""
    gate_up = [torch.cat([weights[i], weights[i + 1]]) for i in range(0, len(weights), 3)]
    return gate_up, list(weights[2::3])


def swiglu_forward(
    x: torch.Tensor,
    spans: list[tuple[int, int, int]],
    w_gate_up: Sequence[torch.Tensor],
    w_down: Sequence[torch.Tensor],
    out: torch.Tensor,
) -> SwiGLURows:
    """out[s:e] = down(silu(gate(x[s:e])) * up(x[s:e])) with expert j's weights, for each span (j, s, e).
    The spans must cover x's rows; writes `out` (same rows as x) and returns what the backward needs."""
    inter = w_down[0].shape[1]
    gate_up = x.new_empty((x.shape[0], 2 * inter))
    for j, s, e in spans:
        torch.mm(x[s:e], w_gate_up[j].t(), out=gate_up[s:e])
    silu_gate = F.silu(gate_up[:, :inter])
    act = silu_gate * gate_up[:, inter:]
    for j, s, e in spans:
        torch.mm(act[s:e], w_down[j].t(), out=out[s:e])
    return SwiGLURows(spans, gate_up, silu_gate, act)


def swiglu_backward_input(
    run: SwiGLURows,
    grad_out: torch.Tensor,
    w_gate_up: Sequence[torch.Tensor],
    w_down: Sequence[torch.Tensor],
    grad_x: torch.Tensor,
) -> torch.Tensor:
    """Writes the input gradient of the run's rows into grad_x (same rows as grad_out); returns the
    gradient of [gate | up] [N, 2I], which the weight gradients need."""
    inter = run.act.shape[1]
    d_act = torch.empty_like(run.act)
    for j, s, e in run.spans:
        torch.mm(grad_out[s:e], w_down[j], out=d_act[s:e])
    d_gate_up = torch.empty_like(run.gate_up)
    torch.mul(d_act, run.silu_gate, out=d_gate_up[:, inter:])  # d up
    d_silu_gate = d_act.mul_(run.gate_up[:, inter:])
    torch.ops.aten.silu_backward.grad_input(d_silu_gate, run.gate_up[:, :inter], grad_input=d_gate_up[:, :inter])
    for j, s, e in run.spans:
        torch.mm(d_gate_up[s:e], w_gate_up[j], out=grad_x[s:e])
    return d_gate_up


def swiglu_backward_weights(
    run: SwiGLURows,
    d_gate_up: torch.Tensor,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    grads: list[torch.Tensor | None],
) -> None:
    """Add the run's weight gradients to grads: 2 per local expert, ([gate; up] [2I, H], down [H, I]),
    None until an expert has rows (split_expert_grads turns them into the parameters' gradients)."""
    for j, s, e in run.spans:
        for k, a, b in ((2 * j, d_gate_up[s:e], x[s:e]), (2 * j + 1, grad_out[s:e], run.act[s:e])):
            grad = grads[k]
            grads[k] = a.t() @ b if grad is None else grad.addmm_(a.t(), b)


def split_expert_grads(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """(grad [gate; up], grad down) per local expert -> (grad gate, grad up, grad down) per local expert."""
    flat: list[torch.Tensor | None] = []
    for gate_up, down in zip(grads[0::2], grads[1::2], strict=True):
        flat += [None, None] if gate_up is None else list(gate_up.chunk(2))
        flat.append(down)
    return flat


class _SwiGLUExperts(torch.autograd.Function):
    """run_experts: every local expert on its contiguous rows in one Function, with the hand-written
    backward of swiglu_backward_input/weights."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grouped: torch.Tensor,
        spans: list[tuple[int, int, int]],
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        w_gate_up, w_down = fuse_expert_weights(weights)
        out = grouped.new_empty(grouped.shape)
        run = swiglu_forward(grouped, spans, w_gate_up, w_down, out) if spans else None
        ctx.save_for_backward(grouped)
        ctx.run, ctx.fused = run, (w_gate_up, w_down)  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (grouped,) = ctx.saved_tensors  # type: ignore[attr-defined]
        run: SwiGLURows | None = ctx.run  # type: ignore[attr-defined]
        w_gate_up, w_down = ctx.fused  # type: ignore[attr-defined]
        grads: list[torch.Tensor | None] = [None] * (2 * len(w_down))
        grad_grouped = grouped.new_empty(grouped.shape)
        if run is not None:
            grad = grad.contiguous()
            d_gate_up = swiglu_backward_input(run, grad, w_gate_up, w_down, grad_grouped)
            if any(ctx.needs_input_grad[2:]):  # type: ignore[attr-defined]
                swiglu_backward_weights(run, d_gate_up, grad, grouped, grads)
        return grad_grouped, None, *split_expert_grads(grads)


def run_experts(experts: Sequence[nn.Module], grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Run local expert j (a `SwiGLUExpert`) on its counts[j] contiguous rows of `grouped`, each expert once;
    returns the outputs in the same row order. One autograd Function for all the experts (_SwiGLUExperts).
    Rows without experts (no rows at all, or experts without rows) stay connected to `grouped`, so the
    result is part of the graph even when no expert has rows (the all-to-all backward is collective and
    must run on every rank)."""
    if sum(counts) != grouped.shape[0] or len(counts) != len(experts):
        raise ValueError(
            f"run_experts: counts {counts} do not split {grouped.shape[0]} rows among {len(experts)} experts"
        )
    weights = [p.weight for ex in experts for p in ex.projections()]  # type: ignore[operator]
    return _SwiGLUExperts.apply(grouped, expert_spans(counts), *weights)


class LocalDispatch:
    """All experts on this process. Slots are grouped by expert with one stable sort, each expert runs once
    on its contiguous rows, and the results are gathered back per choice and summed with the router weights
    (SlotOrder): gathers and adds only, no index_add_, so the result is deterministic on CUDA too, where
    index_add_ uses atomics; for k = 2 it is also bit-identical to transformers' loop.
    """

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        experts: Sequence[nn.Module],
    ) -> torch.Tensor:
        num_tokens, top_k = topk_idx.shape
        if num_tokens == 0:
            return hidden.new_zeros(hidden.shape)
        num_experts = max(int(topk_idx.max()) + 1, len(experts))
        slots = SlotOrder.of(topk_idx, num_experts)
        counts_list = slots.counts.tolist()
        missing = [e for e, c in enumerate(counts_list) if c and e >= len(experts)]
        if missing:
            raise RuntimeError(
                f"LocalDispatch: token routed to slot {missing[0]}, which this process does not hold "
                f"(holds {len(experts)} experts); use an expert-parallel dispatcher for a partial shard"
            )
        expert_out = run_experts(experts, slots.gather(hidden), counts_list)  # [T*k, H], slot order
        return slots.combine(expert_out, topk_weight)


class SparseMoeBlock(nn.Module):
    """The sparse MoE block every family shares: `gate` (the router, of router kind "softmax_topk",
    steps/models/family.py) + `experts.{e}` for the global expert ids this rank holds, each an instance of the
    family's `expert_class` (a SwiGLUExpert subclass naming its projections).

    slots: this layer's E global expert ids in slot order (default: the identity); with ep_size ep the block
    holds slots [ep_rank*E/ep, (ep_rank+1)*E/ep), i.e. experts slots[ep_rank*E/ep : (ep_rank+1)*E/ep]. The
    router keeps choosing global ids; `to_slots` maps them before dispatch.
    """

    expert_class: type[SwiGLUExpert]  # set by the family's subclass

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        num_experts_per_tok: int,
        norm_topk_prob: bool,
        slots: Sequence[int] | None = None,
        ep_rank: int = 0,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        slots = tuple(range(num_experts)) if slots is None else tuple(int(e) for e in slots)
        if sorted(slots) != list(range(num_experts)):
            raise ValueError(f"slots {list(slots)} are not a permutation of the {num_experts} expert ids")
        if num_experts % ep_size or not 0 <= ep_rank < ep_size:
            raise ValueError(f"EP rank {ep_rank} of {ep_size} cannot hold an equal share of {num_experts} experts")
        per_rank = num_experts // ep_size
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = num_experts_per_tok
        self.norm_topk_prob = norm_topk_prob
        self.slots = slots
        self.held = slots[ep_rank * per_rank : (ep_rank + 1) * per_rank]  # global ids, local slot order
        self.num_local_experts = per_rank
        # global id -> slot id; None for the identity (nothing to map: today's contiguous ranges, same bits)
        identity = slots == tuple(range(num_experts))
        self.expert_slot = None if identity else inverse_permutation(torch.tensor(slots, device="cpu"))
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)  # the router, replicated on every rank
        # ModuleDict in global id order (state_dict order does not depend on the placement)
        self.experts = nn.ModuleDict(
            {str(e): self.expert_class(hidden_size, moe_intermediate_size) for e in sorted(self.held)}
        )
        self.dispatch: ExpertDispatch = LocalDispatch()
        # per-expert (global id) count of routed (token, expert) rows, accumulated by forward while a tensor
        # (the model's count_routed_rows); None: not counted
        self.routed_rows: torch.Tensor | None = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (router_logits [T, E], topk_idx [T, k], topk_weight [T, k]).

        Softmax over all experts in fp32, top-k, optional renormalisation of the k weights, then back to the
        logits' dtype: the same arithmetic as transformers' Qwen3MoeTopKRouter (router kind "softmax_topk").
        """
        router_logits = self.gate(hidden)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        topk_weight, topk_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return router_logits, topk_idx, topk_weight.to(router_logits.dtype)

    def to_slots(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this layer's slot ids (what the dispatchers route by)."""
        if self.expert_slot is None:
            return topk_idx
        if self.expert_slot.device != topk_idx.device:
            self.expert_slot = self.expert_slot.to(topk_idx.device)
        return self.expert_slot.index_select(0, topk_idx.reshape(-1)).view(topk_idx.shape)

    def local_experts(self) -> list[nn.Module]:
        """The experts this block holds, in slot order (the dispatch contract's `experts`)."""
        return [self.experts[str(e)] for e in self.held]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden = x.reshape(-1, self.hidden_size)
        _, topk_idx, topk_weight = self.route(hidden)
        if self.routed_rows is not None:
            self.routed_rows += torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
        if isinstance(self.dispatch, LocalDispatch) and self.num_local_experts != self.num_experts:
            raise RuntimeError(
                f"LocalDispatch: this block holds {self.num_local_experts} of {self.num_experts} experts and "
                "does not hold the others; use an expert-parallel dispatcher for a partial shard"
            )
        out = self.dispatch(hidden, self.to_slots(topk_idx), topk_weight, self.local_experts())
        return out.reshape(shape)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, active per token) for the full model, even when `model` holds only a slice of the experts.

    Active = everything except the experts a token does not use: embeddings, attention, norms, routers,
    dense MLPs, the output projection and num_experts_per_tok experts per MoE layer (the usual "A3B" convention).
    """
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    routed = {id(p) for block in blocks for p in block.experts.parameters()}
    non_expert = sum(p.numel() for p in model.parameters() if id(p) not in routed)
    total = active = non_expert
    for block in blocks:
        per_expert = sum(p.numel() for p in next(iter(block.experts.values())).parameters())
        total += block.num_experts * per_expert
        active += block.top_k * per_expert
    return total, active
