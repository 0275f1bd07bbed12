"""The tool demo's environment: a calculator the model must call (configs/demo-tool.yaml, task multiply).

It is written as any user's environment is (steps/environments/worker.py has the contract) and named by its dotted
path, `steps.demo.calculator:CalculatorEnv`. Each tool call is answered with a `tool` message: the value of the
expression, or an error the model can read. A turn without a tool call is the model's final answer: the
conversation ends there, and the run's verifier scores it. The environment's own reward is `call_reward` for each
call it could evaluate in the conversation's first turn (0 by default: the demo's reward is the verifier's).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

TOOLS = [  # kept short: the schema is part of every prompt
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "integer arithmetic",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
]
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_DIGITS = 30  # a result longer than this is refused, so that an expression cannot make a huge number


def evaluate(expression: str) -> int:
    """The integer value of `expression` (integers, + - *, parentheses); ValueError for anything else."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            result = _OPERATORS[type(node.op)](value(node.left), value(node.right))
            if len(str(abs(result))) > MAX_DIGITS:
                raise ValueError("the result is too large")
            return result
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"{expression!r} is not integer arithmetic with + - *")

    return value(tree.body)


class CalculatorEnv:
    """One conversation: reset keeps the prompt's own message; each step answers the tool calls of the last turn."""

    def __init__(self, call_reward: float = 0.0) -> None:
        self.tools = TOOLS
        self.call_reward = call_reward
        self.turn = 0

    def reset(self, prompt: Any, answer: str, metadata: dict[str, Any], seed: int) -> None:
        return None

    def step(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, str]], float, bool, dict[str, float]]:
        self.turn += 1
        calls = messages[-1].get("tool_calls", [])
        if not calls:
            return [], 0.0, True, {"answered_after_call": float(self.turn > 1)}
        observation, evaluated = [], 0
        for call in calls:
            function = call["function"]
            if function["name"] != "calc":
                content = f"error: no tool {function['name']!r}; the tool is calc"
            else:
                try:
                    content = str(evaluate(str(function["arguments"].get("expr", ""))))
                    evaluated += 1
                except ValueError as err:
                    content = f"error: {err}"
            observation.append({"role": "tool", "content": content})
        reward = self.call_reward * evaluated if self.turn == 1 else 0.0
        return observation, reward, False, {"calls_evaluated": float(evaluated)}
