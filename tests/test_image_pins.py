"""Issue 32, item 10: images/check_pins.py checks moerl's requirements against the packages SGLang's release
image holds itself (its own `pip list`), not only against what the registry resolves sglang to. The logic runs
here on fake freezes; the check against the real image needs a Docker engine and skips, saying why, without."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "images"))
import check_pins  # noqa: E402
import pyproject_deps  # noqa: E402

FREEZE = """\
fsspec==2023.1.0
protobuf==6.31.1
sglang==0.5.17
torch==2.11.0
some-local-tool @ file:///tmp/some_local_tool-1.0-py3-none-any.whl
"""


def test_a_freeze_reads_as_pins_and_skips_unversioned_lines():
    pins = check_pins.read_freeze(FREEZE)
    assert pins["fsspec"] == ("fsspec", "2023.1.0")
    assert "some-local-tool" not in pins


def test_a_requirement_the_images_version_does_not_meet_is_named_with_both_sides():
    installed = check_pins.read_freeze(FREEZE)
    problems = check_pins.direct_conflicts(
        installed, ["fsspec>=2024.6", "protobuf<6", "pyarrow>=17", "sglang", "Torch>=2.12; python_version < '3'"]
    )
    assert problems == [
        "fsspec: moerl requires 'fsspec>=2024.6' (pyproject.toml), the image has fsspec==2023.1.0",
        "protobuf: moerl requires 'protobuf<6' (pyproject.toml), the image has protobuf==6.31.1",
    ]  # pyarrow: not in the image (pip installs it at our pin); a marker that does not apply is skipped


def test_moerls_own_requirements_are_checked_without_torch():
    """The rollout image runs on SGLang's torch: torch is left out, as the Dockerfile leaves it out."""
    requirements = pyproject_deps.dependencies(REPO / "pyproject.toml", {"torch"})
    assert requirements and not any(pyproject_deps.requirement_name(r) == "torch" for r in requirements)
    # The image's torch 2.11 against moerl's torch>=2.12 would be a conflict if torch were not left out.
    assert check_pins.direct_conflicts(check_pins.read_freeze("torch==2.11.0\n"), requirements) == []


def test_the_dry_run_in_the_image_is_the_dockerfiles_install():
    dockerfile = (REPO / "images" / "rollout" / "Dockerfile").read_text()
    for command in (
        "merge_constraints.py constraints.txt > merged-constraints.txt",
        "pyproject_deps.py pyproject.toml --exclude torch > requirements.txt",
        "-m pip install -c merged-constraints.txt -r requirements.txt",
    ):
        assert command in dockerfile
    run = check_pins.IN_IMAGE_DRY_RUN
    assert "/moerl/images/merge_constraints.py /moerl/constraints.txt > merged-constraints.txt" in run
    assert "/moerl/images/pyproject_deps.py /moerl/pyproject.toml --exclude torch > requirements.txt" in run
    assert "pip install --dry-run" in run and "-c merged-constraints.txt -r requirements.txt" in run
    assert check_pins.base_image(check_pins.versions()) in dockerfile.replace(
        "v${SGLANG_VERSION}", "v" + check_pins.versions()["SGLANG_VERSION"]
    )


def test_build_sh_runs_the_check_before_the_rollout_image():
    script = (REPO / "images" / "build.sh").read_text()
    assert 'python3 "${repo_root}/images/check_pins.py"' in script
    assert "--built" in script and "CHECK_PINS" in script


def test_without_an_engine_the_script_says_so(monkeypatch, capsys):
    monkeypatch.setattr(check_pins, "engine_problem", lambda: "no 'docker' command on this machine")
    assert check_pins.main([]) == 2
    assert "no 'docker' command" in capsys.readouterr().err


def test_the_sglang_image_accepts_moerls_requirements():
    """Pulls lmsysorg/sglang (tens of GB) and resolves in it: only where a Docker engine runs."""
    problem = check_pins.engine_problem()
    if problem:
        pytest.skip(f"needs a Docker engine: {problem}")
    done = subprocess.run(
        [sys.executable, str(REPO / "images" / "check_pins.py")], capture_output=True, text=True, timeout=3600
    )
    assert done.returncode == 0, done.stderr[-6000:]
