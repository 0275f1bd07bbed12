"""Expert parallelism for training: the dp x ep process mesh, the dispatch backends and gradient sync.

The world of R ranks is a mesh of dp x ep: rank = dp_rank * ep + ep_rank. The ep ranks of one row (an "EP
group") split the experts of every MoE layer between them, E/ep experts each, as the iteration's
`ExpertPlacement` says: per MoE layer, the E global expert ids in slot order, EP rank r holding slots
[r*E/ep, (r+1)*E/ep) (owner of slot s: s // (E/ep)). The identity placement gives contiguous ranges; the
update chooses, per layer, the split that evens out the ranks' routed rows (`balanced_placement`, from the
previous iteration's per-expert row counts). The MoE block maps its router's expert ids to slot ids, so the
dispatch backends only ever see contiguous slot ranges. The dp rows hold the same expert slices ("expert
replicas"). Everything that is not an expert (embeddings, attention, norms, routers, lm_head) is replicated
on all R ranks. Every rank trains on its own slice of the global batch.

Dispatch backends, one `ExpertDispatch` contract (steps/moe.py):
  local     one rank, all experts (steps.moe.LocalDispatch).
  alltoall  torch.distributed.all_to_all_single, gloo on CPU or NCCL on GPU: every (token, expert) slot is
            sent to the expert's owner, run there, and sent back; one autograd Function per MoE layer with a
            hand-written backward, which overlaps every exchange with the experts' work on the slots that
            stay on this rank.
  deepep    DeepEP 2.x ElasticBuffer dispatch/combine (NVLink in a node, RDMA/EFA across nodes), GPU only,
            imported when first used. DeepEP sends tokens (not slots) in bf16; the owner applies the router
            weights and combine sums the ranks' partial outputs. Every dispatch passes num_sms (DeepEP's
            own SM model, run once with bandwidths given, `deepep_bandwidths`): left at 0, DeepEP detects
            the RDMA bandwidth with ibstat, which finds nothing on EFA, and the backward's cached dispatch
            fails before it reads the handle (tests/test_deepep_contract.py holds both rules).

Gradients (`sync_gradients`): each rank's loss is scaled to be its estimate of the global objective
(loss_r = R * sum of its token losses / global tokens), so that
  - replicated parameters: the average over all R ranks is the gradient of the global objective;
  - experts: the all-to-all backward already *sums* the gradients of the ep ranks of a group at the owner,
    so expert gradients are averaged over the dp replicas and divided by ep.
`clip_grad_norm` then computes the global norm with every parameter counted once.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from steps.errors import MoerlError
from steps.moe import (
    ExpertDispatch,
    LocalDispatch,
    SlotOrder,
    SwiGLURows,
    expert_spans,
    fuse_expert_weights,
    group_by_expert,
    run_experts,
    split_expert_grads,
    swiglu_backward_input,
    swiglu_backward_weights,
    swiglu_forward,
)

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
# Expert placement: which experts each EP rank holds, per MoE layer
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertPlacement:
    """slots[l]: MoE layer l's E global expert ids in slot order (l counts the MoE layers in model order);
    EP rank r holds slots [r*E/ep, (r+1)*E/ep) of every layer. Checkpoint tensors and optimizer state keep
    the global ids, so any placement reads and writes the same formats."""

    slots: tuple[tuple[int, ...], ...]
    ep_size: int

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("an expert placement needs at least one MoE layer")
        num_experts = len(self.slots[0])
        if self.ep_size < 1 or num_experts % self.ep_size:
            raise ValueError(f"EP size {self.ep_size} does not divide {num_experts} experts")
        for layer, row in enumerate(self.slots):
            if sorted(row) != list(range(num_experts)):
                raise ValueError(f"MoE layer {layer}: {list(row)} is not a permutation of 0..{num_experts - 1}")

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, ep_size: int) -> ExpertPlacement:
        """The identity: EP rank r holds experts [r*E/ep, (r+1)*E/ep) of every layer."""
        return cls(tuple(tuple(range(num_experts)) for _ in range(num_layers)), ep_size)

    @classmethod
    def from_lists(cls, slots: Sequence[Sequence[int]], ep_size: int) -> ExpertPlacement:
        return cls(tuple(tuple(int(e) for e in row) for row in slots), ep_size)

    @property
    def num_layers(self) -> int:
        return len(self.slots)

    @property
    def num_experts(self) -> int:
        return len(self.slots[0])

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def is_contiguous(self) -> bool:
        return all(row == tuple(range(self.num_experts)) for row in self.slots)

    def held(self, layer: int, ep_rank: int) -> tuple[int, ...]:
        """The global expert ids EP rank `ep_rank` holds in MoE layer `layer`, in slot order."""
        return self.slots[layer][ep_rank * self.per_rank : (ep_rank + 1) * self.per_rank]

    def rank_rows(self, loads: Sequence[Sequence[int]]) -> list[list[int]]:
        """Per MoE layer, the rows each EP rank's experts get under this placement, from per-expert loads."""
        return [
            [sum(int(layer_loads[e]) for e in self.held(layer, r)) for r in range(self.ep_size)]
            for layer, layer_loads in enumerate(loads)
        ]

    def to_lists(self) -> list[list[int]]:
        return [list(row) for row in self.slots]


