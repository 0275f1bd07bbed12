"""The gpt-oss family (steps/models/gpt_oss/) against transformers 5.23's GptOssForCausalLM, on tiny random models
built by transformers' own config class: the tensor names save_pretrained writes (a layer's experts fused in one
tensor per weight, the router `mlp.router` with a bias, attention sinks); equal logits both ways round, with
left padding and sliding windows that bind, and through forward_shared_prompts; gradients; a bf16 round trip; the
router and the clamped-SwiGLU experts (their hand-written backward against autograd); the torch engine's log-probs
with sinks and windows on both of its decode paths; an EP=2 forward over gloo; and one clear error for each bad
checkpoint."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from family_helpers import (
    assert_same_logits,
    edit_config,
    expert_grads,
    left_padded_batch,
    probe_batch,
    rewrite_weights,
    save_rows_and_expert_grads,
)
from model_helpers import randomize_, response_logits, response_logprobs
from safetensors import safe_open
from safetensors.torch import load_file
from test_expert_parallel import run_gloo
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import GptOssConfig as HfGptOssConfig
from transformers import GptOssForCausalLM as HfGptOssForCausalLM
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssTopKRouter

from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.experts import ClampedSwiGLU, run_experts
from steps.models.gpt_oss.config import GptOssConfig
from steps.models.gpt_oss.model import Expert, GptOssCausalLM, moe_block
from steps.models.gpt_oss.spec import GPT_OSS
from steps.models.hf_checkpoint import (
    checkpoint_dtype,
    expected_tensor_shapes,
    load_pretrained,
    load_state_dict_from_dir,
    save_pretrained,
)
from steps.models.kernels import token_logprobs
from steps.models.placement import ExpertPlacement, is_expert_param
from steps.models.registry import config_from_hf, family_of, resolve

# A: top-2 of 4 experts, 2 kv heads, window 4 on layers 0 and 2 (sliding, full, sliding), default YaRN, a tight
#    swiglu_limit so that the clamps bind.
# B: top-3 of 6, one kv head, default RoPE, tied embeddings, no attention biases, window 3 on layer 1 only.
CONFIGS = {
    "yarn_window4": dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
    ),
    "default_rope_tied": dict(
        vocab_size=64, hidden_size=32, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, num_local_experts=6, num_experts_per_tok=3, sliding_window=3,
        layer_types=["full_attention", "sliding_attention"], max_position_embeddings=64, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, swiglu_alpha=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
    ),
}  # fmt: skip
ATOL = 1e-4  # fp32 logits, both ways round (the brief's bound)


def hf_model(kwargs: dict, seed: int) -> HfGptOssForCausalLM:
    torch.manual_seed(seed)
    hf = HfGptOssForCausalLM(HfGptOssConfig(**kwargs))
    randomize_(hf, seed=seed)
    return hf.eval()


@pytest.fixture(params=sorted(CONFIGS))
def config_kwargs(request):
    return dict(CONFIGS[request.param])


def our_config(kwargs: dict) -> GptOssConfig:
    return GptOssConfig.from_hf_dict({"model_type": "gpt_oss", **kwargs})


# --- names ----------------------------------------------------------------------------------------------------


def test_state_dict_names_are_what_transformers_writes(tmp_path, config_kwargs):
    HfGptOssForCausalLM(HfGptOssConfig(**config_kwargs)).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = our_config(config_kwargs)
    model = GptOssCausalLM(cfg)
    adapter = GPT_OSS.state_dict_adapter
    ours = {name: tuple(t.shape) for name, t in adapter.to_hf(model.state_dict()).items()}
    assert ours == on_disk == expected_tensor_shapes(cfg)
    e, h, i = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    assert on_disk["model.layers.1.mlp.experts.gate_up_proj"] == (e, h, 2 * i)
    assert on_disk["model.layers.1.mlp.experts.down_proj"] == (e, i, h)
    assert on_disk["model.layers.1.mlp.router.bias"] == (e,) and on_disk["model.layers.0.self_attn.sinks"] == (4,)
    # model names: one module per expert, the router called gate; from_hf inverts to_hf
    names = set(model.state_dict())
    assert "model.layers.1.mlp.experts.3.gate_up_proj_bias" in names and "model.layers.1.mlp.gate.bias" in names
    back = adapter.from_hf(adapter.to_hf(model.state_dict()))
    assert set(back) == names and all(torch.equal(back[n], t) for n, t in model.state_dict().items())


def test_the_published_20b_config_resolves_and_its_tensors_add_up():
    """gpt-oss-20b's config.json as published (transformers v4: rope_scaling + rope_theta, MXFP4 experts; here
    without its quantization_config, as a dequantized export has it)."""
    d = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}, "rope_theta": 150000,
        "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
    }  # fmt: skip
    assert resolve(d) is GPT_OSS
    cfg = config_from_hf(d)
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.window(0), cfg.window(1)) == (150000, 32.0, 128, None)
    shapes = GPT_OSS.state_dict_adapter.expected_shapes(cfg)
    assert len(shapes) == 3 + 24 * 17
    # 20.9B parameters (the model card's "21B"), 3.6B active per token
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 20_914_757_184
    assert shapes["model.layers.23.mlp.experts.gate_up_proj"] == (32, 2880, 5760)
    with pytest.raises(MoerlError, match=r"quantization_config = .*Mxfp4Config\(dequantize=True\)"):
        config_from_hf({**d, "quantization_config": {"quant_method": "mxfp4"}})


def test_the_family_is_registered():
    cfg = our_config(CONFIGS["yarn_window4"])
    model = GptOssCausalLM(cfg)
    assert family_of(cfg) is GPT_OSS and family_of(model) is GPT_OSS
    assert (GPT_OSS.attention, GPT_OSS.router) == ("softmax_kv_cache", "topk_softmax")
    blocks = [layer.mlp for layer in model.model.layers]
    assert blocks == model.moe_blocks()
    assert model.router_parameters() == [p for b in blocks for p in (b.gate.weight, b.gate.bias)]
    params = GPT_OSS.state_dict_adapter.expert_params(cfg, 1, 3)
    assert [n for n, _ in params] == [f"model.layers.1.mlp.experts.3.{w}" for w in
                                      ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]  # fmt: skip
    assert all(is_expert_param(n) and tuple(model.get_parameter(n).shape) == s for n, s in params)
    assert [a.self_attn.sliding_window for a in model.model.layers] == [4, None, 4]
    parts = GPT_OSS.decode(model)
    assert [layer.window for layer in parts.layers] == [4, None, 4]
    assert parts.layers[2].sinks is model.model.layers[2].self_attn.sinks


def test_config_round_trips_through_config_json():
    cfg = our_config({**CONFIGS["yarn_window4"], "eos_token_id": [2, 3], "pad_token_id": 0})
    d = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert (d["architectures"], d["model_type"], d["dtype"]) == (["GptOssForCausalLM"], "gpt_oss", "bfloat16")
    assert GptOssConfig.from_hf_dict(d) == cfg
    hf = HfGptOssConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hf.rope_parameters["factor"] == 4.0 and hf.layer_types == cfg.layer_types and hf.swiglu_limit == 1.5
    # transformers' defaults where config.json is silent: head_dim 64, window 128, YaRN x32 over theta 150000
    bare = {k: v for k, v in d.items() if k not in ("head_dim", "sliding_window", "rope_parameters", "rope_scaling",
                                                     "layer_types", "rope_theta")}  # fmt: skip
    cfg = GptOssConfig.from_hf_dict(bare)
    hf = HfGptOssConfig(**{k: v for k, v in bare.items() if k not in ("architectures", "model_type")})
    assert (cfg.head_dim, cfg.sliding_window, cfg.rope_theta) == (hf.head_dim, hf.sliding_window, 150000.0)
    assert cfg.layer_types == hf.layer_types
    assert {**cfg.rope_scaling, "rope_theta": cfg.rope_theta} == hf.rope_parameters


# --- logits both ways round -------------------------------------------------------------------------------


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, config_kwargs):
    hf = hf_model(config_kwargs, seed=2)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=3)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert isinstance(model, GptOssCausalLM)
            assert_same_logits(model(ids, mask), theirs, mask, atol=ATOL)
        assert_same_logits(model(ids), hf(input_ids=ids).logits, torch.ones_like(mask), atol=ATOL)
        # the windows bind (11 tokens, windows of 3-4)
        full = ["full_attention"] * config_kwargs["num_hidden_layers"]
        unwindowed = hf_model({**config_kwargs, "layer_types": full}, seed=2)
        assert (unwindowed(input_ids=ids).logits - hf(input_ids=ids).logits)[0, -1].abs().max() > 1e-3


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config_kwargs):
    torch.manual_seed(0)
    model = GptOssCausalLM(our_config(config_kwargs))
    randomize_(model, seed=1)
    save_pretrained(model, tmp_path)
    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert type(hf_config).__name__ == "GptOssConfig" and hf_config.layer_types == model.config.layer_types
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(hf, HfGptOssForCausalLM)
    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"])
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(model(ids, mask), theirs, mask, atol=ATOL)


def shared_prompt_logits_against_transformers(model: GptOssCausalLM, hf: HfGptOssForCausalLM, vocab: int) -> None:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 4)]
    responses = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 2, 6)]
    prompt_index = torch.tensor([0, 1, 0])
    width, length = max(map(len, prompts)), max(map(len, responses))
    prompt_ids, prompt_mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        prompt_ids[row, width - len(p) :], prompt_mask[row, width - len(p) :] = torch.tensor(p), 1
    response_ids, response_mask = torch.zeros(3, length, dtype=torch.long), torch.zeros(3, length, dtype=torch.long)
    for row, r in enumerate(responses):
        response_ids[row, : len(r)], response_mask[row, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        ours = model.forward_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask, prompt_index)
    for row, r in enumerate(responses):
        theirs = response_logits(hf, prompts[int(prompt_index[row])], r + [0])[: len(r) + 1]
        torch.testing.assert_close(ours[row, : len(r) + 1], theirs, atol=ATOL, rtol=0)


def test_shared_prompt_forward_equals_transformers(tmp_path, config_kwargs):
    hf = hf_model(config_kwargs, seed=4)
    hf.save_pretrained(tmp_path)
    shared_prompt_logits_against_transformers(load_pretrained(tmp_path), hf, config_kwargs["vocab_size"])


def test_gradients_match_transformers(tmp_path):
    """Every parameter's gradient matches transformers' (expert e's gradients are slice e of the fused ones)."""
    kwargs = CONFIGS["yarn_window4"]
    hf = hf_model(kwargs, seed=7).train()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=8)
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (token_logprobs(hf_logits, targets) * weight).sum().backward()
    hf_grads = GPT_OSS.state_dict_adapter.from_hf({n: p.grad for n, p in hf.named_parameters()})
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    block = ours.model.layers[0].mlp
    assert block.gate.bias.grad.abs().sum() > 0 and ours.model.layers[1].self_attn.sinks.grad.abs().sum() > 0


