"""Reading scored experience for an update: the rows the trainer sees, and one clear error for each bad input.

Also home of the small-run helpers that the update/publish tests share (a tiny SFT checkpoint imported as
v000000 of a file:// run store, and synthetic scored experience written as the score step writes it).
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from steps.demo.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer
from steps.errors import MoerlError
from steps.experience.tables import read_scored_experience
from steps.import_sft import import_sft
from steps.models.hf_checkpoint import save_pretrained
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.run.config import RunConfig
from steps.run.keys import scored_key
from steps.store.object_store import Store

REPO = Path(__file__).resolve().parents[1]

TINY = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
    max_position_embeddings=64, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)  # fmt: skip


def tiny_model(seed: int = 0, **overrides) -> MoeForCausalLM:
    """A small Qwen3-MoE with weights far enough from the default init that routing is not uniform."""
    torch.manual_seed(seed)
    model = MoeForCausalLM(MoeConfig(**{**TINY, **overrides}))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def make_run(tmp_path: Path, trainer: dict | None = None, **config) -> str:
    """A file:// run store with run.json and a tiny v000000; returns its URI."""
    sft = tmp_path / "sft"
    save_pretrained(tiny_model(), sft)
    save_tokenizer(sft)
    run_uri = (tmp_path / "run").as_uri()
    cfg = RunConfig(
        sft_checkpoint=sft.as_uri(), run_store=run_uri,
        trainer={"ep_backend": "alltoall", "micro_batch_size": 4, "lr": 1e-2, **(trainer or {})}, **config,
    )  # fmt: skip
    import_sft(sft.as_uri(), run_uri, cfg.model_dump_json())
    return run_uri


def experience_table(
    policy_version: int, prompts: int = 4, group: int = 4, seed: int = 0, vocab: int = VOCAB_SIZE
) -> pa.Table:
    """Scored experience as the score step writes it: GRPO groups with normalised advantages."""
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list] = {k: [] for k in (
        "prompt_id", "sample_index", "prompt_ids", "response_ids", "behavior_logprobs", "policy_version",
        "reward", "advantage")}  # fmt: skip
    for p in range(prompts):
        prompt_length = int(torch.randint(3, 7, (1,), generator=gen))
        prompt = [BOS_ID] + torch.randint(4, vocab, (prompt_length,), generator=gen).tolist()
        rewards = torch.rand(group, generator=gen)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        for s in range(group):
            length = int(torch.randint(2, 7, (1,), generator=gen))
            response = torch.randint(4, vocab, (length - 1,), generator=gen).tolist() + [EOS_ID]
            rows["prompt_id"].append(f"p{p:03d}")
            rows["sample_index"].append(s)
            rows["prompt_ids"].append(prompt)
            rows["response_ids"].append(response)
            rows["behavior_logprobs"].append((-4.0 * torch.rand(length, generator=gen) - 2.0).tolist())
            rows["policy_version"].append(policy_version)
            rows["reward"].append(float(rewards[s]))
            rows["advantage"].append(float(advantages[s]))
    schema = pa.schema([
        ("prompt_id", pa.string()), ("sample_index", pa.int32()), ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())), ("behavior_logprobs", pa.list_(pa.float32())),
        ("policy_version", pa.int64()), ("reward", pa.float32()), ("advantage", pa.float32()),
    ])  # fmt: skip
    return pa.table(rows, schema=schema)


def write_experience(run_uri: str, iteration: int, table: pa.Table) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    Store.open(run_uri).put_bytes(scored_key(iteration), buffer.getvalue())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def torchrun_update(run_uri: str, iteration: int, nproc: int = 2, *extra: str) -> list[str]:
    """The command line of a torchrun update on loopback with a free port. The `--` keeps torchrun's own
    parser from reading the step's --run as an abbreviation of its --run-path."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
        "127.0.0.1", "--master-port", str(free_port()), "-m", "steps.update", "--", "--run", run_uri,
        "--iteration", str(iteration), *extra,
    ]  # fmt: skip


def run_cmd(cmd: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=step_env(), capture_output=True, text=True, timeout=timeout)


def start_ranks(run_uri: str, iteration: int, world: int = 2, *extra: str) -> list[subprocess.Popen]:
    """`world` update processes with the environment torchrun gives its workers (RANK, WORLD_SIZE,
    MASTER_ADDR, ...), without torchrun's own agent process: one torch import less per launch."""
    port, procs = free_port(), []
    for rank in range(world):
        env = {
            **step_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "steps.update", "--run", run_uri, "--iteration", str(iteration), *extra],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
            )  # fmt: skip
        )
    return procs


def wait_ranks(procs: list[subprocess.Popen], timeout: int = 240) -> list[tuple[int, str, str]]:
    """(return code, stdout, stderr) of each rank."""
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


# ---------------------------------------------------------------------------------------------- tests


def test_rows_come_back_sorted_and_validated(tmp_path):
    run_uri = (tmp_path / "run").as_uri()
    table = experience_table(policy_version=0, prompts=3, group=2)
    write_experience(run_uri, 1, table.take(list(reversed(range(table.num_rows)))))  # shard order scrambled
    samples = read_scored_experience(Store.open(run_uri), 1, expected_version=0)
    assert [(s.prompt_id, s.sample_index) for s in samples] == [(f"p{p:03d}", i) for p in range(3) for i in range(2)]
    first = samples[0]
    assert first.prompt_ids == table.column("prompt_ids")[0].as_py()
    assert first.response_ids[-1] == EOS_ID
    assert len(first.behavior_logprobs) == len(first.response_ids)
    assert first.advantage == pytest.approx(table.column("advantage")[0].as_py())


def test_missing_experience_names_the_file_and_the_step(tmp_path):
    with pytest.raises(MoerlError, match=r"iter-000002/scored.parquet: no scored experience.*steps.score"):
        read_scored_experience(Store.open(tmp_path.as_uri()), 2, expected_version=1)


def test_experience_from_another_policy_version_is_refused(tmp_path):
    write_experience(tmp_path.as_uri(), 3, experience_table(policy_version=1))
    with pytest.raises(MoerlError, match=r"policy version\(s\) \[1\].*v000002"):
        read_scored_experience(Store.open(tmp_path.as_uri()), 3, expected_version=2)


def test_bad_rows_are_refused(tmp_path):
    table = experience_table(policy_version=0, prompts=1, group=2)
    short = table.set_column(4, "behavior_logprobs", pa.array([[-1.0], [-1.0]], pa.list_(pa.float32())))
    write_experience(tmp_path.as_uri(), 1, short)
    with pytest.raises(MoerlError, match="one log-prob per response token"):
        read_scored_experience(Store.open(tmp_path.as_uri()), 1, expected_version=0)
    nan = table.set_column(7, "advantage", pa.array([float("nan"), 0.0], pa.float32()))
    write_experience(tmp_path.as_uri(), 1, nan)
    with pytest.raises(MoerlError, match="NaN"):
        read_scored_experience(Store.open(tmp_path.as_uri()), 1, expected_version=0)
    write_experience(tmp_path.as_uri(), 1, table.drop_columns(["advantage"]))
    with pytest.raises(MoerlError, match=r"missing columns \['advantage'\]"):
        read_scored_experience(Store.open(tmp_path.as_uri()), 1, expected_version=0)
