"""Weight deltas: a published version as a lossless, compressed difference against its parent (issue 21).

    <run>/deltas/v000003/model.safetensors.delta      one blob per safetensors file of v000003
    <run>/deltas/v000003/DELTA.json                   written LAST: the index below

What a blob holds, for one safetensors file of v(i): the file's header (its 8-byte length and JSON table) and
then, tensor by tensor in the order of the file's data, the XOR of the tensor's stored bit pattern with the
bit pattern of v(i-1)'s tensor of the same name (as int16 lanes for bf16/fp16, int32 for fp32), its bytes
regrouped by significance (byte planes: every lane's first byte, then every second byte, ...) and compressed
with zstd (pyarrow.compress), each segment on its own. XOR makes it exact: parent ^ delta is v(i)'s bits,
whatever the arithmetic that made them. The planes make it small: an AdamW step moves the low mantissa bits
of a fp32 weight and leaves its sign, exponent and high mantissa alone, so those planes are runs of zeros;
at an RL learning rate most bf16 weights do not move at all and their XOR is zero (bench/weight_update.py).
A tensor its parent lacks, or holds in another dtype or shape, is stored XORed with nothing: as itself.

DELTA.json: the version and its parent; per weight file its size and sha256 (those of v(i)'s MANIFEST.json),
where the header's segment lies and, per tensor, its name, dtype, shape, segment (offset, compressed size), the
size and sha256 of the bytes it rebuilds; the version's other files (config.json, tokenizer, the shard index:
small) by size and sha256, each stored whole under deltas/v(i)/files/ (`copies`); the blobs' total size against
the whole checkpoint's. So the index lists every file v(i)'s MANIFEST.json lists, and the parent's weights with
the delta rebuild the whole version: before v(i) is published, too.

A version is usable from its delta before it is published. The update writes the blobs, the writer of each
weight file (one of its EP rank's dp replicas: steps/training/candidate_writer.py writer_plan) that file's
(write_file_delta, against the bits of v(i-1) it started from, held in memory: StoredTensors), so the bytes are
read and written in parallel across the trainer's nodes, and each file's tensors encoded on the writer's share
of its node's cores (encode_threads); once the weights are complete (after CANDIDATE.json; a trainer that stays
up: after WEIGHTS.json, before it answers), the update indexes them
(steps/training/publication.py index_candidate: the blobs checked against the candidate's marker, the other
files as publish will publish them, DELTA.json last). Rollout servers may then take v(i) while publish still
writes the full checkpoint (the workflow's rollout of the next iteration waits for the update, not for publish:
pipelines/workflow/graph.py). An indexed version is final: publish publishes exactly the files DELTA.json
lists or fails, and the update refuses to train its iteration again (samples may have been generated with it).
LATEST, retention and recovery still move only with MANIFEST.json. A candidate without blobs (or whose blobs
do not describe its files) gets its delta from publish itself (write_delta: reads both versions), before
MANIFEST.json, so a published version's delta is complete or absent. Retention deletes a delta with its
version. Written only where read: runs with rollout servers and checkpoint.deltas (wanted). Readers: no delta
(none written, or an unfinished one without DELTA.json) is not an error, the reader fetches the full
checkpoint; a corrupt one (a blob the store finds corrupted, a segment that does not rebuild its sha256, a
file that does not rebuild its recorded digest) raises DeltaUnusable and the reader falls back the same way,
or, for a version not published yet, waits for it (steps/engines/weight_sync.py).
Nothing is unpickled: a safetensors header is JSON, read here directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

import numpy as np
import pyarrow as pa

from steps.errors import MoerlError
from steps.run import checkpoint
from steps.run.keys import delta_blob_key, delta_copy_key, delta_index_key, delta_prefix, version_name, version_prefix
from steps.store.object_store import Store

if TYPE_CHECKING:
    from steps.run.config import RunConfig

FORMAT = 2  # 2: the version's other files are stored beside the blobs (copies)
CODEC = "zstd"
TRANSFORM = "xor-byteplanes"
WEIGHTS_SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
LANES = {"F32": np.dtype(np.int32), "BF16": np.dtype(np.int16), "F16": np.dtype(np.int16)}
BYTES = np.dtype(np.uint8)  # the header, and any dtype without lanes above


class DeltaUnusable(MoerlError):
    """This delta cannot rebuild its version (missing, stale or corrupt): fetch the full checkpoint instead."""


# ------------------------------------------------------------------------------------ safetensors layout


@dataclass(frozen=True)
class TensorSpan:
    name: str
    dtype: str  # safetensors code: F32, BF16, F16, ...
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


@dataclass(frozen=True)
class Layout:
    """A safetensors file as bytes: its header, then its tensors back to back in data order."""

    path: Path
    header: bytes  # the 8-byte length and the JSON table
    tensors: list[TensorSpan]


def read_layout(path: Path) -> Layout:
    """The header and tensor spans of a safetensors file; refuses one whose tensors do not tile its data."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise MoerlError(f"{path}: not a safetensors file (header length {length}); re-save it")
        table_bytes = f.read(length)
    try:
        table = json.loads(table_bytes)
        data_start = 8 + length
        spans = [
            TensorSpan(
                str(name),
                str(meta["dtype"]),
                tuple(int(d) for d in meta["shape"]),
                data_start + int(meta["data_offsets"][0]),
                data_start + int(meta["data_offsets"][1]),
            )
            for name, meta in table.items()
            if name != "__metadata__"
        ]
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
        raise MoerlError(f"{path}: unreadable safetensors header ({err!r}); re-save it") from err
    spans.sort(key=lambda s: (s.start, s.end))
    position = data_start
    for span in spans:
        if span.start != position or span.end < span.start:
            raise MoerlError(f"{path}: tensor {span.name}'s bytes do not follow the previous tensor's; re-save it")
        position = span.end
    if position != size:
        raise MoerlError(f"{path}: {size - position} bytes after the last tensor; re-save it")
    return Layout(path, prefix + table_bytes, spans)


