"""Dynamic sampling (rollout.dynamic_sampling, DAPO): an iteration generates more prompts than
prompts_per_iteration, as many as the share of tied groups of the iteration its policy version came from says are
needed (at most dynamic_sampling_max_factor times), and the update trains on the first prompts_per_iteration groups
in plan order whose rewards are mixed, topped up with tied ones only when too few are; the plan depends only on the
run store's score metrics, so every step that plans an iteration plans the same one."""

from __future__ import annotations

import numpy as np
import pytest
from experience_helpers import make_run, read_parquet, tiny_model, write_checkpoint
from test_score import CONFIG, TOK

from steps.demo.char_tokenizer import EOS_ID, encode, encode_prompt
from steps.engines.interface import FINISH_STOP, Generation
from steps.errors import MoerlError
from steps.experience.rollout_plan import (
    DYNAMIC_SAMPLING_MARGIN,
    RolloutPlan,
    chunk_table,
    generated_prompt_count,
    iteration_prompts,
    write_chunk,
)
from steps.run.config import load_run_config
from steps.run.keys import metrics_key, scored_key
from steps.score import score_iteration
from steps.scoring.rewards import select_groups
from steps.store.object_store import Store

DYNAMIC = {**CONFIG, "rollout": {**CONFIG["rollout"], "dynamic_sampling": True, "dynamic_sampling_max_factor": 2.0}}


def test_the_first_mixed_groups_in_plan_order_are_kept_and_tied_ones_only_fill_the_rest():
    groups = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "e"]
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.0, 1.0, 1.0, 0.2])  # b and c tie
    order = ["e", "b", "d", "c", "a"]  # the plan's order, not the table's
    mask, counts = select_groups(groups, rewards, order, keep=2)
    assert [g for g, kept in zip(groups, mask, strict=True) if kept] == ["d", "d", "e", "e"]
    assert counts == {"generated_groups": 5, "mixed_groups": 3, "trained_mixed_groups": 2, "trained_tied_groups": 0,
                      "unused_mixed_groups": 1}  # fmt: skip
    mask, counts = select_groups(groups, rewards, order, keep=4)  # three mixed: the first tied one fills
    assert sorted({g for g, kept in zip(groups, mask, strict=True) if kept}) == ["a", "b", "d", "e"]
    assert counts["trained_mixed_groups"] == 3 and counts["trained_tied_groups"] == 1
    assert counts["unused_mixed_groups"] == 0


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tiny_model(seed=8), tmp_path_factory.mktemp("policy") / "v0")


def test_the_count_follows_the_tied_share_of_the_iteration_the_version_came_from(tmp_path, checkpoint_dir):
    run = Store.open(make_run(tmp_path, checkpoint_dir, **DYNAMIC))
    cfg = load_run_config(run)
    assert generated_prompt_count(cfg, 1, run) == 8  # nothing scored yet: the cap, 2 x 4
    with pytest.raises(MoerlError, match=r"no score metrics of iteration 1, whose share of tied groups sizes"):
        generated_prompt_count(cfg, 2, run)
    for tied, expected in ((0.0, 5), (0.25, 7), (0.5, 8), (1.0, 8)):
        run.put_json(metrics_key(1), {"tied_group_fraction": tied})
        assert generated_prompt_count(cfg, 2, run) == expected
        assert expected == min(8, max(4, int(np.ceil(4 * DYNAMIC_SAMPLING_MARGIN / max(1 - tied, 1e-9)))))
    run.put_json(metrics_key(1), {"tied_group_fraction": "half"})
    with pytest.raises(MoerlError, match="tied_group_fraction 'half' is not a share"):
        generated_prompt_count(cfg, 2, run)
    stale = cfg.model_copy(update={"staleness": 1})
    assert generated_prompt_count(stale, 2, None) == 8  # v0 again: no scored iteration behind it
    plain = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"dynamic_sampling": False})})
    assert generated_prompt_count(plain, 2, None) == 4
    # More prompts extend the iteration's draw deterministically, and the plan digest changes with them
    assert [p.prompt_id for p in iteration_prompts(cfg, 1, 8)] == [p.prompt_id for p in iteration_prompts(cfg, 1, 8)]
    assert RolloutPlan.for_iteration(cfg, 1, 0, (EOS_ID,), run).digest != RolloutPlan.for_iteration(
        plain, 1, 0, (EOS_ID,)).digest  # fmt: skip


