"""DeepSeek-V4 (model_type deepseek_v4) against transformers 5.23's DeepseekV4ForCausalLM: a tiny random checkpoint
made by transformers' own config class with every layer kind (sliding, compressed sparse with its indexer choosing
fewer entries than there are, heavily compressed; hash-routed and top-k routed MoE layers), saved by transformers and
renamed to the release's layout on import. The release's names, the config both ways (transformers' keys and the
release's legacy ones), fp32 logits (unpadded and right-padded rows exactly as transformers; left-padded and packed
rows and shared prompts as each sequence alone: transformers cuts its compressed windows by row index, so its own
left-padded rows differ), gradients, publishing what transformers loads, EP=2 over gloo, the torch engine's decode
against transformers' forward, and the refusals."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from family_helpers import (
    assert_close_to_scale,
    assert_engine_records_the_routers_choice,
    assert_same_logits,
    edit_config,
    expert_grads,
    probe_batch,
    right_padded_batch,
    save_rows_and_expert_grads,
)
from model_helpers import randomize_, response_logits
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import DeepseekV4Config as HfConfig
from transformers import DeepseekV4ForCausalLM as HfModel

from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.deepseek_v4.config import DeepseekV4Config
from steps.models.deepseek_v4.layout import release_name
from steps.models.deepseek_v4.spec import DEEPSEEK_V4
from steps.models.family import is_frozen
from steps.models.hf_checkpoint import (
    check_checkpoint,
    expected_tensor_shapes,
    load_pretrained,
    save_pretrained,
    tensor_index,
)
from steps.models.import_conversions import convert_on_import
from steps.models.kernels import token_logprobs
from steps.models.placement import ExpertPlacement
from steps.models.registry import config_from_hf, family_of

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# A: every layer kind, hash layers first, default rotaries, untied. B: the compress rotary YaRN, tied embeddings,
#    heavily compressed first, one hash layer, 3 streams, a wider sliding window.
CONFIGS = {
    "every_kind": dict(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4, partial_rotary_factor=0.25,
        layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 8}, sliding_window=6, index_topk=2, index_n_heads=4, index_head_dim=16,
        hc_mult=4, o_groups=2, o_lora_rank=8, max_position_embeddings=256,
    ),
    "yarn_tied": dict(
        vocab_size=64, hidden_size=24, moe_intermediate_size=12, num_hidden_layers=3, num_attention_heads=2,
        head_dim=16, q_lora_rank=12, num_experts_per_tok=3, n_routed_experts=6, partial_rotary_factor=0.5,
        layer_types=[HCA, CSA, SLIDING], mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={CSA: 3, HCA: 5}, sliding_window=9, index_topk=3, index_n_heads=8, index_head_dim=12,
        hc_mult=3, o_groups=2, o_lora_rank=6, max_position_embeddings=256, tie_word_embeddings=True,
        routed_scaling_factor=2.0, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    ),
}  # fmt: skip
ATOL = 1e-4


def hf_model(kwargs: dict, seed: int) -> HfModel:
    """transformers' model of `kwargs`: weights far from their init, a random correction bias and hash table."""
    torch.manual_seed(seed)
    hf = HfModel(HfConfig(**kwargs))
    randomize_(hf, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("tid2eid"):
                buffer.copy_(torch.randint(0, kwargs["n_routed_experts"], buffer.shape, generator=gen))
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)
    return hf.eval()


def release_checkpoint(kwargs: dict, seed: int, directory) -> HfModel:
    """transformers' save of hf_model(kwargs, seed) in `directory`, renamed to the release's layout as import does;
    returns the model."""
    hf = hf_model(kwargs, seed)
    hf.save_pretrained(directory)
    convert_on_import(directory, say=lambda line: None)
    return hf


@pytest.fixture(params=sorted(CONFIGS))
def kwargs(request):
    return dict(CONFIGS[request.param])


# --- names and config ----------------------------------------------------------------------------------------------


