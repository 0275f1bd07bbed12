"""GLM-4.5 / GLM-4.6 (steps/models/glm4_moe/) against transformers' Glm4MoeForCausalLM, on tiny random instances
built by transformers' own Glm4MoeConfig: the same logits both ways round (fp32, left-padded batches, forward and
the shared-prompt forward), the same tensor names on disk, bf16 checkpoints, the torch engine's log-probs, an EP=2
forward over gloo, and one clear error for each bad checkpoint."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from family_helpers import assert_same_logits, edit_config, left_padded_batch, rewrite_weights
from model_helpers import randomize_, response_logprobs
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import Glm4MoeConfig as HfGlm4MoeConfig
from transformers import Glm4MoeForCausalLM as HfGlm4MoeForCausalLM

from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.models.decoding import RotaryTable
from steps.models.glm4_moe.config import Glm4MoeConfig
from steps.models.glm4_moe.model import Glm4MoeForCausalLM
from steps.models.hf_checkpoint import (
    check_checkpoint,
    checkpoint_dtype,
    expected_tensor_shapes,
    load_pretrained,
    load_state_dict_from_dir,
    save_pretrained,
)
from steps.models.kernels import token_logprobs
from steps.models.placement import ExpertPlacement
from steps.models.registry import config_from_hf, family_of, resolve

# A: GLM-4.5-like: q/k norms, q/k/v biases, half the head rotated, one dense layer, 2 groups of 4 experts (the
#    best 1 chosen), routed_scaling_factor 2.5, untied head.
# B: GLM-4.5-Air-like: no q/k norm, no bias, a quarter of the head rotated, every layer MoE, two shared experts,
#    no group limit, top-3 without renormalisation, tied head.
CONFIGS = {
    "qk_norm_bias_groups": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
        rope_theta=1000.0, max_position_embeddings=64,
    ),
    "air_quarter_rotary_tied": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, intermediate_size=40, moe_intermediate_size=12, n_routed_experts=6, num_experts_per_tok=3,
        n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0, norm_topk_prob=False,
        use_qk_norm=False, attention_bias=False, partial_rotary_factor=0.25, tie_word_embeddings=True,
        max_position_embeddings=64,
    ),
}  # fmt: skip


def hf_model(kwargs: dict, seed: int) -> HfGlm4MoeForCausalLM:
    """transformers' model of `kwargs`, with weights far from the default init and a non-zero correction bias
    (so that the bias really changes which experts are chosen)."""
    torch.manual_seed(seed)
    hf = HfGlm4MoeForCausalLM(HfGlm4MoeConfig(**kwargs))
    randomize_(hf, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    return hf.eval()


def our_model(kwargs: dict, seed: int) -> Glm4MoeForCausalLM:
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**kwargs))
    randomize_(model, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for block in model.moe_blocks():
            block.gate.e_score_correction_bias.copy_(torch.randn(block.num_experts, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(params=sorted(CONFIGS))
def config_kwargs(request):
    return dict(CONFIGS[request.param])


# --- the arithmetic: logits both ways round ---------------------------------------------------------------


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, config_kwargs):
    hf = hf_model(config_kwargs, seed=0)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert json.loads((tmp_path / "single" / "config.json").read_text())["num_nextn_predict_layers"] == 1

    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=3)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        theirs_unpadded = hf(input_ids=ids).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert isinstance(model, Glm4MoeForCausalLM)
            assert_same_logits(model(ids, mask), theirs, mask)
        assert_same_logits(model(ids), theirs_unpadded, torch.ones_like(mask))
    # the correction bias was loaded (and is a buffer: never trained, kept at its SFT value)
    block = model.moe_blocks()[0]
    layer = next(i for i, layer in enumerate(model.model.layers) if layer.mlp is block)
    hf_bias = hf.model.layers[layer].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(block.gate.e_score_correction_bias, hf_bias)
    assert all("e_score_correction_bias" not in name for name, _ in model.named_parameters())
    assert len(model.router_parameters()) == len(model.moe_blocks())  # the gate weights only


def test_shared_prompt_forward_matches_transformers(tmp_path, config_kwargs):
    """GRPO's forward (each prompt once, its responses after it) gives transformers' logits of prompt + response."""
    hf = hf_model(config_kwargs, seed=4)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    vocab = config_kwargs["vocab_size"]
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (6, 3)]
    responses = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (4, 2, 5)]
    prompt_index = torch.tensor([0, 1, 1])
    width, length = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, p in enumerate(prompts):  # left-padded
        prompt_ids[i, width - len(p) :], prompt_mask[i, width - len(p) :] = torch.tensor(p), 1
    response_ids = torch.zeros(len(responses), length, dtype=torch.long)
    response_mask = torch.zeros_like(response_ids)
    for i, r in enumerate(responses):  # right-padded
        response_ids[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        logits = model.forward_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask, prompt_index)
        for r, response in enumerate(responses):
            prompt = prompts[int(prompt_index[r])]
            full = hf(input_ids=torch.tensor([prompt + response])).logits[0]
            want = full[len(prompt) - 1 :]  # the prompt's last position, then each response position
            got = logits[r, : len(response) + 1]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            assert got.abs().mean() > 0.1


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config_kwargs):
    model = our_model(config_kwargs, seed=6)
    save_pretrained(model, tmp_path)

    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert type(hf_config).__name__ == "Glm4MoeConfig"
    assert hf_config.n_routed_experts == config_kwargs["n_routed_experts"]
    assert hf_config.rope_parameters["partial_rotary_factor"] == config_kwargs["partial_rotary_factor"]
    assert hf_config.num_nextn_predict_layers == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert isinstance(hf, HfGlm4MoeForCausalLM)
    hf.eval()
    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=7)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(model(ids, mask), theirs, mask)


def test_state_dict_names_are_what_transformers_writes(tmp_path, config_kwargs):
    HfGlm4MoeForCausalLM(HfGlm4MoeConfig(**config_kwargs)).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = Glm4MoeConfig(**config_kwargs)
    ours = {name: tuple(t.shape) for name, t in Glm4MoeForCausalLM(cfg).state_dict().items()}
    assert ours == on_disk
    assert expected_tensor_shapes(cfg) == on_disk
    assert any(name.endswith(".mlp.experts.3.down_proj.weight") for name in on_disk)  # per-expert, not fused
    assert any(name.endswith(".mlp.shared_experts.up_proj.weight") for name in on_disk)
    assert not any(name.endswith("o_proj.bias") for name in on_disk)  # o_proj never has a bias


def test_gradients_match_transformers(tmp_path):
    """The trainer differentiates token log-probs: every parameter's gradient matches transformers' (gradients
    reach ~25 here: atol 1e-4); an expert no token chose has none (transformers': zeros)."""
    kwargs = CONFIGS["qk_norm_bias_groups"]
    hf = hf_model(kwargs, seed=8)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=9)
    targets = torch.roll(ids, -1, dims=1)
    weight = mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (token_logprobs(hf_logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    inter, chosen = kwargs["moe_intermediate_size"], 0
    for name, p in ours.named_parameters():
        if ".mlp.experts." in name:  # in memory transformers fuses them: gate_up_proj [E, 2I, H], down_proj
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = hf_grads[f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
            want = {"gate_proj": fused[expert][:inter], "up_proj": fused[expert][inter:], "down_proj": fused[expert]}
            if p.grad is None:
                assert not want[proj].any(), name
                continue
            torch.testing.assert_close(p.grad, want[proj], atol=1e-4, rtol=1e-4, msg=name)
            chosen += 1
        else:
            torch.testing.assert_close(p.grad, hf_grads[name], atol=1e-4, rtol=1e-4, msg=name)
    assert chosen >= 3 * 8  # at least 8 of the 16 routed experts (both groups) got tokens
    assert ours.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0  # the router learns via the top-k weights


def test_partial_rotary_frequencies_are_transformers(config_kwargs):
    """The rotary dims and inv_freq of the training forward and of the engine's RotaryTable are transformers'."""
    hf = HfGlm4MoeForCausalLM(HfGlm4MoeConfig(**config_kwargs))
    cfg = Glm4MoeConfig(**config_kwargs)
    inv_freq = hf.model.rotary_emb.inv_freq
    assert cfg.rotary_dim == 2 * inv_freq.numel() == int(16 * config_kwargs["partial_rotary_factor"])
    table = RotaryTable.default(cfg.rotary_dim, cfg.rope_theta, torch.float32)
    assert torch.equal(table.inv_freq, inv_freq)
    positions = torch.arange(9)[None]
    cos, sin = Glm4MoeForCausalLM(cfg).rotary(positions, torch.float32)
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cos, hf_cos) and torch.equal(sin, hf_sin)


# --- bf16 ------------------------------------------------------------------------------------------------


def test_bf16_checkpoints_round_trip_with_transformers(tmp_path, config_kwargs):
    """Our bf16 checkpoint reads in transformers (dtype auto) with equal fp32 logits. transformers keeps
    e_score_correction_bias in fp32 (_keep_in_fp32_modules_strict), so its own bf16 save holds those tensors as
    F32 beside BF16 weights: moerl reads that as a bf16 checkpoint and keeps the biases in float32."""
    ours = our_model(config_kwargs, seed=10).to(torch.bfloat16)
    save_pretrained(ours, tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert hf.dtype == torch.bfloat16
    hf.save_pretrained(tmp_path / "hf")
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16  # BF16 weights, the F32 bias beside them
    back = load_state_dict_from_dir(tmp_path / "hf")
    for name, tensor in ours.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            assert back[name].dtype == torch.float32 and torch.equal(back[name], tensor.float()), name
        else:
            assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor), name
    loaded = load_pretrained(tmp_path / "hf", dtype=None)
    assert all(t.dtype == (torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16)
               for n, t in loaded.state_dict().items())  # fmt: skip

    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=11)
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf32(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(load_pretrained(tmp_path / "ours")(ids, mask), theirs, mask)
        assert_same_logits(load_pretrained(tmp_path / "hf")(ids, mask), theirs, mask)


# --- the torch engine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_logprobs_equal_transformers(tmp_path, name):
    """The torch engine's prefill + decode steps (decode.py: GqaProjection with partial rotary, the shared
    experts beside the routed ones) give the log-probs of a transformers forward over the same tokens."""
    kwargs = CONFIGS[name]
    save_pretrained(our_model(kwargs, seed=12), tmp_path)
    engine = TorchEngine.from_checkpoint(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(13)
    prompts = [(f"p{i}", torch.randint(3, 64, (n,), generator=gen).tolist()) for i, n in enumerate((5, 9, 2))]
    params = SamplingParams(stop_token_ids=(2,), n=3, max_new_tokens=8, temperature=1.3)
    requests = sample_requests(prompts, params, lambda prompt_id, k: sample_seed(1, 1, prompt_id, k))
    generations = engine.generate(requests, params)
    assert max(len(g.response_ids) for g in generations) > 1
    for request, generation in zip(requests, generations, strict=True):
        expected = response_logprobs(hf, request.prompt_ids, generation.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)


# --- expert parallelism ----------------------------------------------------------------------------------


def test_expert_placement_holds_a_slice_under_global_names(tmp_path):
    kwargs = CONFIGS["qk_norm_bias_groups"]
    cfg = Glm4MoeConfig(**kwargs)
    full = our_model(kwargs, seed=14)
    save_pretrained(full, tmp_path)
    placement = ExpertPlacement.from_lists([[7, 0, 5, 2, 1, 6, 3, 4]] * 2, ep_size=2)
    part = load_pretrained(tmp_path, placement=placement, ep_rank=1)
    names = set(part.state_dict())
    assert names == set(expected_tensor_shapes(cfg, placement, ep_rank=1))
    assert "model.layers.1.mlp.experts.6.gate_proj.weight" in names
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in names
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names  # replicated, like the router
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert names < set(full.state_dict())
    for name in names:
        assert torch.equal(part.state_dict()[name], full.state_dict()[name]), name
    assert part.moe_blocks()[0].held == (1, 6, 3, 4)


def ep_forward(rank: int, world: int, out_dir, slots: list[list[int]]) -> None:
    """An EP=2 rank: its slice of the experts under `slots`, its own row of the batch, the all-to-all dispatch."""
    from steps.expert_parallel.dispatch import make_dispatch
    from steps.expert_parallel.mesh import build_mesh

    mesh = build_mesh(rank, world, world, torch.device("cpu"))
    placement = ExpertPlacement.from_lists(slots, world)
    model = load_pretrained(out_dir / "ckpt", placement=placement, ep_rank=rank)
    model.set_dispatch(make_dispatch("alltoall", mesh, model.config.num_experts))
    ids, mask, _ = left_padded_batch(model.config.vocab_size, seed=15)
    logits = model(ids[rank : rank + 1], mask[rank : rank + 1])
    logits.sum().backward()
    out = {"logits": logits.detach(), "router_grad": model.moe_blocks()[0].gate.weight.grad}
    save_file(out, str(out_dir / f"rank{rank}.safetensors"))


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    kwargs = CONFIGS["qk_norm_bias_groups"]
    full = our_model(kwargs, seed=16)
    save_pretrained(full, tmp_path / "ckpt")
    slots = [[7, 0, 5, 2, 1, 6, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
    run_gloo(ep_forward, 2, tmp_path, slots)
    ids, mask, _ = left_padded_batch(kwargs["vocab_size"], seed=15)
    full = load_pretrained(tmp_path / "ckpt")
    router_grad = torch.zeros_like(full.moe_blocks()[0].gate.weight)
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        full.zero_grad()
        want = full(ids[rank : rank + 1], mask[rank : rank + 1])
        want.sum().backward()
        assert_same_logits(got["logits"], want.detach(), mask[rank : rank + 1])
        torch.testing.assert_close(got["router_grad"], full.moe_blocks()[0].gate.weight.grad, atol=1e-4, rtol=1e-4)
        router_grad += got["router_grad"]
    assert router_grad.abs().sum() > 0


# --- config.json -----------------------------------------------------------------------------------------


def test_config_round_trip_and_registry():
    cfg = Glm4MoeConfig(**CONFIGS["qk_norm_bias_groups"], bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    d = cfg.to_hf_dict(torch.bfloat16)
    assert d["architectures"] == ["Glm4MoeForCausalLM"] and d["model_type"] == "glm4_moe"
    assert d["dtype"] == d["torch_dtype"] == "bfloat16"
    assert d["partial_rotary_factor"] == d["rope_parameters"]["partial_rotary_factor"] == 0.5  # v4 and v5 readers
    assert d["rope_theta"] == d["rope_parameters"]["rope_theta"] == 1000.0
    assert d["head_dim"] == 16 and d["num_nextn_predict_layers"] == 0
    assert Glm4MoeConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg
    assert resolve(d).name == "GLM-4-MoE" and family_of(cfg).model_type == "glm4_moe"
    assert config_from_hf(d) == cfg
    assert cfg.num_experts == 8 and [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_transformers_configs_are_read_v4_and_v5(tmp_path):
    """v5 writes rope_parameters (with partial_rotary_factor); GLM-4.5's own config.json (v4) has them at the top
    level with num_nextn_predict_layers = 1; absent fields take transformers' defaults."""
    HfGlm4MoeConfig(**CONFIGS["air_quarter_rotary_tied"]).save_pretrained(tmp_path)
    v5 = json.loads((tmp_path / "config.json").read_text())
    cfg = Glm4MoeConfig.from_hf_dict(v5)
    assert (cfg.partial_rotary_factor, cfg.rotary_dim, cfg.rope_theta) == (0.25, 4, 10000.0)
    assert cfg == Glm4MoeConfig(**CONFIGS["air_quarter_rotary_tied"])
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=1e6, partial_rotary_factor=0.5, rope_scaling=None, num_nextn_predict_layers=1)
    cfg = Glm4MoeConfig.from_hf_dict(v4)
    assert (cfg.rope_theta, cfg.rotary_dim) == (1e6, 8)
    bare = {k: v for k, v in v4.items() if k not in ("partial_rotary_factor", "rope_theta", "n_group", "head_dim")}
    cfg, hf = Glm4MoeConfig.from_hf_dict(bare), HfGlm4MoeConfig.from_dict(bare)
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (hf.rope_parameters["rope_theta"], 0.5)
    assert (cfg.n_group, cfg.head_dim) == (hf.n_group, 32 // 4)


# --- bad checkpoints: one MoerlError naming the input and the fix ------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    save_pretrained(our_model(CONFIGS["qk_norm_bias_groups"], seed=17), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_good_checkpoint_passes_the_checks(good_checkpoint):
    cfg = check_checkpoint(good_checkpoint)
    assert isinstance(cfg, Glm4MoeConfig)
    assert set(load_state_dict_from_dir(good_checkpoint)) == set(expected_tensor_shapes(cfg))


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_routed_experts=0), "no experts.*moerl supports: .*GLM-4.5/4.6"),
        (dict(moe_intermediate_size=None), r"missing required GLM-4-MoE fields \['moe_intermediate_size'\]"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok = 9 exceeds n_routed_experts = 8"),
        (dict(n_group=3), "n_group = 3 / topk_group = 1 do not split n_routed_experts = 8"),
        (dict(num_experts_per_tok=5), r"top-5 of the best topk_group = 1 of n_group = 2 groups"),
        (dict(first_k_dense_replace=3), r"first_k_dense_replace = 3 must be in \[0, num_hidden_layers=3\)"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters.rope_type 'yarn'"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling = .* is not supported"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
         "head_dim = 16 x partial_rotary_factor = 0.1 gives 1 rotary dims; they must be even"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config = .* is not supported"),
        (dict(hidden_act="gelu"), "hidden_act = 'gelu' is not supported by moerl"),
        (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers = -1 is not supported"),
        (dict(dtype="bfloat16", torch_dtype="bfloat16"), "declares dtype bfloat16 but the weights are stored as"),
    ],
    ids=[
        "zero_experts", "missing_moe_field", "more_experts_per_token_than_experts", "groups_do_not_split",
        "groups_too_few_experts", "no_moe_layer", "rope_parameters_yarn", "rope_scaling_yarn",
        "odd_rotary_dims", "quantization", "hidden_act", "negative_mtp",
        "dtype_is_not_the_weights",
    ],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message):
        load_pretrained(good_checkpoint)


def test_mtp_layers_in_config_are_ignored(good_checkpoint):
    """num_nextn_predict_layers (GLM-4.5: 1) does not change the model: transformers ignores it too."""
    edit_config(good_checkpoint, num_nextn_predict_layers=1)
    assert load_pretrained(good_checkpoint).config == check_checkpoint(good_checkpoint)


def test_mtp_tensors_are_dropped_on_import(good_checkpoint):
    """A checkpoint holding multi-token-prediction layers (model.layers.{num_hidden_layers}.*, as GLM-4.5's
    release does) loads without them; moerl neither trains nor publishes them (config.py)."""
    before = load_pretrained(good_checkpoint).state_dict()
    name = "model.layers.3.eh_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(32, 64)}))
    after = load_pretrained(good_checkpoint).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)


def test_missing_tensor_is_named(good_checkpoint):
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=rf"tensor {name} is missing \(expected shape \[8\]"):
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named_with_its_file(good_checkpoint):
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(32, 9)}))
    with pytest.raises(MoerlError, match=rf"model\.safetensors: tensor {name} has shape \[32, 9\], expected \[32, 16"):
        load_pretrained(good_checkpoint)


def test_qk_norm_without_its_tensors_is_refused(good_checkpoint):
    """use_qk_norm changes the tensors a checkpoint must hold: flipping it off leaves the norms unexpected."""
    edit_config(good_checkpoint, use_qk_norm=False)
    with pytest.raises(MoerlError, match=r"unexpected tensor model\.layers\.0\.self_attn\.k_norm\.weight"):
        load_pretrained(good_checkpoint)
