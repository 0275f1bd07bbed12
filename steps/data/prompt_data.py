"""Prompt files: the user's own prompts, as JSONL or Parquet on any store URI (file://, s3://, a path).

One record per JSONL line (blank lines are ignored) or per Parquet row. The run config maps the field names
(`prompt_fields`; a dotted name reaches into a nested object, e.g. `reward_model.ground_truth`):

    prompt   a string, or a list of chat messages {"role": ..., "content": ...}     (default field 'prompt')
    answer   the reference answer: a string or a number                            (default field 'answer')
    id       the prompt's id: a string or an integer, unique in the file          (default field 'prompt_id');
             where a record has none, a stable hash of its prompt ("h-" + 16 hex digits)

Every other field travels with the prompt as its metadata, for the user's reward function. So common exports
load as they are: GSM8K (`prompt_fields: {prompt: question}`; its answers end in '#### 72', which the numeric
and math verifiers read), and chat-message datasets such as verl's Parquet (`prompt_fields: {prompt: prompt,
answer: reward_model.ground_truth}`).

Held-out prompts come from `heldout_file` (same format and fields), or else `heldout_fraction` of the file's
prompts are split off by a stable hash of their id (`heldout_split`), never trained on.

Every bad record is reported, with its line (JSONL) or row (Parquet) number, in one MoerlError naming the file.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from steps.data.tasks import Prompt
from steps.errors import MoerlError

if TYPE_CHECKING:
    from steps.data.verifiers import Verifier

PROMPT_FILE_TASK = "prompt_file"  # the `task` of a prompt-file prompt: its verifier comes from the run config
_MAX_PROBLEMS_SHOWN = 20
_MISSING = object()


@dataclass(frozen=True)
class PromptFields:
    """Where a record keeps its prompt, answer and id (dotted names reach into nested objects)."""

    prompt: str = "prompt"
    answer: str = "answer"
    id: str = "prompt_id"

    def hint(self) -> str:
        return (
            f'each record needs "{self.prompt}" (a string or a list of chat messages) and "{self.answer}", '
            f'and may have "{self.id}"; map other names with prompt_fields in the run config'
        )


class _Pairs(list):
    """A JSON object as its (key, value) pairs, so that repeated keys are seen, not silently merged."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _lookup(record: Mapping[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def hashed_id(prompt: str | list[dict[str, str]]) -> str:
    """A stable id for a record without one: blake2b of the prompt as canonical JSON."""
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    return "h-" + hashlib.blake2b(text.encode(), digest_size=8, person=b"moerl-prompt").hexdigest()


def heldout_split(prompt_id: str, fraction: float) -> bool:
    """Whether `prompt_id` is held out: a stable hash of the id, below `fraction` of its range."""
    digest = hashlib.blake2b(prompt_id.encode(), digest_size=8, person=b"moerl-heldout").digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def _messages_problem(value: list[Any]) -> str | None:
    if not value:
        return "an empty list of chat messages"
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            return f"chat message {i} is not an object"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f'chat message {i} needs a string "{key}"'
    return None


def _record_prompt(
    record: Any,
    fields: PromptFields,
    seen: dict[str, int],
    number: int,
    verifier: Verifier | None,
    prompt_problem: Callable[[str | list[dict[str, str]]], str | None] | None,
) -> tuple[Prompt | None, list[str]]:
    if not isinstance(record, Mapping):
        return None, [f"not an object (got {type(record).__name__})"]
    problems: list[str] = []
    prompt = _lookup(record, fields.prompt)
    messages = None
    if prompt is _MISSING:
        problems.append(f"missing field {fields.prompt!r} (the prompt)")
        prompt = None
    elif isinstance(prompt, str):
        if not prompt.strip():
            problems.append("empty prompt")
    elif isinstance(prompt, list):
        if problem := _messages_problem(prompt):
            problems.append(f"field {fields.prompt!r}: {problem}")
        else:
            prompt = messages = [{k: v for k, v in dict(m).items() if v is not None} for m in prompt]
    else:
        kind = "null" if prompt is None else type(prompt).__name__
        problems.append(f"field {fields.prompt!r} must be a string or a list of chat messages, got {kind}")
        prompt = None

    answer = _lookup(record, fields.answer)
    if answer is _MISSING:
        problems.append(f"missing field {fields.answer!r} (the reference answer)")
        answer = None
    elif isinstance(answer, bool) or not isinstance(answer, str | int | float):
        kind = "null" if answer is None else type(answer).__name__
        problems.append(f"field {fields.answer!r} must be a string or a number, got {kind}")
        answer = None
    else:
        answer = str(answer)
        if not answer.strip():
            problems.append("empty answer")
        elif verifier is not None and (problem := verifier.answer_problem(answer)):
            problems.append(f"answer {_short(answer)}: {problem}")

    prompt_id = _lookup(record, fields.id)
    if prompt_id is _MISSING or prompt_id is None:
        prompt_id = hashed_id(prompt) if prompt is not None else None
        duplicate = "the same prompt as"
    elif isinstance(prompt_id, bool) or not isinstance(prompt_id, str | int):
        problems.append(f"field {fields.id!r} must be a string or an integer, got {type(prompt_id).__name__}")
        prompt_id = None
    else:
        prompt_id = str(prompt_id)
        duplicate = f"duplicate {fields.id} {_short(prompt_id)}, first"
        if not prompt_id.strip():
            problems.append(f"empty {fields.id}")
            prompt_id = None
    if prompt_id is not None:
        if prompt_id in seen:
            problems.append(f"{duplicate} on {seen[prompt_id]}")
        else:
            seen[prompt_id] = number
    if prompt is not None and prompt_problem is not None and not problems:
        if problem := prompt_problem(prompt):
            problems.append(problem)
    if problems:
        return None, problems
    used = {fields.prompt.split(".")[0], fields.answer.split(".")[0], fields.id.split(".")[0]}
    metadata = {k: v for k, v in record.items() if k not in used}
    text = prompt if isinstance(prompt, str) else str(messages[-1]["content"])  # type: ignore[index]
    return (
        Prompt(
            prompt_id=str(prompt_id), task=PROMPT_FILE_TASK, text=text, answer=str(answer),
            messages=tuple(messages) if messages is not None else None, metadata=metadata,
        ),  # fmt: skip
        [],
    )


