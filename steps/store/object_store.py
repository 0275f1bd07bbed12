"""The run store: one small object-store API over a local directory or an S3 prefix (the backends: local.py and
s3.py beside this file; what they share with Store, keys and ObjectNotFound among it: backend.py).

    store = Store.open("s3://bucket/runs/r1")      # or "file:///abs/dir", or a plain path
    sha = store.put_bytes("metrics/iter-000001.json", data)
    data = store.get_bytes("metrics/iter-000001.json")   # verified against the recorded sha256

Keys are relative, '/'-separated paths below the store's root; a key can never leave the root.

Atomic publication: no reader ever sees a half-written object.
  - local: the bytes go to a temp file in the target directory, are fsynced, then os.replace()d into place.
  - S3: one PUT, or a multipart upload that S3 publishes only when it is completed (s3fs aborts it on
    failure); the final key is never written incrementally.

Digests: every write records the object's sha256 and every read verifies it.
  - S3: user metadata `x-amz-meta-sha256`, sent in the same PUT (or CreateMultipartUpload), and read back
    from the very GET response that carries the bytes, so digest and bytes always belong together.
  - local: a sidecar `.moerl-sha256-<hash of name>` in the same directory (a sha256sum line naming the
    object), renamed into place just before the object. Its name holds no part of the object's name, so
    no data pattern (`*.safetensors`, `model*.safetensors*`, `*model*`) globs it; sidecars written
    before as `.moerl-sha256-<name>` are still read, and replaced or deleted with their object. A reader
    that lands between those two renames of an overwrite sees a mismatch, so a mismatch is re-read a few
    times before it is reported; a persistent one is corruption.
  Objects written by other tools carry no digest and read unverified. Names starting with `.moerl-` are
  reserved for this bookkeeping: list() hides them and keys may not use them.

Retries (S3 only; local errors are never transient):
  - botocore retries each HTTP request ("standard" mode, 3 attempts, unless AWS_MAX_ATTEMPTS /
    AWS_RETRY_MODE say otherwise): cheap per-request retries, e.g. for one part of a multipart upload.
  - s3fs's own retry loop is switched off, so attempts do not multiply across three layers.
  - ours: RetryPolicy (s3.py) retries a whole store operation on transient errors (throttling, 5xx, request
    timeouts, connections reset or closed mid-request, read timeouts) with capped exponential backoff and
    full jitter. Permanent errors (4xx such as NoSuchBucket or AccessDenied, no route to the endpoint,
    missing credentials) fail at once as one MoerlError that names the URI and the fix.

S3 endpoint, region and credentials come from the standard AWS sources as botocore reads them:
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE, ~/.aws/config and ~/.aws/credentials, and
IRSA / EKS Pod Identity / instance profiles. s3fs listing caches are disabled so exists() and list() always
see the current state of the bucket.
"""


from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, BinaryIO

from steps.errors import MoerlError
from steps.store.backend import (
    RESERVED_PREFIX,
    Backend,
    DigestSink,
    ObjectNotFound,
    check_key,
    check_prefix,
    is_visible,
    join_key,
)
from steps.store.local import LocalBackend, local_errors, sha256_file, staged_file
from steps.store.s3 import RetryPolicy, S3Backend

# A digest mismatch is re-read this many times before it is called corruption (see module docstring).
MISMATCH_REREAD_DELAYS_S = (0.02, 0.1, 0.3)

ACCEPTED_FORMS = "a local path (runs/r1 or /abs/runs/r1), file:///abs/runs/r1, or s3://bucket[/prefix]"


# ---------------------------------------------------------------------------------------------------------
# JSON


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def json_text(obj: Any, *, indent: int | None = 2) -> str:
    """obj as strict JSON (RFC 8259), one line per file's end: a float that is not finite (a metric with no
    value, such as the extreme of an empty set) is written null, since Python's `Infinity`/`NaN` tokens are
    refused by jq, browsers and most trackers."""
    return json.dumps(_finite(obj), indent=indent, sort_keys=True, allow_nan=False) + "\n"


# ---------------------------------------------------------------------------------------------------------
# URIs


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.DOTALL)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_IPV4 = re.compile(r"^\d+\.\d+\.\d+\.\d+$")
_BUCKET_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def _bad_uri(uri: str, problem: str) -> MoerlError:
    return MoerlError(f"store URI {uri!r}: {problem}; accepted forms: {ACCEPTED_FORMS}")


