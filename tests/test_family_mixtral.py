"""The Mixtral family (steps/models/mixtral/) against transformers 5.23's MixtralForCausalLM, on tiny random models
built by transformers' own config class: the tensor names of Mixtral's published checkpoints, which
save_pretrained writes (block_sparse_moe.experts.E.w1/w2/w3); equal logits both ways round, with left padding and
through forward_shared_prompts; gradients; a bf16 round trip; the torch engine's log-probs; an EP=2 forward over
gloo; the router's arithmetic; sliding windows; and one clear error for each bad checkpoint."""

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
from transformers import MixtralConfig as HfMixtralConfig
from transformers import MixtralForCausalLM as HfMixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.hf_checkpoint import (
    checkpoint_dtype,
    expected_tensor_shapes,
    load_pretrained,
    load_state_dict_from_dir,
    save_pretrained,
)
from steps.models.kernels import token_logprobs
from steps.models.mixtral.config import MixtralConfig
from steps.models.mixtral.model import MixtralCausalLM, moe_block
from steps.models.mixtral.spec import MIXTRAL
from steps.models.placement import ExpertPlacement, is_expert_param
from steps.models.registry import config_from_hf, family_of, resolve

# A: top-2 of 4 experts, 2 kv heads, rope_theta 1000, no window.
# B: top-3 of 6, one kv head, the default rope_theta, a window that cannot bind (>= max_position_embeddings).
# (Tied embeddings, an explicit head_dim and a binding window are refused at load: see the sliding-window test.)
CONFIGS = {
    "top2_untied": dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        rope_theta=1000.0,
    ),
    "top3_window": dict(
        vocab_size=64, hidden_size=32, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, num_local_experts=6, num_experts_per_tok=3, max_position_embeddings=64,
        rms_norm_eps=1e-6, sliding_window=64,
    ),
}  # fmt: skip
ATOL = 5e-5  # fp32 logits, both ways round (observed up to 1.0e-5; the brief allows 1e-4)


def hf_model(kwargs: dict, seed: int) -> HfMixtralForCausalLM:
    torch.manual_seed(seed)
    hf = HfMixtralForCausalLM(HfMixtralConfig(**kwargs))
    randomize_(hf, seed=seed)
    return hf.eval()


@pytest.fixture(params=sorted(CONFIGS))
def config_kwargs(request):
    return dict(CONFIGS[request.param])


# --- names: what Mixtral's checkpoints hold and transformers writes --------------------------------------------


def test_state_dict_names_are_what_transformers_writes(tmp_path, config_kwargs):
    HfMixtralForCausalLM(HfMixtralConfig(**config_kwargs)).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = MixtralConfig(**config_kwargs)
    ours = {name: tuple(t.shape) for name, t in MixtralCausalLM(cfg).state_dict().items()}
    assert ours == on_disk == expected_tensor_shapes(cfg)
    # the Hub's per-expert names (w1 gate, w3 up, w2 down), not transformers' in-memory fused experts
    experts = config_kwargs["num_local_experts"] - 1
    assert on_disk[f"model.layers.1.block_sparse_moe.experts.{experts}.w2.weight"] == (32, cfg.intermediate_size)
    assert not any(".mlp." in name or "gate_up_proj" in name for name in on_disk)


def test_the_published_8x7b_config_resolves_and_its_tensors_add_up():
    """Mixtral-8x7B-v0.1's config.json as published (written by transformers v4: rope_theta at the top, torch_dtype,
    no head_dim): its expected tensors are the checkpoint's 995 tensors and 46,702,792,704 parameters."""
    d = {
        "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
    }  # fmt: skip
    assert resolve(d) is MIXTRAL
    cfg = config_from_hf(d)
    assert (cfg.head_dim, cfg.rope_theta, cfg.num_experts, cfg.sliding_window) == (128, 1e6, 8, None)
    shapes = MIXTRAL.state_dict_adapter.expected_shapes(cfg)
    assert len(shapes) == 995
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 46_702_792_704
    assert shapes["model.layers.31.block_sparse_moe.experts.7.w1.weight"] == (14336, 4096)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)