def write_rollout(run: Store, plan: RolloutPlan, tied: set[int]) -> None:
    """Four samples a prompt: all right for the prompts in `tied`, else two right and two wrong."""
    for chunk in range(plan.num_chunks):
        generations, prompt_ids = [], {}
        for prompt in plan.chunk_prompts(chunk):
            index = plan.prompts.index(prompt)
            prompt_ids[prompt.prompt_id] = encode_prompt(TOK, prompt.text)
            right = encode(TOK, prompt.answer) + [EOS_ID]
            wrong = encode(TOK, str(int(prompt.answer) + 1)) + [EOS_ID]
            for k in range(4):
                response = right if index in tied or k < 2 else wrong
                generations.append(Generation(prompt.prompt_id, k, response, [-0.25] * len(response), FINISH_STOP))
        write_chunk(run, plan, chunk, chunk_table(plan, chunk, prompt_ids, generations))


@pytest.mark.parametrize(
    ("tied", "kept", "counts"),
    [
        ({0, 2, 3, 5}, [1, 4, 6, 7], (4, 4, 0, 0)),  # exactly enough mixed groups
        ({0, 1, 2, 3, 4, 5}, [6, 7, 0, 1], (2, 2, 2, 0)),  # too few: the first tied ones fill the batch
        (set(), [0, 1, 2, 3], (8, 4, 0, 4)),  # more than enough: the later ones are not trained
    ],
)
def test_the_score_keeps_the_batch_of_mixed_groups_and_counts_the_rest(tmp_path, checkpoint_dir, tied, kept, counts):
    run_uri = make_run(tmp_path, checkpoint_dir, **DYNAMIC)
    run = Store.open(run_uri)
    plan = RolloutPlan.for_iteration(load_run_config(run), 1, 0, stop_token_ids=(EOS_ID,), run=run)
    assert len(plan.prompts) == 8 and plan.num_chunks == 4
    write_rollout(run, plan, tied)
    metrics = score_iteration(run_uri, 1, None, heldout=False, log=lambda line: None)
    table = read_parquet(run_uri, scored_key(1))
    assert sorted(set(table.column("prompt_id").to_pylist())) == sorted(plan.prompts[i].prompt_id for i in kept)
    assert table.num_rows == 16 and metrics["samples"] == 32 and metrics["prompts"] == 8
    assert metrics["tied_group_fraction"] == len(tied) / 8  # over every generated group: the next count's estimate
    mixed, trained_mixed, trained_tied, unused = counts
    assert metrics["dynamic_sampling"] == {
        "generated_groups": 8, "mixed_groups": mixed, "trained_mixed_groups": trained_mixed,
        "trained_tied_groups": trained_tied, "unused_mixed_groups": unused, "trained_samples": 16,
    }  # fmt: skip
    next_plan = RolloutPlan.for_iteration(load_run_config(run), 2, 1, stop_token_ids=(EOS_ID,), run=run)
    assert len(next_plan.prompts) == generated_prompt_count(load_run_config(run), 2, run)


def test_the_simulator_prices_the_prompts_the_rollout_will_generate(tmp_path, checkpoint_dir):
    from pipelines.simulate.sizing import Assumptions, chunks_per_iteration

    run = Store.open(make_run(tmp_path, checkpoint_dir, **DYNAMIC))
    cfg = load_run_config(run)
    assert Assumptions.__dataclass_fields__["tied_group_share"].default == 0.5
    assert chunks_per_iteration(cfg, 0.5) == 4  # 4 x 1.2 / 0.5 = 9.6, capped at 8 prompts: 4 chunks of 2
    assert chunks_per_iteration(cfg, 0.0) == 3  # 5 prompts
    plain = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"dynamic_sampling": False})})
    assert chunks_per_iteration(plain, 0.5) == 2
