"""`moerl local MANIFEST [-p NAME=VALUE ...] [--chaos SPEC] [--status-out FILE] [--workdir DIR]
[--entrypoint IMAGE=COMMAND ...] [--configmap FILE ...]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipelines.local.api.manifest import parse_entrypoint
from pipelines.local.run import DEFAULT_WORKDIR, run_workflow
from pipelines.workflow.commands import warm_preload
from steps.errors import MoerlError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "local",
        help="run an Argo Workflow manifest on this machine",
        description="Run an Argo Workflow manifest on this machine with Argo's semantics: each container's "
        "command runs here as a process (the image is recorded, not pulled). Exit code 0 iff the workflow "
        "Succeeded. MOERL_LOCAL_TIME_SCALE scales retry backoffs, suspends and grace periods (default 1).",
    )
    parser.add_argument("manifest", type=Path, help="a YAML file with kind Workflow, WorkflowTemplate or CronWorkflow")
    parser.add_argument(
        "-p",
        "--parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a workflow argument (spec.arguments.parameters), as `argo submit -p`",
    )
    parser.add_argument(
        "--chaos",
        metavar="SPEC",
        help="preempt=N[@TEMPLATE],kill=M[@TEMPLATE],seed=S: inject Spot preemptions and kills, each in the middle "
        "of a running attempt; an error if the workflow succeeds before all of them landed",
    )
    parser.add_argument("--status-out", type=Path, metavar="FILE", help="write the workflow's status (Argo's shape)")
    parser.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        default=DEFAULT_WORKDIR,
        help=f"where each run keeps its pods' logs and sandboxes (default {DEFAULT_WORKDIR})",
    )
    parser.add_argument(
        "--entrypoint",
        action="append",
        default=[],
        metavar="IMAGE=COMMAND",
        help="the host command that stands for IMAGE's ENTRYPOINT, for its containers that give no command "
        "(their args follow it), e.g. --entrypoint 'argoproj/argosay:v2=sh -c \"echo $0 $@\"'; repeatable",
    )
    parser.add_argument(
        "--configmap",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a YAML file of ConfigMaps whose data the workflow's synchronization semaphores read their limits "
        "from (ConfigMaps in the manifest's file and beside it are read too); repeatable",
    )
    parser.add_argument(
        "--no-strict",
        action="store_true",
        help="drop fields that are not Argo's, with a warning, as Argo's controller decodes what kubectl "
        "created; by default they are refused, as `argo submit` (--strict) refuses them",
    )
    parser.add_argument(
        "--cold-start",
        action="store_true",
        help="start every pod as a new process; by default `python -m` pods are forks of a Python that has "
        "imported torch and the moerl libraries once (also MOERL_LOCAL_WARM=0)",
    )
    parser.set_defaults(func=main)


def parse_parameters(items: list[str]) -> dict[str, str]:
    parameters = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise MoerlError(f"-p {item!r}: expected NAME=VALUE, e.g. -p message=hello")
        parameters[name] = value
    return parameters


def main(args: argparse.Namespace) -> int:
    try:
        result = run_workflow(
            args.manifest,
            parameters=parse_parameters(args.parameter),
            chaos=args.chaos,
            status_out=args.status_out,
            workdir=args.workdir,
            warm_start=False if args.cold_start else None,
            preload=warm_preload(),  # moerl's manifests are the ones this command runs most
            entrypoints=dict(parse_entrypoint(item) for item in args.entrypoint),
            configmaps=args.configmap,
            strict=not getattr(args, "no_strict", False),
        )
    except KeyboardInterrupt:  # the pods are stopped and the status says so; no traceback
        print("moerl local: interrupted", file=sys.stderr)
        return 130
    return 0 if result.succeeded else 1
