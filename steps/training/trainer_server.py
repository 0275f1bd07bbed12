"""A trainer that stays up: the ranks of one torchrun keep the EP group and, between two updates, the state
of the version they trained (steps/training/held_state.py), and train iteration after iteration on request.

Rank 0 serves steps/run/serving.py's JsonServer, whose operations run on rank 0's main thread; its `update`
operation {run, iteration[, force, ep_size]} is broadcast from there to every rank as JSON (a gloo group of
its own, so that an idle wait is never an NCCL collective; a heartbeat every HEARTBEAT_S keeps that wait
under the group's timeout). Every rank then runs steps/training/update.py's train_iteration, the update step's
own code, and rank 0 answers once the candidate is complete; where the run's trainer holds versions (rollout
servers and deltas), once its weights are (WEIGHTS.json, the delta indexed), the optimizer shards following
on each rank's thread (steps/training/optimizer_write.py; joined before the next update writes, or a stop). A
trainer starting replays first any update whose shards its predecessor lost (recover).

Rank 0 alone decides whether there is anything to train (update.pending_iteration: v(I) published or
its candidate complete, a retried client, is answered at once without the other ranks) and checks the
iteration's inputs; only then does it broadcast the update, and every rank trains: no rank decides on its own
view of the store. Which state an update starts from is decided by rank 0 and broadcast with the request, so
every rank takes the same path: the state held in memory when it is v(I-1) exactly as published
(HeldState.matches), else v(I-1) and optimizer/v(I-1) from the store, as a fresh update step would (a trainer
just started, restarted after a crash, or holding another version). The expert dispatcher (with DeepEP, its
buffer) is made by the first update and kept (dispatch.HeldDispatch), and so is the KL reference
(held_state.HeldReference).

A failed update: when it failed in a step the ranks agreed on (update.agreed: every rank raises there,
no collective left half-entered), each rank drops its held state (the next update reloads) and listens on.
Any other failure (an OOM in training, a moved expert, the DeepEP buffer: collectives that run without an
agreement) ends the failing rank's process at once (`abort`): its peers may be waiting in an NCCL collective
it will never join, and would otherwise wait out its timeout (an hour). torchrun then stops the node's other
ranks, the job's first failed replica fails the PyTorchJob (steps/pytorchjob_launcher.py), and the daemon's
retry starts a trainer that reloads from the store; the client of the update exits 75 and is retried.

With `serve`'s LauncherWatch (a multi-node trainer's job), rank 0 also ends the trainer once its launcher's
heartbeat has been still for trainer.server_idle_exit_s: the launcher is gone, whatever the pace of updates.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from steps.errors import MoerlError
from steps.experience.tables import read_scored_experience
from steps.expert_parallel.dispatch import HeldDispatch
from steps.expert_parallel.mesh import Mesh
from steps.models.family import FamilyConfig
from steps.run import candidate, checkpoint, weight_delta
from steps.run.config import load_run_config
from steps.run.keys import (
    CANDIDATES_PREFIX,
    behaviour_version,
    delta_index_key,
    parse_iteration,
    scored_key,
    version_prefix,
)
from steps.run.serving import JsonServer, Unavailable
from steps.store.object_store import Store
from steps.training.held_state import HeldReference, HeldState
from steps.training.optimizer_write import OptimizerWrite
from steps.training.trainer import TrainSettings
from steps.training.update import IterationWork, agreed, check_token_ids, pending_iteration, train_iteration

# Rank 0 broadcasts a no-op this often while idle: the other ranks wait in a broadcast, whose group timeout
# (update.COLLECTIVE_TIMEOUT_SECONDS) must never run out between two updates.
HEARTBEAT_S = 60.0
PUBLISH_POLL_S = 2.0  # how often a trainer that waits for a version's publish looks for its MANIFEST.json
EXIT_RANK_FAILED = 1  # a rank that failed outside an agreed step: torchrun's exit code for a failed worker


def agreed_everywhere(err: BaseException) -> bool:
    """Whether every rank raised `err`'s failure at the same update.agreed step (which marks what it
    raises), so that no rank waits in a collective this one will not join."""
    return bool(getattr(err, "moerl_agreed", False))


def end_now(code: int) -> NoReturn:
    """End this process at once (after flushing its output): no atexit callbacks, no interpreter teardown,
    whose process-group destructors could wait on the very collective the other ranks are stuck in."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def iteration_inputs(run: Store, iteration: int, replay: bool = False) -> IterationWork:
    """Update `iteration`'s inputs (what update.pending_iteration reads once it found work to do), for
    the ranks that follow rank 0's decision (`replay`: rank 0's, IterationWork.replay)."""
    cfg = load_run_config(run)
    version = behaviour_version(iteration, cfg.staleness)
    samples = read_scored_experience(run, iteration, version)
    return IterationWork(run, cfg, iteration, version, samples, TrainSettings.from_run_config(cfg), replay)