def test_bf16_checkpoints_round_trip_with_transformers(tmp_path):
    kwargs = CONFIGS["yarn_window4"]
    ours = GptOssCausalLM(our_config(kwargs))
    randomize_(ours, seed=9)
    ours = ours.to(torch.bfloat16)
    save_pretrained(ours, tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert hf.dtype == torch.bfloat16
    hf.save_pretrained(tmp_path / "hf")
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16
    back = GPT_OSS.state_dict_adapter.from_hf(load_state_dict_from_dir(tmp_path / "hf"))
    assert set(back) == set(ours.state_dict())
    for name, tensor in ours.state_dict().items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor), name
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=10)
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf32(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(load_pretrained(tmp_path / "hf")(ids, mask), theirs, mask, atol=ATOL)


# --- the router and the experts ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_is_gpt_oss_topk_then_softmax_bit_for_bit(dtype):
    """GptOssTopKRouter (biased logits, top-k, softmax over the k in the logits' dtype) and the shared block's
    "topk_softmax" router choose the same experts with the same weights, bit for bit, in fp32 and bf16."""
    kwargs = CONFIGS["default_rope_tied"]
    hf_router = GptOssTopKRouter(HfGptOssConfig(**kwargs)).to(dtype)
    block = moe_block(our_config(kwargs)).to(dtype)
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5)
        hf_router.bias.normal_(0, 0.5)
        block.gate.weight.copy_(hf_router.weight)
        block.gate.bias.copy_(hf_router.bias)
        hidden = torch.randn(512, kwargs["hidden_size"], generator=torch.Generator().manual_seed(0)).to(dtype)
        hf_logits, hf_weights, hf_idx = hf_router(hidden)
        logits, idx, weights = block.route(hidden)
    assert torch.equal(logits, hf_logits) and torch.equal(idx, hf_idx) and torch.equal(weights, hf_weights)


