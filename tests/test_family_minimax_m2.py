"""The MiniMax-M2 family (steps/models/minimax_m2/) against transformers 5.23's MiniMaxM2ForCausalLM, on tiny random
models built by transformers' own config class, with a non-zero correction bias (transformers starts it at zero): the
tensor names of the released checkpoints, which save_pretrained writes (block_sparse_moe.experts.E.w1/w2/w3 and
block_sparse_moe.e_score_correction_bias); the config.json fields SGLang reads; equal logits both ways round, with
left padding and through forward_shared_prompts; gradients; a bf16 round trip; the sigmoid router bit for bit; the
torch engine's log-probs and recorded routes; an EP=2 forward over gloo; the multi-token-prediction layers dropped on
import; and one clear error for each bad checkpoint."""

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
from transformers import MiniMaxM2Config as HfMiniMaxM2Config
from transformers import MiniMaxM2ForCausalLM as HfMiniMaxM2ForCausalLM
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

from steps.demo.char_tokenizer import save_tokenizer
from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.checkpoint_validation import validate_checkpoint_dir
from steps.models.hf_checkpoint import (
    check_checkpoint,
    checkpoint_dtype,
    expected_tensor_shapes,
    load_pretrained,
    load_state_dict_from_dir,
    save_pretrained,
)
from steps.models.kernels import token_logprobs
from steps.models.minimax_m2.config import MiniMaxM2Config
from steps.models.minimax_m2.model import MiniMaxM2CausalLM, moe_block
from steps.models.minimax_m2.spec import MINIMAX_M2
from steps.models.placement import ExpertPlacement, is_expert_param
from steps.models.registry import config_from_hf, family_of, resolve

# What the released config.json says and SGLang 0.5.17 reads (steps/models/minimax_m2/config.py SERVED_AS_BUILT).
SERVED = dict(use_qk_norm=True, qk_norm_type="per_layer", use_routing_bias=True, scoring_func="sigmoid")
# A: half of each head rotated (rotary_dim 8 of 16), top-2 of 8 experts, 2 kv heads.
# B: the whole head rotated, top-3 of 6 experts, one kv head, rope_theta 10000.
CONFIGS = {
    "half_rotary_top2": dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, rope_theta=5000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=None, **SERVED,
    ),
    "full_rotary_top3_one_kv": dict(
        vocab_size=128, hidden_size=64, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, rotary_dim=16, num_local_experts=6, num_experts_per_tok=3,
        max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=None, **SERVED,
    ),
}  # fmt: skip
ATOL = 5e-5  # fp32 logits, both ways round
OURS_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rotary_dim", "num_local_experts", "num_experts_per_tok",
               "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
               "eos_token_id", "pad_token_id")  # fmt: skip


def our_config(kwargs: dict) -> MiniMaxM2Config:
    return MiniMaxM2Config(**{k: v for k, v in kwargs.items() if k in OURS_FIELDS})


