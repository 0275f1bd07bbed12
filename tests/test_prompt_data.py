"""steps/data/prompt_data.py: the user's prompt files, JSONL or Parquet on a store, fields mapped by the config; and
the held-out prompts a prompt-file run gets (steps/experience/rollout_plan.py)."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from steps.data.prompt_data import (
    PromptFields,
    format_prompt_jsonl,
    hashed_id,
    heldout_split,
    parse_prompt_jsonl,
    read_prompt_uri,
)
from steps.data.verifiers import NumericVerifier
from steps.errors import MoerlError
from steps.experience.rollout_plan import heldout_prompts, iteration_prompts, training_pool
from steps.run.config import validate_config

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many?",
     "answer": "Natalia sold 48/2 = 24 clips in May.\n#### 72"},
    {"question": "Weng earns $12 an hour. How much did she earn for 50 minutes?", "answer": "12/60*50 = 10\n#### 10"},
]  # fmt: skip


def test_gsm8k_style_records_load_without_conversion(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    prompts = read_prompt_uri(path.as_uri(), PromptFields(prompt="question"), verifier=NumericVerifier())
    assert [p.text for p in prompts] == [r["question"] for r in GSM8K]
    assert prompts[0].answer.endswith("#### 72") and prompts[0].prompt_id == hashed_id(GSM8K[0]["question"])
    assert NumericVerifier().verify("so she sold 72 clips.", prompts[0].answer).correct
    # ids are stable: a hash of the prompt, the same in every process
    assert hashed_id(GSM8K[0]["question"]) == hashed_id(str(GSM8K[0]["question"]))


def test_chat_message_parquet_with_nested_answer_and_metadata(tmp_path):
    rows = [
        {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
         "reward_model": {"ground_truth": "2", "style": "rule"}, "extra_info": {"index": 0}},
        {"data_source": "gsm8k", "prompt": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "2+3?"}],
         "reward_model": {"ground_truth": "5", "style": "rule"}, "extra_info": {"index": 1}},
    ]  # fmt: skip
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    fields = PromptFields(prompt="prompt", answer="reward_model.ground_truth", id="extra_info.index")
    prompts = read_prompt_uri(path.as_uri(), fields)
    assert [p.prompt_id for p in prompts] == ["0", "1"]
    assert prompts[1].content == rows[1]["prompt"] and prompts[1].answer == "5"
    assert prompts[0].metadata == {"data_source": "gsm8k"}


def test_every_bad_record_is_reported_with_its_line():
    lines = [
        json.dumps({"prompt_id": "a", "prompt": "ok", "answer": "1"}),
        "",
        "{not json",
        json.dumps({"prompt_id": "a", "prompt": "again", "answer": "2"}),
        json.dumps({"prompt": "", "answer": "3"}),
        json.dumps({"prompt": [{"role": "user"}], "answer": "3"}),
        json.dumps({"prompt": "x", "answer": None}),
        json.dumps({"prompt": "y"}),
        json.dumps({"prompt": "z", "answer": "abc"}),
        '{"prompt": "w", "prompt": "v", "answer": "1"}',
    ]
    with pytest.raises(MoerlError) as err:
        parse_prompt_jsonl("\n".join(lines), "file:///p.jsonl", verifier=NumericVerifier())
    message = str(err.value)
    for expected in [
        "line 3: invalid JSON",
        "line 4: duplicate prompt_id 'a', first on line 1",
        "line 5: empty prompt",
        "line 6: field 'prompt': chat message 0 needs a string \"content\"",
        "line 7: field 'answer' must be a string or a number, got null",
        "line 8: missing field 'answer'",
        "line 9: answer 'abc': the answer holds no number",
        "line 10: field 'prompt' given more than once",
    ]:
        assert expected in message, message
    assert message.startswith("prompt file file:///p.jsonl has 8 problem(s)")


def test_the_tokenizer_check_names_the_line():
    text = json.dumps({"prompt": "fine", "answer": "1"}) + "\n" + json.dumps({"prompt": "Bad", "answer": "1"})
    with pytest.raises(MoerlError, match=re.escape("line 2: cannot encode 'B'")):
        parse_prompt_jsonl(text, "p.jsonl", prompt_problem=lambda p: "cannot encode 'B'" if "B" in p else None)


def test_format_round_trips():
    prompts = parse_prompt_jsonl("".join(json.dumps({**r, "level": 3}) + "\n" for r in GSM8K), "p",
                                 PromptFields(prompt="question"))  # fmt: skip
    again = parse_prompt_jsonl(format_prompt_jsonl(prompts), "p")
    assert again == prompts and again[0].metadata == {"level": 3}


def _config(tmp_path, **fields):
    return validate_config({"sft_checkpoint": str(tmp_path / "sft"), "run_store": str(tmp_path / "run"),
                            "prompts_per_iteration": 8, "rollout": {"num_shards": 1, "chunk_size": 8},
                            **fields})  # fmt: skip


def test_heldout_by_stable_hash_is_never_trained_on(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt_id": f"q{i}", "prompt": f"q{i}?", "answer": str(i)}) + "\n"
                            for i in range(200)))  # fmt: skip
    cfg = _config(tmp_path, prompt_file=path.as_uri(), heldout_fraction=0.2, heldout_size=1000)
    held = {p.prompt_id for p in heldout_prompts(cfg)}
    train = {p.prompt_id for p in training_pool(cfg)}
    assert held and train and held.isdisjoint(train) and len(held | train) == 200
    assert held == {f"q{i}" for i in range(200) if heldout_split(f"q{i}", 0.2)}
    assert 20 <= len(held) <= 60
    for i in (1, 2, 3):
        assert {p.prompt_id for p in iteration_prompts(cfg, i)} <= train


def test_heldout_from_a_second_file(tmp_path):
    train, held = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text(json.dumps({"prompt": "a?", "answer": "1"}) + "\n")
    held.write_text("".join(json.dumps({"prompt": f"h{i}?", "answer": "1"}) + "\n" for i in range(5)))
    cfg = _config(tmp_path, prompt_file=train.as_uri(), heldout_file=held.as_uri(), heldout_size=3)
    assert len(heldout_prompts(cfg)) == 3 and {p.text for p in heldout_prompts(cfg)} < {f"h{i}?" for i in range(5)}
    assert [p.text for p in training_pool(cfg)] == ["a?"]
    assert heldout_prompts(cfg) == heldout_prompts(cfg)


def test_bad_parquet_rows_are_named_by_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a?", "answer": "1"}, {"prompt": None, "answer": "2"},
                                         {"prompt": "c?", "answer": None}]), path)  # fmt: skip
    with pytest.raises(MoerlError) as err:
        read_prompt_uri(path.as_uri())
    assert "row 2: field 'prompt' must be a string or a list of chat messages, got null" in str(err.value)
    assert "row 3: field 'answer' must be a string or a number, got null" in str(err.value)
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(MoerlError, match="not a readable Parquet file"):
        read_prompt_uri((tmp_path / "junk.parquet").as_uri())
