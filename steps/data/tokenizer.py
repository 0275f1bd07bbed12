"""The checkpoint's own tokenizer: how every step turns a prompt into token ids and a response back into text.

A checkpoint dir carries its tokenizer as Hugging Face writes it:

    tokenizer.json            the `tokenizers` model, pre-tokenizer, added tokens and post-processor
    tokenizer_config.json     bos/eos/pad/unk token strings, and the chat template (older checkpoints)
    special_tokens_map.json   the same token strings (legacy checkpoints)
    chat_template.jinja       the chat template (transformers 5 writes it here)
    generation_config.json    eos_token_id: an id or a list of ids that end a response
    config.json               eos_token_id, when there is no generation_config.json

`CheckpointTokenizer.load(dir)` reads them with the `tokenizers` library (no transformers tokenizer class is
built, so a step pays no transformers import for a raw prompt). Nothing here knows a vocabulary:

    prompt ids (raw)     tokenizer.encode(text, add_special_tokens=True): its post-processor puts BOS in front
                         only where this tokenizer adds one (the demo's does, Qwen's does not)
    prompt ids (chat)    the chat template rendered with add_generation_prompt (transformers' own renderer,
                         with the bos/eos/pad/unk strings and the template kwargs, e.g. enable_thinking), then
                         encoded without special tokens: the template writes its own, as apply_chat_template does
    stop tokens          generation_config.json eos_token_id (an int or a list) plus the tokenizer's eos token
    a response           ends at its first stop token (kept in the ids, left out of the text)

A prompt is valid when the tokenizer encodes it: text that a vocabulary without byte fallback can only map to
its unknown token is refused, naming the characters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from steps.errors import MoerlError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
# What a step that needs the tokenizer but not the weights downloads (those of them the checkpoint has).
TOKENIZER_FILES = (
    TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE, GENERATION_CONFIG_FILE,
    MODEL_CONFIG_FILE,
)  # fmt: skip
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")

Messages = tuple[Mapping[str, str], ...]
PromptInput = str | Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class PromptFormat:
    """How a prompt becomes the text the policy sees: as is ('raw') or through the chat template ('chat')."""

    kind: str = "raw"
    system_prompt: str | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def messages(self, prompt: PromptInput) -> list[dict[str, str]]:
        """The chat of a prompt: a string is one user message; the system prompt goes first unless the
        prompt's own messages start with one."""
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and not (chat and chat[0].get("role") == "system"):
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat


RAW = PromptFormat()


