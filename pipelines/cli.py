"""moerl: RL after SFT for sparse MoE models, as Argo Workflows on Kubernetes or on this machine.

Each subcommand lives in its own module that exposes `register(subparsers)`; that function adds the
parser and sets `func` to the handler, which takes the parsed args and returns an exit code."""

from __future__ import annotations

import argparse
import importlib

from steps.errors import run_cli

# Modules that contribute subcommands, in the order `moerl --help` lists them.
COMMAND_MODULES = [
    "pipelines.demo",
    "pipelines.sft_demo",
    "pipelines.render",
    "pipelines.local.cli",
    "pipelines.simulate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moerl", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    run_cli(lambda: args.func(args))