def experts_pair(kwargs: dict, seed: int) -> tuple[GptOssExperts, list[Expert]]:
    """transformers' fused experts and ours (slices of the same weights), large enough that the clamps bind."""
    hf = GptOssExperts(HfGptOssConfig(**kwargs))
    randomize_(hf, seed=seed, scale=1.0)
    cfg = our_config(kwargs)
    ours = [Expert(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit)
            for _ in range(cfg.num_local_experts)]  # fmt: skip
    with torch.no_grad():
        for e, expert in enumerate(ours):
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                getattr(expert, name).copy_(getattr(hf, name)[e])
    return hf, ours


def test_clamped_swiglu_experts_forward_equals_transformers_and_backward_equals_autograd():
    kwargs = CONFIGS["yarn_window4"]
    hf, ours = experts_pair(kwargs, seed=11)
    counts = [5, 0, 7, 3]
    x = torch.randn(sum(counts), kwargs["hidden_size"], generator=torch.Generator().manual_seed(12))
    x.requires_grad_(True)
    out = run_experts(ours, x, counts)
    # transformers' per-expert arithmetic on the same rows (weights 1, one expert per row)
    idx = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))[:, None]
    ref_x = x.detach().clone().requires_grad_(True)
    ref = hf(ref_x, idx, torch.ones(len(idx), 1))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    gate_up = torch.cat([x.detach() @ hf.gate_up_proj[e] + hf.gate_up_proj_bias[e] for e in idx[:, 0]])
    assert (gate_up[:, ::2] > kwargs["swiglu_limit"]).any() and (gate_up[:, 1::2].abs() > kwargs["swiglu_limit"]).any()
    # the hand-written backward against autograd of transformers' forward
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(13))
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, atol=1e-5, rtol=1e-5)
    for e, expert in enumerate(ours):
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            want = getattr(hf, name).grad[e]
            got = getattr(expert, name).grad
            if counts[e] == 0:
                assert got is None or not got.any()
            else:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"{e}.{name}")
    assert ClampedSwiGLU(1.5, 2.0) == ClampedSwiGLU(1.5, 2.0) != ClampedSwiGLU(1.702, 7.0)


