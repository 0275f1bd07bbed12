"""The demo checkpoint's own tokenizer: one token per character, built locally.

It is only what `moerl sft-demo` saves into the demo checkpoint; every step reads a checkpoint's tokenizer
through steps/data/tokenizer.py, which knows no vocabulary, so nothing outside the demo's SFT depends on this one.

Nothing is downloaded: the vocabulary is written out below and turned into a `tokenizers.Tokenizer`
(WordLevel model over single characters). `save_tokenizer` writes the files that
`transformers.AutoTokenizer.from_pretrained(dir)` loads offline (as `TokenizersBackend`, the class that
`PreTrainedTokenizerFast` names in transformers 5), so a checkpoint dir carries its own tokenizer.

Ids:
    0 <pad>   1 <bos>   2 <eos>   3 <unk>   then one id per character of VOCAB_CHARS, in that order.

`<unk>` only exists so that a Hugging Face tokenizer given text outside the vocabulary degrades to an unknown
token instead of failing inside Rust; our own `encode` refuses such text with a MoerlError. `<` is not a
vocabulary character, so no text that `encode` accepts can spell a special token.

Sequence conventions (shared by SFT, rollout and scoring):
    prompt ids   = [BOS_ID] + encode(prompt text)          (`encode_prompt`; also what the HF tokenizer
                                                             produces with its default add_special_tokens)
    response ids = encode(response text) + [EOS_ID]        a response ends at its first EOS
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from steps.errors import MoerlError

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
SPECIAL: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}

DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PUNCTUATION = " +=,:?>.-()*"  # space first
VOCAB_CHARS = DIGITS + LETTERS + PUNCTUATION
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(VOCAB_CHARS)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

_VOCAB_CHAR_SET = frozenset(VOCAB_CHARS)


def build_tokenizer() -> Tokenizer:
    """The tokenizer, built from the fixed vocabulary above (same ids on every machine)."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *VOCAB_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Every character is its own piece; [\s\S] so that newlines and other whitespace are pieces too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the pieces with nothing between them (the default decoder would insert spaces).
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # With add_special_tokens=True (the HF default) a text becomes a prompt: BOS in front, no EOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def unknown_chars(text: str) -> list[str]:
    """The distinct characters of `text` that are not in the vocabulary, in order of first appearance."""
    return list(dict.fromkeys(c for c in text if c not in _VOCAB_CHAR_SET))


def describe_vocab() -> str:
    return f"digits, lowercase letters a-z, space and {PUNCTUATION.strip()!r}"


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Ids of `text`, one per character, no special tokens. Text outside the vocabulary is a MoerlError."""
    bad = unknown_chars(text)
    if bad:
        shown = ", ".join(repr(c) for c in bad[:10])
        raise MoerlError(
            f"text {text[:40]!r} has characters outside the tokenizer vocabulary: {shown}; "
            f"use only {describe_vocab()}"
        )
    return tok.encode(text, add_special_tokens=False).ids


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
    """Ids the model sees for a prompt: BOS, then the text."""
    return [BOS_ID, *encode(tok, text)]


def response_end(ids: list[int]) -> tuple[list[int], bool]:
    """The response up to (not including) its first EOS, and whether an EOS was there at all."""
    ids = list(ids)
    if EOS_ID in ids:
        return ids[: ids.index(EOS_ID)], True
    return ids, False


def decode(tok: Tokenizer, ids: list[int]) -> str:
    """Text of `ids`: everything after the first EOS is dropped, then PAD/BOS/UNK are skipped.

    For any text over the vocabulary, decode(tok, encode(tok, text)) == text.
    """
    kept, _ = response_end(ids)
    return tok.decode([int(i) for i in kept], skip_special_tokens=True)


def save_tokenizer(directory: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / TOKENIZER_FILE))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "TokenizersBackend",
        "backend": "tokenizers",
        **specials,
        # Batched generation with a causal LM pads on the left so every prompt ends at the last column.
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
    }
    (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    (directory / SPECIAL_TOKENS_MAP_FILE).write_text(json.dumps(specials, indent=2) + "\n")
    return directory
