"""steps/data/tokenizer.py: the checkpoint's own tokenizer as every step uses it, held to what transformers does with
the same files (AutoTokenizer, apply_chat_template)."""

import json
import os

import pytest

from steps.data.tokenizer import RAW, CheckpointTokenizer, PromptFormat
from steps.demo.bpe_tokenizer import CHATML_TEMPLATE, ENDOFTEXT, IM_END, chatml, train_chat_tokenizer
from steps.demo.char_tokenizer import BOS_ID, EOS_ID, save_tokenizer
from steps.errors import MoerlError

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT = PromptFormat("chat", system_prompt="You sort digits.")
PROMPTS = ["Sort the digits 830142 in descending order. Put the final answer in \\boxed{}.", "What is 12+7?"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    corpus = [chatml(CHAT.messages(p) + [{"role": "assistant", "content": "\\boxed{843210}"}]) for p in PROMPTS] * 20
    train_chat_tokenizer(corpus, directory)
    return directory


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("char")
    save_tokenizer(directory)
    return directory


def test_bos_only_where_the_tokenizer_adds_one(char_dir, bpe_dir):
    char, bpe = CheckpointTokenizer.load(char_dir), CheckpointTokenizer.load(bpe_dir)
    assert char.prompt_ids("12+3=")[0] == BOS_ID
    assert bpe.token_id("bos_token") is None
    assert bpe.prompt_ids("What is 12+7?") == bpe.encode_text("What is 12+7?")


def test_raw_and_chat_prompt_ids_match_transformers(char_dir, bpe_dir):
    from transformers import AutoTokenizer

    for directory in (char_dir, bpe_dir):
        hf = AutoTokenizer.from_pretrained(directory)
        ours = CheckpointTokenizer.load(directory)
        assert ours.prompt_ids("12+3=", RAW) == hf("12+3=")["input_ids"]
    hf = AutoTokenizer.from_pretrained(bpe_dir)
    bpe = CheckpointTokenizer.load(bpe_dir)
    for prompt in PROMPTS:
        messages = CHAT.messages(prompt)
        expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert bpe.prompt_ids(prompt, CHAT) == expected
        assert bpe.prompt_text(prompt, CHAT) == hf.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    # a prompt given as chat messages keeps its own system message
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert bpe.prompt_text(own, CHAT).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_template_kwargs_reach_the_template(tmp_path, bpe_dir):
    # Qwen3's template reads enable_thinking; ours stands in for it, rendered by transformers' own renderer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        CHATML_TEMPLATE + "{% if add_generation_prompt and enable_thinking is false %}"
        "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    )
    tok = CheckpointTokenizer.load(tmp_path)
    assert tok.prompt_text("Hi", PromptFormat("chat", template_kwargs={"enable_thinking": False})).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.prompt_text("Hi", PromptFormat("chat")).endswith("<|im_start|>assistant\n")


def test_stop_tokens_are_generation_config_eos_ids_plus_the_tokenizer_eos(tmp_path, bpe_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / name).write_bytes((bpe_dir / name).read_bytes())
    tok = CheckpointTokenizer.load(tmp_path)
    im_end, endoftext = tok.tokenizer.token_to_id(IM_END), tok.tokenizer.token_to_id(ENDOFTEXT)
    assert tok.stop_ids == (im_end,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [endoftext, im_end]}))
    tok = CheckpointTokenizer.load(tmp_path)
    assert tok.stop_ids == (endoftext, im_end) and tok.eos_id == im_end and tok.pad_id == endoftext
    ids = tok.encode_text("\\boxed{5}")
    assert tok.response_text(ids + [endoftext, 7]) == ("\\boxed{5}", True)
    assert tok.response_text(ids) == ("\\boxed{5}", False)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**6}))
    with pytest.raises(MoerlError, match="outside the tokenizer's"):
        CheckpointTokenizer.load(tmp_path)


def test_a_prompt_is_valid_when_the_tokenizer_encodes_it(char_dir, bpe_dir):
    char, bpe = CheckpointTokenizer.load(char_dir), CheckpointTokenizer.load(bpe_dir)
    assert char.prompt_problem("sort:123>") is None
    problem = char.prompt_problem("Natürlich 5")
    assert "'N'" in problem and "'ü'" in problem and "unknown token" in problem
    assert bpe.prompt_problem("Natürlich 5 \u2603", CHAT) is None  # byte-level BPE encodes any text
    assert "prompt_format: chat" in char.prompt_problem([{"role": "user", "content": "hi"}], RAW)
    assert "no chat template" in char.prompt_problem("12+3=", CHAT)
    assert char.stop_ids == (EOS_ID,)
