"""The functions an Argo expression can call: expr-lang's builtins, Argo's additions (`asInt`, `asFloat`,
`jsonpath`, `toJson`) and the common part of `sprig.*` (Masterminds/sprig, as Argo exposes it).

Values follow Go's conventions because the results are written back into manifests: `string(1.0)` is
"1", JSON of a float that is whole has no ".0", and `int("1.5")` is an error as in expr-lang.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any


class FunctionError(ValueError):
    """A function called with arguments it does not accept."""


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def go_equal(left: Any, right: Any) -> bool:
    """Go/expr-lang equality: numbers compare by value across int and float, nothing else mixes types."""
    if is_number(left) and is_number(right):
        return left == right
    if type(left) is not type(right):
        return False
    return left == right


def go_float(value: float) -> str:
    """strconv.FormatFloat(f, 'g', -1, 64) with %v's exponent range, e.g. 3.0 -> "3", 1e21 -> "1e+21"."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1e21:
        return str(int(value))
    text = repr(value)
    if "e" in text:
        mantissa, exponent = text.split("e")
        sign = "-" if exponent.startswith("-") else "+"
        text = f"{mantissa}e{sign}{abs(int(exponent)):02d}"
    return text


def go_string(value: Any) -> str:
    """fmt.Sprintf("%v", value), which is what expr-lang's string() returns."""
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return go_float(value)
    if isinstance(value, list):
        return "[" + " ".join(go_string(item) for item in value) + "]"
    if isinstance(value, dict):
        return "map[" + " ".join(f"{go_string(k)}:{go_string(v)}" for k, v in sorted(value.items())) + "]"
    return str(value)