def _max_group(loads: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    return max(sum(loads[e] for e in g) for g in groups)


def _balance_layer(loads: list[int], ep_size: int) -> tuple[int, ...]:
    """One layer's slots: ep groups of exactly E/ep experts with the largest group load as small as greedy
    plus pairwise swaps make it; the contiguous split when that is as good (no needless moves)."""
    num_experts = len(loads)
    per_rank = num_experts // ep_size
    contiguous = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep_size)]
    # Greedy (LPT with a size limit): heaviest expert first (ties: lower id), to the least-loaded group
    # that has room (ties: lower group index).
    groups: list[list[int]] = [[] for _ in range(ep_size)]
    sums = [0] * ep_size
    for e in sorted(range(num_experts), key=lambda e: (-loads[e], e)):
        g = min((g for g in range(ep_size) if len(groups[g]) < per_rank), key=lambda g: (sums[g], g))
        groups[g].append(e)
        sums[g] += loads[e]
    # Swaps out of the heaviest group while one lowers it without making the other group as heavy: each
    # lowers the sum of squared group loads, so this ends; the best swap (smallest resulting pair maximum,
    # then lowest ids) keeps it deterministic.
    while True:
        heavy = min(range(ep_size), key=lambda g: (-sums[g], g))
        best: tuple[int, int, int, int, int] | None = None  # (new max of the pair, a, b, group, delta)
        for g in range(ep_size):
            if g == heavy:
                continue
            for a in sorted(groups[heavy]):
                for b in sorted(groups[g]):
                    delta = loads[a] - loads[b]
                    if delta <= 0 or sums[g] + delta >= sums[heavy]:
                        continue
                    candidate = (max(sums[heavy] - delta, sums[g] + delta), a, b, g, delta)
                    if best is None or candidate < best:
                        best = candidate
        if best is None:
            break
        _, a, b, g, delta = best
        groups[heavy][groups[heavy].index(a)] = b
        groups[g][groups[g].index(b)] = a
        sums[heavy] -= delta
        sums[g] += delta
    if _max_group(loads, contiguous) <= max(sums):
        groups = contiguous
    # Groups in the order of their lowest expert id, ids ascending inside each: one canonical form.
    groups = sorted((sorted(g) for g in groups), key=lambda g: g[0])
    return tuple(e for g in groups for e in g)


def balanced_placement(loads: Sequence[Sequence[int]] | torch.Tensor, ep_size: int) -> ExpertPlacement:
    """Per MoE layer, split the experts into ep_size groups of exactly E/ep so that the largest group's load
    (routed (token, expert) rows) is as small as possible (greedy by descending load, then improving swaps;
    deterministic; never worse than the contiguous split, which is kept when it is as good).

    loads: [num MoE layers][num_experts] non-negative row counts (a list of lists or an integer tensor)."""
    rows = loads.tolist() if isinstance(loads, torch.Tensor) else [list(r) for r in loads]
    if not rows or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("loads must be a non-empty [layers][experts] table")
    if len(rows[0]) % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide {len(rows[0])} experts")
    if any(int(x) != x or x < 0 for r in rows for x in r):
        raise ValueError("loads must be non-negative integers")
    return ExpertPlacement(tuple(_balance_layer([int(x) for x in r], ep_size) for r in rows), ep_size)


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


