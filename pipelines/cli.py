"""moerl: RL after SFT for sparse MoE models, as Argo Workflows on Kubernetes or on this machine.

Each subcommand lives in its own module that exposes `register(subparsers)`; that function adds the
parser and sets `func` to the handler, which takes the parsed args and returns an exit code."""

from __future__ import annotations

import argparse
import importlib
import sys

from steps.errors import run_cli

# The module that registers each subcommand, in the order `moerl --help` lists them. `moerl COMMAND ...`
# imports only COMMAND's module: another may import torch at its top (sft-demo), which costs 2 s of the start
# of `moerl demo` on a busy machine, before its first pod (tests/test_cli.py keeps this table complete).
COMMANDS = {
    "demo": "pipelines.demo",
    "run": "pipelines.demo",
    "sft-demo": "pipelines.sft_demo",
    "render": "pipelines.render",
    "check": "pipelines.render",
    "submit": "pipelines.render",
    "schedule": "pipelines.render",
    "local": "pipelines.local.cli",
    "simulate": "pipelines.simulate.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or only of `command`'s module when it names one."""
    parser = argparse.ArgumentParser(prog="moerl", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    run_cli(lambda: args.func(args))
