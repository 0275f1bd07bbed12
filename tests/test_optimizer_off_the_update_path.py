"""The optimizer state off the update's path (steps/training/optimizer_write.py): a trainer that stays up
answers an update once the weights are stored and indexed and stores the optimizer shards afterwards; the
writers' receipts make CANDIDATE.json without any collective, and a failed writer ends rank 0's wait; publish
waits for CANDIDATE.json while WEIGHTS.json says the weights are complete, at most trainer.publish_wait_s; a
candidate whose optimizer shards were lost after its weights were indexed is replayed: trained again, the
weights checked bit for bit against WEIGHTS.json, only the optimizer shards and CANDIDATE.json written; a
replay that does not reproduce them is refused. (The trainer that stays up end to end, its loss after it
answered included: tests/test_trainer_server.py.)"""

from __future__ import annotations

import threading

import pytest
import torch
from test_publish_step import assert_nothing_published, updated_run

from pipelines.workflow.graph import segments
from steps.errors import MoerlError
from steps.publish import publish
from steps.run import candidate, checkpoint
from steps.run.candidate import MARKER, OPTIMIZER_RECEIPTS, WEIGHTS_MARKER
from steps.run.config import RunConfig
from steps.run.keys import candidate_prefix, delta_index_key
from steps.store.object_store import Store
from steps.training import optimizer_write
from steps.training.optimizer_write import OptimizerWrite
from steps.training.update import pending_iteration, run_update

SERVED = {"rollout": {"servers": 1}}  # the update's ranks write deltas and index v(I) after its weights


def lose_optimizer_shards(run: Store, iteration: int) -> dict:
    """Leave candidate `iteration` as a trainer lost after it answered does: WEIGHTS.json (and the indexed delta),
    no optimizer shard, receipt or CANDIDATE.json. Returns the CANDIDATE.json it had."""
    prefix = candidate_prefix(iteration)
    complete = run.get_json(f"{prefix}/{MARKER}")
    run.delete(f"{prefix}/{MARKER}")
    run.delete_prefix(f"{prefix}/{OPTIMIZER_RECEIPTS}/")
    for key in run.list(f"{prefix}/"):
        if key.rsplit("/", 1)[-1].startswith("optimizer-rank"):
            run.delete(key)
    return complete


def test_the_update_writes_weights_then_optimizer_and_candidate_json_lists_both(tmp_path):
    _, run = updated_run(tmp_path, **SERVED)
    prefix = candidate_prefix(1)
    weights, complete = run.get_json(f"{prefix}/{WEIGHTS_MARKER}"), run.get_json(f"{prefix}/{MARKER}")
    optimizer = {name for name in complete["files"] if name.startswith("optimizer-rank")}
    assert optimizer and not optimizer & set(weights["files"])
    assert set(complete["files"]) == set(weights["files"]) | optimizer
    assert complete["weight_deltas"] == weights["weight_deltas"]
    assert candidate.read_weights_marker(run, 1) == complete


def test_a_candidate_whose_optimizer_shards_were_lost_after_its_index_is_replayed_to_the_same_bytes(tmp_path):
    run_uri, run = updated_run(tmp_path, **SERVED)
    complete = lose_optimizer_shards(run, 1)
    assert run.exists(delta_index_key(1)) and candidate.read_marker(run, 1) is None
    work = pending_iteration(run, 1)
    assert work is not None and work.replay
    weights_before = run.get_bytes(f"{candidate_prefix(1)}/{WEIGHTS_MARKER}")
    run_update(run_uri, 1)
    assert run.get_bytes(f"{candidate_prefix(1)}/{WEIGHTS_MARKER}") == weights_before  # the weights not rewritten
    replayed = run.get_json(f"{candidate_prefix(1)}/{MARKER}")
    assert replayed["files"] == complete["files"]  # the optimizer shards as the first update wrote them
    publish(run_uri, 1)
    assert checkpoint.read_manifest(run, 1) is not None


