"""Argo's JSON schema (../shared/argo/schema.json), made strict for tests of rendered manifests.

The published schema has two quirks (see ../shared/argo/README.md): IntOrString is typed as a string only,
and no object forbids unknown properties. Here IntOrString also takes integers, and every object definition
with declared properties forbids the others, so a typo such as `limt:` fails validation.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

SCHEMA_PATH = Path(__file__).resolve().parents[1].parent / "shared" / "argo" / "schema.json"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
PREFIX = "io.argoproj.workflow.v1alpha1."


@cache
def strict_schema() -> dict[str, Any]:
    schema = copy.deepcopy(json.loads(SCHEMA_PATH.read_text()))
    definitions = schema["definitions"]
    for definition in definitions.values():
        if definition.get("type") == "object" and "properties" in definition:
            definition.setdefault("additionalProperties", False)
    definitions[INT_OR_STRING] = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    return schema


@cache
def validator(kind: str) -> Draft202012Validator:
    """A validator for one Argo kind (Workflow, WorkflowTemplate, CronWorkflow)."""
    schema = strict_schema()
    root = {"$schema": schema["$schema"], "definitions": schema["definitions"], "$ref": f"#/definitions/{PREFIX}{kind}"}
    return Draft202012Validator(root)


def errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation of a manifest, as 'path: message'."""
    found = validator(manifest["kind"]).iter_errors(manifest)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}" for e in found]
