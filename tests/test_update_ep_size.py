"""trainer.ep_size: the expert-parallel group size as a config field (the data-parallel size it implies),
checked against the trainer's ranks when the config is read and against the checkpoint's experts when the
update sizes its mesh; and a downloaded checkpoint hashed once per node, not once per local rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_expert_parallel import run_gloo
from test_update_experience import experience_table, make_run, start_ranks, wait_ranks, write_experience

from steps.errors import MoerlError
from steps.expert_parallel.mesh import Mesh, resolve_ep_size
from steps.run import checkpoint
from steps.run.candidate import MARKER
from steps.run.config import validate_config
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store
from steps.update import fetch_checkpoint

BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}


def test_ep_size_must_divide_the_trainer_ranks():
    cfg = validate_config({**BASE, "trainer": {"nodes": 16, "nproc_per_node": 8, "ep_size": 8}})
    assert cfg.trainer.ep_size == 8
    with pytest.raises(MoerlError, match=r"trainer.ep_size: 3 does not divide the 128 trainer ranks"):
        validate_config({**BASE, "trainer": {"nodes": 16, "nproc_per_node": 8, "ep_size": 3}})
    assert validate_config(BASE).trainer.ep_size is None  # default: gcd(ranks, experts)


def test_ep_size_must_divide_the_experts_with_a_clear_choice():
    assert resolve_ep_size(128, 128) == 128
    assert resolve_ep_size(128, 128, requested=8) == 8  # EP inside a node, 16-way data parallel
    with pytest.raises(MoerlError, match=r"trainer.ep_size 16: .* num_experts \(8\); set trainer.ep_size to one "
                                         r"of \[1, 2, 4, 8\]"):  # fmt: skip
        resolve_ep_size(32, 8, requested=16)


def test_the_update_runs_the_configured_ep_size(tmp_path):
    """Two ranks, ep_size 1: pure data parallelism (dp 2), where the default would be EP=2."""
    run_uri = make_run(tmp_path, trainer={"ep_size": 1})
    run = Store.open(run_uri)
    write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
    results = wait_ranks(start_ranks(run_uri, 1, 2))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
    marker = run.get_json(f"{candidate_prefix(1)}/{MARKER}")
    assert (marker["ep_size"], marker["dp_size"], marker["world_size"]) == (1, 2, 2)


def hashing_worker(rank: int, world: int, out_dir: Path, run_uri: str) -> None:
    import torch.distributed as dist

    hashed: list[str] = []
    digest = checkpoint.file_digest
    checkpoint.file_digest = lambda path: (hashed.append(path.name), digest(path))[1]
    mesh = Mesh(rank=rank, world_size=world, world_group=dist.group.WORLD)
    local = fetch_checkpoint(Store.open(run_uri), 0, mesh, local_rank=rank)  # one node: local rank = rank
    assert (local / "config.json").is_file()
    (out_dir / f"rank{rank}.txt").write_text("\n".join(hashed))


def test_a_checkpoint_is_hashed_once_per_node(tmp_path):
    run_uri = make_run(tmp_path)
    run_gloo(hashing_worker, 2, tmp_path, run_uri)
    files = set(checkpoint.require_manifest(Store.open(run_uri), 0).files)
    assert set((tmp_path / "rank0.txt").read_text().split()) == {Path(f).name for f in files}
    assert (tmp_path / "rank1.txt").read_text() == ""  # the node's other ranks read what rank 0 verified
