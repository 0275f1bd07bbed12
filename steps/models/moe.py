"""The sparse Mixture-of-Experts block: its router (RouterSettings: softmax top-k, top-k softmax, or sigmoid scores
with a selection bias and group-limited top-k), routed experts (steps/models/experts.py: their arithmetic),
optional shared experts, and a swappable dispatcher.

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
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from steps.models.experts import RoutedExpert, run_experts
from steps.models.router_loss import load_balancing_loss


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
        ctx: torch.autograd.function.FunctionCtx,
        grouped_out: torch.Tensor,
        topk_weight: torch.Tensor,
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


# Tensors kept in float32 whatever the checkpoint's dtype (transformers' _keep_in_fp32_modules_strict), by checkpoint
# name: the routers' selection-only correction bias (DeepSeek-V3, GLM-4.5, MiniMax-M2), whose small differences
# between experts bf16 would erase. A family adds its own names (ModelFamily.float32_tensors; steps/models/registry.py
# stored_dtype asks both). Loaded, held and published in float32 beside weights of the run's dtype.
FLOAT32_TENSOR_SUFFIXES = (".e_score_correction_bias",)
# Integer tables a model routes by, loaded, held and published as integers (DeepSeek-V4's hash layers: the token ->
# experts table, a buffer no optimizer step changes)
INTEGER_TENSOR_SUFFIXES = (".gate.tid2eid",)


def kept_in_float32(name: str, family_names: tuple[str, ...] = ()) -> bool:
    """Whether checkpoint tensor `name` stays float32 whatever the checkpoint's dtype: it ends with a shared suffix
    or one of its family's `family_names` (ModelFamily.float32_tensors)."""
    return name.endswith(FLOAT32_TENSOR_SUFFIXES + tuple(family_names))


def kept_as_integers(name: str) -> bool:
    """Whether tensor `name` is an integer table (INTEGER_TENSOR_SUFFIXES), held as int64 beside any weights."""
    return name.endswith(INTEGER_TENSOR_SUFFIXES)


def stored_dtype(name: str, dtype: torch.dtype, family_names: tuple[str, ...] = ()) -> torch.dtype:
    """The dtype checkpoint tensor `name` is held and written in beside weights of `dtype`: float32 for
    kept_in_float32 (with the family's names), int64 for the integer tables, else dtype."""
    if kept_as_integers(name):
        return torch.int64
    return torch.float32 if kept_in_float32(name, family_names) else dtype


@dataclass(frozen=True)
class RouterSettings:
    """How a block's router chooses experts (the router kind, steps/models/family.py) and weighs them.

    softmax_topk: softmax over all experts, top k, optional renormalisation (Qwen3-MoE, Qwen2-MoE, Mixtral).
    sigmoid_group_topk: sigmoid scores, a selection-only correction bias, group-limited top-k (n_group groups,
    the best topk_group of them), weights renormalised when norm_topk_prob (DeepSeek-V3, Kimi-K2, GLM-4.5).
    topk_softmax: a router with a bias; top k of its logits, then softmax over those k in the logits' dtype
    (gpt-oss).
    sqrtsoftplus_topk: sqrt(softplus) scores, a selection-only correction bias, top-k, the weights renormalised
    (DeepSeek-V4).
    All multiply the weights by routed_scaling_factor."""

    kind: str = "softmax_topk"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def check(self, num_experts: int, top_k: int) -> None:
        if self.kind not in ("softmax_topk", "sigmoid_group_topk", "topk_softmax", "sqrtsoftplus_topk"):
            raise ValueError(f"router kind {self.kind!r} is not implemented")
        if self.n_group < 1 or num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"n_group {self.n_group} / topk_group {self.topk_group} do not split {num_experts} experts"
            )
        group_size = num_experts // self.n_group
        if self.n_group > 1 and (group_size < 2 or top_k > self.topk_group * group_size):
            raise ValueError(
                f"group-limited top-{top_k} of {num_experts} experts in {self.topk_group} of {self.n_group} groups "
                "cannot choose enough experts"
            )