class AllToAllDispatch:
    """Expert parallelism over all_to_all_single (gloo or NCCL), with the exchanges overlapped with expert
    work.

    Per MoE layer and call: the T*k (token, expert) rows are grouped by slot id (the block mapped its expert
    ids through the layer's placement), which also groups them by owner rank (SlotOrder), and one small
    exchange of per-slot counts tells every owner how many rows to expect from each rank for each of its
    experts (it travels while the slots' rows are gathered).
    Then, in one autograd Function with a hand-written backward (_AllToAllMoe), so that the order of work is
    ours and not the autograd engine's:

      forward   send the slots' rows to their owners (asynchronous); meanwhile run the own experts on half
                of the slots this rank owns itself (about 1/ep of all slots: they never travel); then the
                experts on the rows that arrived; send those outputs back (asynchronous) while the own
                experts run on the other half; combine: gather the outputs per choice and add them with the
                router weights (deterministic: gathers and adds only).
      backward  the combine's gradient goes to the owners (asynchronous) while the own experts run their
                backward; then the arrived rows' input gradients, which go back (asynchronous) while the
                owner computes those rows' weight gradients; finally each token sums its k slot gradients.

    Four row exchanges and one counts exchange per layer and micro-batch, each overlapped with expert work;
    the own block is never sent to itself. The number of exchanges does not depend on the number of experts:
    few, large messages, which is what a latency-bound transport (gloo on loopback) needs. The experts are
    the model's SwiGLU `Expert`s; the Function computes their forward and backward from their weights with
    steps.moe's swiglu_forward / swiglu_backward_input / swiglu_backward_weights (the one implementation).
    `expert_rows` counts the (token, expert) rows this rank's experts ran (the bench reports the balance).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        ep_size: int,
        num_experts: int,
        ep_rank: int,
        device: torch.device,
        timer: CommTimer | None = None,
    ) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts {num_experts} is not a multiple of the EP size {ep_size}")
        self.group = group
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.ep_rank = ep_rank
        self.device = device
        self.timer = timer or CommTimer()
        self.expert_rows = 0

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        experts: Sequence[nn.Module],
    ) -> torch.Tensor:
        slots = SlotOrder.of(topk_idx, self.num_experts)
        recv_counts = torch.empty_like(slots.counts)
        with self.timer.measure(hidden.device):
            counts_sent = dist.all_to_all_single(recv_counts, slots.counts, group=self.group, async_op=True)
        if len(experts) != self.num_local_experts:
            raise ValueError(f"AllToAllDispatch: {len(experts)} local experts, expected {self.num_local_experts}")
        weights = []
        for expert in experts:  # local slot order
            weights += [expert.gate_proj.weight, expert.up_proj.weight, expert.down_proj.weight]
        return _AllToAllMoe.apply(hidden, topk_weight, self, slots, counts_sent, recv_counts, *weights)


def _exchange_others(
    out: torch.Tensor,
    out_own: slice,
    x: torch.Tensor,
    x_own: slice,
    out_splits: list[int],
    in_splits: list[int],
    d: AllToAllDispatch,
) -> Callable[[], None]:
    """Start the all-to-all of x's rows to out's rows (out_splits[i] rows from rank i, in_splits[i] to it),
    except this rank's own block (x_own -> out_own), which the caller fills itself; returns the wait.
    With ep = 2 the own block is at one end of both buffers, and the exchange reads and writes views."""
    out_splits, in_splits = list(out_splits), list(in_splits)
    out_splits[d.ep_rank] = in_splits[d.ep_rank] = 0
    x_others = _without_block(x, x_own)
    out_others = _without_block(out, out_own) if out_own.start == 0 or out_own.stop == out.shape[0] else None
    target = out_others if out_others is not None else out.new_empty((sum(out_splits), *out.shape[1:]))
    work = dist.all_to_all_single(target, x_others, out_splits, in_splits, group=d.group, async_op=True)

    def wait() -> None:
        work.wait()
        if out_others is None:  # the own block sits in the middle: copy the others around it
            out[: out_own.start] = target[: out_own.start]
            out[out_own.stop :] = target[out_own.start :]

    return wait


def _without_block(x: torch.Tensor, block: slice) -> torch.Tensor:
    """x without the rows of `block`: a view when the block is at either end (always, with ep = 2)."""
    if block.start == 0:
        return x[block.stop :]
    if block.stop == x.shape[0]:
        return x[: block.start]
    return torch.cat([x[: block.start], x[block.stop :]])


@dataclass
class _Run:
    """The experts run on rows [start, end) of a buffer (SwiGLU arithmetic in steps.moe), and what their
    backward needs (`rows`, spans relative to `start`)."""

    start: int
    end: int
    rows: SwiGLURows


def _run_experts(x: torch.Tensor, out: torch.Tensor, counts: list[int], start: int, fused: tuple) -> list[_Run]:
    """out[rows] = the experts on x's rows [start, start + sum(counts)), grouped by expert: counts[j] rows
    for local expert j (the counts of all local experts); one run, or none without rows."""
    end = start + sum(counts)
    if end == start:
        return []
    rows = swiglu_forward(x[start:end], expert_spans(counts), *fused, out[start:end])
    return [_Run(start, end, rows)]


def _backward_input(runs: list[_Run], grad_out: torch.Tensor, grad_x: torch.Tensor, fused: tuple) -> list:
    """grad_x's rows of each run; returns what the weight gradients need: (run, d_gate_up) per run."""
    return [
        (r, swiglu_backward_input(r.rows, grad_out[r.start : r.end], *fused, grad_x[r.start : r.end])) for r in runs
    ]


