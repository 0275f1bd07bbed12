"""The repository stands alone: a user's clone has no `../shared` beside it, so no file may read or point to it,
except the one place that finds Argo's reference files for the tests that compare with them
(tests/argo_reference.py, which skips those tests without them) and .ci/run, which runs the suite without
it. .ci/run also runs the whole suite on a copy with nothing beside it; this test catches a new reference
on any `make test`."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALLOWED = {"tests/argo_reference.py", ".ci/run", "tests/test_stands_alone.py"}
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build"}
# `../shared`, a path built with a "shared" component, or the design notes that live there
OUTSIDE = re.compile(r"\.\./shared\b|/\s*[\"']shared[\"']|[\"']shared[\"']\s*/|\b(DESIGN|LAYOUT)\.md\b|families-2026")


def repository_files() -> list[Path]:
    files = []
    for directory, subdirectories, names in os.walk(REPO):
        # pruned in place, so that os.walk never descends into .venv or .git
        subdirectories[:] = [d for d in subdirectories if d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        files += [Path(directory) / name for name in names]
    return files


def test_no_file_reads_or_points_outside_the_repository():
    found = []
    for path in repository_files():
        relative = path.relative_to(REPO).as_posix()
        if relative in ALLOWED:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary (a plot, a wheel)
        lines = enumerate(text.splitlines(), 1)
        found += [f"{relative}:{n}: {line.strip()}" for n, line in lines if OUTSIDE.search(line)]
    assert not found, "references outside the repository:\n" + "\n".join(found)
