"""Verifiable toy tasks: prompts with exact answers, rule verifiers, and prompt files.

A task makes prompts deterministically and checks responses exactly:

    addition<D>  "12+345=" -> "357"        two operands drawn from 0 .. 10**D - 1 (D = 1..6)
    sort<L>      "sort:8301>" -> "0138"    the L digits in ascending order (L = 2..10)
    multiply<D>  "What is 123*456? Put the answer in \\boxed{}." -> "56088"
                 for a chat model with a tool: two D-digit operands; the demo's environment
                 (steps/demo/calculator.py) answers the model's calculator call, and the answer is checked by the
                 math verifier
    sortdesc<L>  "Sort the digits 8301 in descending order. Put the final answer in \\boxed{}." -> "8310"
                 in natural language, for a chat model: its response is "\\boxed{8310}", checked by the math
                 verifier (descending, so that no answer has a leading zero that a numeric comparison drops)

`addition` and `sort` name the default difficulty (see DEFAULT_ADDITION_DIGITS, DEFAULT_SORT_LENGTH); a task's
`name` is always the canonical one ("addition3"), and `get_task("addition", digits=4)` builds any other.

The model's response is `sft_target` followed by a stop token (see steps.data.tokenizer). The digit tasks' `verify`
compares the response with the answer after stripping surrounding whitespace:
    well_formed  the response ended (the policy wrote <eos>), is nonempty after stripping, and has only the
                 task's answer characters (digits);
    correct      the response ended and its stripped text equals the stripped answer.

Splits: "train" and "heldout". A problem's split is a hash of its split key, and the key ignores what does
not change the problem's substance: a+b and b+a share a key, and so do all orderings of the same digits for
sort. So no held-out problem, nor a reordering of one, is ever a training prompt, whatever the seed or
difficulty. `prompts(split, n, seed)` returns n distinct problems of that split, the same for the same
arguments on any machine; prompt ids are stable ("addition3/012345": operands 012 and 345; "sort5/83014").

Prompt files (JSONL or Parquet, the user's own prompts) are read by steps/data/prompt_data.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from steps.data.verifiers import MathVerifier, Verdict
from steps.errors import MoerlError

if TYPE_CHECKING:
    from steps.data.tokenizer import CheckpointTokenizer

DIGITS = "0123456789"

SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 10
# Defaults sized for the CPU demo: a ~0.8M-parameter dense model reached about 40% held-out exact match on
# addition3 after ~450 steps of batch 128, and 60% on sort6 after only 80 steps, so sort defaults longer.
DEFAULT_ADDITION_DIGITS = 3
DEFAULT_SORT_LENGTH = 8
ADDITION_DIGITS = range(1, 7)  # "999999+999999=" is 14 characters
SORT_LENGTHS = range(2, 11)  # "sort:0123456789>" is 16 characters
DEFAULT_MULTIPLY_DIGITS = 3
MULTIPLY_DIGITS = range(1, 5)
# Spaces up to this many problems are enumerated once per split (exact sampling without replacement);
# bigger ones are sampled by rejection, where a split is far larger than any n anyone asks for.
_ENUMERATE_LIMIT = 200_000


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text, or its chat messages (then `text` is the last message's content, for logs)."""

    prompt_id: str
    task: str  # a built-in task's name, or prompt_data.PROMPT_FILE_TASK
    text: str
    answer: str
    messages: tuple[Mapping[str, str], ...] | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def content(self) -> str | list[dict[str, str]]:
        """What the prompt format renders: the text, or the chat messages."""
        return [dict(m) for m in self.messages] if self.messages is not None else self.text


class Task(Protocol):
    name: str
    answer_rule: str  # what a well-formed answer looks like, for error messages

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]: ...

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict: ...

    def sft_target(self, answer: str) -> str: ...


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

    def sft_target(self, answer: str) -> str:
        """The response text a perfect policy writes (the stop token after it is added as a token id)."""
        return answer.strip()

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


class SortDescending(Sort):
    """Sort in natural language for a chat model: the digits in descending order, answered in \\boxed{}."""

    def __init__(self, length: int = DEFAULT_SORT_LENGTH) -> None:
        _check_param("sortdesc", "length", length, SORT_LENGTHS)
        super().__init__(length)
        self.name = f"sortdesc{length}"
        self.answer_rule = "digits, checked by math-verify"

    def problem(self, index: int) -> tuple[str, str, str]:
        digits = f"{index:0{self.length}d}"
        answer = "".join(sorted(digits, reverse=True))
        text = f"Sort the digits {digits} in descending order. Put the final answer in \\boxed{{}}."
        return text, answer, f"sortdesc:{answer}"

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict:
        return MathVerifier().verify(response, answer, ended)

    def sft_target(self, answer: str) -> str:
        return f"\\boxed{{{answer.strip()}}}"


