"""Step plan: where does this run stand? Reads LATEST so that every Workflow resumes where the run stopped.

python -m steps.plan --run URI --first F --last L --out DIR [--run-config-json JSON] [--next-out FILE]
    writes DIR/latest: the LATEST version number, -1 before import-sft (and FILE: latest + 1). The Argo
    workflow skips the tasks of iterations <= latest. Refuses a segment that starts after a gap, and a
    config whose training fields differ from the run's run.json.

python -m steps.plan --run URI --unless-published I -- COMMAND ...
python -m steps.plan --run URI --first-iteration F --slot J [--iterations N] [--staleness S] -- COMMAND ...
    runs COMMAND (exec: its exit code and signals are the step's own) for iteration I (or F + J), unless
    LATEST already covers it or it lies beyond N; then it says so and exits 0. '{iteration}' and
    '{policy_version}' in COMMAND become the iteration and the policy version its rollout samples from.
    The KFP pipeline runs its steps this way: KFP has no `when` that follows a task's output across
    iterations, so its slots learn their iteration when they start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steps import progress
from steps.errors import MoerlError, run_cli
from steps.run.keys import RUN_CONFIG, behaviour_version


@dataclass(frozen=True)
class Plan:
    latest: int  # -1: nothing published yet
    first: int
    last: int

    @property
    def todo(self) -> range:
        """Iterations of this segment that still have to run."""
        return range(max(self.first, self.latest + 1), self.last + 1)


def plan_segment(latest: int | None, first: int, last: int) -> Plan:
    """Check that a segment [first, last] can run on a run whose LATEST is v(latest) (None: not imported)."""
    if first < 1 or last < first:
        raise MoerlError(f"--first {first} --last {last}: need 1 <= first <= last")
    if latest is None:
        if first > 1:
            raise MoerlError(
                f"the run has no LATEST checkpoint, so segment {first}-{last} cannot start; submit the run's "
                "first segment (it imports the SFT checkpoint; later segments follow by themselves)"
            )
        return Plan(-1, first, last)
    if latest < first - 1:
        raise MoerlError(
            f"LATEST is v{latest:06d} but this segment starts at iteration {first}; iterations "
            f"{latest + 1}-{first - 1} have not run. Submit the run from its first segment (finished iterations "
            "are skipped)"
        )
    return Plan(latest, first, last)


def training_fields(config: dict[str, Any]) -> dict[str, Any]:
    from steps.run.config import training_view  # the config model decides what a run may not change

    return training_view(config)


def check_config(stored: dict[str, Any], wanted: dict[str, Any], where: str) -> None:
    """A resumed run must keep what it trains; where it runs, how often it retries and how long it is may change."""
    old, new = training_fields(stored), training_fields(wanted)
    if old == new:
        return
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    raise MoerlError(
        f"{where} holds a different training config (changed: {', '.join(changed)}); a run keeps what it "
        "trains — restore those fields or start a new run with a new run_store"
    )


def read_latest(run_uri: str) -> int | None:
    from steps.run import checkpoint
    from steps.store.object_store import Store

    return checkpoint.latest_version(Store.open(run_uri))


def write_plan(run_uri: str, first: int, last: int, out: Path, config_json: str | None) -> Plan:
    from steps.store.object_store import Store

    run = Store.open(run_uri)
    run.check_access()
    if config_json is not None:
        try:
            wanted = json.loads(config_json)
        except ValueError as err:
            raise MoerlError(f"--run-config-json: not valid JSON ({err})") from None
        if run.exists(RUN_CONFIG):
            check_config(json.loads(run.get_bytes(RUN_CONFIG)), wanted, run.url(RUN_CONFIG))
    plan = plan_segment(read_latest(run_uri), first, last)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest").write_text(str(plan.latest))
    return plan


def describe(plan: Plan) -> str:
    done = "nothing published yet" if plan.latest < 0 else f"LATEST v{plan.latest:06d}"
    if not plan.todo:
        return f"{done}: iterations {plan.first}-{plan.last} are all published; nothing to run"
    return f"{done}: running iterations {plan.todo.start}-{plan.todo.stop - 1} of segment {plan.first}-{plan.last}"


def run_guarded(run_uri: str, iteration: int, command: list[str], iterations: int | None, staleness: int) -> int:
    """Exec `command` for `iteration`, or return 0 when there is nothing to do."""
    if iterations is not None and iteration > iterations:
        print(f"iteration {iteration} is past the run's {iterations} iterations; nothing to do", flush=True)
        return 0
    latest = read_latest(run_uri)
    if latest is not None and latest >= iteration:
        print(
            f"iteration {iteration} is published (LATEST v{latest:06d}); skipping {' '.join(command[:3])}", flush=True
        )
        return 0
    policy = behaviour_version(iteration, staleness)
    argv = [a.replace("{iteration}", str(iteration)).replace("{policy_version}", str(policy)) for a in command]
    sys.stdout.flush()
    os.execvp(argv[0], argv)
    return 0  # not reached


def main() -> int:
    argv = sys.argv[1:]
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    parser = argparse.ArgumentParser(prog="python -m steps.plan", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI")
    parser.add_argument("--first", type=int, help="first iteration of the segment")
    parser.add_argument("--last", type=int, help="last iteration of the segment")
    parser.add_argument("--out", type=Path, default=Path("/tmp/plan"), help="where to write the 'latest' file")
    parser.add_argument("--next-out", type=Path, help="also write latest + 1 (the next iteration) to this file")
    parser.add_argument("--run-config-json", help="the config the workflow was rendered from")
    parser.add_argument("--unless-published", type=int, metavar="I", help="run COMMAND for iteration I")
    parser.add_argument("--first-iteration", type=int, metavar="F", help="with --slot J: run COMMAND for F + J")
    parser.add_argument("--slot", type=int, metavar="J")
    parser.add_argument("--iterations", type=int, metavar="N", help="the run's last iteration")
    parser.add_argument("--staleness", type=int, default=0, choices=(0, 1))
    args = parser.parse_args(argv)

    if args.unless_published is not None or args.slot is not None:
        if not command:
            parser.error("a guarded step needs its command after --")
        if args.unless_published is not None:
            iteration = args.unless_published
        elif args.first_iteration is None:
            parser.error("--slot J needs --first-iteration F")
        else:
            iteration = args.first_iteration + args.slot
        return run_guarded(args.run, iteration, command, args.iterations, args.staleness)
    if args.first is None or args.last is None:
        parser.error("--first and --last are required (or a guarded step: --unless-published I -- COMMAND)")
    progress.report(0, 1)
    plan = write_plan(args.run, args.first, args.last, args.out, args.run_config_json)
    if args.next_out is not None:
        args.next_out.parent.mkdir(parents=True, exist_ok=True)
        args.next_out.write_text(str(plan.latest + 1))
    print(describe(plan), flush=True)
    progress.report(1, 1)
    return 0


if __name__ == "__main__":
    run_cli(main)