def set_biases_(biases, seed: int) -> None:
    """Non-zero correction biases (transformers and moerl start them at zero), large enough to change choices."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for bias in biases:
            bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)


def hf_model(kwargs: dict, seed: int) -> HfMiniMaxM2ForCausalLM:
    torch.manual_seed(seed)
    hf = HfMiniMaxM2ForCausalLM(HfMiniMaxM2Config(**kwargs))
    randomize_(hf, seed=seed)
    set_biases_([layer.mlp.e_score_correction_bias for layer in hf.model.layers], seed + 1)
    return hf.eval()


def our_model(kwargs: dict, seed: int) -> MiniMaxM2CausalLM:
    torch.manual_seed(seed)
    model = MiniMaxM2CausalLM(our_config(kwargs))
    randomize_(model, seed=seed)
    set_biases_([block.gate.e_score_correction_bias for block in model.moe_blocks()], seed + 1)
    return model.eval()


@pytest.fixture(params=sorted(CONFIGS))
def config_kwargs(request):
    return dict(CONFIGS[request.param])


# --- names: what MiniMax-M2's checkpoints hold and transformers writes ------------------------------------------


def test_state_dict_names_are_what_transformers_writes(tmp_path, config_kwargs):
    HfMiniMaxM2ForCausalLM(HfMiniMaxM2Config(**config_kwargs)).save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = our_config(config_kwargs)
    save_pretrained(MiniMaxM2CausalLM(cfg), tmp_path / "ours")
    with safe_open(tmp_path / "ours" / "model.safetensors", framework="pt") as f:
        ours = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert ours == on_disk == expected_tensor_shapes(cfg)
    experts = config_kwargs["num_local_experts"]
    assert on_disk["model.layers.1.block_sparse_moe.e_score_correction_bias"] == (experts,)
    assert on_disk[f"model.layers.1.block_sparse_moe.experts.{experts - 1}.w2.weight"] == (64, cfg.intermediate_size)
    assert on_disk["model.layers.0.self_attn.q_norm.weight"] == (4 * 16,)  # over the whole projection
    assert on_disk["model.layers.0.self_attn.k_norm.weight"] == (config_kwargs["num_key_value_heads"] * 16,)
    assert not any(".mlp." in name or "gate_up_proj" in name for name in on_disk)
    # in memory the shared router holds the bias; only the checkpoint name differs
    model_names = set(MiniMaxM2CausalLM(cfg).state_dict())
    assert "model.layers.0.block_sparse_moe.gate.e_score_correction_bias" in model_names
    assert MINIMAX_M2.state_dict_adapter.to_hf({n: None for n in model_names}).keys() == on_disk.keys()


def test_the_family_is_registered_and_its_config_round_trips():
    cfg = MiniMaxM2Config(**{**{k: v for k, v in CONFIGS["half_rotary_top2"].items() if k in OURS_FIELDS},
                             "eos_token_id": [2, 3], "pad_token_id": 0})  # fmt: skip
    d = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert (d["architectures"], d["model_type"], d["dtype"], d["torch_dtype"]) == (
        ["MiniMaxM2ForCausalLM"], "minimax_m2", "bfloat16", "bfloat16"
    )  # fmt: skip
    assert {k: d[k] for k in SERVED} == SERVED and d["rotary_dim"] == 8
    assert d["rope_parameters"]["partial_rotary_factor"] == 0.5 and d["num_mtp_modules"] == 0
    assert MiniMaxM2Config.from_hf_dict(d) == cfg
    assert resolve(d) is MINIMAX_M2 and family_of(cfg) is MINIMAX_M2 and config_from_hf(d) == cfg
    assert (MINIMAX_M2.attention, MINIMAX_M2.router) == ("softmax_kv_cache", "sigmoid_group_topk")
    assert cfg.num_experts == 8 and all(cfg.is_moe_layer(i) for i in range(2))
    model = MiniMaxM2CausalLM(cfg)
    assert family_of(model) is MINIMAX_M2
    blocks = [layer.block_sparse_moe for layer in model.model.layers]
    assert blocks == model.moe_blocks()
    assert model.router_parameters() == [block.gate.weight for block in blocks]  # the bias is a buffer
    assert all("e_score_correction_bias" not in name for name, _ in model.named_parameters())
    adapter = MINIMAX_M2.state_dict_adapter
    assert [name for name, _ in adapter.expert_params(cfg, 1, 3)] == [
        f"model.layers.1.block_sparse_moe.experts.3.{p}.weight" for p in ("w1", "w3", "w2")
    ]
    assert all(is_expert_param(name) for name, _ in adapter.expert_params(cfg, 1, 3))
    assert not is_expert_param("model.layers.1.block_sparse_moe.e_score_correction_bias")
    parts = MINIMAX_M2.decode(model)
    assert parts.layers[1].mlp is blocks[1] and parts.embed is model.model.embed_tokens


def test_transformers_reads_our_config_json_as_the_same_model(tmp_path, config_kwargs):
    save_pretrained(our_model(config_kwargs, seed=0), tmp_path)
    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert type(hf_config).__name__ == "MiniMaxM2Config"
    rotary, head_dim = config_kwargs["rotary_dim"], config_kwargs["head_dim"]
    assert hf_config.rope_parameters["partial_rotary_factor"] == rotary / head_dim
    assert hf_config.rope_parameters["rope_theta"] == config_kwargs["rope_theta"]
    assert (hf_config.num_local_experts, hf_config.head_dim, hf_config.tie_word_embeddings) == (
        config_kwargs["num_local_experts"], head_dim, False
    )  # fmt: skip
    # the fields SGLang 0.5.17 reads (models/minimax_m2.py), which transformers keeps as written
    assert (hf_config.use_qk_norm, hf_config.qk_norm_type, hf_config.scoring_func, hf_config.use_routing_bias) == (
        True, "per_layer", "sigmoid", True
    )  # fmt: skip
    assert hf_config.rotary_dim == rotary
    # and transformers' own config.json reads back as moerl's config
    HfMiniMaxM2Config(**config_kwargs).save_pretrained(tmp_path / "hf")
    hf_written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert MiniMaxM2Config.from_hf_dict(hf_written) == our_config(config_kwargs)


# --- logits both ways round -------------------------------------------------------------------------------


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, config_kwargs):
    hf = hf_model(config_kwargs, seed=2)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="16KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=3)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert isinstance(model, MiniMaxM2CausalLM)
            assert_same_logits(model(ids, mask), theirs, mask, atol=ATOL)
        assert_same_logits(model(ids), hf(input_ids=ids).logits, torch.ones_like(mask), atol=ATOL)
    for layer, block in enumerate(model.moe_blocks()):  # the (non-zero) bias was loaded, as a float32 buffer
        hf_bias = hf.model.layers[layer].mlp.e_score_correction_bias
        assert block.gate.e_score_correction_bias.dtype == torch.float32 and hf_bias.abs().sum() > 0
        assert torch.equal(block.gate.e_score_correction_bias, hf_bias)


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config_kwargs):
    model = our_model(config_kwargs, seed=1)
    save_pretrained(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(hf, HfMiniMaxM2ForCausalLM)
    for layer, block in enumerate(model.moe_blocks()):
        assert torch.equal(hf.model.layers[layer].mlp.e_score_correction_bias, block.gate.e_score_correction_bias)
    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"])
    with torch.no_grad():
        assert_same_logits(model(ids, mask), hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits,
                           mask, atol=ATOL)  # fmt: skip


def test_the_correction_bias_changes_the_choice_and_the_logits(tmp_path):
    """Without the bias the logits differ: the tests above would catch a bias dropped or mis-named."""
    kwargs = CONFIGS["half_rotary_top2"]
    hf = hf_model(kwargs, seed=2)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    ids, mask, _ = left_padded_batch(kwargs["vocab_size"], seed=3)
    with torch.no_grad():
        with_bias = model(ids, mask)
        for block in model.moe_blocks():
            block.gate.e_score_correction_bias.zero_()
        assert (model(ids, mask) - with_bias)[mask.bool()].abs().max() > 1e-3


def shared_prompt_logits_against_transformers(model, hf, vocab: int) -> None:
    """forward_shared_prompts on 2 left-padded prompts and 3 right-padded responses equals transformers' forward
    over each prompt + response without padding."""
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
        prompt = prompts[int(prompt_index[row])]
        # slot 0 predicts the response's first token; slot t its token t (fed response[:t])
        theirs = response_logits(hf, prompt, r + [0])[: len(r) + 1]
        torch.testing.assert_close(ours[row, : len(r) + 1], theirs, atol=ATOL, rtol=0)
        assert ours[row, : len(r) + 1].abs().mean() > 0.1


def test_shared_prompt_forward_equals_transformers(tmp_path, config_kwargs):
    hf = hf_model(config_kwargs, seed=4)
    hf.save_pretrained(tmp_path)
    shared_prompt_logits_against_transformers(load_pretrained(tmp_path), hf, config_kwargs["vocab_size"])


def test_gradients_match_transformers(tmp_path, config_kwargs):
    """The trainer differentiates token log-probs: every parameter's gradient matches transformers' (whose
    experts are fused in memory: gate_up_proj [E, 2I, H] = [w1; w3] per expert, down_proj [E, H, I] = w2); an
    expert no token chose has none (transformers': zeros)."""
    hf = hf_model(config_kwargs, seed=7).train()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=8)
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (token_logprobs(hf_logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    inter, chosen = config_kwargs["intermediate_size"], 0
    for name, p in ours.named_parameters():
        if ".block_sparse_moe.experts." in name:
            prefix, rest = name.split(".block_sparse_moe.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = hf_grads[f"{prefix}.mlp.experts.{'down_proj' if proj == 'w2' else 'gate_up_proj'}"][expert]
            want = {"w1": fused[:inter], "w3": fused[inter:], "w2": fused}[proj]
            if p.grad is None:
                assert not want.any(), name
                continue
            chosen += 1
        else:
            want = hf_grads[name.replace(".block_sparse_moe.", ".mlp.")]
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4, msg=name)
    assert chosen >= 3 * config_kwargs["num_local_experts"]  # most experts got tokens
    assert ours.model.layers[0].block_sparse_moe.gate.weight.grad.abs().sum() > 0  # the router learns


def test_bf16_checkpoints_round_trip_with_transformers(tmp_path):
    """transformers' dtype auto reads our bf16 checkpoint as bf16 and writes back the same bits under the same
    names; moerl reads the bias in float32 (kept_in_float32) and its fp32 forward equals transformers'.
    transformers keeps no MiniMax-M2 tensor in fp32: its bf16 save holds the bias as BF16."""
    kwargs = CONFIGS["half_rotary_top2"]
    ours = our_model(kwargs, seed=9).to(torch.bfloat16)
    save_pretrained(ours, tmp_path / "ours")
    assert checkpoint_dtype(tmp_path / "ours") == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert hf.dtype == torch.bfloat16
    hf.save_pretrained(tmp_path / "hf")
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16
    back = load_state_dict_from_dir(tmp_path / "hf")
    published = MINIMAX_M2.state_dict_adapter.to_hf(ours.state_dict())
    assert set(back) == set(published)
    for name, tensor in published.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor), name
    loaded = load_pretrained(tmp_path / "hf", dtype=None)
    for name, t in loaded.state_dict().items():
        assert t.dtype == (torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16), name
    for block, bias in zip(loaded.moe_blocks(), (b.gate.e_score_correction_bias for b in ours.moe_blocks()),
                           strict=True):  # fmt: skip
        assert torch.equal(block.gate.e_score_correction_bias, bias.float())
    # a bf16 checkpoint as moerl publishes it after import (the bias F32 beside BF16 weights) reads in transformers
    save_pretrained(loaded, tmp_path / "published")
    with safe_open(tmp_path / "published" / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.layers.0.block_sparse_moe.e_score_correction_bias").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.block_sparse_moe.gate.weight").get_dtype() == "BF16"
    assert checkpoint_dtype(tmp_path / "published") == torch.bfloat16
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=10)
    with torch.no_grad():
        for sub in ("hf", "published"):
            hf32 = AutoModelForCausalLM.from_pretrained(tmp_path / sub, dtype=torch.float32).eval()
            theirs = hf32(input_ids=ids, attention_mask=mask, position_ids=positions).logits
            assert_same_logits(load_pretrained(tmp_path / sub)(ids, mask), theirs, mask, atol=ATOL)


