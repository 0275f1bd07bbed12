"""DeepSeek-V3 (steps/models/deepseek_v3/) against transformers' DeepseekV3ForCausalLM, on tiny random instances
built by transformers' own config class: logits both ways round (fp32, left-padded batches, forward and
forward_shared_prompts), tensor names, bf16 round trip, gradients, the torch engine's log-probs, an EP=2
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
from transformers import DeepseekV3Config as HFConfig
from transformers import DeepseekV3ForCausalLM as HFModel

from steps.demo.char_tokenizer import save_tokenizer
from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.models.checkpoint_validation import validate_checkpoint_dir
from steps.models.deepseek_v3.config import DeepseekConfig
from steps.models.deepseek_v3.model import DeepseekV3ForCausalLM
from steps.models.deepseek_v3.state_dict_adapter import is_mtp_tensor
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
from steps.models.registry import config_from_hf, family_of

YARN = dict(rope_type="yarn", rope_theta=1000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=8,
            beta_slow=1, mscale=0.8, mscale_all_dim=1.2)  # fmt: skip
# A: q LoRA, YaRN with mscale_all_dim (softmax scale and cos/sin factor), interleaved rope, 4 groups choose 2,
#    2 shared experts, one dense layer. B: q_proj, default RoPE not interleaved, one group, tied head, biases.
CONFIGS = {
    "q_lora_yarn_interleave": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=12,
        intermediate_size=40, n_shared_experts=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, rope_parameters=YARN, max_position_embeddings=64,
    ),
    "q_proj_default_tied": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=12,
        intermediate_size=40, n_shared_experts=1, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=6,
        qk_nope_head_dim=10, v_head_dim=14, first_k_dense_replace=0, routed_scaling_factor=1.5,
        norm_topk_prob=False, rope_interleave=False, tie_word_embeddings=True, attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=500.0), rms_norm_eps=1e-5, max_position_embeddings=64,
    ),
}  # fmt: skip


def hf_model(name: str, seed: int) -> HFModel:
    """transformers' model of CONFIGS[name], weights and correction biases far from their init."""
    torch.manual_seed(seed)
    model = HFModel(HFConfig(**CONFIGS[name]))
    randomize(model, seed)
    return model.eval()


def randomize(model: torch.nn.Module, seed: int) -> None:
    """randomize_ (parameters) and the correction-bias buffers, so that the bias changes which experts win."""
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)


def moerl_config(name: str) -> DeepseekConfig:
    return DeepseekConfig.from_hf_dict(json.loads(HFConfig(**CONFIGS[name]).to_json_string()))


@pytest.fixture(params=sorted(CONFIGS))
def name(request):
    return request.param


@pytest.fixture
def hf_checkpoint(tmp_path, name):
    """transformers' save_pretrained of CONFIGS[name] (fp32) and its model."""
    hf = hf_model(name, seed=2)
    hf.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", hf


def test_registry_resolves_deepseek_v3_and_the_config_reads_transformers(hf_checkpoint, name):
    directory, _ = hf_checkpoint
    d = json.loads((directory / "config.json").read_text())
    cfg = config_from_hf(d)
    assert family_of(cfg).name == "DeepSeek-V3" and cfg == moerl_config(name)
    assert cfg.num_experts == CONFIGS[name]["n_routed_experts"]
    assert cfg.q_lora_rank == CONFIGS[name]["q_lora_rank"]
    assert (cfg.rope_scaling is None) == (name == "q_proj_default_tied")
    # to_hf_dict round trip, and transformers reads moerl's config.json as the same DeepseekV3Config
    assert DeepseekConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    ours = HFConfig.from_dict(cfg.to_hf_dict())
    theirs = HFConfig(**CONFIGS[name])
    for field in ("rope_parameters", "q_lora_rank", "rope_interleave", "n_group", "routed_scaling_factor",
                  "first_k_dense_replace", "n_shared_experts", "tie_word_embeddings", "attention_bias"):  # fmt: skip
        got, want = getattr(ours, field), getattr(theirs, field)
        if field == "rope_parameters":
            got = {k: v for k, v in got.items() if k != "type"}
        assert got == want, field


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, hf_checkpoint, name):
    directory, hf = hf_checkpoint
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    ids, mask, positions = left_padded_batch(hf.config.vocab_size, seed=3)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for sub in (directory, tmp_path / "sharded"):
            model = load_pretrained(sub)
            assert isinstance(model, DeepseekV3ForCausalLM)
            assert_same_logits(model(ids, mask), theirs, mask)
        assert_same_logits(model(ids), hf(input_ids=ids).logits, torch.ones_like(mask))
    # the correction bias is loaded, kept a buffer (never a parameter the optimizer steps)
    bias = load_state_dict_from_dir(directory)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias) and bias.abs().sum() > 0
    assert not any("e_score_correction_bias" in n for n, _ in model.named_parameters())


