"""The run store's S3 backend: an S3 prefix through s3fs and aiobotocore (steps/store/object_store.py's module
docstring says how writes are atomic, where the digest travels, and how the three layers of retries stack), the
retry policy for a whole store operation, which S3 errors are transient, and the one MoerlError that names the
object and the fix for the others.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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
from steps.store.backend import CHUNK_BYTES, DigestSink, ObjectNotFound, join_key

T = TypeVar("T")

S3_MULTIPART_CHUNK_BYTES = 64 << 20  # part size; objects under two parts go up in one PUT
S3_CONNECT_TIMEOUT_S = 5
S3_READ_TIMEOUT_S = 60
S3_METADATA_KEY = "sha256"  # sent as the x-amz-meta-sha256 header


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
# The backend


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


class S3Backend:
    def __init__(self, bucket: str, prefix: str, retry: RetryPolicy, fs: Any = None) -> None:
        self.bucket, self.prefix, self.retry = bucket, prefix, retry
        self.fs = fs if fs is not None else _new_s3fs()
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def child(self, prefix: str) -> S3Backend:
        return S3Backend(self.bucket, join_key(self.prefix, prefix), self.retry, self.fs)

    def full_key(self, key: str) -> str:
        return join_key(self.prefix, key)

    def _run(self, key: str, coroutine_fn: Callable[..., Any], *args: Any) -> Any:
        """Run an async S3 operation on s3fs's event loop, under our retry policy, with errors explained."""
        import fsspec.asyn  # loaded with s3fs already; not at the top, so that file:// runs skip it

        try:
            return self.retry.call(lambda: fsspec.asyn.sync(self.fs.loop, coroutine_fn, *args))
        except MoerlError:
            raise
        except Exception as exc:
            error = _explain_s3_error(join_key(self.uri, key) if key else self.uri, self.bucket, exc, self.retry)
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

    def read_into(self, key: str, sink: DigestSink) -> str | None:
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
