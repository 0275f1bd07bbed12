"""Loading a run config: the YAML file, `--set` overrides and relative paths; the schema is steps/run/config.py.

`load_config(path)` reads the YAML, applies overrides, resolves relative store paths against the current
directory and validates the result (steps.run.config.validate_config), returning a `RunConfig`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from steps.errors import MoerlError
from steps.run.config import RunConfig, validate_config


def resolve_paths(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative paths in the URI fields become absolute file:// URIs: pods and workers have another cwd."""
    out = dict(data)
    for key in ("sft_checkpoint", "run_store", "prompt_file", "heldout_file"):
        value = out.get(key)
        # A NUL cannot be in a path (resolve() would raise): left as is for semantic_problems to report.
        if isinstance(value, str) and value.strip() and "://" not in value and "\x00" not in value:
            out[key] = (base / value).resolve().as_uri()
    return out


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """--set FIELD=VALUE flags as {dotted field: YAML value}, for load_config's `overrides`."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise MoerlError(f"--set {pair!r}: write FIELD=VALUE, e.g. --set rollout.num_shards=3")
        out[key] = yaml.safe_load(value)
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys ({"rollout.num_shards": 3}) in a parsed config, creating sections as needed."""
    out = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise MoerlError(f"override {dotted}: {part} is not a section of the run config")
        node[leaf] = value
    return out


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Read, resolve and validate a run config YAML; relative store paths resolve against the current dir.

    `overrides` sets dotted fields after reading, e.g. {"run_store": "file:///tmp/x", "iterations": 3}.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise MoerlError(f"{path}: cannot read the run config ({err.strerror}); check the path") from None
    except UnicodeDecodeError as err:
        raise MoerlError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise MoerlError(f"{path}: not valid YAML ({err}); fix the syntax at the line shown") from None
    if data is None:
        data = {}
    if isinstance(data, dict) and overrides:
        data = apply_overrides(data, overrides)
    if isinstance(data, dict):
        data = resolve_paths(data, Path.cwd())
    return validate_config(data, str(path))
