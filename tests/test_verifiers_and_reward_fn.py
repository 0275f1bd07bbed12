"""steps/data/verifiers.py (exact, numeric, math via math-verify, regex) and steps/scoring/user_reward.py (the user's
reward
function in a worker: its contract, time limit and errors)."""

import threading
from pathlib import Path

import pytest

from steps.data.verifiers import Verdict, get_verifier, read_number
from steps.errors import MoerlError
from steps.scoring.user_reward import RewardFunction

PLUGINS = Path(__file__).resolve().parent / "reward_plugins"


@pytest.mark.parametrize(
    "response, answer, verdict",
    [
        ("The answer is 5.", "5", Verdict(True, True)),
        ("#### 1,080", "1080", Verdict(True, True)),
        ("so it is -5", "-5", Verdict(True, True)),
        ("3.50", "3.5", Verdict(True, True)),
        ("first 3 then 7", "Reasoning... #### 7", Verdict(True, True)),
        ("#### 8 and later 9", "8", Verdict(True, True)),
        ("no number", "5", Verdict(False, False)),
        ("6", "5", Verdict(False, True)),
    ],
)
def test_numeric_reads_the_last_number_or_the_one_after_hashes(response, answer, verdict):
    assert get_verifier("numeric").verify(response, answer) == verdict


def test_numeric_numbers():
    assert read_number("1,080 apples") == 1080 and read_number("-.5") == -0.5 and read_number("x") is None


@pytest.mark.parametrize(
    "response, answer, correct",
    [
        ("Thus \\boxed{843210}", "843210", True),
        ("\\boxed{843201}", "843210", False),
        ("The answer is $\\frac{1}{2}$", "0.5", True),
        ("\\boxed{72}", "Natalia sold 24 in May.\n#### 72", True),
        ("x = \\boxed{3.5}", "3.5", True),
    ],
)
def test_math_verifier_is_math_verify(response, answer, correct):
    verdict = get_verifier("math").verify(response, answer)
    assert verdict == Verdict(correct, True)
    assert get_verifier("math").verify(response, answer, ended=False) == Verdict(False, False)


def test_math_verify_contract_outside_the_main_thread():
    # math-verify bounds its work with signal.alarm, which works in the main thread only: elsewhere the verifier
    # turns the limit off instead of failing (the score step verifies in its main thread)
    out = []
    thread = threading.Thread(target=lambda: out.append(get_verifier("math").verify("\\boxed{7}", "7")))
    thread.start()
    thread.join()
    assert out == [Verdict(True, True)]
    from math_verify import parse

    with pytest.raises(ValueError, match="threaded"):  # what our fallback avoids (math-verify 0.9.0)
        err: list[BaseException] = []

        def parse_with_alarm():
            try:
                parse("\\boxed{7}", parsing_timeout=5)
            except BaseException as e:  # noqa: BLE001
                err.append(e)

        worker = threading.Thread(target=parse_with_alarm)
        worker.start()
        worker.join()
        raise err[0] if err else AssertionError("math-verify allowed signal.alarm in a thread")


def test_regex_and_exact():
    regex = get_verifier("regex", r"answer is (-?\d+)")
    assert regex.verify("the answer is 12, no, the answer is 13", "13") == Verdict(True, True)
    assert regex.verify("13", "13") == Verdict(False, False)
    assert get_verifier("exact").verify(" 13\n", "13") == Verdict(True, True)
    with pytest.raises(MoerlError, match="answer_pattern"):
        get_verifier("regex", None)


@pytest.fixture
def plugins(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(PLUGINS))


def test_reward_function_float_and_dict_contract(plugins):
    fn = RewardFunction("demo_rewards:length_bonus", 10)
    try:
        assert fn.call("prompt 'a' sample 0", "q", "it is 42", "42", {"level": 2}) == {
            "reward": 1.0, "length": 8.0, "level": 2.0}  # fmt: skip
    finally:
        fn.close()
    fn = RewardFunction("demo_rewards:plain", 10)
    try:
        assert fn.call("s", [{"role": "user", "content": "q"}], "r", "a", {}) == {"reward": 0.5}
        assert fn.call("s", "q", "r", "a", {}) == {"reward": 0.25}
    finally:
        fn.close()


@pytest.mark.parametrize(
    "name, message",
    [
        ("raises", "rewards.reward_fn demo_rewards:raises raised on prompt 'p' sample 3: KeyError: 'gold'"),
        ("hangs", "rewards.reward_fn demo_rewards:hangs: took longer than 1s on prompt 'p' sample 3"),
        ("not_finite", "rewards.reward_fn demo_rewards:not_finite on prompt 'p' sample 3: returned 'reward' = nan"),
        ("wrong_type", "on prompt 'p' sample 3: returned str; return a number or a dict with 'reward'"),
    ],
)
def test_reward_function_errors_name_the_function_and_the_sample(plugins, name, message):
    fn = RewardFunction(f"demo_rewards:{name}", 1)
    with pytest.raises(MoerlError) as err:
        fn.call("prompt 'p' sample 3", "q", "r", "a", {})
    assert message in str(err.value)
    assert fn.process.poll() is not None  # the worker is gone


def test_reward_function_that_cannot_be_imported(plugins):
    with pytest.raises(MoerlError, match="cannot import no_such_package.mod"):
        RewardFunction("no_such_package.mod:fn", 5)
    with pytest.raises(MoerlError, match="has no function 'missing'"):
        RewardFunction("demo_rewards:missing", 5)
