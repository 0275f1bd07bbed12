"""trainer.fsdp: the non-expert parameters (attention, norms, routers, shared experts, dense layers, embeddings and
the output projection), their gradients and their AdamW state sharded over all the trainer's ranks with FSDP2
(torch.distributed.fsdp.fully_shard, one unit per decoder layer and one for the rest), as torchtitan shards a
MoE's dense part. The routed experts stay out of it (ignored_params): expert parallelism already splits them, and
their gradients are reduced over their dp replicas by steps/expert_parallel/mesh.py.

trainer.shard_experts shards the routed experts too, over the dp replicas of their EP rank (shard_experts).

Every replicated parameter becomes a DTensor sharded on dim 0 over the world (Shard(0)), its gradient reduce-
scattered (averaged over the ranks, as sync_gradients averages a replicated gradient) in the backward and its
AdamW state made by the optimizer in the same layout. What reads or writes a parameter by name (the candidate's
files, the optimizer state files, what a trainer that stays up holds) sees whole tensors through full_tensor /
full_state_dict, collectives that every rank calls in the same order (the DTensors are the non-expert parameters,
the same names in the same order on every rank); restoring goes the other way with like_param, which cuts a whole
tensor into this rank's shard without any communication."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from steps.expert_parallel.mesh import Mesh
from steps.models.placement import is_expert_param

# The methods of the model and of its decoder layers that run a forward besides `forward` (FSDP2 gathers a
# unit's parameters only around the methods it is told of).
FORWARD_METHODS = ("forward_shared_prompts",)


def shard_non_experts(model: nn.Module, mesh: Mesh, force: bool = False) -> bool:
    """Apply FSDP2 to `model` (a MoeCausalLM with its weights loaded, its expert dispatch set) over all of mesh's
    ranks: each decoder layer a unit, the root the rest; the routed experts ignored. Returns whether it sharded
    (a world of one rank has nothing to shard over; force: shard over it all the same, as bench/gpu_smoke.py does
    to run FSDP2's code on one GPU)."""
    if mesh.world_group is None or (mesh.world_size == 1 and not force):
        return False
    device_mesh = DeviceMesh.from_group(mesh.world_group, mesh.device.type)
    # the routed experts, unless shard_experts already made them its own units (FSDP2 leaves those alone)
    experts = {p for name, p in model.named_parameters() if is_expert_param(name) and not isinstance(p, DTensor)}
    for layer in model.decoder_layers():
        fully_shard(layer, mesh=device_mesh, ignored_params=experts & set(layer.parameters()))
        for method in FORWARD_METHODS:
            if hasattr(layer, method):
                register_fsdp_forward_method(layer, method)
    # The root keeps its parameters (embeddings, final norm, output projection) gathered from its forward to its
    # backward: they are needed at both ends of the model.
    fully_shard(model, mesh=device_mesh, ignored_params=experts, reshard_after_forward=False)
    for method in FORWARD_METHODS:
        register_fsdp_forward_method(model, method)
    return True


def shard_experts(model: nn.Module, mesh: Mesh) -> bool:
    """trainer.shard_experts: each MoE layer's routed experts of this rank (its EP share) sharded over the dp
    replicas that hold the same experts (mesh.replica_group) with FSDP2, one unit per layer (RoutedExperts, the
    module whose call runs the dispatch): a GPU keeps 1/dp of its experts' weights, gradients and AdamW state, and
    gathers one layer's around its forward and backward. Call before shard_non_experts. Returns whether it
    sharded (a single replica has nothing to shard over)."""
    if mesh.dp_size == 1 or mesh.replica_group is None:
        return False
    replicas = DeviceMesh.from_group(mesh.replica_group, mesh.device.type)
    for block in model.moe_blocks():
        block.experts.gradient_for_every_expert = True  # every replica reduce-scatters every expert's gradient
        fully_shard(block.experts, mesh=replicas, reshard_after_forward=True)
    return True


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one (a collective: every rank calls it for the same tensor), else t."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def any_sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """model.state_dict() with every sharded tensor whole, on the CPU, one tensor gathered at a time (every rank
    calls this, in the same order); keep=False takes part in the gathers and keeps nothing of them (a rank that
    writes none of the files). The expert tensors are this rank's own, as always."""
    out = {}
    for name, t in model.state_dict().items():
        whole = full_tensor(t)
        if keep:
            out[name] = whole.detach().to("cpu")
        del whole
    return out


def like_param(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` (the whole tensor of parameter p's shape) on p's device and dtype, in p's layout: this rank's shard
    of it when p is sharded (cut locally: every rank holds the whole tensor), else the tensor itself."""
    whole = whole.to(device=p.device if not isinstance(p, DTensor) else p.to_local().device, dtype=p.dtype)
    if isinstance(p, DTensor):
        return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
    return whole
