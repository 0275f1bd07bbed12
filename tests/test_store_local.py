"""The run store's behaviour, on every backend, then what is special to local disk.

The contract cases take the `store` fixture, which runs each of them twice: on a local directory and on
S3 (a moto server on loopback, see tests/conftest.py). S3-only behaviour lives in test_store_s3.py.
"""

import hashlib
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import steps.store.local as store_module
from steps.errors import MoerlError
from steps.store.backend import ObjectNotFound
from steps.store.object_store import Store


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Raw:
    """Reaches the stored bytes behind the store's back (what another tool or bit rot would do)."""

    def __init__(self, store: Store, server=None):
        self.store, self.server = store, server

    def _s3(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = self.store.uri.removeprefix("s3://").partition("/")
        return bucket, f"{prefix}/{key}" if prefix else key

    def overwrite_keeping_digest(self, key: str, data: bytes) -> None:
        """Replace the bytes, leaving the digest the store recorded: silent corruption."""
        if self.server is None:
            path = Path(self.store.uri.removeprefix("file://"), key)
            with open(path, "r+b") as f:  # in place, as a flipped bit or a buggy tool would
                f.truncate(0)
                f.write(data)
        else:
            bucket, full_key = self._s3(key)
            digest = {"sha256": self.store.sha256(key)}
            self.server.s3.put_object(Bucket=bucket, Key=full_key, Body=data, Metadata=digest)

    def write_foreign(self, key: str, data: bytes) -> None:
        """An object written by another tool: no digest recorded."""
        if self.server is None:
            path = Path(self.store.uri.removeprefix("file://"), key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        else:
            bucket, full_key = self._s3(key)
            self.server.s3.put_object(Bucket=bucket, Key=full_key, Body=data)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store.open(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_env")
    return Store.open(f"s3://{server.create_bucket()}/runs/r1")


@pytest.fixture
def raw(request, store):
    server = request.getfixturevalue("s3_server") if store.uri.startswith("s3://") else None
    return Raw(store, server)


# --- the contract, on every backend -----------------------------------------------------------------------


def test_bytes_json_and_file_roundtrip(store, tmp_path):
    data = os.urandom(300_000)
    assert store.put_bytes("a/blob.bin", data) == sha(data)
    assert store.get_bytes("a/blob.bin") == data
    assert store.sha256("a/blob.bin") == sha(data)
    assert store.size("a/blob.bin") == len(data)
    assert store.exists("a/blob.bin") and not store.exists("a/other.bin") and not store.exists("a")

    assert store.put_bytes("empty", b"") == sha(b"")
    assert store.get_bytes("empty") == b"" and store.size("empty") == 0

    obj = {"iteration": 3, "reward": [0.5, 1.0], "name": "ünïcode"}
    store.put_json("metrics/iter-000003.json", obj)
    assert store.get_json("metrics/iter-000003.json") == obj

    src = tmp_path / "src.safetensors"
    src.write_bytes(data[:1000])
    assert store.put_file("w/model.safetensors", src) == sha(data[:1000])
    out = tmp_path / "out" / "deep" / "model.safetensors"
    store.get_file("w/model.safetensors", out)
    assert out.read_bytes() == data[:1000]
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temp file left behind


def test_url_and_child_share_one_namespace(store):
    child = store.child("checkpoints/")
    assert child.uri == store.uri + "/checkpoints"
    assert child.url("v000001/config.json") == store.uri + "/checkpoints/v000001/config.json"
    child.put_bytes("v000001/config.json", b"{}")
    assert store.get_bytes("checkpoints/v000001/config.json") == b"{}"
    assert child.list() == ["v000001/config.json"]
    assert store.child("checkpoints").child("v000001").exists("config.json")


def test_list_is_sorted_recursive_relative_and_prefix_means_directory(store):
    for key in ["b", "a/2", "a/1", "a/sub/deep/x", "ab/1", ".gitattributes"]:
        store.put_bytes(key, key.encode())
    assert store.list() == [".gitattributes", "a/1", "a/2", "a/sub/deep/x", "ab/1", "b"]
    assert store.list("a") == store.list("a/") == ["a/1", "a/2", "a/sub/deep/x"]  # not ab/1
    assert store.list("a/sub") == ["a/sub/deep/x"]
    assert store.list("nothing/here") == []
    assert store.list("b") == []  # an object is not a directory


def test_overwrite_replaces_the_object_and_its_digest(store):
    store.put_bytes("LATEST", b"v000001\n")
    store.put_bytes("LATEST", b"v000002\n")
    assert store.get_bytes("LATEST") == b"v000002\n"
    assert store.sha256("LATEST") == sha(b"v000002\n")
    assert store.list() == ["LATEST"]  # no temp files or sidecars visible


def test_concurrent_reader_never_sees_a_partial_or_mixed_object(store):
    versions = [bytes([i]) * (200_000 + 50_000 * i) for i in range(3)]
    store.put_bytes("obj", versions[0])
    errors, seen = [], set()
    done = threading.Event()

    def writer():
        try:
            for i in range(24):
                store.put_bytes("obj", versions[i % 3])
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)
        finally:
            done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        data = store.get_bytes("obj")  # verified: a torn read would fail its digest
        assert data in versions
        seen.add(data[0])
    thread.join()
    assert not errors
    assert seen  # the reader did read while the writer was overwriting


def test_corrupted_object_is_detected(store, raw, tmp_path):
    good = b"good weights" * 100
    recorded = store.put_bytes("ckpt/model.safetensors", good)
    raw.overwrite_keeping_digest("ckpt/model.safetensors", b"evil weights" * 100)
    message = rf"corrupted: sha256 {sha(b'evil weights' * 100)} .* expected {recorded}"
    with pytest.raises(MoerlError, match=message) as e:
        store.get_bytes("ckpt/model.safetensors")
    assert store.url("ckpt/model.safetensors") in str(e.value)
    target = tmp_path / "dl" / "model.safetensors"
    with pytest.raises(MoerlError, match="corrupted"):
        store.get_file("ckpt/model.safetensors", target)
    assert not target.exists() and list(target.parent.iterdir()) == []  # nothing half-verified left behind
    assert store.get_bytes("ckpt/model.safetensors", verify=False) == b"evil weights" * 100


def test_object_written_by_another_tool_reads_unverified(store, raw):
    raw.write_foreign("foreign/data.jsonl", b'{"x": 1}\n')
    assert store.sha256("foreign/data.jsonl") is None
    assert store.get_bytes("foreign/data.jsonl") == b'{"x": 1}\n'
    assert store.list("foreign") == ["foreign/data.jsonl"]


BAD_KEYS = [
    "/etc/passwd", "../outside", "a/../../outside", "a/..", "..", ".", "a/./b", "a//b", "a/", "",
    "a\\..\\b", "a\x00b", ".moerl-sha256-x", "a/.moerl-tmp-1",
]  # fmt: skip


@pytest.mark.parametrize("key", BAD_KEYS)
def test_keys_cannot_escape_the_root(store, key, tmp_path):
    for attempt in (
        lambda: store.put_bytes(key, b"x"),
        lambda: store.get_bytes(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
        lambda: store.url(key),
        lambda: store.get_file(key, tmp_path / "x"),
    ):
        with pytest.raises(MoerlError, match="store key|store prefix"):
            attempt()
    if key not in ("", "a/"):  # valid prefixes: the whole store, and the directory a/
        for attempt in (lambda: store.child(key), lambda: store.list(key), lambda: store.delete_prefix(key)):
            with pytest.raises(MoerlError, match="store prefix|Store.child"):
                attempt()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "store") == []  # nothing written outside


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab./\\\x00", max_size=12))
def test_no_accepted_key_resolves_outside_the_root(key):
    root = "/srv/moerl/run"
    store = Store.open(root)  # no I/O
    try:
        path = store.url(key).removeprefix("file://")
    except MoerlError:
        return
    assert os.path.normpath(path) == path  # no '.', '..' or '//' left for the OS to interpret
    assert path.startswith(root + "/") and len(path) > len(root) + 1


def test_missing_object(store):
    for read in (store.get_bytes, store.size, store.sha256):
        with pytest.raises(ObjectNotFound, match="no such object") as e:
            read("nope/x")
        assert store.url("nope/x") in str(e.value)
        assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, MoerlError)
    assert not store.exists("nope/x")


def test_delete_and_delete_prefix(store):
    for key in ["v1/a", "v1/sub/b", "v10/a", "v1x", "keep"]:
        store.put_bytes(key, b"x")
    store.delete("keep")
    store.delete("keep")  # idempotent: a retried step may delete twice
    assert not store.exists("keep")
    store.delete_prefix("v1/")
    assert store.list() == ["v10/a", "v1x"]
    store.delete_prefix("v1")  # nothing left there: fine
    with pytest.raises(MoerlError, match="whole store"):
        store.delete_prefix("")
    assert store.list() == ["v10/a", "v1x"]


def test_upload_dir_and_download_dir(store, tmp_path):
    src = tmp_path / "ckpt"
    files = {
        "config.json": b"{}",
        "model-00001.safetensors": os.urandom(5000),
        "sub/tok/vocab.txt": b"a\nb\n",
        ".gitattributes": b"*.bin lfs\n",
        "empty": b"",
    }
    for name, data in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    uploaded = store.upload_dir(src, "checkpoints/v000000/")
    assert uploaded == {name: (len(data), sha(data)) for name, data in files.items()}
    assert store.list("checkpoints") == sorted(f"checkpoints/v000000/{name}" for name in files)
    out = tmp_path / "out"
    store.download_dir("checkpoints/v000000", out)
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert got == files


def test_check_access_passes_on_a_fresh_store(store):
    store.check_access()
    assert store.list() == []


# --- local disk -------------------------------------------------------------------------------------------


def test_local_uri_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Store.open("runs/r1").uri == f"file://{tmp_path}/runs/r1"
    assert Store.open("runs/r1/").uri == f"file://{tmp_path}/runs/r1"
    assert Store.open(f"file://{tmp_path}/runs/r1").uri == f"file://{tmp_path}/runs/r1"
    assert Store.open(f"file://localhost{tmp_path}/x").uri == f"file://{tmp_path}/x"
    assert Store.open("file://runs/r1").uri == f"file://{tmp_path}/runs/r1"  # relative, as fsspec reads it
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Store.open("~/r").uri == f"file://{tmp_path}/r"


BAD_URIS = ["", "   ", "gs://bucket/x", "http://host/x", "s3a://bucket/x", "file:/x", "s3:bucket/x", "file://"]


@pytest.mark.parametrize("uri", BAD_URIS)
def test_bad_uri_names_the_uri_and_the_accepted_forms(uri):
    accepted = "accepted forms: a local path .* file:///abs/runs/r1, or s3://bucket"
    with pytest.raises(MoerlError, match=accepted) as e:
        Store.open(uri)
    assert repr(uri) in str(e.value)


def test_local_bookkeeping_is_hidden_and_digest_is_a_sha256sum_line(tmp_path):
    store = Store.open(str(tmp_path / "s"))
    digest = store.put_bytes("d/model.bin", b"weights")
    on_disk = sorted(p.name for p in (tmp_path / "s" / "d").iterdir())
    sidecar = ".moerl-sha256-" + hashlib.sha256(b"model.bin").hexdigest()[:32]
    assert on_disk == [sidecar, "model.bin"]
    assert (tmp_path / "s" / "d" / sidecar).read_text() == f"{digest}  model.bin\n"
    (tmp_path / "s" / "d" / ".moerl-tmp-0123abcd").write_bytes(b"half a write from a killed process")
    assert store.list() == ["d/model.bin"]
    store.delete("d/model.bin")
    assert sorted(p.name for p in (tmp_path / "s" / "d").iterdir()) == [".moerl-tmp-0123abcd"]


def test_failed_write_leaves_the_old_object_and_no_temp_file(tmp_path, monkeypatch):
    store = Store.open(str(tmp_path / "s"))
    store.put_bytes("LATEST", b"v000001\n")
    src = tmp_path / "big"
    src.write_bytes(b"n" * 3_000_000)

    def copy_half_then_fail(fsrc, fdst, length=0):
        fdst.write(fsrc.read(1_000_000))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_module.shutil, "copyfileobj", copy_half_then_fail)
    with pytest.raises(MoerlError, match="no space left on device"):
        store.put_file("LATEST", src)
    assert store.get_bytes("LATEST") == b"v000001\n"
    assert not any(p.name.startswith(".moerl-tmp-") for p in (tmp_path / "s").iterdir())


