"""The sglang.Engine kwargs each model family needs for deterministic inference (steps/engines/sglang_engine.py
family_server_args), held to SGLang 0.5.17 (python/sglang/srt/, cited there): off Hopper, DeepSeek-V3/Kimi-K2
and gpt-oss must be given a deterministic attention backend (SGLang's own pick, trtllm_mla / trtllm_mha, fails
_deterministic_attention_backend), and the MoE runner stays triton where sm100 would pick flashinfer_trtllm;
Mixtral and gpt-oss have no DeepEP path in SGLang. Qwen3-Next gets triton attention and no radix cache on every
GPU (its linear-attention layers: chunk-aligned prefill splits, no cached SSM states), and a config SGLang's
Qwen3NextConfig would read as another model is refused. The names passed are ServerArgs fields (the fake holds
them, tests/fake_sglang), and the fake refuses what upstream refuses."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from transformers import (
    DeepseekV3Config,
    Glm4MoeConfig,
    GptOssConfig,
    MiniMaxM2Config,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3_5MoeConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

from steps.engines import sglang_engine
from steps.engines.sglang_engine import (
    DETERMINISTIC_ATTENTION_BACKENDS,
    GPT_OSS_ATTENTION_BACKENDS,
    MLA_DETERMINISTIC_ATTENTION_BACKENDS,
    QWEN3_NEXT_SERVER_ARGS,
    SGLANG_MODELS,
    SGLangEngine,
    SGLangSettings,
    family_server_args,
    sglang_architecture,
)
from steps.errors import MoerlError
from steps.models.registry import FAMILIES

FAKE_SGLANG = Path(__file__).parent / "fake_sglang" / "sglang" / "__init__.py"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip
HOPPER, BLACKWELL = 90, 100


def tiny(config_class, **extra) -> dict:
    """A small config.json dict of the family, as transformers writes it (no `architectures`: by model_type)."""
    return config_class(**TINY, **extra).to_dict()


def tiny_qwen3_next(interval: int = 2, **extra) -> dict:
    """A small Qwen3-Next config.json dict: transformers' layer_types (from full_attention_interval, which its
    to_dict drops) and the interval beside them, as moerl publishes it (steps/models/qwen3_next/config.py)."""
    sizes = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 32, "head_dim": 16, "linear_num_key_heads": 2,
             "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # fmt: skip
    config = tiny(Qwen3NextConfig, **sizes, full_attention_interval=interval, **extra)
    return {**config, "full_attention_interval": interval}


def tiny_qwen3_5_moe(**text_extra) -> dict:
    """A small Qwen3.5-MoE config.json dict as transformers writes it (text_config with layer_types and
    rope_parameters, vision_config), with text_config's full_attention_interval beside them, as the releases have it
    and moerl writes it (steps/models/qwen3_5_moe/config.py)."""
    text = {**TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "head_dim": 16, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "layer_types": ["linear_attention", "full_attention"]}  # fmt: skip
    del text["intermediate_size"]
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": 64}
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision).to_dict()
    config["text_config"].update({"full_attention_interval": 2, **text_extra})
    return config


CONFIGS = {
    "qwen3_moe": tiny(Qwen3MoeConfig, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": tiny(Qwen2MoeConfig, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": tiny(DeepseekV3Config, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "glm4_moe": tiny(Glm4MoeConfig, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": tiny(MixtralConfig, num_local_experts=8, num_experts_per_tok=2),
    "gpt_oss": tiny(GptOssConfig, num_local_experts=8, num_experts_per_tok=2),
    "minimax_m2": tiny(MiniMaxM2Config, num_local_experts=8, num_experts_per_tok=2, head_dim=16, rotary_dim=8,
                       use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True),
    "qwen3_next": tiny_qwen3_next(),
    "qwen3_5_moe": tiny_qwen3_5_moe(),
}  # fmt: skip
# Kimi-K2's config.json: model_type kimi_k2, served by SGLang as DeepseekV3ForCausalLM.
KIMI_K2 = {**CONFIGS["deepseek_v3"], "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}

# family -> (kwargs off Hopper with moe_a2a_backend none, the same on Hopper)
EXPECTED = {
    "qwen3_moe": ({"moe_runner_backend": "triton"}, {}),
    "qwen2_moe": ({}, {}),
    "deepseek_v3": ({"attention_backend": "triton", "moe_runner_backend": "triton"}, {}),
    "glm4_moe": ({"moe_runner_backend": "triton"}, {}),
    "mixtral": ({}, {}),
    "gpt_oss": ({"attention_backend": "triton"}, {}),
    "minimax_m2": ({}, {}),  # SGLang builds no trtllm MoE override for MiniMaxM2ForCausalLM
    # triton attention and no radix cache everywhere (QWEN3_NEXT_SERVER_ARGS), the triton MoE runner off Hopper
    "qwen3_next": ({"attention_backend": "triton", "disable_radix_cache": True, "moe_runner_backend": "triton"},
                   {"attention_backend": "triton", "disable_radix_cache": True}),
    # the same hybrid to SGLang (its config class a Qwen3NextConfig, the same overrides)
    "qwen3_5_moe": ({"attention_backend": "triton", "disable_radix_cache": True, "moe_runner_backend": "triton"},
                    {"attention_backend": "triton", "disable_radix_cache": True}),
}  # fmt: skip


def load_fake_sglang(monkeypatch):
    """The fake, as `sglang` in sys.modules for this test only (its dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location("sglang", FAKE_SGLANG)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sglang", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_each_familys_kwargs_off_hopper_on_hopper_and_unknown(family):
    config = CONFIGS[family]
    off_hopper, on_hopper = EXPECTED[family]
    assert family_server_args(config, sm=BLACKWELL) == off_hopper
    assert family_server_args(config, sm=120) == off_hopper
    assert family_server_args(config) == off_hopper  # unknown GPU: the arch-independent choice
    assert family_server_args(config, sm=HOPPER) == on_hopper  # SGLang's own fa3 is deterministic there
    # the same with the architecture named, as a published checkpoint's config.json names it
    named = {**config, "architectures": [sglang_engine.SGLANG_ARCHITECTURES[family]]}
    assert family_server_args(named, sm=BLACKWELL) == off_hopper


def test_kimi_k2_is_served_as_deepseek_v3():
    assert sglang_architecture(KIMI_K2) == "DeepseekV3ForCausalLM"
    assert family_server_args(KIMI_K2, sm=BLACKWELL) == EXPECTED["deepseek_v3"][0]
    assert family_server_args({"model_type": "kimi_k2"}, sm=BLACKWELL) == EXPECTED["deepseek_v3"][0]


def test_the_attention_backends_given_are_ones_upstream_accepts_for_the_family():
    """triton is in DETERMINISTIC_ATTENTION_BACKEND_CHOICES (server_args.py:220), in the MLA list that
    DeepSeek models need under deterministic inference (:228, :7849-7855), and among gpt-oss's sink backends
    (:5334); the backends SGLang would pick on sm100 for them are not deterministic."""
    assert family_server_args(CONFIGS["deepseek_v3"])["attention_backend"] in MLA_DETERMINISTIC_ATTENTION_BACKENDS
    gpt_oss = family_server_args(CONFIGS["gpt_oss"])["attention_backend"]
    assert gpt_oss in GPT_OSS_ATTENTION_BACKENDS and gpt_oss in DETERMINISTIC_ATTENTION_BACKENDS
    assert set(MLA_DETERMINISTIC_ATTENTION_BACKENDS) <= set(DETERMINISTIC_ATTENTION_BACKENDS)
    for sm100_default in ("trtllm_mla", "trtllm_mha"):  # overrides.py:639, :880, :1261 (Qwen3-Next)
        assert sm100_default not in DETERMINISTIC_ATTENTION_BACKENDS
    # Qwen3-Next: deterministic, keeps SGLang's radix-capable list (server_args.py:228), chunk-aligned prefill splits
    for sm in (None, HOPPER, BLACKWELL):
        qwen3_next = family_server_args(CONFIGS["qwen3_next"], sm=sm)["attention_backend"]
        assert qwen3_next in MLA_DETERMINISTIC_ATTENTION_BACKENDS and qwen3_next != "fa3"


def test_under_deepep_the_moe_runner_is_left_to_sglang():
    for family in ("qwen3_moe", "deepseek_v3", "glm4_moe", "qwen2_moe", "minimax_m2", "qwen3_next", "qwen3_5_moe"):
        kwargs = family_server_args(CONFIGS[family], moe_a2a_backend="deepep", sm=BLACKWELL)
        assert "moe_runner_backend" not in kwargs
    # Qwen3-Next's Qwen2MoeSparseMoeBlock has a DeepEP forward (models/qwen2_moe.py:461)
    assert family_server_args(CONFIGS["qwen3_next"], moe_a2a_backend="deepep", sm=HOPPER) == QWEN3_NEXT_SERVER_ARGS
    # MiniMaxM2ForCausalLM has a DeepEP path in SGLang 0.5.17 (models/minimax_m2.py): served over it as it is
    assert family_server_args(CONFIGS["minimax_m2"], moe_a2a_backend="deepep", sm=HOPPER) == {}
    assert family_server_args(CONFIGS["deepseek_v3"], moe_a2a_backend="deepep") == {"attention_backend": "triton"}


@pytest.mark.parametrize("family, arch", [("mixtral", "MixtralForCausalLM"), ("gpt_oss", "GptOssForCausalLM")])
def test_deepep_is_refused_for_the_families_sglang_has_no_deepep_path_for(family, arch):
    with pytest.raises(MoerlError, match=rf"cannot serve {arch} \(model_type '{family}'\) over DeepEP") as err:
        family_server_args(CONFIGS[family], moe_a2a_backend="deepep", sm=HOPPER)
    assert "moe_a2a_backend: none" in str(err.value)
    assert family_server_args(CONFIGS[family], moe_a2a_backend="none", sm=HOPPER) == {}


def test_recorded_routes_are_refused_where_sglang_captures_none_per_layer():
    """SGLang 0.5.17's Mixtral and MiniMax-M2 build their TopK without layer_id (models/mixtral.py,
    models/minimax_m2.py), and the capturer indexes its buffer by it (layers/moe/state_capturer/base.py); the
    families whose TopK gets layer_id record their routes."""
    with pytest.raises(MoerlError, match=r"records no per-layer routes for MixtralForCausalLM .*routing_replay: none"):
        family_server_args(CONFIGS["mixtral"], sm=HOPPER, record_routes=True)
    with pytest.raises(MoerlError, match=r"records no per-layer routes for MiniMaxM2ForCausalLM .*routing_replay: no"):
        family_server_args(CONFIGS["minimax_m2"], sm=BLACKWELL, record_routes=True)
    named = {**CONFIGS["minimax_m2"], "architectures": ["MiniMaxM2ForCausalLM"]}
    with pytest.raises(MoerlError, match=r"MiniMaxM2MoE builds TopK\(\.\.\.\) without layer_id"):
        family_server_args(named, moe_a2a_backend="deepep", sm=HOPPER, record_routes=True)
    for family in ("qwen3_moe", "qwen2_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_next", "qwen3_5_moe"):
        assert family_server_args(CONFIGS[family], sm=HOPPER, record_routes=True) == family_server_args(
            CONFIGS[family], sm=HOPPER)  # fmt: skip


def test_an_architecture_moerl_does_not_know_gets_nothing_extra():
    assert family_server_args({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}) == {}
    assert family_server_args({}) == {}


def test_the_names_are_server_args_fields_and_the_fake_refuses_what_upstream_refuses(monkeypatch):
    fake = load_fake_sglang(monkeypatch)
    for config in (*CONFIGS.values(), KIMI_K2):
        for sm in (None, HOPPER, BLACKWELL):
            assert set(family_server_args(config, sm=sm)) <= fake.SERVER_ARGS
    assert set(DETERMINISTIC_ATTENTION_BACKENDS) == fake.DETERMINISTIC_ATTENTION_BACKEND_CHOICES
    with pytest.raises(ValueError, match="supported for deterministic inference"):
        fake.Engine(model_path="/nonexistent", enable_deterministic_inference=True, attention_backend="trtllm_mla")


def test_the_engine_passes_the_familys_kwargs(tmp_path, monkeypatch):
    """SGLangEngine adds family_server_args to the kwargs it starts sglang.Engine with (the fake records them)."""
    load_fake_sglang(monkeypatch)
    monkeypatch.setattr(sglang_engine, "sglang_unavailable_reason", lambda: None)
    monkeypatch.setattr(sglang_engine, "_device_sm", lambda: BLACKWELL)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")  # restored afterwards; the engine sets it
    record = tmp_path / "kwargs.json"
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIGS["deepseek_v3"], "dtype": "bfloat16"}))
    engine = SGLangEngine(model, SGLangSettings())
    try:
        kwargs = json.loads(record.read_text())
        assert kwargs["attention_backend"] == "triton" and kwargs["moe_runner_backend"] == "triton"
        assert kwargs["enable_deterministic_inference"] is True
    finally:
        engine.close()
        engine.engine.loop.close()
        asyncio.set_event_loop(None)
    (model / "config.json").write_text(json.dumps({**CONFIGS["mixtral"], "dtype": "bfloat16"}))
    with pytest.raises(MoerlError, match="MixtralForCausalLM"):
        SGLangEngine(model, SGLangSettings(tp_size=2, ep_size=2, moe_a2a_backend="deepep"))


