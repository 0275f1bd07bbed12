"""Argo's variable substitution and condition languages.

- `substitute(value, scope)` replaces `{{name}}` and `{{= expr}}` tags in every string of a manifest
  fragment, the way Argo's util/template does: a simple tag takes the scope's value verbatim; an
  expression tag is evaluated with expr-lang (exprlang.py) over the scope expanded into nested maps
  (`inputs.parameters.x`, `steps['flip-coin'].outputs.result`), and a non-string result is written as
  JSON. A tag that cannot be resolved yet is left in place, unless its name starts with one of the
  `strict` prefixes (Argo resolves `steps.*`/`tasks.*` strictly once the steps they name are done).
- `evaluate_when(text)` evaluates a substituted `when:` condition with govaluate's rules, where bare
  words are strings: `heads == heads`, `{{workflow.status}} != Succeeded`, `5 > 3`, `abc =~ '^a'`.
- `humanize_duration`: Argo's durations in messages (pipelines/durations.py parses them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from pipelines.local.lang import exprlang
from pipelines.local.lang.functions import BUILTINS, go_float, go_json

# Variables Argo binds late; an expression naming one is left unresolved until they exist.
LATE_VARIABLES = {
    "item", "retries", "lastRetry.exitCode", "lastRetry.status", "lastRetry.duration",
    "lastRetry.message", "workflow.status", "workflow.failures",
}  # fmt: skip


class SubstitutionError(Exception):
    """A tag that must resolve did not (message as Argo words it)."""


class AbsentOptional(SubstitutionError):
    """A tag naming the output of a skipped step that has no default."""


# ----------------------------------------------------------------------------- scopes


def expand(scope: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1, "a.c": 2} -> {"a": {"b": 1, "c": 2}}. As in Argo's util/expand, a key that is also
    the prefix of another key ("workflow.parameters" beside "workflow.parameters.x") is dropped."""
    keys = sorted(scope)
    nested: dict[str, Any] = {}
    for i, key in enumerate(keys):
        if i + 1 < len(keys) and keys[i + 1].startswith(key + "."):
            continue
        parts = key.split(".")
        target = nested
        for part in parts[:-1]:
            child = target.get(part)
            if not isinstance(child, dict):
                child = target[part] = {}
            target = child
        target[parts[-1]] = scope[key]
    return nested


def _has_path(env: dict[str, Any], path: str) -> bool:
    current: Any = env
    for part in path.split("."):
        if not isinstance(current, dict) or part not in current:
            return False
        current = current[part]
    return True


def referenced_names(source: str) -> list[str]:
    """Identifiers and member paths an expression reads, as Argo's getIdentifiers collects them
    (util/template/expression_template.go, v4.1.2), in ast.Walk's order (children first): every
    identifier, and each member path of string keys (`a.b.c` gives a, a.b, a.b.c). Its guardVisitor
    leaves out the member nodes on the left of `??` and the object of a `?.`, but not a bare
    identifier there ("so a genuinely-unavailable variable still triggers a requeue"): in
    `get(item, 'type') ?? 'x'`, `item` is read, so the tag waits for the loop's item. A function's own
    name is not a variable (expr-lang's builtins are BuiltinNodes; Argo's functions are in the env)."""
    tree = exprlang.parse(source)
    guarded: set[int] = set()  # id() of the guarded member nodes (the tree lives for this call)

    def children(node: tuple) -> list[tuple]:
        if node[0] in ("lit", "name", "pointer"):
            return []
        parts: list[Any] = [node[2]] if node[0] == "call" and node[1][0] == "name" else list(node[1:])
        out: list[tuple] = []
        while parts:
            part = parts.pop(0)
            if isinstance(part, tuple) and part and isinstance(part[0], str):
                out.append(part)
            elif isinstance(part, tuple | list):
                parts[:0] = list(part)  # an argument list, a map's (key, value) pairs
        return out

    def walk(node: tuple, visit: Callable[[tuple], None]) -> None:
        for child in children(node):
            walk(child, visit)
        visit(node)

    def mark_members(node: tuple) -> None:  # memberMarker
        if node[0] == "member":
            guarded.add(id(node))

    def guard(node: tuple) -> None:  # guardVisitor
        if node[0] == "binary" and node[1] == "??":
            walk(node[2], mark_members)
        elif node[0] == "member" and node[3] and node[1][0] == "member":
            guarded.add(id(node[1]))

    def path_of(node: tuple) -> str | None:  # getMemberPath: no path through a `?.` or a computed key
        if node[0] == "name":
            return node[1]
        if node[0] == "member" and node[2][0] == "lit" and isinstance(node[2][1], str) and not node[3]:
            base = path_of(node[1])
            return None if base is None else f"{base}.{node[2][1]}"
        return None

    found: list[str] = []

    def identify(node: tuple) -> None:  # identifierVisitor
        if id(node) in guarded:
            return
        path = node[1] if node[0] == "name" else path_of(node) if node[0] == "member" else None
        if path is not None:
            found.append(path)

    walk(tree, guard)
    walk(tree, identify)
    return list(dict.fromkeys(found))


