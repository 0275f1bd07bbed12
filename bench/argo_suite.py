"""Argo's own test suite through `moerl local`: how many of Argo's workflows end here as they end on Argo.

    ARGO_WORKFLOWS_SRC=/path/to/argo-workflows .venv/bin/python bench/argo_suite.py [SRC] [--jobs N]
        [--timeout S] [--only SUBSTRING ...] [--skip SUBSTRING ...] [--list]

SRC (or $ARGO_WORKFLOWS_SRC) is a checkout of argoproj/argo-workflows (the figures in
pipelines/local/README.md are for v4.1.2). Without either the script says so and exits 0: nothing here
needs Argo's files. It is not a test (pytest collects tests/ only; tests/test_local_argo_*.py hold the
rules it found).

What runs: every kind Workflow document of examples/**/*.yaml (the files Argo's test/e2e/examples_test.go
walks), and the first workflow document (Workflow, WorkflowTemplate, ClusterWorkflowTemplate or
CronWorkflow, as `moerl local` picks it) of each test/e2e/functional/*.yaml that is not a link into
examples/ (those run once, as examples). Each goes through `moerl local --no-strict --cold-start` in a
process of its own (the e2e fixtures create Workflows through the API, whose decoder drops unknown fields,
as --no-strict does), at most --jobs at once (those that serve on nginx's port 80 one at a time, after the
others), each for at most --timeout seconds (135), with:

- the WorkflowTemplates and ConfigMaps that examples_test applies before it runs the examples: the files
  beside each manifest (moerl local reads them) and every ConfigMap of examples/ (`--configmap`);
- stand-ins for what the images hold: `argoproj/argosay` as a small shell emulation of argosay v2
  (echo [TEXT [FILE]], cat, exit, sleep, assert_contains); images without an ENTRYPOINT (alpine, debian,
  ubuntu, busybox, python, golang) as `env`, which runs the args as the command, as the container runtime
  does; `nginx` as Python's HTTP server on port 80; `cowsay` as an echo;
- for a workflow with no deadline of any kind (activeDeadlineSeconds, timeout, pendingTimeout, maxDuration,
  probe delays), `sleep` (and argosay's sleep) at 1/100 of the time and MOERL_LOCAL_TIME_SCALE=0.01
  (backoffs): every clock scaled alike keeps the outcome; a workflow with a deadline runs in real time.

What counts as refused: `moerl local` exits 2 (a field or template kind it refuses, named before anything
runs); a template's command is a program this machine does not have (`influxd`, `cmd`, ...: it would end
Error with "executable file not found", which says nothing about the executor); or the outcome is the
container runtime's or the outside world's (ENVIRONMENT: a kernel mount, the pod's /etc/hosts, Slack).

What Argo expects, for the workflows that ran (a workflow with no expectation is "not judged"):

- examples: Succeeded, as examples_test.go requires, unless labelled `workflows.argoproj.io/no-test`
  (examples_test skips those): then what KNOWN_OUTCOMES says, taken from the example itself (an intended
  failure, a deadline shorter than its sleep; or Succeeded for one that needs only a cluster resource such
  as a secret or a labelled node); "duration" and "flaky" expect Succeeded (slow or racy on a cluster, not
  failing); an example that passes or fails by random.choice (RANDOM), and any other, is not judged;
- test/e2e/functional: the phase the Go tests that submit the file (`@functional/NAME.yaml`) wait for or
  assert (`fixtures.ToBeSucceeded/ToBeFailed/ToBeErrored`, `wfv1.WorkflowSucceeded/Failed/Error`), when
  they agree on one; not judged when they act on the running workflow (stop, terminate, resume, ...: ACTIONS)
  or state no phase; a file no Go test submits is presumed to succeed.

Prints how many ran, were judged and matched (and the rate), how many were refused and why, and each
mismatch with the phase and message it ended with; --list prints every workflow's outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MOERL = "import sys; from pipelines.cli import main; main(sys.argv[1:])"  # `moerl` of this checkout
NO_TEST = "workflows.argoproj.io/no-test"
WORKFLOW_KINDS = ("Workflow", "WorkflowTemplate", "ClusterWorkflowTemplate", "CronWorkflow")
DEADLINE_FIELDS = re.compile(
    r"\b(activeDeadlineSeconds|timeout|pendingTimeout|maxDuration|initialDelaySeconds|periodSeconds):"
)
NO_ENTRYPOINT = ("alpine", "debian", "ubuntu", "busybox", "python", "golang", "centos", "fedora")
# Examples labelled no-test whose outcome on Argo the example itself makes plain (its comments, an intended
# failure, a deadline shorter than its sleep), or that need only a cluster resource (a secret, a labelled node, a
# device claim, the ConfigMap permissions memoize needs) and otherwise succeed.
KNOWN_OUTCOMES: dict[str, str] = {
    "examples/exit-handlers.yaml": "Failed",  # intentional-fail
    "examples/dag-continue-on-fail.yaml": "Failed",  # E fails and no task continues on it
    "examples/continue-on-fail.yaml": "Succeeded",  # continueOn.failed on its one failing step
    "examples/dag-disable-failFast.yaml": "Failed",
    "examples/timeouts-step.yaml": "Failed",
    "examples/timeouts-workflow.yaml": "Failed",
    "examples/step-level-timeout.yaml": "Failed",
    "examples/dag-task-level-timeout.yaml": "Failed",
    "examples/pod-gc-strategy.yaml": "Failed",  # its step `fail` exits 1
    "examples/pod-gc-strategy-with-label-selector.yaml": "Failed",
    **{f"examples/{name}.yaml": "Succeeded" for name in (
        "image-pull-secrets", "node-selector", "loops-dag", "loops-maps", "loops-param-argument", "loops-sequence",
        "parallelism-template-limit", "synchronization-mutex-tmpl-level", "template-on-exit",
        "fibonacci-seq-conditional-param", "resource-claims", "resource-claims-template-override")},
}  # fmt: skip
# Workflows whose outcome is the container runtime's or the outside world's, not the controller's: counted with
# the refused ones, with the reason.
ENVIRONMENT: dict[str, str] = {
    "examples/volumes-emptydir.yaml": "greps /proc/mounts for the volume: a kernel mount, which a sandbox is not",
    "test/e2e/functional/dag-with-retries.yaml": "`exit $((RANDOM % 5))` needs busybox sh's $RANDOM (sh here is dash)",
    "examples/exit-handler-slack.yaml": "posts to Slack",
    **{f"test/e2e/functional/{name}.yaml": "nslookup of a hostAliases name: the pod's /etc/hosts" for name in (
        "template_level_host_aliases", "workflow_level_host_aliases", "workflow_template_level_host_aliases")},
}  # fmt: skip
# The Go tests that act on the running workflow (stop, terminate, resume, ...): the phase they expect is not an
# unattended run's.
ACTIONS = ("ShutdownWorkflow", "StopWorkflow", "TerminateWorkflow", "ResumeWorkflow", "SuspendWorkflow",
           "RetryWorkflow", "ResubmitWorkflow", "DeleteWorkflow")  # fmt: skip
# Examples labelled no-test that pass or fail by random.choice, their retries notwithstanding (11 attempts at 2/3
# each fail together once in 86): Argo's examples_test skips them too.
RANDOM = ("examples/template-defaults.yaml", "examples/resubmit.yaml", "examples/retry-conditional.yaml",
          "examples/retry-on-error.yaml", "examples/custom-metrics.yaml", "examples/retry-backoff.yaml",
          "examples/retry-with-steps.yaml", "examples/workflow-template/retry-with-steps.yaml")  # fmt: skip

ARGOSAY = r"""#!/bin/sh
# argoproj/argosay v2: echo [TEXT [FILE]], cat FILE..., exit [CODE], sleep DURATION, assert_contains FILE TEXT
cmd=${1:-echo}
[ $# -gt 0 ] && shift
case "$cmd" in
  echo)
    case $# in
      0) echo "hello argo" ;;
      1) echo "$1" ;;
      *) mkdir -p "$(dirname "$2")" && printf '%s' "$1" > "$2" ;;
    esac ;;
  cat) cat "$@" ;;
  exit) exit "${1:-0}" ;;
  sleep) exec sleep "$1" ;;
  assert_contains) grep -qF -- "$2" "$1" ;;
  assert_exists) test -e "$1" ;;
  *) echo "usage: argosay [assert_contains FILE TEXT|cat [FILE...]|echo [TEXT] [FILE]|exit [CODE]|sleep DURATION]" >&2
     exit 1 ;;