def _backward_weights(pending: list, grad_out: torch.Tensor, x: torch.Tensor, grads: list) -> None:
    for r, d_gate_up in pending:
        swiglu_backward_weights(r.rows, d_gate_up, grad_out[r.start : r.end], x[r.start : r.end], grads)


class _AllToAllMoe(torch.autograd.Function):
    """The routed experts of one MoE layer over the EP group (AllToAllDispatch): forward and backward each
    overlap their exchanges with the experts' work on the rows that stay on this rank."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        topk_weight: torch.Tensor,
        d: AllToAllDispatch,
        slots: SlotOrder,
        counts_sent: dist.Work,
        recv_counts: torch.Tensor,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        routed = slots.gather_rows(hidden)  # [T*k, H], grouped by expert, hence by owner
        with d.timer.measure(hidden.device):
            counts_sent.wait()
        counts = torch.stack([slots.counts, recv_counts]).cpu()  # one device->host copy for all the sizes
        send_matrix = counts[0].view(d.ep_size, d.num_local_experts)
        recv_matrix = counts[1].view(d.ep_size, d.num_local_experts)
        send_splits, recv_splits = send_matrix.sum(1).tolist(), recv_matrix.sum(1).tolist()

        # The slots go to their owners while the own experts run on the slots this rank owns itself (those
        # never travel: the own block of `received` and of `expert_out` stays unused).
        me = d.ep_rank
        own_rows = slice(sum(send_splits[:me]), sum(send_splits[: me + 1]))  # in routed and returned
        own_received = slice(sum(recv_splits[:me]), sum(recv_splits[: me + 1]))  # in received and expert_out
        received = routed.new_empty((sum(recv_splits), routed.shape[1]))
        with d.timer.measure(hidden.device):
            sent = _exchange_others(received, own_received, routed, own_rows, recv_splits, send_splits, d)
        fused = fuse_expert_weights(weights)  # [gate; up] per expert, for this call (weights change per step)
        returned = routed.new_empty(routed.shape)  # expert outputs of this rank's slots, grouped by expert
        own_routed, own_returned = routed[own_rows], returned[own_rows]
        # the own experts are split between the two exchanges' waits: experts [0, first) and [first, E/ep),
        # about half of the own rows each
        own_counts = send_matrix[me].tolist()
        half = (own_rows.stop - own_rows.start) // 2
        first = sum(1 for rows_so_far in itertools.accumulate(own_counts) if rows_so_far <= half)
        first_counts = own_counts[:first] + [0] * (len(own_counts) - first)
        last_counts = [0] * first + own_counts[first:]
        own = _run_experts(own_routed, own_returned, first_counts, 0, fused)
        expert_out = torch.empty_like(received)  # outputs of the rows that arrived (own block unused)
        with d.timer.measure(hidden.device):
            sent()
        remote = [
            run for s in range(d.ep_size) if s != me
            for run in _run_experts(received, expert_out, recv_matrix[s].tolist(), sum(recv_splits[:s]), fused)
        ]  # fmt: skip

        # the outputs go back (all but the own block) while the rest of the own experts run
        with d.timer.measure(hidden.device):
            back = _exchange_others(returned, own_rows, expert_out, own_received, send_splits, recv_splits, d)
        own += _run_experts(own_routed, own_returned, last_counts, sum(first_counts), fused)
        d.expert_rows += sum(r.end - r.start for r in own + remote)
        with d.timer.measure(hidden.device):
            back()
        out, per_choice, choice_weights = slots.combine_rows(returned, topk_weight)

        ctx.save_for_backward(routed, received, per_choice, choice_weights)
        ctx.d, ctx.slots, ctx.own, ctx.remote, ctx.fused = d, slots, own, remote, fused  # type: ignore[attr-defined]
        ctx.splits, ctx.own_slices = (send_splits, recv_splits), (own_rows, own_received)  # type: ignore[attr-defined]
        ctx.weight_dtype = topk_weight.dtype  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        routed, received, per_choice, choice_weights = ctx.saved_tensors  # type: ignore[attr-defined]
        d: AllToAllDispatch = ctx.d  # type: ignore[attr-defined]
        slots: SlotOrder = ctx.slots  # type: ignore[attr-defined]
        send_splits, recv_splits = ctx.splits  # type: ignore[attr-defined]
        own_rows, own_received = ctx.own_slices  # type: ignore[attr-defined]
        own_runs, remote_runs, fused = ctx.own, ctx.remote, ctx.fused  # type: ignore[attr-defined]
        weight_dtype = ctx.weight_dtype  # type: ignore[attr-defined]
        grads: list[torch.Tensor | None] = [None] * (2 * len(fused[1]))  # ([gate; up], down) per expert

        # The combine's gradient goes to the owners while the own experts run backward on their own slots.
        grad_returned, grad_topk_weight = slots.combine_rows_backward(grad, per_choice, choice_weights)
        grad_expert_out = torch.empty_like(received)  # own block unused
        with d.timer.measure(grad.device):
            sent = _exchange_others(
                grad_expert_out, own_received, grad_returned, own_rows, recv_splits, send_splits, d
            )
        grad_routed = torch.empty_like(routed)
        own_grad_returned = grad_returned[own_rows]
        own = _backward_input(own_runs, own_grad_returned, grad_routed[own_rows], fused)
        _backward_weights(own, own_grad_returned, routed[own_rows], grads)
        with d.timer.measure(grad.device):
            sent()

        # The arrived rows' input gradients go back while their weight gradients are computed.
        grad_received = torch.empty_like(received)  # own block unused
        remote = _backward_input(remote_runs, grad_expert_out, grad_received, fused)
        with d.timer.measure(grad.device):
            back = _exchange_others(grad_routed, own_rows, grad_received, own_received, send_splits, recv_splits, d)
        _backward_weights(remote, grad_expert_out, received, grads)
        with d.timer.measure(grad.device):
            back()
        grad_hidden = slots.gather_rows_backward(grad_routed)
        return grad_hidden, grad_topk_weight.to(weight_dtype), None, None, None, None, *split_expert_grads(grads)


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


# What DeepEP would otherwise detect for its SM model, on p5en (H200 + EFA): get_rdma_gbs() parses `ibstat`
# for an mlx5_0 NIC, finds none on EFA, returns 0 and DeepEP divides by it as soon as the group spans two
# nodes (ZeroDivisionError; upstream fix only in the open PR deepseek-ai/DeepEP#612); get_nvlink_gbs() runs
# nvidia-smi, which a container may lack. p5en: 16 x 200 Gb/s EFA for 8 GPUs = 50 GB/s a GPU; H200: 18
# NVLink 4 links of 26.6 GB/s, times DeepEP's own 0.9 efficiency. Other hardware: set the variables.
RDMA_GBS_ENV, NVLINK_GBS_ENV = "MOERL_DEEPEP_RDMA_GBS", "MOERL_DEEPEP_NVLINK_GBS"
P5EN_RDMA_GBS, H200_NVLINK_GBS = 50.0, 430.0


def deepep_bandwidths() -> tuple[float, float]:
    """(RDMA GB/s a GPU, NVLink GB/s a GPU) for DeepEP's SM model: the environment's, else p5en's."""
    values = []
    for name, default in ((RDMA_GBS_ENV, P5EN_RDMA_GBS), (NVLINK_GBS_ENV, H200_NVLINK_GBS)):
        text = os.environ.get(name, "")
        try:
            value = float(text) if text else default
        except ValueError:
            value = -1.0
        if not value > 0:
            raise MoerlError(f"{name}={text!r}: not a positive bandwidth in GB/s; set e.g. {name}={default:g}")
        values.append(value)
    return values[0], values[1]


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
                num_sms=owner.num_sms,
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
            # num_sms explicitly: with 0, DeepEP sizes the SMs from num_experts before it reads the handle,
            # and a cached dispatch passes no num_experts (TypeError on None % int).
            grad_y, _, _, _, _ = owner.buffer.dispatch(grad.contiguous(), handle=handle, num_sms=handle.num_sms)
        return grad_y, None, None