def _matches_prefix(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# ----------------------------------------------------------------------------- substitution


def substitute(value: Any, scope: dict[str, Any], strict: tuple[str, ...] = ()) -> Any:
    """Substitute tags in every string (and mapping key) of `value`; returns a new structure."""
    if isinstance(value, str):
        return substitute_text(value, scope, strict)
    if isinstance(value, list):
        return [substitute(item, scope, strict) for item in value]
    if isinstance(value, dict):
        return {
            substitute_text(k, scope, strict) if isinstance(k, str) else k: substitute(v, scope, strict)
            for k, v in value.items()
        }
    return value


def substitute_text(text: str, scope: dict[str, Any], strict: tuple[str, ...] = ()) -> str:
    if "{{" not in text:
        return text
    out = []
    pos = 0
    env: dict[str, Any] | None = None
    while True:
        start = text.find("{{", pos)
        if start < 0:
            out.append(text[pos:])
            break
        end = text.find("}}", start + 2)
        if end < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        tag = text[start + 2 : end]
        if tag.startswith("="):
            if env is None:
                env = expand(scope)
            out.append(_replace_expression(tag, env, strict))
        else:
            out.append(_replace_simple(tag, scope, strict))
        pos = end + 2
    return "".join(out)


def _replace_simple(tag: str, scope: dict[str, Any], strict: tuple[str, ...]) -> str:
    name = tag.strip()
    if name not in scope:
        if _matches_prefix(name, strict):
            raise SubstitutionError(f"failed to resolve {{{{{tag}}}}}")
        return "{{" + tag + "}}"
    value = scope[name]
    if value is None:
        raise AbsentOptional(
            f"unable to substitute {{{{{tag}}}}}: output is an absent optional (skipped/omitted node with no default)"
        )
    return str(value)


def _replace_expression(tag: str, env: dict[str, Any], strict: tuple[str, ...]) -> str:
    source = tag[1:]
    unresolved = "{{" + tag + "}}"
    try:
        names = referenced_names(source)
    except exprlang.ExprError as err:
        if strict:
            raise SubstitutionError(f"failed to evaluate expression: {err}") from err
        return unresolved
    missing = [n for n in names if not _has_path(env, n) and n.split(".")[0] not in BUILTINS]
    for name in missing:
        if _matches_prefix(name, strict):
            raise SubstitutionError(f"failed to evaluate expression: {name} is missing")
    allow_unresolved = bool(missing) or not strict
    if allow_unresolved and any(n in LATE_VARIABLES for n in missing):
        return unresolved
    try:
        result = exprlang.evaluate(source, env)
    except exprlang.ExprError as err:
        if allow_unresolved:
            return unresolved
        raise SubstitutionError(f"failed to evaluate expression: {err}") from err
    if result is None:
        if allow_unresolved:
            return unresolved
        raise SubstitutionError(f'failed to evaluate expression "{source}"')
    return result if isinstance(result, str) else go_json(result)


# ----------------------------------------------------------------------------- when (govaluate)

WHEN_TOKEN_RE = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<string>"[^"]*"|'[^']*')
  | (?P<bracket>\[[^\]]*\])
  | (?P<word>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<op>\?\?|==|!=|>=|<=|=~|!~|&&|\|\||\*\*|<<|>>|[-+*/%<>!()?:,&|^~])
    """,
    re.VERBOSE,
)
WHEN_PRECEDENCE = [
    {"??"}, {"||"}, {"&&"}, {"==", "!=", ">", "<", ">=", "<=", "=~", "!~", "in"},
    {"+", "-"}, {"*", "/", "%"}, {"**"},
]  # fmt: skip


class WhenError(Exception):
    """A `when` condition that does not parse or evaluate (message as Argo words it)."""


def evaluate_when(condition: str) -> bool:
    """Argo's shouldExecute: an empty condition runs the step; otherwise it must evaluate to a bool."""
    if condition == "":
        return True
    try:
        tokens = _when_tokens(condition)
        parser = _WhenParser(tokens)
        result = parser.ternary()
        if parser.pos != len(tokens):
            raise WhenError(f"unexpected token {tokens[parser.pos][1]!r}")
    except WhenError as err:
        raise WhenError(f"Invalid 'when' expression '{condition}': {err}") from err
    if not isinstance(result, bool):
        raise WhenError(f"Expected boolean evaluation for '{condition}'. Got {result}")
    return result