# --- the torch engine: sinks and sliding windows -----------------------------------------------------------

# prompts + 9 generated tokens run well past the windows (3-4)
ENGINE_PROMPTS = [("p0", [5, 9, 3]), ("p1", [7, 1, 2, 8, 30, 11, 40]), ("p2", [4])]


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("tree_waste", [3.0, 0.0], ids=["prefix_tree", "rows"])
def test_engine_logprobs_equal_transformers_and_update_in_place(tmp_path, config_name, tree_waste):
    """The torch engine (prefill + decode steps over its key/value tree, DecodeBatch; or per-row keys after the
    first step, RowBatch, with tree_waste 0) on a checkpoint transformers wrote: its log-probs equal a
    transformers recompute of the same tokens, over sequences longer than the windows; an in-place update to
    another version generates what an engine opened on that version does."""
    kwargs = CONFIGS[config_name]
    hf = hf_model(kwargs, seed=14)
    hf.save_pretrained(tmp_path / "v0")
    engine = TorchEngine.from_checkpoint(tmp_path / "v0")
    engine.tree_waste = tree_waste
    params = SamplingParams(n=3, max_new_tokens=9, temperature=1.3)
    requests = sample_requests(ENGINE_PROMPTS, params, lambda prompt_id, k: sample_seed(3, 1, prompt_id, k))
    generations = engine.generate(requests, params)
    assert all(len(g.response_ids) == 9 for g in generations)
    for request, generation in zip(requests, generations, strict=True):
        expected = response_logprobs(hf, request.prompt_ids, generation.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)

    hf_model(kwargs, seed=15).save_pretrained(tmp_path / "v1")
    engine.update_weights(tmp_path / "v1")
    fresh = TorchEngine.from_checkpoint(tmp_path / "v1")
    fresh.tree_waste = tree_waste
    assert engine.generate(requests, params) == fresh.generate(requests, params)


# --- expert parallelism ------------------------------------------------------------------------------------

EP_CONFIG = CONFIGS["yarn_window4"]
EP_PLACEMENT = ExpertPlacement.from_lists([[3, 0, 2, 1], [1, 2, 3, 0], [0, 3, 1, 2]], ep_size=2)
EP_ROWS = (slice(0, 2), slice(2, 3))


def ep_full_model() -> GptOssCausalLM:
    model = GptOssCausalLM(our_config(EP_CONFIG))
    randomize_(model, seed=16)
    return model


