"""Bring a live engine to a policy version: the version's dir from the node's cache, by deltas or in full, then
the engine's in-place update (issue 21; used by the rollout server, steps/experience/rollout_server.py).

    sync = WeightSync(run)                      # cache: $MOERL_NODE_CACHE, else <tmp>/moerl-node-cache
    result = sync.bring(engine, held=3, wanted=5)
    result.path, result.bytes_fetched           # "delta", 41_000_000

The node cache holds reconstructed version dirs, `<cache>/<run hash>/v000005/`, each exactly the version's files
(verified: against MANIFEST.json when fetched whole, tensor by tensor and file by file when rebuilt from a
delta), with the files it was built as beside it (`v000005.files.json`): a dir whose record differs from what
the run says the version is now (a version indexed, never published, and trained again) is dropped and built
anew. A dir appears by a rename once complete, so its presence means it is whole. Building a
dir, and evicting old ones, happens under an exclusive flock of `<cache>/<run hash>/.lock`; reading one (the
engine's update) under a shared one. So several servers on one node (processes or threads) fetch each version
once, and no dir is evicted while an engine reads it.

A version is usable once it is published or once its update indexed its delta (steps/run/weight_delta.py):
a server takes v(i) from v(i-1) and the delta while publish still writes the full checkpoint. How a version's
dir is obtained (SyncResult.path):
    none    the engine already holds it: nothing is done
    cache   another server of the node made it already: nothing is fetched
    delta   the newest cached version below it (for a version not published yet and nothing cached below it:
            its parent, fetched whole first) plus the deltas of every version from there up to it, applied in
            turn (each intermediate dir is cached too), when all of them exist and together are smaller than
            the checkpoint (always, for a version not published yet)
    full    otherwise, or when a delta turns out unusable (a warning line says why): the whole checkpoint,
            verified (steps/run/checkpoint.py). A version not published yet has none: the bring raises
            serving.Unavailable (the request is answered 503 and retried, by when publish has written it)
Eviction: after each bring the cache keeps the two newest versions, and the one just brought.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from steps.engines.interface import Engine
from steps.errors import MoerlError
from steps.run import checkpoint, weight_delta
from steps.run.keys import MANIFEST, parse_version, version_name, version_prefix
from steps.run.serving import Unavailable
from steps.store.object_store import Store

E = TypeVar("E", bound=Engine)
T = TypeVar("T")

CACHE_ENV = "MOERL_NODE_CACHE"
KEEP_VERSIONS = 2
LOCK_NAME = ".lock"
STAGING_PREFIX = ".staging-"
FILES_SUFFIX = ".files.json"  # beside a version dir: the files it was built as


@dataclass(frozen=True)
class SyncResult:
    path: str  # "none" | "cache" | "delta" | "full" (module docstring)
    bytes_fetched: int  # read from the run store by this bring
    seconds: float  # the whole bring: fetch and in-place update
    version: int  # the version the engine holds now
    update_seconds: float = 0.0  # of which the engine's update_weights


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / "moerl-node-cache")


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class WeightSync:
    def __init__(self, run: Store, cache_dir: Path | None = None, log: Callable[[str], None] = _warn) -> None:
        self.run = run
        self.root = Path(cache_dir if cache_dir is not None else default_cache_dir())
        self.root = self.root / hashlib.sha256(run.uri.encode()).hexdigest()[:16]
        self.log = log

    # ------------------------------------------------------------------------------- public

    def version_dir(self, version: int) -> Path:
        return self.root / version_name(version)

    def cached_versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(parse_version(p.name) for p in self.root.iterdir() if p.is_dir() and _is_version_name(p.name))

    def bring(self, engine: Engine, held: int | None, wanted: int) -> SyncResult:
        """Make `engine` (holding version `held`, None: unknown) hold published version `wanted`."""
        start = time.perf_counter()
        if held == wanted:
            return SyncResult("none", 0, time.perf_counter() - start, wanted)
        (path, fetched), update_seconds = self._with_dir(wanted, lambda model_dir: _timed_update(engine, model_dir))
        return SyncResult(path, fetched, time.perf_counter() - start, wanted, update_seconds)

    def open(self, wanted: int, opener: Callable[[Path], E]) -> E:
        """A new engine, `opener(model_dir)` on `wanted`'s dir in the node cache: the version the deltas of a
        later bring start from, fetched once per node."""
        return self._with_dir(wanted, opener)[1]

    def _with_dir(self, wanted: int, use: Callable[[Path], T]) -> tuple[tuple[str, int], T]:
        """materialize(wanted), then use(its dir) under the shared lock; (materialize's result, use's)."""
        while True:
            made = self.materialize(wanted)
            with self._locked(fcntl.LOCK_SH):
                model_dir = self.version_dir(wanted)
                if not model_dir.is_dir():  # evicted between the two locks by a server far ahead: again
                    continue
                return made, use(model_dir)

    def materialize(self, wanted: int) -> tuple[str, int]:
        """Make sure the cache holds `wanted`'s dir; returns (how: cache|delta|full, bytes fetched)."""
        with self._locked(fcntl.LOCK_EX):
            self._drop_staging()
            manifest = checkpoint.read_manifest(self.run, wanted)
            files = manifest.files if manifest is not None else weight_delta.version_files(self.run, wanted)
            if files is None:  # the request came after the update that indexes it: a moment's gap, or a damage
                raise Unavailable(f"{weight_delta.not_usable(self.run, wanted)}; the request is retried")
            if self._holds(wanted, files):
                how, fetched = "cache", 0
            else:
                self._drop(wanted)
                how, fetched = self._build(wanted, manifest, files)
            self._evict(keep=wanted)
            return how, fetched

    # ------------------------------------------------------------------------------- building dirs

    def _build(
        self, wanted: int, manifest: checkpoint.Manifest | None, files: weight_delta.FileDigests
    ) -> tuple[str, int]:
        """Build `wanted`'s dir (`manifest`: its MANIFEST.json, None before publish): (how, bytes fetched) as
        materialize."""
        read: list[int] = []
        published = manifest is not None
        chain = self._delta_chain(wanted, files, published)
        if chain is None and not published:  # from the nearest published version below it, fetched whole
            below = ((v, checkpoint.read_manifest(self.run, v)) for v in range(wanted - 1, -1, -1))
            base, base_manifest = next(((v, m) for v, m in below if m is not None), (None, None))
            if base is None or base_manifest is None:
                raise Unavailable(f"{version_name(wanted)} is not published and no version below it is; retried")
            if not self._holds(base, base_manifest.files):
                self._drop(base)
                read.append(self._fetch_full(base, base_manifest))
            chain = self._delta_chain(wanted, files, published)
        if chain is not None:
            try:
                self._apply_chain(chain, read)
                return "delta", sum(read)
            except weight_delta.DeltaUnusable as err:
                if not published:
                    raise Unavailable(
                        f"{err}; {version_name(wanted)} is not published yet, so it cannot be fetched whole: "
                        "the request is retried"
                    ) from err
                self.log(f"warning: {err}; fetching the full checkpoint {version_name(wanted)}")
        if manifest is None:
            raise Unavailable(
                f"{self.run.url(version_prefix(wanted))}: {version_name(wanted)} is not published yet and the deltas "
                f"from the nearest cached or published version up to it are not all indexed; the request is retried"
            )
        return "full", sum(read) + self._fetch_full(wanted, manifest)

    def _holds(self, version: int, files: weight_delta.FileDigests) -> bool:
        """Whether the cache holds `version`'s dir built as `files` (what the run says the version is)."""
        record = self.root / f"{version_name(version)}{FILES_SUFFIX}"
        if not self.version_dir(version).is_dir() or not record.is_file():
            return False
        try:
            return json.loads(record.read_text()) == files
        except ValueError:
            return False

    def _record(self, version: int, files: weight_delta.FileDigests) -> None:
        record = self.root / f"{version_name(version)}{FILES_SUFFIX}"
        record.write_text(json.dumps(files, sort_keys=True))

    def _drop(self, version: int) -> None:
        (self.root / f"{version_name(version)}{FILES_SUFFIX}").unlink(missing_ok=True)
        shutil.rmtree(self.version_dir(version), ignore_errors=True)

    def _delta_chain(
        self, wanted: int, files: weight_delta.FileDigests, published: bool
    ) -> list[weight_delta.DeltaIndex] | None:
        """The deltas from the newest cached version below `wanted` that is still what the run says it is, up to
        it, if all exist and (for a published version) are cheaper than the checkpoint; else None."""
        base = None
        for version in reversed([v for v in self.cached_versions() if v < wanted]):
            held = weight_delta.version_files(self.run, version)
            if held is not None and self._holds(version, held):
                base = version
                break
        if base is None:
            return None
        chain = []
        for version in range(base + 1, wanted + 1):
            try:
                index = weight_delta.read_index(self.run, version)
            except weight_delta.DeltaUnusable as err:
                self.log(f"warning: {err}; fetching the full checkpoint {version_name(wanted)}")
                return None
            if index is None:
                return None
            chain.append(index)
        if published and sum(index.delta_bytes for index in chain) >= weight_delta.checkpoint_bytes(files):
            return None
        return chain

    def _apply_chain(self, chain: list[weight_delta.DeltaIndex], read: list[int]) -> None:
        """Apply the deltas in turn, caching each version; appends the bytes of each applied delta to `read`."""
        for index in chain:
            with self._staging() as staging:
                parent = self.version_dir(index.parent)
                read.append(weight_delta.apply_delta(self.run, index.version, parent, staging, index))
                self._drop(index.version)
                staging.rename(self.version_dir(index.version))
                self._record(index.version, index.version_files())

    def _fetch_full(self, version: int, manifest: checkpoint.Manifest) -> int:
        with self._staging() as staging:
            checkpoint.download(self.run, version, staging)
            self._drop(version)
            staging.rename(self.version_dir(version))
            self._record(version, manifest.files)
        return weight_delta.checkpoint_bytes(manifest.files) + self.run.size(f"{version_prefix(version)}/{MANIFEST}")

    @contextmanager
    def _staging(self) -> Iterator[Path]:
        """A fresh dir beside the version dirs, removed unless renamed into place."""
        staging = self.root / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            yield staging
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def _drop_staging(self) -> None:
        """Left by a process killed while building (only builders write them, under the exclusive lock)."""
        for path in self.root.glob(f"{STAGING_PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)

    def _evict(self, keep: int) -> None:
        versions = self.cached_versions()
        kept = {*versions[-KEEP_VERSIONS:], keep}
        for version in versions:
            if version not in kept:
                self._drop(version)

    @contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_NAME, "a+b") as lock:
            try:
                fcntl.flock(lock.fileno(), mode)
            except OSError as err:
                raise MoerlError(
                    f"{self.root / LOCK_NAME}: cannot lock the node's weight cache ({err}); set {CACHE_ENV} to a "
                    "local directory that supports flock"
                ) from err
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _is_version_name(name: str) -> bool:
    try:
        parse_version(name)
    except MoerlError:
        return False
    return True


def _timed_update(engine: Engine, model_dir: Path) -> float:
    """engine.update_weights(model_dir); its seconds."""
    began = time.perf_counter()
    engine.update_weights(model_dir)
    return time.perf_counter() - began