def _when_tokens(text: str) -> list[tuple[str, Any]]:
    tokens: list[tuple[str, Any]] = []
    pos = 0
    while pos < len(text):
        match = WHEN_TOKEN_RE.match(text, pos)
        if match is None:
            raise WhenError(f"Invalid token: '{text[pos:]}'")
        pos = match.end()
        kind, raw = match.lastgroup, match.group()
        if kind == "space":
            continue
        if kind == "number":
            tokens.append(("value", float(raw)))
        elif kind == "string":
            tokens.append(("value", raw[1:-1]))
        elif kind == "bracket":
            tokens.append(("value", raw[1:-1]))
        elif kind == "word" and raw in ("true", "false"):
            tokens.append(("value", raw == "true"))
        elif kind == "word" and raw == "in":
            tokens.append(("op", "in"))
        elif kind == "word":  # govaluate variables become strings, so bare words compare as text
            tokens.append(("value", raw))
        else:
            tokens.append(("op", raw))
    for previous, current in zip(tokens, tokens[1:], strict=False):
        if previous[0] == "value" and current[0] == "value":
            raise WhenError(f"Cannot transition token types from VALUE [{previous[1]}] to VALUE [{current[1]}]")
    return tokens


class _WhenParser:
    def __init__(self, tokens: list[tuple[str, Any]]):
        self.tokens = tokens
        self.pos = 0

    def peek(self) -> tuple[str, Any] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def ternary(self) -> Any:
        test = self.binary(0)
        if self.peek() == ("op", "?"):
            self.pos += 1
            yes = self.binary(0)
            no = None
            if self.peek() == ("op", ":"):
                self.pos += 1
                no = self.binary(0)
            return yes if test is True else no
        return test

    def binary(self, level: int) -> Any:
        if level == len(WHEN_PRECEDENCE):
            return self.prefix()
        left = self.binary(level + 1)
        while (token := self.peek()) is not None and token[0] == "op" and token[1] in WHEN_PRECEDENCE[level]:
            self.pos += 1
            op = token[1]
            if op == "&&" and left is False or op == "||" and left is True:
                self.binary(level + 1)  # parsed, not needed
                continue
            left = _when_apply(op, left, self.binary(level + 1))
        return left

    def prefix(self) -> Any:
        token = self.peek()
        if token is None:
            raise WhenError("unexpected end of expression")
        self.pos += 1
        if token == ("op", "!"):
            value = self.prefix()
            if not isinstance(value, bool):
                raise WhenError(f"Value '{value}' cannot be used with the prefix '!', it is not a bool")
            return not value
        if token == ("op", "-"):
            value = self.prefix()
            if not isinstance(value, float):
                raise WhenError(f"Value '{value}' cannot be used with the prefix '-', it is not a number")
            return -value
        if token == ("op", "("):
            items = [self.ternary()]
            while self.peek() == ("op", ","):
                self.pos += 1
                items.append(self.ternary())
            if self.peek() != ("op", ")"):
                raise WhenError("Unbalanced parenthesis")
            self.pos += 1
            return items[0] if len(items) == 1 else items
        if token[0] == "value":
            return token[1]
        raise WhenError(f"unexpected token '{token[1]}'")


