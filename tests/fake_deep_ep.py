"""A stand-in for `deep_ep` (DeepEP 2.1.0 at images/versions.env's DEEPEP_COMMIT) that runs on CPU over gloo.

It holds what our wrapper (steps/expert_parallel/deepep.py DeepEPDispatch) must get right, as read in DeepEP's
deep_ep/buffers/elastic.py and deep_ep/utils/envs.py at that commit:

  signatures   ElasticBuffer(group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0,
               num_topk=0, use_fp8_dispatch=False, deterministic=False, ...), dispatch(x, topk_idx=None,
               topk_weights=None, cumulative_local_expert_recv_stats=None, num_experts=None,
               num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0, ..., handle=None,
               do_handle_copy=True, do_cpu_sync=None, do_expand=False, ...) -> (recv_x, recv_topk_idx,
               recv_topk_weights, handle, event), combine(x, handle, topk_weights=None, bias=None, num_sms=0,
               num_qps=0, ...) -> (combined_x, combined_topk_weights, event); keyword-only use is not
               enforced upstream, so neither is it here, but every name is upstream's.
  SM count     dispatch with num_sms=0 asks get_theoretical_num_sms(num_experts, num_topk) BEFORE it reads a
               cached handle, so a cached dispatch (handle=..., num_experts=None) fails there with a
               TypeError on `None % int`. get_theoretical_num_sms asks get_rdma_gbs() when rdma_gbs is 0 and
               the group spans more than one RDMA rank (node); get_rdma_gbs parses `ibstat` for mlx5_0 and
               returns 0 on EFA, and the model divides by it whenever there is more than one scale-out rank:
               ZeroDivisionError. It asks get_nvlink_gbs() (nvidia-smi) when nvlink_gbs is 0, and divides
               by that too across nodes. combine with num_sms=0 reuses handle.num_sms.
  dtypes       x bf16 [num_tokens, hidden], topk_idx deep_ep.topk_idx_t (int64), topk_weights float32;
               num_tokens <= num_max_tokens_per_rank; a cached dispatch takes topk_idx=None and no CPU sync.
  determinism  every call asserts that torch's deterministic mode and fill_uninitialized_memory are not
               both on (check_torch_deterministic).

  memory      the buffer is not torch's: ElasticBuffer's C++ runtime allocates it from the driver
               (csrc/kernels/backend/symmetric.hpp: ncclMemAlloc, or cuMemCreate) and registers it as an NCCL
               window (csrc/kernels/backend/nccl.cu), and with explicitly_destroy=False frees it when the
               Python object goes ("released by the destructor", ElasticBuffer.__init__'s docstring). Blocks
               that torch's caching allocator holds are free to torch only: the driver can give them to a new
               buffer once torch.cuda.empty_cache() returned them. `DEVICE` models that memory; a buffer that
               does not fit what the driver has free fails as the runtime's CUDA check does. Its synchronize
               and empty_cache stand in for torch.cuda's where a test puts them in place.

The exchange itself: rank r owns experts [r*E/R, (r+1)*E/R). Dispatch sends each token once to every rank
owning one of its experts; there its top-k ids are local ids, -1 for experts held elsewhere, and its weights
are all k of them; rows arrive ordered by (source rank, token), as DeepEP's deterministic mode sorts them,
followed by padding rows that only `handle.num_recv_tokens` tells apart. Combine sums the rows back at their
source token. The bandwidth model is not DeepEP's: any even SM count in [4, device SMs] satisfies our side.
"""

from __future__ import annotations

import sys
import types
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__version__ = "2.1.0"
topk_idx_t = torch.int64
DEVICE_SMS = 132  # an H200
PADDING_ROWS = 2  # DeepEP's receive buffers are larger than what arrived

# The node topology the fake pretends: ranks per node (NVLink domain); more ranks than that span nodes (RDMA).
RANKS_PER_NODE = 8
# What deep_ep.utils.envs would detect: ibstat finds no mlx5_0 on EFA (0), nvidia-smi's NVLink total.
DETECTED_RDMA_GBS = 0.0
DETECTED_NVLINK_GBS = 430.0


