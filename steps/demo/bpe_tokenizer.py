"""The chat demo's tokenizer: a byte-level BPE trained with the `tokenizers` library on the task's own text,
with a ChatML chat template, the way Qwen's tokenizer is built (no BOS; `<|im_end|>` ends a turn).

Nothing is downloaded: `train_chat_tokenizer(corpus, dir)` learns the merges from the given texts and writes the
files a Hugging Face checkpoint carries (tokenizer.json, tokenizer_config.json, chat_template.jinja), which
`transformers.AutoTokenizer` loads offline and steps/data/tokenizer.py reads. Digits are split one per token (as
Qwen's and Llama's pre-tokenizers do), so a number is never one opaque token.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_VOCAB_SIZE = 400  # 256 bytes + 3 special tokens + the merges of the task's few words


def chatml(messages: Iterable[dict[str, str]]) -> str:
    """A conversation as the template renders it (the BPE's training text)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def train_chat_tokenizer(corpus: Iterable[str], directory: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train the BPE on `corpus` and write tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "backend": "tokenizers",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    return directory