def go_json(value: Any) -> str:
    """encoding/json.Marshal: compact, map keys sorted, whole floats without ".0", no HTML escaping."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise FunctionError(f"json: unsupported value: {go_float(value)}")
        if value == int(value) and abs(value) < 1e21:
            return str(int(value))
        if abs(value) < 1e-6 or abs(value) >= 1e21:
            return go_float(value)
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(go_json(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{go_json(v)}" for k, v in sorted(value.items())) + "}"
    return json.dumps(value, ensure_ascii=False)


def to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise FunctionError(f"invalid operation: int({go_string(value)})")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value):
        return int(value)
    raise FunctionError(f"invalid operation: int({go_string(value)})")


def to_float(value: Any) -> float:
    if is_number(value):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise FunctionError(f"invalid operation: float({go_string(value)})")


def _length(value: Any) -> int:
    if isinstance(value, str | list | dict):
        return len(value)
    raise FunctionError(f"invalid argument for len (type {type(value).__name__})")


def _round(value: Any) -> float:
    number = to_float(value)
    return float(math.floor(number + 0.5)) if number >= 0 else -float(math.floor(-number + 0.5))


def _first(items: list) -> Any:
    return items[0] if items else None


def _last(items: list) -> Any:
    return items[-1] if items else None


def _get(target: Any, key: Any) -> Any:
    if isinstance(target, dict):
        return target.get(key)
    if isinstance(target, list) and isinstance(key, int) and -len(target) <= key < len(target):
        return target[key]
    return None


def _find(items: list, test: Callable[[Any], Any]) -> Any:
    return next((item for item in items if test(item)), None)


def _find_index(items: list, test: Callable[[Any], Any]) -> int:
    return next((i for i, item in enumerate(items) if test(item)), -1)


def jsonpath(document: str, path: str) -> Any:
    """The part of JSONPath that workflows use: $, .key, ['key'], [n], [*], .*"""
    data = json.loads(document)
    if not path.startswith("$"):
        raise FunctionError(f"jsonpath {path!r} must start with $")
    results = [data]
    for step in re.findall(r"\.\*|\.[^.\[]+|\[\*\]|\[\d+\]|\['[^']*'\]|\[\"[^\"]*\"\]", path[1:]):
        nxt = []
        for item in results:
            if step in (".*", "[*]"):
                nxt.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else [])
            elif step.startswith("[") and step[1].isdigit():
                index = int(step[1:-1])
                if isinstance(item, list) and index < len(item):
                    nxt.append(item[index])
            else:
                key = step[1:] if step.startswith(".") else step[2:-2]
                if isinstance(item, dict) and key in item:
                    nxt.append(item[key])
        results = nxt
    wildcard = "*" in path
    if wildcard:
        return results
    if not results:
        raise FunctionError(f"jsonpath {path!r} matched nothing")
    return results[0]


def _sprig_default(default: Any, given: Any = None) -> Any:
    return default if given in (None, "", [], {}, 0, False) else given


def _sprig_substr(start: int, end: int, text: str) -> str:
    if start < 0:
        return text[:end]
    if end < 0 or end > len(text):
        return text[start:]
    return text[start:end]


def _sprig_int(value: Any) -> int:
    try:
        return int(float(value)) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        return 0


def _sprig_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _sprig_until(count: int) -> list[int]:
    return list(range(count)) if count >= 0 else list(range(0, count, -1))


SPRIG: dict[str, Callable[..., Any]] = {
    "trim": lambda s: str(s).strip(),
    "trimAll": lambda cut, s: str(s).strip(cut),
    "trimPrefix": lambda prefix, s: str(s).removeprefix(prefix),
    "trimSuffix": lambda suffix, s: str(s).removesuffix(suffix),
    "upper": lambda s: str(s).upper(),
    "lower": lambda s: str(s).lower(),
    "title": lambda s: str(s).title(),
    "replace": lambda old, new, s: str(s).replace(old, new),
    "repeat": lambda count, s: str(s) * int(count),
    "substr": _sprig_substr,
    "trunc": lambda length, s: str(s)[:length] if length >= 0 else str(s)[length:],
    "nospace": lambda s: re.sub(r"\s", "", str(s)),
    "contains": lambda sub, s: sub in str(s),
    "hasPrefix": lambda prefix, s: str(s).startswith(prefix),
    "hasSuffix": lambda suffix, s: str(s).endswith(suffix),
    "quote": lambda *items: " ".join(json.dumps(go_string(i)) for i in items if i is not None),
    "squote": lambda *items: " ".join(f"'{go_string(i)}'" for i in items if i is not None),
    "cat": lambda *items: " ".join(go_string(i) for i in items if i is not None),
    "toString": go_string,
    "atoi": _sprig_int,
    "int": _sprig_int,
    "int64": _sprig_int,
    "float64": _sprig_float,
    "add": lambda *numbers: sum(_sprig_int(n) for n in numbers),
    "add1": lambda n: _sprig_int(n) + 1,
    "sub": lambda a, b: _sprig_int(a) - _sprig_int(b),
    "mul": lambda *numbers: math.prod(_sprig_int(n) for n in numbers),
    "div": lambda a, b: int(_sprig_int(a) / _sprig_int(b)),
    "mod": lambda a, b: _sprig_int(a) % _sprig_int(b),
    "max": lambda *numbers: max(_sprig_int(n) for n in numbers),
    "min": lambda *numbers: min(_sprig_int(n) for n in numbers),
    "addf": lambda *numbers: sum(_sprig_float(n) for n in numbers),
    "subf": lambda a, b: _sprig_float(a) - _sprig_float(b),
    "mulf": lambda *numbers: math.prod(_sprig_float(n) for n in numbers),
    "divf": lambda a, b: _sprig_float(a) / _sprig_float(b),
    "maxf": lambda *numbers: max(_sprig_float(n) for n in numbers),
    "minf": lambda *numbers: min(_sprig_float(n) for n in numbers),
    "floor": lambda n: float(math.floor(_sprig_float(n))),
    "ceil": lambda n: float(math.ceil(_sprig_float(n))),
    "round": lambda n, precision=0: round(_sprig_float(n), int(precision)),
    "default": _sprig_default,
    "empty": lambda value: value in (None, "", [], {}, 0, False),
    "coalesce": lambda *items: next((i for i in items if i not in (None, "", [], {}, 0, False)), None),
    "ternary": lambda yes, no, test: yes if test else no,
    "list": lambda *items: list(items),
    "first": _first,
    "last": _last,
    "join": lambda sep, items: sep.join(go_string(i) for i in items),
    "splitList": lambda sep, s: str(s).split(sep),
    "split": lambda sep, s: {f"_{i}": part for i, part in enumerate(str(s).split(sep))},
    "until": _sprig_until,
    "has": lambda item, items: any(go_equal(item, i) for i in items),
    "uniq": lambda items: [i for n, i in enumerate(items) if not any(go_equal(i, j) for j in items[:n])],
    "toJson": go_json,
    "toRawJson": go_json,
    "fromJson": json.loads,
    "b64enc": lambda s: base64.b64encode(str(s).encode()).decode(),
    "b64dec": lambda s: base64.b64decode(str(s)).decode(),
    "sha256sum": lambda s: hashlib.sha256(str(s).encode()).hexdigest(),
    "sha1sum": lambda s: hashlib.sha1(str(s).encode()).hexdigest(),
    "regexMatch": lambda pattern, s: re.search(pattern, str(s)) is not None,
    "regexFind": lambda pattern, s: m.group() if (m := re.search(pattern, str(s))) else "",
    "regexReplaceAll": lambda pattern, s, repl: re.sub(pattern, repl.replace("$", "\\"), str(s)),
    "indent": lambda spaces, s: "\n".join(" " * spaces + line for line in str(s).split("\n")),
    "abbrev": lambda width, s: str(s) if len(str(s)) <= width else str(s)[: max(width - 3, 0)] + "...",
}


BUILTINS: dict[str, Callable[..., Any]] = {
    # expr-lang's builtins
    "len": _length,
    "abs": lambda n: abs(n),
    "ceil": lambda n: float(math.ceil(to_float(n))),
    "floor": lambda n: float(math.floor(to_float(n))),
    "round": _round,
    "int": to_int,
    "float": to_float,
    "string": go_string,
    "trim": lambda s, chars=None: s.strip(chars),
    "trimPrefix": lambda s, prefix=" ": s.removeprefix(prefix),
    "trimSuffix": lambda s, suffix=" ": s.removesuffix(suffix),
    "upper": lambda s: s.upper(),
    "lower": lambda s: s.lower(),
    "split": lambda s, sep, n=-1: s.split(sep, n - 1) if n > 0 else s.split(sep),
    "replace": lambda s, old, new: s.replace(old, new),
    "repeat": lambda s, n: s * n,
    "indexOf": lambda s, sub: s.find(sub),
    "lastIndexOf": lambda s, sub: s.rfind(sub),
    "hasPrefix": lambda s, prefix: s.startswith(prefix),
    "hasSuffix": lambda s, suffix: s.endswith(suffix),
    "max": lambda *items: max(items[0] if len(items) == 1 and isinstance(items[0], list) else items),
    "min": lambda *items: min(items[0] if len(items) == 1 and isinstance(items[0], list) else items),
    "sum": lambda items: sum(items),
    "first": _first,
    "last": _last,
    "get": _get,
    "keys": lambda m: sorted(m.keys()),
    "values": lambda m: [m[k] for k in sorted(m.keys())],
    "join": lambda items, sep="": sep.join(items),
    "reverse": lambda items: list(reversed(items)),
    "sort": lambda items: sorted(items),
    "uniq": SPRIG["uniq"],
    "concat": lambda *lists: [item for items in lists for item in items],
    "flatten": lambda items: [x for item in items for x in (item if isinstance(item, list) else [item])],
    "toJSON": lambda value: json.dumps(value, indent=2, sort_keys=True),
    "fromJSON": json.loads,
    "toBase64": SPRIG["b64enc"],
    "fromBase64": SPRIG["b64dec"],
    "type": lambda value: {
        bool: "bool",
        int: "int",
        float: "float",
        str: "string",
        list: "array",
        dict: "map",
        type(None): "nil",
    }.get(type(value), "unknown"),
    # Argo's additions (util/expr/env)
    "asInt": to_int,
    "asFloat": to_float,
    "jsonpath": jsonpath,
    "toJson": go_json,
    "sprig": SPRIG,  # type: ignore[dict-item]  # a namespace: sprig.trim(x)
}

# Builtins whose second argument is a closure over `#`, e.g. filter(items, {# > 1}).
PREDICATES: dict[str, Callable[[list, Callable[[Any], Any]], Any]] = {
    "all": lambda items, test: all(test(item) for item in items),
    "any": lambda items, test: any(test(item) for item in items),
    "none": lambda items, test: not any(test(item) for item in items),
    "one": lambda items, test: sum(1 for item in items if test(item)) == 1,
    "filter": lambda items, test: [item for item in items if test(item)],
    "map": lambda items, test: [test(item) for item in items],
    "count": lambda items, test: sum(1 for item in items if test(item)),
    "find": _find,
    "findIndex": _find_index,
}
