"""The experience plan and files: prompts fixed by (seed, iteration), chunks cut by order and chunk size (never
by shard count), shards taking every S-th chunk, and chunk files that are checked against the plan when read."""

import dataclasses

import pyarrow as pa
import pytest

from steps.data.prompt_data import format_prompt_jsonl
from steps.data.tasks import get_task
from steps.demo.char_tokenizer import EOS_ID
from steps.engines.interface import Generation
from steps.errors import MoerlError
from steps.experience.rollout_plan import (
    RolloutPlan,
    chunk_problem,
    chunk_table,
    heldout_prompts,
    iteration_prompts,
    read_rollout,
    write_chunk,
)
from steps.experience.tables import CANONICAL_ORDER, ROLLOUT_SCHEMA
from steps.run.config import validate_config
from steps.run.keys import behaviour_version, chunk_key, metrics_key, scored_key
from steps.store.object_store import Store


def config(**overrides):
    data = {"sft_checkpoint": "file:///sft", "run_store": "file:///run", "prompts_per_iteration": 22,
            "group_size": 3, "rollout": {"num_shards": 2, "chunk_size": 5}, **overrides}  # fmt: skip
    return validate_config(data, "test config")


def plan_for(cfg, iteration=1, version=0):
    return RolloutPlan.for_iteration(cfg, iteration, version, stop_token_ids=(EOS_ID,))


def fake_generations(plan, chunk, length=3):
    """Deterministic stand-in samples: response = a few digits then <eos>."""
    return [
        Generation(p.prompt_id, k, [4 + (i + k) % 10] * length + [EOS_ID], [-0.5] * (length + 1), "stop")
        for i, p in enumerate(plan.chunk_prompts(chunk))
        for k in range(plan.group_size)
    ]


def write_fake_chunk(run, plan, chunk):
    prompt_ids = {p.prompt_id: [1, 5, 6] for p in plan.chunk_prompts(chunk)}
    write_chunk(run, plan, chunk, chunk_table(plan, chunk, prompt_ids, fake_generations(plan, chunk)))


def test_prompts_are_fixed_by_seed_and_iteration_and_come_from_the_train_split():
    cfg = config()
    first = iteration_prompts(cfg, 1)
    assert first == iteration_prompts(cfg, 1) and len(first) == 22 and len({p.prompt_id for p in first}) == 22
    assert iteration_prompts(cfg, 2) != first
    assert iteration_prompts(config(seed=1), 1) != first
    heldout = {p.prompt_id for p in get_task("addition").prompts("heldout", 2000, 0)}
    assert not heldout & {p.prompt_id for p in first + iteration_prompts(cfg, 2)}
    assert [p.prompt_id for p in heldout_prompts(cfg)] == [p.prompt_id for p in get_task("addition").prompts(
        "heldout", cfg.heldout_size, cfg.seed)]  # fmt: skip
    sort4 = iteration_prompts(config(task={"name": "sort", "params": {"length": 4}}), 1)
    assert {p.task for p in sort4} == {"sort4"}


def test_prompt_file_prompts_are_sampled_deterministically(tmp_path):
    prompts = get_task("addition").prompts("train", 30, 5)
    store = Store.open(str(tmp_path / "data"))
    store.put_bytes("prompts.jsonl", format_prompt_jsonl(prompts).encode())
    cfg = config(task=None, prompt_file=(tmp_path / "data" / "prompts.jsonl").as_uri(), prompts_per_iteration=12,
                 heldout_fraction=0)  # fmt: skip
    chosen = iteration_prompts(cfg, 1)
    ids = {p.prompt_id: p for p in prompts}
    assert len(chosen) == 12 and {p.prompt_id for p in chosen} <= set(ids) and chosen == iteration_prompts(cfg, 1)
    assert all((p.text, p.answer) == (ids[p.prompt_id].text, ids[p.prompt_id].answer) for p in chosen)
    assert chosen != iteration_prompts(cfg, 2)
    everything = iteration_prompts(config(task=None, prompt_file=cfg.prompt_file, prompts_per_iteration=50,
                                          heldout_fraction=0), 1)  # fmt: skip
    assert sorted(p.prompt_id for p in everything) == sorted(p.prompt_id for p in prompts)
    assert heldout_prompts(cfg) == []  # heldout_fraction 0 and no heldout_file: no held-out set


def test_chunks_are_cut_by_order_and_shards_take_every_sth_chunk():
    plan = plan_for(config())
    assert plan.num_chunks == 5 and plan.group_size == 3
    assert [len(plan.chunk_prompts(c)) for c in range(5)] == [5, 5, 5, 5, 2]
    assert [p for c in range(5) for p in plan.chunk_prompts(c)] == list(plan.prompts)
    assert plan.shard_chunks(1, 2) == [1, 3] and plan.shard_chunks(0, 3) == [0, 3]
    for shards in range(1, 8):
        owned = [c for s in range(shards) for c in plan.shard_chunks(s, shards)]
        assert sorted(owned) == list(range(5))  # every chunk exactly once, whatever the shard count
    # The plan (and so every chunk) does not depend on the shard count.
    assert plan_for(config(rollout={"num_shards": 5, "chunk_size": 5})) == plan