esac
"""

# `sleep` that takes Go durations too (argosay's) and sleeps ARGO_SUITE_SLEEP_SCALE of the time.
SLEEP = r"""#!/bin/sh
case "$*" in  # one whole number of seconds (most sleeps): shell arithmetic, no awk (thousands of pods sleep)
  ''|*[!0-9]*) ;;
  *) ms=$(( $1 * ${ARGO_SUITE_SLEEP_PERMILLE:-1000} )); frac=$(( ms % 1000 + 1000 ))
     exec "$REAL_SLEEP" "$(( ms / 1000 )).${frac#1}" ;;
esac
total=0
for arg in "$@"; do
  seconds=$(echo "$arg" | awk '{
    s = $0; t = 0
    if (s ~ /^[0-9.]+$/) { print s; exit }
    while (match(s, /^[0-9.]+(ms|us|ns|h|m|s|d)/)) {
      part = substr(s, 1, RLENGTH); s = substr(s, RLENGTH + 1)
      match(part, /[0-9.]+/); n = substr(part, RSTART, RLENGTH); u = substr(part, RLENGTH + 1)
      k = u == "ms" ? 0.001 : u == "us" ? 0.000001 : u == "ns" ? 0.000000001 : 1
      t += n * (u == "h" ? 3600 : u == "m" ? 60 : u == "d" ? 86400 : k)
    }
    print t }')
  total=$(awk -v a="$total" -v b="$seconds" 'BEGIN { print a + b }')
