"""Weight deltas (steps/run/weight_delta.py): a version rebuilt from its parent and its delta is the published
checkpoint
bit for bit; writing is idempotent and DELTA.json comes last; a stale, corrupt or unfinished delta is never
applied; publish writes the delta before MANIFEST.json and retention deletes it with its version."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from delta_helpers import VersionedRun, same_files
from test_publish_step import updated_run

from steps.publish import clean_up, publish
from steps.run import checkpoint, weight_delta
from steps.run.keys import delta_blob_key, delta_index_key, delta_prefix
from steps.run.weight_delta import DeltaUnusable, apply_delta, read_index, write_delta
from steps.store.object_store import Store


@pytest.mark.parametrize(
    "dtype,shard",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, 40_000)],
    ids=["fp32", "bf16", "sharded"],
)
def test_a_version_rebuilt_from_its_delta_is_the_published_checkpoint_bit_for_bit(tmp_path, dtype, shard):
    versions = VersionedRun(tmp_path, dtype, max_shard_bytes=shard)
    new_dir = versions.next_dir()
    summary = write_delta(versions.run, 1, new_dir)
    assert (summary.version, summary.parent) == (1, 0)
    assert summary.full_bytes == sum(p.stat().st_size for p in new_dir.iterdir())
    checkpoint.publish_dir(versions.run, new_dir, 1, parent=0, iteration=1)
    out = tmp_path / "rebuilt"
    out.mkdir()
    fetched = apply_delta(versions.run, 1, checkpoint.fetch(versions.run, 0), out)
    assert same_files(out, new_dir)
    assert fetched < summary.full_bytes
    index = read_index(versions.run, 1)
    weights = [n for n in new_dir.iterdir() if n.suffix == ".safetensors"]
    assert len(index.files) == len(weights) and (len(weights) == 1 if shard is None else len(weights) > 1)
    assert all(t.xor for f in index.files.values() for t in f.tensors)


def test_segments_roundtrip_any_bits():
    rng = np.random.default_rng(0)
    for dtype, lanes in (("F32", np.int32), ("BF16", np.int16), ("F16", np.int16), ("I8", np.uint8)):
        new, old = (rng.integers(-(2**15), 2**15, 64).astype(lanes).tobytes() for _ in range(2))
        for base in (old, None):
            segment = weight_delta.encode(new, base, dtype)
            assert weight_delta.decode(segment, len(new), base, dtype) == new
    assert weight_delta.decode(weight_delta.encode(b"", None, "F32"), 0, None, "F32") == b""
    with pytest.raises(DeltaUnusable, match="decompress"):
        weight_delta.decode(b"not zstd", 8, None, "F32")


def test_the_blob_is_the_same_on_one_thread_or_many_with_any_window(tmp_path, monkeypatch):
    """The tensors encode on encode_threads() threads, their segments written in the file's order: the blob, its
    tensor entries and the file's digest do not depend on the thread count or on how many bytes are in flight."""
    versions = VersionedRun(tmp_path, torch.bfloat16)
    new_dir = versions.next_dir()
    (weights,) = [p for p in new_dir.iterdir() if p.suffix == ".safetensors"]
    layout = weight_delta.read_layout(weights)
    blobs = {}
    with weight_delta.TensorReader(versions.dirs[0]) as parent:
        for threads, window in ((1, 1 << 30), (4, 1 << 30), (3, 1)):  # window 1: one tensor in flight at a time
            monkeypatch.setattr(weight_delta, "ENCODE_WINDOW_BYTES", window)
            out = tmp_path / f"blob-{threads}-{window}"
            written = weight_delta._write_blob(layout, parent, out, threads=threads)
            blobs[(threads, window)] = (out.read_bytes(), written)
        given = weight_delta._write_blob(layout, parent, tmp_path / "given", checkpoint.file_digest(weights)[1])
    assert len({blob for blob, _ in blobs.values()}) == 1
    assert len({repr(written) for _, written in blobs.values()}) == 1
    assert repr(given) == repr(blobs[(1, 1 << 30)][1])  # the caller's digest is the one hashed here
    assert weight_delta.encode_threads() >= 1


def test_an_unchanged_bf16_tensor_costs_almost_nothing(tmp_path):
    versions = VersionedRun(tmp_path, torch.bfloat16)
    summary = write_delta(versions.run, 1, versions.dirs[0])  # v1 == v0: every XOR is zero
    assert summary.delta_bytes < 0.05 * summary.full_bytes


