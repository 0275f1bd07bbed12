"""Shared by the engine, rollout, experience and score tests: a tiny policy checkpoint and an imported run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import torch
from model_helpers import randomize_

from steps.demo.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer
from steps.import_sft import import_sft
from steps.models.hf_checkpoint import save_pretrained
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.run.config import validate_config
from steps.store.object_store import Store

REPO = Path(__file__).resolve().parents[1]

TINY = dict(
    vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
    max_position_embeddings=128, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
)  # fmt: skip


def tiny_model(seed: int = 0, scale: float = 0.4, **overrides) -> MoeForCausalLM:
    """A randomly initialised tiny Qwen3-MoE with weights far from zero: sampling is far from uniform and
    about a third of 12-token samples end with <eos>, at varied lengths."""
    torch.manual_seed(seed)
    model = MoeForCausalLM(MoeConfig(**{**TINY, **overrides}))
    randomize_(model, seed + 1, scale)
    return model.eval()


def write_checkpoint(model: MoeForCausalLM, directory: Path) -> Path:
    save_pretrained(model, directory)
    save_tokenizer(directory)
    return directory


def make_run(tmp_path: Path, checkpoint_dir: Path, name: str = "run", **config) -> str:
    """A run store with the checkpoint imported as v000000 and run.json from `config` (validated)."""
    run_uri = (tmp_path / name).as_uri()
    data = {"sft_checkpoint": checkpoint_dir.as_uri(), "run_store": run_uri, **config}
    cfg = validate_config(data, "test config")
    import_sft(checkpoint_dir.as_uri(), run_uri, json.dumps(cfg.model_dump(mode="json")))
    return run_uri


def run_files(run_uri: str, prefix: str) -> dict[str, bytes]:
    """key -> bytes of every object below prefix."""
    run = Store.open(run_uri)
    return {key: run.get_bytes(key) for key in run.list(prefix)}


def read_parquet(run_uri: str, key: str):
    return pq.read_table(io.BytesIO(Store.open(run_uri).get_bytes(key)))


def step_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def run_step(module: str, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, env=step_env(),
        timeout=timeout,
    )  # fmt: skip