def test_the_plan_digest_covers_what_determines_the_samples():
    cfg = config()
    plan = plan_for(cfg)
    assert plan.digest == plan_for(config(rollout={"num_shards": 1, "chunk_size": 5})).digest
    assert plan.digest == plan_for(config(iterations=9, name="other")).digest
    changed = [
        plan_for(cfg, version=1),
        plan_for(cfg, iteration=2),
        plan_for(config(seed=3)),
        plan_for(config(group_size=4)),
        plan_for(config(sampling={"temperature": 0.9})),
        plan_for(config(rollout={"num_shards": 2, "chunk_size": 6})),
        dataclasses.replace(plan, engine="sglang"),
    ]
    assert len({plan.digest, *(p.digest for p in changed)}) == len(changed) + 1


def test_keys_follow_the_design():
    assert scored_key(3) == "experience/iter-000003/scored.parquet"
    assert chunk_key(1, 3) == "experience/iter-000001/rollout/chunk-000003.parquet"
    assert metrics_key(12) == "metrics/iter-000012.json"
    assert [behaviour_version(i, s) for i, s in [(1, 0), (2, 0), (1, 1), (2, 1), (5, 1)]] == [0, 1, 0, 0, 3]


def test_chunk_files_read_back_in_canonical_order_with_the_design_columns(tmp_path):
    run = Store.open(str(tmp_path / "run"))
    plan = plan_for(config())
    for chunk in range(plan.num_chunks):
        write_fake_chunk(run, plan, chunk)
    table = read_rollout(run, plan, num_shards=2)
    assert table.schema.remove_metadata() == ROLLOUT_SCHEMA
    assert table.num_rows == 22 * 3
    assert table.equals(table.sort_by(CANONICAL_ORDER))
    keys = list(zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True))
    assert keys == sorted((p.prompt_id, k) for p in plan.prompts for k in range(3))
    assert set(table.column("policy_version").to_pylist()) == {0}
    assert table.column("response_ids").type == pa.list_(pa.int32())
    assert table.column("behavior_logprobs").type == pa.list_(pa.float32())


def test_missing_surplus_and_foreign_chunks_are_named_with_their_shard(tmp_path):
    run = Store.open(str(tmp_path / "run"))
    plan = plan_for(config())
    for chunk in (0, 1, 2, 4):
        write_fake_chunk(run, plan, chunk)
    with pytest.raises(MoerlError, match=r"1 of 5 chunks missing: chunk 000003 \(rollout shard 1 of 2\)"):
        read_rollout(run, plan, num_shards=2)

    other = plan_for(config(), version=1)  # e.g. sampled from another policy version
    write_fake_chunk(run, other, 3)
    with pytest.raises(MoerlError, match=r"chunk-000003.parquet: chunk 000003 \(rollout shard 0 of 3\) does not "
                                         r"match this iteration: it was generated under another plan"):  # fmt: skip
        read_rollout(run, plan, num_shards=3)

    write_fake_chunk(run, plan, 3)
    read_rollout(run, plan, num_shards=2)
    run.put_bytes(chunk_key(1, 7), run.get_bytes(chunk_key(1, 3)))
    with pytest.raises(MoerlError, match="chunk 7 is not in this iteration's plan of 5 chunks"):
        read_rollout(run, plan, num_shards=2)


def test_a_chunk_must_hold_exactly_its_samples():
    plan = plan_for(config())
    prompt_ids = {p.prompt_id: [1, 5] for p in plan.chunk_prompts(1)}
    good = chunk_table(plan, 1, prompt_ids, fake_generations(plan, 1))
    assert chunk_problem(plan, 1, good) is None
    assert "metadata says chunk 1" in chunk_problem(plan, 2, good)
    short = chunk_table(plan, 1, prompt_ids, fake_generations(plan, 1)[:-1])
    assert "holds 14 samples, not exactly the 15" in chunk_problem(plan, 1, short)


def test_chunks_written_before_the_multi_turn_columns_read_as_single_turn(tmp_path):
    run = Store.open(str(tmp_path / "run"))
    plan = plan_for(config())
    prompt_ids = {p.prompt_id: [1, 5, 6] for p in plan.chunk_prompts(0)}
    table = chunk_table(plan, 0, prompt_ids, fake_generations(plan, 0))
    older = table.drop_columns(["loss_mask", "env_reward", "turns", "env_metrics"])
    assert chunk_problem(plan, 0, older) is None
    for chunk in range(plan.num_chunks):
        write_chunk(run, plan, chunk, older if chunk == 0 else chunk_table(
            plan, chunk, {p.prompt_id: [1, 5, 6] for p in plan.chunk_prompts(chunk)}, fake_generations(plan, chunk)))
    read = read_rollout(run, plan, num_shards=2)
    assert read.schema.remove_metadata() == ROLLOUT_SCHEMA and read.column("loss_mask").null_count == read.num_rows


def test_a_multi_turn_plan_refuses_chunks_without_or_with_misaligned_loss_masks():
    cfg = config(prompt_format="chat", environment={"class_path": "steps.demo.calculator:CalculatorEnv"})
    plan = plan_for(cfg)
    prompt_ids = {p.prompt_id: [1, 5, 6] for p in plan.chunk_prompts(0)}
    single = chunk_table(plan, 0, prompt_ids, fake_generations(plan, 0))
    assert "without a loss_mask" in chunk_problem(plan, 0, single)
    masks = pa.array([[1, 0] for _ in range(single.num_rows)], type=pa.list_(pa.int8()))
    misaligned = single.set_column(single.schema.get_field_index("loss_mask"), "loss_mask", masks)
    assert "differ in length" in chunk_problem(plan, 0, misaligned)
    assert "has no environment" in chunk_problem(plan_for(config()), 0, misaligned)