class LauncherWatch:
    """Rank 0's view of its launcher's heartbeat (steps/pytorchjob_launcher.py heartbeat_writer rewrites the
    object `key` at every poll): gone once the object has not changed for `timeout_s` of this process's own
    clock (no clock is compared across machines). An object never seen means no launcher watches this
    trainer (the local executor runs the job itself): never gone. A store error reads as no change."""

    def __init__(self, run: Store, key: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.run, self.key, self.timeout_s, self.clock = run, key, timeout_s, clock
        self.last: bytes | None = None
        self.changed_at = clock()

    def still_s(self) -> float | None:
        """Seconds since the heartbeat last changed; None while none was ever seen."""
        try:
            data: bytes | None = self.run.get_bytes(self.key)
        except (MoerlError, OSError, ValueError):
            data = None  # absent (ObjectNotFound is a MoerlError) or unreadable now
        now = self.clock()
        if data is not None and data != self.last:
            self.last, self.changed_at = data, now
        return None if self.last is None else now - self.changed_at

    def gone(self) -> bool:
        still = self.still_s()
        return self.timeout_s > 0 and still is not None and still >= self.timeout_s


class TrainerService:
    def __init__(
        self,
        run: Store,
        mesh: Mesh,
        local_rank: int,
        model_config: FamilyConfig,
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
        self.pending: OptimizerWrite | None = None  # the last update's optimizer shards, being written
        self.recovering: int | None = None  # the update recover() trains again before serving (calls queue meanwhile)
        self.dispatches = HeldDispatch()  # its DeepEP buffer made once, not per update
        self.reference = HeldReference()  # the KL reference read once, not per update
        self.instance = ""  # set by the step once registered
        self.stopping = threading.Event()
        self.launcher: LauncherWatch | None = None  # serve's, also checked while an update waits for a publish
        self.abort: Callable[[int], NoReturn] = end_now  # a failure outside an agreed step (the module docstring)
        self._done = 0

    # ------------------------------------------------------------------------------- rank 0: the face

    def health(self) -> dict[str, Any]:
        pending = self.pending  # read once: the main thread may clear it meanwhile
        return {
            "run": self.run.uri,
            "instance": self.instance,
            "ready": bool(self.instance) and not self.stopping.is_set(),
            "held": None if self.held is None else self.held.version,
            "optimizer_pending": None if pending is None else pending.iteration,
            "recovering": self.recovering,
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
        force = bool(body.get("force"))
        try:
            if self.pending is not None and self.pending.iteration == iteration and not force:
                # a retried client of the update this trainer answered last: its optimizer shards are on their way
                return {"outcome": "nothing to do", "source": "memory", "iteration": iteration}
            if self.pending is not None and not self._trains_on_from_memory(iteration):
                self._broadcast({"op": "join"})  # the store says what it holds before anything is decided from it
                self._finish_pending()
            # Rank 0 decides for every rank, and refuses inputs that cannot train before any rank starts.
            work = pending_iteration(self.run, iteration, force, 0)
            if work is None:
                return {"outcome": "nothing to do", "source": "store", "iteration": iteration}
            check_token_ids(work.samples, self.model_config.vocab_size, self.run.url(scored_key(iteration)))
            # the optimizer shards after the answer only where the next update does not wait for this one's publish
            # (the trainer holds versions: pipelines/workflow/graph.py), and as the run's trainer says
            later = bool(body.get("optimizer_later")) and not work.replay and candidate.defers_optimizer(work.cfg)
            command = {
                "op": "update",
                "iteration": iteration,
                "from_memory": self._may_train_on(iteration),
                "replay": work.replay,
                "optimizer_later": later,
            }
            self._broadcast(command)
            return self.execute(command, work)
        finally:
            self._done += 1

    def serve(self, server: JsonServer, launcher: LauncherWatch | None = None) -> None:
        """Rank 0's main thread: run the server's requests on every rank until stopping, with a no-op broadcast
        while idle (HEARTBEAT_S); then tell the other ranks to stop. With `launcher`, it also stops once the
        launcher's heartbeat has been still for its timeout (checked at each idle heartbeat). (A SIGTERM ends
        rank 0 at once, in a request or not; the other ranks then end with their process group.)"""

        def idle() -> None:
            if launcher is not None and launcher.gone():
                self.log(
                    f"trainer: its launcher's heartbeat {self.run.url(launcher.key)} has not changed for "
                    f"{launcher.still_s() or 0:.0f} s (--idle-exit-s {launcher.timeout_s:g}): the launcher is "
                    "gone; stopping"
                )
                self.stopping.set()
                return
            self._broadcast({"op": "noop"})

        self.launcher = launcher
        self.recover()  # the calls that come meanwhile wait in the server's queue
        server.run_operations(self.stopping, idle=idle, idle_every_s=HEARTBEAT_S)
        self._broadcast({"op": "stop"})
        self._finish_pending()

    def _trains_on_from_memory(self, iteration: int) -> bool:
        """Whether the held state is v(iteration-1) as the run has it (HeldState.matches)."""
        files = weight_delta.version_files(self.run, iteration - 1)
        return self.held is not None and files is not None and self.held.matches(iteration - 1, files)

    def _may_train_on(self, iteration: int) -> bool:
        """Whether the held state is v(iteration-1) as the run has it (else the update reloads it). A version
        indexed and not published yet (the update of `iteration` does not wait for its publish when the trainer
        stays up: pipelines/workflow/graph.py) can only be trained on from memory: without it (a trainer started
        or restarted since, or one whose last update failed) the update waits for that publish, which runs beside
        it and is at most one version behind; and when the candidate of v(iteration-1) lacks its optimizer
        shards (the trainer that wrote its weights was lost before it stored them: they are what the publish
        waits for), this trainer trains that update again first (_train_again) and holds it."""
        if self._trains_on_from_memory(iteration):
            return True
        parent = iteration - 1
        if self._optimizer_lost(parent):
            self._train_again(parent)
            if self._trains_on_from_memory(iteration):
                return True
        self._wait_for_publish(parent)
        return False

    def _optimizer_lost(self, version: int) -> bool:
        """Whether v(version)'s candidate has its weights (WEIGHTS.json) but will never get its optimizer shards
        (no CANDIDATE.json, no publish, and this trainer writes none of it)."""
        if version < 1 or self.pending is not None or checkpoint.read_manifest(self.run, version) is not None:
            return False
        return candidate.awaits_optimizer(self.run, version)

    def _train_again(self, version: int) -> None:
        """Update `version` again on every rank (its candidate's optimizer shards were lost: a replay of the
        indexed weights, or a plain retrain when they were not indexed), so that this trainer holds v(version)
        and CANDIDATE.json is written."""
        work = pending_iteration(self.run, version, False, 0)
        if work is None:
            return
        self.log(f"trainer: the candidate of iteration {version} lacks its optimizer shards: training it again")
        command = {
            "op": "update",
            "iteration": version,
            "from_memory": self._may_train_on(version),
            "replay": work.replay,
            "optimizer_later": False,
        }
        self._broadcast(command)
        self.execute(command, work)

    def _wait_for_publish(self, version: int) -> None:
        """Until v(version) is published, with the other ranks kept from their group's timeout (a no-op broadcast
        every HEARTBEAT_S), for at most trainer.publish_wait_s: then the update is refused (a MoerlError naming
        the publish). Unavailable (the client retries) if the trainer stops meanwhile: told to, or its launcher
        gone (as serve's idle check would find)."""
        wait_s = load_run_config(self.run).trainer.publish_wait_s
        started = beat = time.monotonic()
        self.log(f"trainer: v{version:06d} is not published yet and not held here: waiting for its publish")
        while checkpoint.read_manifest(self.run, version) is None:
            if self.launcher is not None and self.launcher.gone():
                self.stopping.set()
            if self.stopping.wait(PUBLISH_POLL_S):
                raise Unavailable(f"the trainer stopped while waiting for v{version:06d}'s publish")
            if time.monotonic() - started >= wait_s:
                raise MoerlError(
                    f"{self.run.url(version_prefix(version))}: v{version:06d} is not published after {wait_s:.0f} s "
                    f"(trainer.publish_wait_s) and this trainer, restarted since it trained it, does not hold it: the "
                    f"publish of iteration {version} failed or is not running; publish it (python -m steps.publish "
                    f"--run {self.run.uri} --iteration {version}), then retry this update"
                )
            if time.monotonic() - beat >= HEARTBEAT_S:
                self._broadcast({"op": "noop"})
                beat = time.monotonic()

    # ------------------------------------------------------------------------------- every rank

    def follow(self) -> None:
        """The other ranks: run what rank 0 broadcasts, until it says stop."""
        while True:
            command = self._broadcast(None)
            if command["op"] == "stop":
                self._finish_pending()
                return
            if command["op"] == "join":
                self._finish_pending()
            if command["op"] == "update":
                try:
                    self.execute(command)
                except Exception as err:  # noqa: BLE001 - agreed by every rank (execute ends it otherwise)
                    self.log(f"rank {self.mesh.rank}: update {command['iteration']} failed: {err}")

    def execute(self, command: dict[str, Any], work: IterationWork | None = None) -> dict[str, Any]:
        """One update on this rank (every rank runs it with the same command, which rank 0 broadcast once it
        found work to do: `work`, its inputs, on rank 0; the others read them). A failure that every rank
        agreed on is raised; any other ends this process (`abort`, see the module docstring)."""
        try:
            return self._train(command, work)
        except Exception as err:
            self.held = None  # a failed update's state is not v(I-1) any more: the next one reloads
            if self.command_group is not None and not agreed_everywhere(err):
                self.log(
                    f"rank {self.mesh.rank}: update {command['iteration']} failed outside a step the ranks agree "
                    f"on ({type(err).__name__}: {err}); ending this rank so that torchrun ends them all"
                )
                self.abort(EXIT_RANK_FAILED)
            raise

    def _train(self, command: dict[str, Any], work: IterationWork | None) -> dict[str, Any]:
        iteration = command["iteration"]
        rank = self.mesh.rank
        inputs, replay = work, bool(command.get("replay"))
        work = agreed(
            self.mesh, lambda: inputs if inputs is not None else iteration_inputs(self.run, iteration, replay)
        )
        held = self.held
        from_memory = bool(command["from_memory"])

        def check() -> None:
            if from_memory and (held is None or held.version != iteration - 1):
                raise MoerlError(f"trainer rank {rank} does not hold v{iteration - 1:06d}, which rank 0 holds")

        agreed(self.mesh, check)
        self.held = None  # consumed by the update: its tensors become the model's; a failure reloads
        source = "memory" if from_memory else "store"
        if rank == 0:
            self.log(f"update {iteration}: v{iteration - 1:06d} from {source}" + (" (a replay)" if replay else ""))

        def hand_over(write: OptimizerWrite) -> None:
            self.pending = write

        _, self.held = train_iteration(
            work,
            self.mesh,
            self.local_rank,
            self.model_config,
            held=held if from_memory else None,
            dispatches=self.dispatches,
            reference=self.reference,
            before_write=self._join_pending,
            write_optimizer_later=hand_over if command.get("optimizer_later") else None,
        )
        answer = {"outcome": "trained", "source": source, "iteration": iteration}
        if self.pending is not None:
            answer["optimizer"] = "being written"
        return answer

    def _join_pending(self) -> None:
        """The previous update's optimizer shards stored (rank 0: CANDIDATE.json written): every rank waits for its
        own shard, the ranks agree, then rank 0 waits for CANDIDATE.json (optimizer_write.py). Run by
        train_iteration before it writes anything, and by a stop, on every rank. A failure is Unavailable (503):
        the client's retry finds this trainer holding nothing and trains that update again (_may_train_on)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            agreed(self.mesh, pending.own_part)
            pending.join()
        except Exception as err:
            pending.cancel()
            raise Unavailable(
                f"{err}; the next update trains iteration {pending.iteration} again to store them"
            ) from err

    def _finish_pending(self) -> None:
        """Every rank: the pending optimizer write joined (agreed); a failure is said, not raised (the update
        that next needs that version trains it again: _may_train_on). Nothing pending is nothing to join, on every
        rank alike (each rank's pending is set and cleared by the same commands)."""
        if self.pending is None:
            return
        try:
            agreed(self.mesh, self._join_pending)
        except Exception as err:  # noqa: BLE001 - every rank agreed on it; said here
            self.log(f"rank {self.mesh.rank}: {err}")

    def recover(self) -> None:
        """Rank 0, before it serves: a candidate whose weights were indexed and whose optimizer shards never came
        (the trainer this one replaces was lost after it answered) is trained again now, so that its publish,
        which waits for them, is not left to wait for the next update (optimizer_write.py)."""
        try:
            for version in self._lost_optimizer_versions():
                self.recovering = version
                self._train_again(version)
        except Exception as err:  # noqa: BLE001 - said; the next update that needs it tries again
            self.log(f"trainer: recovering lost optimizer shards failed ({err}); the next update needing them retries")
        finally:
            self.recovering = None

    def _lost_optimizer_versions(self) -> list[int]:
        """The iterations whose candidate has WEIGHTS.json and an indexed delta but no CANDIDATE.json and that are
        not published, oldest first."""
        iterations = set()
        for key in self.run.list(f"{CANDIDATES_PREFIX}/"):
            parts = key.split("/")
            iteration = parse_iteration(parts[1]) if len(parts) == 3 else None
            if iteration is not None and parts[2] == candidate.WEIGHTS_MARKER:
                iterations.add(iteration)
        return sorted(
            i for i in iterations
            if self.run.exists(delta_index_key(i)) and self._optimizer_lost(i)
        )  # fmt: skip

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
