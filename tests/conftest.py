"""Shared pytest fixtures."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

# --- S3 on loopback -------------------------------------------------------------------------------------
# A moto server (the real S3 REST API, in a thread of this process) on 127.0.0.1, started once per session.
# Tests that talk to it through the standard AWS environment use `s3_env`, which points AWS_ENDPOINT_URL at
# it with fake credentials and hides the developer's own AWS configuration.

S3_REGION = "us-east-1"
S3_FAKE_KEY, S3_FAKE_SECRET = "testing", "testing"

# Every variable that could steer botocore somewhere else than the test server.
AWS_ENV_VARS = """AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_SECURITY_TOKEN AWS_PROFILE
AWS_DEFAULT_PROFILE AWS_REGION AWS_DEFAULT_REGION AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3
AWS_IGNORE_CONFIGURED_ENDPOINT_URLS AWS_CONFIG_FILE AWS_SHARED_CREDENTIALS_FILE AWS_ROLE_ARN
AWS_WEB_IDENTITY_TOKEN_FILE AWS_CONTAINER_CREDENTIALS_RELATIVE_URI AWS_CONTAINER_CREDENTIALS_FULL_URI
AWS_CONTAINER_AUTHORIZATION_TOKEN AWS_MAX_ATTEMPTS AWS_RETRY_MODE""".split()


@dataclass
class S3Server:
    """The loopback S3 server, with admin clients that ignore the test's AWS environment."""

    endpoint_url: str
    region: str = S3_REGION
    s3: Any = field(init=False, repr=False)  # boto3 S3 client, created once (before any env changes)
    iam: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        import boto3

        session = boto3.session.Session(
            aws_access_key_id=S3_FAKE_KEY, aws_secret_access_key=S3_FAKE_SECRET, region_name=self.region
        )
        self.s3 = session.client("s3", endpoint_url=self.endpoint_url)
        self.iam = session.client("iam", endpoint_url=self.endpoint_url)

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name unless given) and return its name."""
        name = name or f"moerl-test-{secrets.token_hex(6)}"
        self.s3.create_bucket(Bucket=name)
        return name

    def create_access_key(self, allow: list[str] | None = None) -> tuple[str, str]:
        """A new IAM user's (access key id, secret); `allow` lists the S3 actions its policy grants."""
        user = f"moerl-user-{secrets.token_hex(4)}"
        self.iam.create_user(UserName=user)
        if allow:
            statement = {"Effect": "Allow", "Action": allow, "Resource": "*"}
            policy = json.dumps({"Version": "2012-10-17", "Statement": [statement]})
            self.iam.put_user_policy(UserName=user, PolicyName="moerl", PolicyDocument=policy)
        key = self.iam.create_access_key(UserName=user)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    @contextlib.contextmanager
    def iam_auth(self) -> Iterator[None]:
        """Within this block the server checks signatures and IAM policies (by default it accepts anything).

        The admin clients' fake credentials are refused too, so set up buckets and users before entering.
        """
        from moto.core import enable_iam_authentication

        with enable_iam_authentication():
            yield


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log lines in test output
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield S3Server(endpoint_url=f"http://{host}:{port}")
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """The standard AWS environment pointed at the loopback server, with fake credentials.

    AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE name files that do not exist yet (a test may write them),
    so nothing from ~/.aws leaks in, and instance metadata (IMDS) is never queried.
    """
    for name in AWS_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    aws_dir = tmp_path_factory.mktemp("aws")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(aws_dir / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws_dir / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_FAKE_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_FAKE_SECRET)
    monkeypatch.setenv("AWS_REGION", s3_server.region)
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_server.region)
    return s3_server


# --- Fault injection ------------------------------------------------------------------------------------
# The fault-free run of the tiny fault-test config (tests/faults_helpers.py), made once per session: the
# fault tests compare what a run left after faults with it, and the security tests grep its outputs.


@pytest.fixture(scope="session")
def fault_free_run(tmp_path_factory: pytest.TempPathFactory):
    from faults_helpers import run_reference

    return run_reference(tmp_path_factory.mktemp("fault-free"))


@pytest.fixture
def s3_fault_proxy(s3_env, monkeypatch: pytest.MonkeyPatch):
    """A fault-injecting proxy (tests/s3_fault_proxy.py) in front of the loopback S3 server; the AWS
    environment points at the proxy. Returns the proxy; s3_env's admin clients still reach the server."""
    from s3_fault_proxy import S3FaultProxy

    proxy = S3FaultProxy(s3_env.endpoint_url).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        yield proxy
    finally:
        proxy.stop()