class DeepEPDispatch:
    """Expert parallelism over DeepEP 2.x (`deep_ep.ElasticBuffer`), normal (high-throughput) mode.

    DeepEP sends each token once to every rank owning one of its experts, in bf16, with its top-k ids
    (local ids there, -1 for experts held elsewhere) and fp32 weights. The ids it gets are slot ids (the
    block mapped them through the layer's placement), so each rank owns a contiguous range, as DeepEP
    needs. The owner computes sum_j w_j * expert_j(x) over its own experts, and combine sums those partial
    outputs at the token's rank.
    The buffer is created on first use, sized for `max_tokens_per_rank` tokens (the same on every rank), with
    DeepEP's deterministic receive order.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
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
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.timer = timer or CommTimer()
        self.last_handle: object = None
        self.num_sms = 0  # set with the buffer: the SMs every dispatch and combine of this layer use
        self._buffer: object = None

    @property
    def buffer(self) -> object:
        if self._buffer is None:
            buffer = self.deep_ep.ElasticBuffer(  # type: ignore[attr-defined]
                self.group,
                num_max_tokens_per_rank=self.max_tokens_per_rank,
                hidden=self.hidden_size,
                num_topk=self.top_k,
                deterministic=True,
            )
            # DeepEP's own SM model, with the bandwidths given rather than detected (see deepep_bandwidths).
            rdma_gbs, nvlink_gbs = deepep_bandwidths()
            self.num_sms = int(
                buffer.get_theoretical_num_sms(  # type: ignore[attr-defined]
                    self.num_experts, self.top_k, rdma_gbs=rdma_gbs, nvlink_gbs=nvlink_gbs
                )
            )
            self._buffer = buffer
        return self._buffer

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weight: torch.Tensor,
        experts: Sequence[nn.Module],
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
        out = run_experts(experts, x[rows], counts.tolist())
        weighted = out * recv_weights[:num_recv][rows, slots].unsqueeze(-1).to(out.dtype)
        # each (row, expert) pair occurs once; index_add is deterministic in torch's deterministic mode
        partial = x.new_zeros(recv_x.shape[0], x.shape[1]).index_add(0, rows, weighted)
        combined = _DeepEPCombineFn.apply(partial.to(torch.bfloat16).contiguous(), self, handle)
        return combined.to(hidden.dtype)


# ----------------------------------------------------------------------------------------------------
# Choosing a backend
# ----------------------------------------------------------------------------------------------------


def ep_group_within_node(mesh: Mesh, local_world_size: int | None = None) -> bool:
    """Whether this rank's EP group lies inside one node: its ranks dp*ep .. dp*ep+ep-1 are consecutive, so
    they share a node when the node's rank count (torchrun's LOCAL_WORLD_SIZE) is a multiple of ep."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(mesh.world_size)))
    return local_world_size % mesh.ep_size == 0


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
    if backend == "alltoall":
        return AllToAllDispatch(mesh.ep_group, mesh.ep_size, num_experts, mesh.ep_rank, mesh.device, timer)
    if mesh.device.type != "cuda":
        raise MoerlError(
            "trainer.ep_backend 'deepep' needs CUDA GPUs (DeepEP is GPU-only); run the trainer on GPU nodes "
            "or set trainer.ep_backend: alltoall"
        )
    if ep_group_within_node(mesh):
        # NVLink only: DeepEP's non-Gin path, so that an EP group inside a node needs neither the OFI
        # plugin's GIN nor GDRCopy's /dev/gdrdrv (DeepEP asserts GIN for any group of 2+ ranks otherwise).
        os.environ.setdefault("EP_DISABLE_GIN", "1")
    return DeepEPDispatch(
        mesh.ep_group, num_experts, num_experts // mesh.ep_size, hidden_size, top_k, max_tokens_per_rank, timer,
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


def gather_ranks(values: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Every rank's copy of a small 1-D tensor, stacked in rank order [R, n] (one collective; reduce it
    locally, in rank order, with sums and maxima alike)."""
    if mesh.world_group is None:
        return values.unsqueeze(0).clone()
    parts = [torch.empty_like(values) for _ in range(mesh.world_size)]
    dist.all_gather(parts, values.contiguous(), group=mesh.world_group)
    return torch.stack(parts)


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))