def test_import_renames_transformers_layout_to_the_release_names_moerl_expects(tmp_path, kwargs):
    hf = hf_model(kwargs, seed=1)
    hf.save_pretrained(tmp_path)
    saved = set(tensor_index(tmp_path))
    assert "model.layers.0.attn.norm.weight" in saved and "model.hc_head.hc_fn" in saved  # transformers' own
    convert_on_import(tmp_path, say=lambda line: None)
    cfg = check_checkpoint(tmp_path)
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes == expected_tensor_shapes(cfg)
    assert {"embed.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight", "layers.1.attn.compressor.norm.weight",
            "layers.0.ffn.gate.tid2eid", "layers.0.hc_attn_fn"} <= set(shapes)  # fmt: skip
    assert release_name("layers.3.attn.compressor.norm.weight") == "layers.3.attn.compressor.norm.weight"
    convert_on_import(tmp_path, say=lambda line: pytest.fail(line))  # the release's layout: nothing to do


def test_the_family_is_registered_and_its_config_round_trips(tmp_path, kwargs):
    HfConfig(**kwargs).save_pretrained(tmp_path / "theirs")
    written = json.loads((tmp_path / "theirs" / "config.json").read_text())
    cfg = config_from_hf(written)
    assert family_of(cfg) is DEEPSEEK_V4 and isinstance(cfg, DeepseekV4Config)
    assert cfg.layer_types == kwargs["layer_types"] and cfg.mlp_layer_types == kwargs["mlp_layer_types"]
    assert cfg.compress_rates == kwargs["compress_rates"]
    assert cfg.qk_rope_head_dim == int(kwargs["head_dim"] * kwargs["partial_rotary_factor"])
    ours = cfg.to_hf_dict(torch.bfloat16)
    ratios = [0 if t == SLIDING else kwargs["compress_rates"][t] for t in kwargs["layer_types"]]
    assert ours["compress_ratios"] == ratios
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(ours))
    back = AutoConfig.from_pretrained(tmp_path / "ours")
    assert type(back) is HfConfig
    for name in ("layer_types", "mlp_layer_types", "compress_rates", "sliding_window", "index_topk", "hc_mult",
                 "qk_rope_head_dim", "tie_word_embeddings", "swiglu_limit", "routed_scaling_factor"):  # fmt: skip
        assert getattr(back, name) == getattr(HfConfig(**kwargs), name), name
    # the release's rope_scaling (which transformers folds in) also says "type" for DeepSeek's own code
    compress = {k: v for k, v in back.rope_parameters["compress"].items() if k != "type"}
    assert {**back.rope_parameters, "compress": compress} == HfConfig(**kwargs).rope_parameters
    assert config_from_hf(ours) == cfg


def test_the_releases_legacy_keys_read_as_transformers_reads_them():
    """compress_ratios per layer, num_hash_layers, qk_rope_head_dim and a flat YaRN rope_scaling: the release's."""
    legacy = dict(model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16,
                  num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=16, num_experts_per_tok=2,
                  n_routed_experts=4, compress_ratios=[0, 4, 128, 4], num_hash_layers=2, qk_rope_head_dim=8,
                  rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})  # fmt: skip
    theirs = HfConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    cfg = config_from_hf(legacy)
    assert cfg.layer_types == theirs.layer_types and cfg.mlp_layer_types == theirs.mlp_layer_types
    assert cfg.qk_rope_head_dim == theirs.qk_rope_head_dim == 8
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 16


@pytest.mark.parametrize(
    "change, message",
    [({"quantization_config": {"quant_method": "fp8"}}, "quantization_config .*convert the release's FP8/FP4"),
     ({"scoring_func": "sigmoid"}, "scoring_func = 'sigmoid' .*sqrt\\(softplus"),
     ({"num_key_value_heads": 4}, "num_key_value_heads = 4 .*one shared key=value head"),
     ({"n_shared_experts": 2}, "n_shared_experts = 2 .*one shared expert"),
     ({"norm_topk_prob": False}, "norm_topk_prob = False .*always renormalises"),
     ({"compress_ratios": [0, 4, 64, 4], "layer_types": None}, "compress_ratios = .*0, 4 or 128"),
     ({"mlp_layer_types": ["moe"] * 3}, "mlp_layer_types = .*each of the num_hidden_layers = 4"),
     ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "rope type 'llama3' is not supported")],
    ids=["fp8", "scoring", "kv_heads", "shared_experts", "norm_topk", "ratios", "mlp_types", "rope"],
)  # fmt: skip
def test_refusals_name_the_field_in_one_line(change, message):
    d = {**CONFIGS["every_kind"], "model_type": "deepseek_v4", **change}
    with pytest.raises(MoerlError, match=message) as err:
        config_from_hf({k: v for k, v in d.items() if v is not None})
    assert "\n" not in str(err.value)


