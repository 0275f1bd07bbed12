"""The trainer's plan against its GPUs' memory: `moerl check` refuses a plan whose memory table is over the
trainer GPU's memory, naming the biggest term and the settings that would fit (tried on the table itself);
configs/eks-p5en.yaml fits as shipped; a CPU run is never judged; and the table's activation-checkpointing
term follows what autograd keeps in moerl's own layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_simulate_model_sizing import QWEN3_235B, SMALL_QWEN3, kept_bytes

from pipelines.cli import main
from pipelines.config import load_config
from pipelines.simulate.memory_check import fitting_changes, trainer_memory_problem, with_trainer
from pipelines.simulate.model_sizing import REFERENCE_CONFIG, model_sizing, reference_sizing
from pipelines.simulate.sizing import GPU_ASSUMPTIONS, trainer_memory_table
from steps.demo.char_tokenizer import save_tokenizer

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"


def test_the_eks_reference_fits_as_shipped_and_not_without_checkpointing():
    cfg = load_config(EKS, {})
    assert cfg.trainer.activation_checkpointing
    assert trainer_memory_table(cfg, GPU_ASSUMPTIONS, reference_sizing()).fits is True
    assert trainer_memory_problem(cfg, reference_sizing()) is None
    problem = trainer_memory_problem(with_trainer(cfg, activation_checkpointing=False), reference_sizing())
    assert problem is not None
    assert "needs 187.9 GB a GPU, more than the H200's 141 GB" in problem  # with DeepEP's 0.3 GB buffer
    assert "the biggest term is activations (2 x 4,352 tokens, fp32) (94.3 GB)" in problem
    assert "set trainer.activation_checkpointing: true;" in problem


def test_every_fix_offered_fits_and_the_plan_it_fixes_does_not():
    cfg = with_trainer(load_config(EKS, {}), activation_checkpointing=False, micro_batch_size=8)
    m = reference_sizing()
    assert trainer_memory_table(cfg, GPU_ASSUMPTIONS, m).fits is False
    fixes = fitting_changes(cfg, m)
    assert fixes
    for change in fixes:
        assert trainer_memory_table(with_trainer(cfg, **change), GPU_ASSUMPTIONS, m).fits is True, change


def test_qwen3_235b_fits_the_reference_cluster_with_fsdp_and_a_wider_ep_group():
    # EP 8 keeps 227B / 8 expert parameters a GPU, and without FSDP every GPU keeps the 8B non-expert ones
    problem = trainer_memory_problem(load_config(EKS, {}), model_sizing(QWEN3_235B, source="Qwen3-235B-A22B"))
    assert problem is not None and "Qwen3-235B-A22B (235.1B parameters)" in problem
    assert ("set trainer.fsdp: true and trainer.shard_experts: true; or trainer.fsdp: true and trainer.ep_size: 64; "
            "or trainer.fsdp: true and trainer.ep_size: 128") in problem  # fmt: skip


def test_a_gpu_no_setting_fits_is_said_so():
    cfg = load_config(EKS, {})
    small = GPU_ASSUMPTIONS.override({"gpu_memory_gb": 4.0})
    problem = trainer_memory_problem(cfg, reference_sizing(), small)
    assert problem is not None and "needs" in problem
    assert "no trainer setting moerl has makes it fit on these GPUs" in problem


def test_a_run_without_a_named_gpu_is_not_judged():
    cfg = load_config(REPO / "configs" / "demo.yaml", {"sft_checkpoint": "file:///x", "run_store": "file:///y"})
    assert trainer_memory_problem(cfg, model_sizing(QWEN3_235B)) is None


@pytest.fixture
def thirty_b_checkpoint(tmp_path) -> Path:
    """The config.json of Qwen3-30B-A3B with a tokenizer: what `moerl check` reads (no weights)."""
    directory = tmp_path / "sft"
    directory.mkdir()
    save_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(REFERENCE_CONFIG))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "abc", "answer": "cba"}) + "\n")
    return directory


def run_check(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["check", *argv])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.err + captured.out


def test_moerl_check_refuses_a_plan_that_does_not_fit_and_passes_the_one_that_does(thirty_b_checkpoint, capsys):
    prompts = thirty_b_checkpoint.parent / "p.jsonl"
    inputs = ["--set", f"sft_checkpoint={thirty_b_checkpoint}", "--set", f"prompt_file={prompts}"]
    code, out = run_check([str(EKS), *inputs, "--set", "trainer.activation_checkpointing=false"], capsys)
    assert code == 2, out
    assert "1 problem(s)" in out and "trainer memory:" in out and "(30.5B parameters)" in out
    assert "set trainer.activation_checkpointing: true" in out
    code, out = run_check([str(EKS), *inputs], capsys)
    assert code == 0 and "check out" in out, out


def test_the_checkpointing_term_follows_what_autograd_keeps():
    """With checkpointing, a layer more keeps its input (h values a token) and nothing else: autograd's saved
    bytes per added layer against the table's 4 h bytes a token."""
    for tokens in (32, 128):
        per_layer = kept_bytes(3, tokens, checkpointing=True) - kept_bytes(2, tokens, checkpointing=True)
        assert per_layer == 4 * SMALL_QWEN3["hidden_size"] * tokens, (tokens, per_layer)