def ep_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return probe_batch(EP_CONFIG["vocab_size"], seed=17)


def ep_worker(rank: int, world: int, out_dir) -> None:
    """EP rank `rank`'s model (its experts only, under their global names), loaded from the full checkpoint
    (the fused tensors read whole, its experts kept), its rows of the batch, the all-to-all dispatch: its logits
    and its experts' gradients of sum(logits * probe)."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    model = load_pretrained(out_dir / "full", placement=EP_PLACEMENT, ep_rank=mesh.ep_rank)
    held = {n.split(".experts.")[1].split(".")[0] for n in model.state_dict() if ".layers.0.mlp.experts." in n}
    assert held == {str(e) for e in EP_PLACEMENT.held(0, mesh.ep_rank)}
    model.set_dispatch(make_dispatch("alltoall", mesh, model.config.num_local_experts))
    save_rows_and_expert_grads(model, rank, EP_ROWS[rank], ep_batch(), out_dir)


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    full = ep_full_model()
    save_pretrained(full, tmp_path / "full")
    ids, mask, probe = ep_batch()
    logits = full(ids, mask)
    (logits * probe).sum().backward()
    run_gloo(ep_worker, 2, tmp_path)
    for rank, rows in enumerate(EP_ROWS):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert_same_logits(got["logits"], logits[rows].detach(), mask[rows], atol=ATOL)
        grads = expert_grads(got)
        assert len(grads) == 3 * 2 * 4  # layers x experts held x weights
        for name, grad in grads.items():
            torch.testing.assert_close(grad, full.get_parameter(name).grad, atol=1e-5, rtol=1e-5, msg=name)


def test_an_ep_ranks_subset_cannot_be_written_as_a_fused_checkpoint():
    cfg = our_config(EP_CONFIG)
    rank1 = GptOssCausalLM(cfg, EP_PLACEMENT, 1)
    with pytest.raises(ValueError, match=r"needs every expert, this state holds experts \[1, 2\]"):
        GPT_OSS.state_dict_adapter.to_hf(rank1.state_dict())


# --- bad checkpoints ---------------------------------------------------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    hf_model(CONFIGS["yarn_window4"], seed=19).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_tensor_is_named(good_checkpoint):
    name = "model.layers.1.self_attn.sinks"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=rf"tensor {name} is missing \(expected shape \[4\]"):
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named_with_its_file(good_checkpoint):
    name = "model.layers.0.mlp.experts.gate_up_proj"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(3, 32, 32)}))
    with pytest.raises(MoerlError, match=rf"safetensors: tensor {name} has shape \[3, 32, 32\], expected \[4, 32"):
        load_pretrained(good_checkpoint)


def test_mxfp4_tensors_are_refused_by_name(good_checkpoint):
    """An MXFP4 export's packed experts (without its quantization_config) are named, not read."""
    def pack(t):
        t.pop("model.layers.0.mlp.experts.down_proj")
        t["model.layers.0.mlp.experts.down_proj_blocks"] = torch.zeros(4, 32, 1, 8, dtype=torch.uint8)
    rewrite_weights(good_checkpoint, pack)
    with pytest.raises(MoerlError, match=r"tensor model\.layers\.0\.mlp\.experts\.down_proj is missing"):
        load_pretrained(good_checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_local_experts=0), r"config\.json: no experts \(num_local_experts 0\)"),
        (dict(intermediate_size=None), r"missing required gpt-oss fields \['intermediate_size'\]"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok = 5 exceeds num_local_experts = 4"),
        (dict(quantization_config={"quant_method": "mxfp4"}),
         r"quantization_config = .* not supported by moerl \(moerl reads float weights; dequantize the MXFP4"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
         "rope_parameters.rope_type 'linear' is not supported by moerl"),
        (dict(attention_dropout=0.1), r"attention_dropout = 0.1 is not supported by moerl \(set it to 0.0\)"),
        (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
         r"layer_types = .* must list 3 of \['sliding_attention', 'full_attention'\]"),
        (dict(sliding_window=0), "sliding_window = 0 must be null or a positive integer"),
        (dict(swiglu_limit=-1.0), "swiglu_limit = -1.0 must be a number > 0"),
    ],
    ids=["zero_experts", "missing_field", "top_k_over_experts", "quantized", "linear_rope", "dropout",
         "layer_types", "zero_window", "limit"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        load_pretrained(good_checkpoint)
    assert "\n" not in str(err.value)
