"""What the run store (steps/store/object_store.py) and its two backends (local.py: a directory on local disk,
s3.py: an S3 prefix) share: the rules a key follows (Store checks every key before a backend sees it), the names
the store reserves for its own bookkeeping, the error for a key that holds no object, the digest sink a read
fills, and the Backend protocol both backends implement.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO, Protocol

from steps.errors import MoerlError

RESERVED_PREFIX = ".moerl-"  # names the store uses for its own bookkeeping (sidecars, temp files)
SIDECAR_PREFIX = RESERVED_PREFIX + "sha256-"
TEMP_PREFIX = RESERVED_PREFIX + "tmp-"
CHUNK_BYTES = 1 << 20  # streaming granularity for hashing, copying and downloading


class ObjectNotFound(MoerlError, FileNotFoundError):
    """The key holds no object. A MoerlError (message names the URL) that is also a FileNotFoundError."""


# ---------------------------------------------------------------------------------------------------------
# Keys


def check_key(key: str, what: str = "key") -> str:
    """A key is relative and '/'-separated, with no empty, '.', '..' or reserved segments."""
    if not isinstance(key, str) or not key:
        raise MoerlError(f"store {what} {key!r}: must be a non-empty relative path like 'a/b.json'")
    problem = None
    if key.startswith("/"):
        problem = "is absolute"
    elif "\\" in key:
        problem = "contains a backslash"
    elif "\x00" in key:
        problem = "contains a NUL byte"
    else:
        for segment in key.split("/"):
            if segment == "":
                problem = "has an empty segment ('//' or a trailing '/')"
            elif segment in (".", ".."):
                problem = f"has a '{segment}' segment"
            elif segment.startswith(RESERVED_PREFIX):
                problem = f"uses the reserved name prefix {RESERVED_PREFIX!r}"
            if problem:
                break
    if problem:
        raise MoerlError(
            f"store {what} {key!r} {problem}; keys are relative '/'-separated paths below the store root "
            "(like 'checkpoints/v000001/config.json') and can never leave it"
        )
    return key


def check_prefix(prefix: str) -> str:
    """A prefix is '' (the whole store) or a key, optionally with a trailing '/'; returned without it."""
    if prefix == "":
        return ""
    if not isinstance(prefix, str):
        raise MoerlError(f"store prefix {prefix!r}: must be a string like 'checkpoints/'")
    return check_key(prefix[:-1] if prefix.endswith("/") else prefix, what="prefix")


def join_key(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def is_visible(key: str) -> bool:
    """Whether a raw key found in the backend is a user object (not bookkeeping, not unaddressable)."""
    try:
        check_key(key)
    except MoerlError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Reads


class DigestSink:
    """A file being filled with downloaded bytes while they are hashed; reset() starts a retry afresh."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.reset()

    def reset(self) -> None:
        self.file.seek(0)
        self.file.truncate()
        self.hasher = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.hasher.update(chunk)
        self.file.write(chunk)

    def hexdigest(self) -> str:
        return self.hasher.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# The backends' protocol: each works on keys that Store has already validated, relative to the backend's root.


class Backend(Protocol):
    """A directory on local disk (local.LocalBackend) or an S3 prefix (s3.S3Backend)."""

    uri: str

    def child(self, prefix: str) -> Backend: ...

    def put_bytes(self, key: str, data: bytes, sha: str) -> None: ...

    def put_file(self, key: str, local_path: Path, sha: str) -> None: ...

    def read_into(self, key: str, sink: DigestSink) -> str | None:
        """Fill sink with the object's bytes; return the sha256 recorded when it was written (None: none)."""
        ...

    def head(self, key: str) -> tuple[int, str | None] | None:
        """(size, recorded sha256) of the object, None when the key holds none."""
        ...

    def list(self, prefix: str) -> list[str]: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...

    def check_access(self) -> None: ...
