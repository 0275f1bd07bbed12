"""The run store: one small object-store API over a local directory or an S3 prefix.

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
  - ours: RetryPolicy retries a whole store operation on transient errors (throttling, 5xx, request
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

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import random
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    FlexibleChecksumError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ProfileNotFound,
    ProxyConnectionError,
    ReadTimeoutError,
    ResponseStreamingError,
    SSLError,
)

from steps.errors import MoerlError

T = TypeVar("T")

RESERVED_PREFIX = ".moerl-"  # names the store uses for its own bookkeeping (sidecars, temp files)
SIDECAR_PREFIX = RESERVED_PREFIX + "sha256-"
TEMP_PREFIX = RESERVED_PREFIX + "tmp-"
CHUNK_BYTES = 1 << 20  # streaming granularity for hashing, copying and downloading
S3_MULTIPART_CHUNK_BYTES = 64 << 20  # part size; objects under two parts go up in one PUT
S3_CONNECT_TIMEOUT_S = 5
S3_READ_TIMEOUT_S = 60
S3_METADATA_KEY = "sha256"  # sent as the x-amz-meta-sha256 header
# A digest mismatch is re-read this many times before it is called corruption (see module docstring).
MISMATCH_REREAD_DELAYS_S = (0.02, 0.1, 0.3)

ACCEPTED_FORMS = "a local path (runs/r1 or /abs/runs/r1), file:///abs/runs/r1, or s3://bucket[/prefix]"


class ObjectNotFound(MoerlError, FileNotFoundError):
    """The key holds no object. A MoerlError (message names the URL) that is also a FileNotFoundError."""


# ---------------------------------------------------------------------------------------------------------
# Keys


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


def _check_key(key: str, what: str = "key") -> str:
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


def _check_prefix(prefix: str) -> str:
    """A prefix is '' (the whole store) or a key, optionally with a trailing '/'; returned without it."""
    if prefix == "":
        return ""
    if not isinstance(prefix, str):
        raise MoerlError(f"store prefix {prefix!r}: must be a string like 'checkpoints/'")
    return _check_key(prefix[:-1] if prefix.endswith("/") else prefix, what="prefix")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _is_visible(key: str) -> bool:
    """Whether a raw key found in the backend is a user object (not bookkeeping, not unaddressable)."""
    try:
        _check_key(key)
    except MoerlError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Retries


TRANSIENT_S3_CODES = frozenset(
    """SlowDown Throttling ThrottlingException ThrottledException RequestThrottled
    RequestThrottledException TooManyRequestsException RequestLimitExceeded BandwidthLimitExceeded
    RequestTimeout RequestTimeoutException InternalError ServiceUnavailable OperationAborted
    PriorRequestNotComplete XAmzContentSHA256Mismatch 500 502 503 504""".split()
)
TRANSIENT_HTTP_STATUSES = frozenset({500, 502, 503, 504})
WRONG_REGION_CODES = frozenset(
    "PermanentRedirect AuthorizationHeaderMalformed IllegalLocationConstraintException".split()
)
DROPPED_MID_REQUEST = (ConnectionClosedError, ReadTimeoutError, ResponseStreamingError, IncompleteReadError)


def _botocore_error(exc: BaseException) -> BaseException | None:
    """The botocore exception behind exc (s3fs re-raises a ClientError as an OSError caused by it)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ClientError, BotoCoreError)):
            return seen
        seen = seen.__cause__
    return None


def _could_not_connect(err: BaseException) -> bool:
    """Whether a botocore connection error means 'no route to the endpoint' rather than a dropped request."""
    if isinstance(err, (ConnectTimeoutError, ProxyConnectionError, SSLError)):
        return True
    if isinstance(err, EndpointConnectionError):
        # aiobotocore raises EndpointConnectionError both when it cannot connect at all and when an
        # established connection is reset; only the first means the endpoint is wrong or down.
        import aiohttp  # S3 only: aiohttp and fsspec take ~1 s to import, which file:// runs never need

        cause = err.kwargs.get("error")
        return cause is None or isinstance(cause, (aiohttp.ClientConnectorError, socket.gaierror))
    return False


