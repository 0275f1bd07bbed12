"""WeightSync (steps/engines/weight_sync.py): an engine is brought to a version from the node cache, by deltas when
they are
all there and else in full; a missing or corrupt delta falls back to the full checkpoint; two syncs on one node
fetch a version once; the cache keeps the last two versions."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from delta_helpers import VersionedRun, same_files
from test_weight_delta import forge_segment

from steps.engines.weight_sync import CACHE_ENV, WeightSync, default_cache_dir
from steps.run import checkpoint
from steps.run.keys import delta_index_key, delta_prefix
from steps.run.serving import Unavailable


class RecordingEngine:
    """Keeps a copy of every dir it was told to load (the dir may be evicted later)."""

    name = "recording"

    def __init__(self) -> None:
        self.loaded: list[dict[str, bytes]] = []

    def update_weights(self, model_dir: Path) -> None:
        self.loaded.append({p.name: p.read_bytes() for p in Path(model_dir).iterdir()})


def holds(engine: RecordingEngine, directory: Path) -> bool:
    return engine.loaded[-1] == {p.name: p.read_bytes() for p in directory.iterdir()}


@pytest.fixture
def versions(tmp_path):
    versions = VersionedRun(tmp_path)
    for _ in range(3):
        versions.publish_next()
    return versions


def full_bytes(versions: VersionedRun, version: int) -> int:
    return sum(int(m["size"]) for m in checkpoint.require_manifest(versions.run, version).files.values())


def test_the_first_bring_fetches_in_full_and_the_next_ones_by_delta(versions, tmp_path):
    sync, engine = WeightSync(versions.run, tmp_path / "cache"), RecordingEngine()
    first = sync.bring(engine, None, 0)
    assert (first.path, first.version) == ("full", 0)
    assert first.bytes_fetched > full_bytes(versions, 0)  # the files and MANIFEST.json
    assert holds(engine, versions.dirs[0])
    step = sync.bring(engine, 0, 1)
    assert step.path == "delta" and 0 < step.bytes_fetched < full_bytes(versions, 1)
    assert holds(engine, versions.dirs[1]) and same_files(sync.version_dir(1), versions.dirs[1])
    jump = sync.bring(engine, 1, 3)  # v2 and v3's deltas in turn
    assert jump.path == "delta" and holds(engine, versions.dirs[3])
    assert sync.cached_versions() == [2, 3]  # the last two
    assert sync.bring(engine, 3, 3).path == "none" and len(engine.loaded) == 3


def test_deltas_that_cost_more_than_the_checkpoint_are_not_used(tmp_path):
    versions = VersionedRun(tmp_path, lr=1e-2)  # steps so large that two deltas weigh more than a checkpoint
    for _ in range(2):
        versions.publish_next()
    sync, engine = WeightSync(versions.run, tmp_path / "cache"), RecordingEngine()
    sync.bring(engine, None, 0)
    assert sync.bring(engine, 0, 2).path == "full" and holds(engine, versions.dirs[2])


def test_a_missing_delta_means_the_full_checkpoint(versions, tmp_path):
    sync, engine = WeightSync(versions.run, tmp_path / "cache"), RecordingEngine()
    sync.bring(engine, None, 0)
    versions.run.delete(delta_index_key(2))  # v2's delta unfinished: v3 cannot be reached by deltas
    result = sync.bring(engine, 0, 3)
    assert result.path == "full" and holds(engine, versions.dirs[3])
    versions.run.delete_prefix(delta_prefix(1))
    assert WeightSync(versions.run, tmp_path / "other").bring(engine, None, 0).path == "full"


def test_a_corrupt_delta_is_refused_with_a_warning_and_the_full_checkpoint_fetched(versions, tmp_path):
    lines = []
    sync, engine = WeightSync(versions.run, tmp_path / "cache", log=lines.append), RecordingEngine()
    sync.bring(engine, None, 1)
    name = forge_segment(versions.run, 2, 1)
    result = sync.bring(engine, 1, 2)
    assert result.path == "full" and holds(engine, versions.dirs[2])
    assert same_files(sync.version_dir(2), versions.dirs[2])
    assert len(lines) == 1 and f"tensor {name} does not rebuild its sha256" in lines[0]
    assert "fetching the full checkpoint v000002" in lines[0]
    assert not [p for p in sync.root.iterdir() if p.name.startswith(".staging")]


def test_two_syncs_on_one_node_fetch_each_version_once(versions, tmp_path):
    cache = tmp_path / "cache"
    WeightSync(versions.run, cache).bring(RecordingEngine(), None, 0)
    engines = [RecordingEngine() for _ in range(4)]
    results = [None] * 4

    def bring(k: int) -> None:
        results[k] = WeightSync(versions.run, cache).bring(engines[k], 0, 1)  # each server its own WeightSync

    threads = [threading.Thread(target=bring, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.path for r in results) == ["cache", "cache", "cache", "delta"]
    assert sum(r.bytes_fetched for r in results) == next(r.bytes_fetched for r in results if r.path == "delta")
    assert all(holds(engine, versions.dirs[1]) for engine in engines)


def test_a_version_neither_published_nor_indexed_is_answered_503(versions, tmp_path):
    """Asked for only after the update that indexes it, such a version is a moment's gap or damage: retried."""
    with pytest.raises(Unavailable, match="v000007 is neither published .* nor indexed .* absent.*retried"):
        WeightSync(versions.run, tmp_path / "cache").bring(RecordingEngine(), None, 7)


def test_the_cache_is_the_nodes_own_directory_by_default(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "node"))
    assert default_cache_dir() == tmp_path / "node"
    monkeypatch.delenv(CACHE_ENV)
    assert default_cache_dir().name == "moerl-node-cache"


def test_an_engine_opened_from_the_cache_is_brought_on_by_delta(versions, tmp_path):
    """A server opens its first engine on the node cache's dir (WeightSync.open), so its first bring starts
    from a cached version: a delta, not a second whole checkpoint."""
    sync = WeightSync(versions.run, tmp_path / "cache")
    opened: list[Path] = []

    def opener(model_dir: Path) -> RecordingEngine:
        opened.append(model_dir)
        engine = RecordingEngine()
        engine.update_weights(model_dir)
        return engine

    engine = sync.open(0, opener)
    assert opened == [sync.version_dir(0)] and holds(engine, versions.dirs[0])
    assert sync.bring(engine, 0, 1).path == "delta" and holds(engine, versions.dirs[1])