# --- the router --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_router_is_transformers_sigmoid_biased_topk_bit_for_bit_in_fp32(config_name):
    """MiniMaxM2TopKRouter (sigmoid of the logits, top-k of scores + correction bias, the chosen scores without the
    bias renormalised) and the shared block's sigmoid_group_topk router with one group choose the same experts
    (as sets: transformers' topk is unsorted) with the same fp32 weights, bit for bit."""
    kwargs = CONFIGS[config_name]
    hf_config = HfMiniMaxM2Config(**kwargs)
    hf_router = MiniMaxM2TopKRouter(hf_config)
    block = moe_block(our_config(kwargs))
    experts = kwargs["num_local_experts"]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        hf_router.weight.copy_(torch.randn(hf_router.weight.shape, generator=gen) * 0.5)
        bias = torch.randn(experts, generator=gen) * 0.3
        block.gate.weight.copy_(hf_router.weight)
        block.gate.e_score_correction_bias.copy_(bias)
        hidden = torch.randn(512, kwargs["hidden_size"], generator=gen)
        hf_logits, hf_weights, hf_idx = hf_router(hidden, bias)
        logits, idx, weights = block.route(hidden)
    assert torch.equal(logits, hf_logits)
    hf_order, order = hf_idx.argsort(-1), idx.argsort(-1)
    assert torch.equal(idx.gather(1, order), hf_idx.gather(1, hf_order))
    assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order))
    torch.testing.assert_close(weights.sum(-1), torch.ones(512))
    # the bias changes the choice but not the weights' source: without it other experts are chosen
    without = hf_router(hidden, torch.zeros(experts))[2].sort(-1)[0]
    assert not torch.equal(without, hf_idx.sort(-1)[0])


