"""Expert parallelism for training: the dp x ep process mesh, the dispatch backends and gradient sync.

The world of R ranks is a mesh of dp x ep: rank = dp_rank * ep + ep_rank. The ep ranks of one row (an "EP
group") split the experts of every MoE layer between them, E/ep contiguous experts each (owner of expert e:
e // (E/ep)); the dp rows hold the same expert slices ("expert replicas"). Everything that is not an expert
(embeddings, attention, norms, routers, lm_head) is replicated on all R ranks. Every rank trains on its own
slice of the global batch.

Dispatch backends, one `ExpertDispatch` contract (steps/moe.py):
  local     one rank, all experts (steps.moe.LocalDispatch).
  alltoall  torch.distributed.all_to_all_single, gloo on CPU or NCCL on GPU: every (token, expert) slot is
            sent to the expert's owner, run there, and sent back; each exchange is an autograd Function whose
            backward is the reverse exchange.
  deepep    DeepEP 2.x ElasticBuffer dispatch/combine (NVLink in a node, RDMA/EFA across nodes), GPU only,
            imported when first used. DeepEP sends tokens (not slots) in bf16; the owner applies the router
            weights and combine sums the ranks' partial outputs.

Gradients (`sync_gradients`): each rank's loss is scaled to be its estimate of the global objective
(loss_r = R * sum of its token losses / global tokens), so that
  - replicated parameters: the average over all R ranks is the gradient of the global objective;
  - experts: the all-to-all backward already *sums* the gradients of the ep ranks of a group at the owner,
    so expert gradients are averaged over the dp replicas and divided by ep.
`clip_grad_norm` then computes the global norm with every parameter counted once.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from steps.errors import MoerlError
from steps.moe import ExpertDispatch, LocalDispatch, group_by_expert, run_experts

BACKENDS = ("local", "alltoall", "deepep")
_EXPERT_PARAM = re.compile(r"(^|\.)experts\.\d+\.")


def is_expert_param(name: str) -> bool:
    """`model.layers.3.mlp.experts.17.up_proj.weight` (or `experts.17...` inside a bare MoeBlock)."""
    return _EXPERT_PARAM.search(name) is not None


# ----------------------------------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------------------------------


@dataclass
class Mesh:
    """This rank's place in the dp x ep mesh and the process groups it talks to.

    ep_group: the ep ranks that split the experts with this rank (None when ep == 1);
    replica_group: the dp ranks that hold the same experts as this rank (None when dp == 1);
    world_group: all ranks (None when the world is one process).
    """

    rank: int = 0
    world_size: int = 1
    ep_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ep_group: dist.ProcessGroup | None = None
    replica_group: dist.ProcessGroup | None = None
    world_group: dist.ProcessGroup | None = None

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ep_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ep_size

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """The contiguous global expert ids [first, end) this rank holds."""
        per_rank = num_experts // self.ep_size
        return self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank

    def ep_ranks(self) -> list[int]:
        return [self.dp_rank * self.ep_size + i for i in range(self.ep_size)]

    def replica_ranks(self) -> list[int]:
        return [d * self.ep_size + self.ep_rank for d in range(self.dp_size)]


def resolve_ep_size(world_size: int, num_experts: int, requested: int | None = None) -> int:
    """The EP group size: `requested`, or by default the largest size that divides both the world and E."""
    ep = requested if requested else math.gcd(world_size, num_experts)
    if world_size % ep or num_experts % ep:
        raise MoerlError(
            f"expert-parallel size {ep} must divide both the number of trainer ranks ({world_size}) and "
            f"num_experts ({num_experts}); choose an ep size that divides both, or change nproc_per_node/nodes"
        )
    return ep


def build_mesh(rank: int, world_size: int, ep_size: int, device: torch.device) -> Mesh:
    """Create the process groups of the dp x ep mesh (torch.distributed must be initialised when R > 1).

    Every rank creates every group in the same order, as dist.new_group requires.
    """
    mesh = Mesh(rank=rank, world_size=world_size, ep_size=ep_size, device=device)
    if world_size == 1:
        return mesh
    mesh.world_group = dist.group.WORLD
    dp_size = world_size // ep_size
    if ep_size > 1:
        for d in range(dp_size):
            group = dist.new_group([d * ep_size + i for i in range(ep_size)])
            if d == mesh.dp_rank:
                mesh.ep_group = group
    if dp_size > 1:
        for e in range(ep_size):
            group = dist.new_group([d * ep_size + e for d in range(dp_size)])
            if e == mesh.ep_rank:
                mesh.replica_group = group
    return mesh


# ----------------------------------------------------------------------------------------------------
# Timing of the exchanges (the bench reports the share of step time spent in dispatch/combine)
# ----------------------------------------------------------------------------------------------------


class CommTimer:
    """Wall time spent in dispatch/combine exchanges, forward and backward. On CUDA it synchronises the
    device around each exchange while enabled, so leave it disabled outside benchmarks."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.seconds = 0.0

    def measure(self, device: torch.device) -> _Span:
        return _Span(self, device)