def test_local_objects_get_umask_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        store = Store.open(str(tmp_path / "s"))
        store.put_bytes("x", b"1")
        store.get_file("x", tmp_path / "copy")
    finally:
        os.umask(umask)
    assert (tmp_path / "s" / "x").stat().st_mode & 0o777 == 0o644  # readable by other pods' users
    assert (tmp_path / "copy").stat().st_mode & 0o777 == 0o644


def test_local_check_access(tmp_path):
    Store.open(str(tmp_path / "not" / "yet")).check_access()
    assert not (tmp_path / "not").exists()  # checking creates nothing
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(MoerlError, match="not a directory"):
        Store.open(str(tmp_path / "file")).check_access()
    with pytest.raises(MoerlError, match="is a file, not a directory"):
        Store.open(str(tmp_path / "file" / "below")).check_access()


def test_key_that_is_also_a_prefix_is_a_clear_error_on_local_disk(tmp_path):
    store = Store.open(str(tmp_path / "s"))
    store.put_bytes("a/b", b"1")
    with pytest.raises(MoerlError, match="cannot be both an object and a prefix"):
        store.put_bytes("a", b"2")


def test_no_data_glob_matches_a_sidecar(tmp_path):
    """Issue 19: `.moerl-sha256-model-00001-of-00002.safetensors` beside the weights matched `*.safetensors`
    for anything that globs with pathlib. The sidecar's name now holds no part of the object's name."""
    store = Store.open(str(tmp_path / "s"))
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"]
    for name in names:
        store.put_bytes(f"ckpt/{name}", name.encode())
    directory = tmp_path / "s" / "ckpt"
    for pattern in ("*.safetensors", "model*.safetensors*", "*model*", "*.json", "*config*", "*-of-*"):
        assert all(not p.name.startswith(".moerl-") for p in directory.glob(pattern)), pattern
        assert all(not p.name.startswith(".moerl-") for p in (tmp_path / "s").rglob(pattern)), pattern
    assert sorted(p.name for p in directory.glob("*.safetensors")) == names[:2]
    assert store.get_bytes("ckpt/config.json") == b"config.json"


def test_sidecars_under_their_old_names_are_still_verified_then_replaced(tmp_path):
    """A store written before the rename (`.moerl-sha256-<name>`) still reads verified; a rewrite or a delete
    of the object takes the old sidecar with it."""
    store = Store.open(str(tmp_path / "s"))
    digest = store.put_bytes("d/w.bin", b"weights")
    directory = tmp_path / "s" / "d"
    new = next(p for p in directory.iterdir() if p.name.startswith(".moerl-sha256-"))
    old = directory / ".moerl-sha256-w.bin"
    new.rename(old)  # as an older moerl left it
    assert store.get_bytes("d/w.bin") == b"weights" and store.sha256("d/w.bin") == digest
    (directory / "w.bin").write_bytes(b"tampered")
    with pytest.raises(MoerlError, match="corrupted"):
        store.get_bytes("d/w.bin")
    store.put_bytes("d/w.bin", b"new weights")
    assert not old.exists()
    assert store.get_bytes("d/w.bin") == b"new weights"
    store.delete("d/w.bin")
    assert list(directory.iterdir()) == []
