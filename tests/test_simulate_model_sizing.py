"""Model-aware sizing (pipelines/simulate/model_sizing.py): parameter counts, bytes and FLOPs from a config.json
of every family moerl loads, the trainer's memory per GPU, and `moerl simulate --model-config`.

The configs below are the architecture fields of the models' published config.json (Hugging Face Hub). Where
transformers' config class defaults to the same model (DeepseekV3Config, MixtralConfig, GptOssConfig),
test_the_written_configs_are_transformers_defaults checks them against it; Qwen3MoeConfig() and Glm4MoeConfig()
default to other sizes (a 24-layer Qwen3-MoE, GLM-4.5-Air), so those three are written from the model cards'
architecture tables (Qwen3 technical report Table 2, GLM-4.5 report Table 1)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from family_helpers import saved_activation_bytes

from pipelines.config import load_config
from pipelines.simulate.cli import register
from pipelines.simulate.model_sizing import REFERENCE_CONFIG, model_sizing, reference_sizing, trainer_memory
from pipelines.simulate.sizing import GPU_ASSUMPTIONS, flops_seq_len, model_assumptions, trainer_memory_table

REPO = Path(__file__).resolve().parents[1]
EKS = REPO / "configs" / "eks-p5en.yaml"

QWEN3_30B: dict = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
QWEN3_235B = {**QWEN3_30B, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "num_nextn_predict_layers": 1, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
GPT_OSS_120B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "vocab_size": 201088,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18, "attention_bias": True,
    "max_position_embeddings": 131072, "rope_theta": 150000, "rms_norm_eps": 1e-05, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                            "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}}
GLM_45 = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 5120,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "use_qk_norm": True,
    "attention_bias": True, "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1, "vocab_size": 151552, "max_position_embeddings": 131072, "rope_theta": 1000000,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
KIMI_K2 = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "num_attention_heads": 64,
    "num_key_value_heads": 64, "first_k_dense_replace": 1, "vocab_size": 163840, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.827}
QWEN15_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "decoder_sparse_step": 1, "vocab_size": 151936, "max_position_embeddings": 8192,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

# (config, total, active, which count the card's "active" is, where the figures come from)
CARDS = [
    pytest.param(QWEN3_30B, 30.5e9, 3.3e9, "active", id="Qwen3-30B-A3B"),  # hf.co/Qwen/Qwen3-30B-A3B card
    pytest.param(QWEN3_235B, 235e9, 22e9, "active", id="Qwen3-235B-A22B"),  # hf.co/Qwen/Qwen3-235B-A22B card
    # hf.co/deepseek-ai/DeepSeek-V3 card: 671B main model (685B with the 14B multi-token-prediction module)
    pytest.param(DEEPSEEK_V3, 671e9, 37e9, "active", id="DeepSeek-V3"),
    # mistral.ai/news/mixtral-of-experts and arXiv 2401.04088: 46.7B total, 12.9B used per token
    pytest.param(MIXTRAL_8X7B, 46.7e9, 12.9e9, "active", id="Mixtral-8x7B"),
    # gpt-oss model card (arXiv 2508.10925, Table 1): 116.83B total, 5.13B active, which leaves the embedding
    # table out (active less the input embedding: `compute`)
    pytest.param(GPT_OSS_120B, 116.83e9, 5.13e9, "compute", id="gpt-oss-120b"),
    # GLM-4.5 report (arXiv 2508.06471, Table 1) and hf.co/zai-org/GLM-4.5: 355B total with its MTP layer (moerl
    # drops it: 353B), 32B activated without the embedding and the output layer
    pytest.param(GLM_45, 355e9, 32e9, "active_non_embedding", id="GLM-4.5"),
    # hf.co/Qwen/Qwen1.5-MoE-A2.7B card: 14.3B total, 2.7B activated (the qwen2_moe family)
    pytest.param(QWEN15_MOE, 14.3e9, 2.7e9, "active", id="Qwen1.5-MoE-A2.7B"),
]


@pytest.mark.parametrize(("config", "total", "active", "count"), CARDS)
def test_parameter_counts_match_the_model_cards(config, total, active, count):
    m = model_sizing(config)
    assert m.total == pytest.approx(total, rel=0.02)
    assert getattr(m, count) == pytest.approx(active, rel=0.02)
    assert m.expert + m.non_expert == m.total
    assert m.active == m.non_expert + m.expert * m.experts_per_token // m.num_experts
    assert m.version_bytes == 2 * m.total  # bf16


def test_kimi_k2_loads_as_deepseek_v3_and_sizes_to_a_trillion():
    m = model_sizing(KIMI_K2)  # hf.co/moonshotai/Kimi-K2-Instruct: 1T total, 32B activated (rounded figures)
    assert m.total == pytest.approx(1.0e12, rel=0.03) and m.active == pytest.approx(32e9, rel=0.03)
    assert m.num_experts == 384


def test_the_written_configs_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    for ours, cls in ((DEEPSEEK_V3, "DeepseekV3Config"), (MIXTRAL_8X7B, "MixtralConfig"),
                      (GPT_OSS_120B, "GptOssConfig"), (QWEN15_MOE, "Qwen2MoeConfig")):  # fmt: skip
        theirs = getattr(transformers, cls)().to_dict()
        for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_local_experts",
                    "num_experts", "num_experts_per_tok", "vocab_size", "first_k_dense_replace", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim"):  # fmt: skip
            if key in ours and theirs.get(key) is not None:
                assert ours[key] == theirs[key], (cls, key)
        assert model_sizing(theirs).total == model_sizing(ours).total


def test_the_built_in_reference_is_qwen3_30b_a3b():
    assert REFERENCE_CONFIG == QWEN3_30B
    ref = reference_sizing()
    # the built-in assumptions' figures: ~61 GB of bf16 weights, ~366 GB of AdamW state, ~5% outside the experts
    assert ref.version_bytes / 1e9 == pytest.approx(GPU_ASSUMPTIONS.checkpoint_gb, rel=0.01)
    assert ref.optimizer_bytes / 1e9 == pytest.approx(GPU_ASSUMPTIONS.optimizer_gb, rel=0.01)
    assert ref.replicated_fraction == pytest.approx(GPU_ASSUMPTIONS.replicated_fraction, abs=0.01)
    moved = model_assumptions(GPU_ASSUMPTIONS, ref, ref, 4352.0)
    assert moved.rollout_tokens_per_gpu_s == GPU_ASSUMPTIONS.rollout_tokens_per_gpu_s
    assert moved.trainer_tokens_per_gpu_s == GPU_ASSUMPTIONS.trainer_tokens_per_gpu_s


def test_flops_per_token_is_6n_plus_the_attention_term():
    m = model_sizing(QWEN3_30B)
    t = 4096.0
    # PaLM (arXiv 2204.02311, Appendix B): 6N + 12 L H Q T, N without the input embedding
    assert m.flops_per_token(t) == pytest.approx(6 * m.compute + 12 * 48 * 32 * 128 * t)
    dsv3 = model_sizing(DEEPSEEK_V3)  # MLA: d_qk = 128 + 64, d_v = 128
    assert dsv3.flops_per_token(t) == pytest.approx(6 * dsv3.compute + 6 * 61 * 128 * (192 + 128) * t)
    oss = model_sizing(GPT_OSS_120B)  # half the layers attend over the last 128 keys only
    assert oss.flops_per_token(t) == pytest.approx(6 * oss.compute + 6 * 64 * 128 * (18 * t + 18 * 128))


def test_a_bigger_model_moves_the_assumptions():
    ref, dsv3 = reference_sizing(), model_sizing(DEEPSEEK_V3)
    moved = model_assumptions(GPU_ASSUMPTIONS, dsv3, ref, 4352.0)
    assert moved.checkpoint_gb == pytest.approx(1342, rel=0.01) and moved.num_experts == 256
    assert moved.rollout_tokens_per_gpu_s < GPU_ASSUMPTIONS.rollout_tokens_per_gpu_s / 10
    assert moved.trainer_tokens_per_gpu_s < GPU_ASSUMPTIONS.trainer_tokens_per_gpu_s / 9
    assert moved.engine_startup_s > GPU_ASSUMPTIONS.engine_startup_s + 1200


def test_the_trainer_memory_table():
    m = model_sizing(QWEN3_235B)
    table = trainer_memory(m, ep=8, dp=16, micro_batch=1, seq_len=1024, kl_ref=False, gpu="H200", capacity_gb=141)
    params = m.non_expert + m.expert / 8
    states = sum(gb for what, gb in table.rows if not what.startswith(("activations", "logits")))
    assert states == pytest.approx(16 * params / 1e9)
    # issue 28: EP 8 inside a node cannot hold 235B-A22B: 8.0B + 227.1B / 8 = 36.4B parameters a GPU, 582 GB
    assert 36.3e9 < params < 36.5e9 and table.total_gb > 4 * 141 and table.fits is False
    # EP over all 128 GPUs still leaves the 8.0B non-expert parameters (16 bytes each) on every GPU: 156 GB
    wide = trainer_memory(m, ep=128, dp=1, micro_batch=1, seq_len=1024, kl_ref=False, gpu="H200", capacity_gb=141)
    assert wide.total_gb < table.total_gb / 3 and wide.fits is False
    small = trainer_memory(reference_sizing(), ep=8, dp=16, micro_batch=1, seq_len=1024, kl_ref=False, gpu="H200",
                           capacity_gb=141)  # fmt: skip
    assert small.fits is True and "fits in the H200's 141 GB: headroom" in "\n".join(small.lines())
    with_ref = trainer_memory(m, ep=8, dp=16, micro_batch=1, seq_len=1024, kl_ref=True, gpu="H200", capacity_gb=141)
    assert with_ref.total_gb == pytest.approx(table.total_gb + 4 * params / 1e9)


def test_the_eks_config_sizes_its_trainer_on_h200s():
    cfg = load_config(EKS, {})
    table = trainer_memory_table(cfg, GPU_ASSUMPTIONS, reference_sizing())
    assert table.gpu == "H200" and table.capacity_gb == 141
    assert any("2 x 4,352 tokens" in what for what, _ in table.rows)
    assert flops_seq_len(cfg, GPU_ASSUMPTIONS) == 256 + 4096


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", *argv])
    return args.func(args)


def mean_iteration(out: str) -> tuple[float, float]:
    sync, async_ = re.search(r"iteration time, mean\s+([\d,.]+) s\s+([\d,.]+) s", out).groups()
    return float(sync.replace(",", "")), float(async_.replace(",", ""))


def test_simulate_without_a_readable_config_says_it_prices_the_built_in_model(capsys):
    assert run_cli([str(EKS), "--iterations", "3"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("model: ")]
    assert len(lines) == 1 and "not readable here" in lines[0] and "built-in Qwen3-30B-A3B figures" in lines[0]
    assert "30.5B parameters" in out and "trainer memory per GPU" in out and "H200's 141 GB" in out


def test_a_deepseek_v3_config_changes_the_counts_and_the_iteration_time(tmp_path, capsys):
    run_cli([str(EKS), "--iterations", "3"])
    builtin = capsys.readouterr().out
    config = tmp_path / "config.json"
    config.write_text(json.dumps(DEEPSEEK_V3))
    assert run_cli([str(EKS), "--iterations", "3", "--model-config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"model: {config}" in out and "not readable" not in out
    assert "671.0B parameters" in out and "256 routed experts" in out and "37.6B active" in out
    assert "30.5B parameters" not in out and "does NOT fit" in out
    assert all(d > 3 * b for d, b in zip(mean_iteration(out), mean_iteration(builtin), strict=True))
    # --assume still has the last word over the model's figures
    run_cli([str(EKS), "--iterations", "3", "--model-config", str(config), "--assume", "checkpoint_gb=61"])
    assert "(61 GB of weights" in capsys.readouterr().out


def test_a_qwen3_30b_config_prices_as_the_built_in_figures(tmp_path, capsys):
    run_cli([str(EKS), "--iterations", "3"])
    builtin = mean_iteration(capsys.readouterr().out)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN3_30B))
    run_cli([str(EKS), "--iterations", "3", "--model-config", str(tmp_path)])  # a directory holding config.json
    assert mean_iteration(capsys.readouterr().out) == pytest.approx(builtin, rel=0.01)


SMALL_QWEN3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 128,
               "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
               "vocab_size": 64, "tie_word_embeddings": False, "torch_dtype": "float32"}  # fmt: skip


def kept_bytes(layers: int, tokens: int, checkpointing: bool = False) -> int:
    """What moerl's own small Qwen3-MoE of `layers` layers keeps for its backward on one row of `tokens`."""
    import torch

    from steps.models.registry import config_from_hf, family_of

    torch.manual_seed(0)
    cfg = config_from_hf({**SMALL_QWEN3, "num_hidden_layers": layers})
    model = family_of(cfg).build(cfg).float()
    model.activation_checkpointing = checkpointing
    return saved_activation_bytes(model, torch.randint(0, 64, (1, tokens)))


def test_the_activation_formula_follows_what_autograd_keeps():
    """The formula's per-token, per-layer count against the bytes autograd saves in moerl's own Qwen3-MoE layer
    (a small one, fp32, on this CPU): what a layer adds, fitted as const + b T + c T^2 over three lengths; c is the
    CPU attention's heads x T^2 probabilities (CUDA's memory-efficient kernel keeps none), b is the formula's."""
    import numpy as np

    base = SMALL_QWEN3
    kept = kept_bytes
    lengths = [64, 128, 256]
    per_layer = [kept(3, t) - kept(2, t) for t in lengths]
    _, per_token, per_token_squared = np.linalg.solve(np.array([[1, t, t * t] for t in lengths], float), per_layer)
    assert per_token_squared == pytest.approx(4 * 4)  # heads x fp32
    formula = 4 * model_sizing({**base, "num_hidden_layers": 1}).layer_activation_elements[0]
    assert per_token <= formula <= 1.25 * per_token  # rough, and on the safe side