def test_deepeps_buffer_is_sized_as_deepep_dd758ca_sizes_it():
    """calculate_buffer_size's arithmetic (csrc/elastic/buffer.hpp) worked by hand for DeepSeek-V3's hidden 7168,
    top-8, 4096 tokens a rank: one node of 8 ranks, then two nodes (hybrid: scale-out 2 x scale-up 8)."""
    from pipelines.simulate.model_sizing import deepep_buffer_bytes

    workspace = 14 * 1024 * 1024
    dispatch_token = 14336 + 128  # bf16 row; 12 k + 4 metadata bytes, 32-aligned
    one_node = dispatch_token * 4096 * 8  # = 473,956,352, a multiple of 2 MiB already
    assert deepep_buffer_bytes(8, 8, 4096, 7168, 8) == one_node + workspace
    combine_token = 14336 + 64  # bf16 row; 8 k metadata bytes
    dispatch = dispatch_token * (17 * 4096 + 2 * (4096 + 1280))  # 1,162,674,176
    combine = combine_token * (8 * 2 * 4096 + 2 * 4096 + 2 * (4096 + 1280))  # 1,216,512,000: the larger
    assert combine > dispatch
    aligned = -(-combine // (2 << 20)) * (2 << 20)
    assert aligned == 1_218_445_312
    assert deepep_buffer_bytes(16, 8, 4096, 7168, 8) == aligned + workspace


def test_the_rollout_engines_kv_cache_is_sglangs_cell_size():
    """SGLang 0.5.17's bytes a KV token (pool_configurator.py _compute_cell_size): MLA keeps kv_lora_rank +
    qk_rope_head_dim a layer on every TP rank (DeepSeek-V3: 576 x 61 x 2 = 70,272); GQA splits its KV heads over
    TP, at least one a rank."""
    from test_simulate_model_sizing import DEEPSEEK_V3, QWEN3_30B

    from pipelines.simulate.model_sizing import rollout_memory

    v3 = model_sizing(DEEPSEEK_V3)
    table, held = rollout_memory(v3, 8, 8, sequences=1, seq_len=1000, mem_fraction=0.85, gpu="H200", capacity_gb=141)
    assert table.rows[1][1] == pytest.approx(1000 * 70_272 / 1e9)
    qwen = model_sizing(QWEN3_30B)  # 4 KV heads of 128, 48 layers
    assert rollout_memory(qwen, 2, 2, 1, 1000, 0.85, "H200", 141)[0].rows[1][1] == pytest.approx(
        1000 * 2 * 256 * 48 * 2 / 1e9)
    assert rollout_memory(qwen, 8, 8, 1, 1000, 0.85, "H200", 141)[0].rows[1][1] == pytest.approx(
        1000 * 1 * 256 * 48 * 2 / 1e9)
    assert held == 0.0  # DeepSeek-V3's 168 GB of weights a GPU at TP 8 leave no pool at all
    assert rollout_memory(qwen, 8, 8, 512, 4352, 0.85, "H200", 141)[1] == 1.0
    _, held = rollout_memory(qwen, 8, 8, 4096, 32_768, 0.85, "H200", 141)
    assert 0 < held < 1  # the pool holds part of such a chunk at once


def test_moerl_check_refuses_an_engine_its_weights_fill():
    from test_simulate_model_sizing import DEEPSEEK_V3

    from pipelines.simulate.memory_check import rollout_memory_problem

    cfg = load_config(EKS, {})
    v3 = model_sizing(DEEPSEEK_V3, source="DeepSeek-V3")
    problem = rollout_memory_problem(cfg, v3)  # 671B in bf16 over 8 GPUs: 168 GB each
    assert problem is not None and "leaving no KV cache" in problem
    assert "no engine of at most one rollout pod's 8 GPUs holds its bf16 weights" in problem
    assert rollout_memory_problem(cfg, reference_sizing()) is None
    # a smaller engine than the pod allows: the fix is the pod's size
    narrow = load_config(EKS, {"rollout.sglang.tp_size": 2, "rollout.sglang.ep_size": 2})
    problem = rollout_memory_problem(narrow, model_sizing(QWEN3_235B, source="Qwen3-235B-A22B"))
    assert problem is not None and "set rollout.sglang.tp_size and ep_size to 8" in problem


def test_an_engine_larger_than_a_rollout_pod_is_refused_when_the_config_is_read():
    from steps.errors import MoerlError

    with pytest.raises(MoerlError, match=r"rollout.sglang.tp_size: 16 GPUs for one engine, but a rollout pod has 8"):
        load_config(EKS, {"rollout.sglang.tp_size": 16})


def test_fsdp_splits_the_non_expert_state_over_every_rank():
    from pipelines.simulate.model_sizing import trainer_memory

    m = model_sizing(QWEN3_235B)
    kw = {"micro_batch": 1, "seq_len": 1024, "kl_ref": False, "gpu": "H200", "capacity_gb": 141}
    plain = trainer_memory(m, ep=128, dp=1, **kw)
    sharded = trainer_memory(m, ep=128, dp=1, fsdp=True, **kw)
    states = {what: gb for what, gb in sharded.rows}
    per_gpu = m.non_expert / 128 + m.expert / 128
    assert sum(states[w] for w in states if w.startswith(("weights", "gradients", "fp32", "AdamW"))) == (
        pytest.approx(16 * per_gpu / 1e9))
    assert any(w.startswith("FSDP: two layers") for w in states)
    assert plain.fits is False and sharded.fits is True


def test_shard_experts_splits_each_ep_ranks_experts_over_its_replicas():
    from pipelines.simulate.model_sizing import trainer_memory

    m = model_sizing(QWEN3_235B)
    kw = {"micro_batch": 1, "seq_len": 1024, "kl_ref": False, "gpu": "H200", "capacity_gb": 141, "fsdp": True}
    sharded = trainer_memory(m, ep=8, dp=16, shard_experts=True, **kw)
    states = {what: gb for what, gb in sharded.rows}
    per_gpu = m.non_expert / 128 + m.expert / 8 / 16
    assert sum(states[w] for w in states if w.startswith(("weights", "gradients", "fp32", "AdamW"))) == (
        pytest.approx(16 * per_gpu / 1e9))
    assert any(w.startswith("shard_experts: two layers") for w in states)
    assert trainer_memory(m, ep=8, dp=16, **kw).fits is False and sharded.fits is True
