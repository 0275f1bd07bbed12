"""A subset of expr-lang (github.com/expr-lang/expr), the language Argo evaluates in `{{= ...}}` tags,
DAG `depends`, `retryStrategy.expression` and hook expressions.

    evaluate("asInt(lastRetry.exitCode) > 1 && lastRetry.status != 'Error'", env)

Supported: literals (numbers, strings in '' "" ``, true/false/nil, arrays, maps), member access
(`a.b`, `a['b']`, `a?.b`, `a[0]`, `a[1:3]`), calls, the operators of expr-lang with its precedence
table (`?:` `??` `||`/or `&&`/and `== != < > <= >= in matches contains startsWith endsWith` with `not`
forms, `..`, `+ -`, `* / %`, `** ^`, unary `! not - +`) and predicates with closures
(`all(list, {# > 0})`, filter, map, any, none, one, count, find). Values follow Go's types: int and
float are distinct, `/` always gives a float, `&&` wants booleans, `==` never equates a string and a
number. The functions an expression may call live in functions.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pipelines.local.lang.functions import BUILTINS, PREDICATES, go_equal

Node = tuple


class ExprError(Exception):
    """An expression that does not parse or cannot be evaluated."""


# Binary operators and their precedence, exactly as in expr-lang's parser/operator package.
BINARY = {
    "or": 10, "||": 10, "and": 15, "&&": 15,
    "==": 20, "!=": 20, "<": 20, ">": 20, ">=": 20, "<=": 20,
    "in": 20, "matches": 20, "contains": 20, "startsWith": 20, "endsWith": 20,
    "..": 25, "+": 30, "-": 30, "*": 60, "/": 60, "%": 60, "**": 100, "^": 100, "??": 500,
}  # fmt: skip
RIGHT_ASSOCIATIVE = {"**", "^"}
UNARY = {"not": 50, "!": 50, "-": 90, "+": 90}
NEGATABLE = {"in", "matches", "contains", "startsWith", "endsWith"}
WORD_OPERATORS = {"and", "or", "not", "in", "matches", "contains", "startsWith", "endsWith"}

TOKEN_RE = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<number>0[xX][0-9a-fA-F_]+|\d[\d_]*\.\d[\d_]*(?:[eE][+-]?\d+)?|\d[\d_]*[eE][+-]?\d+|\d[\d_]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<name>[A-Za-z_$][A-Za-z0-9_$]*)
  | (?P<op>\?\?|\?\.|\.\.|==|!=|<=|>=|&&|\|\||\*\*|[-+*/%^!<>()\[\]{},:?.\#|])
    """,
    re.VERBOSE,
)


def tokenize(source: str) -> list[tuple[str, str]]:
    tokens = []
    pos = 0
    while pos < len(source):
        match = TOKEN_RE.match(source, pos)
        if match is None:
            raise ExprError(f"unexpected character {source[pos]!r} at position {pos} in {source!r}")
        pos = match.end()
        kind = match.lastgroup
        text = match.group()
        if kind == "space":
            continue
        if kind == "name" and text in WORD_OPERATORS:
            kind = "op"
        tokens.append((kind, text))
    tokens.append(("eof", ""))
    return tokens


def _unquote(text: str) -> str:
    if text[0] == "`":
        return text[1:-1]
    body = text[1:-1]
    escapes = {
        "n": "\n",
        "t": "\t",
        "r": "\r",
        "\\": "\\",
        '"': '"',
        "'": "'",
        "0": "\0",
        "a": "\a",
        "b": "\b",
        "f": "\f",
        "v": "\v",
    }
    out = []
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt == "u" and i + 5 < len(body):
                out.append(chr(int(body[i + 2 : i + 6], 16)))
                i += 6
                continue
            out.append(escapes.get(nxt, "\\" + nxt))
            i += 2
            continue
        out.append(char)
        i += 1
    return "".join(out)