def _token_string(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise MoerlError(f"{path}: not valid JSON ({err}); save the tokenizer again with save_pretrained") from err
    if not isinstance(data, dict):
        raise MoerlError(f"{path}: expected a JSON object; save the tokenizer again with save_pretrained")
    return data


def _eos_ids(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class CheckpointTokenizer:
    """A checkpoint's tokenizer with its special tokens, stop tokens and chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        special_tokens: Mapping[str, str],
        stop_ids: Sequence[int],
        chat_template: str | None,
        source: str,
    ) -> None:
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens)
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in stop_ids))
        self.chat_template = chat_template
        self.source = source

    @classmethod
    def load(cls, directory: str | Path, source: str | None = None) -> CheckpointTokenizer:
        """The tokenizer saved in `directory`; `source` names the checkpoint in errors (default: the dir)."""
        directory = Path(directory)
        where = source or str(directory)
        path = directory / TOKENIZER_FILE
        if not path.is_file():
            raise MoerlError(
                f"{where}: no {TOKENIZER_FILE}; save the checkpoint's tokenizer beside its weights "
                "(AutoTokenizer.from_pretrained(...).save_pretrained(dir))"
            )
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # the Rust side raises plain Exception for malformed files
            raise MoerlError(
                f"{where}/{TOKENIZER_FILE} is not a valid tokenizer file ({str(err)[:200]}); save the tokenizer "
                "again with save_pretrained"
            ) from err
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        legacy = _read_json(directory / SPECIAL_TOKENS_MAP_FILE)
        special: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_string(config.get(name)) or _token_string(legacy.get(name))
            if token is not None:
                special[name] = token
        template_file = directory / CHAT_TEMPLATE_FILE
        template = config.get("chat_template")
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        elif isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        generation = _read_json(directory / GENERATION_CONFIG_FILE)
        eos_source = generation if "eos_token_id" in generation else _read_json(directory / MODEL_CONFIG_FILE)
        stop_ids = _eos_ids(eos_source.get("eos_token_id"))
        eos = special.get("eos_token")
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            stop_ids.append(tokenizer.token_to_id(eos))
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        bad = [i for i in stop_ids if not 0 <= i < vocab]
        if bad:
            raise MoerlError(
                f"{where}: eos_token_id {bad} is outside the tokenizer's {vocab} ids; fix eos_token_id in "
                f"{GENERATION_CONFIG_FILE} (or {MODEL_CONFIG_FILE})"
            )
        if not stop_ids:
            raise MoerlError(
                f"{where}: no stop token: neither {GENERATION_CONFIG_FILE} nor {MODEL_CONFIG_FILE} has "
                f"eos_token_id, and {TOKENIZER_CONFIG_FILE} names no eos_token that the tokenizer knows; set "
                "eos_token_id in generation_config.json"
            )
        return cls(tokenizer, special, stop_ids, template if isinstance(template, str) else None, where)

    # ------------------------------------------------------------------------------------ special tokens

    def token_id(self, name: str) -> int | None:
        """The id of a special token by its name ('bos_token', 'pad_token', ...), or None."""
        token = self.special_tokens.get(name)
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def eos_id(self) -> int:
        """The token a finished response ends with: the tokenizer's eos, else the first stop token."""
        eos = self.token_id("eos_token")
        return eos if eos is not None else self.stop_ids[0]

    @property
    def pad_id(self) -> int:
        """Padding: the tokenizer's pad token, else its eos (padded positions are masked out anyway)."""
        pad = self.token_id("pad_token")
        return pad if pad is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------------------------------ prompts

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` with no special tokens added (added tokens written in the text still match)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_text(self, prompt: PromptInput, fmt: PromptFormat = RAW) -> str:
        """The text the policy sees for `prompt`: the prompt itself, or the rendered chat template."""
        if fmt.kind == "raw":
            if not isinstance(prompt, str):
                raise MoerlError(
                    f"a prompt given as chat messages needs prompt_format: chat (the checkpoint {self.source} "
                    "formats messages with its chat template)"
                )
            return prompt
        return self.render_chat(fmt.messages(prompt), fmt)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        fmt: PromptFormat,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """A conversation through the checkpoint's chat template, as apply_chat_template renders it (with the
        template kwargs of `fmt` and, for a conversation with tools, their schemas)."""
        if self.chat_template is None:
            raise MoerlError(
                f"{self.source}: prompt_format is chat but the checkpoint has no chat template; add one "
                f"({CHAT_TEMPLATE_FILE}, or chat_template in {TOKENIZER_CONFIG_FILE}) or use prompt_format: raw"
            )
        # transformers' own renderer (a sandboxed jinja2 environment with its filters and extensions), so
        # a template renders here exactly as apply_chat_template renders it; imported only for chat prompts.
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(
                conversations=[[dict(m) for m in messages]],
                tools=None if tools is None else [dict(t) for t in tools],
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **dict(fmt.template_kwargs)},
            )
        except Exception as err:  # jinja2 raises TemplateError, the template itself anything via raise_exception
            raise MoerlError(
                f"{self.source}: its chat template failed on a prompt ({type(err).__name__}: {str(err)[:200]}); "
                "fix the prompt's messages or the template kwargs (chat_template_kwargs)"
            ) from err
        return rendered[0]

    def prompt_ids(self, prompt: PromptInput, fmt: PromptFormat = RAW) -> list[int]:
        """The ids the policy sees for `prompt` (module docstring: BOS only where the tokenizer adds one)."""
        return self._encode_prompt(self.prompt_text(prompt, fmt), fmt).ids

    def _encode_prompt(self, text: str, fmt: PromptFormat) -> Any:
        # raw: the post-processor adds what this tokenizer adds (BOS or nothing); chat: the template wrote it
        return self.tokenizer.encode(text, add_special_tokens=fmt.kind == "raw")

    def _unknown_pieces(self, text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]]) -> list[str]:
        unk = self.token_id("unk_token")
        if unk is None:
            unk = self.tokenizer.token_to_id("<unk>")
        if unk is None:
            return []
        pieces = [text[a:b] for i, (a, b) in zip(ids, offsets, strict=True) if i == unk]
        return list(dict.fromkeys(p for p in pieces if p != self.special_tokens.get("unk_token")))

    def unencodable(self, text: str) -> list[str]:
        """The distinct pieces of `text` that the tokenizer can only map to its unknown token."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return self._unknown_pieces(text, encoding.ids, encoding.offsets)

    def checked_prompt_ids(self, prompt: PromptInput, fmt: PromptFormat = RAW) -> tuple[list[int], str | None]:
        """(ids, None) for a prompt this checkpoint can take, else ([], why not): the format fits the prompt
        (and the checkpoint has a chat template for chat), and the tokenizer encodes every piece of it."""
        try:
            text = self.prompt_text(prompt, fmt)
        except MoerlError as err:
            return [], str(err)
        encoding = self._encode_prompt(text, fmt)
        bad = self._unknown_pieces(text, encoding.ids, encoding.offsets)
        if bad:
            shown = ", ".join(repr(p) for p in bad[:8])
            return [], f"the checkpoint's tokenizer cannot encode {shown} (it maps them to its unknown token)"
        if not encoding.ids:
            return [], "the prompt encodes to no tokens"
        return encoding.ids, None

    def prompt_problem(self, prompt: PromptInput, fmt: PromptFormat = RAW) -> str | None:
        """Why `prompt` cannot be a prompt for this checkpoint (format or tokenizer), or None."""
        return self.checked_prompt_ids(prompt, fmt)[1]

    # ---------------------------------------------------------------------------------------- responses

    def response_end(self, ids: Sequence[int]) -> tuple[list[int], bool]:
        """The response up to (not including) its first stop token, and whether it had one."""
        ids = [int(i) for i in ids]
        stops = set(self.stop_ids)
        for position, token in enumerate(ids):
            if token in stops:
                return ids[:position], True
        return ids, False

    def response_text(self, ids: Sequence[int]) -> tuple[str, bool]:
        """(text, ended): the response up to its first stop token, decoded as the model wrote it (special
        tokens before the stop stay in the text), and whether it ended."""
        kept, ended = self.response_end(ids)
        return self.tokenizer.decode(kept, skip_special_tokens=False), ended

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | Path, source: str | None = None) -> CheckpointTokenizer:
    """CheckpointTokenizer.load, by the name the steps use."""
    return CheckpointTokenizer.load(directory, source)
