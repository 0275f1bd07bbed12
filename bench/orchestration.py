"""The local executor's overhead per step: `moerl local` against running the same commands directly.

    .venv/bin/python bench/orchestration.py [--steps 20] [--repeats 3] [--command true|python|step]

Three runs of the same N step commands (`true`; `python -c pass` with --command python; `python -m steps.publish
--help` with --command step, a moerl step that imports torch and the step's libraries), one after another:

    direct   subprocess.run of each command in turn: the floor
    dag      a Workflow whose DAG chains N tasks (each `depends` on the one before)
    steps    a Workflow whose steps template has N sequential step groups

The executor runs in this process (pipelines.local.run_workflow, silent, writing its status JSON as
`moerl local --status-out` does), so the figures hold its controller loop, pod sandboxes, logs and status, not
the interpreter start of the `moerl` command. Each figure is the median of --repeats runs. Prints the total,
the time per step, the executor's overhead per step (its time minus the direct time, over N) and the ratio.
With --command step the executor's warm starts apply (pipelines/local/pods/warm.py: the first pod starts cold and
starts the warm server, later pods fork from it), so its "overhead" is negative: what warm starts save;
--cold-start runs the executor without them.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COMMANDS = {
    "true": ["true"],
    "python": [sys.executable, "-c", "pass"],
    "step": [sys.executable, "-m", "steps.publish", "--help"],
}


def workflow(kind: str, steps: int, command: list[str]) -> dict:
    step = {"name": "step", "container": {"image": "alpine", "command": command}}
    if kind == "dag":
        tasks = [{"name": f"s{k}", "template": "step", **({"depends": f"s{k - 1}"} if k else {})} for k in range(steps)]
        main = {"name": "main", "dag": {"tasks": tasks}}
    else:
        main = {"name": "main", "steps": [[{"name": f"s{k}", "template": "step"}] for k in range(steps)]}
    return {
        "apiVersion": "argoproj.io/v1alpha1",
        "kind": "Workflow",
        "metadata": {"generateName": f"bench-{kind}-"},
        "spec": {"entrypoint": "main", "templates": [main, step]},
    }


def time_direct(steps: int, command: list[str]) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        subprocess.run(command, check=True)
    return time.perf_counter() - start


def time_executor(manifest: dict, workdir: Path, warm_start: bool) -> float:
    from pipelines.local import run_workflow
    from pipelines.workflow.commands import warm_preload

    start = time.perf_counter()
    result = run_workflow(
        manifest, view=None, workdir=workdir, status_out=workdir / "status.json", warm_start=warm_start,
        preload=warm_preload(),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    if not result.succeeded:
        raise SystemExit(f"the {manifest['metadata']['generateName']} workflow ended {result.phase}: {result.message}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="step commands per run (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each kind; the median is shown")
    parser.add_argument("--command", choices=sorted(COMMANDS), default="true", help="the step command")
    parser.add_argument("--cold-start", action="store_true", help="the executor without warm starts")
    args = parser.parse_args()
    command = COMMANDS[args.command]
    import pipelines.local  # noqa: F401  (imported once, outside the timings)

    times: dict[str, list[float]] = {"direct": [], "dag": [], "steps": []}
    workdir = Path(tempfile.mkdtemp(prefix="moerl-bench-orchestration-"))
    try:
        for _ in range(args.repeats):  # interleaved, so that a slow moment of the machine hits every kind
            times["direct"].append(time_direct(args.steps, command))
            for kind in ("dag", "steps"):
                times[kind].append(time_executor(workflow(kind, args.steps, command), workdir, not args.cold_start))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    median = {kind: statistics.median(values) for kind, values in times.items()}
    shown = " ".join(command).replace(sys.executable, "python")
    starts = "cold starts" if args.cold_start else "warm starts"
    print(f"{args.steps} sequential steps of `{shown}`, median of {args.repeats} runs, executor with {starts}")
    print(f"{'run':>8}  {'total (s)':>9}  {'per step (ms)':>13}  {'overhead/step (ms)':>18}  {'ratio':>6}")
    for kind, seconds in median.items():
        per_step = 1000 * seconds / args.steps
        overhead = "-" if kind == "direct" else f"{1000 * (seconds - median['direct']) / args.steps:.1f}"
        ratio = seconds / median["direct"]
        print(f"{kind:>8}  {seconds:>9.3f}  {per_step:>13.1f}  {overhead:>18}  {ratio:>5.1f}x")


if __name__ == "__main__":
    main()
