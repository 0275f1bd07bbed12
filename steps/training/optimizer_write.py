"""The optimizer shards of candidate I, written after a trainer that stays up answered update I.

The weights are what the next rollout and the next update wait for: the trainer holds v(I) and its AdamW state
in memory, and rollout servers take v(I) from its delta once it is indexed. The optimizer shards (about six
times the weights' bytes: fp32 masters and two fp32 moments) are only what publish stores for a trainer that
starts again. So a trainer that stays up writes WEIGHTS.json, indexes the delta, answers, and writes the
optimizer shards on a thread of each rank while it waits for and trains the next update:

    pending = OptimizerWrite(run, I, shard, rank, expected, weights_marker)   # a copy of this rank's shard
    pending.start()
    ... update I+1 trains ...
    agreed(mesh, pending.own_part)   # every rank, before update I+1 writes anything: its own shard stored
    pending.join()                   # then rank 0's CANDIDATE.json (cancel() instead, when a rank failed)

The threads run no collective (the main thread's training does): each writer stores its shard and then a receipt
beside it (candidate.receipt_key: its size and sha256, or the error that stopped it); rank 0's thread, once its own
shard is stored, waits for every receipt and writes CANDIDATE.json (candidate.write_marker) from WEIGHTS.json and
them. A receipt that holds an error ends rank 0's wait with it; a writer that could not even write that is found
when the ranks agree on their own parts, and rank 0's wait is cancelled. At most one write is pending per trainer:
the next update joins it before it writes its own candidate, and a trainer that stops joins it first.

A trainer lost before CANDIDATE.json leaves WEIGHTS.json and the delta's index without it: publish of I waits
for it, and the trainer's replacement, before it serves, trains update I again from the same inputs and writes
the optimizer shards of the identical weights (steps/training/update.py, the replay; trainer_server.py
recover). A write that fails while the trainer lives fails the next update with 503: its client's retry finds
the trainer holding nothing and the candidate without its shards, and replays it the same way. Only runs whose
trainer holds versions defer the write (rollout servers and deltas: pipelines/workflow/graph.py), where the next
update does not wait for publish; elsewhere publish-I is what the next update waits for.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from steps.errors import MoerlError
from steps.run import candidate
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store
from steps.training.candidate_writer import write_optimizer_shard

RECEIPT_POLL_S = 0.5  # how often rank 0's thread looks for the other writers' receipts
# How long rank 0's thread waits for the receipts once every rank said its own part is stored (they are then
# written already: this only bounds a store that does not show them).
RECEIPT_WAIT_S = 600.0


class OptimizerWrite:
    """One rank's share of writing candidate `iteration`'s optimizer shards (the module docstring). `shard`:
    this rank's (file name, tensors), a copy (candidate_writer.optimizer_shard(copy=True)), None when it writes
    none; `expected` (rank 0): every optimizer shard file of the candidate; `weights_marker` (rank 0): its
    WEIGHTS.json.

    Joined in two phases, so that no rank waits for another that failed: every rank waits for its own part
    (own_part: its shard and receipt stored, or its error), the ranks agree on the outcome (update.agreed), and
    only then does rank 0 wait for CANDIDATE.json (join), whose receipts are all there by then; on a failure
    anywhere rank 0 cancels its wait instead."""

    def __init__(
        self,
        run: Store,
        iteration: int,
        shard: tuple[str, dict[str, torch.Tensor]] | None,
        rank: int,
        expected: list[str] | None = None,
        weights_marker: dict[str, Any] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        if rank == 0 and (expected is None or weights_marker is None):
            raise ValueError("rank 0 writes CANDIDATE.json: it needs the expected shards and WEIGHTS.json")
        self.run, self.iteration, self.rank, self.log = run, iteration, rank, log
        self.expected, self.weights_marker = expected or [], weights_marker
        self._shard = shard
        self._own_error: BaseException | None = None
        self._own_done = threading.Event()
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._joined_at: float | None = None
        self._thread = threading.Thread(target=self._write, name=f"optimizer-write-{iteration}", daemon=True)

    def start(self) -> OptimizerWrite:
        self._thread.start()
        return self

    def own_part(self) -> None:
        """Wait until this rank's shard and its receipt are stored; raise what stopped them."""
        self._own_done.wait()
        if self._own_error is not None:
            raise self._failure(self._own_error)

    def join(self) -> None:
        """Wait for the thread (rank 0: CANDIDATE.json written, after own_part agreed on every rank); raise what
        stopped it."""
        self._joined_at = time.monotonic()
        self._thread.join()
        error = self._own_error or self._error
        if error is not None:
            raise self._failure(error)

    def cancel(self, wait_s: float = 10 * RECEIPT_POLL_S) -> None:
        """End rank 0's wait for receipts (a writer failed: the ranks agreed so in own_part), and wait a moment for
        the thread to end, so that a replay of the same candidate does not run beside it."""
        self._cancel.set()
        if self._thread.is_alive():
            self._thread.join(timeout=wait_s)

    def _failure(self, error: BaseException) -> MoerlError:
        return MoerlError(
            f"{self.run.url(candidate_prefix(self.iteration))}: the optimizer shards written after update "
            f"{self.iteration} answered: {type(error).__name__}: {error}"
        )

    # ------------------------------------------------------------------------------- the thread

    def _write(self) -> None:
        try:
            files = self._store_shard()
        except BaseException as err:  # noqa: BLE001 - kept for own_part, which raises it on the main thread
            self._own_error = err
            return
        finally:
            self._own_done.set()
        if self.rank == 0:
            try:
                self._write_marker(files)
            except BaseException as err:  # noqa: BLE001 - kept for join
                self._error = err

    def _store_shard(self) -> dict[str, dict[str, Any]]:
        if self._shard is None:
            return {}
        name = self._shard[0]
        key = candidate.receipt_key(self.iteration, name)
        try:
            with tempfile.TemporaryDirectory(prefix=f"moerl-optimizer-{self.rank}-") as tmp:
                files = write_optimizer_shard(self.run, self.iteration, self._shard, Path(tmp))
            self.run.put_json(key, files[name])
            return files
        except BaseException as err:
            try:  # so that rank 0's wait ends with it even before the ranks agree on it
                self.run.put_json(key, {"error": f"{type(err).__name__}: {err}"})
            except Exception:  # noqa: BLE001,S110 - the store that failed the shard may fail this too; own_part says it
                pass
            raise
        finally:
            self._shard = None  # the copy's memory goes once it is stored

    def _write_marker(self, own: dict[str, dict[str, Any]]) -> None:
        files: dict[str, dict[str, Any]] = dict(own)
        while True:
            stored = set(self.run.list(candidate.receipts_prefix(self.iteration)))  # one listing a look
            for name in self.expected:
                key = candidate.receipt_key(self.iteration, name)
                if name not in files and key in stored:
                    receipt = self.run.get_json(key)
                    if "error" in receipt:
                        raise MoerlError(f"the writer of {name} failed: {receipt['error']}")
                    files[name] = {"size": int(receipt["size"]), "sha256": str(receipt["sha256"])}
            if all(name in files for name in self.expected):
                break
            if self._cancel.wait(RECEIPT_POLL_S):
                raise MoerlError("cancelled before every optimizer shard was stored")
            joined = self._joined_at  # set by join: the other ranks' parts are stored by then
            if joined is not None and time.monotonic() - joined > RECEIPT_WAIT_S:
                missing = sorted(set(self.expected) - set(files))
                raise MoerlError(f"no receipt of {missing[0]} ({len(missing)} in all) within {RECEIPT_WAIT_S:.0f} s")
        assert self.weights_marker is not None
        candidate.write_marker(self.run, self.iteration, self.weights_marker, files)
        self.log(f"candidate of iteration {self.iteration} complete: its optimizer shards stored after the update")