def test_writing_twice_writes_nothing_new_and_a_stale_delta_is_replaced(tmp_path, monkeypatch):
    versions = VersionedRun(tmp_path)
    new_dir = versions.next_dir()
    first = write_delta(versions.run, 1, new_dir)
    stored = {key: versions.run.get_bytes(key) for key in versions.run.list(delta_prefix(1))}
    puts = []
    monkeypatch.setattr(Store, "put_file", lambda self, *a: puts.append(a))
    assert write_delta(versions.run, 1, new_dir) == first  # a publish retry
    assert puts == []
    monkeypatch.undo()
    assert {key: versions.run.get_bytes(key) for key in versions.run.list(delta_prefix(1))} == stored
    # A retried update wrote other weights for the same, still unpublished, version: the delta follows them.
    other = VersionedRun(tmp_path / "other", seed=1).next_dir()
    replaced = write_delta(versions.run, 1, other)
    assert read_index(versions.run, 1).describes(1, checkpoint.describe_dir(other))
    assert replaced != first


def test_no_delta_for_the_first_version_or_without_a_parent(tmp_path):
    versions = VersionedRun(tmp_path)
    assert write_delta(versions.run, 0, versions.dirs[0]) is None
    lines = []
    assert write_delta(versions.run, 5, versions.dirs[0], log=lines.append) is None
    assert "parent v000004 is not published" in lines[0]
    assert versions.run.list("deltas/") == []


def rebuild(versions: VersionedRun, version: int, tmp_path):
    out = tmp_path / f"rebuilt-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    return apply_delta(versions.run, version, checkpoint.fetch(versions.run, version - 1), out)


def forge_segment(run: Store, version: int, tensor_number: int) -> str:
    """Rewrite one tensor's segment so that it rebuilds other bytes, with DELTA.json's sizes and offsets made to
    match and the store's digests following: only the tensor's sha256 can tell. Returns the tensor's name."""
    name = "model.safetensors"
    key, entry = delta_blob_key(version, name), json.loads(run.get_bytes(delta_index_key(version)))
    blob, meta = run.get_bytes(key), entry["files"][name]
    t = meta["tensors"][tensor_number]
    start, end = t["offset"], t["offset"] + t["compressed"]
    flipped = bytearray(weight_delta.decode(blob[start:end], t["size"], None, t["dtype"]))
    flipped[0] ^= 1
    segment = weight_delta.encode(bytes(flipped), None, t["dtype"])
    shift = len(segment) - t["compressed"]
    for other in meta["tensors"]:
        other["offset"] += shift if other["offset"] > start else 0
    t["compressed"], meta["blob_bytes"] = len(segment), meta["blob_bytes"] + shift
    run.put_bytes(key, blob[:start] + segment + blob[end:])
    run.put_json(delta_index_key(version), entry)
    return t["name"]


def test_a_segment_that_does_not_rebuild_its_sha256_is_detected(tmp_path):
    versions = VersionedRun(tmp_path)
    versions.publish_next()
    name = forge_segment(versions.run, 1, 3)
    with pytest.raises(DeltaUnusable, match=f"tensor {name} does not rebuild its sha256"):
        rebuild(versions, 1, tmp_path)


