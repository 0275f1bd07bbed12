import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from steps.char_tokenizer import DIGITS, VOCAB_CHARS
from steps.errors import MoerlError
from steps.tasks import TASKS, Prompt, format_prompt_jsonl, parse_prompt_jsonl, read_prompt_file

SOURCE = "file:///runs/r1/prompts.jsonl"


def line(**fields):
    base = {"prompt_id": "p1", "prompt": "12+345=", "answer": "357", "task": "addition3"}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}, ensure_ascii=False)


def problems_of(text):
    with pytest.raises(MoerlError) as err:
        parse_prompt_jsonl(text, SOURCE)
    return str(err.value)


def test_valid_file_parses_and_skips_blank_lines():
    text = "\n".join(
        [
            line(),
            "",
            "   ",
            line(prompt_id="p2", prompt="what is 2+2?", answer="4", task="addition"),
            line(prompt_id="p3", prompt="sort:8301>", answer="0138", task="sort4"),
        ]
    )
    prompts = parse_prompt_jsonl(text + "\n\n", SOURCE)
    assert prompts == [
        Prompt("p1", "addition3", "12+345=", "357"),
        Prompt("p2", TASKS["addition"].name, "what is 2+2?", "4"),
        Prompt("p3", "sort4", "sort:8301>", "0138"),
    ]


def test_crlf_line_endings_are_accepted():
    assert parse_prompt_jsonl(line() + "\r\n" + line(prompt_id="p2") + "\r\n", SOURCE)[1].prompt_id == "p2"


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ('{"prompt_id": "p1", "prompt": "1+2="', "invalid JSON (Expecting ',' delimiter at column 37)"),
        ('{"n": ' + "1" * 5000 + "}", "invalid JSON (Exceeds the limit"),
        ("[1, 2]", "not a JSON object (got list)"),
        ('"just a string"', "not a JSON object (got str)"),
        (line(answer=...), "missing field 'answer'"),
        (line(extra="x"), "unknown field 'extra'"),
        (line(answer=357), "field 'answer' must be a string, got int"),
        (line(prompt=None), "field 'prompt' must be a string, got null"),
        (line(prompt="  "), "empty prompt"),
        (line(prompt_id=""), "empty prompt_id"),
        (line(answer=""), "empty answer"),
        (line(task="multiplication"), "unknown task 'multiplication'"),
        (line(prompt="12+345=\n"), "prompt has characters outside the tokenizer vocabulary: '\\n'"),
        (line(prompt="What is 1+2?"), "outside the tokenizer vocabulary: 'W'"),
        (line(answer="three"), "answer 'three' can never be matched by task addition3 (digits only"),
        (line(answer="3 5 7"), "can never be matched"),
        ('{"prompt_id": "p1", "prompt_id": "p2", "prompt": "1=", "answer": "1", "task": "sort4"}', "given more"),
    ],
)
def test_each_kind_of_bad_line_is_reported_with_its_line_number(bad_line, expected):
    message = problems_of(line(prompt_id="ok") + "\n\n" + bad_line + "\n")
    assert SOURCE in message
    assert any(m.startswith("  line 3: ") and expected in m for m in message.splitlines()), message
    assert "line 1" not in message
    assert "fix these lines" in message and '"prompt_id": str' in message


def test_duplicate_prompt_id_names_both_lines():
    message = problems_of("\n".join([line(), line(prompt_id="p2"), line()]))
    assert "line 3: duplicate prompt_id 'p1' (first on line 1)" in message


def test_all_problems_are_reported_in_one_error():
    text = "\n".join([line(prompt_id="a"), "nope", line(prompt_id="b", task="x"), line(prompt_id="c", answer=1)])
    message = problems_of(text)
    assert message.startswith(f"prompt file {SOURCE} has 3 problem(s)")
    assert re.search(r"line 2: invalid JSON", message)
    assert "line 3: unknown task 'x'" in message
    assert "line 4: field 'answer' must be a string" in message


def test_a_line_with_several_problems_reports_each():
    message = problems_of('{"prompt": 5, "answer": "", "task": "sort4", "foo": 1}')
    for expected in ["missing field 'prompt_id'", "unknown field 'foo'", "field 'prompt' must be", "empty answer"]:
        assert f"line 1: {expected}" in message