class Multiplication(DigitTask):
    """A product that needs a tool, for a chat model with an environment: 'What is 123*456? Put the answer in ...'
    -> '\\boxed{56088}'. The prompt's metadata holds the expression (the demo environment's calculator evaluates
    what the model passes it, steps/demo/calculator.py); `sft_turns` are the two turns of a perfect policy: the
    calculator call in the Qwen tool-call format, then the boxed result."""

    def __init__(self, digits: int = DEFAULT_MULTIPLY_DIGITS) -> None:
        _check_param("multiply", "digits", digits, MULTIPLY_DIGITS)
        self.digits = digits
        self.name = f"multiply{digits}"
        self.space_size = 10 ** (2 * digits)
        self.longest_answer = 2 * digits
        self.answer_rule = "digits, checked by math-verify"

    def problem(self, index: int) -> tuple[str, str, str]:
        a, b = divmod(index, 10**self.digits)
        text = f"What is {a}*{b}? Put the answer in \\boxed{{}}."
        return text, str(a * b), f"multiply:{min(a, b)}*{max(a, b)}"

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]:
        return [dataclasses.replace(p, metadata={"expression": p.text.split()[2].rstrip("?")})
                for p in super().prompts(split, n, seed)]  # fmt: skip

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict:
        return MathVerifier().verify(response, answer, ended)

    def sft_target(self, answer: str) -> str:
        return f"\\boxed{{{answer.strip()}}}"

    def sft_turns(self, prompt: Prompt) -> list[str]:
        """A perfect policy's two turns: the calculator call in the Qwen tool-call format, then the boxed result."""
        call = json.dumps({"name": "calc", "arguments": {"expr": prompt.metadata["expression"]}})
        return [f"<tool_call>\n{call}\n</tool_call>", self.sft_target(prompt.answer)]


def _check_param(family: str, param: str, value: object, allowed: range) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
        raise MoerlError(
            f"task {family}: {param}={value!r} is out of range; "
            f"use an integer from {allowed[0]} to {allowed[-1]}"
        )


FAMILIES: dict[str, type[DigitTask]] = {
    "addition": Addition, "sort": Sort, "sortdesc": SortDescending, "multiply": Multiplication,
}  # fmt: skip


def _registry() -> dict[str, Task]:
    tasks: dict[str, Task] = {}
    for digits in ADDITION_DIGITS:
        tasks[f"addition{digits}"] = Addition(digits)
    for length in SORT_LENGTHS:
        tasks[f"sort{length}"] = Sort(length)
        tasks[f"sortdesc{length}"] = SortDescending(length)
    for digits in MULTIPLY_DIGITS:
        tasks[f"multiply{digits}"] = Multiplication(digits)
    tasks["addition"] = tasks[f"addition{DEFAULT_ADDITION_DIGITS}"]
    tasks["multiply"] = tasks[f"multiply{DEFAULT_MULTIPLY_DIGITS}"]
    tasks["sort"] = tasks[f"sort{DEFAULT_SORT_LENGTH}"]
    tasks["sortdesc"] = tasks[f"sortdesc{DEFAULT_SORT_LENGTH}"]
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
            allowed = "digits" if family in (Addition, Multiplication) else "length"
            raise MoerlError(f"task {name}: bad parameters {params}; it takes only {allowed}=N") from err
    task = TASKS.get(name)
    if task is None:
        raise MoerlError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return task


def sft_target(prompt: Prompt) -> str:
    """The response text a perfect policy writes for a built-in task's `prompt`."""
    return get_task(prompt.task).sft_target(prompt.answer)


def verify_ids(task: Task, tok: CheckpointTokenizer, response_ids: list[int], answer: str) -> Verdict:
    """Verdict on a sampled response given as token ids: it ends at its first stop token; the text before it
    is decoded as written (a special token there stays in the text, so the digit tasks call it malformed)."""
    text, ended = tok.response_text(response_ids)
    return task.verify(text, answer, ended=ended)
