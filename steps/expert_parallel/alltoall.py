"""The alltoall dispatch backend: expert parallelism over torch.distributed.all_to_all_single, gloo on CPU
or NCCL on GPU.

Every (token, expert) slot is sent to the expert's owner, run there, and sent back; one autograd Function per
MoE layer with a hand-written backward, which overlaps every exchange with the experts' work on the slots that
stay on this rank (AllToAllDispatch). It implements steps.models.moe's `ExpertDispatch` contract;
steps/expert_parallel/dispatch.py chooses it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from steps.expert_parallel.timing import CommTimer
from steps.models.experts import ExpertArithmetic, expert_arithmetic, expert_spans
from steps.models.moe import SlotOrder


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
    the model's `RoutedExpert`s; the Function computes their forward and backward from their weights with their
    kind's arithmetic (steps.models.moe ExpertArithmetic: SwiGLU's swiglu_forward / swiglu_backward_input /
    swiglu_backward_weights, or another kind's; the one implementation of each).
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
        arithmetic = expert_arithmetic(experts)
        weights = [w for expert in experts for w in expert.expert_weights()]  # type: ignore[operator]  # slot order
        return _AllToAllMoe.apply(hidden, topk_weight, self, slots, counts_sent, recv_counts, arithmetic, *weights)


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
    """The experts run on rows [start, end) of a buffer (their kind's arithmetic, steps.models.moe
    ExpertArithmetic), and what their backward needs (`rows`, spans relative to `start`)."""

    start: int
    end: int
    rows: Any


def _run_experts(
    x: torch.Tensor, out: torch.Tensor, counts: list[int], start: int, fused: Any, arithmetic: ExpertArithmetic
) -> list[_Run]:
    """out[rows] = the experts on x's rows [start, start + sum(counts)), grouped by expert: counts[j] rows
    for local expert j (the counts of all local experts); one run, or none without rows."""
    end = start + sum(counts)
    if end == start:
        return []
    rows = arithmetic.forward(x[start:end], expert_spans(counts), fused, out[start:end])
    return [_Run(start, end, rows)]


def _backward_input(
    runs: list[_Run], grad_out: torch.Tensor, grad_x: torch.Tensor, fused: Any, arithmetic: ExpertArithmetic
) -> list:
    """grad_x's rows of each run; returns what the weight gradients need: (run, saved) per run."""
    return [
        (r, arithmetic.backward_input(r.rows, grad_out[r.start : r.end], fused, grad_x[r.start : r.end]))
        for r in runs
    ]


def _backward_weights(
    pending: list, grad_out: torch.Tensor, x: torch.Tensor, grads: list, arithmetic: ExpertArithmetic
) -> None:
    for r, saved in pending:
        arithmetic.backward_weights(r.rows, saved, grad_out[r.start : r.end], x[r.start : r.end], grads)


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
        arithmetic: ExpertArithmetic,
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
        fused = arithmetic.fuse(weights)  # e.g. SwiGLU's [gate; up] per expert, for this call (weights change)
        returned = routed.new_empty(routed.shape)  # expert outputs of this rank's slots, grouped by expert
        own_routed, own_returned = routed[own_rows], returned[own_rows]
        # the own experts are split between the two exchanges' waits: experts [0, first) and [first, E/ep),
        # about half of the own rows each
        own_counts = send_matrix[me].tolist()
        half = (own_rows.stop - own_rows.start) // 2
        first = sum(1 for rows_so_far in itertools.accumulate(own_counts) if rows_so_far <= half)
        first_counts = own_counts[:first] + [0] * (len(own_counts) - first)
        last_counts = [0] * first + own_counts[first:]
        own = _run_experts(own_routed, own_returned, first_counts, 0, fused, arithmetic)
        expert_out = torch.empty_like(received)  # outputs of the rows that arrived (own block unused)
        with d.timer.measure(hidden.device):
            sent()
        remote = [
            run for s in range(d.ep_size) if s != me
            for run in _run_experts(
                received, expert_out, recv_matrix[s].tolist(), sum(recv_splits[:s]), fused, arithmetic
            )
        ]  # fmt: skip

        # the outputs go back (all but the own block) while the rest of the own experts run
        with d.timer.measure(hidden.device):
            back = _exchange_others(returned, own_rows, expert_out, own_received, send_splits, recv_splits, d)
        own += _run_experts(own_routed, own_returned, last_counts, sum(first_counts), fused, arithmetic)
        d.expert_rows += sum(r.end - r.start for r in own + remote)
        with d.timer.measure(hidden.device):
            back()
        out, per_choice, choice_weights = slots.combine_rows(returned, topk_weight)

        ctx.save_for_backward(routed, received, per_choice, choice_weights)
        ctx.d, ctx.slots, ctx.own, ctx.remote, ctx.fused = d, slots, own, remote, fused  # type: ignore[attr-defined]
        ctx.arithmetic = arithmetic  # type: ignore[attr-defined]
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
        arithmetic: ExpertArithmetic = ctx.arithmetic  # type: ignore[attr-defined]
        grads: list[torch.Tensor | None] = [None] * arithmetic.grad_slots(d.num_local_experts)

        # The combine's gradient goes to the owners while the own experts run backward on their own slots.
        grad_returned, grad_topk_weight = slots.combine_rows_backward(grad, per_choice, choice_weights)
        grad_expert_out = torch.empty_like(received)  # own block unused
        with d.timer.measure(grad.device):
            sent = _exchange_others(
                grad_expert_out, own_received, grad_returned, own_rows, recv_splits, send_splits, d
            )
        grad_routed = torch.empty_like(routed)
        own_grad_returned = grad_returned[own_rows]
        own = _backward_input(own_runs, own_grad_returned, grad_routed[own_rows], fused, arithmetic)
        _backward_weights(own, own_grad_returned, routed[own_rows], grads, arithmetic)
        with d.timer.measure(grad.device):
            sent()

        # The arrived rows' input gradients go back while their weight gradients are computed.
        grad_received = torch.empty_like(received)  # own block unused
        remote = _backward_input(remote_runs, grad_expert_out, grad_received, fused, arithmetic)
        with d.timer.measure(grad.device):
            back = _exchange_others(grad_routed, own_rows, grad_received, own_received, send_splits, recv_splits, d)
        _backward_weights(remote, grad_expert_out, received, grads, arithmetic)
        with d.timer.measure(grad.device):
            back()
        grad_hidden = slots.gather_rows_backward(grad_routed)
        grad_weights = arithmetic.split_grads(grads)
        return grad_hidden, grad_topk_weight.to(weight_dtype), None, None, None, None, None, *grad_weights