def test_a_blob_changed_behind_the_stores_back_or_an_unreadable_index_is_detected(tmp_path):
    versions = VersionedRun(tmp_path)
    versions.publish_next()
    local = tmp_path / "run" / delta_blob_key(1, "model.safetensors")
    raw = bytearray(local.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    local.write_bytes(bytes(raw))  # the store's recorded digest no longer matches
    with pytest.raises(DeltaUnusable, match="corrupted"):
        rebuild(versions, 1, tmp_path)
    versions.run.put_bytes(delta_index_key(1), b"{not json")
    with pytest.raises(DeltaUnusable, match="unreadable delta index"):
        read_index(versions.run, 1)


def test_an_unfinished_or_stale_delta_is_not_applied(tmp_path):
    versions = VersionedRun(tmp_path)
    versions.publish_next()
    versions.run.delete(delta_index_key(1))  # blobs without DELTA.json: a publish killed while writing it
    assert read_index(versions.run, 1) is None
    with pytest.raises(DeltaUnusable, match="no delta"):
        rebuild(versions, 1, tmp_path)
    stale = write_delta(versions.run, 2, versions.next_dir())  # v2's delta, but another v2 gets published
    assert stale is not None
    other = VersionedRun(tmp_path / "other", seed=1)
    other.next_dir()
    checkpoint.publish_dir(versions.run, other.next_dir(), 2, parent=1, iteration=2)
    with pytest.raises(DeltaUnusable, match="stale"):
        rebuild(versions, 2, tmp_path)


def test_publish_writes_the_delta_before_the_manifest_and_a_retry_keeps_it(tmp_path, monkeypatch):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})  # a real update: v1 is one AdamW step from v0
    order = []
    real_publish_dir = checkpoint.publish_dir
    monkeypatch.setattr(
        checkpoint,
        "publish_dir",
        lambda *a, **k: (order.append(run.exists(delta_index_key(1))), real_publish_dir(*a, **k))[1],
    )
    manifest = publish(run_uri, 1)
    assert order == [True]
    out = tmp_path / "rebuilt"
    out.mkdir()
    apply_delta(run, 1, checkpoint.fetch(run, 0), out)
    assert same_files(out, checkpoint.fetch(run, 1))
    stored = {key: run.get_bytes(key) for key in run.list(delta_prefix(1))}
    assert publish(run_uri, 1).same_content(manifest)
    assert {key: run.get_bytes(key) for key in run.list(delta_prefix(1))} == stored


def test_publish_writes_no_delta_when_the_run_says_so(tmp_path):
    run_uri, run = updated_run(tmp_path, checkpoint={"deltas": False})
    publish(run_uri, 1)
    assert run.list("deltas/") == []


def test_retention_deletes_a_deleted_versions_delta(tmp_path):
    versions = VersionedRun(tmp_path)
    for _ in range(3):
        versions.publish_next()
    assert sorted({k.split("/")[1] for k in versions.run.list("deltas/")}) == ["v000001", "v000002", "v000003"]
    stray = write_delta(versions.run, 4, versions.next_dir())  # a publish of v4 under way: not touched
    assert stray is not None
    assert clean_up(versions.run, 3, keep_last=2) == [1]
    assert sorted({k.split("/")[1] for k in versions.run.list("deltas/")}) == ["v000002", "v000003", "v000004"]


def test_the_update_indexes_its_delta_as_the_version_publish_then_publishes(tmp_path, monkeypatch):
    """The update's rank wrote its weight file's blob and rank 0 indexed it after CANDIDATE.json: DELTA.json
    lists every file of v1 exactly as publish then publishes it (MANIFEST.json), and publish keeps it without
    reading v(i-1). A blob lost makes publish write the delta itself, the same bytes."""
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})
    marker = run.get_json("candidates/iter-000001/CANDIDATE.json")
    assert set(marker["weight_deltas"]) == {"model.safetensors"}
    early = read_index(run, 1)
    assert early is not None and checkpoint.read_manifest(run, 1) is None  # usable before it is published
    assert weight_delta.version_files(run, 1) == early.version_files()
    blob = run.get_bytes(delta_blob_key(1, "model.safetensors"))
    wrote = []
    real_write_delta = weight_delta.write_delta
    monkeypatch.setattr(weight_delta, "write_delta", lambda *a, **k: (wrote.append(a[1]), real_write_delta(*a, **k))[1])

    stored = {key: run.get_bytes(key) for key in run.list(delta_prefix(1))}
    manifest = publish(run_uri, 1)
    assert wrote == [] and early.describes(1, manifest.files)  # kept: what servers took is what got published
    assert {key: run.get_bytes(key) for key in run.list(delta_prefix(1))} == stored

    again_uri, again = updated_run(tmp_path / "again", rollout={"servers": 1})
    again.delete(delta_blob_key(1, "model.safetensors"))  # as if lost
    publish(again_uri, 1)
    assert wrote == [1] and again.get_bytes(delta_blob_key(1, "model.safetensors")) == blob  # written again, the same
    assert read_index(again, 1) == early
    files = checkpoint.describe_dir(checkpoint.fetch(again, 1))
    assert weight_delta.adopt(again, 1, files, None, {}) is None  # no blobs listed: not adopted
