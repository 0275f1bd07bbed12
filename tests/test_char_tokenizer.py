import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steps.data.tokenizer import CheckpointTokenizer
from steps.demo.char_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL,
    UNK_ID,
    VOCAB_CHARS,
    VOCAB_SIZE,
    build_tokenizer,
    decode,
    encode,
    encode_prompt,
    response_end,
    save_tokenizer,
)
from steps.errors import MoerlError

TOK = build_tokenizer()
vocab_text = st.text(alphabet=VOCAB_CHARS, max_size=40)


def test_special_ids_are_fixed_and_pad_is_zero():
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert SPECIAL == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    assert TOK.token_to_id("<pad>") == 0
    assert TOK.token_to_id("<bos>") == BOS_ID
    assert TOK.token_to_id("<eos>") == EOS_ID
    assert TOK.get_vocab_size() == VOCAB_SIZE == 4 + len(VOCAB_CHARS)


def test_vocabulary_holds_digits_letters_space_and_task_punctuation():
    for c in "0123456789abcdefghijklmnopqrstuvwxyz +=,:?>.-()*":
        assert c in VOCAB_CHARS
    assert "<" not in VOCAB_CHARS  # so no accepted text can spell a special token
    assert len(set(VOCAB_CHARS)) == len(VOCAB_CHARS)


def test_one_token_per_character_with_stable_ids():
    ids = encode(TOK, "12+345=")
    assert len(ids) == 7
    assert ids == [TOK.token_to_id(c) for c in "12+345="]
    assert encode(TOK, "0") == [4]  # first id after the four specials
    assert encode(TOK, "") == []


def test_build_is_deterministic():
    assert build_tokenizer().to_str() == TOK.to_str()


@given(vocab_text)
def test_decode_is_exact_inverse_of_encode(text):
    ids = encode(TOK, text)
    assert len(ids) == len(text)
    assert all(i >= 4 for i in ids)
    assert decode(TOK, ids) == text


def test_decode_keeps_spaces_exactly():
    for text in ["  a b  ", "sort:1 2>", " ", "a  b"]:
        assert decode(TOK, encode(TOK, text)) == text


def test_decode_stops_at_first_eos_and_drops_pad_and_bos():
    body = encode(TOK, "357")
    assert decode(TOK, body + [EOS_ID]) == "357"
    assert decode(TOK, body + [EOS_ID, PAD_ID, PAD_ID]) == "357"
    assert decode(TOK, body + [EOS_ID] + encode(TOK, "99") + [EOS_ID]) == "357"
    assert decode(TOK, [BOS_ID] + body + [PAD_ID]) == "357"
    assert decode(TOK, [PAD_ID, PAD_ID] + body) == "357"
    assert decode(TOK, [EOS_ID] + body) == ""


def test_response_end_reports_whether_eos_was_written():
    assert response_end([5, 6, EOS_ID, 7]) == ([5, 6], True)
    assert response_end([5, 6, 7]) == ([5, 6, 7], False)
    assert response_end([]) == ([], False)


def test_encode_prompt_puts_bos_first():
    assert encode_prompt(TOK, "1+2=") == [BOS_ID] + encode(TOK, "1+2=")


@pytest.mark.parametrize("text", ["A", "1+2=\n", "<eos>", "héllo", "tab\there"])
def test_encode_rejects_characters_outside_vocabulary(text):
    with pytest.raises(MoerlError, match="outside the tokenizer vocabulary"):
        encode(TOK, text)


def test_save_and_load_round_trip(tmp_path):
    save_tokenizer(tmp_path / "tok")
    for name in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
        assert (tmp_path / "tok" / name).is_file()
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<bos>" and config["eos_token"] == "<eos>" and config["pad_token"] == "<pad>"
    checkpoint_tokenizer = CheckpointTokenizer.load(tmp_path / "tok")
    loaded = checkpoint_tokenizer.tokenizer
    assert loaded.to_str() == TOK.to_str()
    # what every step reads from it: BOS from the post-processor, eos as the stop token, pad
    assert checkpoint_tokenizer.prompt_ids("sort:8301>") == encode_prompt(TOK, "sort:8301>")
    assert checkpoint_tokenizer.stop_ids == (EOS_ID,) and checkpoint_tokenizer.pad_id == PAD_ID
    assert encode(loaded, "sort:8301>") == encode(TOK, "sort:8301>")


def test_load_from_dir_without_tokenizer_names_dir_and_fix(tmp_path):
    with pytest.raises(MoerlError) as err:
        CheckpointTokenizer.load(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert "save_pretrained" in str(err.value)


def test_load_corrupt_tokenizer_file_is_a_moerl_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(MoerlError, match="not a valid tokenizer file"):
        CheckpointTokenizer.load(tmp_path)


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_tok")
    save_tokenizer(directory)
    # A checkpoint dir also holds the model's config.json (Qwen3-MoE); AutoTokenizer must still pick our
    # tokenizer_config's class and not the model type's default tokenizer class.
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": VOCAB_SIZE}))
    return directory


def _auto_tokenizer(directory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def test_auto_tokenizer_loads_offline_with_specials_set(hf_tokenizer_dir):
    hf = _auto_tokenizer(hf_tokenizer_dir)
    assert type(hf).__name__ == "TokenizersBackend"
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert hf.pad_token == "<pad>" and hf.bos_token == "<bos>" and hf.eos_token == "<eos>"
    assert len(hf) == VOCAB_SIZE
    assert hf.padding_side == "left"


def test_auto_tokenizer_agrees_with_ours(hf_tokenizer_dir):
    hf = _auto_tokenizer(hf_tokenizer_dir)
    for text in ["12+345=", "sort:8301>", "what is 2*(3-1)?", "  a, b. c:d  ", ""]:
        ids = encode(TOK, text)
        assert hf.encode(text, add_special_tokens=False) == ids
        assert hf(text)["input_ids"] == encode_prompt(TOK, text)
        assert hf.decode(ids) == text
        assert hf.decode(ids + [EOS_ID, PAD_ID], skip_special_tokens=True) == decode(TOK, ids + [EOS_ID, PAD_ID])


def test_auto_tokenizer_batch_pads_left_with_pad_id(hf_tokenizer_dir):
    hf = _auto_tokenizer(hf_tokenizer_dir)
    batch = hf(["1+2=", "10+20="], padding=True)["input_ids"]
    assert batch[0] == [PAD_ID, PAD_ID] + encode_prompt(TOK, "1+2=")
    assert batch[1] == encode_prompt(TOK, "10+20=")