def test_forward_shared_prompts_equals_forward(hf_checkpoint, name):
    """GRPO's forward (each prompt once, its responses after it) gives transformers' logits of prompt + response."""
    directory, hf = hf_checkpoint
    model = load_pretrained(directory)
    gen = torch.Generator().manual_seed(5)
    prompt_ids = torch.randint(0, 64, (2, 6), generator=gen)
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padding
    response_ids = torch.randint(0, 64, (3, 4), generator=gen)
    response_mask = torch.ones(3, 4, dtype=torch.long)
    response_mask[2, 3:] = 0  # right padding
    prompt_index = torch.tensor([0, 1, 1])
    with torch.no_grad():
        got = model.forward_shared_prompts(prompt_ids, prompt_mask, response_ids, response_mask, prompt_index)
        for r in range(3):
            p = int(prompt_index[r])
            prompt = prompt_ids[p][prompt_mask[p].bool()]
            response = response_ids[r][response_mask[r].bool()]
            theirs = hf(input_ids=torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 :]
            torch.testing.assert_close(got[r, : len(response) + 1], theirs, atol=1e-4, rtol=0)


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, name):
    model = DeepseekV3ForCausalLM(moerl_config(name))
    randomize(model, seed=1)
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["num_nextn_predict_layers"] == 0
    assert type(AutoConfig.from_pretrained(tmp_path)).__name__ == "DeepseekV3Config"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(hf, HFModel)
    ids, mask, positions = left_padded_batch(64)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(model(ids, mask), theirs, mask)


def test_state_dict_names_are_what_transformers_writes(hf_checkpoint, name):
    directory, _ = hf_checkpoint
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        on_disk = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    cfg = moerl_config(name)
    ours = {n: tuple(t.shape) for n, t in DeepseekV3ForCausalLM(cfg).state_dict().items()}
    assert ours == on_disk == expected_tensor_shapes(cfg)
    assert any(n.endswith(".mlp.experts.3.down_proj.weight") for n in on_disk)  # per-expert, not fused
    assert any(n.endswith(".mlp.shared_experts.up_proj.weight") for n in on_disk)


