import json
import subprocess
import sys
from pathlib import Path

import pytest

from steps.data.tasks import (
    DEFAULT_ADDITION_DIGITS,
    DEFAULT_SORT_LENGTH,
    TASKS,
    Addition,
    Prompt,
    Sort,
    Verdict,
    get_task,
    sft_target,
    split_of,
    verify_ids,
)
from steps.data.tokenizer import CheckpointTokenizer
from steps.demo.char_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    build_tokenizer,
    encode,
    save_tokenizer,
    unknown_chars,
)
from steps.errors import MoerlError

TOK = build_tokenizer()


@pytest.fixture(scope="module")
def checkpoint_tok(tmp_path_factory):
    directory = tmp_path_factory.mktemp("char-tok")
    save_tokenizer(directory)
    return CheckpointTokenizer.load(directory)
SMALL_TASKS = ["addition1", "addition2", "addition3", "sort3", "sort5", "sort8"]


def test_addition_prompts_are_correct_sums():
    for p in get_task("addition3").prompts("train", 300, seed=1):
        a, b = p.text.removesuffix("=").split("+")
        assert p.text == f"{a}+{b}="
        assert int(a) < 1000 and int(b) < 1000
        assert str(int(a)) == a and str(int(b)) == b  # no leading zeros
        assert p.answer == str(int(a) + int(b))
        assert p.task == "addition3"


def test_sort_prompts_are_sorted_digits():
    for p in get_task("sort5").prompts("train", 300, seed=1):
        assert p.text.startswith("sort:") and p.text.endswith(">")
        digits = p.text[len("sort:") : -1]
        assert len(digits) == 5 and digits.isdigit()
        assert p.answer == "".join(sorted(digits))


def test_prompt_ids_name_the_problem():
    assert get_task("addition3").prompt_id(12345) == "addition3/012345"
    assert Addition(3).problem(12345)[:2] == ("12+345=", "357")
    assert Sort(4).problem(8301)[:2] == ("sort:8301>", "0138")
    assert Sort(4).prompt_id(8301) == "sort4/8301"


@pytest.mark.parametrize("name", SMALL_TASKS)
def test_prompts_are_deterministic_for_split_n_seed(name):
    task = get_task(name)
    first = task.prompts("train", 50, seed=7)
    assert first == task.prompts("train", 50, seed=7)
    assert first != task.prompts("train", 50, seed=8)
    # a fresh instance, as another process would build it, gives the same prompts
    assert first == type(task)(**vars_of(task)).prompts("train", 50, seed=7)


def vars_of(task):
    return {"digits": task.digits} if isinstance(task, Addition) else {"length": task.length}