done
exec "$REAL_SLEEP" "$(awk -v t="$total" -v k="${ARGO_SUITE_SLEEP_SCALE:-1}" 'BEGIN { printf "%.3f", t * k }')"
"""


# nginx's part in these workflows: an HTTP server on port 80 (`nginx -g "daemon off;"`), here Python's.
NGINX = r"""#!/bin/sh
www="${TMPDIR:-/tmp}/argo-suite-www"
mkdir -p "$www" && echo "<h1>Welcome to nginx!</h1>" > "$www/index.html"
exec PYTHON -m http.server 80 --bind 127.0.0.1 --directory "$www"
"""

# cowsay of docker/whalesay and argosay:v1: the message (less the cow).
COWSAY = """#!/bin/sh
echo "< $* >"
"""


@dataclass
class Case:
    key: str  # examples/NAME.yaml[#N] or test/e2e/functional/NAME.yaml
    manifest: Path
    expected: str | None  # None: not judged
    why: str  # where the expectation comes from
    realtime: bool
    refused: str = ""  # set before the run: a program this machine lacks
    phase: str = ""
    message: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default=os.environ.get("ARGO_WORKFLOWS_SRC"))
    parser.add_argument("--jobs", type=int, default=3, help="workflows run at once (default 3)")
    parser.add_argument("--timeout", type=float, default=135.0, help="seconds a workflow may take (default 135)")
    parser.add_argument("--only", action="append", default=[], help="run the cases whose key contains this")
    parser.add_argument("--skip", action="append", default=[], help="leave out the cases whose key contains this")
    parser.add_argument("--list", action="store_true", help="print every case's outcome, not only mismatches")
    args = parser.parse_args(argv)
    if not args.source:
        print("argo_suite: skipped: set ARGO_WORKFLOWS_SRC (or pass SRC) to a checkout of argoproj/argo-workflows")
        return 0
    source = Path(args.source).resolve()
    if not (source / "examples").is_dir() or not (source / "test" / "e2e" / "functional").is_dir():
        print(f"argo_suite: skipped: {source} has no examples/ and test/e2e/functional/ (not argo-workflows)")
        return 0
    with tempfile.TemporaryDirectory(prefix="argo-suite-") as tmp:
        work = Path(tmp)
        shutil.copytree(source / "examples", work / "src" / "examples", symlinks=False)
        shutil.copytree(source / "test" / "e2e" / "functional", work / "src" / "functional", symlinks=True)
        cases = collect(source, work)
        if args.only:
            cases = [c for c in cases if any(s in c.key for s in args.only)]
        cases = [c for c in cases if not any(s in c.key for s in args.skip)]
        env = environment(work)
        configmaps = configmap_file(work)
        started = time.time()
        # the workflows that serve on a fixed port (nginx's 80) run one at a time, after the others
        shared = [c for c in cases if "nginx" not in c.manifest.read_text()]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda c: run_case(c, work, env, configmaps, args.timeout), shared))
        for case in cases:
            if case not in shared:
                run_case(case, work, env, configmaps, args.timeout)
        report(cases, time.time() - started, args.list)
    return 0


# ----------------------------------------------------------------------------- what runs and what Argo expects


def collect(source: Path, work: Path) -> list[Case]:
    cases: list[Case] = []
    expectations = e2e_expectations(source / "test" / "e2e")
    for path in sorted((work / "src" / "examples").rglob("*.yaml")):
        rel = "examples/" + path.relative_to(work / "src" / "examples").as_posix()
        docs = read_documents(path)
        workflows = [d for d in docs if d.get("kind") == "Workflow"]
        for n, doc in enumerate(workflows):
            key = rel if len(workflows) == 1 else f"{rel}#{n}"
            manifest = path
            if len(workflows) > 1 or docs[0] is not doc:  # moerl local runs a file's first workflow document
                manifest = path.with_name(f"{path.stem}.suite-{n}.yml")  # .yml: not read as a sibling by others
                manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
            expected, why = example_expectation(rel, doc)
            cases.append(Case(key, manifest, expected, why, realtime=needs_real_time(doc)))
    functional = source / "test" / "e2e" / "functional"
    for path in sorted(functional.glob("*.yaml")):
        if path.is_symlink() and "examples" in os.readlink(path):
            continue  # the same file as an example: run once, there
        rel = f"test/e2e/functional/{path.name}"
        copy = work / "src" / "functional" / path.name
        docs = read_documents(copy)
        main_doc = next((d for d in docs if d.get("kind") in WORKFLOW_KINDS), None)
        if main_doc is None:
            continue
        if path.name in expectations:
            expected, why = expectations[path.name]
        elif rel in KNOWN_OUTCOMES:
            expected, why = KNOWN_OUTCOMES[rel], "KNOWN_OUTCOMES"
        else:
            expected, why = "Succeeded", "submitted by no Go test: presumed Succeeded"
        cases.append(Case(rel, copy, expected, why, realtime=needs_real_time(main_doc)))
    return cases


def example_expectation(rel: str, doc: dict) -> tuple[str | None, str]:
    labels = (doc.get("metadata") or {}).get("labels") or {}
    reason = labels.get(NO_TEST)
    if reason is None:
        return "Succeeded", "examples_test.go: ToBeSucceeded"
    if rel in RANDOM:
        return None, f"no-test: {reason}; random outcome"
    if rel in KNOWN_OUTCOMES:
        return KNOWN_OUTCOMES[rel], f"no-test: {reason}; KNOWN_OUTCOMES"
    if reason in ("duration", "flaky"):
        return "Succeeded", f"no-test: {reason} (slow or racy on a cluster, not failing)"
    return None, f"no-test: {reason}"


PHASES = {
    "Succeeded": ("ToBeSucceeded", "wfv1.WorkflowSucceeded"),
    "Failed": ("ToBeFailed", "wfv1.WorkflowFailed"),
    "Error": ("ToBeErrored", "wfv1.WorkflowError"),
}


def e2e_expectations(e2e: Path) -> dict[str, tuple[str | None, str]]:
    """functional file name -> (the phase the Go tests that submit it expect, which tests say so)."""
    found: dict[str, list[tuple[str | None, str]]] = {}
    for go in sorted(e2e.glob("*_test.go")):
        text = go.read_text()
        for match in re.finditer(r"@functional/([\w.-]+\.yaml)", text):
            # the chain that submits it: up to the next workflow it names or the next test function
            rest = text[match.end() :]
            end = min(
                [m.start() for m in (re.search(r"@\w+/", rest), re.search(r"\nfunc ", rest)) if m is not None]
                + [len(rest)]
            )
            chain = rest[:end]
            phases = {phase for phase, marks in PHASES.items() if any(m in chain for m in marks)}
            if any(action in chain for action in ACTIONS):
                phases = {"acted on"}
            test = re.findall(r"func \(s \*\w+\) (Test\w+)", text[: match.start()])
            where = f"{go.name} {test[-1] if test else '?'}"
            found.setdefault(match.group(1), []).append((phases.pop() if len(phases) == 1 else None, where))
    result = {}
    for name, expectations in found.items():
        phases = {p for p, _ in expectations if p is not None}
        wheres = ", ".join(w for _, w in expectations)
        if "acted on" in phases:
            result[name] = (None, f"{wheres}: acts on the running workflow")
        else:
            result[name] = (phases.pop(), wheres) if len(phases) == 1 else (None, f"{wheres}: no single phase")
    return result


def needs_real_time(doc: dict) -> bool:
    return bool(DEADLINE_FIELDS.search(yaml.safe_dump(doc)))


def read_documents(path: Path) -> list[dict]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
    except (yaml.YAMLError, UnicodeDecodeError):
        return []


# ----------------------------------------------------------------------------- running one


def environment(work: Path) -> dict[str, str]:
    bin_dir = work / "bin"
    bin_dir.mkdir()
    for name, text in (("argosay", ARGOSAY), ("sleep", SLEEP), ("nginx", NGINX), ("cowsay", COWSAY)):
        (bin_dir / name).write_text(text.replace("PYTHON", sys.executable))
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ)
    env["REAL_SLEEP"] = shutil.which("sleep") or "/bin/sleep"
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)
    env.pop("MOERL_LOCAL_TIME_SCALE", None)
    return env


def configmap_file(work: Path) -> Path:
    """Every ConfigMap of examples/, as examples_test.go applies them before the examples run."""
    maps = [d for p in sorted((work / "src" / "examples").rglob("*.yaml")) for d in read_documents(p)]
    out = work / "configmaps.yml"
    out.write_text(yaml.safe_dump_all([d for d in maps if d.get("kind") == "ConfigMap"]))
    return out


def entrypoints(doc_text: str) -> list[str]:
    """--entrypoint for each image the manifest names: argosay's emulation, `env` for an image with none."""
    out = []
    for image in sorted(set(re.findall(r"image:\s*['\"]?([^\s'\"]+)", doc_text))):
        base = image.split("/")[-1].split(":")[0]
        if base == "argosay":
            out.append(f"{image}=argosay")
        elif base in NO_ENTRYPOINT:
            out.append(f"{image}=env")
        elif base == "nginx":  # its CMD, `nginx -g "daemon off;"`
            out.append(f"{image}=nginx")
    return out