class TensorReader:
    """The stored bytes of a checkpoint dir's tensors, by name (its top-level safetensors files)."""

    def __init__(self, directory: Path) -> None:
        self.spans: dict[str, TensorSpan] = {}
        self.files: dict[str, Path] = {}
        for path in sorted(Path(directory).glob(f"*{WEIGHTS_SUFFIX}")):
            for span in read_layout(path).tensors:
                self.spans[span.name], self.files[span.name] = span, path
        self._stack = ExitStack()
        self._open: dict[Path, BinaryIO] = {}

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def read(self, name: str, dtype: str, shape: tuple[int, ...]) -> bytes | None:
        """The tensor's bytes if this dir holds it with that dtype and shape, else None."""
        span = self.spans.get(name)
        if span is None or (span.dtype, span.shape) != (dtype, shape):
            return None
        path = self.files[name]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(open(path, "rb"))
        f = self._open[path]
        f.seek(span.start)
        return f.read(span.end - span.start)


class StoredTensors:
    """The stored bytes of tensors held in memory, by name: what TensorReader reads from a dir, for a rank
    that holds the version it started from (name -> (safetensors dtype code, shape, bytes))."""

    def __init__(self, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
        self.tensors = tensors

    def read(self, name: str, dtype: str, shape: tuple[int, ...]) -> bytes | None:
        held = self.tensors.get(name)
        return held[2] if held is not None and (held[0], held[1]) == (dtype, shape) else None


class ParentTensors(Protocol):
    def read(self, name: str, dtype: str, shape: tuple[int, ...]) -> bytes | None: ...


def wanted(cfg: RunConfig) -> bool:
    """Whether a run writes deltas: only rollout servers read them (checkpoint.deltas and rollout.servers)."""
    return cfg.checkpoint.deltas and cfg.rollout.servers > 0


# ------------------------------------------------------------------------------------ one segment


def _lanes(dtype: str, nbytes: int) -> np.dtype:
    lanes = LANES.get(dtype, BYTES)
    return lanes if nbytes % lanes.itemsize == 0 else BYTES


def encode(new: bytes, old: bytes | None, dtype: str) -> bytes:
    """zstd(byte planes(new ^ old)), old None: of new itself."""
    lanes = _lanes(dtype, len(new))
    x = np.frombuffer(new, dtype=lanes)
    if old is not None:
        x = x ^ np.frombuffer(old, dtype=lanes)
    planes = np.ascontiguousarray(x.view(BYTES).reshape(-1, lanes.itemsize).T)
    return pa.compress(planes, codec=CODEC, asbytes=True)


def decode(segment: bytes, size: int, old: bytes | None, dtype: str) -> bytes:
    """The inverse of encode; raises DeltaUnusable when the segment does not decompress to `size` bytes."""
    lanes = _lanes(dtype, size)
    try:
        raw = pa.decompress(segment, decompressed_size=size, codec=CODEC, asbytes=True)
    except (pa.ArrowException, ValueError, OSError) as err:
        raise DeltaUnusable(f"a segment does not decompress ({err})") from err
    if len(raw) != size:
        raise DeltaUnusable(f"a segment decompresses to {len(raw)} bytes, not {size}")
    x = np.ascontiguousarray(np.frombuffer(raw, dtype=BYTES).reshape(lanes.itemsize, -1).T).view(lanes).reshape(-1)
    if old is not None:
        x = x ^ np.frombuffer(old, dtype=lanes)
    return x.tobytes()


# ------------------------------------------------------------------------------------ the index


@dataclass(frozen=True)
class TensorDelta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its segment in the blob
    compressed: int  # the segment's size
    size: int  # the bytes it rebuilds
    xor: bool  # False: stored as itself (the parent has no such tensor of that dtype and shape)
    sha256: str  # of the bytes it rebuilds


@dataclass(frozen=True)
class FileDelta:
    size: int  # the rebuilt file's, as MANIFEST.json records it
    sha256: str
    blob_bytes: int
    header: tuple[int, int, int]  # offset, compressed size, size of the header's segment
    tensors: tuple[TensorDelta, ...]

    @classmethod
    def from_dict(cls, f: dict) -> FileDelta:
        """From its JSON form (DELTA.json's files, a candidate's weight_deltas); KeyError/ValueError/TypeError
        when it is not one."""
        return cls(
            size=int(f["size"]),
            sha256=str(f["sha256"]),
            blob_bytes=int(f["blob_bytes"]),
            header=tuple(int(v) for v in f["header"]),  # type: ignore[arg-type]
            tensors=tuple(
                TensorDelta(
                    str(t["name"]),
                    str(t["dtype"]),
                    tuple(int(d) for d in t["shape"]),
                    int(t["offset"]),
                    int(t["compressed"]),
                    int(t["size"]),
                    bool(t["xor"]),
                    str(t["sha256"]),
                )
                for t in f["tensors"]
            ),
        )


FileDigests = dict[str, dict[str, int | str]]  # file name -> {"size", "sha256"}, as MANIFEST.json lists them


def _digests(files: FileDigests) -> FileDigests:
    return {str(n): {"size": int(m["size"]), "sha256": str(m["sha256"])} for n, m in sorted(files.items())}


@dataclass(frozen=True)
class DeltaIndex:
    version: int
    parent: int
    files: dict[str, FileDelta]  # the weight files' blobs
    delta_bytes: int  # the blobs together
    full_bytes: int  # the whole checkpoint (every file of its MANIFEST.json)
    copies: FileDigests = field(default_factory=dict)  # the other files, stored whole (delta_copy_key)
    format: int = FORMAT
    codec: str = CODEC
    transform: str = TRANSFORM

    def version_files(self) -> FileDigests:
        """Every file of the version this delta rebuilds, as its MANIFEST.json lists (or will list) them."""
        weights = {name: {"size": f.size, "sha256": f.sha256} for name, f in self.files.items()}
        return _digests({**weights, **self.copies})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> DeltaIndex:
        try:
            raw = json.loads(text)
            if (raw["format"], raw["codec"], raw["transform"]) != (FORMAT, CODEC, TRANSFORM):
                raise ValueError(f"format {raw['format']} {raw['codec']} {raw['transform']}")
            files = {str(name): FileDelta.from_dict(f) for name, f in raw["files"].items()}
            copies = _digests(raw["copies"])
            return cls(
                int(raw["version"]), int(raw["parent"]), files, int(raw["delta_bytes"]), int(raw["full_bytes"]), copies
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise DeltaUnusable(f"{where}: unreadable delta index ({err!r})") from err

    def describes(self, version: int, files: FileDigests) -> bool:
        """Whether this delta rebuilds exactly these files (a version's MANIFEST.json files) of `version`."""
        return (self.version, self.parent) == (version, version - 1) and self.version_files() == _digests(files)


@dataclass(frozen=True)
class DeltaSummary:
    version: int
    parent: int
    tensors: int
    delta_bytes: int
    full_bytes: int

    @classmethod
    def of(cls, index: DeltaIndex) -> DeltaSummary:
        tensors = sum(len(f.tensors) for f in index.files.values())
        return cls(index.version, index.parent, tensors, index.delta_bytes, index.full_bytes)


def read_index(run: Store, version: int) -> DeltaIndex | None:
    """v(version)'s delta index, None when there is none (never written, or unfinished: DELTA.json comes last).
    Raises DeltaUnusable when it cannot be read or parsed."""
    key = delta_index_key(version)
    try:
        if not run.exists(key):
            return None
        return DeltaIndex.from_json(run.get_bytes(key), run.url(key))
    except DeltaUnusable:
        raise
    except MoerlError as err:
        raise DeltaUnusable(f"{run.url(key)}: {err}") from err


# ------------------------------------------------------------------------------------ writing


# At most this many bytes of a file's tensors between being read and their segments being written, so that the
# encoder's threads never hold more than about twice it (the new bytes and the parent's).
ENCODE_WINDOW_BYTES = 1 << 30


def encode_threads() -> int:
    """The encoder's threads: this process's share of the machine's cores: the cores it may run on (its CPU
    affinity, at most the container's CPU quota), shared with the other LOCAL_WORLD_SIZE ranks torchrun starts on
    the node unless its affinity already pins it to its own. numpy's XOR and transpose, zstd and sha256 release
    the GIL, so tensors encode in parallel; the blob is the same whatever the count (segments are written in the
    file's order)."""
    machine = os.cpu_count() or 1
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    quota = _cpu_quota()
    pinned = cores <= machine // ranks  # cores of its own, not the cpuset every rank of the node shares
    if quota is not None:  # the container's, over all its ranks
        cores = min(cores, quota)
    return max(1, cores if pinned else cores // ranks)


def _cpu_quota() -> int | None:
    """The container's CPU quota in whole cores (cgroup v2 cpu.max, else v1 cpu.cfs_quota_us), None when unlimited
    or unknown."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text().strip()
            period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit():
        return None
    return max(1, int(quota) // max(1, int(period)))


def _encoded(new: bytes, old: bytes | None, dtype: str) -> tuple[bytes, str]:
    return encode(new, old, dtype), hashlib.sha256(new).hexdigest()


def _write_blob(
    layout: Layout, parent: ParentTensors, out: Path, file_sha256: str | None = None, threads: int | None = None
) -> tuple[tuple[int, int, int], list[TensorDelta], str]:
    """Write one safetensors file's blob; returns (header segment, tensor entries, sha256 of the file's bytes).
    The tensors are read here in order and encoded on `threads` threads (encode_threads), their segments
    written in order. file_sha256: the file's digest when the caller has it (its upload hashed it), else hashed
    here on the way."""
    digest = hashlib.sha256() if file_sha256 is None else None
    tensors: list[TensorDelta] = []
    offset, in_flight = 0, 0
    threads = threads or encode_threads()
    pending: deque[tuple[TensorSpan, bool, Future[tuple[bytes, str]]]] = deque()
    with open(out, "wb") as blob, open(layout.path, "rb") as src, ThreadPoolExecutor(threads) as pool:

        def segment(data: bytes) -> tuple[int, int]:
            nonlocal offset
            blob.write(data)
            offset += len(data)
            return offset - len(data), len(data)

        def write_oldest() -> None:
            nonlocal in_flight
            span, xor, future = pending.popleft()
            data, sha = future.result()
            start, length = segment(data)
            size = span.end - span.start
            in_flight -= size
            tensors.append(TensorDelta(span.name, span.dtype, span.shape, start, length, size, xor, sha))

        if digest is not None:
            digest.update(layout.header)
        header = (*segment(encode(layout.header, None, "")), len(layout.header))
        try:
            for span in layout.tensors:
                src.seek(span.start)
                new = src.read(span.end - span.start)
                if len(new) != span.end - span.start:
                    raise MoerlError(f"{layout.path}: {span.name} is cut short ({len(new)} bytes read); write it again")
                if digest is not None:
                    digest.update(new)
                old = parent.read(span.name, span.dtype, span.shape)
                pending.append((span, old is not None, pool.submit(_encoded, new, old, span.dtype)))
                in_flight += len(new)
                while pending and (in_flight > ENCODE_WINDOW_BYTES or len(pending) > 4 * threads):
                    write_oldest()
            while pending:
                write_oldest()
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the queued tensors are not encoded for nothing
            raise
    return header, tensors, digest.hexdigest() if digest is not None else str(file_sha256)


def write_delta(
    run: Store,
    version: int,
    new_dir: Path | None = None,
    parent_dir: Path | None = None,
    log: Callable[[str], None] = print,
) -> DeltaSummary | None:
    """Write v(version)'s delta against v(version-1): the blobs, then DELTA.json. Returns None for v000000
    (no parent) or when the parent is not published (nothing to rebuild from).

    new_dir: v(version)'s checkpoint dir (publish passes the one it is about to publish; default: the published
    version, fetched); parent_dir: v(version-1)'s (default: fetched, verified, from the local cache).
    Idempotent: a complete delta that describes these files is kept; a stale or unfinished one is replaced.
    """
    if version < 1:
        return None
    new_dir = Path(new_dir) if new_dir is not None else checkpoint.fetch(run, version)
    files = checkpoint.describe_dir(new_dir)
    try:
        existing = read_index(run, version)
    except DeltaUnusable as err:
        log(f"warning: {err}; rewriting the delta of {version_name(version)}")
        existing = None
    if existing is not None and existing.describes(version, files) and blobs_stored(run, existing):
        return DeltaSummary.of(existing)
    if checkpoint.read_manifest(run, version - 1) is None:
        log(f"no delta for {version_name(version)}: its parent {version_name(version - 1)} is not published")
        return None
    parent_dir = Path(parent_dir) if parent_dir is not None else checkpoint.fetch(run, version - 1)
    run.delete(delta_index_key(version))  # first: a half-replaced delta reads as unfinished
    run.delete_prefix(delta_prefix(version))
    deltas: dict[str, FileDelta] = {}
    with TensorReader(parent_dir) as parent:
        for name in sorted(n for n in files if is_weight_file(n)):
            deltas[name] = write_file_delta(run, version, name, new_dir / name, parent)
            if deltas[name].sha256 != files[name]["sha256"]:
                raise MoerlError(f"{new_dir / name}: changed while its delta was written; publish again")
    copies = {name: (new_dir / name).read_bytes() for name in files if not is_weight_file(name)}
    if write_copies(run, version, copies) != {n: m for n, m in _digests(files).items() if n in copies}:
        raise MoerlError(f"{new_dir}: a file changed while the delta was written; publish again")
    return write_index(run, version, deltas, copies, files)


def is_weight_file(name: str) -> bool:
    """A file the delta holds as a blob (a top-level safetensors file); the others are copied whole."""
    return "/" not in name and name.endswith(WEIGHTS_SUFFIX)


def write_copies(run: Store, version: int, copies: dict[str, bytes]) -> FileDigests:
    """Store v(version)'s other files whole beside its delta; returns their digests as stored."""
    return {name: {"size": len(data), "sha256": run.put_bytes(delta_copy_key(version, name), data)}
            for name, data in sorted(copies.items())}  # fmt: skip


def copy_digests(copies: dict[str, bytes]) -> FileDigests:
    """Size and sha256 of each file kept whole, as MANIFEST.json lists them."""
    digests: FileDigests = {}
    for name, data in copies.items():
        size, sha = checkpoint.bytes_digest(data)
        digests[name] = {"size": size, "sha256": sha}
    return digests


def write_file_delta(
    run: Store, version: int, name: str, path: Path, parent: ParentTensors, file_sha256: str | None = None
) -> FileDelta:
    """Write the blob of v(version)'s weight file `name` (the local file `path`) against `parent`'s tensors;
    file_sha256: the file's sha256 when the caller has it (else hashed here)."""
    with tempfile.TemporaryDirectory(prefix="moerl-delta-") as tmp:
        blob = Path(tmp) / "blob"
        header, tensors, sha = _write_blob(read_layout(path), parent, blob, file_sha256)
        run.put_file(delta_blob_key(version, name), blob)
        return FileDelta(path.stat().st_size, sha, blob.stat().st_size, header, tuple(tensors))


def write_index(
    run: Store, version: int, deltas: dict[str, FileDelta], copies: dict[str, bytes], files: FileDigests
) -> DeltaSummary:
    """DELTA.json, last: the blobs of `deltas` and the stored `copies` rebuild `files` (v(version)'s, as its
    MANIFEST.json will list them)."""
    index = _index(version, deltas, copy_digests(copies), files)
    if not index.describes(version, files):
        raise MoerlError(f"the delta of {version_name(version)} does not describe its files; publish again")
    run.put_bytes(delta_index_key(version), index.to_json().encode())
    return DeltaSummary.of(index)


def _index(version: int, deltas: dict[str, FileDelta], copies: FileDigests, files: FileDigests) -> DeltaIndex:
    return DeltaIndex(
        version=version,
        parent=version - 1,
        files=dict(sorted(deltas.items())),
        delta_bytes=sum(f.blob_bytes for f in deltas.values()),
        full_bytes=checkpoint_bytes(files),
        copies=_digests(copies),
    )


def blobs_stored(run: Store, index: DeltaIndex) -> bool:
    """Whether every blob the index names is in the store at its size (nothing is read)."""
    for name, delta in index.files.items():
        key = delta_blob_key(index.version, name)
        if not run.exists(key) or run.size(key) != delta.blob_bytes:
            return False
    return True


def file_deltas(written: dict[str, dict] | None) -> dict[str, FileDelta] | None:
    """The blobs a candidate's marker lists (weight_deltas, JSON), by published file name; None when it lists
    none or they cannot be read."""
    if not written:
        return None
    try:
        return {str(name): FileDelta.from_dict(f) for name, f in written.items()}
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def adopt(
    run: Store, version: int, files: FileDigests, deltas: dict[str, FileDelta] | None, copies: dict[str, bytes]
) -> DeltaSummary | None:
    """Index the blobs an update wrote (`deltas`, by published file name): the other files (`copies`, by name)
    stored whole, then DELTA.json, if the blobs and copies describe exactly `files` (v(version)'s files as its
    MANIFEST.json lists or will list them) and every blob is stored at its size; else None (the caller writes
    the delta itself). Nothing is read but the blobs' sizes."""
    if not deltas:
        return None
    index = _index(version, deltas, copy_digests(copies), files)
    if not index.describes(version, files) or not blobs_stored(run, index):
        return None
    write_copies(run, version, copies)
    run.put_bytes(delta_index_key(version), index.to_json().encode())
    return DeltaSummary.of(index)


# ------------------------------------------------------------------------------------ reading


def _rebuild(run: Store, version: int, name: str, delta: FileDelta, parent: TensorReader, target: Path) -> int:
    """Rebuild one safetensors file of v(version) at target; returns the blob's size."""
    key = delta_blob_key(version, name)
    with tempfile.TemporaryDirectory(prefix=".moerl-delta-", dir=target.parent) as tmp:
        blob_path = Path(tmp) / "blob"
        try:
            run.get_file(key, blob_path)
        except MoerlError as err:  # missing, or the store's own sha256 check failed
            raise DeltaUnusable(f"{run.url(key)}: {err}") from err
        if blob_path.stat().st_size != delta.blob_bytes:
            raise DeltaUnusable(f"{run.url(key)}: {blob_path.stat().st_size} bytes, DELTA.json says {delta.blob_bytes}")
        digest = hashlib.sha256()
        with open(blob_path, "rb") as blob, open(target, "wb") as out:

            def read(offset: int, length: int) -> bytes:
                blob.seek(offset)
                return blob.read(length)

            header = decode(read(delta.header[0], delta.header[1]), delta.header[2], None, "")
            out.write(header)
            digest.update(header)
            for t in delta.tensors:
                old = parent.read(t.name, t.dtype, t.shape) if t.xor else None
                if t.xor and old is None:
                    raise DeltaUnusable(f"{run.url(key)}: the parent dir has no {t.dtype} {list(t.shape)} {t.name}")
                new = decode(read(t.offset, t.compressed), t.size, old, t.dtype)
                if hashlib.sha256(new).hexdigest() != t.sha256:
                    raise DeltaUnusable(f"{run.url(key)}: tensor {t.name} does not rebuild its sha256")
                out.write(new)
                digest.update(new)
    if digest.hexdigest() != delta.sha256:
        raise DeltaUnusable(f"{run.url(key)}: {name} does not rebuild the sha256 of MANIFEST.json")
    return delta.blob_bytes


def read_copy(run: Store, version: int, name: str, meta: dict[str, int | str]) -> bytes:
    """One of v(version)'s other files from beside its delta, checked against `meta` (size and sha256)."""
    key = delta_copy_key(version, name)
    try:
        data = run.get_bytes(key)
    except MoerlError as err:  # missing, or the store's own sha256 check failed
        raise DeltaUnusable(f"{run.url(key)}: {err}") from err
    if checkpoint.bytes_digest(data) != (meta["size"], meta["sha256"]):
        raise DeltaUnusable(f"{run.url(key)}: its size or sha256 differs from DELTA.json")
    return data


def apply_delta(run: Store, version: int, parent_dir: Path, out_dir: Path, index: DeltaIndex | None = None) -> int:
    """Rebuild version `version` in the empty dir out_dir from parent_dir (a verified dir of v(version-1)) and
    the version's delta: every file DELTA.json lists, each checked against its sha256; a published version's
    delta must describe its MANIFEST.json. Returns the bytes read from the store. Raises DeltaUnusable when the
    delta is missing, stale or corrupt (out_dir then holds a partial copy: the caller discards it)."""
    key = delta_index_key(version)
    index = index if index is not None else read_index(run, version)
    if index is None:
        raise DeltaUnusable(f"{run.url(key)}: no delta")
    manifest = checkpoint.read_manifest(run, version)
    if manifest is not None and not index.describes(version, manifest.files):
        raise DeltaUnusable(f"{run.url(key)}: stale: it does not describe {version_name(version)}'s MANIFEST.json")
    fetched = run.size(key)
    out_dir, parent_dir = Path(out_dir), Path(parent_dir)
    with TensorReader(parent_dir) as parent:
        for name, meta in index.version_files().items():
            target = out_dir / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if name in index.files:
                fetched += _rebuild(run, version, name, index.files[name], parent, target)
                continue
            data = read_copy(run, version, name, meta)
            target.write_bytes(data)
            fetched += len(data)
    return fetched


# ------------------------------------------------------------------------------------ a usable version


def version_files(run: Store, version: int) -> FileDigests | None:
    """The files of a version that can be read: its MANIFEST.json's when it is published, else its DELTA.json's
    when the update indexed it (usable from its delta before it is published); None otherwise (an unreadable
    DELTA.json included: the version is then usable once it is published)."""
    manifest = checkpoint.read_manifest(run, version)
    if manifest is not None:
        return manifest.files
    try:
        index = read_index(run, version)
    except DeltaUnusable:
        return None
    return None if index is None else index.version_files()


def require_version_files(run: Store, version: int) -> FileDigests:
    """version_files, or the error that says the version is neither published nor indexed."""
    files = version_files(run, version)
    if files is None:
        raise not_usable(run, version)
    return files


def not_usable(run: Store, version: int) -> MoerlError:
    """The error for a version that is neither published nor indexed (version_files is None)."""
    key = delta_index_key(version)
    why = "unreadable" if run.exists(key) else "absent"
    return MoerlError(
        f"{run.url(version_prefix(version))}: {version_name(version)} is neither published (no MANIFEST.json) "
        f"nor indexed ({run.url(key)} {why}); run its update (which indexes a complete candidate again), or its "
        "publish"
    )


def read_version_file(run: Store, version: int, name: str) -> bytes:
    """One file of a usable version (its tokenizer, its config.json): from the published checkpoint, else from
    beside its delta; checked against the digest its MANIFEST.json or DELTA.json records."""
    if checkpoint.read_manifest(run, version) is not None:
        return checkpoint.read_file(run, version, name)
    index = read_index(run, version)
    if index is None:
        raise not_usable(run, version)
    meta = index.version_files().get(name)
    if meta is None or name in index.files:
        raise MoerlError(f"{run.url(delta_index_key(version))}: {version_name(version)} has no small file {name}")
    return read_copy(run, version, name, meta)


def fetch_version(run: Store, version: int) -> Path:
    """A usable version's dir in the local cache: the published checkpoint (checkpoint.fetch), else rebuilt
    from its published parent and its delta, every file checked against DELTA.json (a cached rebuild too)."""
    if checkpoint.read_manifest(run, version) is not None:
        return checkpoint.fetch(run, version)
    index = read_index(run, version)
    if index is None:
        raise not_usable(run, version)
    target = checkpoint.cache_dir_for(run, version)
    if target.is_dir() and checkpoint.describe_dir(target) == index.version_files():
        return target
    # the parent is published, or indexed in turn (a trainer that stays up trains on before publish): from the
    # nearest published ancestor, at most two versions back (pipelines/workflow/graph.py)
    parent = fetch_version(run, version - 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".moerl-rebuild-", dir=target.parent) as tmp:
        staging = Path(tmp) / "version"
        staging.mkdir()
        apply_delta(run, version, parent, staging, index)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def checkpoint_bytes(files: FileDigests) -> int:
    """The bytes of a version's files (its MANIFEST.json's or DELTA.json's)."""
    return sum(int(meta["size"]) for meta in files.values())


def describe(summary: DeltaSummary | None) -> str:
    """One line for the publish step's log."""
    if summary is None:
        return "no delta"
    share = summary.delta_bytes / max(summary.full_bytes, 1)
    return (
        f"delta of {version_name(summary.version)} against {version_name(summary.parent)}: "
        f"{summary.delta_bytes / 1e6:.1f} MB for {summary.tensors} tensors, {share:.1%} of the "
        f"{summary.full_bytes / 1e6:.1f} MB checkpoint"
    )
