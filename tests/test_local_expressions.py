"""Argo's expression languages as the local executor evaluates them: expr-lang (`{{= }}`, depends,
retryStrategy.expression), `{{ }}` substitution, govaluate `when` conditions, durations in messages."""

from __future__ import annotations

import pytest

from pipelines.local.api.depends import evaluate_depends, task_dependencies, task_results
from pipelines.local.lang.expressions import (
    AbsentOptional,
    SubstitutionError,
    WhenError,
    evaluate_when,
    expand,
    humanize_duration,
    substitute,
    substitute_text,
)
from pipelines.local.lang.exprlang import ExprError, evaluate, evaluate_bool
from pipelines.local.lang.functions import go_json, go_string

ENV = expand(
    {
        "inputs.parameters.count": "3",
        "inputs.parameters.safe-to-retry": "true",
        "steps.flip-coin.outputs.result": "heads",
        "workflow.name": "wf-abcde",
        "items": '[{"a": 1}, {"a": 2}]',
    }
)


@pytest.mark.parametrize(
    ("source", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),  # / is always a float division
        ("6 / 3", 2.0),
        ("-7 % 3", -1),  # Go's % truncates toward zero
        ("2 ** 3 ** 2", 512.0),  # right associative
        ("1 < 2 && 2 <= 2 || false", True),
        ("!true || not false", True),
        ("1 == 1.0", True),
        ("'1' == 1", False),  # a string never equals a number
        ("1 > 2 ? 'a' : 'b'", "b"),
        ("'b' in ['a', 'b']", True),
        ("'c' not in ['a', 'b']", True),
        ("'imminent node shutdown' matches 'imminent|pod deleted'", True),
        ("'abc' contains 'b' && 'abc' startsWith 'a' && 'abc' endsWith 'c'", True),
        ("nil ?? 'fallback'", "fallback"),
        ("1..3", [1, 2, 3]),
        ("asInt(inputs.parameters.count) + 1", 4),
        ("asFloat('1.5') * 2", 3.0),
        ("int(2.9)", 2),
        ("float('2')", 2.0),
        ("string(2.0) + string(true)", "2true"),
        ("steps['flip-coin'].outputs.result == 'heads'", True),
        ("inputs.parameters['safe-to-retry'] == 'true'", True),
        ("len('abc') + len([1, 2])", 5),
        ("filter([1, 2, 3], {# > 1})", [2, 3]),
        ("map([1, 2], {# * 10})", [10, 20]),
        ("all([2, 4], {# % 2 == 0})", True),
        ("count(jsonpath(items, '$[*].a'), {# > 1})", 1),
        ("jsonpath(items, '$[1].a')", 2),
        ("sprig.trim('  x ') + sprig.upper('y')", "xY"),
        ("sprig.replace('-', '_', workflow.name)", "wf_abcde"),
        ("sprig.add(1, '2')", 3),
        ("toJson({'a': [1, 2.5]})", '{"a":[1,2.5]}'),
        ("upper(split('a,b', ',')[1])", "B"),
    ],
)
def test_expr_lang_values(source, value):
    assert evaluate(source, ENV) == value


@pytest.mark.parametrize(
    "source",
    [
        "asInt('1.5')",  # expr-lang's int() parses integers only
        "unknown_name + 1",
        "1 && true",  # && wants booleans
        "'a' + 1",
        "1 +",
        "[1, 2][5]",
    ],
)
def test_expr_lang_errors(source):
    with pytest.raises(ExprError):
        evaluate(source, ENV)


def test_evaluate_bool_refuses_a_non_boolean_result():
    with pytest.raises(ExprError, match="to bool"):
        evaluate_bool("1 + 1", {})


def test_substitution_of_simple_tags_and_expressions():
    scope = {"inputs.parameters.x": "5", "workflow.name": "wf"}
    text = "{{inputs.parameters.x}} {{ workflow.name }} {{=asInt(inputs.parameters.x) * 2}} {{=[1, 2.5]}}"
    assert substitute_text(text, scope) == "5 wf 10 [1,2.5]"


def test_unknown_tags_stay_until_their_values_exist():
    assert substitute_text("{{steps.a.outputs.result}} {{item}}", {}) == "{{steps.a.outputs.result}} {{item}}"
    assert substitute_text("{{=item + 1}}", {}) == "{{=item + 1}}"


def test_strict_prefixes_must_resolve():
    with pytest.raises(SubstitutionError, match=r"failed to resolve \{\{steps.a.outputs.result\}\}"):
        substitute_text("{{steps.a.outputs.result}}", {}, strict=("steps", "tasks"))
    # Argo names the first missing identifier in expr-lang's ast.Walk order, children first: the base name
    with pytest.raises(SubstitutionError, match="failed to evaluate expression: steps is missing"):
        substitute_text("{{=steps.a.outputs.result}}", {}, strict=("steps", "tasks"))


