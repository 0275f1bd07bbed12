"""steps/environments/tool_calls.py: parse_turn reading a model turn into an assistant message.

The qwen format (one call, several, text around them, blocks that are not calls and stay in the content, arguments
written as a JSON string) and the none format; then the round trip through the demo's real chat template
(steps/demo/bpe_tokenizer.py CHATML_TEMPLATE, in a transformers tokenizer trained offline): the tool calls an
assistant message is rendered with are exactly those parse_turn reads back from the rendered turn, and the template
puts the tools' schemas in the system message and renders plain ChatML without tools.
"""

from __future__ import annotations

import json

import pytest

from steps.demo.bpe_tokenizer import CHATML_TEMPLATE, train_chat_tokenizer
from steps.demo.calculator import TOOLS
from steps.environments.tool_calls import parse_turn, tool_calls

ASSISTANT, END = "<|im_start|>assistant\n", "<|im_end|>"


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def block(body):
    return f"<tool_call>\n{body}\n</tool_call>"


def test_one_qwen_call():
    text = block('{"name": "calc", "arguments": {"expr": "3*4"}}')
    expected = {"role": "assistant", "content": "", "tool_calls": [call("calc", {"expr": "3*4"})]}
    assert parse_turn(text, "qwen") == expected


def test_two_qwen_calls_keep_their_order():
    text = block('{"name": "calc", "arguments": {"expr": "1+2"}}') + "\n" + block('{"name":"lookup","arguments":{}}')
    message = parse_turn(text, "qwen")
    assert message["tool_calls"] == [call("calc", {"expr": "1+2"}), call("lookup", {})]
    assert message["content"] == ""
    assert tool_calls(message) == [{"name": "calc", "arguments": {"expr": "1+2"}}, {"name": "lookup", "arguments": {}}]


def test_text_before_a_call_is_the_content():
    text = "I will compute it.\n" + block('{"name": "calc", "arguments": {"expr": "6*7"}}')
    message = parse_turn(text, "qwen")
    assert message["content"] == "I will compute it."
    assert message["tool_calls"] == [call("calc", {"expr": "6*7"})]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "calc", "arguments": {"expr": "3*4"}',  # broken JSON
        '{"arguments": {"expr": "3*4"}}',  # no name
        '{"name": 5, "arguments": {}}',  # a name that is not text
        '{"name": "calc", "arguments": ["3*4"]}',  # arguments not an object
        '{"name": "calc", "arguments": "not json"}',  # arguments a string that is not JSON
        '{"name": "calc", "arguments": "\\"3*4\\""}',  # arguments a JSON string of a non-object
        '["calc", {"expr": "3*4"}]',  # not an object
    ],
)
def test_a_block_that_is_not_a_call_stays_in_the_content(body):
    text = "Let me try. " + block(body)
    assert parse_turn(text, "qwen") == {"role": "assistant", "content": text}


def test_a_broken_block_beside_a_good_one_stays_in_the_content():
    broken = block('{"name": "calc", "arguments": ')
    good = block('{"name": "calc", "arguments": {"expr": "2-1"}}')
    message = parse_turn(f"First {broken} then {good} done", "qwen")
    assert message["content"] == f"First {broken} then  done"
    assert message["tool_calls"] == [call("calc", {"expr": "2-1"})]


def test_arguments_given_as_a_json_string_are_read():
    text = block(json.dumps({"name": "calc", "arguments": json.dumps({"expr": "5*5"})}))
    assert parse_turn(text, "qwen")["tool_calls"] == [call("calc", {"expr": "5*5"})]


def test_plain_text_has_no_tool_calls():
    assert parse_turn("The answer is 12.", "qwen") == {"role": "assistant", "content": "The answer is 12."}


def test_format_none_keeps_every_turn_as_text():
    text = "Sure. " + block('{"name": "calc", "arguments": {"expr": "3*4"}}')
    assert parse_turn(text, "none") == {"role": "assistant", "content": text}


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="tool call format 'llama3'"):
        parse_turn("hi", "llama3")


# --- the round trip through the demo's chat template ------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = train_chat_tokenizer(["what is 3*4?", "The answer is 12."], tmp_path_factory.mktemp("tokenizer"))
    tok = AutoTokenizer.from_pretrained(directory)
    assert tok.chat_template == CHATML_TEMPLATE
    return tok


def rendered_turn(tokenizer, assistant):
    """The assistant turn's text as the template renders it in a conversation with the calculator's tools."""
    messages = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "what is 3*4?"},
        assistant,
        {"role": "tool", "content": "12"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    start = text.index(ASSISTANT) + len(ASSISTANT)
    return text[start : text.index(END, start)]


@pytest.mark.parametrize(
    "content, calls",
    [
        ("", [call("calc", {"expr": "3*4"})]),
        ("", [call("calc", {"expr": "3*4"}), call("calc", {"expr": "(1+2)*-3"})]),
        ("I need the calculator.", [call("calc", {"expr": "3*4"})]),
        ("Two steps:\nfirst, then second.", [call("calc", {"expr": "3"}), call("other", {"a": 1, "b": [True, None]})]),
    ],
)
def test_parse_turn_reads_back_the_calls_the_template_rendered(tokenizer, content, calls):
    turn = rendered_turn(tokenizer, {"role": "assistant", "content": content, "tool_calls": calls})
    assert turn.count("<tool_call>") == len(calls)
    assert parse_turn(turn, "qwen") == {"role": "assistant", "content": content, "tool_calls": calls}


def test_the_tools_schemas_are_in_the_system_message(tokenizer):
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools\n<tools>\n")
    system = text[: text.index(END)]
    for tool in TOOLS:
        assert json.dumps(tool) in system
    assert text.count("<|im_start|>system") == 1  # the system prompt is not rendered twice
    assert text.endswith(f"{END}\n<|im_start|>user\nhi{END}\n{ASSISTANT}")


def test_a_tool_message_is_a_user_turn_with_a_tool_response(tokenizer):
    messages = [{"role": "user", "content": "q"}, {"role": "tool", "content": "12"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert text.endswith(f"<|im_start|>user\nq{END}\n<|im_start|>user\n<tool_response>\n12\n</tool_response>{END}\n")


def test_without_tools_the_template_is_plain_chatml(tokenizer):
    hi = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(hi, tokenize=False, add_generation_prompt=True) == (
        f"<|im_start|>user\nhi{END}\n{ASSISTANT}"
    )
    conversation = [{"role": "system", "content": "s"}, *hi, {"role": "assistant", "content": "hello"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == (
        f"<|im_start|>system\ns{END}\n<|im_start|>user\nhi{END}\n{ASSISTANT}hello{END}\n"
    )


def test_the_configs_tool_call_formats_are_the_parsers():
    import typing

    from steps.environments.tool_calls import FORMATS
    from steps.run.config import EnvironmentConfig

    assert typing.get_args(EnvironmentConfig.model_fields["tool_call_format"].annotation) == FORMATS
