"""Faults injected into a step's own process, for the fault-injection tests (tests/test_faults_*.py).

A test puts this directory first on PYTHONPATH and describes the faults in MOERL_FAULT (a JSON list); Python
imports this module at start-up, in the step and in every process it starts (torchrun's workers too). With
MOERL_FAULT unset it does nothing.

    {"kill": "KILL" | "TERM" | "STOP", "on": "put" | "replace", "match": REGEX, "nth": N, "when": "before" | "after"}
        Send the signal to this process at the N-th store write whose key matches (on "put":
        steps.store.object_store.Store.put_bytes / put_file), or at the N-th os.replace whose target path matches (on
        "replace": the local store's renames into place), just before or just after it. Deterministic
        crash points: "after the first chunk is written", "between the sidecar and the object rename"; STOP holds
        the process there for the test to kill when it chooses.
    {"enospc": REGEX, "free": BYTES}
        A full disk for the local store's writes into directories whose path matches: once BYTES have been
        written there, every write fails with ENOSPC, as on a full filesystem. (Used where no tiny tmpfs
        can be mounted.)

steps.store.object_store is patched when it is first imported, so processes that never import it pay nothing.
"""

from __future__ import annotations

import errno
import importlib.abc
import importlib.machinery
import json
import os
import re
import signal
import sys

_SPECS = json.loads(os.environ.get("MOERL_FAULT") or "[]")


class _Kill:
    def __init__(self, spec: dict) -> None:
        self.signal = getattr(signal, f"SIG{spec['kill']}")
        self.on = spec.get("on", "put")
        self.pattern = re.compile(spec.get("match", ""))
        self.nth = int(spec.get("nth", 1))
        self.when = spec.get("when", "after")
        self.count = 0

    def due(self, on: str, name: str) -> bool:
        if on != self.on or not self.pattern.search(name):
            return False
        self.count += 1
        return self.count == self.nth

    def fire(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), self.signal)


_KILLS = [_Kill(s) for s in _SPECS if "kill" in s]
_FULL = [s for s in _SPECS if "enospc" in s]


def _around(on: str, name: str, op):
    due = [k for k in _KILLS if k.due(on, name)]
    for kill in due:
        if kill.when == "before":
            kill.fire()
    result = op()
    for kill in due:
        if kill.when == "after":
            kill.fire()
    return result


class _FullDiskFile:
    """A file whose writes fail with ENOSPC once the shared budget of free bytes is used up."""

    def __init__(self, file, budget: dict) -> None:
        self._file, self._budget = file, budget

    def write(self, data) -> int:
        if self._budget["free"] < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget["free"] -= len(data)
        return self._file.write(data)

    def __getattr__(self, name: str):
        return getattr(self._file, name)

    def __enter__(self) -> _FullDiskFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _patch_store(module) -> None:
    store = module.Store
    put_bytes, put_file = store.put_bytes, store.put_file

    def patched_put_bytes(self, key, data):
        return _around("put", key, lambda: put_bytes(self, key, data))

    def patched_put_file(self, key, local_path):
        return _around("put", key, lambda: put_file(self, key, local_path))

    store.put_bytes, store.put_file = patched_put_bytes, patched_put_file

    if any(k.on == "replace" for k in _KILLS):
        replace = os.replace

        def patched_replace(src, dst, **kwargs):
            return _around("replace", os.fspath(dst), lambda: replace(src, dst, **kwargs))

        os.replace = patched_replace

    local = sys.modules["steps.store.local"]  # the local backend's files, imported by object_store above
    for spec in _FULL:
        pattern, budget, open_temp = re.compile(spec["enospc"]), {"free": int(spec["free"])}, local._open_temp

        def patched_open_temp(directory, _open=open_temp, _pattern=pattern, _budget=budget):
            path, file = _open(directory)
            return (path, _FullDiskFile(file, _budget)) if _pattern.search(str(directory)) else (path, file)

        local._open_temp = patched_open_temp


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds steps.store.object_store like the normal machinery, then patches it right after it has executed."""

    def find_spec(self, name, path, target=None):
        if name != "steps.store.object_store":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _patch_store(module)


if _KILLS or _FULL:
    sys.meta_path.insert(0, _PatchOnImport())
