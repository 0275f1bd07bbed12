"""Rollout shards: bytes-identical chunks whatever the shard count, and after an interrupted shard resumes;
the union of the shards is exactly prompts x group size samples."""

import os
import signal

import pytest
import torch
from experience_helpers import make_run, run_files, tiny_model, write_checkpoint

from steps.demo.char_tokenizer import EOS_ID
from steps.engines.torch_engine import Decoder
from steps.errors import MoerlError
from steps.experience.rollout_plan import RolloutPlan, read_rollout
from steps.rollout import Preempted, Preemption, rollout_shard
from steps.run.config import load_run_config
from steps.run.keys import chunk_key, rollout_prefix
from steps.store.object_store import Store

CONFIG = dict(prompts_per_iteration=14, group_size=3, rollout={"num_shards": 3, "chunk_size": 3},
              sampling={"max_new_tokens": 10}, heldout_size=0)  # fmt: skip


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """rollout_shard pins torch's thread count; give the rest of the test session its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tiny_model(seed=2), tmp_path_factory.mktemp("policy") / "v0")


def new_run(tmp_path, checkpoint_dir, name):
    return make_run(tmp_path, checkpoint_dir, name=name, **CONFIG)


def rollout_all(run_uri, num_shards, log=lambda line: None):
    return [rollout_shard(run_uri, 1, shard, num_shards, log=log) for shard in range(num_shards)]


def test_chunks_are_bytes_identical_for_one_and_three_shards(tmp_path, checkpoint_dir):
    one, three = new_run(tmp_path, checkpoint_dir, "one"), new_run(tmp_path, checkpoint_dir, "three")
    [single] = rollout_all(one, 1)
    results = rollout_all(three, 3)
    assert single.generated == [0, 1, 2, 3, 4]
    assert [r.generated for r in results] == [[0, 3], [1, 4], [2]]
    files_one, files_three = run_files(one, rollout_prefix(1)), run_files(three, rollout_prefix(1))
    assert sorted(files_one) == [chunk_key(1, c) for c in range(5)]
    assert files_one == files_three

    run = Store.open(one)
    plan = RolloutPlan.for_iteration(load_run_config(run), 1, 0, stop_token_ids=(EOS_ID,))
    table = read_rollout(run, plan, num_shards=1)
    assert table.num_rows == 14 * 3 == len(set(zip(table.column("prompt_id").to_pylist(),
                                                   table.column("sample_index").to_pylist(), strict=True)))  # fmt: skip
    responses = table.column("response_ids").to_pylist()
    assert len({tuple(r) for r in responses}) > table.num_rows // 2  # real, varied samples
    assert {len(r) for r in responses} != {10}  # some ended with <eos> before max_new_tokens
    assert single.samples == 42 and single.tokens == sum(len(r) for r in responses)


def test_an_interrupted_shard_resumes_to_the_same_bytes(tmp_path, checkpoint_dir, monkeypatch):
    clean, interrupted = new_run(tmp_path, checkpoint_dir, "clean"), new_run(tmp_path, checkpoint_dir, "cut")
    rollout_all(clean, 1)

    # SIGTERM arrives in the middle of the third chunk's decoding (its 4th decode step).
    steps_seen, chunks_done = [], []
    real_step = Decoder.step

    def step(self, tokens, batch):
        steps_seen.append(len(chunks_done))
        if len(chunks_done) == 2 and steps_seen.count(2) == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, tokens, batch)

    def log(line):
        if " done (" in line:
            chunks_done.append(line)

    monkeypatch.setattr(Decoder, "step", step)
    previous = signal.getsignal(signal.SIGTERM)
    preemption = Preemption()
    preemption.install()
    try:
        with pytest.raises(Preempted):
            rollout_shard(interrupted, 1, 0, 1, preemption=preemption, log=log)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert steps_seen.count(2) == 4  # it stopped in that step, not at the end of the chunk
    assert sorted(run_files(interrupted, rollout_prefix(1))) == [chunk_key(1, 0), chunk_key(1, 1)]

    monkeypatch.setattr(Decoder, "step", real_step)
    lines = []
    resumed = rollout_shard(interrupted, 1, 0, 1, log=lines.append)
    assert resumed.generated == [2, 3, 4]
    assert "2 already finished" in lines[0]
    assert run_files(interrupted, rollout_prefix(1)) == run_files(clean, rollout_prefix(1))
    # A finished shard rerun does nothing (and loads no model).
    assert rollout_shard(interrupted, 1, 0, 1, log=lines.append).generated == []


def test_bad_versions_and_shards_are_clear_errors(tmp_path, checkpoint_dir):
    run = new_run(tmp_path, checkpoint_dir, "errors")
    with pytest.raises(MoerlError, match=r"--policy-version 1: iteration 1 with staleness 0 samples from v000000"):
        rollout_shard(run, 1, 0, 1, policy_version=1)
    with pytest.raises(MoerlError, match="v000002 is neither published .* nor indexed"):
        rollout_shard(run, 3, 0, 1)  # v2 was never published
    with pytest.raises(MoerlError, match="need 0 <= shard < num-shards"):
        rollout_shard(run, 1, 3, 3)
    with pytest.raises(MoerlError, match="iterations count from 1"):
        rollout_shard(run, 0, 0, 1)
    with pytest.raises(MoerlError, match="no run config"):
        rollout_shard((tmp_path / "nothing").as_uri(), 1, 0, 1)
    # More shards than chunks: the extra shards have nothing to do and succeed.
    assert rollout_shard(run, 1, 6, 7).chunks == []


def test_a_corrupted_finished_chunk_is_not_skipped(tmp_path, checkpoint_dir):
    run_uri = new_run(tmp_path, checkpoint_dir, "corrupt")
    rollout_shard(run_uri, 1, 1, 3)
    run = Store.open(run_uri)
    run.put_bytes(chunk_key(1, 1), run.get_bytes(chunk_key(1, 4)))  # chunk 4's samples under chunk 1's name
    with pytest.raises(MoerlError, match="chunk-000001.parquet: its metadata says chunk 4; delete it and rerun"):
        rollout_shard(run_uri, 1, 1, 3)
