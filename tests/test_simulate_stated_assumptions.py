"""A config's stated assumptions (`configs/<name>.assumptions.yaml`, or `moerl simulate --assumptions FILE`): what
is known about its workload, each value with its source, read beside the config and printed by --explain;
--from-run and --assume go over them; a file that names no assumption, holds no number or does not say what kind
of source it is, is one clear error naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_simulate import EKS, run_cli
from test_simulate_from_run import write_run

from pipelines.simulate.sources import read_stated, stated_path
from steps.errors import MoerlError

REPO = Path(__file__).resolve().parents[1]


def mean(out: str) -> float:
    return float(out.split("iteration time, mean")[1].split()[0])


def test_every_reference_config_states_its_response_lengths_with_a_source():
    for config in ("eks-p5en.yaml", "eks-p5en-235b.yaml"):
        values, sources = read_stated(stated_path(REPO / "configs" / config))
        assert 0 < values["response_fill"] <= 1
        assert sources["response_fill"].startswith(("published", "assumption"))


def test_the_configs_own_are_read_beside_it_and_explained(capsys):
    run_cli([str(EKS), "--iterations", "4", "--explain"])
    out = capsys.readouterr().out
    assert f"stated in {stated_path(EKS)}: response_fill 0.7195" in out
    (line,) = [line for line in out.splitlines() if line.strip().startswith("response_fill")]
    assert "published: NeMo-RL v0.6" in line and "(eks-p5en.assumptions.yaml)" in line


def test_from_run_and_assume_go_over_the_stated_ones(tmp_path, capsys):
    stated = tmp_path / "stated.yaml"
    stated.write_text("response_fill: {value: 0.5, source: 'measured: a run of ours'}\n")
    run_cli([str(EKS), "--iterations", "4", "--assumptions", str(stated)])
    half = capsys.readouterr().out
    assert "stated in" in half and "response_fill 0.5" in half
    run_cli([str(EKS), "--iterations", "4", "--assumptions", str(stated), "--assume", "response_fill=1"])
    full = capsys.readouterr().out
    assert mean(full) > mean(half)
    run = write_run(tmp_path, [1024.0])
    run_cli([str(EKS), "--iterations", "4", "--assumptions", str(stated), "--from-run", run])
    measured = capsys.readouterr().out
    assert "(fill 0.25 of 4,096)" in measured and mean(measured) < mean(half)  # the run's 1,024 of 4,096


@pytest.mark.parametrize(
    "text,message",
    [
        ("response_fil: {value: 0.5, source: 'published: x'}\n", "'response_fil' is not an assumption"),
        ("response_fill: 0.5\n", r"expected \{value: NUMBER, source: TEXT\}"),
        ("response_fill: {value: 'half', source: 'published: x'}\n", "value 'half' is not a finite number >= 0"),
        ("response_fill: {value: -1, source: 'published: x'}\n", "value -1 is not a finite number >= 0"),
        ("response_fill: {value: 0.5, source: 'NeMo-RL says so'}\n", "the source must start with what it is"),
        ("[1, 2]\n", "expected a mapping of assumption names"),
        ("response_fill: {value: 0.5\n", "not readable as YAML"),
    ],
)
def test_a_bad_file_is_one_clear_error_naming_it(tmp_path, text, message):
    stated = tmp_path / "stated.yaml"
    stated.write_text(text)
    with pytest.raises(MoerlError, match=message) as err:
        run_cli([str(EKS), "--iterations", "1", "--assumptions", str(stated)])
    assert str(stated) in str(err.value)


def test_a_named_file_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(MoerlError, match="not readable as YAML"):
        run_cli([str(EKS), "--iterations", "1", "--assumptions", str(tmp_path / "absent.yaml")])