# --- logits --------------------------------------------------------------------------------------------------------


def test_logits_equal_transformers_on_unpadded_and_right_padded_rows(tmp_path, kwargs):
    hf = release_checkpoint(kwargs, seed=2, directory=tmp_path)
    ours = load_pretrained(tmp_path).eval()
    ids, mask = right_padded_batch(kwargs["vocab_size"], seed=3, length=23, real=(17, 10))
    with torch.no_grad():
        assert_same_logits(ours(ids), hf(input_ids=ids).logits, torch.ones_like(ids), atol=ATOL)
        assert_same_logits(ours(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, mask, atol=ATOL)


def test_left_padded_and_packed_rows_equal_each_sequence_alone(tmp_path, kwargs):
    """moerl's compressed windows follow each sequence's positions: a left-padded row, or a sequence packed after
    another, gets the logits it gets alone (and transformers gives it unpadded)."""
    hf = release_checkpoint(kwargs, seed=4, directory=tmp_path)
    ours = load_pretrained(tmp_path).eval()
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, kwargs["vocab_size"], (n,), generator=gen) for n in (22, 15, 9)]
    width = max(len(s) for s in sequences)
    left, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for row, s in enumerate(sequences):
        left[row, width - len(s) :], mask[row, width - len(s) :] = s, 1
    packed = torch.cat(sequences)[None]
    segments = torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)])[None]
    with torch.no_grad():
        padded, together = ours(left, mask), ours(packed, None, segments)
        start = 0
        for row, s in enumerate(sequences):
            alone = hf(input_ids=s[None]).logits[0]
            torch.testing.assert_close(padded[row, width - len(s) :], alone, atol=ATOL, rtol=0)
            torch.testing.assert_close(together[0, start : start + len(s)], alone, atol=ATOL, rtol=0)
            start += len(s)


