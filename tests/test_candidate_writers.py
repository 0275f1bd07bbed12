"""Issue 32, item 7: the candidate's files are written by every EP rank's dp replicas, spread over the nodes
(steps/run/candidate.py shard_writers, steps/training/candidate_writer.py writer_plan), not by the first dp row alone;
the files, CANDIDATE.json and the delta blobs are those of the single-writer layout; and `moerl simulate` times
the write by the node that writes the most."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_expert_parallel import run_gloo
from test_update_experience import experience_table, make_run, write_experience

from pipelines.config import load_config
from pipelines.simulate.sizing import (
    GPU_ASSUMPTIONS,
    candidate_write_s,
    derived_step_model,
    node_write_s,
    shard_gb,
)
from steps.expert_parallel.mesh import Mesh, build_mesh
from steps.models.hf_checkpoint import load_config as load_model_config
from steps.run.candidate import (
    MARKER,
    OPTIMIZER,
    SHARD_KINDS,
    WEIGHTS,
    WEIGHTS_MARKER,
    node_write_loads,
    shard_writers,
)
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"


# ---------------------------------------------------------------------------------------------- the plan


def eks_sizes(ep: int) -> list[dict[str, float]]:
    """GB per EP rank of a bf16 Qwen3-30B-A3B-class candidate: 61 GB of weights, 366 of AdamW state."""
    share = [0.95 / ep + (0.05 if r == 0 else 0.0) for r in range(ep)]
    return [{WEIGHTS: 61 * s, OPTIMIZER: 366 * s} for s in share]


def test_every_file_has_one_writer_among_its_ep_ranks_replicas():
    for ep, dp, per_node in [(8, 16, 8), (8, 2, 8), (16, 8, 8), (4, 4, 8), (2, 2, 2), (1, 2, 1)]:
        writers = shard_writers(eks_sizes(ep), dp, per_node)
        assert set(writers) == {(r, k) for r in range(ep) for k in SHARD_KINDS}
        assert all(rank % ep == r and rank < ep * dp for (r, _), rank in writers.items())


def test_the_eks_write_is_spread_over_the_sixteen_nodes():
    """ep_size 8 over 16 nodes of 8: the 16 files on 16 nodes, the busiest one EP rank 0's optimizer file
    (not the whole 427 GB on node 0, as when the first dp row wrote everything)."""
    sizes = eks_sizes(8)
    writers = shard_writers(sizes, 16, 8)
    loads = node_write_loads(sizes, writers, 8)
    assert sorted(loads) == list(range(16))
    assert max(loads.values()) == pytest.approx(sizes[0][OPTIMIZER])
    first_row = {(r, k): r for r in range(8) for k in SHARD_KINDS}
    assert node_write_loads(sizes, first_row, 8) == {0: pytest.approx(61 + 366)}
    # Two nodes: each writes about half.
    two = node_write_loads(sizes, shard_writers(sizes, 2, 8), 8)
    assert max(two.values()) < 0.6 * (61 + 366)


def test_one_replica_writes_as_before():
    assert shard_writers(eks_sizes(4), 1, 8) == {(r, k): r for r in range(4) for k in SHARD_KINDS}


# ---------------------------------------------------------------------------------------------- the update


def update_worker(rank: int, world: int, out_dir: Path, run_uri: str, ep_size: int, per_node: int, spread: bool):
    """Update iteration 1 on this gloo rank, as run_update does, recording the store keys this rank uploads;
    `spread` False: the plan of before (the first dp row writes every file)."""
    from steps.run import candidate
    from steps.training import update as training_update

    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)  # `world // per_node` nodes, as torchrun numbers them
    if not spread:
        candidate.shard_writers = lambda sizes, dp, n: {(r, k): r for r in range(len(sizes)) for k in SHARD_KINDS}
    wrote: list[str] = []
    put_file = Store.put_file

    def recording(self, key, local_path):
        wrote.append(key)
        return put_file(self, key, local_path)

    Store.put_file = recording  # type: ignore[method-assign]
    run = Store.open(run_uri)
    work = training_update.pending_iteration(run, 1, rank=rank)
    assert work is not None
    mesh = Mesh(rank=rank, world_size=world, world_group=dist.group.WORLD)
    parent_dir = training_update.fetch_checkpoint(run, 0, mesh, local_rank=rank)  # one machine: rank 0 fetches
    mesh = build_mesh(rank, world, ep_size, torch.device("cpu"))
    training_update.train_iteration(work, mesh, rank, load_model_config(parent_dir), parent_dir=parent_dir)
    (out_dir / f"wrote-{rank}.json").write_text(json.dumps(wrote))


def run_update(tmp_path: Path, spread: bool) -> tuple[Path, dict[int, list[str]]]:
    """World 4, ep_size 2 (dp 2), two ranks a node, deltas on: the candidate's directory and who wrote what."""
    base = tmp_path / ("spread" if spread else "single")
    base.mkdir()
    run_uri = make_run(base, trainer={"ep_size": 2}, rollout={"servers": 1}, checkpoint={"deltas": True})
    write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
    run_gloo(update_worker, 4, base, run_uri, 2, 2, spread, timeout=300.0)
    wrote = {r: json.loads((base / f"wrote-{r}.json").read_text()) for r in range(4)}
    return base / "run", wrote


