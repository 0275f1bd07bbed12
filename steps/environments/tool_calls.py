"""Tool calls in the model's own output format, parsed into the messages the chat template and the environment read.

    qwen   <tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>
           the Hermes format that the chat templates of Qwen2.5, Qwen3, Qwen3-MoE, Qwen3-Next and Qwen3.5 write for
           an assistant message's `tool_calls` and teach the model in their tools system prompt; several calls are
           several blocks. (A template's own rendering, e.g. Qwen3's, puts a newline between blocks and JSON with
           ", " and ": " separators: the parser reads any JSON whitespace.)
    none   no tool calls: every turn is plain text (a conversation with an environment that only talks)

A turn becomes an assistant message {"role": "assistant", "content": text outside the calls, "tool_calls":
[{"type": "function", "function": {"name": ..., "arguments": {...}}}]} (transformers' chat message shape, which
the templates render back). A block that is not a JSON object with a string "name" and an object "arguments" (or
none: {}) is no call: it stays in the content, for the environment to answer as it sees fit (a model learning the
format writes broken calls, and that is a reward signal, not an error). Other formats (Llama 3's JSON, Mistral's
[TOOL_CALLS], DeepSeek-V3's and Kimi-K2's special-token calls, GLM-4.5's <arg_key> tags) are not read yet: a
run names one of the formats above.
"""

from __future__ import annotations

import json
import re
from typing import Any

FORMATS = ("qwen", "none")
_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_turn(text: str, fmt: str) -> dict[str, Any]:
    """The assistant message of one model turn (its text up to, not including, the stop token)."""
    if fmt == "none":
        return {"role": "assistant", "content": text}
    if fmt != "qwen":
        raise ValueError(f"tool call format {fmt!r}: one of {FORMATS}")
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _QWEN_BLOCK.finditer(text):
        call = _qwen_call(match.group(1))
        if call is None:
            continue  # not a call: the block stays in the content
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(kept).strip() if calls else text}
    if calls:
        message["tool_calls"] = calls
    return message


def _qwen_call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"type": "function", "function": {"name": value["name"], "arguments": arguments}}


def tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The calls of an assistant message as (name, arguments) dicts: [{"name": ..., "arguments": {...}}]."""
    return [dict(call["function"]) for call in message.get("tool_calls", [])]
