"""Where the tests find Argo's own files (its JSON schema and example workflows), which the project does not
ship: `$MOERL_ARGO_REFERENCE`, by default `../shared/argo` beside the clone. The folder holds, from
argoproj/argo-workflows at the tag the manifests target (v4.1.2): `schema.json` (api/jsonschema/schema.json),
`examples/` (a selection of examples/*.yaml) and a README.md naming the tag. A test that compares with them
skips, saying so, where the folder is absent; nothing else in the suite reads it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ARGO_REFERENCE_ENV = "MOERL_ARGO_REFERENCE"
DEFAULT_ARGO_REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "argo"


def argo_reference() -> Path:
    """The folder of Argo's reference files, present or not."""
    return Path(os.environ.get(ARGO_REFERENCE_ENV) or DEFAULT_ARGO_REFERENCE)


def reference_path(relative: str) -> Path:
    """A file or folder of Argo's reference files; the calling test skips, naming where to put it, without it."""
    path = argo_reference() / relative
    if not path.exists():
        pytest.skip(
            f"Argo's reference file {path} is absent: set {ARGO_REFERENCE_ENV} to a folder holding Argo v4.1.2's "
            "api/jsonschema/schema.json as schema.json and its examples/ (see tests/argo_reference.py)"
        )
    return path