def test_shared_prompt_forward_equals_transformers(tmp_path, kwargs):
    """Each response's compressed windows run over its prompt's tokens and its own (they straddle the boundary)."""
    hf = release_checkpoint(kwargs, seed=6, directory=tmp_path)
    model = load_pretrained(tmp_path).eval()
    prompts, responses = [[3, 4, 5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16]], [[20, 21, 22, 23, 24, 25, 26, 27, 28,
                          29, 30], [31, 32, 33, 34, 35, 36, 37], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]  # fmt: skip
    prompt_index = torch.tensor([0, 1, 1])
    width = max(len(p) for p in prompts)
    prompt_ids = torch.zeros(2, width, dtype=torch.long)
    prompt_mask = torch.zeros(2, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        prompt_ids[row, width - len(p) :], prompt_mask[row, width - len(p) :] = torch.tensor(p), 1
    length = max(len(r) for r in responses)
    response_ids = torch.zeros(3, length, dtype=torch.long)
    response_mask = torch.zeros(3, length, dtype=torch.long)
    for row, r in enumerate(responses):
        response_ids[row, : len(r)], response_mask[row, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        ours = model.forward_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask, prompt_index)
    for row, r in enumerate(responses):
        prompt = prompts[int(prompt_index[row])]
        theirs = response_logits(hf, prompt, r + [0])[: len(r) + 1]
        torch.testing.assert_close(ours[row, : len(r) + 1], theirs, atol=ATOL, rtol=0)


def test_gradients_match_transformers(tmp_path, kwargs):
    """Every parameter's gradient equals transformers' (compared under the release's names: transformers' gradients
    are saved as the weights of a copy of its model, which its save_pretrained names)."""
    hf = release_checkpoint(kwargs, seed=7, directory=tmp_path / "ckpt").train()
    ours = load_pretrained(tmp_path / "ckpt").train()
    ids, mask = right_padded_batch(kwargs["vocab_size"], seed=8, length=20, real=(14, 9))
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    (token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, targets) * weight).sum().backward()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.zeros_like(p) if p.grad is None else p.grad)
    hf.save_pretrained(tmp_path / "grads")
    convert_on_import(tmp_path / "grads", say=lambda line: None)
    theirs = {}
    for file in (tmp_path / "grads").glob("*.safetensors"):
        theirs.update(load_file(str(file)))
    adapter = DEEPSEEK_V4.state_dict_adapter
    frozen = {n for n, p in ours.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in ours.named_parameters() if is_frozen(n)} and frozen  # the sizing's rule
    assert all(p.grad is None for n, p in ours.named_parameters() if n in frozen)
    trained = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ours.named_parameters()
               if n not in frozen}  # fmt: skip
    grads = adapter.to_hf(trained)
    assert set(grads) == set(theirs) - {n for n in theirs if n.endswith(("tid2eid", ".gate.bias")) or ".indexer." in n}
    assert not any(theirs[n].any() for n in theirs if ".indexer." in n)  # transformers' indexer gets none either
    chosen = 0
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        if not theirs[name].any():  # an expert no token chose
            assert not grad.any() and ".experts." in name, name
            continue
        chosen += 1
        assert_close_to_scale(grad, theirs[name], name)
    assert chosen > len(grads) * 3 // 4
    assert grads["layers.1.hc_attn_fn"].abs().sum() > 0 and grads["hc_head_fn"].abs().sum() > 0