def _when_apply(op: str, left: Any, right: Any) -> Any:
    def number(value: Any) -> bool:
        return isinstance(value, float)

    if op == "??":
        return right if left is None else left
    if op in ("&&", "||"):
        for value in (left, right):
            if not isinstance(value, bool):
                raise WhenError(f"Value '{value}' cannot be used with the logical operator '{op}', it is not a bool")
        return left and right if op == "&&" else left or right
    if op == "==":
        return type(left) is type(right) and left == right
    if op == "!=":
        return not (type(left) is type(right) and left == right)
    if op in (">", "<", ">=", "<="):
        if not (number(left) and number(right) or isinstance(left, str) and isinstance(right, str)):
            raise WhenError(f"Value '{left}' cannot be used with the comparator '{op}', it is not a number")
        return {">": left > right, "<": left < right, ">=": left >= right, "<=": left <= right}[op]
    if op in ("=~", "!~"):
        if not (isinstance(left, str) and isinstance(right, str)):
            raise WhenError(f"Value '{left}' cannot be used with the comparator '{op}', it is not a string")
        try:
            found = re.search(right, left) is not None
        except re.error as err:
            raise WhenError(f"Unable to compile regexp pattern '{right}': {err}") from err
        return found if op == "=~" else not found
    if op == "in":
        items = right if isinstance(right, list) else [right]
        return any(type(left) is type(item) and left == item for item in items)
    if op == "+" and (isinstance(left, str) or isinstance(right, str)):
        return _when_text(left) + _when_text(right)
    if not (number(left) and number(right)):
        raise WhenError(f"Value '{left}' cannot be used with the modifier '{op}', it is not a number")
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    if op == "/":
        return left / right if right else math.copysign(math.inf, left)
    if op == "%":
        return math.fmod(left, right)
    if op == "**":
        return left**right
    raise WhenError(f"unsupported operator '{op}'")


def _when_text(value: Any) -> str:
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ----------------------------------------------------------------------------- durations


def humanize_duration(seconds: float) -> str:
    """Argo's util/humanize.Duration, used in "Backoff for 2 seconds"."""

    def truncated(s: float) -> str:
        for limit, fmt, unit in (
            (1, "0 seconds", 1),
            (2, "1 second", 1),
            (60, "{} seconds", 1),
            (120, "1 minute", 1),
            (3600, "{} minutes", 60),
            (7200, "1 hour", 1),
            (86400, "{} hours", 3600),
            (172800, "1 day", 1),
        ):
            if s < limit:
                return fmt.format(int(s // unit))
        return f"{int(s // 86400)} days"

    if seconds < 60:
        return truncated(seconds)
    if seconds < 3600:
        return f"{truncated(seconds)} {int(seconds % 60)} seconds"
    if seconds < 86400:
        return f"{truncated(seconds)} {int(seconds / 60 % 60)} minutes"
    return f"{truncated(seconds)} {int(seconds / 3600 % 24)} hours"
