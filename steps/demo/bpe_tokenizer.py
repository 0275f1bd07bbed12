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
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# ChatML, and for a conversation with tools the Qwen way (written here, not copied): the tools' schemas in the system
# message, an assistant's tool calls as <tool_call>{json}</tool_call> blocks after its text, and each tool message
# as a user turn in <tool_response> tags. Without tools it renders exactly plain ChatML.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one in <tool_call></tool_call> tags.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DEFAULT_VOCAB_SIZE = 400  # 256 bytes + 3 special tokens + the merges of the task's few words


def chatml(messages: Iterable[dict[str, str]]) -> str:
    """A conversation as the template renders it (the BPE's training text)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def render_conversation(messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    """A whole conversation through CHATML_TEMPLATE with its tools, as transformers renders it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=CHATML_TEMPLATE)
    return rendered[0]


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