# --- publishing ------------------------------------------------------------------------------------------------------


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, kwargs):
    """moerl's save after one SGD step holds the release's names (and the hash tables, unchanged, as integers),
    transformers reads it as DeepseekV4ForCausalLM with moerl's logits, and moerl reads it back bit for bit."""
    release_checkpoint(kwargs, seed=9, directory=tmp_path / "sft")
    model = load_pretrained(tmp_path / "sft")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids, mask = right_padded_batch(kwargs["vocab_size"], seed=10, length=16, real=(11, 7))
    (token_logprobs(model(ids, mask), torch.roll(ids, -1, 1)) * mask).sum().backward()
    optimizer.step()
    after = model.state_dict()
    assert torch.equal(after["model.layers.0.ffn.gate.tid2eid"], before["model.layers.0.ffn.gate.tid2eid"])
    assert not torch.equal(after["model.layers.0.hc_attn.fn"], before["model.layers.0.hc_attn.fn"])
    save_pretrained(model, tmp_path / "published")
    config = json.loads((tmp_path / "published" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and "compress_ratios" in config
    with safe_open(str(next((tmp_path / "published").glob("*.safetensors"))), "pt") as f:
        assert "embed.weight" in f.keys() and f.get_tensor("layers.0.ffn.gate.tid2eid").dtype == torch.int64
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32).eval()
    assert type(hf) is HfModel
    with torch.no_grad():
        assert_same_logits(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, mask, atol=ATOL)
    back = load_pretrained(tmp_path / "published").state_dict()
    assert back.keys() == after.keys()
    assert all(torch.equal(back[name], t) for name, t in after.items())


def test_a_bf16_checkpoint_keeps_the_hyper_connections_sinks_gate_biases_and_norms_in_float32(tmp_path):
    """As transformers holds them (_keep_in_fp32_modules_strict), and as its save of a bf16 model stores them: a bf16
    checkpoint saved by transformers loads, and moerl publishes them in float32 too."""
    hf = hf_model(CONFIGS["every_kind"], seed=11)
    hf.save_pretrained(tmp_path / "fp32")
    HfModel.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    convert_on_import(tmp_path / "ckpt", say=lambda line: None)
    with safe_open(str(next((tmp_path / "ckpt").glob("*.safetensors"))), "pt") as f:
        stored = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert stored["layers.0.attn.kv_norm.weight"] == stored["norm.weight"] == "F32" and "BF16" in stored.values()
    model = load_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    state = model.state_dict()
    for name in ("model.layers.0.hc_attn.fn", "hc_head.scale", "model.layers.1.attn.attn_sink",
                 "model.layers.1.attn.compressor.ape", "model.layers.2.ffn.gate.e_score_correction_bias",
                 "model.layers.0.attn_norm.weight", "model.layers.1.attn.kv_norm.weight", "model.norm.weight",
                 "model.layers.1.attn.indexer.compressor.norm.weight",
                 "model.layers.0.attn.q_norm.weight"):  # fmt: skip
        assert state[name].dtype == torch.float32, name
    assert state["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert state["model.layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    save_pretrained(model, tmp_path / "published")
    assert check_checkpoint(tmp_path / "published") == model.config
    with safe_open(str(next((tmp_path / "published").glob("*.safetensors"))), "pt") as f:
        assert {name: f.get_slice(name).get_dtype() for name in f.keys()} == stored


# --- expert parallelism ----------------------------------------------------------------------------------------------

EP_CONFIG = CONFIGS["every_kind"]
EP_PLACEMENT = ExpertPlacement.from_lists([[3, 0, 1, 2], [1, 2, 3, 0], [2, 3, 0, 1], [0, 1, 2, 3]], ep_size=2)
EP_ROWS = (slice(0, 2), slice(2, 3))


def ep_worker(rank: int, world: int, out_dir) -> None:
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    model = load_pretrained(out_dir / "ckpt", placement=EP_PLACEMENT, ep_rank=mesh.ep_rank).train()
    model.set_dispatch(make_dispatch("alltoall", mesh, model.config.num_experts))
    save_rows_and_expert_grads(model, rank, EP_ROWS[rank], probe_batch(EP_CONFIG["vocab_size"], seed=13), out_dir)


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    """EP=2 over gloo (hash layers included: their table routes to experts on the other rank): each rank's logits
    and its experts' gradients equal the full model's."""
    release_checkpoint(EP_CONFIG, seed=12, directory=tmp_path / "ckpt")
    full = load_pretrained(tmp_path / "ckpt").train()
    ids, mask, probe = probe_batch(EP_CONFIG["vocab_size"], seed=13)
    logits = full(ids, mask)
    (logits * probe).sum().backward()
    run_gloo(ep_worker, 2, tmp_path)
    compared = 0
    for rank, rows in enumerate(EP_ROWS):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert_same_logits(got["logits"], logits[rows].detach(), mask[rows], atol=1e-5)
        for name, grad in expert_grads(got).items():
            want = full.get_parameter(name).grad
            if want is None:
                assert not grad.any(), name
            else:
                compared += 1
                assert_close_to_scale(grad, want, name)
    assert compared > 8


# --- the torch engine ------------------------------------------------------------------------------------------------


def test_the_torch_engine_decodes_as_one_full_forward(tmp_path, kwargs):
    """compressed_kv_cache: prompts of different lengths (left-padded in the prefill), several samples each, sampled
    and greedy, long enough to close several windows and pass the sliding window and index_topk: every behaviour
    log-prob equals transformers' fp32 forward."""
    hf = release_checkpoint(kwargs, seed=14, directory=tmp_path)
    engine = TorchEngine.from_checkpoint(tmp_path)
    prompts = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13, 14, 15]]
    sampled, greedy = SamplingParams(temperature=1.0, max_new_tokens=16, n=2), SamplingParams(max_new_tokens=16)
    longest = 0
    for params in (sampled, greedy):
        requests = sample_requests([(f"p{i}", p) for i, p in enumerate(prompts)], params,
                                   seed_of=lambda pid, k: sample_seed(0, 1, pid, k))  # fmt: skip
        for request, generation in zip(requests, engine.generate(requests, params), strict=True):
            longest = max(longest, len(request.prompt_ids) + len(generation.response_ids))
            logits = response_logits(hf, request.prompt_ids, generation.response_ids)
            expected = token_logprobs(logits, torch.tensor(generation.response_ids))
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=ATOL, rtol=0)
            if params.greedy:
                assert generation.response_ids == logits.argmax(dim=-1).tolist()
    assert longest >= 3 * max(kwargs["compress_rates"].values()) and longest > kwargs["sliding_window"] + 4


