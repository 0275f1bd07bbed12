"""The `moerl` command line: each command's module is imported only for that command."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_the_command_table_names_every_subcommand_and_its_module():
    assert subcommands(build_parser()) == list(COMMANDS)  # `moerl --help` order
    for command, module in COMMANDS.items():
        assert command in subcommands(build_parser(command)), f"{module} does not register {command}"


@pytest.mark.parametrize("command", ["demo", "run", "render", "local"])
def test_a_command_that_needs_no_model_does_not_import_torch(command):
    # `moerl demo` with its SFT checkpoint in place runs every model step in pods: its own process would
    # only lose ~2 s before the first pod importing torch for another command's parser (sft-demo).
    code = (
        "import sys; from pipelines.cli import build_parser; "
        f"build_parser({command!r}).parse_args([{command!r}, '--help'])"
    )
    wrapped = f"import sys\ntry:\n    exec({code!r})\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", wrapped], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_an_unknown_command_lists_them_all(capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser("no-such-command").parse_args(["no-such-command"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert all(command in err for command in COMMANDS)
