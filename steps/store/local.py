"""The run store's local backend: a directory on local disk (steps/store/object_store.py's module docstring says
how writes are atomic and where the digest sidecar lives), and the local-file helpers Store uses too (hashing a
file, staging a file next to its target, naming the file and fix of an OSError).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from steps.errors import MoerlError
from steps.store.backend import CHUNK_BYTES, SIDECAR_PREFIX, TEMP_PREFIX, DigestSink, ObjectNotFound, join_key

# ---------------------------------------------------------------------------------------------------------
# Hashing and local files


def sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
    return hasher.hexdigest()


def _open_temp(directory: Path) -> tuple[Path, BinaryIO]:
    """A new temp file in `directory` (reserved name: list() ignores it), with the umask's permissions."""
    directory.mkdir(parents=True, exist_ok=True)
    while True:
        path = directory / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        return path, os.fdopen(fd, "w+b")


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: fsync the directory entry (not supported everywhere, hence best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def staged_file(path: Path, fill: Callable[[BinaryIO], None]) -> Iterator[Path]:
    """A temp file next to path, filled and fsynced; the caller renames it into place, else it is removed."""
    tmp, f = _open_temp(path.parent)
    try:
        with f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # still there only if it was not renamed


@contextlib.contextmanager
def local_errors(url: str, hint: str) -> Iterator[None]:
    """Turn an OSError on local disk into one MoerlError naming the file and the likely fix."""
    try:
        yield
    except MoerlError:
        raise
    except PermissionError as err:
        raise MoerlError(f"{url}: permission denied — use a directory you can write to") from err
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise MoerlError(f"{url}: no space left on device — free space or use another store") from err
        raise MoerlError(f"{url}: {err.strerror or err} — {hint}") from err


# ---------------------------------------------------------------------------------------------------------
# The backend


class LocalBackend:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = "file://" + root.as_posix()

    def child(self, prefix: str) -> LocalBackend:
        return LocalBackend(self.path(prefix))

    def path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def sidecar(self, path: Path) -> Path:
        """Where path's digest is kept: named by a hash of path's name, so that no glob of data files can
        match it (a name such as `.moerl-sha256-model.safetensors` would match `*.safetensors`)."""
        return path.with_name(SIDECAR_PREFIX + hashlib.sha256(path.name.encode()).hexdigest()[:32])

    def old_sidecar(self, path: Path) -> Path:
        """The name sidecars had before (`.moerl-sha256-<name>`): read when there is no new one."""
        return path.with_name(SIDECAR_PREFIX + path.name)

    def _errors(self, key: str) -> contextlib.AbstractContextManager:
        return local_errors(
            join_key(self.uri, key) if key else self.uri,
            "check the store path; on local disk a key cannot be both an object and a prefix of other keys",
        )

    def _put(self, key: str, fill: Callable[[BinaryIO], None], sha: str) -> None:
        path = self.path(key)
        with self._errors(key):
            # Object and sidecar are staged in full first, so a failed write changes nothing. Then the
            # sidecar is renamed into place just before the object, so an object never appears without its
            # digest. Only a crash between those two renames leaves the old bytes under the new digest,
            # which reads as corrupted (safe) until the object is rewritten. Sidecars are sha256sum lines.
            sidecar, digest_line = self.sidecar(path), f"{sha}  {path.name}\n".encode()
            with (
                staged_file(path, fill) as staged,
                staged_file(sidecar, lambda f: f.write(digest_line)) as staged_digest,
            ):
                os.replace(staged_digest, sidecar)
                os.replace(staged, path)
            with contextlib.suppress(FileNotFoundError):  # the old-named digest of an older write is stale now
                self.old_sidecar(path).unlink()
            _fsync_dir(path.parent)

    def put_bytes(self, key: str, data: bytes, sha: str) -> None:
        self._put(key, lambda f: f.write(data), sha)

    def put_file(self, key: str, local_path: Path, sha: str) -> None:
        def copy(f: BinaryIO) -> None:
            with open(local_path, "rb") as src:
                shutil.copyfileobj(src, f, CHUNK_BYTES)

        self._put(key, copy, sha)

    def read_into(self, key: str, sink: DigestSink) -> str | None:
        path = self.path(key)
        with self._errors(key):
            try:
                f = open(path, "rb")
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise ObjectNotFound(f"{join_key(self.uri, key)}: no such object") from None
            with f:
                recorded = self._recorded(path)
                sink.reset()
                while chunk := f.read(CHUNK_BYTES):
                    sink.write(chunk)
        return recorded

    def _recorded(self, path: Path) -> str | None:
        for sidecar in (self.sidecar(path), self.old_sidecar(path)):
            try:
                return sidecar.read_text(errors="replace").split()[0]  # garbage reads as a mismatch
            except FileNotFoundError:
                continue
            except IndexError:
                return None
        return None

    def head(self, key: str) -> tuple[int, str | None] | None:
        path = self.path(key)
        with self._errors(key):
            if not path.is_file():
                return None
            return path.stat().st_size, self._recorded(path)

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix) if prefix else self.root
        keys = []
        with self._errors(prefix):
            for directory, _, files in os.walk(base):
                rel = Path(directory).relative_to(self.root).as_posix()
                keys.extend(name if rel == "." else f"{rel}/{name}" for name in files)
        return keys

    def delete(self, key: str) -> None:
        path = self.path(key)
        with self._errors(key):
            for victim in (path, self.sidecar(path), self.old_sidecar(path)):  # object first: no unverified object
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    victim.unlink()

    def delete_prefix(self, prefix: str) -> None:
        with self._errors(prefix):
            base = self.path(prefix)
            if base.is_dir():
                shutil.rmtree(base)

    def check_access(self) -> None:
        if self.root.exists():
            if not self.root.is_dir():
                raise MoerlError(f"{self.uri}: not a directory — point the store URI at a directory")
            if not os.access(self.root, os.R_OK | os.X_OK):
                raise MoerlError(f"{self.uri}: permission denied — make it readable or use another directory")
            return
        ancestor = self.root.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise MoerlError(f"{self.uri}: {ancestor} is a file, not a directory — choose another store path")
