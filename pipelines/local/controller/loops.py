"""withItems, withParam and withSequence: one step or task becomes one per item, named as Argo
names them (`print(0:hello world)`, `sleep(3:23)`, `user(1:age:30,name:bob)`), with `{{item}}` and
`{{item.KEY}}` substituted in each copy.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from pipelines.local.lang.expressions import evaluate_when, substitute
from pipelines.local.lang.functions import go_json


class ExpandError(Exception):
    pass


LOOP_FIELDS = ("withItems", "withParam", "withSequence")


def loops(step: dict) -> bool:
    return bool(step.get("withItems")) or bool(step.get("withParam")) or step.get("withSequence") is not None


def item_text(item: Any) -> str:
    """How an item reads when substituted: strings as they are, anything else as JSON."""
    return item if isinstance(item, str) else go_json(item)


def item_label(item: Any) -> str:
    """The `desc` part of a loop node's name, `name(index:desc)` (fmt's %v of the item)."""
    if isinstance(item, dict):
        return ",".join(sorted(f"{k}:{item_text(v)}" for k, v in item.items()))
    if isinstance(item, list):
        return "[" + " ".join(item_text(v) for v in item) + "]"
    return item_text(item)


def node_name(name: str, index: int, item: Any) -> str:
    return f"{name}({index}:{item_label(item).replace('(', '').replace(')', '')})"


def sequence(spec: dict) -> list[str]:
    def number(key: str) -> int:
        try:
            return int(str(spec[key]).strip())
        except ValueError as err:
            raise ExpandError(f'withSequence.{key}: strconv.Atoi: parsing "{spec[key]}": invalid syntax') from err

    start = number("start") if spec.get("start") is not None else 0
    if spec.get("end") is not None:
        end = number("end")
    elif spec.get("count") is not None:
        count = number("count")
        if count == 0:
            return []
        end = start + count - 1
    else:
        raise ExpandError("neither end nor count was specified in withSequence")
    fmt = re.sub(r"%(-?\d*)v", r"%\1d", str(spec.get("format") or "%d"))
    step = 1 if start <= end else -1
    return [fmt % i for i in range(start, end + step, step)]


def items_of(step: dict) -> list[Any]:
    if step.get("withItems"):
        return list(step["withItems"])
    if step.get("withParam"):
        text = step["withParam"]
        try:
            items = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as err:
            raise ExpandError(
                f"withParam value could not be parsed as a JSON list: {str(text).strip()}: {err}"
            ) from err
        if not isinstance(items, list):
            raise ExpandError(f"withParam value could not be parsed as a JSON list: {str(text).strip()}")
        return items
    return sequence(step["withSequence"])


def expand(step: dict) -> list[dict]:
    """The copies of a looping step (already substituted with everything but the item). A pure function of
    the step, which every pass expands again (as Argo's expandStepGroup does on each reconciliation): the
    copies of the last steps expanded are kept, so that a pass over a loop of thousands of items does not
    substitute each of them again. The copies are read, never changed, by the walkers."""
    try:
        key = json.dumps(step, sort_keys=True, default=str)
    except (TypeError, ValueError):  # a key that is not text: expanded, not kept
        return _expand(step)
    cached = _EXPANDED.pop(key, None)
    if cached is None:
        cached = _expand(step)
    _EXPANDED[key] = cached  # the newest last
    while len(_EXPANDED) > EXPANDED_KEPT:
        del _EXPANDED[next(iter(_EXPANDED))]
    return list(cached)


EXPANDED_KEPT = 64  # distinct looping steps whose copies are kept (least recently expanded dropped first)
_EXPANDED: dict[str, list[dict]] = {}


def _expand(step: dict) -> list[dict]:
    try:
        items = items_of(step)
    except ExpandError:
        if _may_run(step.get("when", "")):
            raise
        return []
    template = {k: v for k, v in step.items() if k not in LOOP_FIELDS}
    expanded = []
    for index, item in enumerate(items):
        if not isinstance(item, str | int | float | bool | dict | list):
            raise ExpandError(f"withItems[{index}] expected string, number, list, or map. received: {item}")
        scope = {"item": item_text(item)}
        if isinstance(item, dict):
            scope.update({f"item.{k}": item_text(v) for k, v in item.items()})
        copy_ = substitute(copy.deepcopy(template), scope, strict=("item",))
        copy_["name"] = node_name(step["name"], index, item)
        if "template" in step:  # the template name is never substituted
            copy_["template"] = step["template"]
        expanded.append(copy_)
    return expanded


def _may_run(when: str) -> bool:
    try:
        return evaluate_when(when)
    except Exception:  # noqa: BLE001 - an unparsable condition may still run the step
        return True