def is_transient_s3_error(exc: BaseException) -> bool:
    """Whether retrying the same S3 operation may succeed: throttling, 5xx, timeouts, dropped connections."""
    err = _botocore_error(exc)
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in TRANSIENT_S3_CODES or status in TRANSIENT_HTTP_STATUSES
    if isinstance(err, DROPPED_MID_REQUEST):
        return True
    if isinstance(err, EndpointConnectionError):
        return not _could_not_connect(err)
    if err is not None:
        return False
    import aiohttp

    dropped = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, TimeoutError)
    return isinstance(exc, (*dropped, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError))


@dataclass
class RetryPolicy:
    """Bounded retries with capped exponential backoff and full jitter.

    Attempt n (1-based) that fails with a transient error sleeps uniform(0, min(max_delay_s,
    base_delay_s * 2**(n-1))) before attempt n+1; a non-transient error, or the last attempt's error,
    is raised as is. `is_transient`, `sleep` and `rng` are injectable for tests.
    """

    max_attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 10.0
    is_transient: Callable[[BaseException], bool] = is_transient_s3_error
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts={self.max_attempts}: must be at least 1")

    def delay_s(self, attempt: int) -> float:
        return self.rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)))

    def call(self, fn: Callable[[], T]) -> T:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn()
            except Exception as exc:
                if attempt == self.max_attempts or not self.is_transient(exc):
                    raise
                self.sleep(self.delay_s(attempt))
        raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------------------
# Hashing and local files


class _DigestSink:
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


def _sha256_file(path: Path) -> str:
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
def _staged(path: Path, fill: Callable[[BinaryIO], None]) -> Iterator[Path]:
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


# ---------------------------------------------------------------------------------------------------------
# Backends: each works on keys that Store has already validated, relative to the backend's root.