class _Span:
    def __init__(self, timer: CommTimer, device: torch.device) -> None:
        self.timer, self.device = timer, device

    def __enter__(self) -> None:
        if self.timer.enabled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.timer.enabled:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.timer.seconds += time.perf_counter() - self.start


# ----------------------------------------------------------------------------------------------------
# alltoall backend
# ----------------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows of x go to the ranks of `group` (input_splits[i] rows to rank i) and rows come back
    (output_splits[i] from rank i). The backward is the same exchange in reverse: the gradient of each row
    goes back to the rank the row came from."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
        timer: CommTimer,
    ) -> torch.Tensor:
        ctx.splits = (output_splits, input_splits)  # type: ignore[attr-defined]
        ctx.group, ctx.timer = group, timer  # type: ignore[attr-defined]
        return _exchange(x, output_splits, input_splits, group, timer)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        output_splits, input_splits = ctx.splits  # type: ignore[attr-defined]
        grad_x = _exchange(grad, input_splits, output_splits, ctx.group, ctx.timer)  # type: ignore[attr-defined]
        return grad_x, None, None, None, None


def _exchange(
    x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup, timer: CommTimer
) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    with timer.measure(x.device):
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _PermuteRows(torch.autograd.Function):
    """x[perm] for a permutation of the rows. The backward is a gather with the inverse permutation, where
    plain indexing would zero-fill and scatter-add (slower, and atomics on CUDA)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x[perm]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad[inverse], None, None


class _TokensToSlots(torch.autograd.Function):
    """hidden [T, H] -> [T*k, H]: the row of each of the T*k (token, expert) slots, slots in `order`
    (slot s belongs to token s // k). The backward sums each token's k slot gradients in a fixed order."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        order: torch.Tensor,
        inverse: torch.Tensor,
        top_k: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k  # type: ignore[attr-defined]
        return hidden[order // top_k]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors  # type: ignore[attr-defined]
        per_slot = grad[inverse]  # back to token-major slot order: slot t*k + j
        return per_slot.view(-1, ctx.top_k, grad.shape[-1]).sum(dim=1), None, None, None  # type: ignore[attr-defined]


class AllToAllDispatch:
    """Expert parallelism over all_to_all_single (gloo or NCCL).

    Per MoE layer and call, three exchanges forward and two backward: (1) the T*k slots are grouped by
    global expert id, which also groups them by owner rank; (2) one small exchange of per-expert counts tells
    every owner how many rows to expect from each rank for each of its experts (it runs while the slots'
    rows are gathered); (3) the slots' hidden rows go to their owners; (4) each owner regroups what it
    received by local expert, runs each expert once, and restores the received order; (5) the outputs go
    back, are put back in slot order and summed over the k slots with the router weights (a gather + sum, so
    the result is deterministic). Every reordering is a permutation whose backward is the inverse gather, so
    the backward has no scatter-add either. The number of exchanges does not depend on the number of
    experts: few, large messages, which is what a latency-bound transport (gloo on loopback) needs.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        ep_size: int,
        num_experts: int,
        expert_offset: int,
        device: torch.device,
        timer: CommTimer | None = None,
    ) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the EP size {ep_size}")
        self.group = group
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_offset = expert_offset
        self.device = device
        self.timer = timer or CommTimer()

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        experts: nn.ModuleDict,
    ) -> torch.Tensor:
        num_tokens, top_k = topk_idx.shape
        local = self.num_local_experts

        # (1) slots grouped by expert, hence by owner rank; per_expert: rows this rank sends to each expert
        order, inverse_order, per_expert = group_by_expert(topk_idx.reshape(-1), self.num_experts)

        # (2) recv_counts[s * local + j]: rows rank s sends to this rank's local expert j. Asynchronous: the
        # gather of the slots' rows below runs while the counts travel.
        recv_counts = torch.empty_like(per_expert)
        with self.timer.measure(hidden.device):
            counts_sent = dist.all_to_all_single(recv_counts, per_expert, group=self.group, async_op=True)
        routed = _TokensToSlots.apply(hidden, order, inverse_order, top_k)
        with self.timer.measure(hidden.device):
            counts_sent.wait()
        counts = torch.stack([per_expert, recv_counts]).cpu()  # one device->host copy for all the sizes
        send_splits = counts[0].view(self.ep_size, local).sum(1).tolist()
        recv_matrix = counts[1].view(self.ep_size, local)
        recv_splits = recv_matrix.sum(1).tolist()

        # (3) send each slot's hidden row to the owner of its expert
        received = _AllToAll.apply(routed, recv_splits, send_splits, self.group, self.timer)

        # (4) regroup by local expert, run each expert once on its rows, restore the received order
        local_ids = torch.arange(local, device=hidden.device).repeat(self.ep_size)
        expert_of_row = torch.repeat_interleave(local_ids, counts[1].to(hidden.device))
        by_expert, inverse_by_expert, _ = group_by_expert(expert_of_row, local)
        grouped = _PermuteRows.apply(received, by_expert, inverse_by_expert)
        # an owner that received nothing still takes part in both exchanges (they are collective)
        expert_out = run_experts(experts, grouped, recv_matrix.sum(0).tolist(), self.expert_offset)
        expert_out = _PermuteRows.apply(expert_out, inverse_by_expert, by_expert)

        # (5) back to the sending ranks, in slot order, weighted and summed over the k slots
        returned = _AllToAll.apply(expert_out, send_splits, recv_splits, self.group, self.timer)
        if num_tokens == 0:
            return hidden.new_zeros(hidden.shape) + returned.sum() * 0.0
        per_slot = _PermuteRows.apply(returned, inverse_order, order).view(num_tokens, top_k, -1)
        return (per_slot * topk_weight.unsqueeze(-1).to(per_slot.dtype)).sum(dim=1)


# ----------------------------------------------------------------------------------------------------
# deepep backend (DeepEP 2.x ElasticBuffer)
# ----------------------------------------------------------------------------------------------------


def import_deep_ep() -> object:
    """The deep_ep module (DeepEP >= 2, with ElasticBuffer), or a MoerlError saying what is missing."""
    try:
        import deep_ep  # noqa: PLC0415 - GPU-only dependency, imported when the backend is chosen
    except ImportError as err:
        raise MoerlError(
            f"trainer.ep_backend 'deepep': DeepEP is not installed ({err}); use the trainer image "
            "(images/trainer), which builds DeepEP 2.x, or set trainer.ep_backend: alltoall"
        ) from err
    if not hasattr(deep_ep, "ElasticBuffer"):
        raise MoerlError(
            f"trainer.ep_backend 'deepep': deep_ep {getattr(deep_ep, '__version__', '?')} has no "
            "ElasticBuffer; moerl needs DeepEP 2.x — rebuild the trainer image or use alltoall"
        )
    return deep_ep


class _DeepEPDispatchFn(torch.autograd.Function):
    """Tokens to the ranks that own any of their experts; backward: combine of the gradients."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_idx: torch.Tensor,
        owner: DeepEPDispatch,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with owner.timer.measure(x.device):
            recv_x, recv_idx, recv_weights, handle, _ = owner.buffer.dispatch(
                x,
                topk_idx=topk_idx,
                topk_weights=topk_weights,
                num_experts=owner.num_experts,
                num_max_tokens_per_rank=owner.max_tokens_per_rank,
            )
        ctx.owner, ctx.handle = owner, handle  # type: ignore[attr-defined]
        owner.last_handle = handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_weights, recv_idx

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_x: torch.Tensor,
        grad_weights: torch.Tensor | None,
        _grad_idx: torch.Tensor | None,
    ) -> tuple:
        owner, handle = ctx.owner, ctx.handle  # type: ignore[attr-defined]
        if grad_weights is None:
            grad_weights = torch.zeros(grad_x.shape[0], handle.topk_idx.shape[1], device=grad_x.device)
        with owner.timer.measure(grad_x.device):
            combined_x, combined_weights, _ = owner.buffer.combine(
                grad_x.contiguous(), handle=handle, topk_weights=grad_weights.float().contiguous()
            )
        return combined_x, combined_weights, None, None


class _DeepEPCombineFn(torch.autograd.Function):
    """Sum the ranks' partial outputs back at each token's rank; backward: dispatch of the gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, y: torch.Tensor, owner: DeepEPDispatch, handle: object
    ) -> torch.Tensor:
        with owner.timer.measure(y.device):
            combined, _, _ = owner.buffer.combine(y, handle=handle)
        ctx.owner, ctx.handle = owner, handle  # type: ignore[attr-defined]
        return combined

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        owner, handle = ctx.owner, ctx.handle  # type: ignore[attr-defined]
        with owner.timer.measure(grad.device):
            grad_y, _, _, _, _ = owner.buffer.dispatch(grad.contiguous(), handle=handle)
        return grad_y, None, None


class DeepEPDispatch:
    """Expert parallelism over DeepEP 2.x (`deep_ep.ElasticBuffer`), normal (high-throughput) mode.

    DeepEP sends each token once to every rank owning one of its experts, in bf16, with its top-k ids
    (local ids there, -1 for experts held elsewhere) and fp32 weights. The owner computes
    sum_j w_j * expert_j(x) over its own experts, and combine sums those partial outputs at the token's rank.
    The buffer is created on first use, sized for `max_tokens_per_rank` tokens (the same on every rank), with
    DeepEP's deterministic receive order.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        expert_offset: int,
        num_local_experts: int,
        hidden_size: int,
        top_k: int,
        max_tokens_per_rank: int,
        timer: CommTimer | None = None,
    ) -> None:
        self.deep_ep = import_deep_ep()
        if torch.are_deterministic_algorithms_enabled():
            # DeepEP allocates with torch.empty on its own stream; filling it would race with the kernels
            torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
        self.group = group
        self.num_experts = num_experts
        self.expert_offset = expert_offset
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.timer = timer or CommTimer()
        self.last_handle: object = None
        self._buffer: object = None

    @property
    def buffer(self) -> object:
        if self._buffer is None:
            self._buffer = self.deep_ep.ElasticBuffer(  # type: ignore[attr-defined]
                self.group,
                num_max_tokens_per_rank=self.max_tokens_per_rank,
                hidden=self.hidden_size,
                num_topk=self.top_k,
                deterministic=True,
            )
        return self._buffer

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        experts: nn.ModuleDict,
    ) -> torch.Tensor:
        if hidden.shape[0] > self.max_tokens_per_rank:
            raise RuntimeError(
                f"DeepEPDispatch: {hidden.shape[0]} tokens on this rank exceed the buffer's "
                f"max_tokens_per_rank={self.max_tokens_per_rank}"
            )
        recv_x, recv_weights, recv_idx = _DeepEPDispatchFn.apply(
            hidden.to(torch.bfloat16).contiguous(),
            topk_weight.float().contiguous(),
            topk_idx.to(self.deep_ep.topk_idx_t).contiguous(),  # type: ignore[attr-defined]
            self,
        )
        handle = self.last_handle
        num_recv = int(handle.num_recv_tokens)  # type: ignore[attr-defined]  # exact: dispatch synced the CPU

        # The received rows' (row, slot) pairs that name one of this rank's experts, grouped by expert.
        x = recv_x[:num_recv].to(hidden.dtype)
        ids = recv_idx[:num_recv]
        rows, slots = (ids >= 0).nonzero(as_tuple=True)
        by_expert, _, counts = group_by_expert(ids[rows, slots], self.num_local_experts)
        rows, slots = rows[by_expert], slots[by_expert]
        # With no rows the (empty) outputs still hang off recv_x, so this rank takes part in the backward.
        out = run_experts(experts, x[rows], counts.tolist(), self.expert_offset)
        weighted = out * recv_weights[:num_recv][rows, slots].unsqueeze(-1).to(out.dtype)
        # each (row, expert) pair occurs once; index_add is deterministic in torch's deterministic mode
        partial = x.new_zeros(recv_x.shape[0], x.shape[1]).index_add(0, rows, weighted)
        combined = _DeepEPCombineFn.apply(partial.to(torch.bfloat16).contiguous(), self, handle)
        return combined.to(hidden.dtype)