def _check_bucket(uri: str, bucket: str) -> None:
    problem = None
    if not bucket:
        problem = "names no bucket"
    elif bucket != bucket.lower():
        problem = f"bucket name {bucket!r} has upper-case letters (S3 bucket names are lower case)"
    elif not _BUCKET.match(bucket):
        problem = (
            f"bucket name {bucket!r} is not valid (3-63 characters: lower-case letters, digits, '.' and '-', "
            "starting and ending with a letter or digit)"
        )
    elif ".." in bucket or _IPV4.match(bucket):
        problem = f"bucket name {bucket!r} is not valid (no '..', not an IP address)"
    elif bucket.startswith(_BUCKET_RESERVED_PREFIXES) or bucket.endswith(_BUCKET_RESERVED_SUFFIXES):
        problem = f"bucket name {bucket!r} uses a prefix or suffix that S3 reserves"
    if problem:
        raise _bad_uri(uri, problem)


def _parse_uri(uri: str, retry: RetryPolicy) -> Backend:
    if not isinstance(uri, str) or not uri.strip():
        raise _bad_uri(str(uri), "is empty")
    if "\x00" in uri:
        raise _bad_uri(uri, "contains a NUL byte")
    match = _SCHEME.match(uri)
    if match is None:
        if re.match(r"^(s3|s3a|s3n|file):", uri, re.IGNORECASE):
            raise _bad_uri(uri, "is missing the '//' after the scheme")
        return LocalBackend(Path(os.path.abspath(os.path.expanduser(uri))))
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest:
            raise _bad_uri(uri, "names no path")
        # Like fsspec, 'file://runs/r1' is the relative path runs/r1; file:///abs is an absolute path.
        return LocalBackend(Path(os.path.abspath(os.path.expanduser(rest))))
    if scheme != "s3":
        hint = " (use s3:// for S3)" if scheme in ("s3a", "s3n") else ""
        raise _bad_uri(uri, f"scheme {scheme!r} is not supported{hint}")
    if "?" in rest or "#" in rest:
        raise _bad_uri(uri, "has a query or fragment; name the bucket and prefix only")
    bucket, _, prefix = rest.partition("/")
    _check_bucket(uri, bucket)
    prefix = prefix.rstrip("/")
    if prefix:
        try:
            check_key(prefix, what="prefix")
        except MoerlError as err:
            raise _bad_uri(uri, f"has a bad prefix ({err})") from None
    return S3Backend(bucket, prefix, retry)


# ---------------------------------------------------------------------------------------------------------
# The store


