"""Verifiable toy tasks: prompts with exact answers, rule verifiers, and prompt files.

A task makes prompts deterministically and checks responses exactly:

    addition<D>  "12+345=" -> "357"        two operands drawn from 0 .. 10**D - 1 (D = 1..6)
    sort<L>      "sort:8301>" -> "0138"    the L digits in ascending order (L = 2..10)

`addition` and `sort` name the default difficulty (see DEFAULT_ADDITION_DIGITS, DEFAULT_SORT_LENGTH); a task's
`name` is always the canonical one ("addition3"), and `get_task("addition", digits=4)` builds any other.

The model's response is the answer text followed by `<eos>` (see steps.tokenizer). `verify` compares the
response with the answer after stripping surrounding whitespace:
    well_formed  the response ended (the policy wrote <eos>), is nonempty after stripping, and has only the
                 task's answer characters (digits);
    correct      the response ended and its stripped text equals the stripped answer.

Splits: "train" and "heldout". A problem's split is a hash of its split key, and the key ignores what does
not change the problem's substance: a+b and b+a share a key, and so do all orderings of the same digits for
sort. So no held-out problem, nor a reordering of one, is ever a training prompt, whatever the seed or
difficulty. `prompts(split, n, seed)` returns n distinct problems of that split, the same for the same
arguments on any machine; prompt ids are stable ("addition3/012345": operands 012 and 345; "sort5/83014").

Prompt files (JSONL, read from the run store). One JSON object per line; blank lines are ignored:

    {"prompt_id": "q1", "prompt": "12+345=", "answer": "357", "task": "addition3"}

    prompt_id  string, nonempty, unique within the file
    prompt     string, nonempty; only tokenizer vocabulary characters (digits, a-z, space, +=,:?>.-()*)
    answer     string, a well-formed answer for the task (for every task here: digits only)
    task       string, a known task name (see TASKS) whose verifier checks the answer

No other fields are allowed. The prompt text is free (it need not look like the task's own prompts); only the
answer is checked, by the named task's verifier. An alias ("addition") is stored as the canonical task name.
Every bad line is reported, with its line number, in one error.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

from steps.errors import MoerlError
from steps.tokenizer import DIGITS, describe_vocab, response_end, unknown_chars

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from steps.store import Store

SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 10
# Defaults sized for the CPU demo: a ~0.8M-parameter dense model reached about 40% held-out exact match on
# addition3 after ~450 steps of batch 128, and 60% on sort6 after only 80 steps, so sort defaults longer.
DEFAULT_ADDITION_DIGITS = 3
DEFAULT_SORT_LENGTH = 8
ADDITION_DIGITS = range(1, 7)  # "999999+999999=" is 14 characters
SORT_LENGTHS = range(2, 11)  # "sort:0123456789>" is 16 characters
# Spaces up to this many problems are enumerated once per split (exact sampling without replacement);
# bigger ones are sampled by rejection, where a split is far larger than any n anyone asks for.
_ENUMERATE_LIMIT = 200_000


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    task: str
    text: str
    answer: str


@dataclass(frozen=True)
class Verdict:
    correct: bool
    well_formed: bool


class Task(Protocol):
    name: str
    answer_rule: str  # what a well-formed answer looks like, for error messages

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]: ...

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict: ...


def split_of(split_key: str) -> str:
    """'heldout' for HELDOUT_PERCENT percent of split keys, 'train' for the rest; fixed forever."""
    digest = hashlib.blake2b(split_key.encode(), digest_size=8, person=b"moerl-split").digest()
    return "heldout" if int.from_bytes(digest, "big") % 100 < HELDOUT_PERCENT else "train"


class DigitTask:
    """A task whose problems are numbered 0 .. space_size-1 and whose answers are digit strings."""

    name: str
    space_size: int
    longest_answer: int  # characters (one token each) of the longest answer
    answer_chars = frozenset(DIGITS)
    answer_rule = "digits only, e.g. '357'"

    def problem(self, index: int) -> tuple[str, str, str]:
        """(prompt text, answer, split key) of problem `index`."""
        raise NotImplementedError

    def prompt_id(self, index: int) -> str:
        return f"{self.name}/{index:0{len(str(self.space_size - 1))}d}"

    @cached_property
    def _enumerated(self) -> dict[str, list[int]]:
        by_split: dict[str, list[int]] = {s: [] for s in SPLITS}
        for index in range(self.space_size):
            by_split[split_of(self.problem(index)[2])].append(index)
        return by_split

    def _sample_indices(self, split: str, n: int, rng: random.Random) -> list[int]:
        if self.space_size <= _ENUMERATE_LIMIT:
            pool = self._enumerated[split]
            if n > len(pool):
                raise MoerlError(
                    f"task {self.name} has only {len(pool)} {split} problems but {n} were asked for; "
                    "ask for fewer prompts or use a harder setting of the task"
                )
            return rng.sample(pool, n)
        chosen: dict[int, None] = {}  # insertion-ordered set
        for _ in range(max(100 * n, 100_000)):
            if len(chosen) == n:
                break
            index = rng.randrange(self.space_size)
            if index not in chosen and split_of(self.problem(index)[2]) == split:
                chosen[index] = None
        if len(chosen) < n:
            raise MoerlError(
                f"task {self.name}: could not find {n} distinct {split} problems; ask for fewer prompts"
            )
        return list(chosen)

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]:
        """n distinct problems of `split`, the same ones for the same (split, n, seed)."""
        if split not in SPLITS:
            raise MoerlError(f"unknown split {split!r} for task {self.name}; use one of {', '.join(SPLITS)}")
        if n < 0:
            raise MoerlError(f"number of prompts must be >= 0, got {n}")
        # A string seed is hashed with SHA-512 by random.Random: stable across runs and PYTHONHASHSEED.
        rng = random.Random(f"{self.name}/{split}/{seed}")
        prompts = []
        for index in self._sample_indices(split, n, rng):
            text, answer, _ = self.problem(index)
            prompts.append(Prompt(prompt_id=self.prompt_id(index), task=self.name, text=text, answer=answer))
        return prompts

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict:
        """Exact match after stripping whitespace; `ended` says whether the policy wrote <eos>."""
        text = response.strip()
        well_formed = ended and bool(text) and all(c in self.answer_chars for c in text)
        return Verdict(correct=ended and text == answer.strip(), well_formed=well_formed)

    def __repr__(self) -> str:
        return f"<task {self.name}>"


class Addition(DigitTask):
    """'a+b=' -> the sum, with a and b uniform in 0 .. 10**digits - 1."""

    def __init__(self, digits: int = DEFAULT_ADDITION_DIGITS) -> None:
        _check_param("addition", "digits", digits, ADDITION_DIGITS)
        self.digits = digits
        self.name = f"addition{digits}"
        self.space_size = 10 ** (2 * digits)
        self.longest_answer = digits + 1  # 999+999=1998

    def problem(self, index: int) -> tuple[str, str, str]:
        a, b = divmod(index, 10**self.digits)
        return f"{a}+{b}=", str(a + b), f"addition:{min(a, b)}+{max(a, b)}"


class Sort(DigitTask):
    """'sort:<digits>>' -> the digits in ascending order; all `length`-digit strings, leading zeros too."""

    def __init__(self, length: int = DEFAULT_SORT_LENGTH) -> None:
        _check_param("sort", "length", length, SORT_LENGTHS)
        self.length = length
        self.name = f"sort{length}"
        self.space_size = 10**length
        self.longest_answer = length

    def problem(self, index: int) -> tuple[str, str, str]:
        digits = f"{index:0{self.length}d}"
        answer = "".join(sorted(digits))
        return f"sort:{digits}>", answer, f"sort:{answer}"


def _check_param(family: str, param: str, value: object, allowed: range) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
        raise MoerlError(
            f"task {family}: {param}={value!r} is out of range; "
            f"use an integer from {allowed[0]} to {allowed[-1]}"
        )


FAMILIES: dict[str, type[DigitTask]] = {"addition": Addition, "sort": Sort}


def _registry() -> dict[str, Task]:
    tasks: dict[str, Task] = {}
    for digits in ADDITION_DIGITS:
        tasks[f"addition{digits}"] = Addition(digits)
    for length in SORT_LENGTHS:
        tasks[f"sort{length}"] = Sort(length)
    tasks["addition"] = tasks[f"addition{DEFAULT_ADDITION_DIGITS}"]
    tasks["sort"] = tasks[f"sort{DEFAULT_SORT_LENGTH}"]
    return tasks


TASKS: dict[str, Task] = _registry()


def get_task(name: str, **params: int) -> Task:
    """A task by name ("addition3", "sort"); with params, a family built to order ("addition", digits=4)."""
    if params:
        family = FAMILIES.get(name)
        if family is None:
            raise MoerlError(
                f"task parameters {params} need a task family name ({', '.join(FAMILIES)}), got {name!r}"
            )
        try:
            return family(**params)
        except TypeError as err:
            allowed = "digits" if family is Addition else "length"
            raise MoerlError(f"task {name}: bad parameters {params}; it takes only {allowed}=N") from err
    task = TASKS.get(name)
    if task is None:
        raise MoerlError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return task


def sft_target(prompt: Prompt) -> str:
    """The response text a perfect policy writes for `prompt` (the <eos> after it is added as a token id)."""
    return prompt.answer.strip()


def verify_ids(task: Task, tok: Tokenizer, response_ids: list[int], answer: str) -> Verdict:
    """Verdict on a sampled response given as token ids: it ends at its first <eos>; a special token before
    that (pad, bos, unk) makes it malformed rather than being skipped."""
    kept, ended = response_end(response_ids)
    text = tok.decode([int(i) for i in kept], skip_special_tokens=False)
    return task.verify(text, answer, ended=ended)


# ---------------------------------------------------------------- prompt files

PROMPT_FILE_FIELDS = ("prompt_id", "prompt", "answer", "task")
_MAX_PROBLEMS_SHOWN = 20
_SCHEMA_HINT = (
    "each nonblank line must be one JSON object "
    '{"prompt_id": str, "prompt": str, "answer": str, "task": str} (schema: steps/tasks.py)'
)


class _Pairs(list):
    """A JSON object as its (key, value) pairs, so that repeated keys are seen, not silently merged."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _text_problem(field: str, text: str) -> str | None:
    """What is wrong with the text of a prompt or answer field, or None: empty, or not tokenizable."""
    if not text.strip():
        return f"empty {field}"
    if bad := unknown_chars(text):
        return (
            f"{field} has characters outside the tokenizer vocabulary: {', '.join(map(_short, bad[:5]))} "
            f"(use only {describe_vocab()})"
        )
    return None


