"""Torn uploads and S3 errors that do not pass, on the way from import-sft to the run store
(tests/s3_fault_proxy.py in front of the loopback S3 server).

An upload cut in flight never becomes an object: the store retries it, or, when it is cut every time, the step
stops with one message and nothing is published. A service that keeps a torn body as if it were whole (S3
itself refuses such a request; moto does not) is caught by the next reader: it refuses the object."""

from __future__ import annotations

import json
import sys

import pytest
from faults_helpers import assert_nothing_half_published, published
from s3_fault_proxy import Fault

from steps import import_sft
from steps.errors import MoerlError, run_cli
from steps.run import checkpoint
from steps.run.config import validate_config
from steps.store.object_store import Store

pytestmark = pytest.mark.faults

WEIGHTS = "checkpoints/v000000/model.safetensors"


def import_cli(monkeypatch, capsys, src: str, run_uri: str) -> tuple[int, list[str]]:
    """python -m steps.import_sft, in this process: (exit code, stderr lines)."""
    cfg = validate_config({"sft_checkpoint": src, "run_store": run_uri})
    argv = ["import_sft", "--src", src, "--run", run_uri, "--run-config-json", json.dumps(cfg.model_dump(mode="json"))]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_:
        run_cli(import_sft.main)
    return exit_.value.code, capsys.readouterr().err.splitlines()


def keys(s3_env, bucket: str, prefix: str) -> list[str]:
    """What is really in the bucket (the admin client, past the proxy)."""
    return [o["Key"] for o in s3_env.s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]


def test_an_upload_cut_in_flight_never_appears_and_the_retry_lands_it_whole(
    fault_free_run, s3_fault_proxy, s3_env, monkeypatch, capsys
):
    bucket = s3_env.create_bucket()
    run_uri = f"s3://{bucket}/run"
    s3_fault_proxy.add(Fault("torn_upload", rf"^PUT /{bucket}/run/{WEIGHTS}$", times=2))
    code, err = import_cli(monkeypatch, capsys, fault_free_run.sft_dir.as_uri(), run_uri)
    assert code == 0, err

    puts = [(r.action, r.status) for r in s3_fault_proxy.requests if r.line == f"PUT /{bucket}/run/{WEIGHTS}"]
    assert puts == [("torn_upload", None), ("torn_upload", None), (None, 200)]  # only the whole body reached S3
    run = Store.open(run_uri)
    assert published(run) == ("v000000", [0])
    assert checkpoint.read_manifest(run, 0).files == checkpoint.read_manifest(fault_free_run.store, 0).files
    assert_nothing_half_published(run)


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ("torn_upload", "S3 request kept failing ("),
        ("slowdown", "S3 kept failing with SlowDown (Please reduce your request rate.) after 5 attempts — the "
                     "service is throttling or unavailable; retry later"),
        ("internal_error", "S3 kept failing with InternalError (We encountered an internal error.) after 5 "
                           "attempts — the service is throttling or unavailable; retry later"),
    ],
)  # fmt: skip
def test_an_upload_that_fails_every_time_stops_the_step_with_nothing_published(
    fault_free_run, s3_fault_proxy, s3_env, monkeypatch, capsys, action, message
):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries off: the store's 5 attempts remain
    bucket = s3_env.create_bucket()
    run_uri = f"s3://{bucket}/run"
    s3_fault_proxy.add(Fault(action, rf"^PUT /{bucket}/run/{WEIGHTS}$", times=None))
    code, err = import_cli(monkeypatch, capsys, fault_free_run.sft_dir.as_uri(), run_uri)

    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"error: {run_uri}/{WEIGHTS}: "), err
    assert message in err[0]
    puts = [r for r in s3_fault_proxy.requests if r.line == f"PUT /{bucket}/run/{WEIGHTS}"]
    assert len(puts) >= 5 and all(r.action == action for r in puts)  # each of the store's 5 attempts hit
    assert keys(s3_env, bucket, "run/checkpoints/") == [
        f"run/checkpoints/v000000/{name}" for name in ("config.json", "generation_config.json")
    ]  # the files before it, whole; no weights, no MANIFEST, no LATEST
    assert s3_env.s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_torn_object_kept_by_the_service_is_refused_by_its_next_reader(
    fault_free_run, s3_fault_proxy, s3_env, monkeypatch, capsys
):
    bucket = s3_env.create_bucket()
    run_uri = f"s3://{bucket}/run"
    s3_fault_proxy.add(Fault("truncate_upload", rf"^PUT /{bucket}/run/{WEIGHTS}$"))
    code, err = import_cli(monkeypatch, capsys, fault_free_run.sft_dir.as_uri(), run_uri)
    assert code == 0, err  # moto kept the first half of the body and answered 200, as S3 never would

    run = Store.open(run_uri)
    with pytest.raises(MoerlError) as refused:
        checkpoint.fetch(run, 0)
    assert f"{run_uri}/{WEIGHTS}: " in str(refused.value)
    assert "FlexibleChecksumError" in str(refused.value)  # the response checksum did not match the bytes


def test_a_torn_object_is_reported_as_corrupted(fault_free_run, s3_fault_proxy, s3_env, monkeypatch, capsys):
    bucket = s3_env.create_bucket()
    run_uri = f"s3://{bucket}/run"
    s3_fault_proxy.add(Fault("truncate_upload", rf"^PUT /{bucket}/run/{WEIGHTS}$"))
    import_cli(monkeypatch, capsys, fault_free_run.sft_dir.as_uri(), run_uri)
    with pytest.raises(MoerlError, match=r"model\.safetensors: corrupted: .* — rewrite the object from its source"):
        checkpoint.fetch(Store.open(run_uri), 0)
