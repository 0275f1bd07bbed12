"""The run-config loader under fuzzing: whatever the YAML file holds, load_config returns a RunConfig or raises
one MoerlError that names the file, never another exception.

Four generators: arbitrary text; arbitrary bytes; arbitrary YAML-able structures; and a valid config with
fields set to arbitrary values at real field paths (so validation gets past the first unknown field and into
the checks that span fields). The regressions they found are pinned at the end."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pipelines.config import apply_overrides, load_config
from steps.errors import MoerlError
from steps.run.config import RunConfig

BASE = {"sft_checkpoint": "runs/sft", "run_store": "runs/r"}
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted field path of the config model (and of the models in its dict values)."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.append(path)
        for candidate in (field.annotation, *typing.get_args(field.annotation)):
            args = typing.get_args(candidate)
            inner = args[-1] if typing.get_origin(candidate) is dict and args else candidate
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                key = "rollout." if typing.get_origin(candidate) is dict else ""
                paths += field_paths(inner, f"{path}.{key}")
    return paths


PATHS = field_paths(RunConfig)

scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=24)
    | st.sampled_from(["{{x}}", "s3://b/p", "file:///x", "http://x", "0 */6 * * *", "64Gi", "1h", "addition",
                      "runs/a\x00b", "~nobody/x", "x" * 5000])
)  # fmt: skip
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


def loads_or_one_error(path: Path) -> RunConfig | None:
    try:
        cfg = load_config(path)
    except MoerlError as err:
        assert str(path) in str(err), str(err)  # a message that names the file
        return None
    assert isinstance(cfg, RunConfig)
    return cfg


@pytest.fixture
def config_file(tmp_path):
    return tmp_path / "run.yaml"


@given(st.text(max_size=300))
@SETTINGS
def test_any_text(config_file, text):
    config_file.write_bytes(text.encode("utf-8", errors="surrogatepass"))  # lone surrogates: not UTF-8
    loads_or_one_error(config_file)


@given(st.binary(max_size=200))
@SETTINGS
def test_any_bytes(config_file, data):
    config_file.write_bytes(data)
    loads_or_one_error(config_file)


@given(values)
@SETTINGS
def test_any_structure(config_file, data):
    config_file.write_text(yaml.safe_dump(data))
    loads_or_one_error(config_file)


@given(st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=4))
@SETTINGS
def test_a_valid_config_with_fields_set_to_anything(config_file, changes):
    try:
        data = apply_overrides(BASE, dict(changes))
    except MoerlError:
        return  # a field under a scalar: apply_overrides itself says so
    config_file.write_text(yaml.safe_dump(data))
    cfg = loads_or_one_error(config_file)
    if cfg is not None:  # accepted: then it is a config the rest of moerl can use as is
        assert RunConfig.model_validate(cfg.model_dump(mode="json")) == cfg
        assert all(math.isfinite(v) for v in (cfg.trainer.lr, cfg.sampling.temperature))


def test_the_paths_cover_the_nested_sections():
    assert {"rollout.sglang.ep_size", "trainer.betas", "argo.semaphore.key", "placement.rollout.spot"} <= set(PATHS)


# Regressions found by the fuzzers above.


def test_a_config_file_that_is_not_utf8(config_file):
    config_file.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(MoerlError, match="run.yaml: .*UTF-8"):
        load_config(config_file)


@pytest.mark.parametrize("key", ["[", "a[0]", "int"])
def test_an_unknown_key_that_looks_like_a_pydantic_tag(config_file, key):
    config_file.write_text(yaml.safe_dump({**BASE, key: 1}))
    with pytest.raises(MoerlError, match=f"{re.escape(key)}: unknown field"):
        load_config(config_file)


def test_a_store_path_with_a_nul_character(config_file):
    config_file.write_text(yaml.safe_dump({**BASE, "run_store": "runs/a\x00b"}))
    with pytest.raises(MoerlError, match="run_store: "):
        load_config(config_file)


def test_a_store_path_with_a_nul_character_names_the_config_file(config_file):
    config_file.write_text(yaml.safe_dump({**BASE, "run_store": "runs/a\x00b"}))
    # The same format as every other config error: '<file>: 1 problem in the run config:', then one line each.
    expected = rf"^{re.escape(str(config_file))}: 1 problem in the run config:\n  run_store: .* holds a NUL character"
    with pytest.raises(MoerlError, match=expected):
        load_config(config_file)
