"""The score step on hand-made samples: verifier rewards and their weights, GRPO group advantages, the
optional reward model, the metrics; and every bad input is one clear error with nothing written."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from experience_helpers import make_run, read_parquet, run_step, tiny_model, write_checkpoint

from steps.data.tokenizer import CheckpointTokenizer
from steps.demo.char_tokenizer import EOS_ID, build_tokenizer, encode, encode_prompt
from steps.engines.interface import FINISH_LENGTH, FINISH_STOP, Generation
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.experience.rollout_plan import RolloutPlan, chunk_table, heldout_prompts, write_chunk
from steps.experience.tables import SCORED_SCHEMA
from steps.run.config import load_run_config
from steps.run.keys import metrics_key, scored_key
from steps.score import score_iteration
from steps.scoring.evaluation import evaluate_accuracy
from steps.scoring.rewards import group_advantages
from steps.store.object_store import Store

TOK = build_tokenizer()
CONFIG = dict(prompts_per_iteration=4, group_size=4, rollout={"num_shards": 2, "chunk_size": 2}, heldout_size=0,
              rewards={"exact_match_weight": 1.0, "format_weight": 0.1})  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tiny_model(seed=8), tmp_path_factory.mktemp("policy") / "v0")


def responses_for(prompts):
    """Four hand-made samples per prompt; the comments give (correct, well_formed)."""
    right = [encode(TOK, p.answer) + [EOS_ID] for p in prompts]
    wrong = [encode(TOK, str(int(p.answer) + 1)) + [EOS_ID] for p in prompts]
    letters = encode(TOK, "abc") + [EOS_ID]
    return [
        [right[0]] * 4,  # all (1, 1): the group ties
        [right[1], wrong[1], letters, encode(TOK, prompts[1].answer)],  # (1,1) (0,1) (0,0) (0,0): never ended
        [wrong[2]] * 4,  # all (0, 1): ties too
        [[EOS_ID], right[3], wrong[3], right[3] + encode(TOK, "77")],  # (0,0) (1,1) (0,1) (1,1): text after <eos>
    ]


EXPECTED_CORRECT = [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]]
EXPECTED_WELL_FORMED = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 1]]


def write_hand_made_rollout(run_uri, chunks=(0, 1)):
    run = Store.open(run_uri)
    plan = RolloutPlan.for_iteration(load_run_config(run), 1, 0, stop_token_ids=(EOS_ID,))
    all_responses = responses_for(plan.prompts)
    for chunk in chunks:
        generations, prompt_ids = [], {}
        for index, prompt in enumerate(plan.chunk_prompts(chunk)):
            prompt_ids[prompt.prompt_id] = encode_prompt(TOK, prompt.text)
            for k, response in enumerate(all_responses[chunk * 2 + index]):
                finish = FINISH_STOP if EOS_ID in response else FINISH_LENGTH
                generations.append(Generation(prompt.prompt_id, k, response, [-0.25] * len(response), finish))
        write_chunk(run, plan, chunk, chunk_table(plan, chunk, prompt_ids, generations))
    return plan


def nothing_written(run_uri, metrics_out):
    run = Store.open(run_uri)
    return not run.exists(scored_key(1)) and not run.exists(metrics_key(1)) and not metrics_out.exists()


def test_rewards_advantages_and_metrics_on_hand_made_samples(tmp_path, checkpoint_dir):
    run_uri = make_run(tmp_path, checkpoint_dir, **CONFIG)
    plan = write_hand_made_rollout(run_uri)
    metrics_out = tmp_path / "out" / "metrics.json"
    metrics = score_iteration(run_uri, 1, str(metrics_out), log=lambda line: None)

    table = read_parquet(run_uri, scored_key(1))
    assert table.schema.remove_metadata() == SCORED_SCHEMA
    keys = zip(table.column("prompt_id").to_pylist(), table.column("sample_index").to_pylist(), strict=True)
    by_row = {key: row for row, key in enumerate(keys)}
    assert list(by_row) == sorted(by_row)  # canonical order
    rewards = np.zeros((4, 4))
    for g, prompt in enumerate(plan.prompts):
        for k in range(4):
            row = by_row[(prompt.prompt_id, k)]
            assert table.column("correct")[row].as_py() == bool(EXPECTED_CORRECT[g][k])
            assert table.column("well_formed")[row].as_py() == bool(EXPECTED_WELL_FORMED[g][k])
            rewards[g, k] = table.column("reward")[row].as_py()
            assert table.column("rm_score")[row].as_py() is None
    expected_rewards = np.array(EXPECTED_CORRECT) + 0.1 * np.array(EXPECTED_WELL_FORMED)
    np.testing.assert_allclose(rewards, expected_rewards, rtol=0, atol=1e-6)

    # Group 1 by hand: rewards 1.1, 0.1, 0, 0 -> mean 0.3, population std sqrt(0.86 / 4).
    group1 = [table.column("advantage")[by_row[(plan.prompts[1].prompt_id, k)]].as_py() for k in range(4)]
    std = math.sqrt(0.86 / 4)
    np.testing.assert_allclose(group1, [0.8 / std, -0.2 / std, -0.3 / std, -0.3 / std], rtol=1e-5)
    for tied in (0, 2):  # all rewards equal: advantage exactly 0
        assert {table.column("advantage")[by_row[(plan.prompts[tied].prompt_id, k)]].as_py() for k in range(4)} == {0}

    assert metrics["samples"] == 16 and metrics["prompts"] == 4 and metrics["policy_version"] == 0
    assert metrics["accuracy"] == 7 / 16 and metrics["format_rate"] == 13 / 16
    assert metrics["tied_group_fraction"] == 0.5
    assert metrics["reward_mean"] == pytest.approx(expected_rewards.mean())
    assert metrics["reward_std"] == pytest.approx(expected_rewards.std())
    lengths = [len(r) for group in responses_for(plan.prompts) for r in group]
    assert metrics["response_length_mean"] == pytest.approx(np.mean(lengths))
    prompt_lengths = [len(ids) for ids in table.column("prompt_ids").to_pylist()]
    assert metrics["prompt_length_mean"] == pytest.approx(np.mean(prompt_lengths))
    assert metrics["truncated_fraction"] == 1 / 16
    assert json.loads(metrics_out.read_text()) == Store.open(run_uri).get_json(metrics_key(1)) == metrics

    # A rerun (a retried score pod) writes the same bytes.
    first = Store.open(run_uri).get_bytes(scored_key(1))
    score_iteration(run_uri, 1, str(metrics_out), log=lambda line: None)
    assert Store.open(run_uri).get_bytes(scored_key(1)) == first


def test_group_advantages_with_and_without_std_normalisation():
    groups = ["a", "a", "a", "b", "b", "c"]
    rewards = np.array([1.0, 0.0, 0.5, 2.0, 2.0, 3.0])
    centred, tied = group_advantages(groups, rewards, normalize_std=False)
    np.testing.assert_allclose(centred, [0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    assert tied == 2 / 3  # b ties, and so does the one-sample group c
    normalised, _ = group_advantages(groups, rewards, normalize_std=True, eps=0.0)
    np.testing.assert_allclose(normalised[:3], np.array([0.5, -0.5, 0.0]) / np.std([1.0, 0.0, 0.5]))


def tiny_reward_model(directory, poison=False):
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)  # fmt: skip
    model = LlamaForSequenceClassification(config)
    if poison:
        with torch.no_grad():
            model.score.weight.fill_(float("nan"))
    model.save_pretrained(directory)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")  # fmt: skip
    tokenizer.save_pretrained(directory)
    return model.eval(), tokenizer


def test_the_reward_model_score_is_added_with_its_weight(tmp_path, checkpoint_dir):
    rm_dir = tmp_path / "rm"
    model, tokenizer = tiny_reward_model(rm_dir)
    rewards_cfg = {**CONFIG["rewards"], "reward_model": rm_dir.as_uri(), "reward_model_weight": 0.5}
    run_uri = make_run(tmp_path, checkpoint_dir, **{**CONFIG, "rewards": rewards_cfg})
    plan = write_hand_made_rollout(run_uri)
    metrics = score_iteration(run_uri, 1, str(tmp_path / "m.json"), log=lambda line: None)
    table = read_parquet(run_uri, scored_key(1))

    texts, expected = [], []
    text_of = {p.prompt_id: p.text for p in plan.prompts}
    for row in range(table.num_rows):
        response = table.column("response_ids")[row].as_py()
        kept = response[: response.index(EOS_ID)] if EOS_ID in response else response
        texts.append(text_of[table.column("prompt_id")[row].as_py()] + TOK.decode(kept))
    for text in texts:
        with torch.no_grad():
            expected.append(model(**tokenizer([text], return_tensors="pt")).logits[0, 0].item())
    rm_scores = table.column("rm_score").to_pylist()
    np.testing.assert_allclose(rm_scores, expected, rtol=0, atol=1e-5)
    verifier = np.array(table.column("correct").to_pylist()) + 0.1 * np.array(table.column("well_formed").to_pylist())
    np.testing.assert_allclose(table.column("reward").to_pylist(), verifier + 0.5 * np.array(rm_scores), atol=1e-6)
    assert metrics["rm_score_mean"] == pytest.approx(np.mean(rm_scores))


def test_non_finite_rewards_are_one_error_and_nothing_is_written(tmp_path, checkpoint_dir):
    rm_dir = tmp_path / "rm"
    tiny_reward_model(rm_dir, poison=True)
    rewards_cfg = {**CONFIG["rewards"], "reward_model": rm_dir.as_uri(), "reward_model_weight": 1.0}
    run_uri = make_run(tmp_path, checkpoint_dir, name="nan", **{**CONFIG, "rewards": rewards_cfg})
    write_hand_made_rollout(run_uri)
    out = tmp_path / "m.json"
    with pytest.raises(MoerlError, match=r"reward model score .* of prompt '.*' sample 0 is nan \(16 non-finite"):
        score_iteration(run_uri, 1, str(out))
    assert nothing_written(run_uri, out)

    run_uri = make_run(tmp_path, checkpoint_dir, name="inf", **{**CONFIG, "rewards": {"exact_match_weight": math.inf}})
    write_hand_made_rollout(run_uri)
    with pytest.raises(MoerlError, match=r"^reward of prompt .* is nan \(\d+ non-finite in all\); nothing was written"):
        score_iteration(run_uri, 1, str(out))  # inf * 0 for the wrong answers
    assert nothing_written(run_uri, out)


def test_a_reward_model_that_does_not_load_is_one_error(tmp_path, checkpoint_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text("{}")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    cases = [(broken, "cannot be loaded"), (pickled, "pickled"), (tmp_path / "empty", "no files there")]
    for i, (rm_dir, message) in enumerate(cases):
        rewards_cfg = {"reward_model": rm_dir.as_uri(), "reward_model_weight": 1.0}
        run_uri = make_run(tmp_path, checkpoint_dir, name=f"bad{i}", **{**CONFIG, "rewards": rewards_cfg})
        write_hand_made_rollout(run_uri)
        with pytest.raises(MoerlError, match=f"reward model {rm_dir.as_uri()}.*{message}"):
            score_iteration(run_uri, 1, str(tmp_path / "m.json"))
        assert nothing_written(run_uri, tmp_path / "m.json")


def test_a_missing_shard_is_named_and_nothing_is_written(tmp_path, checkpoint_dir):
    run_uri = make_run(tmp_path, checkpoint_dir, **CONFIG)
    write_hand_made_rollout(run_uri, chunks=(0,))
    out = tmp_path / "m.json"
    result = run_step("steps.score", "--run", run_uri, "--iteration", "1", "--metrics-out", str(out))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "chunk 000001 (rollout shard 1 of 2)" in result.stderr
    assert nothing_written(run_uri, out)

    write_hand_made_rollout(run_uri, chunks=(1,))
    result = run_step("steps.score", "--run", run_uri, "--iteration", "1", "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["samples"] == 16


def test_heldout_accuracy_of_the_behaviour_policy(tmp_path, checkpoint_dir):
    run_uri = make_run(tmp_path, checkpoint_dir, **{**CONFIG, "heldout_size": 12})
    write_hand_made_rollout(run_uri)
    metrics = score_iteration(run_uri, 1, None, log=lambda line: None)
    cfg = load_run_config(Store.open(run_uri))
    engine = TorchEngine.from_checkpoint(checkpoint_dir)
    tok = CheckpointTokenizer.load(checkpoint_dir)
    expected = evaluate_accuracy(engine, tok, heldout_prompts(cfg), max_new_tokens=cfg.sampling.max_new_tokens)
    assert metrics["heldout_accuracy"] == expected
    assert "heldout_accuracy" not in score_iteration(run_uri, 1, None, heldout=False, log=lambda line: None)


def test_scored_columns_have_the_design_types():
    expected = {"prompt_id": pa.string(), "reward": pa.float32(), "advantage": pa.float32(),
                "prompt_ids": pa.list_(pa.int32()), "behavior_logprobs": pa.list_(pa.float32())}  # fmt: skip
    for name, kind in expected.items():
        assert SCORED_SCHEMA.field(name).type == kind