def missing_program(doc_text: str, path: str) -> str:
    """A template command this machine does not have (checked before the run: see the module's docstring)."""
    for doc in yaml.safe_load_all(doc_text):
        for command in _commands(doc):
            if not command or "{{" in command or command.startswith("/"):
                continue
            if command not in ("python", "python3") and shutil.which(command, path=path) is None:
                return command
    return ""


def _commands(value: object) -> list[str]:
    found = []
    if isinstance(value, dict):
        command = value.get("command")
        if "image" in value and isinstance(command, list) and command:
            found.append(str(command[0]))
        for item in value.values():
            found += _commands(item)
    elif isinstance(value, list):
        for item in value:
            found += _commands(item)
    return found


def run_case(case: Case, work: Path, env: dict[str, str], configmaps: Path, timeout: float) -> None:
    text = case.manifest.read_text()
    if case.key in ENVIRONMENT:
        case.refused = f"environment: {ENVIRONMENT[case.key]}"
        return
    program = missing_program(text, env["PATH"])
    if program:
        case.refused = f"needs the program {program!r}, which this machine does not have"
        return
    slug = re.sub(r"[^\w.-]+", "_", case.key)
    status = work / "status" / f"{slug}.json"
    status.parent.mkdir(exist_ok=True)
    argv = [sys.executable, "-c", MOERL, "local", str(case.manifest), "--no-strict", "--cold-start",
            "--status-out", str(status), "--workdir", str(work / "runs" / slug), "--configmap", str(configmaps)]
    for item in entrypoints(text):
        argv += ["--entrypoint", item]
    run_env = dict(env)
    if not case.realtime:
        run_env.update(ARGO_SUITE_SLEEP_SCALE="0.01", ARGO_SUITE_SLEEP_PERMILLE="10", MOERL_LOCAL_TIME_SCALE="0.01")
    started = time.time()
    proc = subprocess.Popen(argv, cwd=work, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # moerl local stops its pods on SIGTERM
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
        case.phase, case.message = "Timeout", f"did not finish in {timeout:.0f} s"
        case.seconds = time.time() - started
        return
    case.seconds = time.time() - started
    if proc.returncode == 2:
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        case.refused = (lines or stderr.strip().splitlines() or ["exit 2"])[-1]
        return
    try:
        result = json.loads(status.read_text())
        case.phase, case.message = result.get("phase", "?"), result.get("message", "")
        if case.phase in ("Pending", "Running"):  # moerl local ended without settling the workflow
            case.message = f"exit {proc.returncode}: " + " | ".join(stderr.strip().splitlines()[-3:])
    except (OSError, ValueError):
        case.phase, case.message = "NoStatus", (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]


# ----------------------------------------------------------------------------- the figures


def report(cases: list[Case], seconds: float, verbose: bool) -> None:
    ran = [c for c in cases if not c.refused]
    refused = [c for c in cases if c.refused]
    judged = [c for c in ran if c.expected is not None]
    matched = [c for c in judged if c.phase == c.expected]
    mismatched = [c for c in judged if c.phase != c.expected]
    rate = 100.0 * len(matched) / len(judged) if judged else 0.0
    print(f"argo_suite: {len(cases)} workflows in {seconds:.0f} s")
    print(f"  ran        {len(ran)}")
    print(f"  judged     {len(judged)} (not judged: {len(ran) - len(judged)}: random, acted on, or no phase stated)")
    print(f"  as on Argo {len(matched)} of {len(judged)} judged ({rate:.1f}%)")
    by_environment = sum(1 for c in refused if c.refused.startswith("environment:"))
    by_program = sum(1 for c in refused if c.refused.startswith("needs the program"))
    print(f"  refused    {len(refused)} (by moerl local: {len(refused) - by_environment - by_program}; a program "
          f"this machine lacks: {by_program}; the container runtime's or outside world's: {by_environment})")
    if mismatched:
        print("\nmismatches:")
        for c in mismatched:
            print(f"  {c.key}: expected {c.expected} ({c.why}); got {c.phase}: {c.message[:200]}")
    if verbose:
        print("\nall:")
        for c in cases:
            outcome = f"refused: {c.refused}" if c.refused else f"{c.phase} ({c.seconds:.1f} s)"
            print(f"  {c.key}: expected {c.expected} [{c.why}] -> {outcome}")


if __name__ == "__main__":
    sys.exit(main())