class Store:
    """An object store rooted at a URI. Construct with Store.open(uri)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.uri: str = backend.uri

    @classmethod
    def open(cls, uri: str, retry: RetryPolicy | None = None) -> Store:
        """Validate uri and return a Store on it. Cheap: no I/O; call check_access() to fail early."""
        return cls(_parse_uri(uri, retry or RetryPolicy()))

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def child(self, prefix: str) -> Store:
        """The store rooted at root/prefix (shares connections with this one)."""
        prefix = check_prefix(prefix)
        if not prefix:
            raise MoerlError("Store.child(''): name a prefix like 'checkpoints'")
        return Store(self._backend.child(prefix))

    def url(self, key: str) -> str:
        return f"{self.uri}/{check_key(key)}"

    def check_access(self) -> None:
        """Fail early (one MoerlError naming the URI and the fix) if the store's root cannot be listed."""
        self._backend.check_access()

    # -- writes ---------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> str:
        """Atomically write data at key, record its sha256 with it, and return the digest (hex)."""
        key = check_key(key)
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        self._backend.put_bytes(key, data, sha)
        return sha

    def put_file(self, key: str, local_path: str | os.PathLike) -> str:
        """Atomically upload a local file at key; returns its sha256 (hex)."""
        key = check_key(key)
        local_path = Path(local_path)
        if not local_path.is_file():
            raise MoerlError(f"{local_path}: not a file — cannot upload it to {self.url(key)}")
        sha = sha256_file(local_path)  # first, so that it can travel with the upload
        self._backend.put_file(key, local_path, sha)
        return sha

    def put_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, json_text(obj).encode())

    def upload_dir(self, local_dir: str | os.PathLike, prefix: str) -> dict[str, tuple[int, str]]:
        """Upload each file below local_dir to prefix/<path>; returns {path: (size, sha256)}.

        Paths are relative to local_dir, '/'-separated. Files named like the store's own bookkeeping
        (.moerl-*) are skipped, so a local store's directory uploads cleanly.
        """
        local_dir, prefix = Path(local_dir), check_prefix(prefix)
        if not local_dir.is_dir():
            raise MoerlError(f"{local_dir}: not a directory — cannot upload it to {self.uri}/{prefix}")
        uploaded = {}
        for directory, dirs, files in os.walk(local_dir):
            dirs.sort()
            for name in sorted(files):
                if name.startswith(RESERVED_PREFIX):
                    continue  # a local store's own bookkeeping (sidecars, temp files) is not content
                path = Path(directory) / name
                rel = path.relative_to(local_dir).as_posix()
                uploaded[rel] = (path.stat().st_size, self.put_file(join_key(prefix, rel), path))
        return uploaded

    # -- reads ----------------------------------------------------------------------------------------

    def _read_verified(self, key: str, file: BinaryIO, verify: bool) -> None:
        """Fill file with the object's bytes; raise if they do not match the recorded sha256."""
        for delay in (*MISMATCH_REREAD_DELAYS_S, None):
            sink = DigestSink(file)
            recorded = self._backend.read_into(key, sink)
            if not verify or recorded is None or recorded == sink.hexdigest():
                return
            if delay is not None:
                time.sleep(delay)  # maybe an overwrite in flight (local sidecar and object are two renames)
        raise MoerlError(
            f"{self.url(key)}: corrupted: sha256 {sink.hexdigest()} of the stored bytes, expected {recorded} "
            "(recorded when it was written) — rewrite the object from its source"
        )

    def get_bytes(self, key: str, verify: bool = True) -> bytes:
        """The object's bytes, verified against the sha256 recorded at write time (if any)."""
        key = check_key(key)
        buffer = io.BytesIO()
        self._read_verified(key, buffer, verify)
        return buffer.getvalue()

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Download to a temp file next to local_path, verify it, then rename it into place."""
        key = check_key(key)
        target = Path(local_path)
        with (
            local_errors(str(target), f"choose a writable local path for {self.url(key)}"),
            staged_file(target, lambda f: self._read_verified(key, f, verify=True)) as staged,
        ):
            os.replace(staged, target)

    def get_json(self, key: str) -> Any:
        try:
            return json.loads(self.get_bytes(key))
        except ValueError as err:
            raise MoerlError(f"{self.url(key)}: not valid JSON ({err}) — rewrite it") from err

    def download_dir(self, prefix: str, local_dir: str | os.PathLike) -> None:
        """Download every object below prefix to local_dir/<path relative to prefix> (each file verified)."""
        prefix = check_prefix(prefix)
        strip = len(prefix) + 1 if prefix else 0
        for key in self.list(prefix):
            self.get_file(key, Path(local_dir).joinpath(*key[strip:].split("/")))

    # -- metadata -------------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether key holds an object. (On S3 a missing bucket reads as no object: check_access() tells.)"""
        return self._backend.head(check_key(key)) is not None

    def _head(self, key: str) -> tuple[int, str | None]:
        head = self._backend.head(check_key(key))
        if head is None:
            raise ObjectNotFound(f"{self.url(key)}: no such object")
        return head

    def size(self, key: str) -> int:
        return self._head(key)[0]

    def sha256(self, key: str) -> str | None:
        """The digest recorded when the object was written; None for objects written by other tools."""
        return self._head(key)[1]

    def list(self, prefix: str = "") -> list[str]:
        """Keys below prefix (a directory: 'a' and 'a/' both mean a/...), relative to the root, sorted.

        Recursive. Store bookkeeping (sidecars, temp files) and keys no Store could address (S3 directory
        markers, '//' in a key) are left out.
        """
        return sorted(k for k in self._backend.list(check_prefix(prefix)) if is_visible(k))

    # -- deletes --------------------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        """Delete the object at key; deleting a missing key is not an error."""
        self._backend.delete(check_key(key))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object below the directory prefix ('' is refused: it would wipe the store)."""
        prefix = check_prefix(prefix)
        if not prefix:
            raise MoerlError(f"{self.uri}: delete_prefix('') would delete the whole store; name a prefix")
        self._backend.delete_prefix(prefix)
