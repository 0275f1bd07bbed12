"""The dp x ep process mesh, and what the trainer does over it: gradient sync, global-norm clipping and the
small collectives of its statistics (how the pieces fit: steps/expert_parallel/__init__.py).

Gradients (`sync_gradients`): each rank's loss is scaled to be its estimate of the global objective
(loss_r = R * sum of its token losses / global tokens), so that
  - replicated parameters: the average over all R ranks is the gradient of the global objective;
  - experts: the all-to-all backward already *sums* the gradients of the ep ranks of a group at the owner,
    so expert gradients are averaged over the dp replicas and divided by ep.
`clip_grad_norm` then computes the global norm with every parameter counted once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from steps.errors import MoerlError
from steps.models.placement import is_expert_param

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

    def ep_ranks(self) -> list[int]:
        return [self.dp_rank * self.ep_size + i for i in range(self.ep_size)]

    def replica_ranks(self) -> list[int]:
        return [d * self.ep_size + self.ep_rank for d in range(self.dp_size)]


def resolve_ep_size(world_size: int, num_experts: int, requested: int | None = None) -> int:
    """The EP group size: `requested` (trainer.ep_size), or by default the largest size that divides both the
    world and E. The data-parallel size is world_size // ep."""
    ep = requested if requested else math.gcd(world_size, num_experts)
    if world_size % ep or num_experts % ep:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0 and num_experts % d == 0]
        raise MoerlError(
            f"trainer.ep_size {ep}: must divide both the number of trainer ranks ({world_size}) and the "
            f"checkpoint's num_experts ({num_experts}); set trainer.ep_size to one of {fits}, or change "
            "nproc_per_node/nodes"
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
# Gradients
# ----------------------------------------------------------------------------------------------------


def _split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared, experts = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (experts if is_expert_param(name) else shared).append(p)
    return shared, experts


def _sharded(p: torch.Tensor) -> bool:
    """A parameter FSDP2 shards over the ranks (trainer.fsdp, steps/training/sharding.py): a DTensor whose
    gradient the backward has already averaged over the world and whose shards together count it once."""
    return isinstance(p, DTensor)


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
    _all_reduce_mean([p for p in shared if not _sharded(p)], mesh.world_group, mesh.world_size)
    # sharded experts (trainer.shard_experts) were averaged over their replicas by the backward's reduce-scatter
    _all_reduce_mean([p for p in experts if not _sharded(p)], mesh.replica_group, mesh.dp_size)
    if mesh.ep_size > 1:
        for g in _grads(experts):
            (g.to_local() if _sharded(g) else g).div_(mesh.ep_size)


def global_grad_norm(model: nn.Module, mesh: Mesh) -> torch.Tensor:
    """L2 norm of the whole model's gradient (after sync_gradients), each parameter counted once."""
    shared, experts = _split_params(model)
    zero = torch.zeros((), device=mesh.device)

    def squares(params: list[nn.Parameter]) -> torch.Tensor:
        return torch.stack([g.float().pow(2).sum() for g in _grads(params)]).sum() if params else zero

    whole = [p for p in shared if not _sharded(p)]
    shared_sq = squares(whole)
    sharded = [p for p in shared if _sharded(p)]
    if sharded:  # each rank's shards, summed over the world: every element once
        local = torch.stack([g.to_local().float().pow(2).sum() for g in _grads(sharded)]).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=mesh.world_group)
        shared_sq = shared_sq + local
    expert_sq = squares([p for p in experts if not _sharded(p)])
    sharded_experts = [p for p in experts if _sharded(p)]
    if sharded_experts:  # each replica holds a shard of its EP rank's experts: summed over the replicas first
        local = torch.stack([g.to_local().float().pow(2).sum() for g in _grads(sharded_experts)]).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=mesh.replica_group)
        expert_sq = expert_sq + local
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
                (p.grad.to_local() if _sharded(p.grad) else p.grad).mul_(coef.to(p.grad.dtype))
    return float(total)


def all_reduce_sum(values: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Sum a small tensor of statistics over all ranks (returns a new tensor)."""
    out = values.clone()
    if mesh.world_group is not None:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=mesh.world_group)
    return out


def gather_ranks(values: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Every rank's copy of a small 1-D tensor, stacked in rank order [R, n] (one collective; reduce it
    locally, in rank order, with sums and maxima alike)."""
    if mesh.world_group is None:
        return values.unsqueeze(0).clone()
    parts = [torch.empty_like(values) for _ in range(mesh.world_size)]
    dist.all_gather(parts, values.contiguous(), group=mesh.world_group)
    return torch.stack(parts)