class Parser:
    """A Pratt parser producing tuples: ("lit", v), ("name", n), ("member", obj, key, optional),
    ("slice", obj, lo, hi), ("call", callee, args), ("unary", op, x), ("binary", op, l, r),
    ("cond", c, a, b), ("array", items), ("map", pairs), ("closure", body), ("pointer",)."""

    def __init__(self, source: str):
        self.source = source
        self.tokens = tokenize(source)
        self.pos = 0

    def peek(self, offset: int = 0) -> tuple[str, str]:
        return self.tokens[min(self.pos + offset, len(self.tokens) - 1)]

    def take(self) -> tuple[str, str]:
        token = self.tokens[self.pos]
        self.pos += 1
        return token

    def expect(self, text: str) -> None:
        kind, got = self.take()
        if got != text or kind not in ("op",):
            raise ExprError(f"expected {text!r} but found {got or 'end of input'!r} in {self.source!r}")

    def parse(self) -> Node:
        node = self.expression(0)
        if self.peek()[0] != "eof":
            raise ExprError(f"unexpected {self.peek()[1]!r} in {self.source!r}")
        return node

    def expression(self, precedence: int) -> Node:
        left = self.unary()
        while True:
            kind, text = self.peek()
            negate = False
            if kind == "op" and text == "not" and self.peek(1)[1] in NEGATABLE:
                negate = True
                text = self.peek(1)[1]
            if kind == "op" and text == "|" and precedence == 0:  # the pipe: `a | f(b)` is `f(a, b)`
                self.take()
                left = self.pipe(left)
                continue
            if kind != "op" or text not in BINARY or BINARY[text] < precedence:
                break
            self.take()
            if negate:
                self.take()
            next_precedence = BINARY[text] if text in RIGHT_ASSOCIATIVE else BINARY[text] + 1
            right = self.expression(next_precedence)
            left = ("binary", text, left, right)
            if negate:
                left = ("unary", "not", left)
        if precedence == 0 and self.peek()[1] == "?" and self.peek()[0] == "op":
            self.take()
            if self.peek()[1] == ":":  # Elvis: a ?: b
                self.take()
                return ("binary", "?:", left, self.expression(0))
            yes = self.expression(0)
            self.expect(":")
            no = self.expression(0)
            return ("cond", left, yes, no)
        return left

    def unary(self) -> Node:
        kind, text = self.peek()
        if kind == "op" and text in UNARY:
            self.take()
            return ("unary", text, self.expression(UNARY[text]))
        return self.postfix(self.primary())

    def primary(self) -> Node:
        kind, text = self.take()
        if kind == "number":
            clean = text.replace("_", "")
            if clean.lower().startswith("0x"):
                return ("lit", int(clean, 16))
            return ("lit", float(clean) if any(c in clean for c in ".eE") else int(clean))
        if kind == "string":
            return ("lit", _unquote(text))
        if kind == "name":
            if text in ("true", "false"):
                return ("lit", text == "true")
            if text == "nil":
                return ("lit", None)
            if self.peek()[1] == "(":
                return self.call(("name", text), text)
            return ("name", text)
        if text == "(":
            node = self.expression(0)
            self.expect(")")
            return node
        if text == "[":
            items = []
            while self.peek()[1] != "]":
                items.append(self.expression(0))
                if self.peek()[1] != ",":
                    break
                self.take()
            self.expect("]")
            return ("array", items)
        if text == "{":
            pairs = []
            while self.peek()[1] != "}":
                key_kind, key_text = self.take()
                if key_kind == "string":
                    key: Node = ("lit", _unquote(key_text))
                elif key_kind in ("name", "number"):
                    key = ("lit", key_text)
                elif key_text == "(":
                    key = self.expression(0)
                    self.expect(")")
                else:
                    raise ExprError(f"bad map key {key_text!r} in {self.source!r}")
                self.expect(":")
                pairs.append((key, self.expression(0)))
                if self.peek()[1] != ",":
                    break
                self.take()
            self.expect("}")
            return ("map", pairs)
        if text == "#":
            return ("pointer",)
        if text == ".":  # `.field` inside a closure means `#.field`
            _, field = self.take()
            return ("member", ("pointer",), ("lit", field), False)
        raise ExprError(f"unexpected {text or 'end of input'!r} in {self.source!r}")

    def call(self, callee: Node, name: str | None) -> Node:
        self.expect("(")
        args = []
        index = 0
        while self.peek()[1] != ")":
            if name in PREDICATES and index == 1:
                args.append(self.closure())
            else:
                args.append(self.expression(0))
            index += 1
            if self.peek()[1] != ",":
                break
            self.take()
        self.expect(")")
        return ("call", callee, args)

    def pipe(self, left: Node) -> Node:
        """expr-lang's parsePipe: the left side becomes the first argument of the call on the right."""
        kind, name = self.take()
        if kind != "name":
            raise ExprError(f"expected a function after '|' but found {name or 'end of input'!r} in {self.source!r}")
        callee: Node = ("name", name)
        while self.peek()[1] == ".":  # a member function: `x | sprig.upper()`
            self.take()
            _, field = self.take()
            callee, name = ("member", callee, ("lit", field), False), f"{name}.{field}"
        args = [left]
        if self.peek()[1] == "(":
            self.take()
            while self.peek()[1] != ")":
                args.append(self.closure() if name in PREDICATES and len(args) == 1 else self.expression(0))
                if self.peek()[1] != ",":
                    break
                self.take()
            self.expect(")")
        return ("call", callee, args)

    def closure(self) -> Node:
        if self.peek()[1] == "{":
            self.take()
            body = self.expression(0)
            self.expect("}")
            return ("closure", body)
        return ("closure", self.expression(0))

    def postfix(self, node: Node) -> Node:
        while True:
            kind, text = self.peek()
            if kind != "op":
                return node
            if text in (".", "?."):
                self.take()
                _, field = self.take()
                node = ("member", node, ("lit", field), text == "?.")
                if self.peek()[1] == "(":
                    node = self.call(node, None)
            elif text == "[":
                self.take()
                if self.peek()[1] == ":":
                    self.take()
                    hi = None if self.peek()[1] == "]" else self.expression(0)
                    self.expect("]")
                    node = ("slice", node, None, hi)
                    continue
                index = self.expression(0)
                if self.peek()[1] == ":":
                    self.take()
                    hi = None if self.peek()[1] == "]" else self.expression(0)
                    self.expect("]")
                    node = ("slice", node, index, hi)
                    continue
                self.expect("]")
                node = ("member", node, index, False)
            elif text == "(" and node[0] == "member":
                node = self.call(node, None)
            else:
                return node