def test_the_family_is_registered_and_its_modules_are_its_checkpoint_names():
    cfg = MixtralConfig(**CONFIGS["top2_untied"])
    model = MixtralCausalLM(cfg)
    assert family_of(cfg) is MIXTRAL and family_of(model) is MIXTRAL
    assert (MIXTRAL.attention, MIXTRAL.router) == ("softmax_kv_cache", "softmax_topk")
    blocks = [layer.block_sparse_moe for layer in model.model.layers]
    assert [layer.mlp for layer in model.model.layers] == blocks == model.moe_blocks()
    assert model.router_parameters() == [block.gate.weight for block in blocks]
    adapter = MIXTRAL.state_dict_adapter
    state = model.state_dict()
    assert adapter.to_hf(state) is state and adapter.from_hf(state) is state
    assert [name for name, _ in adapter.expert_params(cfg, 1, 3)] == [
        f"model.layers.1.block_sparse_moe.experts.3.{p}.weight" for p in ("w1", "w3", "w2")
    ]
    assert all(is_expert_param(name) for name, _ in adapter.expert_params(cfg, 1, 3))
    parts = MIXTRAL.decode(model)
    assert parts.layers[1].mlp is model.model.layers[1].block_sparse_moe and parts.embed is model.model.embed_tokens


