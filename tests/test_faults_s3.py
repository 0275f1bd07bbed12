"""Transient S3 errors — throttling (503 SlowDown), 500 InternalError, connections reset mid-response, uploads
cut in flight — injected by a proxy in front of the loopback S3 server (tests/s3_fault_proxy.py) into a whole
run on an s3:// store. The store's retries absorb them: every step succeeds at its first attempt and the run
ends with the fault-free run's weights."""

from __future__ import annotations

import pytest
from faults_helpers import assert_same_result, run_local
from s3_fault_proxy import Fault

from steps.store.object_store import Store

pytestmark = pytest.mark.faults


def test_the_proxy_injects_by_request_count_and_the_store_retries_through_it(s3_fault_proxy, s3_env):
    bucket = s3_env.create_bucket()
    store = Store.open(f"s3://{bucket}/run")
    proxy = s3_fault_proxy
    proxy.add(
        Fault("slowdown", r"^PUT .*/a$", times=4),  # more than botocore's own 3 attempts: our RetryPolicy steps in
        Fault("internal_error", r"^GET .*/a$", after=1),
        Fault("reset", r"^GET .*/a$", after=2),
        Fault("torn_upload", r"^PUT .*/b$", times=2),
    )
    store.put_bytes("a", b"A" * 5000)
    assert [store.get_bytes("a") for _ in range(3)] == [b"A" * 5000] * 3
    store.put_bytes("b", b"B" * 5000)
    assert store.get_bytes("b") == b"B" * 5000

    seen = [(r.line.replace(f"/{bucket}/run/", ""), r.action, r.status) for r in proxy.requests]
    assert seen == [
        *[("PUT a", "slowdown", None)] * 4, ("PUT a", None, 200),
        ("GET a", None, 200),
        ("GET a", "internal_error", None),
        ("GET a", "reset", 200),  # S3 served it, the client saw a reset: read again
        ("GET a", None, 200),
        ("GET a", None, 200),
        *[("PUT b", "torn_upload", None)] * 2, ("PUT b", None, 200),  # a cut upload never reaches S3
        ("GET b", None, 200),
    ]  # fmt: skip
    assert [r.body_size for r in proxy.requests if r.line.endswith("/b") and r.method == "PUT"] == [2500, 2500, 5000]
    assert [fired for *_, fired in proxy.fired()] == [4, 1, 1, 2]


def test_transient_s3_errors_in_every_step_end_in_the_fault_free_weights(
    fault_free_run, s3_fault_proxy, s3_env, tmp_path, monkeypatch
):
    monkeypatch.setenv("MOERL_LOCAL_TIME_SCALE", "0.05")
    bucket = s3_env.create_bucket()
    Store.open(f"s3://{bucket}/sft").upload_dir(fault_free_run.sft_dir, "")
    run_uri = f"s3://{bucket}/runs/faults"
    cfg = fault_free_run.config_for(run_uri, sft_checkpoint=f"s3://{bucket}/sft")
    run, list_prefix = f"/{bucket}/runs/faults", f"^GET /{bucket}\\?.*prefix=runs%2Ffaults%2F"
    faults = [
        # import-sft: the SFT download reset mid-response, throttled and failing uploads
        Fault("reset", rf"^GET /{bucket}/sft/model\.safetensors$", times=2),
        Fault("slowdown", rf"^PUT {run}/checkpoints/v000000/model\.safetensors$", times=4),
        Fault("internal_error", rf"^PUT {run}/checkpoints/v000000/MANIFEST\.json$", times=2),
        # rollout: the policy download reset, a chunk upload failing, listings throttled
        Fault("reset", rf"^GET {run}/checkpoints/v000000/model\.safetensors$", times=1),
        Fault("internal_error", rf"^PUT {run}/experience/iter-000001/rollout/chunk-000001\.parquet$", times=3),
        Fault("torn_upload", rf"^PUT {run}/experience/iter-000001/rollout/chunk-000002\.parquet$", times=1),
        Fault("slowdown", list_prefix + "experience", times=2),
        # score and update: their reads
        Fault("reset", rf"^GET {run}/experience/iter-000001/rollout/chunk-000003\.parquet$", times=1),
        Fault("slowdown", rf"^GET {run}/experience/iter-000001/scored\.parquet$", times=1),
        # publish: the candidate's download, the manifest applied twice (S3 answered, the client saw a reset),
        # LATEST failing once
        Fault("slowdown", rf"^GET {run}/candidates/iter-000001/model-", times=2),
        Fault("reset", rf"^PUT {run}/checkpoints/v000001/MANIFEST\.json$", times=1),
        Fault("internal_error", rf"^PUT {run}/checkpoints/LATEST$", after=1, times=1),  # v1's move, not v0's
    ]
    s3_fault_proxy.add(*faults)

    result = run_local(cfg, tmp_path / "work")
    assert result.succeeded, result.message
    pods = [n for n in result.status["nodes"].values() if n["type"] == "Pod"]
    assert all(n["phase"] == "Succeeded" for n in pods), "a step needed a retry of the whole pod"
    assert [(f.action, f.match, f.fired) for f in faults] == [(f.action, f.match, f.times) for f in faults]

    assert_same_result(Store.open(run_uri), fault_free_run.store)
    # The manifest reached S3 twice (the reset came after S3 applied it), with the same bytes both times.
    manifest_puts = {r.body_sha256 for r in s3_fault_proxy.requests
                     if r.line == f"PUT {run}/checkpoints/v000001/MANIFEST.json" and r.status == 200}  # fmt: skip
    assert len(manifest_puts) == 1
