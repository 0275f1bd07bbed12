"""Choosing the expert dispatch backend a run names (trainer.ep_backend): one `ExpertDispatch` (steps/models/moe.py)
whichever it is, so the model and the trainer never see which.

  local     one rank, all experts (steps.models.moe.LocalDispatch);
  alltoall  steps/expert_parallel/alltoall.py;
  deepep    steps/expert_parallel/deepep.py (CUDA only).
"""

from __future__ import annotations

import os

from steps.errors import MoerlError
from steps.expert_parallel.alltoall import AllToAllDispatch
from steps.expert_parallel.deepep import DeepEPDispatch, check_deepep_shape
from steps.expert_parallel.mesh import Mesh
from steps.expert_parallel.timing import CommTimer
from steps.models.moe import ExpertDispatch, LocalDispatch

BACKENDS = ("local", "alltoall", "deepep")


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
    check_deepep_shape(hidden_size, num_experts, top_k, mesh.ep_size)
    if ep_group_within_node(mesh):
        # NVLink only: DeepEP's non-Gin path, so that an EP group inside a node needs neither the OFI
        # plugin's GIN nor GDRCopy's /dev/gdrdrv (DeepEP asserts GIN for any group of 2+ ranks otherwise).
        os.environ.setdefault("EP_DISABLE_GIN", "1")
    return DeepEPDispatch(
        mesh.ep_group, num_experts, num_experts // mesh.ep_size, hidden_size, top_k, max_tokens_per_rank, timer,
    )  # fmt: skip


class HeldDispatch:
    """The dispatcher that a trainer that stays up keeps from one update to the next
    (steps/training/trainer_server.py).

    Made once: a DeepEP buffer registers its NCCL window and exchanges its handles across the EP group when
    it is made, and a process that made one per update would pay that each time and hold the old window
    until the collector freed it. Remade only when an update needs more tokens per rank than the buffer
    holds (then as many as the larger of the two) or names another backend or model shape; the backends
    without a buffer (alltoall, local) are the same object throughout. Its buffer's size changes no result.
    Before it is remade, the old dispatcher's `release` frees its buffer and empties torch's cache (DeepEP's
    buffer comes from the driver, not from that cache: deepep.DeepEPDispatch.release); every rank calls `get`
    with the same arguments at the same point of an update, so every rank does it."""

    def __init__(self) -> None:
        self._dispatch: ExpertDispatch | None = None
        self._key: tuple[str, int, int, int] | None = None
        self.made = 0

    def get(
        self,
        backend: str,
        mesh: Mesh,
        num_experts: int,
        hidden_size: int,
        top_k: int,
        max_tokens_per_rank: int,
        timer: CommTimer | None = None,
    ) -> ExpertDispatch:
        key = (backend, num_experts, hidden_size, top_k)
        held = self._dispatch
        capacity = getattr(held, "max_tokens_per_rank", None)  # DeepEP's buffer is the one with a size
        if held is not None and key == self._key and (capacity is None or capacity >= max_tokens_per_rank):
            if hasattr(held, "timer"):
                held.timer = timer or CommTimer()  # this update's own count
            return held
        size = max(max_tokens_per_rank, capacity or 0) if key == self._key else max_tokens_per_rank
        release = getattr(held, "release", None)
        self._dispatch = held = None  # the old buffer goes before the new one is registered
        if release is not None:
            release()
        held = make_dispatch(backend, mesh, num_experts, hidden_size, top_k, size, timer)
        self._dispatch, self._key = held, key
        self.made += 1
        return held
