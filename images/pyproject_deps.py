"""Print moerl's runtime requirements from pyproject.toml, one per line, leaving out the named packages.

The trainer image installs torch from the PyTorch index first, then moerl's other requirements, then
replaces torch's NCCL; moerl's code comes last with --no-deps. Resolving torch again in the middle step
would make pip put torch's exact NCCL pin back, so torch is left out of it:

    python3 pyproject_deps.py pyproject.toml --exclude torch > requirements.txt
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirement_name(requirement: str) -> str:
    """The distribution name of a PEP 508 requirement, normalised (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def dependencies(pyproject: Path, exclude: set[str]) -> list[str]:
    declared = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    excluded = {requirement_name(name) for name in exclude}
    return [r for r in declared if requirement_name(r) not in excluded]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    sys.stdout.write("".join(f"{r}\n" for r in dependencies(args.pyproject, set(args.exclude))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
