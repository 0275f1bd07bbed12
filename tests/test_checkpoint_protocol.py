"""The checkpoint protocol: MANIFEST last, LATEST after it, verified reads, retention."""

from pathlib import Path

import pytest

from steps.errors import MoerlError
from steps.run import checkpoint
from steps.run import keys as run_store
from steps.store.object_store import Store


def make_dir(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture
def run(tmp_path):
    return Store.open(str(tmp_path / "run"))


def test_publish_writes_manifest_and_moves_latest(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"config.json": b"{}", "model.safetensors": b"w" * 100})
    assert checkpoint.read_latest(run) is None
    manifest = checkpoint.publish_dir(run, src, version=0, parent=None, iteration=0)
    assert checkpoint.read_latest(run) == "v000000"
    assert set(manifest.files) == {"config.json", "model.safetensors"}
    assert manifest.files["model.safetensors"]["size"] == 100
    stored = checkpoint.read_manifest(run, 0)
    assert stored is not None and stored.same_content(manifest)
    assert run.list("checkpoints/v000000/") == [
        "checkpoints/v000000/MANIFEST.json",
        "checkpoints/v000000/config.json",
        "checkpoints/v000000/model.safetensors",
    ]


def test_publish_is_idempotent_and_refuses_changed_content(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"a.json": b"1"})
    first = checkpoint.publish_dir(run, src, version=1, parent=0, iteration=1)
    again = checkpoint.publish_dir(run, src, version=1, parent=0, iteration=1)
    assert again.created_at == first.created_at  # the stored manifest was not rewritten
    (src / "a.json").write_bytes(b"2")
    with pytest.raises(MoerlError, match="already published with different content"):
        checkpoint.publish_dir(run, src, version=1, parent=0, iteration=1)


def test_latest_never_moves_backwards(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"a.json": b"1"})
    checkpoint.publish_dir(run, src, version=2, parent=1, iteration=2)
    checkpoint.publish_dir(run, src, version=1, parent=0, iteration=1)
    assert checkpoint.latest_version(run) == 2


def test_unfinished_version_is_refused(run, tmp_path):
    run.put_bytes("checkpoints/v000003/model.safetensors", b"partial")
    with pytest.raises(MoerlError, match="unfinished"):
        checkpoint.download(run, 3, tmp_path / "out")


def test_corrupted_file_is_refused(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"model.safetensors": b"good weights"})
    checkpoint.publish_dir(run, src, version=0, parent=None, iteration=0)
    # Overwrite through the store so its own digest matches: only the manifest can catch it.
    run.put_bytes("checkpoints/v000000/model.safetensors", b"evil weights")
    with pytest.raises(MoerlError, match="corrupted"):
        checkpoint.download(run, 0, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_missing_file_is_refused(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"model.safetensors": b"w", "config.json": b"{}"})
    checkpoint.publish_dir(run, src, version=0, parent=None, iteration=0)
    run.delete("checkpoints/v000000/config.json")
    with pytest.raises(MoerlError, match="missing from checkpoint"):
        checkpoint.download(run, 0, tmp_path / "out")


def test_download_roundtrip_and_cache_reuse(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"config.json": b"{}", "sub/x.bin2": b"x" * 10})
    checkpoint.publish_dir(run, src, version=0, parent=None, iteration=0)
    out = checkpoint.download(run, 0, tmp_path / "out")
    assert (out / "sub" / "x.bin2").read_bytes() == b"x" * 10
    assert not (out / "MANIFEST.json").exists()
    mtime = (out / "config.json").stat().st_mtime_ns
    checkpoint.download(run, 0, out)
    assert (out / "config.json").stat().st_mtime_ns == mtime


def test_retention_keeps_last_k_and_the_reference(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"a.json": b"1"})
    for version in range(6):
        checkpoint.publish_dir(run, src, version=version, parent=version - 1 if version else None, iteration=version)
    deleted = checkpoint.apply_retention(run, keep_last=2)
    assert deleted == [1, 2, 3]
    assert checkpoint.published_versions(run) == [0, 4, 5]
    assert run.list("checkpoints/v000002/") == []
    assert checkpoint.read_latest(run) == "v000005"


def test_bad_version_names():
    assert run_store.parse_version("v000012") == 12
    for bad in ["12", "v12", "x000012", "v00001a"]:
        with pytest.raises(MoerlError, match="bad checkpoint version name"):
            run_store.parse_version(bad)


def test_one_file_of_a_version_is_read_verified(run, tmp_path):
    src = make_dir(tmp_path / "ckpt", {"config.json": b'{"dtype": "bfloat16"}', "model.safetensors": b"w" * 10})
    checkpoint.publish_dir(run, src, version=0, parent=None, iteration=0)
    assert checkpoint.read_file(run, 0, "config.json") == b'{"dtype": "bfloat16"}'
    with pytest.raises(MoerlError, match="checkpoint v000000 has no tokenizer.json; republish it"):
        checkpoint.read_file(run, 0, "tokenizer.json")
    run.put_bytes("checkpoints/v000000/config.json", b'{"dtype": "float32"}')
    with pytest.raises(MoerlError, match="size or sha256 differs from MANIFEST.json"):
        checkpoint.read_file(run, 0, "config.json")
    with pytest.raises(MoerlError, match="v000001 is unfinished"):
        checkpoint.read_file(run, 1, "config.json")
