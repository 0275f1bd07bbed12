"""Synchronization: the mutexes and semaphores of a workflow or a template, as Argo's workflow/sync keeps them.

A lock is named as Argo names it: `NAMESPACE/Mutex/NAME` (limit 1) or `NAMESPACE/ConfigMap/NAME/KEY`, its
limit the ConfigMap's value (given with --configmap or beside the manifest). Each slot of a lock is a file
under `<workdir>/.sync/`, held with flock: so two `moerl local` runs sharing a workdir (two Workflows of one
run, as with moerl's run mutex) exclude each other as two Workflows on one cluster do, and a run that dies
frees its slots with its process. A holder (the workflow for `spec.synchronization`, a node ID for a
template's) takes all of its locks or none (tryAcquireImpl); one that cannot waits Pending with Argo's
message "Waiting for LOCK lock. Lock status: FREE/LIMIT".

The queue is Argo's (semaphore.go checkAcquire, priorityQueue): a workflow that waits for a lock enqueues
itself (a file beside the slots: its spec.priority, creation time and pid), and a free slot goes to the
workflow at the front, highest priority first, then the oldest; any node of that workflow may take it
(isSameWorkflowNodeKeys), so within one run the nodes are served in the order the controller walks them.
A queue entry whose process is gone is dropped.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path


class LockError(Exception):
    """A lock that cannot be set up (a ConfigMap's limit missing or not a number); its holder errors."""


def lock_names(sync: dict, namespace: str, configmaps: dict[str, dict[str, str]]) -> list[tuple[str, int]]:
    """(Argo's lock name, limit) of each semaphore, then each mutex (allSyncItems' order)."""
    locks = []
    for semaphore in sync.get("semaphores") or []:
        ref = (semaphore or {}).get("configMapKeyRef") or {}
        ns = (semaphore or {}).get("namespace") or namespace
        name, key = str(ref.get("name")), str(ref.get("key"))
        raw = (configmaps.get(name) or {}).get(key)
        if raw is None or not str(raw).strip().isdigit():
            raise LockError(f"failed to initialize semaphore {ns}/ConfigMap/{name}/{key} with limit")
        locks.append((f"{ns}/ConfigMap/{name}/{key}", int(str(raw).strip())))
    for mutex in sync.get("mutexes") or []:
        ns = (mutex or {}).get("namespace") or namespace
        locks.append((f"{ns}/Mutex/{(mutex or {}).get('name')}", 1))
    if len(set(locks)) != len(locks):
        raise LockError("requested configuration is invalid: duplicate synchronization item found")
    return locks


class LockManager:
    def __init__(
        self,
        lock_dir: Path,
        namespace: str,
        configmaps: dict[str, dict[str, str]],
        workflow_key: str = "",
        priority: int = 0,
        created_at: float = 0.0,
    ):
        self.dir = lock_dir
        self.namespace = namespace
        self.configmaps = configmaps
        self.workflow_key = workflow_key or f"{namespace}/pid-{os.getpid()}"
        self.priority = priority
        self.created_at = created_at
        self.held: dict[str, list[int]] = {}  # holder -> the open slot files it holds (flocked)
        self.waiting: dict[str, set[str]] = {}  # lock name -> this workflow's holders queued for it

    def holding(self, holder: str) -> bool:
        return holder in self.held

    def try_acquire(self, holder: str, sync: dict) -> tuple[bool, str]:
        """Take every lock of `sync` for holder, or none; (acquired, Argo's waiting message)."""
        if holder in self.held:
            return True, ""
        locks = lock_names(sync, self.namespace, self.configmaps)
        self.dir.mkdir(parents=True, exist_ok=True)
        for name, _ in locks:
            self._enqueue(name, holder)
        for name, limit in locks:  # checkAcquire of each lock first, as tryAcquireImpl does
            if limit == 0:
                return False, f"Failed to get semaphore limit for {name}"
            if self._front(name) not in (None, self.workflow_key):
                return False, f"Waiting for {name} lock. Lock status: {self._free(name, limit)}/{limit}"
        taken: list[int] = []
        for name, limit in locks:
            fd = self._take_slot(name, limit)
            if fd is None:
                for held in taken:
                    os.close(held)  # closing the file drops its flock
                return False, f"Waiting for {name} lock. Lock status: 0/{limit}"
            taken.append(fd)
        self.held[holder] = taken
        for name, _ in locks:
            self._dequeue(name, holder)
        return True, ""

    def release(self, holder: str) -> None:
        for fd in self.held.pop(holder, []):
            os.close(fd)

    def release_all(self) -> None:
        for holder in list(self.held):
            self.release(holder)
        for name in list(self.waiting):
            self.waiting[name].clear()
            self._dequeue(name, None)

    # ------------------------------------------------------------------------- slots

    def _stem(self, name: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "_", name)

    def _lock_slot(self, name: str, slot: int) -> int | None:
        """The slot's file, flocked, or None when someone (another run, or another holder here) holds it."""
        fd = os.open(self.dir / f"{self._stem(name)}.{slot}", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        return fd

    def _take_slot(self, name: str, limit: int) -> int | None:
        """A free slot's file, flocked, or None when all `limit` are held."""
        for slot in range(limit):
            fd = self._lock_slot(name, slot)
            if fd is not None:
                return fd
        return None

    def _free(self, name: str, limit: int) -> int:
        """How many of the lock's slots nobody holds (Argo's limit - len(lockHolder))."""
        free = 0
        for slot in range(limit):
            fd = self._lock_slot(name, slot)
            if fd is not None:
                free += 1
                os.close(fd)
        return free

    # ------------------------------------------------------------------------- the queue

    def _queue_dir(self, name: str) -> Path:
        return self.dir / f"{self._stem(name)}.queue"

    def _entry(self, name: str) -> Path:
        return self._queue_dir(name) / self._stem(self.workflow_key)

    def _enqueue(self, name: str, holder: str) -> None:
        holders = self.waiting.setdefault(name, set())
        if not holders:
            self._queue_dir(name).mkdir(parents=True, exist_ok=True)
            entry = {"workflow": self.workflow_key, "priority": self.priority, "created": self.created_at}
            self._entry(name).write_text(json.dumps({**entry, "pid": os.getpid()}))
        holders.add(holder)

    def _dequeue(self, name: str, holder: str | None) -> None:
        holders = self.waiting.get(name, set())
        holders.discard(holder)
        if not holders:
            self.waiting.pop(name, None)
            try:
                self._entry(name).unlink()
            except FileNotFoundError:
                pass

    def _front(self, name: str) -> str | None:
        """The workflow at the front of the lock's queue (priority, then creation time), if any is alive."""
        entries = []
        for path in self._queue_dir(name).glob("*"):
            try:
                entry = json.loads(path.read_text())
                os.kill(int(entry["pid"]), 0)
            except ProcessLookupError:  # its run is gone: so is its place in the queue
                path.unlink(missing_ok=True)
                continue
            except (OSError, ValueError, KeyError, TypeError):
                continue
            entries.append((-int(entry.get("priority") or 0), float(entry.get("created") or 0), str(entry["workflow"])))
        return min(entries)[2] if entries else None