def test_the_torch_engine_records_the_routes_of_hash_and_top_k_layers(tmp_path):
    release_checkpoint(CONFIGS["every_kind"], seed=15, directory=tmp_path)
    assert_engine_records_the_routers_choice(tmp_path, CONFIGS["every_kind"]["vocab_size"])


# --- checkpoints moerl refuses or trims -----------------------------------------------------------------------------


def test_mtp_tensors_are_dropped_and_a_float_hash_table_refused(tmp_path):
    """The release's multi-token-prediction module (mtp.*) is dropped on import, as transformers drops it; a hash
    table stored as floats (a broken conversion) is refused by name."""
    release_checkpoint(CONFIGS["every_kind"], seed=16, directory=tmp_path / "ckpt")
    file = next((tmp_path / "ckpt").glob("*.safetensors"))
    tensors = load_file(str(file))
    save_file({**tensors, "mtp.0.emb.tok_emb.weight": torch.zeros(4, 4)}, str(file), metadata={"format": "pt"})
    edit_config(tmp_path / "ckpt", num_nextn_predict_layers=1)
    model = load_pretrained(tmp_path / "ckpt")
    assert not any("mtp" in name for name in model.state_dict())
    tensors["layers.0.ffn.gate.tid2eid"] = tensors["layers.0.ffn.gate.tid2eid"].float()
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(MoerlError, match=r"layers.0.ffn.gate.tid2eid has dtype F32; it is an integer table") as err:
        load_pretrained(tmp_path / "ckpt")
    assert "\n" not in str(err.value)


# --- replaying the CSA indexer's choice ----------------------------------------------------------------------------


def v4_samples(model, max_new_tokens: int = 16):
    from steps.engines.interface import GenerationRequest
    from steps.experience.tables import Sample

    engine = TorchEngine(model, record_routes=True)
    prompts = [("a", (5, 9, 17, 3, 8, 1)), ("b", (40, 41)), ("c", (7, 8, 9, 10, 11, 12, 13, 14, 15))]
    requests = [
        GenerationRequest(pid, ids, k, seed=10 * i + k) for i, (pid, ids) in enumerate(prompts) for k in range(2)
    ]
    generations = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens))
    return [
        Sample(r.prompt_id, r.sample_index, list(r.prompt_ids), g.response_ids, g.logprobs,
               advantage=1.0 if i % 2 else -1.0, routed_experts=g.routed_experts,
               selected_keys=g.selected_keys.reshape(-1))
        for i, (r, g) in enumerate(zip(requests, generations, strict=True))
    ]  # fmt: skip