# --- the torch engine --------------------------------------------------------------------------------------

ENGINE_PROMPTS = [("p0", [5, 9, 3]), ("p1", [7, 1, 2, 8, 30, 11, 40]), ("p2", [4])]


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_engine_logprobs_equal_transformers_and_update_in_place(tmp_path, config_name):
    """The torch engine (prefill + decode steps, decode.py: q/k norms over the whole projection, partial rotary)
    on a checkpoint transformers wrote: its log-probs equal a transformers recompute of the same tokens; an
    in-place update to another version generates what an engine opened on that version does."""
    kwargs = CONFIGS[config_name]
    hf = hf_model(kwargs, seed=11)
    hf.save_pretrained(tmp_path / "v0")
    engine = TorchEngine.from_checkpoint(tmp_path / "v0")
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.3)
    requests = sample_requests(ENGINE_PROMPTS, params, lambda prompt_id, k: sample_seed(3, 1, prompt_id, k))
    generations = engine.generate(requests, params)
    assert all(len(g.response_ids) == 6 for g in generations)
    for request, generation in zip(requests, generations, strict=True):
        expected = response_logprobs(hf, request.prompt_ids, generation.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)

    hf_model(kwargs, seed=12).save_pretrained(tmp_path / "v1")
    engine.update_weights(tmp_path / "v1")
    assert engine.generate(requests, params) == TorchEngine.from_checkpoint(tmp_path / "v1").generate(requests, params)


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_engine_recorded_routes_are_the_models_own_routing(tmp_path, config_name):
    """TorchEngine(record_routes=True): every MoE layer's top-k of every token fed (prompt + response but the last
    token; -1 where the engine ran no MLP) is the set the model's own routers choose over the same tokens, in fp32
    without exception."""
    kwargs = CONFIGS[config_name]
    hf_model(kwargs, seed=13).save_pretrained(tmp_path)
    engine = TorchEngine.from_checkpoint(tmp_path, record_routes=True)
    policy = load_pretrained(tmp_path)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.3)
    requests = sample_requests(ENGINE_PROMPTS, params, lambda prompt_id, k: sample_seed(4, 1, prompt_id, k))
    generations = engine.generate(requests, params)
    blocks, top_k = policy.moe_blocks(), kwargs["num_experts_per_tok"]
    chosen: list[torch.Tensor] = []
    for request, g in zip(requests, generations, strict=True):
        tokens = list(request.prompt_ids) + g.response_ids[:-1]
        assert g.routed_experts.shape == (len(tokens), len(blocks), top_k)
        routes = torch.from_numpy(g.routed_experts.astype("int64"))
        assert ((routes >= -1) & (routes < kwargs["num_local_experts"])).all()
        assert (routes[:, 0] >= 0).all()  # -1 only where the engine ran no MLP (the last layer's, prompt tokens)
        policy.set_engine_routes(routes.transpose(0, 1))
        policy.count_route_disagreement()
        with torch.no_grad():
            policy(torch.tensor([tokens]))
        counts = policy.route_disagreement()
        policy.set_engine_routes(None)
        assert counts[:, 2].tolist() == (routes[..., 0] >= 0).sum(0).tolist()  # every recorded token compared
        assert counts[:, 0].sum() == 0 and counts[:, 1].sum() == 0, counts
        chosen.append(routes)
    assert len({tuple(r.flatten().tolist()) for r in chosen}) > 1