_PARSED: dict[str, Node] = {}


def parse(source: str) -> Node:
    """Parse once, then reuse: the controller evaluates the same expressions on every pass."""
    if source not in _PARSED:
        _PARSED[source] = Parser(source).parse()
    return _PARSED[source]


def called_functions(source: str) -> set[str]:
    """The plain function names an expression calls (`sprig.x` calls are reported as `sprig.x`)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if not isinstance(node, tuple):
            if isinstance(node, list):
                for item in node:
                    walk(item)
            return
        if node and node[0] == "call":
            callee = node[1]
            if callee[0] == "name":
                found.add(callee[1])
            elif callee[0] == "member" and callee[1] == ("name", "sprig") and callee[2][0] == "lit":
                found.add(f"sprig.{callee[2][1]}")
        for part in node[1:]:
            walk(part)

    walk(parse(source))
    return found


def evaluate(source: str, env: dict[str, Any]) -> Any:
    """Evaluate `source` against `env` (a nested dict; functions come from functions.BUILTINS)."""
    try:
        return Evaluator(env).eval(parse(source), None)
    except ExprError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError, re.error) as err:
        raise ExprError(f"unable to evaluate expression '{source}': {err}") from err


def evaluate_bool(source: str, env: dict[str, Any]) -> bool:
    result = evaluate(source, env)
    if not isinstance(result, bool):
        raise ExprError(f"unable to cast expression result '{result}' to bool")
    return result


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class Evaluator:
    def __init__(self, env: dict[str, Any]):
        self.env = env

    def eval(self, node: Node, pointer: Any) -> Any:
        kind = node[0]
        if kind == "lit":
            return node[1]
        if kind == "name":
            name = node[1]
            if name in self.env:
                return self.env[name]
            if name in BUILTINS:
                return BUILTINS[name]
            raise ExprError(f"unknown name {name}")
        if kind == "pointer":
            return pointer
        if kind == "member":
            return self.member(node, pointer)
        if kind == "slice":
            target = self.eval(node[1], pointer)
            lo = 0 if node[2] is None else self.eval(node[2], pointer)
            hi = len(target) if node[3] is None else self.eval(node[3], pointer)
            return target[lo:hi]
        if kind == "call":
            return self.call(node, pointer)
        if kind == "unary":
            return self.unary(node[1], self.eval(node[2], pointer))
        if kind == "binary":
            return self.binary(node, pointer)
        if kind == "cond":
            test = self.eval(node[1], pointer)
            if not isinstance(test, bool):
                raise ExprError(f"non-bool expression (type {type(test).__name__}) used as condition")
            return self.eval(node[2] if test else node[3], pointer)
        if kind == "array":
            return [self.eval(item, pointer) for item in node[1]]
        if kind == "map":
            return {self.eval(k, pointer): self.eval(v, pointer) for k, v in node[1]}
        raise ExprError(f"cannot evaluate {kind}")

    def member(self, node: Node, pointer: Any) -> Any:
        target = self.eval(node[1], pointer)
        key = self.eval(node[2], pointer)
        if target is None:
            if node[3]:
                return None
            raise ExprError(f"cannot fetch {key} from nil")
        if isinstance(target, dict):
            return target.get(key)
        if isinstance(target, list | str) and isinstance(key, int) and not isinstance(key, bool):
            if not -len(target) <= key < len(target):
                raise ExprError(f"index out of range: {key} (array length is {len(target)})")
            return target[key]
        raise ExprError(f"cannot fetch {key!r} from {type(target).__name__}")

    def call(self, node: Node, pointer: Any) -> Any:
        callee_node, arg_nodes = node[1], node[2]
        if callee_node[0] == "name" and callee_node[1] in PREDICATES and callee_node[1] not in self.env:
            items = self.eval(arg_nodes[0], pointer)
            body = arg_nodes[1][1] if len(arg_nodes) > 1 else ("pointer",)
            return PREDICATES[callee_node[1]](items, lambda item: self.eval(body, item))
        function = self.eval(callee_node, pointer)
        if not callable(function):
            raise ExprError(f"{function!r} is not a function")
        return function(*[self.eval(arg, pointer) for arg in arg_nodes])

    def unary(self, op: str, value: Any) -> Any:
        if op in ("!", "not"):
            if not isinstance(value, bool):
                raise ExprError(f"invalid operation: {op} {type(value).__name__}")
            return not value
        if not _number(value):
            raise ExprError(f"invalid operation: {op}{type(value).__name__}")
        return -value if op == "-" else value

    def binary(self, node: Node, pointer: Any) -> Any:
        op = node[1]
        if op in ("&&", "and", "||", "or"):
            left = self.eval(node[2], pointer)
            if not isinstance(left, bool):
                raise ExprError(f"invalid operation: {type(left).__name__} {op} ...: want bool")
            if (op in ("&&", "and")) != left:  # short circuit: false && x, true || x
                return left
            right = self.eval(node[3], pointer)
            if not isinstance(right, bool):
                raise ExprError(f"invalid operation: ... {op} {type(right).__name__}: want bool")
            return right
        if op == "??":
            left = self.eval(node[2], pointer)
            return self.eval(node[3], pointer) if left is None else left
        if op == "?:":
            left = self.eval(node[2], pointer)
            return left if left not in (None, False, 0, "") else self.eval(node[3], pointer)
        left = self.eval(node[2], pointer)
        right = self.eval(node[3], pointer)
        return BINARY_FUNCTIONS[op](left, right)


def _arithmetic(op: str, python: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def apply(left: Any, right: Any) -> Any:
        if _number(left) and _number(right):
            return python(left, right)
        if op == "+" and isinstance(left, str) and isinstance(right, str):
            return left + right
        if op == "+" and isinstance(left, list) and isinstance(right, list):
            return left + right
        raise ExprError(f"invalid operation: {type(left).__name__} {op} {type(right).__name__}")

    return apply


def _compare(op: str, python: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def apply(left: Any, right: Any) -> bool:
        if (_number(left) and _number(right)) or (isinstance(left, str) and isinstance(right, str)):
            return python(left, right)
        raise ExprError(f"invalid operation: {type(left).__name__} {op} {type(right).__name__}")

    return apply


def _modulo(left: Any, right: Any) -> int:
    if isinstance(left, int) and isinstance(right, int) and not isinstance(left | right, bool):
        if right == 0:
            raise ExprError("integer divide by zero")
        return int(abs(left) % abs(right)) * (1 if left >= 0 else -1)  # Go's % truncates toward zero
    raise ExprError(f"invalid operation: {type(left).__name__} % {type(right).__name__}")


def _divide(left: Any, right: Any) -> float:
    if not (_number(left) and _number(right)):
        raise ExprError(f"invalid operation: {type(left).__name__} / {type(right).__name__}")
    if right == 0:
        return float("inf") if left > 0 else float("-inf") if left < 0 else float("nan")
    return left / right


def _contains(container: Any, item: Any) -> bool:
    if isinstance(container, dict):
        return item in container
    if isinstance(container, list):
        return any(go_equal(element, item) for element in container)
    if container is None:
        return False
    raise ExprError(f"invalid operation: {type(item).__name__} in {type(container).__name__}")


def _strings(op: str, python: Callable[[str, str], bool]) -> Callable[[Any, Any], bool]:
    def apply(left: Any, right: Any) -> bool:
        if isinstance(left, str) and isinstance(right, str):
            return python(left, right)
        raise ExprError(f"invalid operation: {type(left).__name__} {op} {type(right).__name__}")

    return apply


def _range(left: Any, right: Any) -> list[int]:
    if isinstance(left, int) and isinstance(right, int):
        return list(range(left, right + 1))
    raise ExprError("invalid operation: .. wants integers")


BINARY_FUNCTIONS: dict[str, Callable[[Any, Any], Any]] = {
    "+": _arithmetic("+", lambda a, b: a + b),
    "-": _arithmetic("-", lambda a, b: a - b),
    "*": _arithmetic("*", lambda a, b: a * b),
    "/": _divide,
    "%": _modulo,
    "**": _arithmetic("**", lambda a, b: float(a) ** float(b)),
    "^": _arithmetic("^", lambda a, b: float(a) ** float(b)),
    "==": go_equal,
    "!=": lambda a, b: not go_equal(a, b),
    "<": _compare("<", lambda a, b: a < b),
    ">": _compare(">", lambda a, b: a > b),
    "<=": _compare("<=", lambda a, b: a <= b),
    ">=": _compare(">=", lambda a, b: a >= b),
    "in": lambda a, b: _contains(b, a),
    "matches": _strings("matches", lambda a, b: re.search(b, a) is not None),
    "contains": _strings("contains", lambda a, b: b in a),
    "startsWith": _strings("startsWith", lambda a, b: a.startswith(b)),
    "endsWith": _strings("endsWith", lambda a, b: a.endswith(b)),
    "..": _range,
}
