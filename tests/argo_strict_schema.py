"""Argo's types as a strict JSON schema, for tests of rendered manifests, on a bare clone.

The source is the one the project installs: Hera's models (hera.workflows.models), which Hera generates from
Argo's OpenAPI spec (hera 7.1: Argo v4.0.5, whose Workflow types are v4.1.2's less the fields v4.1 added, so a
manifest valid here is valid on v4.1.2). Each definition is named as Argo's schema names it
(`io.argoproj.workflow.v1alpha1.Workflow`). Made strict where Argo's published schema is lax: every object with
declared properties forbids the others (a typo such as `limt:` fails), and `null` is not a value of any field
(pydantic would accept one for every optional field; Argo's decoder drops it, so it hides a mistake).

`official_validator` is Argo's own schema.json, made strict the same way (IntOrString also taking integers, as
Kubernetes decodes it), from the reference folder (tests/argo_reference.py); tests that use it skip without it.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import pkgutil
from functools import cache
from typing import Any

from argo_reference import reference_path
from jsonschema import Draft202012Validator
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

HERA_MODELS = "hera.workflows.models"
ARGO = "io.argoproj.workflow.v1alpha1."
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"


def _model_classes() -> list[type[BaseModel]]:
    package = importlib.import_module(HERA_MODELS)
    classes = []
    for info in pkgutil.walk_packages(package.__path__, HERA_MODELS + "."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__ == module.__name__:
                classes.append(obj)
    return classes


def _without_null(node: Any) -> Any:
    """The schema with `{"type": "null"}` dropped from every anyOf (and a one-branch anyOf unwrapped)."""
    if isinstance(node, list):
        return [_without_null(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _without_null(v) for k, v in node.items()}
    if "anyOf" in node:
        branches = [b for b in node["anyOf"] if b != {"type": "null"}]
        if len(branches) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            return {**rest, **branches[0]}
        node["anyOf"] = branches
    if node.get("default", 0) is None:
        del node["default"]
    return node


def _forbid_unknown_properties(definitions: dict[str, Any]) -> None:
    for definition in definitions.values():
        if definition.get("type") == "object" and "properties" in definition:
            definition.setdefault("additionalProperties", False)


@cache
def strict_schema() -> dict[str, Any]:
    """{"definitions": {Argo's definition name: JSON schema}} from Hera's models, strict."""
    classes = _model_classes()
    keys, generated = models_json_schema(
        [(c, "validation") for c in classes], by_alias=True, ref_template="#/definitions/{model}"
    )
    pydantic_names = {c: keys[(c, "validation")]["$ref"].rsplit("/", 1)[1] for c in classes}
    argo_names = {pydantic_names[c]: c.__module__.removeprefix(HERA_MODELS + ".") + "." + c.__name__ for c in classes}
    text = json.dumps(_without_null(generated["$defs"]))
    for pydantic_name, argo_name in argo_names.items():  # rename every reference, then every definition
        text = text.replace(f'"#/definitions/{pydantic_name}"', f'"#/definitions/{argo_name}"')
    definitions = {argo_names.get(name, name): d for name, d in json.loads(text).items()}  # enums keep theirs
    _forbid_unknown_properties(definitions)
    return {"definitions": definitions}


def _validator(schema: dict[str, Any], definition: str) -> Draft202012Validator:
    if "." not in definition:
        definition = ARGO + definition
    if definition not in schema["definitions"]:
        raise KeyError(f"no definition {definition} in Argo's types")
    return Draft202012Validator({"definitions": schema["definitions"], "$ref": f"#/definitions/{definition}"})


@cache
def validator(definition: str) -> Draft202012Validator:
    """A strict validator for one of Argo's types: a kind (`Workflow`) or a full definition name."""
    return _validator(strict_schema(), definition)


@cache
def _official_schema() -> dict[str, Any]:
    schema = copy.deepcopy(json.loads(reference_path("schema.json").read_text()))
    _forbid_unknown_properties(schema["definitions"])
    schema["definitions"][INT_OR_STRING] = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    return schema


def official_validator(definition: str) -> Draft202012Validator:
    """Argo's own schema.json (v4.1.2), strict; the calling test skips where the reference folder is absent."""
    return _validator(_official_schema(), definition)


def errors(manifest: dict[str, Any], definition: str | None = None) -> list[str]:
    """Every violation of Argo's types (Hera's, strict) in a manifest, as 'path: message'."""
    found = validator(definition or manifest["kind"]).iter_errors(manifest)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}" for e in found]