def run_files(run_dir: Path) -> dict[str, bytes]:
    """Every object of the candidate and of the deltas, by key (CANDIDATE.json and WEIGHTS.json without their
    created_at)."""
    files = {}
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        key = path.relative_to(run_dir).as_posix()
        # (not the store's own digest records: the markers' differ by their created_at)
        if key.startswith((candidate_prefix(1), "deltas/")) and not path.name.startswith(".moerl-"):
            data = path.read_bytes()
            if path.name in (MARKER, WEIGHTS_MARKER):
                marker = json.loads(data)
                marker.pop("created_at")
                data = json.dumps(marker, sort_keys=True).encode()
            files[key] = data
    return files


def test_the_replicas_write_the_single_writer_candidate(tmp_path):
    spread_dir, spread = run_update(tmp_path, spread=True)
    single_dir, single = run_update(tmp_path, spread=False)
    shard_keys = {k for keys in spread.values() for k in keys}
    # Every shard file (2 EP ranks x weights + optimizer) and both delta blobs, each uploaded once.
    assert sum(len(keys) for keys in spread.values()) == len(shard_keys) == 6
    # Ranks 2 and 3 (dp replica 1, the second node) write part of it: more than one dp rank wrote files.
    writer_dp = {rank // 2 for rank, keys in spread.items() if keys}
    assert writer_dp == {0, 1}, spread
    assert not single[2] and not single[3] and {k for keys in single.values() for k in keys} == shard_keys
    # Byte for byte the candidate (and the delta blobs) of the single-writer layout.
    spread_files, single_files = run_files(spread_dir), run_files(single_dir)
    assert sorted(spread_files) == sorted(single_files)
    assert spread_files == single_files
    marker = json.loads(spread_files[f"{candidate_prefix(1)}/{MARKER}"])
    assert {name for name in marker["files"] if name.endswith(".safetensors")} == {
        "model-rank00000-of-00002.safetensors", "model-rank00001-of-00002.safetensors",
        "optimizer-rank00000-of-00002.safetensors", "optimizer-rank00001-of-00002.safetensors",
    }  # fmt: skip
    assert len(marker["weight_deltas"]) == 2


# ---------------------------------------------------------------------------------------------- the model


def test_the_simulated_write_is_the_busiest_nodes():
    """configs/eks-p5en.yaml: the write takes what its busiest node writes at 1 GB/s (EP rank 0's optimizer
    file, or its weight file with the delta's encoding), not the candidate over 16 nodes."""
    a = GPU_ASSUMPTIONS
    cfg = load_config(EKS, {"checkpoint.deltas": False})
    sizes = shard_gb(cfg, a)
    assert len(sizes) == 8 and sum(s[OPTIMIZER] for s in sizes) == pytest.approx(a.optimizer_gb)
    assert candidate_write_s(cfg, a) == pytest.approx(sizes[0][OPTIMIZER] / a.s3_gb_per_s)
    assert candidate_write_s(cfg, a) > 2 * (a.checkpoint_gb + a.optimizer_gb) / (16 * a.s3_gb_per_s)
    assert len(node_write_s(cfg, a)) == 16
    with_deltas = load_config(EKS)
    w0 = shard_gb(with_deltas, a)[0][WEIGHTS]
    encode_rate = a.delta_encode_gb_per_s * a.delta_encode_speedup  # the writer's threads
    weights_node_s = w0 * (1 + a.delta_fraction) / a.s3_gb_per_s + w0 / encode_rate
    optimizer_node_s = sizes[0][OPTIMIZER] / a.s3_gb_per_s
    assert candidate_write_s(with_deltas, a) == pytest.approx(max(weights_node_s, optimizer_node_s))
    # A trainer that stays up answers after the weights; the optimizer shards follow (optimizer_write.py).
    steps = derived_step_model(with_deltas, a)
    assert steps.weights_write_s == pytest.approx(weights_node_s)
    assert steps.optimizer_write_s == pytest.approx(optimizer_node_s)
    one_shot = derived_step_model(load_config(EKS, {"trainer.server": False}), a)
    assert steps.train_s == pytest.approx(
        one_shot.update_s - a.pod_start_s - a.trainer_startup_s - candidate_write_s(with_deltas, a) + weights_node_s
    )
