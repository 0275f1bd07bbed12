"""Synchronization: the mutexes and semaphores of a workflow or a template, as Argo's workflow/sync keeps them.

A lock is named as Argo names it: `NAMESPACE/Mutex/NAME` (limit 1) or `NAMESPACE/ConfigMap/NAME/KEY`, its
limit the ConfigMap's value (given with --configmap or beside the manifest). Each slot of a lock is a file
under `<workdir>/.sync/`, held with flock: so two `moerl local` runs sharing a workdir (two Workflows of one
run, as with moerl's run mutex) exclude each other as two Workflows on one cluster do, and a run that dies
frees its slots with its process. A holder (the workflow for `spec.synchronization`, a node ID for a
template's) takes all of its locks or none (tryAcquireImpl); one that cannot waits Pending with Argo's
message "Waiting for LOCK lock. Lock status: FREE/LIMIT". Within one workflow the nodes are served in the
order the controller walks them, as in Argo, whose queue lets any node of the workflow at its front take a
free slot (isSameWorkflowNodeKeys). Between runs the first to try when a slot frees takes it (Argo orders
workflows by priority, then creation time).
"""

from __future__ import annotations

import fcntl
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
    def __init__(self, lock_dir: Path, namespace: str, configmaps: dict[str, dict[str, str]]):
        self.dir = lock_dir
        self.namespace = namespace
        self.configmaps = configmaps
        self.held: dict[str, list[int]] = {}  # holder -> the open slot files it holds (flocked)

    def holding(self, holder: str) -> bool:
        return holder in self.held

    def try_acquire(self, holder: str, sync: dict) -> tuple[bool, str]:
        """Take every lock of `sync` for holder, or none; (acquired, Argo's waiting message)."""
        if holder in self.held:
            return True, ""
        locks = lock_names(sync, self.namespace, self.configmaps)
        self.dir.mkdir(parents=True, exist_ok=True)
        taken: list[int] = []
        for name, limit in locks:
            fd, free = self._take_slot(name, limit)
            if fd is None:
                for held in taken:
                    os.close(held)  # closing the file drops its flock
                if limit == 0:
                    return False, f"Failed to get semaphore limit for {name}"
                return False, f"Waiting for {name} lock. Lock status: {free}/{limit}"
            taken.append(fd)
        self.held[holder] = taken
        return True, ""

    def release(self, holder: str) -> None:
        for fd in self.held.pop(holder, []):
            os.close(fd)

    def release_all(self) -> None:
        for holder in list(self.held):
            self.release(holder)

    def _take_slot(self, name: str, limit: int) -> tuple[int | None, int]:
        """A free slot's file, flocked, or None and how many slots are free (0: all held)."""
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        for slot in range(limit):
            fd = os.open(self.dir / f"{stem}.{slot}", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            return fd, 0
        return None, 0
