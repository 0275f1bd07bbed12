"""The optimizer shards of candidate I, written after a trainer that stays up answered update I.

The weights are what the next rollout and the next update wait for: the trainer holds v(I) and its AdamW state
in memory, and rollout servers take v(I) from its delta once it is indexed. The optimizer shards (about six
times the weights' bytes: fp32 masters and two fp32 moments) are only what publish stores for a trainer that
starts again. So a trainer that stays up writes WEIGHTS.json, indexes the delta, answers, and writes the
optimizer shards on a thread of each rank while it waits for and trains the next update:

    pending = OptimizerWrite(run, I, shard, rank, expected, weights_marker)   # a copy of this rank's shard
    pending.start()
    ... update I+1 trains ...
    agreed(mesh, pending.join)   # every rank, before update I+1 writes anything

The threads run no collective (the main thread's training does): each writer stores its shard and then a
receipt beside it (candidate.receipt_key: its size and sha256, or the error that stopped it); rank 0's thread,
once its own shard is stored, waits for every receipt and writes CANDIDATE.json (candidate.write_marker) from
WEIGHTS.json and them. A receipt that holds an error ends rank 0's wait with it, so no thread waits for a
writer that failed. At most one write is pending per trainer: the next update joins it before it writes its own
candidate, and a trainer that stops joins it first.

A trainer lost before CANDIDATE.json leaves WEIGHTS.json without it: publish of I waits for it, and the next
update, which does not hold v(I), trains update I again from the same inputs and writes the optimizer shards
of the identical weights (steps/training/update.py, the replay).
"""

from __future__ import annotations

import tempfile
import threading
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


class OptimizerWrite:
    """One rank's share of writing candidate `iteration`'s optimizer shards (the module docstring). `shard`:
    this rank's (file name, tensors), a copy (candidate_writer.optimizer_shard(copy=True)), None when it writes
    none; `expected` (rank 0): every optimizer shard file of the candidate; `weights_marker` (rank 0): its
    WEIGHTS.json."""

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
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._write, name=f"optimizer-write-{iteration}", daemon=True)

    def start(self) -> OptimizerWrite:
        self._thread.start()
        return self

    def join(self) -> None:
        """Wait for this rank's part (rank 0: CANDIDATE.json written); raise what stopped it."""
        self._thread.join()
        if self._error is not None:
            raise MoerlError(
                f"{self.run.url(candidate_prefix(self.iteration))}: the optimizer shards written after "
                f"update {self.iteration} answered: {self._error}"
            )

    def cancel(self) -> None:
        """Stop rank 0's wait for receipts (the other ranks' threads end by themselves)."""
        self._cancel.set()

    # ------------------------------------------------------------------------------- the thread

    def _write(self) -> None:
        try:
            files = self._store_shard()
            if self.rank == 0:
                self._write_marker(files)
        except BaseException as err:  # noqa: BLE001 - kept for join, which raises it on the main thread
            self._error = err

    def _store_shard(self) -> dict[str, dict[str, Any]]:
        if self._shard is None:
            return {}
        name = self._shard[0]
        try:
            with tempfile.TemporaryDirectory(prefix=f"moerl-optimizer-{self.rank}-") as tmp:
                files = write_optimizer_shard(self.run, self.iteration, self._shard, Path(tmp))
        except BaseException as err:
            self.run.put_json(candidate.receipt_key(self.iteration, name), {"error": f"{type(err).__name__}: {err}"})
            raise
        finally:
            self._shard = None  # the copy's memory goes once it is stored
        self.run.put_json(candidate.receipt_key(self.iteration, name), files[name])
        return files

    def _write_marker(self, own: dict[str, dict[str, Any]]) -> None:
        files: dict[str, dict[str, Any]] = dict(own)
        while True:
            for name in self.expected:
                key = candidate.receipt_key(self.iteration, name)
                if name not in files and self.run.exists(key):
                    receipt = self.run.get_json(key)
                    if "error" in receipt:
                        raise MoerlError(f"the writer of {name} failed: {receipt['error']}")
                    files[name] = {"size": int(receipt["size"]), "sha256": str(receipt["sha256"])}
            if all(name in files for name in self.expected):
                break
            if self._cancel.wait(RECEIPT_POLL_S):
                raise MoerlError("cancelled before every optimizer shard was stored")
        assert self.weights_marker is not None
        candidate.write_marker(self.run, self.iteration, self.weights_marker, files)
        self.log(f"candidate of iteration {self.iteration} complete: its optimizer shards stored after the update")