def test_prompts_are_identical_in_a_fresh_interpreter_with_another_hash_seed():
    code = (
        "from steps.data.tasks import get_task;"
        "print([p.prompt_id for p in get_task('sort6').prompts('heldout', 20, 3)]);"
        "print([p.prompt_id for p in get_task('addition2').prompts('train', 20, 3)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.splitlines()
    assert out[0] == str([p.prompt_id for p in get_task("sort6").prompts("heldout", 20, 3)])
    assert out[1] == str([p.prompt_id for p in get_task("addition2").prompts("train", 20, 3)])


@pytest.mark.parametrize("name", SMALL_TASKS)
def test_prompt_ids_are_unique_and_stable(name):
    task = get_task(name)
    n = 20 if name == "addition1" else 200
    prompts = task.prompts("train", n, seed=0)
    ids = [p.prompt_id for p in prompts]
    assert len(set(ids)) == n
    assert len({p.text for p in prompts}) == n
    # the same problem has the same id whichever seed drew it
    by_text = {p.text: p.prompt_id for p in prompts}
    for p in task.prompts("train", n, seed=1):
        assert by_text.get(p.text, p.prompt_id) == p.prompt_id


@pytest.mark.parametrize("name", ["addition1", "addition2", "sort3", "sort4"])
def test_train_and_heldout_partition_the_whole_space(name):
    task = get_task(name)
    train = {p.text for p in task.prompts("train", len(task._enumerated["train"]), 0)}
    heldout = {p.text for p in task.prompts("heldout", len(task._enumerated["heldout"]), 0)}
    assert not train & heldout
    assert len(train) + len(heldout) == task.space_size
    assert 0.03 < len(heldout) / task.space_size < 0.2


@pytest.mark.parametrize("name", ["addition3", "sort6", "sort10"])
def test_sampled_train_and_heldout_are_disjoint(name):
    task = get_task(name)
    train = task.prompts("train", 3000, seed=0) + task.prompts("train", 3000, seed=1)
    heldout = task.prompts("heldout", 500, seed=0)
    assert not {p.text for p in train} & {p.text for p in heldout}
    assert all(split_of(task.problem(int(p.prompt_id.split("/")[1]))[2]) == "heldout" for p in heldout)


def test_reordered_problems_share_a_split():
    # a+b and b+a, and every ordering of the same digits, never straddle train and heldout
    addition, sort = Addition(3), Sort(4)
    for index in range(0, 10**6, 997):
        a, b = divmod(index, 1000)
        assert split_of(addition.problem(index)[2]) == split_of(addition.problem(b * 1000 + a)[2])
    for index in range(0, 10**4, 7):
        digits = f"{index:04d}"
        assert split_of(sort.problem(index)[2]) == split_of(sort.problem(int(digits[::-1]))[2])


def test_heldout_of_one_difficulty_is_never_train_of_another():
    small = {p.text for p in get_task("addition2").prompts("heldout", 1000, 0)}
    big = {p.text for p in get_task("addition3").prompts("train", 20000, 0)}
    assert small and not small & big


def test_asking_for_more_prompts_than_the_split_holds_is_a_moerl_error():
    task = get_task("addition1")
    with pytest.raises(MoerlError, match="only .* heldout problems"):
        task.prompts("heldout", 100, 0)


def test_unknown_split_and_negative_n_are_moerl_errors():
    with pytest.raises(MoerlError, match="unknown split 'test'.*train, heldout"):
        get_task("addition").prompts("test", 5, 0)
    with pytest.raises(MoerlError, match=">= 0"):
        get_task("addition").prompts("train", -1, 0)
    assert get_task("addition").prompts("train", 0, 0) == []


def test_prompts_are_short_and_in_vocabulary():
    for name, task in TASKS.items():
        if name.startswith(("sortdesc", "multiply")):  # natural language for a BPE tokenizer (test_sortdesc_...)
            continue
        for p in task.prompts("train", 20, 0):
            assert len(p.text) <= 16, (name, p.text)
            assert not unknown_chars(p.text + p.answer)


def test_get_task_names_defaults_and_params():
    assert get_task("addition").name == f"addition{DEFAULT_ADDITION_DIGITS}"
    assert get_task("sort").name == f"sort{DEFAULT_SORT_LENGTH}"
    assert get_task("addition", digits=2).name == "addition2"
    assert get_task("sort", length=4).prompts("train", 3, 0) == get_task("sort4").prompts("train", 3, 0)
    for name, task in TASKS.items():
        assert get_task(task.name) is TASKS[task.name], name  # a task's name always resolves


def test_get_task_errors_list_known_tasks_or_ranges():
    with pytest.raises(MoerlError) as err:
        get_task("multiplication")
    assert "multiplication" in str(err.value) and "addition3" in str(err.value) and "sort" in str(err.value)
    with pytest.raises(MoerlError, match="digits=9 is out of range; use an integer from 1 to 6"):
        get_task("addition", digits=9)
    with pytest.raises(MoerlError, match="takes only length"):
        get_task("sort", digits=3)
    with pytest.raises(MoerlError, match="family name"):
        get_task("addition3", digits=3)


@pytest.mark.parametrize(
    ("response", "answer", "ended", "verdict"),
    [
        ("357", "357", True, Verdict(correct=True, well_formed=True)),
        (" 357\n", "357", True, Verdict(correct=True, well_formed=True)),
        ("357", " 357 ", True, Verdict(correct=True, well_formed=True)),
        ("0357", "357", True, Verdict(correct=False, well_formed=True)),
        ("356", "357", True, Verdict(correct=False, well_formed=True)),
        ("35", "357", True, Verdict(correct=False, well_formed=True)),
        ("3570", "357", True, Verdict(correct=False, well_formed=True)),
        ("3 57", "357", True, Verdict(correct=False, well_formed=False)),
        ("357.", "357", True, Verdict(correct=False, well_formed=False)),
        ("abc", "357", True, Verdict(correct=False, well_formed=False)),
        ("", "357", True, Verdict(correct=False, well_formed=False)),
        ("   ", "357", True, Verdict(correct=False, well_formed=False)),
        ("357", "357", False, Verdict(correct=False, well_formed=False)),
        ("0138", "0138", True, Verdict(correct=True, well_formed=True)),
    ],
)
def test_verify_is_exact_match_after_strip(response, answer, ended, verdict):
    for name in ["addition3", "sort4"]:
        assert get_task(name).verify(response, answer, ended=ended) == verdict


def test_verify_defaults_to_an_ended_response():
    assert get_task("addition").verify("357", "357") == Verdict(True, True)


def test_sft_target_is_what_the_verifier_accepts():
    for task in [get_task("addition3"), get_task("sort6"), get_task("sortdesc6")]:
        for p in task.prompts("train", 100, 0):
            target = sft_target(p)
            assert task.verify(target, p.answer) == Verdict(True, True)
    assert sft_target(Prompt("x", "addition3", "1+2=", " 3 ")) == "3"


def test_verify_ids_ends_at_eos_and_refuses_special_tokens_inside(checkpoint_tok):
    task = get_task("addition3")
    tok = checkpoint_tok
    ids = encode(TOK, "357")
    assert verify_ids(task, tok, ids + [EOS_ID, PAD_ID, PAD_ID], "357") == Verdict(True, True)
    assert verify_ids(task, tok, ids + [EOS_ID] + encode(TOK, "1"), "357") == Verdict(True, True)
    assert verify_ids(task, tok, ids, "357") == Verdict(False, False)  # ran out of tokens, never ended
    assert verify_ids(task, tok, [EOS_ID], "357") == Verdict(False, False)
    for special in [UNK_ID, BOS_ID, PAD_ID]:
        assert verify_ids(task, tok, ids[:1] + [special] + ids[1:] + [EOS_ID], "357") == Verdict(False, False)


def test_sortdesc_prompts_are_natural_language_and_answered_in_boxed():
    task = get_task("sortdesc", length=6)
    p = task.prompts("train", 1, 0)[0]
    digits = p.text.split()[3]
    assert p.text == f"Sort the digits {digits} in descending order. Put the final answer in \\boxed{{}}."
    assert p.answer == "".join(sorted(digits, reverse=True))
    assert task.sft_target(p.answer) == f"\\boxed{{{p.answer}}}"
    assert task.verify(f"So: \\boxed{{{p.answer}}}", p.answer) == Verdict(True, True)
    assert task.verify("\\boxed{1}", p.answer) == Verdict(False, True)
    assert task.verify(task.sft_target(p.answer), p.answer, ended=False) == Verdict(False, False)
    # the train/held-out split is by the sorted digits, as for sort
    heldout = {q.prompt_id for q in task.prompts("heldout", 50, 0)}
    assert heldout.isdisjoint(q.prompt_id for q in task.prompts("train", 500, 0))


def test_multiply_prompts_need_the_calculator_and_script_its_call_and_answer():
    task = get_task("multiply", digits=3)
    assert task.name == "multiply3" and get_task("multiply3") is get_task("multiply")
    for p in task.prompts("train", 20, 0):
        a, b = p.metadata["expression"].split("*")
        assert p.text == f"What is {a}*{b}? Put the answer in \\boxed{{}}."
        assert p.answer == str(int(a) * int(b))
        call, answer = task.sft_turns(p)
        assert json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {
            "name": "calc", "arguments": {"expr": p.metadata["expression"]}}  # fmt: skip
        assert answer == f"\\boxed{{{p.answer}}}" and task.verify(answer, p.answer).correct
    # b*a is a's problem: it never crosses the split
    heldout = {tuple(sorted(p.metadata["expression"].split("*"))) for p in task.prompts("heldout", 200, 0)}
    train = {tuple(sorted(p.metadata["expression"].split("*"))) for p in task.prompts("train", 2000, 0)}
    assert not heldout & train