@dataclass
class DeviceMemory:
    """One GPU's memory as the driver sees it: torch's cached blocks, DeepEP's buffers, and what is free."""

    total: int = 141 << 30  # an H200
    torch_cached: int = 0  # held by torch's caching allocator (in use or not): not the driver's to give
    buffers: int = 0  # ElasticBuffers alive
    calls: list[str] = field(default_factory=list)  # synchronize / empty_cache, in order

    def driver_free(self) -> int:
        return self.total - self.torch_cached - self.buffers

    def synchronize(self, device: object = None) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.torch_cached = 0  # what training freed into the cache (nothing is in use between two updates)

    def release(self, num_bytes: int) -> None:
        self.buffers -= num_bytes


DEVICE = DeviceMemory()


def buffer_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int) -> int:
    """The fake's buffer size (not DeepEP's formula): a bf16 row per token from every rank, 2 MB aligned."""
    raw = num_ranks * num_max_tokens_per_rank * hidden * 2
    return -(-raw // (2 << 20)) * (2 << 20)


def get_rdma_gbs() -> float:
    return DETECTED_RDMA_GBS


def get_nvlink_gbs() -> float:
    return DETECTED_NVLINK_GBS


def check_torch_deterministic() -> None:
    assert not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory)


class EventOverlap:
    def current_stream_wait(self) -> None:
        pass


@dataclass
class EPHandle:
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    num_sms: int
    topk_idx: torch.Tensor
    num_recv_tokens: int
    recv_src: list[tuple[int, int]]  # per received row: (source rank, token index there)