class _LocalBackend:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = "file://" + root.as_posix()

    def child(self, prefix: str) -> _LocalBackend:
        return _LocalBackend(self.path(prefix))

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
        return _local_errors(
            _join(self.uri, key) if key else self.uri,
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
            with _staged(path, fill) as staged, _staged(sidecar, lambda f: f.write(digest_line)) as staged_digest:
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

    def read_into(self, key: str, sink: _DigestSink) -> str | None:
        path = self.path(key)
        with self._errors(key):
            try:
                f = open(path, "rb")
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise ObjectNotFound(f"{_join(self.uri, key)}: no such object") from None
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


@contextlib.contextmanager
def _local_errors(url: str, hint: str) -> Iterator[None]:
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


def _s3_region_from_env() -> str | None:
    """AWS_REGION (the cross-SDK name that EKS sets) wins; botocore itself reads only AWS_DEFAULT_REGION."""
    return os.environ.get("AWS_REGION") or None


def _s3_endpoint_from_env() -> str:
    """For messages only: botocore resolves the endpoint itself (env, then config file)."""
    env = os.environ
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "the default AWS S3 endpoint"


def _new_s3fs() -> Any:
    import s3fs

    config: dict[str, Any] = {"connect_timeout": S3_CONNECT_TIMEOUT_S, "read_timeout": S3_READ_TIMEOUT_S}
    if "AWS_MAX_ATTEMPTS" not in os.environ and "AWS_RETRY_MODE" not in os.environ:
        config["retries"] = {"mode": "standard", "total_max_attempts": 3}
    region = _s3_region_from_env()
    fs = s3fs.S3FileSystem(
        skip_instance_cache=True,  # each Store reads the environment afresh (endpoint, credentials, region)
        use_listings_cache=False,  # exists()/list() must see objects written by other pods a moment ago
        config_kwargs=config,
        client_kwargs={"region_name": region} if region else {},
    )
    fs.retries = 1  # s3fs's own retry loop: off (see module docstring)
    return fs


class _S3Backend:
    def __init__(self, bucket: str, prefix: str, retry: RetryPolicy, fs: Any = None) -> None:
        self.bucket, self.prefix, self.retry = bucket, prefix, retry
        self.fs = fs if fs is not None else _new_s3fs()
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def child(self, prefix: str) -> _S3Backend:
        return _S3Backend(self.bucket, _join(self.prefix, prefix), self.retry, self.fs)

    def full_key(self, key: str) -> str:
        return _join(self.prefix, key)

    def _run(self, key: str, coroutine_fn: Callable[..., Any], *args: Any) -> Any:
        """Run an async S3 operation on s3fs's event loop, under our retry policy, with errors explained."""
        import fsspec.asyn  # loaded with s3fs already; not at the top, so that file:// runs skip it

        try:
            return self.retry.call(lambda: fsspec.asyn.sync(self.fs.loop, coroutine_fn, *args))
        except MoerlError:
            raise
        except Exception as exc:
            error = _explain_s3_error(_join(self.uri, key) if key else self.uri, self.bucket, exc, self.retry)
            if error is None:
                raise
            raise error from exc

    async def _client(self) -> Any:
        return await self.fs.set_session()

    # Writes go through s3fs: one PUT, or a multipart upload that it completes (or aborts) as a whole.
    # The digest travels as object metadata in that same PUT / CreateMultipartUpload.

    def put_bytes(self, key: str, data: bytes, sha: str) -> None:
        path = f"{self.bucket}/{self.full_key(key)}"

        async def upload() -> None:
            metadata = {S3_METADATA_KEY: sha}
            await self.fs._pipe_file(path, data, chunksize=S3_MULTIPART_CHUNK_BYTES, Metadata=metadata)

        self._run(key, upload)

    def put_file(self, key: str, local_path: Path, sha: str) -> None:
        path = f"{self.bucket}/{self.full_key(key)}"

        async def upload() -> None:
            await self.fs._put_file(
                str(local_path), path, chunksize=S3_MULTIPART_CHUNK_BYTES, Metadata={S3_METADATA_KEY: sha}
            )

        self._run(key, upload)

    def read_into(self, key: str, sink: _DigestSink) -> str | None:
        async def download() -> str | None:
            client = await self._client()
            sink.reset()  # a retried attempt starts from an empty file
            response = await client.get_object(Bucket=self.bucket, Key=self.full_key(key))
            async with response["Body"] as body:
                while chunk := await body.read(CHUNK_BYTES):
                    sink.write(chunk)
            return response.get("Metadata", {}).get(S3_METADATA_KEY)

        return self._run(key, download)

    def head(self, key: str) -> tuple[int, str | None] | None:
        async def head() -> tuple[int, str | None] | None:
            client = await self._client()
            try:
                response = await client.head_object(Bucket=self.bucket, Key=self.full_key(key))
            except ClientError as err:
                # HEAD has no body, so a missing key and a missing bucket both read as a bare 404.
                if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey"):
                    return None
                raise
            return response["ContentLength"], response.get("Metadata", {}).get(S3_METADATA_KEY)

        return self._run(key, head)

    def _list_full(self, prefix: str) -> list[str]:
        """All raw full keys under the directory `prefix` (relative to the backend root)."""
        full_prefix = self.full_key(prefix) if prefix else self.prefix
        s3_prefix = f"{full_prefix}/" if full_prefix else ""

        async def list_all() -> list[str]:
            client = await self._client()
            keys: list[str] = []
            paginator = client.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=s3_prefix):
                keys.extend(item["Key"] for item in page.get("Contents", []))
            return keys

        return self._run(prefix, list_all)

    def list(self, prefix: str) -> list[str]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        return [full[strip:] for full in self._list_full(prefix)]

    def delete(self, key: str) -> None:
        async def delete() -> None:
            client = await self._client()
            await client.delete_object(Bucket=self.bucket, Key=self.full_key(key))

        self._run(key, delete)

    def delete_prefix(self, prefix: str) -> None:
        full_keys = self._list_full(prefix)

        async def delete_batch(batch: list[str]) -> None:
            client = await self._client()
            response = await client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
            )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise ClientError({"Error": first, "ResponseMetadata": {}}, "DeleteObjects")

        for start in range(0, len(full_keys), 1000):  # DeleteObjects takes at most 1000 keys
            self._run(prefix, delete_batch, full_keys[start : start + 1000])

    def check_access(self) -> None:
        async def probe() -> None:
            client = await self._client()
            prefix = f"{self.prefix}/" if self.prefix else ""
            await client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1)

        self._run("", probe)