def _line_problems(line: str, seen_ids: dict[str, int], lineno: int) -> tuple[Prompt | None, list[str]]:
    try:
        obj = json.loads(line, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as err:
        return None, [f"invalid JSON ({err.msg} at column {err.colno})"]
    except (ValueError, RecursionError) as err:  # e.g. an integer too long to convert, or absurd nesting
        return None, [f"invalid JSON ({str(err)[:80] or type(err).__name__})"]
    if not isinstance(obj, _Pairs):
        return None, [f"not a JSON object (got {type(obj).__name__})"]
    problems = []
    keys = [key for key, _ in obj]
    for key in dict.fromkeys(k for k in keys if keys.count(k) > 1):
        problems.append(f"field {_short(key)} given more than once")
    fields = dict(obj)
    for key in fields:
        if key not in PROMPT_FILE_FIELDS:
            problems.append(f"unknown field {_short(key)} (allowed: {', '.join(PROMPT_FILE_FIELDS)})")
    for key in PROMPT_FILE_FIELDS:
        if key not in fields:
            problems.append(f"missing field {key!r}")
        elif not isinstance(fields[key], str):
            kind = "null" if fields[key] is None else type(fields[key]).__name__
            problems.append(f"field {key!r} must be a string, got {kind} (write it in double quotes)")
    strings = {k: fields[k] for k in PROMPT_FILE_FIELDS if isinstance(fields.get(k), str)}

    prompt_id = strings.get("prompt_id")
    if prompt_id is not None:
        if not prompt_id.strip():
            problems.append("empty prompt_id")
        elif prompt_id in seen_ids:
            problems.append(f"duplicate prompt_id {_short(prompt_id)} (first on line {seen_ids[prompt_id]})")
        else:
            seen_ids[prompt_id] = lineno
    text = strings.get("prompt")
    if text is not None and (problem := _text_problem("prompt", text)):
        problems.append(problem)
    task = None
    if "task" in strings:
        task = TASKS.get(strings["task"])
        if task is None:
            problems.append(f"unknown task {_short(strings['task'])} (known: {', '.join(TASKS)})")
    answer = strings.get("answer")
    if answer is not None:
        if problem := _text_problem("answer", answer):
            problems.append(problem)
        elif task is not None and not task.verify(answer, answer).well_formed:
            problems.append(
                f"answer {_short(answer)} can never be matched by task {task.name} ({task.answer_rule})"
            )
    if problems:
        return None, problems
    assert prompt_id is not None and text is not None and answer is not None and task is not None
    return Prompt(prompt_id=prompt_id, task=task.name, text=text, answer=answer), []


def parse_prompt_jsonl(text: str, source: str) -> list[Prompt]:
    """Prompts of a JSONL prompt file (schema in the module docstring). Every bad line is reported, with its
    line number, in one MoerlError that names `source`."""
    prompts: list[Prompt] = []
    problems: list[str] = []
    seen_ids: dict[str, int] = {}
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        prompt, line_problems = _line_problems(line, seen_ids, lineno)
        problems.extend(f"line {lineno}: {p}" for p in line_problems)
        if prompt is not None:
            prompts.append(prompt)
    if problems:
        shown = problems[:_MAX_PROBLEMS_SHOWN]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise MoerlError(
            f"prompt file {source} has {len(problems)} problem(s):\n  "
            + "\n  ".join(shown)
            + f"\nfix these lines: {_SCHEMA_HINT}"
        )
    if not prompts:
        raise MoerlError(f"prompt file {source} has no prompts; {_SCHEMA_HINT}")
    return prompts


def format_prompt_jsonl(prompts: list[Prompt]) -> str:
    """The JSONL text of `prompts`, which parse_prompt_jsonl reads back unchanged."""
    return "".join(
        json.dumps({"prompt_id": p.prompt_id, "prompt": p.text, "answer": p.answer, "task": p.task}) + "\n"
        for p in prompts
    )


def read_prompt_file(store: Store, key: str) -> list[Prompt]:
    """Prompts of the JSONL file at `key` in the run store (read through Store.get_bytes)."""
    from steps.store import ObjectNotFound  # lazily: the store pulls in fsspec/s3fs

    source = store.url(key)
    try:
        data = store.get_bytes(key)
    except ObjectNotFound as err:
        raise MoerlError(
            f"prompt file {source} does not exist; upload the JSONL file there or point the run at the right key"
        ) from err
    try:
        text = data.decode("utf-8-sig")  # tolerate a byte-order mark written by some editors
    except UnicodeDecodeError as err:
        raise MoerlError(
            f"prompt file {source} is not UTF-8 text (bad byte at offset {err.start}); save it as UTF-8 JSONL"
        ) from err
    return parse_prompt_jsonl(text, source)
