"""Constraints for installing moerl into an image that already has its own Python packages.

The rollout image starts from SGLang's release image, whose torch, transformers, numpy, ... are the versions
SGLang was built and tested with. Installing moerl with the repository's constraints.txt as it is would
move those packages to our pins and could break SGLang. This script prints a constraints file in which
every package already installed in the running interpreter is pinned to its installed version, and every
other package keeps the repository's pin. pip then installs only what is missing, at our versions, and
fails loudly (ResolutionImpossible, naming both sides) if moerl cannot live with a package SGLang pins.

    python3 merge_constraints.py constraints.txt > merged-constraints.txt
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: `Typing_Extensions` and `typing-extensions` are the same package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(lines: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Map canonical name -> (name as written, version) for every `name==version` line."""
    pins: dict[str, tuple[str, str]] = {}
    for line in lines:
        match = _PIN.match(line)
        if match:
            name, version = match.groups()
            pins[canonical_name(name)] = (name, version)
    return pins


def installed_versions() -> dict[str, tuple[str, str]]:
    """Every distribution the running interpreter sees, as canonical name -> (name, version)."""
    found: dict[str, tuple[str, str]] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonical_name(name), (name, dist.version))
    return found


def merge(ours: Mapping[str, tuple[str, str]], installed: Mapping[str, tuple[str, str]]) -> list[str]:
    """Installed versions win; our pins fill in the rest. Sorted by canonical name, one `name==v` a line."""
    merged = dict(ours)
    merged.update(installed)
    return [f"{merged[key][0]}=={merged[key][1]}" for key in sorted(merged)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("constraints", type=Path, help="the repository's constraints.txt")
    args = parser.parse_args(argv)
    ours = read_pins(args.constraints.read_text().splitlines())
    sys.stdout.write("\n".join(merge(ours, installed_versions())) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