def parse_records(
    records: Iterable[tuple[str, Any]],
    source: str,
    fields: PromptFields = PromptFields(),
    verifier: Verifier | None = None,
    prompt_problem: Callable[[str | list[dict[str, str]]], str | None] | None = None,
) -> list[Prompt]:
    """Prompts of (where, record) pairs ('line 3', {...}); every bad record is reported in one MoerlError.

    `verifier` checks each answer can ever be matched; `prompt_problem` (the checkpoint's tokenizer and the
    prompt format) checks each prompt can be encoded."""
    prompts: list[Prompt] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for where, record in records:
        if isinstance(record, str):  # a line that did not parse: record is the message
            problems.append(f"{where}: {record}")
            continue
        prompt, record_problems = _record_prompt(record, fields, seen, where, verifier, prompt_problem)  # type: ignore[arg-type]
        problems.extend(f"{where}: {p}" for p in record_problems)
        if prompt is not None:
            prompts.append(prompt)
    if problems:
        shown = problems[:_MAX_PROBLEMS_SHOWN]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise MoerlError(
            f"prompt file {source} has {len(problems)} problem(s):\n  " + "\n  ".join(shown)
            + f"\nfix these records: {fields.hint()}"
        )  # fmt: skip
    if not prompts:
        raise MoerlError(f"prompt file {source} has no prompts; {fields.hint()}")
    return prompts


def jsonl_records(text: str) -> Iterable[tuple[str, Any]]:
    """(line N, object) per nonblank line; a line that is not one JSON object yields its problem as a str."""
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"line {lineno}"
        try:
            pairs = json.loads(line, object_pairs_hook=_Pairs)
        except json.JSONDecodeError as err:
            yield where, f"invalid JSON ({err.msg} at column {err.colno})"
            continue
        except (ValueError, RecursionError) as err:  # an integer too long to convert, absurd nesting
            yield where, f"invalid JSON ({str(err)[:80] or type(err).__name__})"
            continue
        if not isinstance(pairs, _Pairs):
            yield where, f"not a JSON object (got {type(pairs).__name__})"
            continue
        keys = [k for k, _ in pairs]
        repeated = [k for k in dict.fromkeys(keys) if keys.count(k) > 1]
        if repeated:
            yield where, "; ".join(f"field {_short(k)} given more than once" for k in repeated)
            continue
        yield where, _plain(pairs)


def _plain(value: Any) -> Any:
    """_Pairs (nested too) as dicts."""
    if isinstance(value, _Pairs):
        return {k: _plain(v) for k, v in value}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def parquet_records(data: bytes, source: str) -> Iterable[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(io.BytesIO(data)).read(use_threads=False)
    except (pa.ArrowException, OSError) as err:
        raise MoerlError(f"prompt file {source} is not a readable Parquet file ({err}); write it again") from err
    for row, record in enumerate(table.to_pylist(), start=1):
        yield f"row {row}", record


def parse_prompt_jsonl(text: str, source: str, fields: PromptFields = PromptFields(), **checks: Any) -> list[Prompt]:
    """Prompts of a JSONL prompt file's text (module docstring)."""
    return parse_records(jsonl_records(text), source, fields, **checks)


def format_prompt_jsonl(prompts: Iterable[Prompt], fields: PromptFields = PromptFields()) -> str:
    """The JSONL text of `prompts`, which parse_prompt_jsonl reads back unchanged."""
    lines = []
    for p in prompts:
        record = {**p.metadata, fields.id: p.prompt_id, fields.prompt: list(p.messages) if p.messages else p.text,
                  fields.answer: p.answer}  # fmt: skip
        lines.append(json.dumps(record) + "\n")
    return "".join(lines)


def read_prompt_uri(
    uri: str,
    fields: PromptFields = PromptFields(),
    verifier: Verifier | None = None,
    prompt_problem: Callable[[str | list[dict[str, str]]], str | None] | None = None,
) -> list[Prompt]:
    """The prompts of the JSONL or Parquet file named by a store URI (Parquet by the '.parquet' suffix or its
    magic bytes)."""
    from steps.store.backend import ObjectNotFound
    from steps.store.object_store import Store  # lazily: the store pulls in fsspec/s3fs

    parent, _, name = uri.rstrip("/").rpartition("/")
    if not name or not parent:
        raise MoerlError(f"prompt file {uri!r}: name a file, e.g. s3://bucket/prompts/train.jsonl")
    store = Store.open(parent)
    source = store.url(name)
    try:
        data = store.get_bytes(name)
    except ObjectNotFound as err:
        raise MoerlError(
            f"prompt file {source} does not exist; upload the JSONL or Parquet file there or fix the URI"
        ) from err
    if name.endswith(".parquet") or data[:4] == b"PAR1":
        records = parquet_records(data, source)
    else:
        try:
            text = data.decode("utf-8-sig")  # tolerate a byte-order mark written by some editors
        except UnicodeDecodeError as err:
            raise MoerlError(
                f"prompt file {source} is not UTF-8 text (bad byte at offset {err.start}); save it as UTF-8 JSONL "
                "or write Parquet"
            ) from err
        records = jsonl_records(text)
    return parse_records(records, source, fields, verifier, prompt_problem)