class RoutedExperts(nn.ModuleDict):
    """A block's routed experts, by global id (their state-dict names), and the one call that runs them: the
    dispatcher over the experts in slot order. Being a module call, it is where trainer.shard_experts' FSDP2
    gathers the experts' weights before and reduce-scatters their gradients after (steps/training/sharding.py).

    gradient_for_every_expert (set by that sharding): an expert no row reached gets an exact zero gradient rather
    than none, since FSDP2 reduce-scatters the gradients a rank has and every replica must give the same ones."""

    gradient_for_every_expert = False

    def forward(
        self,
        dispatch: ExpertDispatch,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        topk_weight: torch.Tensor,
        held: Sequence[int],
    ) -> torch.Tensor:
        experts = [self[str(e)] for e in held]
        out = dispatch(hidden, slots, topk_weight, experts)
        if self.gradient_for_every_expert:  # + 0 x one element of each weight: the same values, a zero gradient
            weights = [p for expert in experts for p in expert.parameters() if p.requires_grad]
            out = out + torch.stack([w.reshape(-1)[0] for w in weights]).sum() * 0.0
        return out


class SparseMoeBlock(nn.Module):
    """The sparse MoE block every family shares: `gate` (the router, of a router kind, steps/models/family.py;
    with a bias for "topk_softmax") + `experts.{e}` for the global expert ids this rank holds, each an instance
    of the family's `expert_class` (a RoutedExpert: a SwiGLUExpert subclass naming its projections, or another
    kind's expert), built as expert_class(hidden_size, moe_intermediate_size, **expert_kwargs).

    slots: this layer's E global expert ids in slot order (default: the identity); with ep_size ep the block
    holds slots [ep_rank*E/ep, (ep_rank+1)*E/ep), i.e. experts slots[ep_rank*E/ep : (ep_rank+1)*E/ep]. The
    router keeps choosing global ids; `to_slots` maps them before dispatch.
    """

    expert_class: type[RoutedExpert]  # set by the family's subclass
    # the shared experts' class where it is not expert_class (Qwen3.5-MoE: its routed experts hold their gate and up
    # projections as one tensor, its shared expert as two)
    shared_expert_class: type[RoutedExpert] | None = None

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
        *,
        router: RouterSettings | None = None,
        shared_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        expert_kwargs: dict[str, Any] | None = None,
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
        self.router = router or RouterSettings()
        self.router.check(num_experts, num_experts_per_tok)
        # the router, replicated on every rank
        self.gate = nn.Linear(hidden_size, num_experts, bias=self.router.kind == "topk_softmax")
        if self.router.kind in ("sigmoid_group_topk", "sqrtsoftplus_topk"):
            # Selection-only bias (DeepSeek-V3's aux-loss-free balancing): a buffer, as in transformers, so the
            # policy gradient never changes it; it is loaded, held and published with the weights unchanged.
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        # ModuleDict in global id order (state_dict order does not depend on the placement)
        expert_kwargs = expert_kwargs or {}
        self.experts = RoutedExperts(
            {str(e): self.expert_class(hidden_size, moe_intermediate_size, **expert_kwargs) for e in sorted(self.held)}
        )
        # Shared experts every token goes through beside its routed ones (DeepSeek-V3, GLM-4.5: summed; Qwen2-MoE:
        # scaled by sigmoid(shared_expert_gate(x))), replicated on every rank like the router.
        self.shared_experts = (
            (self.shared_expert_class or self.expert_class)(hidden_size, shared_intermediate_size)
            if shared_intermediate_size
            else None
        )
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate else None
        if shared_expert_gate and self.shared_experts is None:
            raise ValueError("shared_expert_gate needs shared experts (shared_intermediate_size > 0)")
        self.dispatch: ExpertDispatch = LocalDispatch()
        # per-expert (global id) count of routed (token, expert) rows, accumulated by forward while a tensor
        # (the model's count_routed_rows); None: not counted
        self.routed_rows: torch.Tensor | None = None
        # While a tensor (the real tokens [T] of the next forward, set by the model): that forward also computes
        # the routers' load-balancing loss into balance_loss (steps/models/router_loss.py)
        self.balance_mask: torch.Tensor | None = None
        self.balance_loss: torch.Tensor | None = None
        # Whether the router chooses the experts (False: a fixed table does, DeepSeek-V4's hash layers, whose routing
        # no load-balancing loss can move: transformers collects no router logits there either)
        self.router_chooses = True
        # While a tensor [T, k] (set by the model for the next forward: MoeCausalLM.set_engine_routes): the experts
        # the rollout engine routed each of the forward's T tokens to, global ids, a row of -1 where it recorded
        # none. With replay_routes the forward uses them (routing replay); route_disagreement, while a tensor, adds
        # [tokens whose routers' own top-k set differs from the engine's, tokens whose experts used by the forward
        # differ from the engine's, tokens with a recorded route].
        self.engine_routes: torch.Tensor | None = None
        self.replay_routes = False
        self.route_disagreement: torch.Tensor | None = None
        # While a list (the torch engine's record of one generate call over a family it decodes with the family's
        # own state, steps/engines/state_decoder.py): each forward appends the router's choice [T, k]
        self.recorded_choices: list[torch.Tensor] | None = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (router_logits [T, E], topk_idx [T, k], topk_weight [T, k]), by the router's kind
        (RouterSettings): choose, then weigh the chosen experts."""
        router_logits, scores, topk_idx = self.choose(hidden)
        return router_logits, topk_idx, self.weigh(router_logits, scores, topk_idx, hidden.dtype)

    def choose(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> (router_logits [T, E], scores [T, E] the weights are taken from, topk_idx [T, k]):
        the router's own choice of experts.

        softmax_topk: softmax over all experts in fp32, its top k (transformers' Qwen3MoeTopKRouter).
        topk_softmax: the top k logits of gate(hidden) with its bias, in hidden's dtype (GptOssTopKRouter).
        sigmoid_group_topk: fp32 logits, sigmoid scores; the selection adds e_score_correction_bias, keeps the
        topk_group groups with the best sum of their two best scores and takes the top k experts in them
        (DeepseekV3TopkRouter).
        sqrtsoftplus_topk: fp32 logits, scores sqrt(softplus(logits)); the top k of scores + e_score_correction_bias
        (DeepseekV4TopKRouter, which scores in the weights' dtype: the same in fp32)."""
        if self.router.kind == "topk_softmax":
            router_logits = self.gate(hidden)
            return router_logits, router_logits, torch.topk(router_logits, self.top_k, dim=-1)[1]
        if self.router.kind == "sqrtsoftplus_topk":
            router_logits = F.linear(hidden.float(), self.gate.weight.float())
            scores = F.softplus(router_logits).sqrt()
            for_choice = scores + self.gate.e_score_correction_bias
            return router_logits, scores, torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        if self.router.kind == "sigmoid_group_topk":
            settings, num_experts = self.router, self.num_experts
            router_logits = F.linear(hidden.float(), self.gate.weight.float())
            scores = router_logits.sigmoid()
            for_choice = scores + self.gate.e_score_correction_bias
            if settings.n_group > 1:
                per_group = for_choice.view(-1, settings.n_group, num_experts // settings.n_group)
                group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
                group_idx = torch.topk(group_scores, k=settings.topk_group, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
                expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(-1, num_experts)
                for_choice = for_choice.masked_fill(~expert_mask, float("-inf"))
            return router_logits, scores, torch.topk(for_choice, k=self.top_k, dim=-1, sorted=False)[1]
        router_logits = self.gate(hidden)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        return router_logits, probs, torch.topk(probs, self.top_k, dim=-1)[1]

    def weigh(
        self, router_logits: torch.Tensor, scores: torch.Tensor, topk_idx: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The combine weights [T, k] (in `dtype`, the hidden states') of experts topk_idx (the router's own
        choice, or replayed ones), from the router's scores (choose) as the router's kind weighs its own choice:
        softmax_topk the softmax probabilities of those experts, renormalised when norm_topk_prob; topk_softmax a
        softmax over those experts' logits; sigmoid_group_topk their sigmoid scores without the bias,
        renormalised when norm_topk_prob; all times routed_scaling_factor. For the router's own choice these
        are the values its top k returned (a gather of the same elements).

        Replayed experts are weighed as Megatron-Core's router replay does (moe/moe_utils.py
        topk_routing_with_score_function with moe/router_replay.py: only the top-k indices are replaced, then
        probs = scores.gather(1, top_indices) with the router's usual normalisation and scaling), which slime,
        Miles and verl reuse; for a softmax router with norm_topk_prob it is R3's softmax of the training logits
        over the replayed experts (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
        and Inference Routers", arXiv 2510.11370). The router gets the gradient of those weights."""
        scale = self.router.routed_scaling_factor
        if self.router.kind == "topk_softmax":
            top_value = router_logits.gather(1, topk_idx)
            topk_weight = torch.softmax(top_value, dim=1, dtype=top_value.dtype)
            return (topk_weight * scale if scale != 1.0 else topk_weight).to(dtype)
        topk_weight = scores.gather(1, topk_idx)
        if self.router.kind in ("sigmoid_group_topk", "sqrtsoftplus_topk"):
            if self.norm_topk_prob:
                topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
            return (topk_weight * scale).to(dtype)
        if self.norm_topk_prob:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        if scale != 1.0:
            topk_weight = topk_weight * scale
        return topk_weight.to(dtype)

    def shared_output(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' contribution for hidden [T, H] (None without shared experts)."""
        if self.shared_experts is None:
            return None
        out = self.shared_experts(hidden)
        if self.shared_expert_gate is not None:
            out = torch.sigmoid(self.shared_expert_gate(hidden)) * out
        return out

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

    def recorded_choice(self, own: torch.Tensor) -> torch.Tensor:
        """The experts the forward uses, given the router's own choice own [T, k] and engine_routes: with
        replay_routes, the engine's where it recorded a route (Rollout Routing Replay), else own. Counts the
        disagreement between the two sets into route_disagreement while that is a tensor."""
        routes = self.engine_routes
        if routes is None or routes.shape != own.shape:
            raise RuntimeError(
                f"engine routes of shape {None if routes is None else tuple(routes.shape)} for a forward whose "
                f"router chose {tuple(own.shape)}: the routes must follow the tokens of the forward"
            )
        routes = routes.to(own.device)
        recorded = routes[:, 0] >= 0
        used = torch.where(recorded[:, None], routes, own) if self.replay_routes else own
        if self.route_disagreement is not None:
            engine = routes.sort(dim=-1).values
            router_differs = (own.sort(dim=-1).values != engine).any(dim=-1) & recorded
            used_differs = (used.sort(dim=-1).values != engine).any(dim=-1) & recorded
            counts = torch.stack([router_differs.sum(), used_differs.sum(), recorded.sum()])
            self.route_disagreement += counts.to(self.route_disagreement)
        return used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden = x.reshape(-1, self.hidden_size)
        router_logits, scores, topk_idx = self.choose(hidden)
        if self.recorded_choices is not None:
            self.recorded_choices.append(topk_idx)
        if self.engine_routes is not None:
            topk_idx = self.recorded_choice(topk_idx)
        topk_weight = self.weigh(router_logits, scores, topk_idx, hidden.dtype)
        if self.balance_mask is not None:
            self.balance_loss = load_balancing_loss(router_logits, topk_idx, self.router.kind, self.balance_mask)
        if self.routed_rows is not None:
            self.routed_rows += torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
        if isinstance(self.dispatch, LocalDispatch) and self.num_local_experts != self.num_experts:
            raise RuntimeError(
                f"LocalDispatch: this block holds {self.num_local_experts} of {self.num_experts} experts and "
                "does not hold the others; use an expert-parallel dispatcher for a partial shard"
            )
        out = self.experts(self.dispatch, hidden, self.to_slots(topk_idx), topk_weight, self.held)
        shared = self.shared_output(hidden)
        if shared is not None:
            out = out + shared
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
