"""Every image's pinned Python set resolves: pip's own resolver in dry run (`pip install --dry-run
--ignore-installed --report`), over the set each Dockerfile installs, with the versions of
images/versions.env. Needs the package registry (metadata only, PEP 658); without one it skips, saying so.

    trainer   torch==TORCH_VERSION, then moerl's requirements but torch, under constraints.txt (NCCL and
              DeepEP go in with --no-deps afterwards, moerl itself too)
    cpu       torch==TORCH_VERSION and moerl's requirements under constraints.txt
    rollout   the image's own packages are what sglang==SGLANG_VERSION resolves to (SGLang's release image
              installs exactly sglang and its closure); merge_constraints.py then pins them, so our pins hold
              only for the packages outside that closure; moerl's requirements but torch must resolve
              together with it. sglang pins torch exactly (0.5.17: torch==2.11.0) while moerl asks
              torch>=2.12, which is why the rollout image installs moerl without its torch requirement.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "images"))
import merge_constraints  # noqa: E402
import pyproject_deps  # noqa: E402

pytestmark = pytest.mark.registry
TIMEOUT_S = 900


def versions() -> dict[str, str]:
    lines = (REPO / "images" / "versions.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def moerl_requirements(exclude: set[str]) -> list[str]:
    return pyproject_deps.dependencies(REPO / "pyproject.toml", exclude)


def dry_run(tmp_path: Path, name: str, requirements: list[str], constraints: list[str]) -> dict[str, str]:
    """pip's resolution of `requirements` under `constraints`: {canonical name: version}; fails the test with
    pip's own explanation when there is none."""
    req, con, report = tmp_path / f"{name}.req", tmp_path / f"{name}.con", tmp_path / f"{name}.json"
    req.write_text("\n".join(requirements) + "\n")
    con.write_text("\n".join(constraints) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
         str(report), "-c", str(con), "-r", str(req)],
        capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    explanation = "\n".join(line for line in done.stderr.splitlines() if "Location" not in line)
    assert done.returncode == 0, f"{name}: pip cannot resolve the image's set:\n{explanation[-4000:]}"
    installs = json.loads(report.read_text())["install"]
    return {merge_constraints.canonical_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


@cache
def registry_problem() -> str | None:
    """Why the registry cannot be asked (None when it can): one metadata lookup of a package only it has."""
    probe = f"sglang=={versions()['SGLANG_VERSION']}"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet",
             probe], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"the package registry did not answer for {probe} within 120 s"
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip() and "Location" not in line][-1:]
        return f"the package registry is unreachable ({probe}: {' '.join(tail)})"
    return None


@pytest.fixture
def registry() -> None:
    problem = registry_problem()
    if problem is not None:
        pytest.skip(f"{problem}; the image requirement sets are resolved where a registry is reachable (CI)")


def our_pins() -> list[str]:
    return [line.strip() for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line]


@pytest.mark.parametrize("image", ["trainer", "cpu"])
def test_the_torch_images_resolve(tmp_path, registry, image):
    torch = f"torch=={versions()['TORCH_VERSION']}"
    exclude = {"torch"} if image == "trainer" else set()
    resolved = dry_run(tmp_path, image, [torch, *moerl_requirements(exclude)], our_pins())
    assert resolved["torch"] == versions()["TORCH_VERSION"]


def test_the_rollout_image_resolves_with_sglangs_own_torch(tmp_path, registry):
    sglang = f"sglang=={versions()['SGLANG_VERSION']}"
    image = dry_run(tmp_path, "sglang", [sglang], [])  # what the SGLang release image holds
    pins = merge_constraints.read_pins(our_pins())
    outside = [f"{name}=={version}" for key, (name, version) in sorted(pins.items()) if key not in image]
    resolved = dry_run(tmp_path, "rollout", [sglang, *moerl_requirements({"torch"})], outside)
    assert resolved["torch"] == image["torch"]  # SGLang's torch, never moved by moerl
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_requirement = next(r for r in declared if pyproject_deps.requirement_name(r) == "torch")
    minimum = re.search(r">=\s*([\d.]+)", torch_requirement)
    if minimum and tuple(map(int, image["torch"].split(".")[:2])) < tuple(map(int, minimum[1].split(".")[:2])):
        # the reason for the split install: with moerl's torch requirement the set has no resolution
        text = (REPO / "images" / "rollout" / "Dockerfile").read_text()
        assert "pyproject_deps.py pyproject.toml --exclude torch" in text
        assert "pip install --no-deps -c merged-constraints.txt wheels/moerl-*.whl" in text
