"""What is special to S3 stores: URIs, digests as object metadata, multipart atomicity, retries, and one clear
error per misconfiguration (bucket, credentials, endpoint). The behaviour shared with local stores runs on
both backends in test_store_local.py.

Runs against moto's S3 server on loopback (tests/conftest.py). Moto accepts any credentials unless its IAM
authentication is switched on, so the wrong-credential cases run inside `s3_server.iam_auth()`; error codes
that moto cannot produce (expired tokens, throttling, wrong region) are raised by a fake in place of s3fs's
upload, which also exercises the mapping for errors that come out of s3fs rather than botocore.
"""

import hashlib
import os
import random
import socket

import aiohttp
import pytest
import s3fs
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

import steps.store.s3 as store_module
from steps.errors import MoerlError
from steps.store.object_store import Store
from steps.store.s3 import RetryPolicy, is_transient_s3_error


def client_error(code: str, status: int = 400, message: str = "injected") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")  # fmt: skip


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


class Sleeps(list):
    """A RetryPolicy sleep that records instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def bucket(s3_env):
    return s3_env.create_bucket()


# --- URIs ----------------------------------------------------------------------------------------------


def test_s3_uri_is_normalised_and_open_does_no_io(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    assert Store.open("s3://my-bucket").uri == "s3://my-bucket"
    assert Store.open("s3://my-bucket/runs/r1/").uri == "s3://my-bucket/runs/r1"
    assert Store.open("S3://my.bucket-2/a").uri == "s3://my.bucket-2/a"
    assert Store.open("s3://my-bucket/runs").child("r1").url("run.json") == "s3://my-bucket/runs/r1/run.json"


BAD_S3_URIS = {
    "s3://": "names no bucket",
    "s3:///prefix": "names no bucket",
    "s3://My-Bucket/x": "upper-case",
    "s3://ab/x": "not valid",
    "s3://-bucket/x": "not valid",
    "s3://bucket_name/x": "not valid",
    "s3://a..b/x": "no '..'",
    "s3://192.168.1.10/x": "not an IP address",
    "s3://xn--bucket/x": "reserves",
    "s3://bucket-s3alias/x": "reserves",
    "s3://bucket/a/../../x": "bad prefix",
    "s3://bucket/a//b": "bad prefix",
    "s3://bucket/x?versionId=1": "query or fragment",
}


@pytest.mark.parametrize("uri", BAD_S3_URIS)
def test_bad_s3_uri_names_the_uri_the_problem_and_the_accepted_forms(uri):
    with pytest.raises(MoerlError, match="accepted forms:") as e:
        Store.open(uri)
    assert repr(uri) in str(e.value) and BAD_S3_URIS[uri] in str(e.value)


# --- digests and atomic publication ----------------------------------------------------------------------


def test_digest_is_object_metadata_written_with_the_object(s3_env, bucket, tmp_path):
    store = Store.open(f"s3://{bucket}/run")
    digest = store.put_bytes("metrics/iter-000001.json", b'{"reward": 1}')
    head = s3_env.s3.head_object(Bucket=bucket, Key="run/metrics/iter-000001.json")
    assert head["Metadata"] == {"sha256": digest} == {"sha256": hashlib.sha256(b'{"reward": 1}').hexdigest()}
    (tmp_path / "f").write_bytes(b"file body")
    digest = store.put_file("f", tmp_path / "f")
    assert s3_env.s3.head_object(Bucket=bucket, Key="run/f")["Metadata"] == {"sha256": digest}


def test_multipart_upload_carries_the_digest_and_roundtrips(s3_env, bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "S3_MULTIPART_CHUNK_BYTES", 5 << 20)  # S3's smallest part size
    data = os.urandom(11 << 20)
    (tmp_path / "big").write_bytes(data)
    store = Store.open(f"s3://{bucket}/run")
    digest = store.put_file("ckpt/model.safetensors", tmp_path / "big")
    head = s3_env.s3.head_object(Bucket=bucket, Key="run/ckpt/model.safetensors")
    assert head["ETag"].strip('"').endswith("-3")  # really went up as a three-part multipart upload
    assert head["Metadata"] == {"sha256": digest}
    store.get_file("ckpt/model.safetensors", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data


def test_failed_multipart_upload_publishes_nothing(s3_env, bucket, tmp_path, monkeypatch):
    store = Store.open(f"s3://{bucket}/run", retry=RetryPolicy(max_attempts=2, sleep=Sleeps()))
    store.put_bytes("ckpt/model.safetensors", b"old, complete")
    monkeypatch.setattr(store_module, "S3_MULTIPART_CHUNK_BYTES", 5 << 20)
    (tmp_path / "big").write_bytes(os.urandom(11 << 20))
    original = s3fs.S3FileSystem._call_s3

    async def fail_on_complete(self, method, *args, **kwargs):
        if method == "complete_multipart_upload":
            raise client_error("InternalError", 500)
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", fail_on_complete)
    with pytest.raises(MoerlError, match="kept failing with InternalError .* after 2 attempts"):
        store.put_file("ckpt/model.safetensors", tmp_path / "big")
    assert store.get_bytes("ckpt/model.safetensors") == b"old, complete"
    assert s3_env.s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # parts were aborted


def test_exists_and_list_see_changes_made_by_others_at_once(s3_env, bucket):
    store = Store.open(f"s3://{bucket}/run")
    assert store.list() == [] and not store.exists("a/x")
    s3_env.s3.put_object(Bucket=bucket, Key="run/a/x", Body=b"1")
    assert store.list() == ["a/x"] and store.exists("a/x")
    s3_env.s3.delete_object(Bucket=bucket, Key="run/a/x")
    assert store.list() == [] and not store.exists("a/x")


def test_directory_markers_and_unaddressable_keys_are_not_listed(s3_env, bucket):
    for key in ["run/", "run/dir/", "run/a//b", "run/ok"]:
        s3_env.s3.put_object(Bucket=bucket, Key=key, Body=b"")
    assert Store.open(f"s3://{bucket}/run").list() == ["ok"]


# --- retries ---------------------------------------------------------------------------------------------


def test_retry_policy_retries_transient_errors_with_capped_backoff():
    sleeps, calls = Sleeps(), []

    def flaky():
        calls.append(1)
        if len(calls) <= 3:
            raise client_error("SlowDown", 503)
        return "ok"

    policy = RetryPolicy(max_attempts=5, base_delay_s=1.0, max_delay_s=3.0, sleep=sleeps, rng=random.Random(0))
    assert policy.call(flaky) == "ok"
    assert len(calls) == 4 and len(sleeps) == 3
    assert all(0 <= s <= cap for s, cap in zip(sleeps, [1.0, 2.0, 3.0], strict=True))  # jittered, capped


def test_retry_policy_does_not_retry_permanent_errors_and_gives_up_after_max_attempts():
    sleeps, calls = Sleeps(), []

    def denied():
        calls.append(1)
        raise client_error("AccessDenied", 403)

    with pytest.raises(ClientError):
        RetryPolicy(max_attempts=5, sleep=sleeps).call(denied)
    assert len(calls) == 1 and sleeps == []

    def always_throttled():
        calls.append(1)
        raise client_error("SlowDown", 503)

    calls.clear()
    with pytest.raises(ClientError, match="SlowDown"):
        RetryPolicy(max_attempts=3, sleep=sleeps).call(always_throttled)
    assert len(calls) == 3 and len(sleeps) == 2


def wrapped_by_s3fs(code: str, status: int) -> OSError:
    """s3fs re-raises ClientErrors as OSErrors caused by them."""
    error = PermissionError(13, "translated")
    error.__cause__ = client_error(code, status)
    return error


@pytest.mark.parametrize(
    "error, transient",
    [
        (client_error("SlowDown", 503), True),
        (client_error("ServiceUnavailable", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("RequestTimeout", 400), True),
        (client_error("Throttling", 400), True),
        (client_error("SomethingNew", 502), True),
        (ConnectionClosedError(endpoint_url="http://s3"), True),
        (ReadTimeoutError(endpoint_url="http://s3"), True),
        (EndpointConnectionError(endpoint_url="http://s3", error=aiohttp.ClientOSError(104, "reset")), True),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (wrapped_by_s3fs("SlowDown", 503), True),
        (client_error("NoSuchBucket", 404), False),
        (client_error("AccessDenied", 403), False),
        (client_error("InvalidAccessKeyId", 403), False),
        (client_error("SignatureDoesNotMatch", 403), False),
        (wrapped_by_s3fs("AccessDenied", 403), False),
        (EndpointConnectionError(endpoint_url="http://s3", error=socket.gaierror(-2, "unknown host")), False),
        (NoCredentialsError(), False),
        (ValueError("a bug, not the network"), False),
    ],
)
def test_transient_error_classification(error, transient):
    assert is_transient_s3_error(error) is transient


@pytest.fixture
def injected_upload_errors(monkeypatch):
    """Make the next uploads through s3fs fail with the listed errors, then go through; returns the call log."""
    original, pending, calls = s3fs.S3FileSystem._pipe_file, [], []

    async def pipe_file(self, path, data, **kwargs):
        calls.append(path)
        if pending:
            raise pending.pop(0)
        return await original(self, path, data, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_pipe_file", pipe_file)
    return pending, calls


def test_store_retries_transient_upload_errors(bucket, injected_upload_errors):
    pending, calls = injected_upload_errors
    pending += [client_error("SlowDown", 503), ConnectionClosedError(endpoint_url="http://s3")]
    sleeps = Sleeps()
    store = Store.open(f"s3://{bucket}/run", retry=RetryPolicy(sleep=sleeps))
    store.put_bytes("x", b"made it")
    assert len(calls) == 3 and len(sleeps) == 2
    assert store.get_bytes("x") == b"made it"


@pytest.mark.parametrize(
    "code, status, fragment",
    [
        ("AccessDenied", 403, "access denied \\(AccessDenied\\) — .*s3:PutObject"),
        ("ExpiredToken", 400, "session credentials expired .* AWS_SESSION_TOKEN"),
        ("PermanentRedirect", 301, "another region .* set AWS_REGION"),
        ("NoSuchBucket", 404, "does not exist \\(NoSuchBucket\\)"),
        ("SlowDown", 503, "kept failing with SlowDown .* after 3 attempts .* retry later"),
        ("WeirdNewError", 400, "S3 refused the request \\(WeirdNewError"),
    ],
)
def test_store_error_mapping(bucket, injected_upload_errors, code, status, fragment):
    pending, calls = injected_upload_errors
    pending += [client_error(code, status)] * 5
    store = Store.open(f"s3://{bucket}/run", retry=RetryPolicy(max_attempts=3, sleep=Sleeps()))
    with pytest.raises(MoerlError, match=fragment) as e:
        store.put_bytes("metrics/x.json", b"{}")
    assert f"s3://{bucket}/run/metrics/x.json" in str(e.value)
    assert len(calls) == (3 if code == "SlowDown" else 1)


# --- one clear error per misconfiguration, against the real server ------------------------------------


def test_nonexistent_bucket(s3_env, tmp_path):
    store = Store.open("s3://no-such-bucket-here/run")
    for operation in (store.check_access, lambda: store.put_bytes("x", b"1"), lambda: store.get_bytes("x"),
                      store.list, lambda: store.get_file("x", tmp_path / "x")):  # fmt: skip
        with pytest.raises(MoerlError, match="bucket 'no-such-bucket-here' does not exist \\(NoSuchBucket\\)"):
            operation()
    assert not (tmp_path / "x").exists()


def test_check_access_passes_on_an_empty_prefix(bucket):
    Store.open(f"s3://{bucket}/not/written/yet").check_access()


def test_unknown_access_key(s3_env, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with s3_env.iam_auth(), pytest.raises(MoerlError, match="access denied \\(InvalidAccessKeyId") as e:
        Store.open(f"s3://{bucket}/run").check_access()
    assert f"s3://{bucket}/run" in str(e.value) and "AWS_ACCESS_KEY_ID" in str(e.value)


def test_wrong_secret_key(s3_env, bucket, monkeypatch):
    key_id, _ = s3_env.create_access_key(allow=["s3:*"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with s3_env.iam_auth(), pytest.raises(MoerlError, match="SignatureDoesNotMatch.*AWS_SECRET_ACCESS_KEY"):
        Store.open(f"s3://{bucket}/run").check_access()


def test_credentials_without_permission_and_with_it(s3_env, bucket, monkeypatch):
    for allow, works in ((None, False), (["s3:ListBucket", "s3:GetObject", "s3:PutObject"], True)):
        key_id, secret = s3_env.create_access_key(allow=allow)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        store = Store.open(f"s3://{bucket}/run")
        with s3_env.iam_auth():
            if works:
                store.check_access()
                store.put_bytes("x", b"1")
                assert store.get_bytes("x") == b"1"
            else:
                with pytest.raises(MoerlError, match="access denied \\(AccessDenied\\)"):
                    store.check_access()


def test_missing_credentials(s3_env, bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(MoerlError, match="no usable AWS credentials .* AWS_ACCESS_KEY_ID .* AWS_PROFILE") as e:
        Store.open(f"s3://{bucket}/run").check_access()
    assert str(e.value).startswith(f"s3://{bucket}/run: ")


def test_unknown_profile(s3_env, bucket, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(MoerlError, match="no-such-profile.*set AWS_PROFILE to a profile"):
        Store.open(f"s3://{bucket}/run").check_access()


def test_credentials_and_endpoint_from_aws_config_files(s3_env, bucket, monkeypatch):
    key_id, secret = s3_env.create_access_key(allow=["s3:*"])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    with open(os.environ["AWS_SHARED_CREDENTIALS_FILE"], "w") as f:
        f.write(f"[moerl]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
    with open(os.environ["AWS_CONFIG_FILE"], "w") as f:
        f.write(f"[profile moerl]\nregion = us-east-1\nendpoint_url = {s3_env.endpoint_url}\n")
    monkeypatch.setenv("AWS_PROFILE", "moerl")
    store = Store.open(f"s3://{bucket}/run")
    with s3_env.iam_auth():  # so the server really checks the profile's keys
        store.put_bytes("x", b"from the profile")
        assert store.get_bytes("x") == b"from the profile"


def test_service_specific_endpoint_wins(s3_env, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_env.endpoint_url)
    Store.open(f"s3://{bucket}/run").check_access()


def test_unreachable_endpoint(s3_env, monkeypatch):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore would otherwise retry the connect with backoff
    sleeps = Sleeps()
    store = Store.open("s3://some-bucket/run", retry=RetryPolicy(sleep=sleeps))
    with pytest.raises(MoerlError, match="cannot reach the S3 endpoint .* check AWS_ENDPOINT_URL") as e:
        store.check_access()
    assert str(e.value).startswith("s3://some-bucket/run: ") and endpoint in str(e.value)
    assert sleeps == []  # not retried by us: a wrong endpoint will not come right in a few seconds