def test_config_round_trips_through_config_json():
    cfg = MixtralConfig(**CONFIGS["top3_window"], eos_token_id=[2, 3], pad_token_id=0)
    d = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert (d["architectures"], d["model_type"], d["dtype"], d["torch_dtype"]) == (
        ["MixtralForCausalLM"], "mixtral", "bfloat16", "bfloat16"
    )
    assert MixtralConfig.from_hf_dict(d) == cfg
    hf = HfMixtralConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert (hf.num_local_experts, hf.head_dim, hf.sliding_window, hf.rope_parameters["rope_theta"]) == (6, 8, 64, 1e6)
    # transformers' defaults where config.json is silent: bos 1, eos 2, rope_theta 1e6
    bare = {k: v for k, v in d.items() if k not in ("bos_token_id", "eos_token_id", "rope_theta", "rope_parameters")}
    cfg = MixtralConfig.from_hf_dict(bare)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.rope_theta) == (1, 2, 1e6)


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
            assert isinstance(model, MixtralCausalLM)
            assert_same_logits(model(ids, mask), theirs, mask, atol=ATOL)
        assert_same_logits(model(ids), hf(input_ids=ids).logits, torch.ones_like(mask), atol=ATOL)


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config_kwargs):
    torch.manual_seed(0)
    model = MixtralCausalLM(MixtralConfig(**config_kwargs))
    randomize_(model, seed=1)
    save_pretrained(model, tmp_path)
    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert type(hf_config).__name__ == "MixtralConfig"
    assert hf_config.num_local_experts == config_kwargs["num_local_experts"]
    assert hf_config.tie_word_embeddings == config_kwargs.get("tie_word_embeddings", False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(hf, HfMixtralForCausalLM)
    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"])
    with torch.no_grad():
        assert_same_logits(model(ids, mask), hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits,
                           mask, atol=ATOL)  # fmt: skip


def shared_prompt_logits_against_transformers(model: MixtralCausalLM, hf: HfMixtralForCausalLM, vocab: int) -> None:
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


def test_shared_prompt_forward_equals_transformers(tmp_path, config_kwargs):
    hf = hf_model(config_kwargs, seed=4)
    hf.save_pretrained(tmp_path)
    shared_prompt_logits_against_transformers(load_pretrained(tmp_path), hf, config_kwargs["vocab_size"])


def test_gradients_match_transformers(tmp_path):
    """The trainer differentiates token log-probs: every parameter's gradient matches transformers' (whose
    experts are fused in memory: gate_up_proj [E, 2I, H] = [w1; w3] per expert, down_proj [E, H, I] = w2)."""
    kwargs = CONFIGS["top2_untied"]
    hf = hf_model(kwargs, seed=7).train()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=8)
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (token_logprobs(hf_logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    inter = kwargs["intermediate_size"]
    for name, p in ours.named_parameters():
        if ".block_sparse_moe.experts." in name:
            prefix, rest = name.split(".block_sparse_moe.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = hf_grads[f"{prefix}.mlp.experts.{'down_proj' if proj == 'w2' else 'gate_up_proj'}"][expert]
            want = {"w1": fused[:inter], "w3": fused[inter:], "w2": fused}[proj]
        else:
            want = hf_grads[name.replace(".block_sparse_moe.", ".mlp.")]
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4, msg=name)
    assert ours.model.layers[0].block_sparse_moe.gate.weight.grad.abs().sum() > 0


def test_bf16_checkpoints_round_trip_with_transformers(tmp_path):
    """transformers' dtype auto reads our bf16 checkpoint as bf16 and writes back the same bits under the same
    names; an fp32 forward of it equals transformers'."""
    kwargs = CONFIGS["top2_untied"]
    ours = MixtralCausalLM(MixtralConfig(**kwargs))
    randomize_(ours, seed=9)
    ours = ours.to(torch.bfloat16)
    save_pretrained(ours, tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert hf.dtype == torch.bfloat16
    hf.save_pretrained(tmp_path / "hf")
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16
    back = load_state_dict_from_dir(tmp_path / "hf")
    assert set(back) == set(ours.state_dict())
    for name, tensor in ours.state_dict().items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor), name
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=10)
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf32(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(load_pretrained(tmp_path / "hf")(ids, mask), theirs, mask, atol=ATOL)


# --- the router --------------------------------------------------------------------------------------------


def test_router_is_mixtrals_softmax_topk_renormalised_bit_for_bit_in_fp32():
    """MixtralTopKRouter (softmax of the fp32 logits, top-k, divided by their sum) and the shared block with
    norm_topk_prob=True choose the same experts with the same fp32 weights, bit for bit."""
    kwargs = CONFIGS["top3_window"]
    hf_router = MixtralTopKRouter(HfMixtralConfig(**kwargs))
    block = moe_block(MixtralConfig(**kwargs))
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.5)
        block.gate.weight.copy_(hf_router.weight)
        hidden = torch.randn(512, kwargs["hidden_size"], generator=torch.Generator().manual_seed(0))
        hf_logits, hf_weights, hf_idx = hf_router(hidden)
        logits, idx, weights = block.route(hidden)
    assert torch.equal(logits, hf_logits) and torch.equal(idx, hf_idx) and torch.equal(weights, hf_weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(512))


# --- the torch engine --------------------------------------------------------------------------------------

ENGINE_PROMPTS = [("p0", [5, 9, 3]), ("p1", [7, 1, 2, 8, 30, 11, 40]), ("p2", [4])]


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_engine_logprobs_equal_transformers_and_update_in_place(tmp_path, config_name):
    """The torch engine (prefill + decode steps over its key/value tree) on a checkpoint transformers wrote: its
    log-probs equal a transformers recompute of the same tokens; an in-place update to another version generates
    what an engine opened on that version does."""
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


# --- sliding windows ---------------------------------------------------------------------------------------


def test_a_binding_window_tied_head_and_explicit_head_dim_match_transformers_when_built_in_code(tmp_path):
    """What config.json loading refuses (for the engines' sake) still computes as transformers does in a model
    built in code: the shared masks apply Mixtral's window as transformers does (key position > query position -
    window; 4 over 11 tokens, left-padded, and through forward_shared_prompts), with a tied head and a head_dim
    other than hidden_size // num_attention_heads. The torch engine's decoder refuses the window."""
    kwargs = {**CONFIGS["top2_untied"], "sliding_window": 4, "tie_word_embeddings": True, "head_dim": 16}
    hf = hf_model(kwargs, seed=13)
    ours = MixtralCausalLM(MixtralConfig(**kwargs))
    hf.save_pretrained(tmp_path)  # (loading the directory would refuse its window: the state dict only)
    ours.load_state_dict(load_state_dict_from_dir(tmp_path), strict=True)
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=14)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(ours(ids, mask), theirs, mask, atol=ATOL)
        no_window = hf_model({**kwargs, "sliding_window": None}, seed=13)
        unwindowed = no_window(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert (unwindowed - theirs)[0, -1].abs().max() > 1e-3  # the window binds
    shared_prompt_logits_against_transformers(ours, hf, kwargs["vocab_size"])
    with pytest.raises(MoerlError, match=r"no sliding-window attention: Mixtral's sliding_window = 4 < max_posi"):
        TorchEngine(ours)
    assert ours.lm_head is None
    save_pretrained(ours, tmp_path / "ours")
    with pytest.raises(MoerlError, match=r"ours/config\.json: head_dim = 16 is not supported by moerl"):
        load_pretrained(tmp_path / "ours")


# --- expert parallelism ------------------------------------------------------------------------------------

EP_CONFIG = CONFIGS["top2_untied"]
EP_PLACEMENT = ExpertPlacement.from_lists([[3, 0, 2, 1], [1, 2, 3, 0]], ep_size=2)  # not the identity
EP_ROWS = (slice(0, 2), slice(2, 3))  # the batch rows each EP rank runs


def ep_full_model() -> MixtralCausalLM:
    model = MixtralCausalLM(MixtralConfig(**EP_CONFIG))
    randomize_(model, seed=15)
    return model


def ep_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return probe_batch(EP_CONFIG["vocab_size"], seed=16)


def ep_worker(rank: int, world: int, out_dir) -> None:
    """EP rank `rank`'s model (its experts only, under their global names), its rows of the batch, the
    all-to-all dispatch: its logits and its experts' gradients of sum(logits * probe) over every rank's rows."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    full = ep_full_model()
    model = MixtralCausalLM(full.config, EP_PLACEMENT, mesh.ep_rank)
    mine = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert mine == MIXTRAL.state_dict_adapter.expected_shapes(full.config, EP_PLACEMENT, mesh.ep_rank)
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
        held = EP_PLACEMENT.held(0, rank)
        assert {n.split(".experts.")[1].split(".")[0] for n in grads if ".layers.0." in n} == {str(e) for e in held}
        for name, grad in grads.items():
            torch.testing.assert_close(grad, full.get_parameter(name).grad, atol=1e-5, rtol=1e-5, msg=name)


# --- bad checkpoints: one MoerlError naming the input and the fix -----------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    hf_model(CONFIGS["top2_untied"], seed=18).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_tensor_is_named(good_checkpoint):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=rf"tensor {name} is missing \(expected shape \[32, 16\]"):
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named_with_its_file(good_checkpoint):
    name = "model.layers.0.block_sparse_moe.gate.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(5, 32)}))
    with pytest.raises(MoerlError, match=rf"model\.safetensors: tensor {name} has shape \[5, 32\], expected \[4, 32"):
        load_pretrained(good_checkpoint)


def test_fused_expert_names_are_rejected(good_checkpoint):
    """transformers' in-memory names are not a checkpoint's: a file holding them is refused by name."""
    name = "model.layers.0.mlp.experts.gate_up_proj"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(4, 32, 32)}))
    with pytest.raises(MoerlError, match=rf"unexpected tensor {name} .* for a Mixtral model"):
        load_pretrained(good_checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_local_experts=0), r"config\.json: no experts \(num_local_experts 0\), .*a dense model has nothing"),
        (dict(intermediate_size=None), r"missing required Mixtral fields \['intermediate_size'\]"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok = 5 exceeds num_local_experts = 4"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config = .* is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
         "rope_parameters.rope_type 'yarn' is not supported"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling = .* is not supported .* set it to null"),
        (dict(hidden_act="gelu"), "hidden_act = 'gelu' is not supported by moerl"),
        (dict(router_jitter_noise=0.01), "router_jitter_noise = 0.01 is not supported .* set it to 0.0"),
        (dict(sliding_window=16), r"sliding_window = 16 is not supported by moerl \(neither the torch engine's "
                                  r"decoder nor SGLang 0\.5\.17's MixtralForCausalLM applies a window, and one "
                                  r"shorter than max_position_embeddings = 64 could bind\); set it to null"),
        (dict(sliding_window=0), "sliding_window = 0 must be null or a positive integer"),
        (dict(head_dim=16), r"head_dim = 16 is not supported by moerl \(SGLang 0\.5\.17's MixtralForCausalLM, "
                            r"models/mixtral\.py:149, uses hidden_size // num_attention_heads = 8\)"),
        (dict(tie_word_embeddings=True), r"tie_word_embeddings = True is not supported .* set it to false"),
    ],
    ids=["zero_experts", "missing_field", "top_k_over_experts", "quantized", "yarn", "linear_scaling", "gelu",
         "router_jitter", "binding_window", "zero_window", "explicit_head_dim", "tied_embeddings"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        load_pretrained(good_checkpoint)
    assert "\n" not in str(err.value)