def test_problem_list_is_capped():
    message = problems_of("\n".join(["{bad"] * 50))
    assert "has 50 problem(s)" in message
    assert "line 20: invalid JSON" in message
    assert "line 21:" not in message
    assert "... and 30 more" in message


def test_empty_file_is_an_error():
    for text in ["", "\n\n  \n"]:
        assert "has no prompts" in problems_of(text)


def test_long_values_are_shortened_in_messages():
    message = problems_of(line(task="t" * 10_000))
    assert len(message) < 2000


prompt_ids = st.text(min_size=1, max_size=20).filter(lambda s: s.strip())
vocab_text = st.text(alphabet=VOCAB_CHARS, min_size=1, max_size=30).filter(lambda s: s.strip())
answers = st.text(alphabet=DIGITS, min_size=1, max_size=8)


@st.composite
def prompt_lists(draw):
    ids = draw(st.lists(prompt_ids, min_size=1, max_size=15, unique=True))
    names = sorted({task.name for task in TASKS.values()})
    return [Prompt(i, draw(st.sampled_from(names)), draw(vocab_text), draw(answers)) for i in ids]


@given(prompt_lists())
def test_valid_generated_files_round_trip(prompts):
    assert parse_prompt_jsonl(format_prompt_jsonl(prompts), SOURCE) == prompts


@given(st.text(max_size=300))
@settings(max_examples=300)
def test_arbitrary_text_raises_only_moerl_error(text):
    try:
        prompts = parse_prompt_jsonl(text, SOURCE)
    except MoerlError as err:
        assert SOURCE in str(err)
    else:
        assert prompts and all(isinstance(p, Prompt) for p in prompts)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
field_names = st.sampled_from(["prompt_id", "prompt", "answer", "task", "extra"])
field_values = st.one_of(json_values, vocab_text, answers, st.sampled_from(sorted(TASKS)))


@given(st.lists(st.dictionaries(field_names, field_values, max_size=5) | json_values, max_size=8))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_json_shaped_lines_raise_only_moerl_error(objects):
    text = "\n".join(json.dumps(o) for o in objects)
    try:
        prompts = parse_prompt_jsonl(text, SOURCE)
    except MoerlError:
        return
    assert len(prompts) == len(objects)
    assert len({p.prompt_id for p in prompts}) == len(prompts)


def test_deeply_nested_json_is_a_moerl_error():
    assert "line 1: invalid JSON" in problems_of("[" * 100_000 + "]" * 100_000)


# ------------------------------------------------------------ through the run store

store_module = pytest.importorskip("steps.store")


def test_read_prompt_file_from_store(tmp_path):
    store = store_module.Store.open(f"file://{tmp_path}")
    prompts = TASKS["sort4"].prompts("train", 5, 0)
    store.put_bytes("prompts/train.jsonl", format_prompt_jsonl(prompts).encode())
    assert read_prompt_file(store, "prompts/train.jsonl") == prompts


def test_read_prompt_file_accepts_a_byte_order_mark(tmp_path):
    store = store_module.Store.open(f"file://{tmp_path}")
    store.put_bytes("p.jsonl", b"\xef\xbb\xbf" + line().encode())
    assert read_prompt_file(store, "p.jsonl")[0].prompt_id == "p1"


def test_read_prompt_file_errors_name_the_store_object(tmp_path):
    store = store_module.Store.open(f"file://{tmp_path}")
    store.put_bytes("bad.jsonl", (line() + "\n" + line(prompt_id="p2", task="nope")).encode())
    with pytest.raises(MoerlError, match=r"bad\.jsonl has 1 problem\(s\):\n  line 2: unknown task 'nope'"):
        read_prompt_file(store, "bad.jsonl")
    store.put_bytes("latin1.jsonl", line(prompt="caf\u00e9").encode("latin-1"))
    with pytest.raises(MoerlError, match=r"latin1\.jsonl is not UTF-8"):
        read_prompt_file(store, "latin1.jsonl")
    with pytest.raises(MoerlError, match=r"missing\.jsonl does not exist"):
        read_prompt_file(store, "missing.jsonl")
