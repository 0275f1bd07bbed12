"""memoize: a template's outputs cached by key, as Argo's controller/cache keeps them in a ConfigMap.

The cache named by `memoize.cache.configMap.name` is the file `<workdir>/.memoize/<name>.json`, so it lasts
across runs that share a workdir, as the ConfigMap lasts across Workflows. An entry holds what Argo's
ConfigMap entry holds (nodeID, outputs, creationTimestamp, lastHitTimestamp). A node whose key is in the
cache, not older than `maxAge`, is a cache hit: Succeeded at once with the cached outputs and no pod
(initializeCacheHitNode); any other runs, and its outputs are saved as soon as it has Succeeded (only then, as
in Argo), so a later step of the same run with the same key is a hit. Each node made from a memoized template
records Argo's memoizationStatus {hit, key, cacheName}: hit false, or true for a node served from the cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from pathlib import Path

from pipelines.durations import parse_duration
from pipelines.local.api.status import SUCCEEDED, Node, timestamp

KEY_RE = re.compile(r"[-._a-zA-Z0-9]+")  # a ConfigMap key, which Argo's cache key must be


class MemoizeError(Exception):
    """A memoize block that cannot be used (no cache name, a key a ConfigMap cannot hold, a bad maxAge)."""


class Memoizer:
    def __init__(self, cache_dir: Path):
        self.dir = cache_dir
        self.pending: dict[str, tuple[str, str]] = {}  # node ID -> (cache name, key) to save once it Succeeded

    def lookup(self, memoize: dict) -> dict | None:
        """The cached outputs for memoize.key, or None on a miss or an entry older than maxAge."""
        name, key = self._name_and_key(memoize)
        entry = self._read(name).get(key)
        if entry is None:
            return None
        if memoize.get("maxAge"):
            try:
                max_age = parse_duration(str(memoize["maxAge"]))
            except ValueError as err:
                raise MemoizeError(f"invalid maxAge: {err}") from err
            if time.time() - float(entry.get("createdAt", 0)) > max_age:
                return None
        with self._locked(name) as entries:
            if key in entries:
                entries[key]["lastHitTimestamp"] = timestamp(time.time())
        return {"outputs": entry.get("outputs"), "key": key, "cacheName": name}

    def track(self, node: Node, memoize: dict) -> dict:
        """A node made from a memoized template (Argo's initializeExecutableNode): its memoizationStatus,
        a miss, and its outputs to save once it has Succeeded (as Argo saves them where it marks the
        node Succeeded: pod reconciliation, executeSteps, executeDAG)."""
        name = str(((memoize.get("cache") or {}).get("configMap") or {}).get("name") or "")
        key = str(memoize.get("key") or "")
        self.pending[node.id] = (name, key)
        return {"hit": False, "key": key, "cacheName": name}

    def settle(self, node: Node) -> None:
        name, key = self.pending.pop(node.id)
        if node.phase != SUCCEEDED or not (KEY_RE.fullmatch(name) and KEY_RE.fullmatch(key)):
            return
        now = time.time()
        with self._locked(name) as entries:
            entries[key] = {
                "nodeID": node.id,
                "outputs": node.outputs,
                "creationTimestamp": timestamp(now),
                "lastHitTimestamp": timestamp(now),
                "createdAt": now,
            }

    def _name_and_key(self, memoize: dict) -> tuple[str, str]:
        name = str(((memoize.get("cache") or {}).get("configMap") or {}).get("name") or "")
        key = str(memoize.get("key") or "")
        if not KEY_RE.fullmatch(name):
            raise MemoizeError(f"memoize.cache.configMap.name {name!r} is not a valid ConfigMap name")
        if not KEY_RE.fullmatch(key):
            raise MemoizeError(f"memoize.key {key!r} is not a valid ConfigMap key (letters, digits, '-', '_', '.')")
        return name, key

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def _read(self, name: str) -> dict:
        try:
            return json.loads(self._path(name).read_text())
        except (OSError, ValueError):
            return {}

    def _locked(self, name: str) -> _LockedEntries:
        return _LockedEntries(self, name)


class _LockedEntries:
    """The cache's entries, read and written back under a flock (runs sharing a workdir write it too)."""

    def __init__(self, memo: Memoizer, name: str):
        self.memo, self.name = memo, name

    def __enter__(self) -> dict:
        self.memo.dir.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.memo.dir / f".{self.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.entries = self.memo._read(self.name)
        return self.entries

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                path = self.memo._path(self.name)
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(json.dumps(self.entries, indent=2) + "\n")
                os.replace(tmp, path)
        finally:
            os.close(self.fd)
