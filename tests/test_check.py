"""`moerl check CONFIG` (and render/run before anything starts): every input the config names is read, every
problem is reported at once, exit code 2; a refused architecture is named with what is supported; and a
prompt-file run with a chat template, a verifier and a reward function scores end to end."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from experience_helpers import make_run, tiny_model, write_checkpoint

from pipelines.cli import main
from steps.demo.bpe_tokenizer import train_chat_tokenizer
from steps.engines.interface import FINISH_STOP, Generation
from steps.experience.rollout_plan import RolloutPlan, chunk_table, version_tokenizer, write_chunk
from steps.models.qwen3_moe.config import MoeConfig
from steps.run.config import load_run_config
from steps.run.keys import metrics_key
from steps.score import score_iteration
from steps.store.object_store import Store

PLUGINS = Path(__file__).resolve().parent / "reward_plugins"


@pytest.fixture(scope="module")
def char_checkpoint(tmp_path_factory):
    return write_checkpoint(tiny_model(), tmp_path_factory.mktemp("sft") / "char")


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def write_config(tmp_path, **fields):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run_store": str(tmp_path / "run"), "prompts_per_iteration": 8,
                                    "rollout": {"num_shards": 1, "chunk_size": 8}, **fields}))  # fmt: skip
    return path


def test_check_reports_every_problem_at_once(tmp_path, char_checkpoint, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(PLUGINS))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question": "Über 5?", "answer": "5"}) + "\n" + json.dumps({"answer": "x"}) + "\n")
    config = write_config(
        tmp_path, sft_checkpoint=str(char_checkpoint), prompt_file=str(prompts), prompt_fields={"prompt": "question"},
        prompt_format="chat", rewards={"verifier": "numeric", "reward_fn": "demo_rewards:nope"},
    )  # fmt: skip
    code, out, err = run_cli(["check", str(config)], capsys)
    assert code == 2, err
    assert err.startswith(f"error: {config}: 3 problem(s) with the run's inputs:")
    assert "prompt_format is chat but the checkpoint has no chat template" in err
    assert "line 2: missing field 'question'" in err and "line 2: answer 'x': the answer holds no number" in err
    assert "demo_rewards has no function 'nope'" in err
    # render refuses the same way, and writes nothing
    code, _, err = run_cli(["render", str(config), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "no chat template" in err and not (tmp_path / "out").exists()


def test_check_passes_a_good_config(tmp_path, char_checkpoint, capsys):
    config = write_config(tmp_path, sft_checkpoint=str(char_checkpoint), task={"name": "sort", "params": {"length": 6}})
    code, out, err = run_cli(["check", str(config)], capsys)
    assert code == 0, err
    assert "check out" in out


def test_max_new_tokens_is_checked_with_the_checkpoints_tokenizer(tmp_path, char_checkpoint, capsys):
    config = write_config(tmp_path, sft_checkpoint=str(char_checkpoint), task={"name": "sort"},
                          sampling={"max_new_tokens": 8})  # fmt: skip
    code, _, err = run_cli(["check", str(config)], capsys)
    assert code == 2
    assert "sampling.max_new_tokens: 8 cannot hold sort8's longest answer (8 tokens of the checkpoint's " \
           "tokenizer) and its stop token; use at least 9" in err  # fmt: skip


@pytest.mark.parametrize("model_type, name", [("deepseek_v2", "DeepSeek-V2"), ("llama4", "Llama-4"),
                                              ("olmoe", "OLMoE"), ("llama", None)])  # fmt: skip
def test_other_architectures_are_refused_by_name(tmp_path, char_checkpoint, capsys, model_type, name):
    sft = tmp_path / "sft"
    sft.mkdir()
    for f in char_checkpoint.iterdir():
        (sft / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((sft / "config.json").read_text())
    (sft / "config.json").write_text(json.dumps({**cfg, "model_type": model_type, "num_local_experts": 8}))
    config = write_config(tmp_path, sft_checkpoint=str(sft), task={"name": "sort", "params": {"length": 6}})
    code, _, err = run_cli(["check", str(config)], capsys)
    assert code == 2
    assert f"model_type {model_type!r}" in err and "moerl supports: Qwen3-MoE" in err
    if name:
        assert f"{name} (model_type" in err
    with pytest.raises(Exception, match="not supported"):
        MoeConfig.from_hf_dict({**cfg, "model_type": model_type})


def test_prompt_file_chat_run_scores_with_the_verifier_and_the_reward_function(tmp_path, monkeypatch):
    """A BPE checkpoint with a chat template, GSM8K-style prompts, the numeric verifier and a user reward
    function whose named values land in the iteration's metrics."""
    monkeypatch.setenv("PYTHONPATH", str(PLUGINS))
    ckpt = tmp_path / "bpe"
    records = [{"question": f"What is {i}+{i}?", "answer": f"... #### {2 * i}", "level": i} for i in range(40)]
    train_chat_tokenizer([r["question"] + " The answer is 12." for r in records], ckpt)
    from steps.data.tokenizer import CheckpointTokenizer

    vocab = CheckpointTokenizer.load(ckpt).vocab_size
    write_checkpoint_bpe = tiny_model(vocab_size=vocab, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    from steps.models.hf_checkpoint import save_pretrained

    save_pretrained(write_checkpoint_bpe, ckpt)
    prompts = tmp_path / "gsm.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_uri = make_run(
        tmp_path, ckpt, prompt_file=prompts.as_uri(), prompt_fields={"prompt": "question"}, heldout_size=0,
        prompt_format="chat", system_prompt="Add.", prompts_per_iteration=4, group_size=2,
        rollout={"num_shards": 1, "chunk_size": 4},
        rewards={"verifier": "numeric", "reward_fn": "demo_rewards:length_bonus", "reward_fn_weight": 0.5},
    )  # fmt: skip
    run = Store.open(run_uri)
    cfg = load_run_config(run)
    tok = version_tokenizer(run, 0)
    plan = RolloutPlan.for_iteration(cfg, 1, 0, stop_token_ids=tok.stop_ids)
    prompt_ids, generations = {}, []
    for p in plan.prompts:
        prompt_ids[p.prompt_id] = tok.prompt_ids(p.content, plan.prompt_format)
        assert tok.decode(prompt_ids[p.prompt_id], False).startswith("<|im_start|>system\nAdd.<|im_end|>")
        right = tok.encode_text(f"The answer is {p.answer.split()[-1]}.") + [tok.eos_id]
        generations += [Generation(p.prompt_id, 0, right, [-0.5] * len(right), FINISH_STOP),
                        Generation(p.prompt_id, 1, tok.encode_text("no idea"), [-0.5] * 2, "length")]  # fmt: skip
    write_chunk(run, plan, 0, chunk_table(plan, 0, prompt_ids, generations))
    metrics = score_iteration(run_uri, 1, metrics_out=None, heldout=False, log=lambda line: None)
    assert metrics["accuracy"] == 0.5 and metrics["format_rate"] == 0.5
    assert metrics["reward_fn/reward"] == 0.5  # the answer text appears in the right responses only
    assert np.isclose(metrics["reward_fn/level"], np.mean([p.metadata["level"] for p in plan.prompts]))
    assert run.get_json(metrics_key(1))["reward_fn/length"] > 0
    # the right responses get 1 (correct) + 0.1 (well formed) + 0.5 * 1 (the function)
    assert np.isclose(metrics["reward_mean"], (1.6 + 0.0) / 2)