def own_entries(model, ids: list[int]) -> torch.Tensor:
    """[fed, CSA layers, windows] bool: the entries the CSA indexers choose over `ids` in one forward."""
    from steps.models.compressed_attention import Indexer

    chosen, original = [], Indexer.select

    def select(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        chosen.append(out[0])
        return out

    Indexer.select = select
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        Indexer.select = original
    return torch.stack(chosen, dim=1)


def test_the_engine_records_the_csa_indexers_choice_as_the_trainer_makes_it(tmp_path):
    release_checkpoint(CONFIGS["every_kind"], seed=17, directory=tmp_path)
    model = load_pretrained(tmp_path).eval()
    shape = model.selection_shape()
    assert (shape.layers, shape.topk, shape.rate, shape.over_windows, shape.first_query) == (2, 2, 4, True, 11)
    recorded = 0
    for s in v4_samples(model):
        fed = len(s.prompt_ids) + len(s.response_ids) - 1
        rows = s.selected_keys.reshape(shape.queries(fed), 2, -1)
        chosen = np.unpackbits(rows, axis=-1, count=shape.keys(fed)).astype(bool)
        assert (chosen.sum(-1) == 2).all()
        own = own_entries(model, s.prompt_ids + s.response_ids[:-1])[shape.first_query :, :, : shape.keys(fed)]
        assert np.array_equal(chosen, own.numpy())
        recorded += len(chosen)
    assert recorded > 20


@pytest.mark.parametrize("layout", ["plain", "packed", "shared_prompts"])
def test_replaying_its_own_csa_choice_is_the_plain_update(tmp_path, layout):
    from steps.expert_parallel.mesh import Mesh
    from steps.training.rl_loss import LossSettings
    from steps.training.trainer import PolicyTrainer, TrainSettings

    release_checkpoint(CONFIGS["every_kind"], seed=18, directory=tmp_path)
    samples = v4_samples(load_pretrained(tmp_path).eval())
    changes = {"packed": {"sequence_packing": True}, "shared_prompts": {"shared_prompts": True}}.get(layout, {})
    results = {}
    for replay in ("none", "rollout"):
        model = load_pretrained(tmp_path).train()
        settings = TrainSettings(micro_batch_size=3, steps_per_epoch=1, lr=1e-2, loss=LossSettings(kl_coef=0.0),
                                 routing_replay=replay, **changes)  # fmt: skip
        metrics = PolicyTrainer(model, Mesh(), settings).train(samples, iteration=1)
        assert metrics["routing"]["indexer"]["queries"] > 0 and metrics["routing"]["indexer"]["disagreement"] == 0
        results[replay] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(results["rollout"][n], w) for n, w in results["none"].items())


def test_replay_attends_to_the_engines_entries(tmp_path):
    """The last CSA layer's recorded entries moved to the earliest ones: with replay the trainer's log-probs are a
    forward's whose last CSA layer attends to those; the disagreement is counted there only."""
    from steps.expert_parallel.mesh import Mesh
    from steps.models.compressed_attention import Indexer
    from steps.training.micro_batch import collate
    from steps.training.trainer import PolicyTrainer, TrainSettings

    release_checkpoint(CONFIGS["every_kind"], seed=19, directory=tmp_path)
    model = load_pretrained(tmp_path).eval()
    shape = model.selection_shape()
    samples = v4_samples(model)
    moved = []
    for s in samples:
        fed = len(s.prompt_ids) + len(s.response_ids) - 1
        rows = s.selected_keys.reshape(shape.queries(fed), 2, -1).copy()
        earliest = np.zeros(shape.keys(fed), dtype=bool)
        earliest[:2] = True
        rows[:, 1] = np.packbits(earliest)
        moved.append(dataclasses.replace(s, selected_keys=rows.reshape(-1)))
    last = model.model.layers[3].attn.indexer
    original = Indexer.select

    def forced(self, x, queries, keys, visible):
        own = original(self, x, queries, keys, visible)
        if self is not last:
            return own
        earliest = torch.zeros_like(visible)
        earliest[..., :2] = True
        seen = visible.sum(-1, keepdim=True) > shape.topk
        return torch.where(seen, earliest & visible, own)

    want = []
    Indexer.select = forced
    try:
        for s in moved:
            logits = response_logits(model, s.prompt_ids, s.response_ids)
            want.append(token_logprobs(logits, torch.tensor(s.response_ids)))
    finally:
        Indexer.select = original
    trainer = PolicyTrainer(model, Mesh(), TrainSettings(routing_replay="rollout"))
    trainer.selection_counts = torch.zeros(2, 2, dtype=torch.int64)
    mb = collate(moved, list(range(len(moved))), torch.device("cpu"), selection_shape=shape)
    with torch.no_grad():
        logp, _ = trainer.forward_logprobs(model, mb)
    for row, expected in enumerate(want):
        torch.testing.assert_close(logp[row][mb.loss_mask[row]], expected, atol=1e-5, rtol=0)
    differs, queries = trainer.selection_counts.unbind(1)
    assert differs[0] == 0 and 0 < differs[1] <= queries[1]