def test_bf16_checkpoints_round_trip_with_transformers(tmp_path, name):
    """Our bf16 checkpoint reads in transformers (dtype auto) and its save gives back the same bits, with the
    correction bias in float32 (transformers' _keep_in_fp32_modules_strict), which moerl reads and keeps so."""
    ours = DeepseekV3ForCausalLM(moerl_config(name))
    randomize(ours, seed=9)
    ours = ours.to(torch.bfloat16)
    save_pretrained(ours, tmp_path / "ours")
    assert checkpoint_dtype(tmp_path / "ours") == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert hf.dtype == torch.bfloat16
    hf.save_pretrained(tmp_path / "hf")
    back = load_state_dict_from_dir(tmp_path / "hf")
    for n, tensor in ours.state_dict().items():
        if n.endswith("e_score_correction_bias"):
            assert back[n].dtype == torch.float32 and torch.equal(back[n], tensor.float()), n
        else:
            assert back[n].dtype == torch.bfloat16 and torch.equal(back[n], tensor), n
    # ... and moerl reads transformers' bf16 save: bf16 weights with the float32 correction bias beside them,
    # which it keeps in float32 (steps/models/moe.py kept_in_float32).
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16
    loaded = load_pretrained(tmp_path / "hf", dtype=None)
    for n, tensor in loaded.state_dict().items():
        expected = torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16
        assert tensor.dtype == expected and torch.equal(tensor, back[n]), n
    save_pretrained(loaded, tmp_path / "again")  # and publishes it so: F32 bias, BF16 weights
    again = load_state_dict_from_dir(tmp_path / "again")
    assert all(again[n].dtype == back[n].dtype and torch.equal(again[n], back[n]) for n in back)
    ids, mask, positions = left_padded_batch(64, seed=10)
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf32(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(load_pretrained(tmp_path / "ours")(ids, mask), theirs, mask)


def test_gradients_match_transformers(hf_checkpoint, name):
    directory, hf = hf_checkpoint
    ours = load_pretrained(directory)
    ids, mask, positions = left_padded_batch(64, seed=8)
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (token_logprobs(hf_logits, targets) * weight).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    inter = CONFIGS[name]["moe_intermediate_size"]
    for n, p in ours.named_parameters():
        if ".mlp.experts." in n:  # transformers fuses them in memory: gate_up_proj [E, 2I, H], down_proj
            prefix, rest = n.split(".mlp.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = hf_grads[f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][expert]
            want = {"gate_proj": fused[:inter], "up_proj": fused[inter:], "down_proj": fused}[proj]
        else:
            want = hf_grads[n]
        got = torch.zeros_like(want) if p.grad is None else p.grad  # an expert no token chose: no gradient
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=n)
    assert ours.moe_blocks()[0].gate.weight.grad.abs().sum() > 0  # the router learns via the top-k weights


def test_torch_engine_logprobs_equal_transformers(hf_checkpoint, name):
    directory, hf = hf_checkpoint
    engine = TorchEngine.from_checkpoint(directory)
    gen = torch.Generator().manual_seed(11)
    prompts = [(f"p{i}", torch.randint(0, 64, (n,), generator=gen).tolist()) for i, n in enumerate((3, 7, 5))]
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.3)
    requests = sample_requests(prompts, params, lambda prompt_id, k: sample_seed(7, 1, prompt_id, k))
    generations = engine.generate(requests, params)
    assert max(len(g.response_ids) for g in generations) > 1
    for request, generation in zip(requests, generations, strict=True):
        expected = response_logprobs(hf, request.prompt_ids, generation.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)


# --- EP=2: each rank holds a slice of the experts under global names, and the forward equals the full model's


def ep_forward(rank: int, world: int, out_dir, directory: str) -> None:
    from steps.expert_parallel.dispatch import make_dispatch
    from steps.expert_parallel.mesh import build_mesh

    mesh = build_mesh(rank, world, world, torch.device("cpu"))
    cfg = check_checkpoint(directory)
    placement = ExpertPlacement.from_lists([[3, 0, 6, 1, 5, 2, 7, 4], [7, 6, 5, 4, 3, 2, 1, 0]], world)
    model = load_pretrained(directory, placement=placement, ep_rank=mesh.ep_rank)
    assert set(model.state_dict()) == set(expected_tensor_shapes(cfg, placement, mesh.ep_rank))
    model.set_dispatch(make_dispatch("alltoall", mesh, cfg.num_experts))
    ids, mask, _ = left_padded_batch(cfg.vocab_size, seed=20 + rank)  # each rank its own tokens
    with torch.no_grad():
        save_file({"logits": model(ids, mask), "mask": mask}, str(out_dir / f"rank{rank}.safetensors"))


