"""A version is usable from its delta before it is published (steps/run/weight_delta.py, steps/training/
publication.py): once the update indexed v(i), a rollout server brings its engine to v(i) from v(i-1) and the
delta, bit for bit the checkpoint publish then writes; the version's tokenizer and held-out evaluation read it
too, also when its parent is only indexed. An indexed version is final: publish refuses another candidate (and
says how to start over when it refuses the candidate itself), the update refuses to train it again; a crash
between the candidate and its index is mended by the retry; a node cache built as another version than the
run's now is rebuilt; a corrupt delta of a version not published yet is retried, never fetched whole; a
trainer that stays up trains from the indexed version it holds and otherwise waits for its publish."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from delta_helpers import VersionedRun, same_files
from test_publish_step import assert_nothing_published, updated_run
from test_weight_delta import forge_segment
from test_weight_sync import RecordingEngine, holds

from steps.engines.weight_sync import WeightSync
from steps.errors import MoerlError
from steps.experience.rollout_plan import version_tokenizer
from steps.publish import publish
from steps.run import checkpoint, weight_delta
from steps.run.keys import delta_copy_key, delta_index_key, delta_prefix
from steps.run.serving import Unavailable
from steps.store.object_store import Store
from steps.training import trainer_server
from steps.training.held_state import HeldState
from steps.training.trainer_server import TrainerService
from steps.training.update import run_update


def test_a_server_takes_the_version_from_its_delta_before_publish_and_holds_the_published_bits(tmp_path):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})
    assert checkpoint.read_manifest(run, 1) is None and weight_delta.read_index(run, 1) is not None
    warm, engine = WeightSync(run, tmp_path / "warm"), RecordingEngine()
    assert warm.bring(engine, None, 0).path == "full"
    step = warm.bring(engine, 0, 1)  # the node holds v0: only the delta is read
    assert step.path == "delta" and step.version == 1
    cold, late = WeightSync(run, tmp_path / "cold"), RecordingEngine()
    joined = cold.bring(late, None, 1)  # a server that joins now: v0 whole, then the delta
    assert joined.path == "delta" and joined.bytes_fetched > step.bytes_fetched
    tokenizer = version_tokenizer(run, 1)
    evaluated = weight_delta.fetch_version(run, 1)  # what score's held-out evaluation of v1 reads

    publish(run_uri, 1)
    published = checkpoint.fetch(run, 1)
    assert holds(engine, published) and holds(late, published)
    assert same_files(warm.version_dir(1), published) and same_files(evaluated, published)
    assert tokenizer.stop_ids == version_tokenizer(run, 1).stop_ids
    assert warm.bring(RecordingEngine(), None, 1).path == "cache"  # the same files: the cached dir serves


def test_publish_refuses_a_candidate_other_than_the_one_the_version_was_indexed_from(tmp_path):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})
    index = json.loads(run.get_bytes(delta_index_key(1)))
    index["copies"]["config.json"]["sha256"] = "0" * 64  # servers took a v1 with another config.json
    run.put_bytes(delta_index_key(1), json.dumps(index).encode())
    with pytest.raises(MoerlError, match="v000001 was indexed from another candidate"):
        publish(run_uri, 1)
    assert_nothing_published(run)


def test_update_force_refuses_to_retrain_an_indexed_version(tmp_path):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})
    marker = run.get_bytes("candidates/iter-000001/CANDIDATE.json")
    with pytest.raises(MoerlError, match="an indexed version is final"):
        run_update(run_uri, 1, force=True)
    assert run.get_bytes("candidates/iter-000001/CANDIDATE.json") == marker
    plain_uri, plain = updated_run(tmp_path / "plain", checkpoint={"deltas": False}, rollout={"servers": 1})
    assert weight_delta.read_index(plain, 1) is None
    assert run_update(plain_uri, 1, force=True) is not None  # nothing was indexed: --force retrains


def test_a_crash_between_the_candidate_and_its_index_is_mended_by_the_retry(tmp_path, capsys):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})
    stored = {key: run.get_bytes(key) for key in run.list(delta_prefix(1))}
    run.delete(delta_index_key(1))
    run.delete(delta_copy_key(1, "config.json"))
    assert weight_delta.version_files(run, 1) is None  # not usable: rollout waits for the update's retry
    assert run_update(run_uri, 1) is None  # the candidate is complete: nothing to train
    assert "usable by rollout servers before it is published" in capsys.readouterr().out
    assert {key: run.get_bytes(key) for key in run.list(delta_prefix(1))} == stored


def test_a_node_cache_built_as_another_version_than_the_runs_is_rebuilt(tmp_path):
    versions = VersionedRun(tmp_path)
    weight_delta.write_delta(versions.run, 1, versions.next_dir())  # v1 indexed, not published
    sync = WeightSync(versions.run, tmp_path / "cache")
    engine = RecordingEngine()
    sync.bring(engine, None, 0)
    assert sync.bring(engine, 0, 1).path == "delta" and holds(engine, versions.dirs[1])
    # v1 was never published; the run was mended and another v1 published (the indexed one deleted first).
    versions.run.delete_prefix(delta_prefix(1))
    other = VersionedRun(tmp_path / "other", seed=1)
    other_v1 = other.next_dir()
    weight_delta.write_delta(versions.run, 1, other_v1, parent_dir=versions.dirs[0])
    checkpoint.publish_dir(versions.run, other_v1, 1, parent=0, iteration=1)
    again = RecordingEngine()
    result = sync.bring(again, None, 1)
    assert result.path != "cache" and holds(again, other_v1)


def test_a_corrupt_delta_of_a_version_not_published_yet_is_retried_not_fetched_whole(tmp_path):
    versions = VersionedRun(tmp_path)
    weight_delta.write_delta(versions.run, 1, versions.next_dir())
    forge_segment(versions.run, 1, 3)
    sync = WeightSync(versions.run, tmp_path / "cache")
    engine = RecordingEngine()
    sync.bring(engine, None, 0)
    with pytest.raises(Unavailable, match="not published yet"):
        sync.bring(engine, 0, 1)
    assert sync.cached_versions() == [0]


def trainer(run: Store, held: HeldState | None, stopping: bool = False) -> SimpleNamespace:
    """What TrainerService._may_train_on reads of the trainer (rank 0, one rank: the broadcast is a no-op)."""
    service = SimpleNamespace(
        run=run, held=held, stopping=threading.Event(), log=print, _broadcast=lambda c: c, launcher=None, pending=None
    )
    for method in ("_wait_for_publish", "_trains_on_from_memory", "_optimizer_lost"):
        setattr(service, method, getattr(TrainerService, method).__get__(service))
    if stopping:
        service.stopping.set()
    return service


def test_a_trainer_that_stays_up_trains_on_the_indexed_version_it_holds_and_else_waits_for_its_publish(
    tmp_path, monkeypatch
):
    """update-(i+1) does not wait for publish-i when the trainer stays up (pipelines/workflow/graph.py): the
    trainer trains from the v(i) it holds as the run indexed it; one that does not hold it (restarted) waits for
    publish to write v(i), then reloads it from the store; told to stop meanwhile, it answers 503."""
    monkeypatch.setattr(trainer_server, "PUBLISH_POLL_S", 0.01)
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1}, trainer={"server": True})
    files = weight_delta.version_files(run, 1)
    digests = sorted((int(m["size"]), str(m["sha256"])) for n, m in files.items() if n.endswith(".safetensors"))
    held = HeldState(1, torch.float32, None, {}, {}, digests)  # type: ignore[arg-type]
    may_train_on = TrainerService._may_train_on
    assert may_train_on(trainer(run, held), 2) is True  # from memory, v1 not published
    other = HeldState(1, torch.float32, None, {}, {}, [(1, "0" * 64)])  # type: ignore[arg-type]
    for restarted in (None, other):
        with pytest.raises(Unavailable, match="stopped while waiting for v000001's publish"):
            may_train_on(trainer(run, restarted, stopping=True), 2)
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(may_train_on(trainer(run, None), 2)))
    waiting.start()
    publish(run_uri, 1)
    waiting.join(timeout=120)
    assert answers == [False]  # reloaded from the store, now published
    assert may_train_on(trainer(run, held), 2) is True


def test_a_trainer_waits_for_a_publish_at_most_trainer_publish_wait_s_then_names_it(tmp_path):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1}, trainer={"server": True, "publish_wait_s": 0})
    refused = r"v000001 is not published after 0 s \(trainer.publish_wait_s\).*steps.publish"
    with pytest.raises(MoerlError, match=refused):
        TrainerService._may_train_on(trainer(run, None), 2)


def test_a_version_whose_parent_is_only_indexed_too_is_rebuilt_from_the_nearest_published_one(tmp_path):
    """With the trainer that stays up, v(i) can be indexed while v(i-1) still is only indexed: the held-out
    evaluation and a server with nothing cached build v(i) from the nearest published version and both deltas."""
    versions = VersionedRun(tmp_path)
    versions.publish_next()
    versions.publish_next()
    for version in (1, 2):  # published with their deltas, then as if their publish had not happened yet
        versions.run.delete(f"checkpoints/v{version:06d}/MANIFEST.json")
    assert weight_delta.version_files(versions.run, 2) is not None
    assert same_files(weight_delta.fetch_version(versions.run, 2), versions.dirs[2])
    sync, engine = WeightSync(versions.run, tmp_path / "cold"), RecordingEngine()
    result = sync.bring(engine, None, 2)
    assert result.path == "delta" and holds(engine, versions.dirs[2])
    assert sync.cached_versions() == [1, 2]  # v0 fetched whole, then both deltas; the two newest kept


def test_the_update_never_trains_an_indexed_version_again_even_with_its_candidate_deleted(tmp_path):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})
    run.delete_prefix("candidates/iter-000001/")
    with pytest.raises(MoerlError, match="^.*v000001 was indexed from its candidate .* an indexed version is final"):
        run_update(run_uri, 1)


def test_publish_refusing_an_indexed_candidate_says_how_to_start_over(tmp_path):
    run_uri, run = updated_run(tmp_path, rollout={"servers": 1})
    shard = next(k for k in run.list("candidates/iter-000001/") if "/optimizer-rank" in k)
    run.delete(shard)
    with pytest.raises(MoerlError, match="missing.*v000001 was indexed before publish.*iter-000002/ .*are deleted"):
        publish(run_uri, 1)
    assert_nothing_published(run)