def test_an_absent_optional_output_cannot_be_substituted():
    with pytest.raises(AbsentOptional):
        substitute_text("{{steps.skipped.outputs.parameters.p}}", {"steps.skipped.outputs.parameters.p": None})


def test_substitution_walks_nested_manifests_keys_included():
    value = {"args": ["{{a}}", {"{{a}}": "{{a}}-x"}], "n": 3}
    assert substitute(value, {"a": "1"}) == {"args": ["1", {"1": "1-x"}], "n": 3}


@pytest.mark.parametrize(
    ("condition", "result"),
    [
        ("heads == heads", True),
        ("tails == heads", False),
        ("Failed != Succeeded", True),
        ("'hello world' == \"hello world\"", True),
        ("5 > 3", True),
        ("10 < 9", False),
        ("abc =~ '^a'", True),
        ("abc !~ '^a'", False),
        ("(a == a) && (b == c || true)", True),
        ("!(1 == 2)", True),
        ("2 in (1, 2, 3)", True),
        ("true", True),
        ("", True),
    ],
)
def test_when_conditions_follow_govaluate(condition, result):
    assert evaluate_when(condition) is result


def test_when_with_two_bare_words_in_a_row_is_invalid():
    with pytest.raises(WhenError, match="Invalid 'when' expression 'hello world == x'"):
        evaluate_when("hello world == x")


def test_when_must_be_boolean():
    with pytest.raises(WhenError, match="Expected boolean evaluation"):
        evaluate_when("1 + 2")


TASKS = {
    "A": {"name": "A"},
    "B": {"name": "B", "continueOn": {"failed": True}},
    "my-task": {"name": "my-task"},
    "loop": {"name": "loop", "withItems": [1, 2]},
}


def test_a_bare_dependency_means_succeeded_skipped_or_daemoned():
    deps, logic = task_dependencies({"name": "C", "depends": "A && B.Failed"}, TASKS)
    assert deps == ["A", "B"]
    assert logic == "(A.Succeeded || A.Skipped || A.Daemoned) && B.Failed"


def test_dependencies_list_honours_continue_on():
    deps, logic = task_dependencies({"name": "C", "dependencies": ["A", "B"]}, TASKS)
    assert deps == ["A", "B"]
    assert logic == "(A.Succeeded || A.Skipped || A.Daemoned) && (B.Succeeded || B.Skipped || B.Daemoned || B.Failed)"


@pytest.mark.parametrize(
    ("task", "error"),
    [
        ({"name": "C", "depends": "Z"}, "dependency 'Z' not defined"),
        ({"name": "C", "depends": "A.Finished"}, "task result 'Finished' for task 'A' is invalid"),
        ({"name": "C", "dependencies": ["Z"]}, "dependency 'Z' not defined"),
    ],
)
def test_bad_dependencies_are_refused(task, error):
    with pytest.raises(ValueError, match=error):
        task_dependencies(task, TASKS)


def outcome(phase: str, children: list[str] | None = None) -> dict:
    return task_results(phase, children)


@pytest.mark.parametrize(
    ("depends", "results", "runs"),
    [
        ("A", {"A": outcome("Succeeded")}, True),
        ("A", {"A": outcome("Failed")}, False),
        ("A", {"A": outcome("Skipped")}, True),
        ("A.Failed || A.Errored", {"A": outcome("Error")}, True),
        ("!A.Succeeded", {"A": outcome("Omitted")}, True),
        ("A && (B.Failed || B.Skipped)", {"A": outcome("Succeeded"), "B": outcome("Succeeded")}, False),
        ("A && (B.Failed || B.Skipped)", {"A": outcome("Succeeded"), "B": outcome("Failed")}, True),
        ("my-task.Succeeded", {"my-task": outcome("Succeeded")}, True),
        ("loop.AnySucceeded", {"loop": outcome("Failed", ["Failed", "Succeeded"])}, True),
        ("loop.AllFailed", {"loop": outcome("Failed", ["Failed", "Failed"])}, True),
        ("loop.AllFailed", {"loop": outcome("Failed", ["Failed", "Error"])}, False),
    ],
)
def test_depends_logic(depends, results, runs):
    _, logic = task_dependencies({"name": "X", "depends": depends}, TASKS)
    assert evaluate_depends(logic, results) is runs


def test_durations_read_as_argo_writes_them():
    assert [humanize_duration(s) for s in (0.5, 1, 2, 59, 95, 3700)] == [
        "0 seconds",
        "1 second",
        "2 seconds",
        "59 seconds",
        "1 minute 35 seconds",
        "1 hour 1 minutes",
    ]


def test_values_are_written_the_way_go_writes_them():
    assert go_json([1, 2.0, 2.5, "x", True, None, {"b": 1, "a": 2}]) == '[1,2,2.5,"x",true,null,{"a":2,"b":1}]'
    assert [go_string(v) for v in (1.0, 1.5, True, None, [1, "a"])] == ["1", "1.5", "true", "<nil>", "[1 a]"]
