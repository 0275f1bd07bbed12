"""The prompt-file reader under fuzzing: whatever the bytes on the store, reading them ends in a list of prompts
or one MoerlError that names the file, never another exception.

tests/test_prompt_data.py checks each rule of the reader (steps/data/prompt_data.py); this fuzzes the
byte level (read_prompt_uri through a store: encodings, byte-order marks, NUL bytes), corruptions of valid
files (characters dropped, inserted, flipped, lines cut), JSON's non-standard literals and exotic line
separators, and the URI form a run config names."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steps.data.prompt_data import format_prompt_jsonl, parse_prompt_jsonl, read_prompt_uri
from steps.data.tasks import Prompt, get_task
from steps.errors import MoerlError
from steps.store.object_store import Store

SOURCE = "file:///runs/r1/prompts.jsonl"
VALID = format_prompt_jsonl(get_task("addition").prompts("train", 6, 0) + get_task("sort").prompts("train", 6, 0))
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def accepted_or_one_error(read) -> list[Prompt] | None:
    try:
        prompts = read()
    except MoerlError as err:
        assert str(err).strip(), "an empty message"
        return None
    assert prompts and all(isinstance(p, Prompt) for p in prompts)
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert all((p.messages or p.text.strip()) and p.answer.strip() for p in prompts)
    return prompts


@given(st.binary(max_size=400))
@FAST
def test_any_bytes_on_the_store(tmp_path, data):
    store = Store.open(str(tmp_path))
    store.put_bytes("prompts.jsonl", data)
    accepted_or_one_error(lambda: read_prompt_uri(store.url("prompts.jsonl")))


encodings = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "latin-1", "utf-32"])


@given(encodings, st.booleans())
@FAST
def test_a_valid_file_in_any_encoding(tmp_path, encoding, crlf):
    store = Store.open(str(tmp_path))
    text = VALID.replace("\n", "\r\n") if crlf else VALID
    store.put_bytes("prompts.jsonl", text.encode(encoding))
    prompts = accepted_or_one_error(lambda: read_prompt_uri(store.url("prompts.jsonl")))
    if encoding in ("utf-8", "utf-8-sig", "latin-1"):  # the ASCII-only file is the same bytes in latin-1
        assert prompts == parse_prompt_jsonl(VALID, SOURCE)


edits = st.lists(
    st.tuples(st.sampled_from(["drop", "insert", "flip", "cut-line"]), st.integers(0, len(VALID) - 1),
              st.characters(codec="utf-8")),
    min_size=1, max_size=6,
)  # fmt: skip


@given(edits)
@settings(max_examples=300, deadline=None)
def test_corrupted_valid_files(edits):
    text = VALID
    for kind, at, char in edits:
        at = min(at, len(text) - 1)
        if kind == "drop":
            text = text[:at] + text[at + 1 :]
        elif kind == "insert":
            text = text[:at] + char + text[at:]
        elif kind == "flip":
            text = text[:at] + chr(ord(text[at]) ^ 0x20) + text[at + 1 :]
        else:
            text = text[:at] + "\n" + text[at:]
    accepted_or_one_error(lambda: parse_prompt_jsonl(text, SOURCE))


literals = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-0", "1" * 400, "true", "null", "[]", "{}"])
separators = st.sampled_from(["\n", "\r\n", "\r", "\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x00"])


@given(st.lists(st.tuples(st.sampled_from(["prompt_id", "prompt", "answer"]), literals), max_size=4),
       separators)  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_non_standard_json_and_exotic_line_separators(fields, separator):
    good = json.loads(VALID.splitlines()[0])
    line = json.dumps(good)
    for name, literal in fields:
        line = line.replace(json.dumps(good[name]), literal, 1)
    accepted_or_one_error(lambda: parse_prompt_jsonl(separator.join([line, VALID.splitlines()[1]]), SOURCE))


@given(st.text(max_size=60))
@settings(max_examples=200, deadline=None)
def test_any_prompt_file_uri(uri):
    accepted_or_one_error(lambda: read_prompt_uri("file:///nonexistent-moerl-dir/" + uri))
