"""The deepep dispatch backend: DeepEP 2.x ElasticBuffer dispatch/combine (NVLink in a node, RDMA/EFA across
nodes), GPU only, imported when first used.

DeepEP sends tokens (not slots) in bf16; the owner applies the router weights and combine sums the ranks'
partial outputs (DeepEPDispatch, steps.models.moe's `ExpertDispatch` contract). Every dispatch passes num_sms
(DeepEP's own SM model, run once with bandwidths given, `deepep_bandwidths`): left at 0, DeepEP detects the
RDMA bandwidth with ibstat, which finds nothing on EFA, and the backward's cached dispatch fails before it
reads the handle (tests/test_deepep_contract.py holds both rules).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from steps.errors import MoerlError
from steps.expert_parallel.timing import CommTimer
from steps.models.experts import run_experts
from steps.models.moe import group_by_expert


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


# The shapes DeepEP's normal (ElasticBuffer) kernels take, at the trainer image's pin (DeepEP dd758ca,
# images/versions.env DEEPEP_COMMIT). hidden, num_topk and num_experts are template arguments of the
# JIT-compiled kernels, so a shape outside these fails the static asserts when the first dispatch compiles
# (or a host/device assert), deep inside a run; check_deepep_shape says so before the buffer is made.
DEEPEP_HIDDEN_MULTIPLE = 256  # deep_ep/include/deep_ep/impls/combine.cuh:109 (hybrid_combine.cuh:219 across
# nodes): EP_STATIC_ASSERT(kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0, "Invalid hidden"), i.e.
# 32 lanes x 8 bf16; it implies the 32-byte TMA row of common/layout.cuh:198 (ptx.cuh:16 kNumTMAAlignBytes)
# and csrc/elastic/buffer.hpp:755's 16-byte rows.
DEEPEP_MAX_TOPK = 32  # impls/dispatch.cuh:93, dispatch_copy_epilogue.cuh:97, combine_reduce_epilogue.cuh:65:
# EP_STATIC_ASSERT(kNumTopk <= 32) (one lane per selection); combine_utils.cuh:71 kNumValidTopk > 0
DEEPEP_MAX_EXPERTS = 2048  # common/layout.cuh:20 kNumMaxExperts, asserted at :39
DEEPEP_MAX_EXPERTS_PER_RANK = 256  # common/layout.cuh:21 kNumMaxExpertsPerRank, asserted at :40
DEEPEP_MAX_RANKS = 1024  # common/layout.cuh:19 kNumMaxRanks, asserted at :38


def check_deepep_shape(hidden_size: int, num_experts: int, top_k: int, ep_size: int) -> None:
    """One MoerlError, naming DeepEP's limit, for a model shape (experts counted as the slots DeepEP sees) and
    EP group size that DeepEP's normal kernels cannot take; nothing otherwise (see DEEPEP_* above).
    num_experts % ep_size: csrc/elastic/buffer.hpp:805 EP_HOST_ASSERT(num_experts % num_ranks == 0)
    (also common/layout.cuh:37, impls/dispatch.cuh:47)."""
    fix = "set trainer.ep_backend: alltoall (no such limit)"
    problems = []
    if hidden_size <= 0 or hidden_size % DEEPEP_HIDDEN_MULTIPLE:
        problems.append(
            f"hidden_size {hidden_size} is not a multiple of {DEEPEP_HIDDEN_MULTIPLE} (DeepEP's combine moves a "
            "token's bf16 row 32 lanes x 8 values at a time: deep_ep/include/deep_ep/impls/combine.cuh:109)"
        )
    if not 1 <= top_k <= DEEPEP_MAX_TOPK:
        problems.append(f"top_k {top_k} is outside 1..{DEEPEP_MAX_TOPK} (one warp lane per selection: "
                        "deep_ep/include/deep_ep/impls/dispatch.cuh:93)")  # fmt: skip
    if not 1 <= ep_size <= DEEPEP_MAX_RANKS:
        problems.append(f"ep_size {ep_size} is outside 1..{DEEPEP_MAX_RANKS} (deep_ep/include/deep_ep/common/"
                        "layout.cuh:38)")  # fmt: skip
    elif num_experts % ep_size:
        problems.append(f"{num_experts} experts do not split evenly over ep_size {ep_size} "
                        "(csrc/elastic/buffer.hpp:805); choose an ep_size that divides them")  # fmt: skip
    elif num_experts // ep_size > DEEPEP_MAX_EXPERTS_PER_RANK:
        problems.append(f"{num_experts // ep_size} experts a rank exceed DeepEP's {DEEPEP_MAX_EXPERTS_PER_RANK} "
                        "(deep_ep/include/deep_ep/common/layout.cuh:40); use a larger ep_size")  # fmt: skip
    if num_experts > DEEPEP_MAX_EXPERTS:
        problems.append(f"{num_experts} experts exceed DeepEP's {DEEPEP_MAX_EXPERTS} "
                        "(deep_ep/include/deep_ep/common/layout.cuh:39)")  # fmt: skip
    if problems:
        raise MoerlError(
            f"trainer.ep_backend 'deepep' (DeepEP dd758ca): this model's MoE shape does not fit DeepEP's "
            f"kernels: {'; '.join(problems)}; {fix}"
        )


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


def free_cached_device_memory() -> None:
    """Synchronize this rank's device and give the blocks torch's caching allocator holds back to the driver
    (torch.cuda.empty_cache frees only unused cached blocks; the synchronize lets the kernels that still use
    freed tensors finish first). Nothing to do before CUDA starts or without it."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


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
    DeepEP's deterministic receive order. `release` gives its memory back before a bigger one is made.
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

    def release(self) -> None:
        """Free the buffer's device memory, on every rank of the group at the same point (a trainer that stays up
        remakes a bigger one: dispatch.HeldDispatch). DeepEP's buffer is not torch's: ElasticBuffer's runtime
        allocates it from the driver (DeepEP dd758ca csrc/kernels/backend/symmetric.hpp, ncclMemAlloc /
        cuMemCreate) and registers it as an NCCL window (csrc/kernels/backend/nccl.cu, collective), and frees it
        when the Python object goes (deep_ep/buffers/elastic.py ElasticBuffer.__init__, explicitly_destroy=False:
        "released by the destructor"). Memory that torch's caching allocator keeps from training is free to torch
        only, so the next buffer would fail for want of it: this drops the buffer, waits for the device and
        empties torch's cache, before the caller makes the next one."""
        self._buffer = None
        self.last_handle = None
        self.num_sms = 0
        gc.collect()  # the runtime's destructor runs when the last reference goes
        free_cached_device_memory()

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