@pytest.mark.parametrize(
    ("extra", "why"),
    [({"mlp_only_layers": [0]}, "every layer sparse"), ({"decoder_sparse_step": 2}, "every layer sparse"),
     ({"head_dim": 32}, "hidden_size // num_attention_heads"),
     ({"tie_word_embeddings": True}, "output projection of its own")],
)  # fmt: skip
def test_qwen2_moe_configs_sglang_would_serve_as_another_model_are_refused(extra, why):
    """SGLang 0.5.17's qwen2_moe.py loads these and computes another model: refused before it starts."""
    config = tiny(Qwen2MoeConfig, **extra)
    with pytest.raises(MoerlError, match=rf"SGLang 0.5.17 would serve another model .*{why}.*rollout.engine: torch"):
        family_server_args(config, sm=HOPPER)
    assert family_server_args(tiny(Qwen2MoeConfig), sm=HOPPER) == {}  # the published Qwen2-MoE layouts serve


@pytest.mark.parametrize(
    ("config", "why"),
    [({k: v for k, v in CONFIGS["qwen3_next"].items() if k != "full_attention_interval"},
      "full_attention_interval None: .*no default"),
     ({**CONFIGS["qwen3_next"], "layer_types": ["full_attention", "linear_attention"]},
      r"reads full_attention_interval alone and would place \['linear_attention', 'full_attention'\]"),
     ({**CONFIGS["qwen3_next"], "full_attention_interval": 1}, "would place"),
     (tiny_qwen3_next(mlp_only_layers=[0]), "every layer sparse"),
     (tiny_qwen3_next(decoder_sparse_step=2), "every layer sparse"),
     ({**CONFIGS["qwen3_next"], "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
      r"rope_parameters.rope_theta 1000000.0: .*top-level rope_theta \(10000.0, its default\)"),
     ({**CONFIGS["qwen3_next"], "rope_theta": 1e6}, r"rope_parameters.rope_theta 10000.0: .*\(1000000.0\)"),
     ({**CONFIGS["qwen3_next"], "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
      "rope_parameters.partial_rotary_factor 0.5"),
     ({**CONFIGS["qwen3_next"], "attn_output_gate": False}, "always gates"),
     ({**CONFIGS["qwen3_next"], "tie_word_embeddings": True}, "output projection of its own")],
)  # fmt: skip
def test_qwen3_next_configs_sglang_would_serve_as_another_model_are_refused(config, why):
    """SGLang 0.5.17's Qwen3NextConfig places the full-attention layers by full_attention_interval alone (no default,
    layer_types dropped: configs/qwen3_next.py:218, :259-268), makes every layer sparse (models/qwen3_next.py:525,
    :695), reads the top-level rope_theta / partial_rotary_factor (defaults 10000.0, 0.25) and never ties lm_head."""
    with pytest.raises(MoerlError, match=rf"SGLang 0.5.17 would serve another model .*{why}.*rollout.engine: torch"):
        family_server_args(config, sm=HOPPER)


def test_the_qwen3_next_layouts_moerl_publishes_and_qwen_releases_are_served():
    from steps.models.qwen3_next.config import Qwen3NextConfig as MoerlQwen3NextConfig

    published = MoerlQwen3NextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        head_dim=16, rope_theta=1e7,
    ).to_hf_dict()  # fmt: skip
    assert published["full_attention_interval"] == 4 and published["rope_parameters"]["rope_theta"] == 1e7
    assert family_server_args(published, sm=HOPPER) == QWEN3_NEXT_SERVER_ARGS
    # Qwen3-Next-80B-A3B's layout: the interval, top-level RoPE, no layer_types
    release = {k: v for k, v in CONFIGS["qwen3_next"].items() if k not in ("layer_types", "rope_parameters")}
    release.update({"architectures": ["Qwen3NextForCausalLM"], "full_attention_interval": 4, "rope_theta": 1e7,
                    "partial_rotary_factor": 0.25})  # fmt: skip
    assert family_server_args(release, sm=BLACKWELL) == EXPECTED["qwen3_next"][0]


def test_the_engine_passes_qwen3_nexts_kwargs(tmp_path, monkeypatch):
    """SGLangEngine starts a Qwen3-Next checkpoint with triton attention and no radix cache, and refuses one
    SGLang would read with other layer kinds before starting it."""
    load_fake_sglang(monkeypatch)
    monkeypatch.setattr(sglang_engine, "sglang_unavailable_reason", lambda: None)
    monkeypatch.setattr(sglang_engine, "_device_sm", lambda: HOPPER)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")  # restored afterwards; the engine sets it
    record = tmp_path / "kwargs.json"
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(record))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**CONFIGS["qwen3_next"], "dtype": "bfloat16"}))
    engine = SGLangEngine(model, SGLangSettings())
    try:
        kwargs = json.loads(record.read_text())
        assert kwargs["attention_backend"] == "triton" and kwargs["disable_radix_cache"] is True
        assert "moe_runner_backend" not in kwargs and kwargs["enable_deterministic_inference"] is True
    finally:
        engine.close()
        engine.engine.loop.close()
        asyncio.set_event_loop(None)
    record.unlink()
    wrong = {**CONFIGS["qwen3_next"], "layer_types": ["full_attention", "linear_attention"], "dtype": "bfloat16"}
    (model / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(MoerlError, match="Qwen3NextForCausalLM checkpoint .*full_attention_interval alone"):
        SGLangEngine(model, SGLangSettings())
    assert not record.exists()  # refused before sglang.Engine started


@pytest.mark.parametrize(
    "config",
    [{**CONFIGS["deepseek_v3"], "model_type": "deepseek_v32", "index_topk": 2048, "index_n_heads": 64},
     {**CONFIGS["deepseek_v3"], "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]},
     {**CONFIGS["deepseek_v3"], "index_topk": 2048},
     {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"]}],
    ids=["by_model_type", "by_architecture", "deepseek_v3_with_index_topk", "glm5"],
)  # fmt: skip
def test_deepseek_sparse_attention_is_refused_for_sglang_with_the_reason(config):
    """SGLang 0.5.17 serves DSA only with its 'dsa' backend, which deterministic inference refuses
    (arg_groups/overrides.py:551-574, :1980-2012); with 'triton' its indexer returns nothing (dense attention)."""
    for sm in (HOPPER, BLACKWELL):
        with pytest.raises(MoerlError, match=r"DeepSeek sparse attention to SGLang 0.5.17, .*'dsa' .*refused under "
                                             r"deterministic inference.*rollout.engine: torch") as err:  # fmt: skip
            family_server_args(config, sm=sm)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("config", [{"model_type": "deepseek_v4"}, {"architectures": ["DeepseekV4ForCausalLM"]}],
                         ids=["by_model_type", "by_architecture"])  # fmt: skip
def test_deepseek_v4_is_refused_for_sglang_with_the_reason(config):
    """SGLang 0.5.17 sets the 'dsv4' backend over any other for DeepSeek-V4 (arg_groups/overrides.py:1081-1090),
    which deterministic inference refuses (:2004-2008)."""
    for sm in (HOPPER, BLACKWELL):
        with pytest.raises(MoerlError, match=r"DeepseekV4ForCausalLM is compressed attention to SGLang 0.5.17, .*"
                                             r"'dsv4' .*refused under deterministic inference.*rollout.engine: torch"
                           ) as err:  # fmt: skip
            family_server_args(config, sm=sm)
        assert "\n" not in str(err.value)


def test_every_family_is_a_model_sglang_registers():
    """Each family's architecture is a model class SGLang 0.5.17 registers (SGLANG_MODELS: its EntryClass lines),
    and the architecture moerl serves it as; where SGLang is installed (the GPU rollout image), its ModelRegistry
    has each."""
    for model_type, family in FAMILIES.items():
        assert sglang_engine.SGLANG_ARCHITECTURES[model_type] in family.architectures
        if model_type in ("deepseek_v32", "glm_moe_dsa", "deepseek_v4"):  # registered, refused (the tests above)
            continue
        assert all(arch in SGLANG_MODELS for arch in family.architectures), model_type
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed here (it is in the GPU rollout image): the registry itself is not read")
    from sglang.srt.models.registry import ModelRegistry

    registered = set(ModelRegistry.get_supported_archs())
    assert {arch for family in FAMILIES.values() for arch in family.architectures} <= registered


@pytest.mark.parametrize(
    ("config", "why"),
    [(tiny_qwen3_5_moe(full_attention_interval=None), "text_config.full_attention_interval None: .*no default"),
     (tiny_qwen3_5_moe(full_attention_interval=1), r"would place \['full_attention', 'full_attention'\]"),
     (tiny_qwen3_5_moe(rope_parameters={"rope_type": "default"}), "rope_parameters without rope_theta"),
     (tiny_qwen3_5_moe(partial_rotary_factor=0.5), r"rope_parameters.partial_rotary_factor 0.25: .*\(0.5\)"),
     (tiny_qwen3_5_moe(attn_output_gate=False), "always gates"),
     ({k: v for k, v in tiny_qwen3_5_moe().items() if k != "text_config"}, "no text_config")],
)  # fmt: skip
def test_qwen3_5_moe_configs_sglang_would_serve_as_another_model_are_refused(config, why):
    """SGLang 0.5.17's Qwen3_5TextConfig is a Qwen3NextConfig (configs/qwen3_5.py:15): layers placed by
    full_attention_interval alone, rope_theta read from rope_parameters only, partial_rotary_factor from text_config
    itself (models/qwen3_5.py:872)."""
    with pytest.raises(MoerlError, match=rf"SGLang 0.5.17 would serve another model .*{why}.*rollout.engine: torch"):
        family_server_args(config, sm=HOPPER)


def test_the_qwen3_5_moe_layout_moerl_publishes_is_served():
    from steps.models.registry import config_from_hf

    release = tiny_qwen3_5_moe()
    release["text_config"]["vocab_size"] = 128
    published = config_from_hf(release).to_hf_dict()
    assert published["text_config"]["full_attention_interval"] == 2
    assert family_server_args(published, sm=HOPPER) == QWEN3_NEXT_SERVER_ARGS
    assert sglang_architecture(published) == "Qwen3_5MoeForConditionalGeneration"