def test_a_replay_that_does_not_reproduce_the_weights_is_refused(tmp_path):
    run_uri, run = updated_run(tmp_path, **SERVED)
    lose_optimizer_shards(run, 1)
    key = f"{candidate_prefix(1)}/{WEIGHTS_MARKER}"
    weights = run.get_json(key)
    name = next(n for n in weights["files"] if n.startswith("model-rank"))
    weights["files"][name]["sha256"] = "0" * 64  # as if the first update's arithmetic had differed
    run.put_json(key, weights)
    with pytest.raises(MoerlError, match=f"{name}: training iteration 1 again did not reproduce the weights"):
        run_update(run_uri, 1)
    assert candidate.read_marker(run, 1) is None


def test_weights_without_an_index_are_trained_again_from_scratch(tmp_path):
    run_uri, run = updated_run(tmp_path)  # no rollout servers: nothing indexed, nothing final
    lose_optimizer_shards(run, 1)
    work = pending_iteration(run, 1)
    assert work is not None and not work.replay
    run_update(run_uri, 1)
    assert candidate.read_marker(run, 1) is not None


def test_publish_waits_for_the_optimizer_shards_then_publishes(tmp_path, monkeypatch):
    run_uri, run = updated_run(tmp_path, trainer={"server": True}, **SERVED)
    complete = lose_optimizer_shards(run, 1)
    looked, real_read = threading.Event(), candidate.read_marker

    def read_marker(store, iteration):  # publish found no CANDIDATE.json at least once: it is waiting
        marker = real_read(store, iteration)
        if marker is None:
            looked.set()
        return marker

    monkeypatch.setattr(candidate, "read_marker", read_marker)
    stored = {}

    def trainer_stores_them():  # what OptimizerWrite's threads do after the trainer answered
        assert looked.wait(timeout=120)
        run_update(run_uri, 1)
        stored["marker"] = real_read(run, 1)

    later = threading.Thread(target=trainer_stores_them)
    published = []
    waiting = threading.Thread(target=lambda: published.append(publish(run_uri, 1)))
    waiting.start()
    later.start()
    later.join(timeout=300)
    waiting.join(timeout=300)
    assert stored["marker"]["files"] == complete["files"]
    assert published and checkpoint.read_manifest(run, 1) is not None


def test_publish_waits_at_most_publish_wait_s_and_names_the_way_out(tmp_path):
    _, run = updated_run(tmp_path, trainer={"server": True, "publish_wait_s": 0}, **SERVED)
    lose_optimizer_shards(run, 1)
    with pytest.raises(MoerlError, match=r"WEIGHTS.json\) but the optimizer shards did not come within 0 s"):
        publish(run.uri, 1)
    assert_nothing_published(run)


def test_publish_waits_only_where_a_trainer_stores_the_shards_after_it_answered(tmp_path):
    # update steps of their own, no deltas: a candidate without CANDIDATE.json is unfinished, trained again
    _, run = updated_run(tmp_path)
    lose_optimizer_shards(run, 1)
    with pytest.raises(MoerlError, match="no complete candidate"):
        publish(run.uri, 1)
    assert_nothing_published(run)


def test_publish_without_weights_is_refused_at_once(tmp_path):
    _, run = updated_run(tmp_path, **SERVED)
    run.delete_prefix(f"{candidate_prefix(1)}/")
    with pytest.raises(MoerlError, match="no complete candidate"):
        publish(run.uri, 1)


def weights_marker(iteration: int) -> dict:
    return {"iteration": iteration, "parent": iteration - 1, "files": {"model.safetensors": {"size": 1, "sha256": "a"}}}