# ----------------------------------------------------------------------------------------------------
# Choosing a backend
# ----------------------------------------------------------------------------------------------------


def make_dispatch(
    backend: str,
    mesh: Mesh,
    num_experts: int,
    hidden_size: int = 0,
    top_k: int = 0,
    max_tokens_per_rank: int = 0,
    timer: CommTimer | None = None,
) -> ExpertDispatch:
    """The dispatcher of `backend` for this rank (see the module docstring)."""
    if backend not in BACKENDS:
        raise MoerlError(f"trainer.ep_backend {backend!r}: unknown; use one of {', '.join(BACKENDS)}")
    if backend == "local":
        if mesh.world_size > 1:
            raise MoerlError(
                f"trainer.ep_backend 'local' runs on one rank but the trainer has {mesh.world_size}; "
                "set nproc_per_node: 1 and nodes: 1, or use ep_backend: alltoall"
            )
        return LocalDispatch()
    if mesh.ep_size == 1:
        return LocalDispatch()  # pure data parallelism: every rank holds every expert, nothing to exchange
    assert mesh.ep_group is not None
    first, _ = mesh.expert_range(num_experts)
    if backend == "alltoall":
        return AllToAllDispatch(mesh.ep_group, mesh.ep_size, num_experts, first, mesh.device, timer)
    if mesh.device.type != "cuda":
        raise MoerlError(
            "trainer.ep_backend 'deepep' needs CUDA GPUs (DeepEP is GPU-only); run the trainer on GPU nodes "
            "or set trainer.ep_backend: alltoall"
        )
    return DeepEPDispatch(
        mesh.ep_group, num_experts, first, num_experts // mesh.ep_size, hidden_size, top_k,
        max_tokens_per_rank, timer,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------------


def _split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared, experts = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (experts if is_expert_param(name) else shared).append(p)
    return shared, experts


def _grads(params: list[nn.Parameter]) -> Iterator[torch.Tensor]:
    for p in params:
        if p.grad is None:  # e.g. an expert no token chose: it still takes part in the reductions
            p.grad = torch.zeros_like(p)
        yield p.grad


def _all_reduce_mean(params: list[nn.Parameter], group: dist.ProcessGroup | None, size: int) -> None:
    """Average the grads over `group` with one flat all-reduce (fixed order: deterministic)."""
    grads = list(_grads(params))
    if group is None or size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(model: nn.Module, mesh: Mesh) -> None:
    """Make every rank's gradients those of the global objective (module docstring, "Gradients")."""
    shared, experts = _split_params(model)
    _all_reduce_mean(shared, mesh.world_group, mesh.world_size)
    _all_reduce_mean(experts, mesh.replica_group, mesh.dp_size)
    if mesh.ep_size > 1:
        for g in _grads(experts):
            g /= mesh.ep_size


def global_grad_norm(model: nn.Module, mesh: Mesh) -> torch.Tensor:
    """L2 norm of the whole model's gradient (after sync_gradients), each parameter counted once."""
    shared, experts = _split_params(model)
    zero = torch.zeros((), device=mesh.device)
    shared_sq = torch.stack([g.float().pow(2).sum() for g in _grads(shared)]).sum() if shared else zero
    expert_sq = torch.stack([g.float().pow(2).sum() for g in _grads(experts)]).sum() if experts else zero
    if mesh.ep_group is not None:
        expert_sq = expert_sq.clone()
        dist.all_reduce(expert_sq, op=dist.ReduceOp.SUM, group=mesh.ep_group)
    return (shared_sq + expert_sq).sqrt()


def clip_grad_norm(model: nn.Module, mesh: Mesh, max_norm: float) -> float:
    """Scale the gradients so that their global norm is at most max_norm (0: no clipping); returns the norm
    before clipping. The same factor is applied on every rank."""
    total = global_grad_norm(model, mesh)
    if max_norm > 0 and torch.isfinite(total):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.dtype))
    return float(total)


def all_reduce_sum(values: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Sum a small tensor of statistics over all ranks (returns a new tensor)."""
    out = values.clone()
    if mesh.world_group is not None:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh.world_group)
    return out


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
