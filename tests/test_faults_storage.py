"""Storage faults on local disk: a published checkpoint whose bytes were flipped is refused by the next reader
with one message that says so; a full disk stops a step with one message, leaves nothing half-written, and the
step finishes the job once there is space again.

The full disk is a tiny tmpfs (mounted where the tests run as root), else a simulated one: every write of the
store into the run directory fails with ENOSPC once a budget of bytes is used (tests/fault_hooks)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from faults_helpers import (
    assert_store_objects_intact,
    chunk_bytes,
    copy_tree,
    error_lines,
    leftovers,
    manifest_files,
    published,
    run,
    step_argv,
    step_env,
)

from steps.errors import MoerlError
from steps.run import checkpoint
from steps.run.keys import experience_prefix
from steps.store.object_store import Store

pytestmark = pytest.mark.faults

V1_WEIGHTS = "checkpoints/v000001/model.safetensors"


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def next_rollout(run_uri: str, cfg) -> list[str]:
    """Rollout of iteration 2: the first reader of v000001."""
    argv = step_argv("rollout", run_uri, cfg, 0)
    argv[argv.index("--iteration") + 1], argv[argv.index("--policy-version") + 1] = "2", "1"
    return argv


def test_flipped_bytes_in_a_published_checkpoint_are_refused_by_the_next_reader(fault_free_run, tmp_path):
    run_dir = copy_tree(fault_free_run.run_dir, tmp_path / "run")
    cfg = fault_free_run.config_for(run_dir.as_uri())
    flip_byte(run_dir / V1_WEIGHTS)  # bit rot under the file: the store's recorded digest catches it

    result = run(next_rollout(run_dir.as_uri(), cfg), step_env())
    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert f"{run_dir.as_uri()}/{V1_WEIGHTS}: corrupted: sha256 " in line
    assert "(recorded when it was written) — rewrite the object from its source" in line
    assert not Store.open(run_dir.as_uri()).list(experience_prefix(2))


def test_a_checkpoint_file_rewritten_with_other_bytes_is_refused_against_its_manifest(fault_free_run, tmp_path):
    run_dir = copy_tree(fault_free_run.run_dir, tmp_path / "run")
    run_store = Store.open(run_dir.as_uri())
    data = bytearray(run_store.get_bytes(V1_WEIGHTS))
    data[len(data) // 2] ^= 0x01
    run_store.put_bytes(V1_WEIGHTS, bytes(data))  # the store's digest follows; the checkpoint's MANIFEST does not

    result = run(next_rollout(run_dir.as_uri(), fault_free_run.config_for(run_dir.as_uri())), step_env())
    assert result.returncode == 2, result.stderr
    [line] = error_lines(result.stderr)
    assert f"{run_dir.as_uri()}/{V1_WEIGHTS}: size or sha256 differs from MANIFEST.json; the checkpoint is " \
           "corrupted — republish it from its candidate or restore the file" in line  # fmt: skip
    assert not run_store.list(experience_prefix(2))


def test_a_corrupted_local_copy_of_a_checkpoint_is_fetched_again(fault_free_run, tmp_path):
    run_dir = copy_tree(fault_free_run.run_dir, tmp_path / "run")
    run_store = Store.open(run_dir.as_uri())
    cached = checkpoint.fetch(run_store, 1)
    flip_byte(cached / "model.safetensors")
    assert checkpoint.fetch(run_store, 1) == cached  # the cached file fails its digest: fetched again
    meta = manifest_files(run_store, 1)["model.safetensors"]
    assert checkpoint.file_digest(cached / "model.safetensors") == (meta["size"], meta["sha256"])
    run_store.delete(V1_WEIGHTS)  # a file the manifest lists, gone from the store: refused, never half-loaded
    flip_byte(cached / "model.safetensors")
    with pytest.raises(MoerlError, match="missing from checkpoint v000001 although its manifest lists it"):
        checkpoint.fetch(run_store, 1)


# --- a full disk ----------------------------------------------------------------------------------------


class SmallDisk:
    """A directory on a filesystem of a given size: a tmpfs when one can be mounted, else simulated."""

    def __init__(self, path: Path, kib: int) -> None:
        self.path, self.kib = path, kib
        path.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0700", "tmpfs", str(path)],
                                 capture_output=True, check=False) if os.geteuid() == 0 else None  # fmt: skip
        self.tmpfs = mounted is not None and mounted.returncode == 0
        self.free_bytes = kib * 1024

    def fault(self) -> list[dict]:
        """What a step writing here needs: nothing on a tmpfs, the simulated full disk otherwise."""
        return [] if self.tmpfs else [{"enospc": f"^{self.path}", "free": self.free_bytes}]

    def fill(self) -> None:
        """Use up the free space, as another tenant of the volume would."""
        if not self.tmpfs:
            self.free_bytes = 0
            return
        with open(self.path / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError as err:
                assert err.errno == errno.ENOSPC

    def grow(self) -> None:
        """Free space: the filler goes and the volume grows (as a volume resize or a clean-up would)."""
        (self.path / "filler").unlink(missing_ok=True)
        if self.tmpfs:
            subprocess.run(["mount", "-o", "remount,size=65536k", str(self.path)], check=True)
        self.free_bytes = 64 << 20

    def unmount(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    disks: list[SmallDisk] = []

    def make(kib: int) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / f"disk{len(disks)}", kib))
        return disks[-1]

    yield make
    for disk in disks:
        disk.unmount()


def assert_nothing_half_written(run_dir: Path) -> None:
    run_store = Store.open(run_dir.as_uri())
    assert_store_objects_intact(run_store)  # every visible object is whole and verified
    assert leftovers(run_dir) == []  # the failed write cleaned up its staging file


def test_a_full_disk_stops_import_sft_with_one_message_and_the_rerun_completes(fault_free_run, small_disk):
    disk = small_disk(1024)  # room for the small files, not for the 2 MB of weights
    run_dir = disk.path / "run"
    cfg = fault_free_run.config_for(run_dir.as_uri())
    argv = [sys.executable, "-m", "steps.import_sft", "--src", fault_free_run.sft_dir.as_uri(),
            "--run", run_dir.as_uri(), "--run-config-json", json.dumps(cfg.model_dump(mode="json"))]  # fmt: skip

    full = run(argv, step_env(disk.fault()))
    assert full.returncode == 2, full.stderr
    [line] = error_lines(full.stderr)
    assert f"{run_dir.as_uri()}/checkpoints/v000000/model.safetensors: no space left on device — free space or " \
           "use another store" in line  # fmt: skip
    assert published(Store.open(run_dir.as_uri())) == (None, [])
    assert_nothing_half_written(run_dir)

    disk.grow()
    done = run(argv, step_env(disk.fault()))
    assert done.returncode == 0, done.stderr
    assert manifest_files(Store.open(run_dir.as_uri()), 0) == manifest_files(fault_free_run.store, 0)


def test_a_full_disk_stops_a_rollout_shard_and_the_rerun_resumes_to_the_same_chunks(fault_free_run, small_disk):
    disk = small_disk(8192)
    run_dir = disk.path / "run"
    cfg = fault_free_run.config_for(run_dir.as_uri())
    run_store = fault_free_run.copy_stage(run_dir.as_uri(), "rollout")
    disk.fill()
    argv = step_argv("rollout", run_dir.as_uri(), cfg, 0)

    full = run(argv, step_env(disk.fault()))
    assert full.returncode == 2, full.stderr
    [line] = error_lines(full.stderr)
    assert f"{run_dir.as_uri()}/experience/iter-000001/rollout/chunk-000000.parquet: no space left on device" in line
    assert chunk_bytes(run_store) == {}
    assert_nothing_half_written(run_dir)

    disk.grow()
    done = run(argv, step_env(disk.fault()))
    assert done.returncode == 0, done.stderr
    reference = chunk_bytes(fault_free_run.store)
    assert chunk_bytes(run_store) == {c: reference[c] for c in (0, 2)}  # shard 0's chunks