def test_the_writers_receipts_make_candidate_json_without_a_collective(tmp_path):
    run = Store.open(tmp_path.as_uri())
    names = ["optimizer-rank00000-of-00002.safetensors", "optimizer-rank00001-of-00002.safetensors"]
    shards = [(name, {"w.exp_avg": torch.full((3,), float(r))}) for r, name in enumerate(names)]
    rank0 = OptimizerWrite(run, 4, shards[0], 0, names, weights_marker(4)).start()
    rank1 = OptimizerWrite(run, 4, shards[1], 1).start()  # another process's thread, in truth
    rank1.join()
    rank0.join()
    marker = candidate.read_marker(run, 4)
    assert set(marker["files"]) == {"model.safetensors", *names}
    for name in names:
        assert marker["files"][name]["sha256"] == run.sha256(f"{candidate_prefix(4)}/{name}")
        assert run.exists(candidate.receipt_key(4, name))


def test_a_failed_writer_ends_rank_0s_wait_with_its_error(tmp_path, monkeypatch):
    run = Store.open(tmp_path.as_uri())
    names = ["optimizer-rank00000-of-00002.safetensors", "optimizer-rank00001-of-00002.safetensors"]
    real_put = Store.put_file

    def failing_put(self, key, local):
        if key.endswith(names[1]):
            raise OSError("the store refused the part")
        return real_put(self, key, local)

    monkeypatch.setattr(Store, "put_file", failing_put)
    shards = [(name, {"w.exp_avg": torch.zeros(2)}) for name in names]
    rank1 = OptimizerWrite(run, 2, shards[1], 1).start()
    rank0 = OptimizerWrite(run, 2, shards[0], 0, names, weights_marker(2)).start()
    with pytest.raises(MoerlError, match="the store refused the part"):
        rank1.join()
    with pytest.raises(MoerlError, match=f"the writer of {names[1]} failed: OSError: the store refused the part"):
        rank0.join()
    assert candidate.read_marker(run, 2) is None


def test_rank_0_stops_waiting_when_cancelled(tmp_path, monkeypatch):
    monkeypatch.setattr(optimizer_write, "RECEIPT_POLL_S", 0.01)
    run = Store.open(tmp_path.as_uri())
    names = ["optimizer-rank00000-of-00002.safetensors", "optimizer-rank00001-of-00002.safetensors"]
    rank0 = OptimizerWrite(run, 3, (names[0], {"w.step": torch.zeros(())}), 0, names, weights_marker(3)).start()
    rank0.cancel()  # a peer's receipt never comes: its process is gone
    with pytest.raises(MoerlError, match="cancelled before every optimizer shard was stored"):
        rank0.join()
    assert candidate.read_marker(run, 3) is None


def test_segment_last_is_the_last_iteration_of_the_workflow_that_runs_it():
    for iterations, size in ((7, 3), (6, 3), (1, 25), (50, 25)):
        cfg = RunConfig(sft_checkpoint="file:///sft", run_store="file:///run", iterations=iterations, segment_size=size)
        for segment in segments(iterations, size):
            assert [cfg.segment_last(i) for i in segment.iterations] == [segment.last] * len(segment.iterations)


def test_a_writer_that_cannot_even_leave_a_receipt_is_found_when_the_ranks_agree(tmp_path, monkeypatch):
    """Two-phase join: every rank waits for its own part only; rank 0's wait for CANDIDATE.json is cancelled when
    a rank failed, so no rank waits for a receipt that never comes."""
    monkeypatch.setattr(optimizer_write, "RECEIPT_POLL_S", 0.01)
    run = Store.open(tmp_path.as_uri())
    names = ["optimizer-rank00000-of-00002.safetensors", "optimizer-rank00001-of-00002.safetensors"]

    real_file, real_json = Store.put_file, Store.put_json
    monkeypatch.setattr(Store, "put_file", lambda s, k, p: store_down_file(s, k, p))
    monkeypatch.setattr(Store, "put_json", lambda s, k, o: store_down_json(s, k, o))

    def store_down_file(store, key, path):
        if names[1] in key:
            raise OSError("the store is down")
        return real_file(store, key, path)

    def store_down_json(store, key, obj):
        if names[1] in key:
            raise OSError("the store is down")
        return real_json(store, key, obj)

    shards = [(name, {"w.exp_avg": torch.zeros(2)}) for name in names]
    rank0 = OptimizerWrite(run, 5, shards[0], 0, names, weights_marker(5)).start()
    rank1 = OptimizerWrite(run, 5, shards[1], 1).start()
    rank0.own_part()  # its own shard is stored
    with pytest.raises(MoerlError, match="the store is down"):
        rank1.own_part()  # no receipt, not even the error's
    rank0.cancel()  # what the ranks' agreement does on rank 0
    with pytest.raises(MoerlError, match="cancelled before every optimizer shard was stored"):
        rank0.join()
    assert candidate.read_marker(run, 5) is None


