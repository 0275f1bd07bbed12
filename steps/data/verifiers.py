"""Rule verifiers: does a response hold the reference answer? (`rewards.verifier` in the run config)

    exact     the response, stripped, equals the answer, stripped
    numeric   the number after the last '####', else the last number of the text ('3.5', '-5', '1,080'),
              equal as numbers; the answer is read the same way, so GSM8K's '... #### 72' works as it is
    math      math-verify (Hugging Face): the answer in \\boxed{}, LaTeX or plain, compared symbolically;
              an answer with '####' is compared by the part after it
    regex     the last match of `rewards.answer_pattern` (its first group, if it has one) equals the answer

A verdict has two parts: `correct`, and `well_formed` (an answer could be read out of the response at all:
the format reward). A response that never ended (no stop token within max_new_tokens) is neither.

math-verify bounds each parse and comparison with signal.alarm, which Python allows in the main thread only;
the score step verifies in its main thread, so the limit holds there, and anywhere else (a worker thread)
the verifier runs without it rather than fail (see math_verdict).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, Protocol

from steps.errors import MoerlError

VERIFIERS = ("exact", "numeric", "math", "regex")
MATH_TIMEOUT_S = 5  # math-verify's own limit per parse and per comparison (whole seconds: signal.alarm)

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class Verdict:
    correct: bool
    well_formed: bool


class Verifier(Protocol):
    name: str

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict: ...

    def answer_problem(self, answer: str) -> str | None:
        """Why `answer` can never be matched (for the prompt-file checks), or None."""
        ...


class ExactVerifier:
    name = "exact"

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict:
        text = response.strip()
        return Verdict(correct=ended and text == answer.strip(), well_formed=ended and bool(text))

    def answer_problem(self, answer: str) -> str | None:
        return None if answer.strip() else "empty answer"


def read_number(text: str) -> Fraction | None:
    """The number after the last '####', else the last number in `text`; None when there is none."""
    _, marker, after = text.rpartition("####")
    if marker:
        found = _NUMBER.search(after)
        matches = [found] if found else []
    else:
        matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    return Fraction(matches[-1].group(0).replace(",", ""))


class NumericVerifier:
    name = "numeric"

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict:
        got, want = read_number(response), read_number(answer)
        return Verdict(correct=ended and got is not None and got == want, well_formed=ended and got is not None)

    def answer_problem(self, answer: str) -> str | None:
        return None if read_number(answer) is not None else "the answer holds no number (numeric verifier)"


def _math_timeout() -> int | None:
    # signal.alarm works in the main thread only; math-verify raises ValueError anywhere else.
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=65536)
def _math_parse(text: str) -> tuple[Any, ...]:
    from math_verify import parse

    return tuple(parse(text, parsing_timeout=_math_timeout()))


def math_gold(answer: str) -> tuple[Any, ...]:
    """The parsed reference answer: the part after '####' if there is one; plain text, else as LaTeX."""
    _, marker, after = answer.rpartition("####")
    text = after.strip() if marker else answer.strip()
    return _math_parse(text) or _math_parse(f"${text}$")


def math_verdict(response: str, answer: str) -> tuple[bool, bool]:
    """(correct, an answer was found) by math-verify."""
    from math_verify import verify

    predicted = _math_parse(response)
    if not predicted:
        return False, False
    gold = math_gold(answer)
    return bool(gold) and bool(verify(list(gold), list(predicted), timeout_seconds=_math_timeout())), True


class MathVerifier:
    name = "math"

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict:
        if not ended:
            return Verdict(False, False)
        correct, found = math_verdict(response, answer)
        return Verdict(correct=correct, well_formed=found)

    def answer_problem(self, answer: str) -> str | None:
        return None if math_gold(answer) else "math-verify cannot read a mathematical answer out of it"


class RegexVerifier:
    name = "regex"

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)

    def extract(self, response: str) -> str | None:
        matches = list(self.pattern.finditer(response))
        if not matches:
            return None
        last = matches[-1]
        return last.group(1) if self.pattern.groups else last.group(0)

    def verify(self, response: str, answer: str, ended: bool = True) -> Verdict:
        got = self.extract(response)
        return Verdict(
            correct=ended and got is not None and got.strip() == answer.strip(),
            well_formed=ended and got is not None,
        )

    def answer_problem(self, answer: str) -> str | None:
        return None if answer.strip() else "empty answer"


def pattern_problem(pattern: str | None) -> str | None:
    """What is wrong with rewards.answer_pattern for the regex verifier, or None."""
    if pattern is None:
        return "the regex verifier needs rewards.answer_pattern, e.g. 'answer is (-?\\d+)'"
    try:
        re.compile(pattern)
    except re.error as err:
        return f"{pattern!r} is not a regular expression ({err}); fix rewards.answer_pattern"
    return None


def get_verifier(name: str, answer_pattern: str | None = None) -> Verifier:
    """A verifier by its name in the run config."""
    if name == "exact":
        return ExactVerifier()
    if name == "numeric":
        return NumericVerifier()
    if name == "math":
        return MathVerifier()
    if name == "regex":
        problem = pattern_problem(answer_pattern)
        if problem:
            raise MoerlError(f"rewards.answer_pattern: {problem}")
        return RegexVerifier(answer_pattern or "")
    raise MoerlError(f"rewards.verifier {name!r} is not a verifier; use one of {', '.join(VERIFIERS)}")