def test_ep2_forward_equals_the_full_model(tmp_path):
    directory, _ = tmp_path / "hf", hf_model("q_lora_yarn_interleave", seed=2).save_pretrained(tmp_path / "hf")
    cfg = check_checkpoint(directory)
    placement = ExpertPlacement.from_lists([[3, 0, 6, 1, 5, 2, 7, 4], [7, 6, 5, 4, 3, 2, 1, 0]], 2)
    shapes = expected_tensor_shapes(cfg, placement, ep_rank=1)
    assert "model.layers.1.mlp.experts.2.gate_proj.weight" in shapes  # slot 5 of layer 1 is expert 2
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" not in shapes
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in shapes  # replicated with the router
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in shapes
    run_gloo(ep_forward, 2, tmp_path, str(directory))
    full = load_pretrained(directory)
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        ids, mask, _ = left_padded_batch(cfg.vocab_size, seed=20 + rank)
        with torch.no_grad():
            assert_same_logits(got["logits"], full(ids, mask), mask, atol=1e-5)


# --- bad checkpoints: one MoerlError naming the input and the fix ---------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    model = DeepseekV3ForCausalLM(moerl_config("q_lora_yarn_interleave"))
    save_pretrained(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         r"quantization_config = .* is not supported by moerl \(dequantize the fp8 weights to bf16 first"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), r"rope type 'linear' is not supported"),
        (dict(rope_scaling=None, rope_parameters={"rope_type": "dynamic", "factor": 2.0}), r"rope type 'dynamic'"),
        (dict(num_key_value_heads=2), r"num_key_value_heads = 2 is not supported .* set it to num_attention_heads"),
        (dict(scoring_func="softmax"), r"scoring_func = 'softmax' is not supported"),
        (dict(hidden_act="gelu"), r"hidden_act = 'gelu' is not supported"),
        (dict(n_group=3), r"n_group = 3 / topk_group = 2 do not split n_routed_experts = 8"),
        (dict(kv_lora_rank=None), r"tensor model\.layers\.0\.self_attn\.kv_a_proj_with_mqa\.weight has shape "
                                  r"\[24, 32\], expected \[520, 32\]"),
        (dict(first_k_dense_replace=3), r"first_k_dense_replace = 3 must be in \[0, num_hidden_layers\)"),
    ],
    ids=["fp8_quantization", "linear_rope", "dynamic_rope", "kv_heads", "softmax_scoring", "gelu", "groups",
         "shapes_from_defaults", "no_moe_layer"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message):
        load_pretrained(good_checkpoint)


def test_missing_tensor_is_named(good_checkpoint):
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=rf"tensor {name} is missing \(expected shape \[8\]"):
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named_with_its_file(good_checkpoint):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(9, 16)}))
    with pytest.raises(MoerlError, match=rf"model\.safetensors: tensor {name} has shape \[9, 16\], expected \[88, 16"):
        load_pretrained(good_checkpoint)


def test_multi_token_prediction_tensors_are_dropped_on_import(good_checkpoint, capsys):
    """DeepSeek-V3's published checkpoints hold an MTP layer (model.layers.61.*): not part of the model moerl
    trains (nor of transformers'); the loader skips those tensors, import says so in one line, and any other
    extra tensor is still refused by name."""
    name = "model.layers.3.eh_proj.weight"  # num_hidden_layers = 3: the first MTP layer
    cfg = check_checkpoint(good_checkpoint)
    assert is_mtp_tensor(cfg, name) and not is_mtp_tensor(cfg, "model.layers.2.mlp.gate.weight")
    edit_config(good_checkpoint, num_nextn_predict_layers=1)
    assert check_checkpoint(good_checkpoint) == cfg  # the field alone (transformers writes 1 by default) is fine
    before = load_pretrained(good_checkpoint).state_dict()
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(32, 64)}))
    after = load_pretrained(good_checkpoint).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    save_tokenizer(good_checkpoint)
    validate_checkpoint_dir(good_checkpoint)
    assert "1 tensors dropped on import (a multi-token-prediction layer" in capsys.readouterr().out
    rewrite_weights(good_checkpoint, lambda t: t.update({"model.layers.2.mlp.extra.weight": torch.ones(2)}))
    with pytest.raises(MoerlError, match=r"unexpected tensor model\.layers\.2\.mlp\.extra\.weight"):
        load_pretrained(good_checkpoint)