def test_the_trainer_answers_a_failed_write_503_so_that_the_retry_trains_it_again(tmp_path):
    from types import SimpleNamespace

    from steps.run.serving import Unavailable
    from steps.training.trainer_server import TrainerService

    run = Store.open(tmp_path.as_uri())
    mesh = SimpleNamespace(rank=0, world_group=None, world_size=1, ep_size=1, device=torch.device("cpu"))
    service = TrainerService(run, mesh, 0, None, None, print)
    failed = OptimizerWrite(run, 7, None, 0, ["optimizer-rank00000-of-00001.safetensors"], weights_marker(7))
    failed._own_error = OSError("disk full")  # its own part failed (the thread is never started)
    failed._own_done.set()
    service.pending = failed
    with pytest.raises(Unavailable, match="disk full.*the next update trains iteration 7 again"):
        service._join_pending()
    assert service.pending is None and failed._cancel.is_set()


def test_a_starting_trainer_replays_what_its_predecessor_lost_before_it_serves(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from steps.training.trainer_server import TrainerService

    _, run = updated_run(tmp_path, trainer={"server": True}, **SERVED)
    lose_optimizer_shards(run, 1)
    run.put_json(f"{candidate_prefix(3)}/{WEIGHTS_MARKER}", weights_marker(3))  # not indexed: nothing final
    mesh = SimpleNamespace(rank=0, world_group=None, world_size=1, ep_size=1, device=torch.device("cpu"))
    service = TrainerService(run, mesh, 0, None, None, print)
    replayed = []
    monkeypatch.setattr(service, "_train_again", replayed.append)
    service.recover()
    assert replayed == [1]


def test_only_a_trainer_that_holds_versions_defers_and_never_for_the_segments_last_update():
    def cfg(**overrides):
        fields = {"sft_checkpoint": "file:///sft", "run_store": "file:///run", "iterations": 6, "segment_size": 3}
        fields |= {"rollout": {"servers": 2}, "trainer": {"server": True}} | overrides
        return RunConfig(**fields)

    served = cfg()
    assert [candidate.optimizer_after_answer(served, i) for i in range(1, 7)] == [True, True, False] * 2
    assert not candidate.defers_optimizer(cfg(checkpoint={"deltas": False}))  # the next update waits for publish
    assert not candidate.defers_optimizer(cfg(rollout={"servers": 0}))
    assert not candidate.defers_optimizer(cfg(trainer={"server": False}))
    assert not candidate.defers_optimizer(cfg(trainer={"server": True, "optimizer_after_answer": False}))


def test_the_encoder_takes_its_ranks_share_of_the_cores(monkeypatch):
    from steps.run import weight_delta

    def threads(affinity: set[int], quota: int | None = None) -> int:
        monkeypatch.setattr(weight_delta.os, "sched_getaffinity", lambda pid: affinity, raising=False)
        monkeypatch.setattr(weight_delta, "_cpu_quota", lambda: quota)
        return weight_delta.encode_threads()

    monkeypatch.setattr(weight_delta.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert threads(set(range(16))) == 2  # the node's 16 cores over its 8 ranks
    assert threads({4, 5}) == 2  # pinned to cores of its own
    assert threads(set(range(8))) == 1  # a cpuset all 8 ranks share
    assert threads(set(range(16)), quota=4) == 1  # the container's quota of 4, over 8 ranks
    assert threads({4, 5}, quota=16) == 2  # pinned, under a quota for all the ranks
