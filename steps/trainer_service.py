"""A trainer that stays up: the ranks of one torchrun keep the EP group and, between two updates, the state
of the version they trained (steps/trainer_state.py), and train iteration after iteration on request.

Rank 0 serves steps/serving.py's JsonServer, whose operations run on rank 0's main thread; its `update`
operation {run, iteration[, force, ep_size]} is broadcast from there to every rank as JSON (a gloo group of
its own, so that an idle wait is never an NCCL collective; a heartbeat every HEARTBEAT_S keeps that wait
under the group's timeout). Every rank then runs steps/policy_update.py's train_iteration, the update step's own code,
and rank 0 answers once the candidate is complete.

Which state an update starts from is decided by rank 0 and broadcast with the request, so every rank takes
the same path: the state held in memory when it is v(I-1) exactly as published (HeldState.matches), else
v(I-1) and optimizer/v(I-1) from the store, as a fresh update step would (a trainer just started,
restarted after a crash, or holding another version). A request whose candidate is already complete (a
retried client) is answered at once. A failed update drops the held state (the next one reloads). The expert
dispatcher (with DeepEP, its buffer) is made by the first update and kept (dispatch.HeldDispatch), and so is
the KL reference (trainer_state.HeldReference).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from steps import checkpoint
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import HeldDispatch
from steps.expert_parallel.mesh import Mesh
from steps.model import MoeConfig
from steps.policy_update import agreed, pending_iteration, train_iteration
from steps.serving import JsonServer, Unavailable
from steps.store import Store
from steps.trainer_state import HeldReference, HeldState

# Rank 0 broadcasts a no-op this often while idle: the other ranks wait in a broadcast, whose group timeout
# (policy_update.COLLECTIVE_TIMEOUT_SECONDS) must never run out between two updates.
HEARTBEAT_S = 60.0


class TrainerService:
    def __init__(
        self,
        run: Store,
        mesh: Mesh,
        local_rank: int,
        model_config: MoeConfig,
        command_group: dist.ProcessGroup | None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.run = run
        self.mesh = mesh
        self.local_rank = local_rank
        self.model_config = model_config
        self.command_group = command_group  # gloo, all ranks; None for one rank
        self.log = log
        self.held: HeldState | None = None
        self.dispatches = HeldDispatch()  # its DeepEP buffer made once, not per update
        self.reference = HeldReference()  # the KL reference read once, not per update
        self.instance = ""  # set by the step once registered
        self.stopping = threading.Event()
        self._done = 0
        self._last_request = time.monotonic()  # an idle exit counts from the start, then from each request

    # ------------------------------------------------------------------------------- rank 0: the face

    def health(self) -> dict[str, Any]:
        return {
            "run": self.run.uri,
            "instance": self.instance,
            "ready": bool(self.instance) and not self.stopping.is_set(),
            "held": None if self.held is None else self.held.version,
            "dispatches_made": self.dispatches.made,
            "reference_loads": self.reference.loads,
            "requests": self._done,
        }

    def update(self, body: dict[str, Any]) -> dict[str, Any]:
        """The `update` operation, on rank 0's main thread (a JsonServer(main_thread=True)): checked, then
        broadcast to every rank and run on each."""
        if body.get("run") != self.run.uri:
            raise MoerlError(f"this trainer trains run {self.run.uri}, not {body.get('run')!r}")
        iteration = body.get("iteration")
        if type(iteration) is not int or iteration < 1:
            raise MoerlError(f"update: iteration {iteration!r} is not an iteration (an integer >= 1)")
        ep_size = body.get("ep_size")
        if ep_size is not None and ep_size != self.mesh.ep_size:
            raise MoerlError(
                f"update: ep_size {ep_size} asked, this trainer's EP group has {self.mesh.ep_size} ranks; send the "
                "update without --ep-size (the trainer's is trainer.ep_size's) or run it as its own torchrun"
            )
        if self.stopping.is_set():
            raise Unavailable("the trainer is stopping")
        self._last_request = time.monotonic()
        command = {"op": "update", "iteration": iteration, "force": bool(body.get("force"))}
        command["from_memory"] = self._may_train_on(iteration)
        self._broadcast(command)
        try:
            return self.execute(command)
        finally:
            self._done += 1

    def serve(self, server: JsonServer, idle_exit_s: float = 0.0) -> None:
        """Rank 0's main thread: run the server's requests on every rank until stopping, with a no-op broadcast
        while idle (HEARTBEAT_S); then tell the other ranks to stop. With `idle_exit_s` > 0 it also stops
        once that long has passed without a request (checked at each heartbeat). (A SIGTERM ends rank 0 at
        once, in a request or not; the other ranks then end with their process group.)"""

        def idle() -> None:
            quiet_s = time.monotonic() - self._last_request
            if idle_exit_s > 0 and quiet_s >= idle_exit_s:
                self.log(f"trainer: no update request for {quiet_s:.0f} s (--idle-exit-s {idle_exit_s:g}); stopping")
                self.stopping.set()
                return
            self._broadcast({"op": "noop"})

        server.run_operations(self.stopping, idle=idle, idle_every_s=HEARTBEAT_S)
        self._broadcast({"op": "stop"})

    def _may_train_on(self, iteration: int) -> bool:
        """Whether the held state is v(iteration-1) as published (else the update reloads it)."""
        manifest = checkpoint.read_manifest(self.run, iteration - 1)
        return self.held is not None and manifest is not None and self.held.matches(iteration - 1, manifest)

    # ------------------------------------------------------------------------------- every rank

    def follow(self) -> None:
        """The other ranks: run what rank 0 broadcasts, until it says stop."""
        while True:
            command = self._broadcast(None)
            if command["op"] == "stop":
                return
            if command["op"] == "update":
                try:
                    self.execute(command)
                except Exception as err:  # noqa: BLE001 - rank 0 answers the client; this rank follows on
                    self.log(f"rank {self.mesh.rank}: update {command['iteration']} failed: {err}")

    def execute(self, command: dict[str, Any]) -> dict[str, Any]:
        """One update on this rank (every rank runs it with the same command)."""
        iteration = command["iteration"]
        rank = self.mesh.rank
        work = pending_iteration(self.run, iteration, command["force"], rank)
        if work is None:
            return {"outcome": "nothing to do", "source": "store", "iteration": iteration}
        held = self.held
        from_memory = bool(command["from_memory"])

        def check() -> None:
            if from_memory and (held is None or held.version != iteration - 1):
                raise MoerlError(f"trainer rank {rank} does not hold v{iteration - 1:06d}, which rank 0 holds")

        agreed(self.mesh, check)
        self.held = None  # consumed by the update: its tensors become the model's; a failure reloads
        source = "memory" if from_memory else "store"
        if rank == 0:
            self.log(f"update {iteration}: v{iteration - 1:06d} from {source}")
        _, self.held = train_iteration(
            work,
            self.mesh,
            self.local_rank,
            self.model_config,
            held=held if from_memory else None,
            dispatches=self.dispatches,
            reference=self.reference,
        )
        return {"outcome": "trained", "source": source, "iteration": iteration}

    def _broadcast(self, command: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0's command to every rank, as JSON bytes (never pickled)."""
        if self.command_group is None:
            return command or {"op": "noop"}
        data = json.dumps(command).encode() if self.mesh.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.command_group)
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if self.mesh.rank != 0:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.command_group)
        return json.loads(buffer.numpy().tobytes())
