"""Check that moerl's requirements accept the packages SGLang's release image already has (issue 32, item 10).

The rollout image installs moerl into lmsysorg/sglang:v$SGLANG_VERSION-cu130 with every package the image has
pinned to its installed version (merge_constraints.py). tests/test_image_requirements.py resolves what pip
would install for sglang==SGLANG_VERSION from the registry; the image itself may hold other versions (its own
pins, packages added beside sglang). This reads the image's own `pip list --format=freeze` and checks, where
a container engine runs:

  1. direct: each of moerl's requirements (pyproject.toml, torch left out as the Dockerfile does) whose
     package the image has accepts the image's version (e.g. fsspec);
  2. resolution: inside the image, the Dockerfile's own install as `pip install --dry-run` under the merged
     constraints: pip resolves moerl's whole closure (protobuf through kfp, ...) against the image's pins and
     names both sides when they clash;
  3. with --built IMAGE instead (the rollout image make images built): `pip check` inside it.

    python3 images/check_pins.py                      # 1-2 on the base image of images/versions.env
    python3 images/check_pins.py --built REGISTRY/moerl-rollout:TAG     # 3

images/build.sh runs 1-2 before building the rollout image (CHECK_PINS=0 skips it) and 3 after a PUSH=0
build. Exit 0: accepted; 1: a conflict (printed); 2: no container engine (the reason printed).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import merge_constraints  # noqa: E402
import pyproject_deps  # noqa: E402

try:
    from packaging.requirements import Requirement
    from packaging.version import InvalidVersion, Version
except ImportError:  # a host without packaging: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

# The commands the rollout Dockerfile runs to install moerl's requirements, as a dry run (no wheel of moerl:
# it goes in with --no-deps after them). The repository is mounted read-only at /moerl.
IN_IMAGE_DRY_RUN = (
    "cd /tmp && python3 /moerl/images/merge_constraints.py /moerl/constraints.txt > merged-constraints.txt"
    " && python3 /moerl/images/pyproject_deps.py /moerl/pyproject.toml --exclude torch > requirements.txt"
    " && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --dry-run --disable-pip-version-check"
    " -c merged-constraints.txt -r requirements.txt"
)


def versions(path: Path = HERE / "versions.env") -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def base_image(env: dict[str, str]) -> str:
    """The rollout image's base, as images/rollout/Dockerfile names it."""
    return f"lmsysorg/sglang:v{env['SGLANG_VERSION']}-cu130"


def read_freeze(text: str) -> dict[str, tuple[str, str]]:
    """`pip list --format=freeze` (or `pip freeze`) output: canonical name -> (name, version); lines without
    a version (`name @ url`, `-e ...`) are left out."""
    return merge_constraints.read_pins(text.splitlines())


def direct_conflicts(installed: dict[str, tuple[str, str]], requirements: list[str]) -> list[str]:
    """Each requirement the image's version of its package does not satisfy, as a sentence naming both."""
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        found = installed.get(merge_constraints.canonical_name(requirement.name))
        if found is None or not requirement.specifier:
            continue
        try:
            accepted = requirement.specifier.contains(Version(found[1]), prereleases=True)
        except InvalidVersion:
            accepted = False
        if not accepted:
            problems.append(
                f"{found[0]}: moerl requires {text!r} (pyproject.toml), the image has {found[0]}=={found[1]}"
            )
    return problems


def engine_problem() -> str | None:
    """Why no container engine can be used here, or None when `docker info` reaches one."""
    if shutil.which("docker") is None:
        return "no 'docker' command on this machine"
    done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return "'docker info' cannot reach a Docker engine: " + " ".join(done.stderr.split())[:300]
    return None


def docker_run(image: str, command: str, mount_repo: bool = False, timeout: int = 1800) -> subprocess.CompletedProcess:
    mount = ["--volume", f"{REPO}:/moerl:ro"] if mount_repo else []
    return subprocess.run(
        ["docker", "run", "--rm", *mount, "--entrypoint", "bash", image, "-c", command],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def check_base(image: str) -> list[str]:
    """Steps 1 and 2 against `image`; the problems found (empty: accepted)."""
    freeze = docker_run(image, "python3 -m pip list --format=freeze --disable-pip-version-check")
    if freeze.returncode != 0:
        return [f"{image}: pip list failed:\n{freeze.stderr[-2000:]}"]
    requirements = pyproject_deps.dependencies(REPO / "pyproject.toml", {"torch"})
    problems = direct_conflicts(read_freeze(freeze.stdout), requirements)
    resolved = docker_run(image, IN_IMAGE_DRY_RUN, mount_repo=True)
    if resolved.returncode != 0:
        problems.append(f"{image}: pip cannot install moerl's requirements beside the image's packages:\n"
                        f"{resolved.stderr[-4000:]}")  # fmt: skip
    return problems


def check_built(image: str) -> list[str]:
    """Step 3: `pip check` inside the built rollout image."""
    done = docker_run(image, "python3 -m pip check --disable-pip-version-check")
    return [] if done.returncode == 0 else [f"{image}: pip check:\n{(done.stdout + done.stderr)[-4000:]}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", help="the base image (default: images/versions.env's SGLang release image)")
    parser.add_argument("--built", metavar="IMAGE", help="instead, run `pip check` in this built rollout image")
    args = parser.parse_args(argv)
    problem = engine_problem()
    if problem:
        print(f"check_pins: {problem}; run it where a Docker engine runs (docs/eks.md, section 9)", file=sys.stderr)
        return 2
    image = args.built or args.image or base_image(versions())
    problems = check_built(image) if args.built else check_base(image)
    for line in problems:
        print(f"check_pins: {line}", file=sys.stderr)
    if not problems:
        print(f"check_pins: {image}: " + ("pip check passes" if args.built else "accepts moerl's requirements"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