class ElasticBuffer:
    calls: list[tuple[str, dict]] = []  # every dispatch/combine with its arguments, for the tests to read

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        self.group = group
        self.rank_idx, self.num_ranks = group.rank(), group.size()
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden, self.num_topk, self.deterministic = hidden, num_topk, deterministic
        self.num_scaleup_ranks = min(RANKS_PER_NODE, self.num_ranks)
        self.num_scaleout_ranks = self.num_ranks // self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.num_scaleout_ranks, self.num_scaleup_ranks
        self.num_bytes = num_bytes or buffer_bytes(self.num_ranks, num_max_tokens_per_rank, hidden)
        device = DEVICE
        if self.num_bytes > device.driver_free():
            raise RuntimeError(
                f"Failed: CUDA error 2 'out of memory' (fake deep_ep: {self.num_bytes} bytes from the driver, "
                f"{device.driver_free()} free; torch's cache holds {device.torch_cached})"
            )
        device.buffers += self.num_bytes
        self.explicitly_destroy = explicitly_destroy
        self._free = weakref.finalize(self, device.release, self.num_bytes)  # the destructor's release

    def destroy(self) -> None:
        assert self.explicitly_destroy
        self._free()

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        assert num_scaleout_topk == 0
        if rdma_gbs == 0 and self.num_rdma_ranks > 1:
            rdma_gbs = get_rdma_gbs()
        if nvlink_gbs == 0:
            nvlink_gbs = get_nvlink_gbs()
        ranks_hit = num_experts % self.num_ranks  # upstream's first use of num_experts (TypeError on None)
        del ranks_hit
        if self.num_scaleout_ranks > 1:
            rdma_per_gbs = 1.0 / rdma_gbs  # upstream divides by both bandwidths across nodes
            nvlink_per_gbs = 1.0 / nvlink_gbs
            del rdma_per_gbs, nvlink_per_gbs
        return min(DEVICE_SMS, 24)

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: object = None,
        previous_event_before_epilogue: object = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, EPHandle, EventOverlap]:
        check_torch_deterministic()
        self.calls.append(("dispatch", {"cached": handle is not None, "num_sms": num_sms, "num_experts": num_experts}))
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        assert not isinstance(x, tuple) and not do_expand, "the fake covers the bf16, non-expanding layout"
        if handle is not None:
            assert topk_idx is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            topk_idx = handle.topk_idx
            num_experts = handle.num_experts if num_experts is None else num_experts
            num_max_tokens_per_rank = (
                handle.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
            )
            expert_alignment = handle.expert_alignment if expert_alignment is None else expert_alignment
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == (
                handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank,
            )  # fmt: skip
        num_max_tokens_per_rank = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        expert_alignment = expert_alignment or 1
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), (x.dtype, x.shape)
        assert topk_idx.dtype == topk_idx_t and topk_idx.shape[0] == x.shape[0], topk_idx.dtype
        assert topk_weights is None or (topk_weights.dtype == torch.float32 and topk_weights.shape == topk_idx.shape)
        assert x.shape[0] <= num_max_tokens_per_rank, (x.shape[0], num_max_tokens_per_rank)
        assert num_experts is not None and num_experts % self.num_ranks == 0

        gathered: list = [None] * self.num_ranks
        dist.all_gather_object(gathered, (x, topk_idx, topk_weights), group=self.group)
        per_rank = num_experts // self.num_ranks
        first = self.rank_idx * per_rank
        rows, ids, weights, src = [], [], [], []
        for s, (xs, idx, w) in enumerate(gathered):
            mine = (idx >= first) & (idx < first + per_rank)
            for t in mine.any(dim=1).nonzero().flatten().tolist():
                rows.append(xs[t])
                ids.append(torch.where(mine[t], idx[t] - first, torch.full_like(idx[t], -1)))
                weights.append(None if w is None else w[t])
                src.append((s, t))
        hidden = x.shape[1]
        num_recv = len(rows)
        recv_x = torch.full((num_recv + PADDING_ROWS, hidden), 7.0, dtype=torch.bfloat16)
        recv_idx = torch.full((num_recv + PADDING_ROWS, num_topk), -1, dtype=topk_idx_t)
        if num_recv:
            recv_x[:num_recv] = torch.stack(rows)
            recv_idx[:num_recv] = torch.stack(ids)
        recv_weights = None
        if topk_weights is not None:
            recv_weights = torch.full((num_recv + PADDING_ROWS, num_topk), 5.0, dtype=torch.float32)
            if num_recv:
                recv_weights[:num_recv] = torch.stack(weights)
        if handle is None:
            topk = topk_idx.clone() if do_handle_copy else topk_idx
            handle = EPHandle(num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk, num_recv, src)
        return recv_x, recv_idx, recv_weights, handle, EventOverlap()

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias: object = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: object = None,
        previous_event_before_epilogue: object = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        check_torch_deterministic()
        self.calls.append(("combine", {"num_sms": num_sms, "weights": topk_weights is not None}))
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        assert num_sms > 0
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] >= handle.num_recv_tokens, (x.dtype, x.shape)
        assert topk_weights is None or topk_weights.dtype == torch.float32
        n = handle.num_recv_tokens
        gathered: list = [None] * self.num_ranks
        payload = (x[:n], None if topk_weights is None else topk_weights[:n], handle.recv_src)
        dist.all_gather_object(gathered, payload, group=self.group)
        num_tokens, num_topk = handle.topk_idx.shape
        combined = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)
        combined_weights = None if topk_weights is None else torch.zeros(num_tokens, num_topk, dtype=torch.float32)
        for xs, ws, src in gathered:  # in rank order: the sum is deterministic
            for row, (s, t) in enumerate(src):
                if s == self.rank_idx:
                    combined[t] += xs[row].float()
                    if combined_weights is not None:
                        combined_weights[t] += ws[row]
        return combined.to(torch.bfloat16), combined_weights, EventOverlap()


def install() -> types.ModuleType:
    """Put this module in sys.modules as `deep_ep` (what `import deep_ep` then finds)."""
    module = sys.modules[__name__]
    sys.modules["deep_ep"] = module
    return module