def _explain_s3_error(url: str, bucket: str, exc: BaseException, retry: RetryPolicy) -> MoerlError | None:
    """One MoerlError that names the object and the fix, or None for errors that are bugs, not S3 trouble."""
    err = _botocore_error(exc)
    endpoint = _s3_endpoint_from_env()
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", "unknown"))
        message = err.response.get("Error", {}).get("Message", "")
        if code in ("NoSuchKey", "404"):
            return ObjectNotFound(f"{url}: no such object")
        if code == "NoSuchBucket":
            return MoerlError(
                f"{url}: bucket '{bucket}' does not exist (NoSuchBucket) at {endpoint} — create it "
                f"(aws s3 mb s3://{bucket}) or fix the bucket name in the store URI"
            )
        if code == "InvalidAccessKeyId":
            return MoerlError(
                f"{url}: access denied (InvalidAccessKeyId: {endpoint} does not know this access key id) — "
                "check AWS_ACCESS_KEY_ID / AWS_PROFILE (and AWS_ENDPOINT_URL for an S3-compatible service)"
            )
        if code == "SignatureDoesNotMatch":
            return MoerlError(
                f"{url}: access denied (SignatureDoesNotMatch: the secret key does not match the access key "
                "id) — check AWS_SECRET_ACCESS_KEY or the profile's aws_secret_access_key (AWS_PROFILE)"
            )
        if code in ("ExpiredToken", "ExpiredTokenException", "InvalidToken", "TokenRefreshRequired"):
            return MoerlError(
                f"{url}: access denied ({code}: the session credentials expired or are invalid) — refresh "
                "them (aws sso login, re-assume the role) or unset a stale AWS_SESSION_TOKEN"
            )
        if code in ("AccessDenied", "AllAccessDisabled", "403"):
            return MoerlError(
                f"{url}: access denied ({code}) — the credentials in use may not read/write s3://{bucket}; "
                "grant s3:ListBucket, s3:GetObject, s3:PutObject and s3:DeleteObject on it to the IAM role "
                "or user (IRSA / Pod Identity on EKS), or use other credentials (AWS_PROFILE, "
                "AWS_ACCESS_KEY_ID)"
            )
        if code in WRONG_REGION_CODES:
            return MoerlError(
                f"{url}: the bucket is in another region ({code}) — set AWS_REGION to the bucket's region"
            )
        if retry.is_transient(exc):
            return MoerlError(
                f"{url}: S3 kept failing with {code} ({message}) after {retry.max_attempts} attempts — the "
                "service is throttling or unavailable; retry later"
            )
        return MoerlError(f"{url}: S3 refused the request ({code}: {message}) — see the S3 error reference")
    if isinstance(err, ProfileNotFound):
        return MoerlError(
            f"{url}: {err} — set AWS_PROFILE to a profile in ~/.aws/config or ~/.aws/credentials, or unset it"
        )
    if isinstance(err, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return MoerlError(
            f"{url}: no usable AWS credentials ({err}) — set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "choose a profile with AWS_PROFILE (~/.aws/credentials, ~/.aws/config), or run with an IAM role "
            "(IRSA / EKS Pod Identity / instance profile)"
        )
    if isinstance(err, FlexibleChecksumError):
        # The bytes S3 sent do not match the checksum it stored with the object: the object itself is torn
        # (reading it again gives the same bytes), so only a rewrite mends it.
        return MoerlError(
            f"{url}: corrupted: the stored bytes do not match the object's checksum (FlexibleChecksumError: "
            f"{err}) — rewrite the object from its source"
        )
    if err is not None and _could_not_connect(err):
        return MoerlError(
            f"{url}: cannot reach the S3 endpoint ({err}) — check AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 "
            f"(now: {endpoint}), the network, proxy and TLS settings (AWS_CA_BUNDLE)"
        )
    if retry.is_transient(exc):
        return MoerlError(
            f"{url}: S3 request kept failing ({type(exc).__name__}: {exc}) after {retry.max_attempts} "
            f"attempts — check the network to {endpoint} and retry later"
        )
    if err is not None:
        return MoerlError(f"{url}: S3 request failed ({type(err).__name__}: {err}) — check the AWS configuration")
    return None


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


def _parse_uri(uri: str, retry: RetryPolicy) -> _LocalBackend | _S3Backend:
    if not isinstance(uri, str) or not uri.strip():
        raise _bad_uri(str(uri), "is empty")
    if "\x00" in uri:
        raise _bad_uri(uri, "contains a NUL byte")
    match = _SCHEME.match(uri)
    if match is None:
        if re.match(r"^(s3|s3a|s3n|file):", uri, re.IGNORECASE):
            raise _bad_uri(uri, "is missing the '//' after the scheme")
        return _LocalBackend(Path(os.path.abspath(os.path.expanduser(uri))))
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        if rest.startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest:
            raise _bad_uri(uri, "names no path")
        # Like fsspec, 'file://runs/r1' is the relative path runs/r1; file:///abs is an absolute path.
        return _LocalBackend(Path(os.path.abspath(os.path.expanduser(rest))))
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
            _check_key(prefix, what="prefix")
        except MoerlError as err:
            raise _bad_uri(uri, f"has a bad prefix ({err})") from None
    return _S3Backend(bucket, prefix, retry)


# ---------------------------------------------------------------------------------------------------------
# The store


class Store:
    """An object store rooted at a URI. Construct with Store.open(uri)."""

    def __init__(self, backend: _LocalBackend | _S3Backend) -> None:
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
        prefix = _check_prefix(prefix)
        if not prefix:
            raise MoerlError("Store.child(''): name a prefix like 'checkpoints'")
        return Store(self._backend.child(prefix))

    def url(self, key: str) -> str:
        return f"{self.uri}/{_check_key(key)}"

    def check_access(self) -> None:
        """Fail early (one MoerlError naming the URI and the fix) if the store's root cannot be listed."""
        self._backend.check_access()

    # -- writes ---------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> str:
        """Atomically write data at key, record its sha256 with it, and return the digest (hex)."""
        key = _check_key(key)
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        self._backend.put_bytes(key, data, sha)
        return sha

    def put_file(self, key: str, local_path: str | os.PathLike) -> str:
        """Atomically upload a local file at key; returns its sha256 (hex)."""
        key = _check_key(key)
        local_path = Path(local_path)
        if not local_path.is_file():
            raise MoerlError(f"{local_path}: not a file — cannot upload it to {self.url(key)}")
        sha = _sha256_file(local_path)  # first, so that it can travel with the upload
        self._backend.put_file(key, local_path, sha)
        return sha

    def put_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, json_text(obj).encode())

    def upload_dir(self, local_dir: str | os.PathLike, prefix: str) -> dict[str, tuple[int, str]]:
        """Upload each file below local_dir to prefix/<path>; returns {path: (size, sha256)}.

        Paths are relative to local_dir, '/'-separated. Files named like the store's own bookkeeping
        (.moerl-*) are skipped, so a local store's directory uploads cleanly.
        """
        local_dir, prefix = Path(local_dir), _check_prefix(prefix)
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
                uploaded[rel] = (path.stat().st_size, self.put_file(_join(prefix, rel), path))
        return uploaded

    # -- reads ----------------------------------------------------------------------------------------

    def _read_verified(self, key: str, file: BinaryIO, verify: bool) -> None:
        """Fill file with the object's bytes; raise if they do not match the recorded sha256."""
        for delay in (*MISMATCH_REREAD_DELAYS_S, None):
            sink = _DigestSink(file)
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
        key = _check_key(key)
        buffer = io.BytesIO()
        self._read_verified(key, buffer, verify)
        return buffer.getvalue()

    def get_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Download to a temp file next to local_path, verify it, then rename it into place."""
        key = _check_key(key)
        target = Path(local_path)
        with (
            _local_errors(str(target), f"choose a writable local path for {self.url(key)}"),
            _staged(target, lambda f: self._read_verified(key, f, verify=True)) as staged,
        ):
            os.replace(staged, target)

    def get_json(self, key: str) -> Any:
        try:
            return json.loads(self.get_bytes(key))
        except ValueError as err:
            raise MoerlError(f"{self.url(key)}: not valid JSON ({err}) — rewrite it") from err

    def download_dir(self, prefix: str, local_dir: str | os.PathLike) -> None:
        """Download every object below prefix to local_dir/<path relative to prefix> (each file verified)."""
        prefix = _check_prefix(prefix)
        strip = len(prefix) + 1 if prefix else 0
        for key in self.list(prefix):
            self.get_file(key, Path(local_dir).joinpath(*key[strip:].split("/")))

    # -- metadata -------------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        """Whether key holds an object. (On S3 a missing bucket reads as no object: check_access() tells.)"""
        return self._backend.head(_check_key(key)) is not None

    def _head(self, key: str) -> tuple[int, str | None]:
        head = self._backend.head(_check_key(key))
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
        return sorted(k for k in self._backend.list(_check_prefix(prefix)) if _is_visible(k))

    # -- deletes --------------------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        """Delete the object at key; deleting a missing key is not an error."""
        self._backend.delete(_check_key(key))

    def delete_prefix(self, prefix: str) -> None:
        """Delete every object below the directory prefix ('' is refused: it would wipe the store)."""
        prefix = _check_prefix(prefix)
        if not prefix:
            raise MoerlError(f"{self.uri}: delete_prefix('') would delete the whole store; name a prefix")
        self._backend.delete_prefix(prefix)