# --- expert parallelism ------------------------------------------------------------------------------------

EP_CONFIG = CONFIGS["half_rotary_top2"]
EP_PLACEMENT = ExpertPlacement.from_lists([[3, 0, 2, 1, 7, 4, 6, 5], [1, 2, 5, 0, 4, 6, 7, 3]], ep_size=2)
EP_ROWS = (slice(0, 2), slice(2, 3))  # the batch rows each EP rank runs


def ep_full_model() -> MiniMaxM2CausalLM:
    return our_model(EP_CONFIG, seed=15).train()


def ep_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return probe_batch(EP_CONFIG["vocab_size"], seed=16)


def ep_worker(rank: int, world: int, out_dir) -> None:
    """EP rank `rank`'s model (its experts only, under their global names), its rows of the batch, the
    all-to-all dispatch: its logits and its experts' gradients of sum(logits * probe) over every rank's rows."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    full = ep_full_model()
    model = MiniMaxM2CausalLM(full.config, EP_PLACEMENT, mesh.ep_rank)
    mine = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    adapter = MINIMAX_M2.state_dict_adapter
    assert set(adapter.to_hf(mine)) == set(adapter.expected_shapes(full.config, EP_PLACEMENT, mesh.ep_rank))
    model.load_state_dict({name: full.state_dict()[name] for name in mine})
    model.set_dispatch(make_dispatch("alltoall", mesh, full.config.num_local_experts))
    save_rows_and_expert_grads(model, rank, EP_ROWS[rank], ep_batch(), out_dir)


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    full = ep_full_model()
    ids, mask, probe = ep_batch()
    logits = full(ids, mask)
    (logits * probe).sum().backward()
    run_gloo(ep_worker, 2, tmp_path)
    for rank, rows in enumerate(EP_ROWS):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert_same_logits(got["logits"], logits[rows].detach(), mask[rows], atol=ATOL)
        grads = expert_grads(got)
        for layer in range(2):
            held = {n.split(".experts.")[1].split(".")[0] for n in grads if f".layers.{layer}." in n}
            assert held == {str(e) for e in EP_PLACEMENT.held(layer, rank)}
        for name, grad in grads.items():
            torch.testing.assert_close(grad, full.get_parameter(name).grad, atol=1e-5, rtol=1e-5, msg=name)


# --- bad checkpoints: one MoerlError naming the input and the fix -----------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    hf_model(CONFIGS["half_rotary_top2"], seed=18).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_mtp_tensors_are_dropped_on_import(good_checkpoint, capsys):
    """The release holds multi-token-prediction layers (model.layers.{num_hidden_layers + i}.*, num_mtp_modules):
    the loader skips them, import says so in one line with the reason, and any other extra tensor is refused."""
    edit_config(good_checkpoint, num_mtp_modules=3)
    cfg = check_checkpoint(good_checkpoint)
    assert cfg == our_config(CONFIGS["half_rotary_top2"])  # the field alone changes nothing
    before = load_pretrained(good_checkpoint).state_dict()
    names = ("model.layers.2.self_attn.q_proj.weight", "model.layers.3.block_sparse_moe.experts.0.w1.weight")
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(8, 64) for name in names}))
    after = load_pretrained(good_checkpoint).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    save_tokenizer(good_checkpoint)
    validate_checkpoint_dir(good_checkpoint)
    assert "2 tensors dropped on import (a multi-token-prediction layer" in capsys.readouterr().out
    rewrite_weights(good_checkpoint, lambda t: t.update({"model.layers.1.block_sparse_moe.extra": torch.ones(2)}))
    with pytest.raises(MoerlError, match=r"unexpected tensor model\.layers\.1\.block_sparse_moe\.extra"):
        load_pretrained(good_checkpoint)


def test_missing_tensor_is_named(good_checkpoint):
    name = "model.layers.1.block_sparse_moe.e_score_correction_bias"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=rf"tensor {name} is missing \(expected shape \[8\]"):
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named_with_its_file(good_checkpoint):
    name = "model.layers.0.self_attn.k_norm.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(16)}))
    with pytest.raises(MoerlError, match=rf"model\.safetensors: tensor {name} has shape \[16\], expected \[32\]"):
        load_pretrained(good_checkpoint)


def test_in_memory_bias_name_is_not_a_checkpoint_name(good_checkpoint):
    """The router's in-memory name for the bias (gate.e_score_correction_bias) is refused in a file by name."""
    name = "model.layers.0.block_sparse_moe.gate.e_score_correction_bias"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.zeros(8)}))
    with pytest.raises(MoerlError, match=rf"unexpected tensor {name}"):
        load_pretrained(good_checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         r"quantization_config = .* is not supported by moerl \(the released MiniMax-M2 weights are FP8 .*bf16"),
        (dict(use_qk_norm=False), r"use_qk_norm = False is not supported .*set use_qk_norm: True"),
        (dict(use_qk_norm=None), r"use_qk_norm = None is not supported .*set use_qk_norm: True"),
        (dict(qk_norm_type="per_head"), r"qk_norm_type = 'per_head' is not supported .*'per_layer'"),
        (dict(scoring_func="softmax"), r"scoring_func = 'softmax' is not supported .*'sigmoid'"),
        (dict(scoring_func=None), r"scoring_func = None is not supported .*'sigmoid'"),
        (dict(use_routing_bias=False), r"use_routing_bias = False is not supported .*set use_routing_bias: True"),
        (dict(shared_intermediate_size=16), r"shared_intermediate_size = 16 is not supported .*set it to 0"),
        (dict(attn_type_list=[1, 0]), r"attn_type_list = \[1, 0\] is not supported .*full softmax attention"),
        (dict(tie_word_embeddings=True), r"tie_word_embeddings = True is not supported .*set it to false"),
        (dict(router_jitter_noise=0.01), r"router_jitter_noise = 0.01 is not supported .*set it to 0.0"),
        (dict(rotary_dim=None), r"partial_rotary_factor = 0.5 without rotary_dim is not supported .*rotary_dim: 8"),
        (dict(rotary_dim=4), r"rotary_dim = 4 but rope_parameters.partial_rotary_factor = 0.5 of head_dim 16"),
        (dict(hidden_act="gelu"), r"hidden_act = 'gelu' is not supported by moerl"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
         r"rope_parameters.rope_type 'yarn' is not supported"),
        (dict(num_local_experts=0), r"no experts \(num_local_experts 0\)"),
        (dict(intermediate_size=None), r"missing required MiniMax-M2 fields \['intermediate_size'\]"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok = 9 exceeds num_local_experts = 8"),
    ],
    ids=["fp8_quantized", "no_qk_norm", "qk_norm_missing", "qk_norm_type", "scoring_func", "scoring_func_missing",
         "no_routing_bias", "shared_experts", "linear_attention_layer", "tied_embeddings", "router_jitter",
         "partial_factor_without_rotary_dim", "rotary_dim_disagrees", "gelu", "yarn", "zero_experts",
         "missing_field", "top_k_over_experts"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        load_pretrained(good_checkpoint)
    assert "\n" not in str(err.value)
    field = next(iter(changes))
    assert field in str(err.value) or (field == "rope_parameters" and "rope_type" in str(err.value))
