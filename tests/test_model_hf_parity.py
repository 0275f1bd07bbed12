"""Our Qwen3-MoE model against transformers' Qwen3MoeForCausalLM: same tensor names on disk, same logits
both ways round (our save -> HF load, HF save -> our load), and one clear error for each bad checkpoint."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from family_helpers import assert_same_logits, edit_config, left_padded_batch, rewrite_weights
from model_helpers import randomize_
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from steps.errors import MoerlError
from steps.models.hf_checkpoint import (
    check_checkpoint,
    checkpoint_dtype,
    expected_tensor_shapes,
    load_pretrained,
    load_state_dict_from_dir,
    save_pretrained,
)
from steps.models.kernels import token_logprobs
from steps.models.moe import LocalDispatch, count_parameters
from steps.models.placement import ExpertPlacement
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeBlock, MoeForCausalLM

# A: one dense layer via mlp_only_layers, renormalised top-2, untied head.
# B: every other layer sparse via decoder_sparse_step, top-3 without renormalisation, tied head, q/k/v/o bias.
CONFIGS = {
    "dense_layer_top2": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=True, rope_theta=1000.0, max_position_embeddings=64,
    ),
    "sparse_step_top3_tied": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12, intermediate_size=40,
        decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True, attention_bias=True,
        rms_norm_eps=1e-5, max_position_embeddings=64,
    ),
}  # fmt: skip


@pytest.fixture(params=sorted(CONFIGS))
def config_kwargs(request):
    return dict(CONFIGS[request.param])


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config_kwargs):
    torch.manual_seed(0)
    model = MoeForCausalLM(MoeConfig(**config_kwargs))
    randomize_(model, seed=1)
    save_pretrained(model, tmp_path)

    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert type(hf_config).__name__ == "Qwen3MoeConfig"
    assert hf_config.num_experts == config_kwargs["num_experts"]
    assert hf_config.tie_word_embeddings == config_kwargs.get("tie_word_embeddings", False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert isinstance(hf, Qwen3MoeForCausalLM)
    hf.eval()

    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"])
    with torch.no_grad():
        ours = model(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        ours_unpadded = model(ids)
        theirs_unpadded = hf(input_ids=ids).logits
    assert_same_logits(ours, theirs, mask, atol=1e-5)
    assert_same_logits(ours_unpadded, theirs_unpadded, torch.ones_like(mask), atol=1e-5)


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, config_kwargs):
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config_kwargs))
    randomize_(hf, seed=2)
    hf.eval()
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()

    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=3)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert_same_logits(model(ids, mask), theirs, mask, atol=1e-5)


def test_state_dict_names_are_what_transformers_writes(tmp_path, config_kwargs):
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config_kwargs))
    hf.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = MoeConfig(**config_kwargs)
    ours = {name: tuple(t.shape) for name, t in MoeForCausalLM(cfg).state_dict().items()}
    assert ours == on_disk
    assert expected_tensor_shapes(cfg) == on_disk
    assert any(name.endswith(".mlp.experts.3.down_proj.weight") for name in on_disk)  # per-expert, not fused


def test_sharded_save_uses_transformers_names_and_loads_back(tmp_path):
    cfg = MoeConfig(**CONFIGS["dense_layer_top2"])
    model = MoeForCausalLM(cfg)
    randomize_(model, seed=4)
    save_pretrained(model, tmp_path, max_shard_bytes=16_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == shards
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["_from_model_config"] is True

    loaded = load_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        assert_same_logits(loaded(ids), hf(input_ids=ids).logits, torch.ones_like(ids), atol=1e-5)

    # Re-saving unsharded removes the stale shards and index, so no loader can pick up old weights.
    save_pretrained(loaded, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_config_round_trip_through_hf_dict():
    cfg = MoeConfig(**CONFIGS["dense_layer_top2"], bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["Qwen3MoeForCausalLM"]
    assert d["model_type"] == "qwen3_moe"
    assert d["dtype"] == d["torch_dtype"] == "float32"
    assert MoeConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg


def test_transformers_v5_style_config_is_read(tmp_path):
    """v5 writes num_local_experts and rope_parameters instead of num_experts and rope_theta."""
    hf_config = Qwen3MoeConfig(**CONFIGS["dense_layer_top2"])
    hf_config.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert "num_local_experts" in d and "rope_parameters" in d
    cfg = MoeConfig.from_hf_dict(d)
    assert cfg.num_experts == 8
    assert cfg.rope_theta == 1000.0
    assert cfg.mlp_only_layers == [1]


def test_expert_placement_holds_a_slice_under_global_names(tmp_path):
    cfg = MoeConfig(**CONFIGS["dense_layer_top2"])
    full = MoeForCausalLM(cfg)
    randomize_(full, seed=5)
    save_pretrained(full, tmp_path)

    placement = ExpertPlacement.contiguous(len(full.moe_blocks()), cfg.num_experts, ep_size=2)
    part = load_pretrained(tmp_path, placement=placement, ep_rank=1)
    names = set(part.state_dict())
    assert names == set(expected_tensor_shapes(cfg, placement, ep_rank=1))
    assert "model.layers.0.mlp.experts.4.gate_proj.weight" in names
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" not in names
    assert names < set(full.state_dict())
    for name in names:
        assert torch.equal(part.state_dict()[name], full.state_dict()[name]), name
    block = part.moe_blocks()[0]
    assert (block.held, block.num_local_experts) == ((4, 5, 6, 7), 4)
    # Local dispatch over a partial shard is a wiring error, said plainly rather than silently wrong.
    with pytest.raises(RuntimeError, match="does not hold"):
        part(torch.randint(0, cfg.vocab_size, (2, 9)))


def test_local_dispatch_equals_per_token_reference():
    torch.manual_seed(0)
    block = MoeBlock(hidden_size=16, moe_intermediate_size=8, num_experts=5, num_experts_per_tok=3,
                     norm_topk_prob=True)  # fmt: skip
    randomize_(block, seed=6)
    hidden = torch.randn(23, 16)
    _, topk_idx, topk_weight = block.route(hidden)
    out = LocalDispatch()(hidden, topk_idx, topk_weight, block.local_experts())
    reference = torch.stack([
        sum(topk_weight[t, j] * block.experts[str(int(topk_idx[t, j]))](hidden[t]) for j in range(3))
        for t in range(23)
    ])  # fmt: skip
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)
    assert LocalDispatch()(hidden[:0], topk_idx[:0], topk_weight[:0], block.local_experts()).shape == (0, 16)


def test_token_logprobs_match_log_softmax():
    logits = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    targets = torch.randint(0, 64, (2, 5))
    got = token_logprobs(logits, targets)
    want = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_count_parameters_total_and_active():
    kwargs = CONFIGS["dense_layer_top2"]
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs))
    model = MoeForCausalLM(MoeConfig(**kwargs))
    total, active = count_parameters(model)
    assert total == sum(p.numel() for p in hf.parameters())
    per_expert = 3 * 32 * 16
    assert total - active == 2 * (8 - 2) * per_expert  # 2 MoE layers, 6 unused experts each


# --- bad checkpoints: one MoerlError naming the input and the fix ---------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    model = MoeForCausalLM(MoeConfig(**CONFIGS["dense_layer_top2"]))
    save_pretrained(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_good_checkpoint_passes_the_checks(good_checkpoint):
    cfg = check_checkpoint(good_checkpoint)
    assert cfg.num_experts == 8
    assert set(load_state_dict_from_dir(good_checkpoint)) == set(expected_tensor_shapes(cfg))


def test_missing_config_json(good_checkpoint):
    (good_checkpoint / "config.json").unlink()
    with pytest.raises(MoerlError, match=r"no config\.json; a model checkpoint is a Hugging Face model dir"):
        load_pretrained(good_checkpoint)


DENSE_ARCH = ["Qwen3ForCausalLM"]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="qwen3", architectures=DENSE_ARCH), "model_type 'qwen3'.*moerl supports: Qwen3-MoE"),
        (dict(model_type="llama", architectures=DENSE_ARCH), "model_type 'llama'.*moerl supports: Qwen3-MoE"),
        (dict(num_experts=0), "no experts.*moerl supports: Qwen3-MoE"),
        (dict(moe_intermediate_size=None), r"missing required Qwen3-MoE fields \['moe_intermediate_size'\]"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok = 9 exceeds num_experts = 8"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling = .* is not supported"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_parameters.rope_type 'yarn'"),
        (dict(use_sliding_window=True), "use_sliding_window = True is not supported"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config = .* is not supported"),
        (dict(num_attention_heads=3), "num_attention_heads = 3 is not a multiple of num_key_value_heads = 2"),
        (dict(dtype="float64", torch_dtype="float64"), "dtype = 'float64' is not supported; moerl trains float32"),
        (dict(dtype=None, torch_dtype="int8"), "torch_dtype = 'int8' is not supported; moerl trains float32"),
        (dict(torch_dtype="float16"), "dtype = 'float32' but torch_dtype = 'float16'; they must agree"),
        (dict(dtype="bfloat16", torch_dtype="bfloat16"),
         "config.json: declares dtype bfloat16 but the weights are stored as float32; set dtype and torch_dtype"),
    ],
    ids=[
        "dense_qwen3", "dense_llama", "zero_experts", "missing_moe_field", "more_experts_per_token_than_experts",
        "rope_scaling", "rope_parameters", "sliding_window", "quantization", "heads_not_a_multiple_of_kv_heads",
        "float64_dtype", "int8_torch_dtype", "dtype_and_torch_dtype_disagree", "dtype_is_not_the_weights",
    ],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message):
        load_pretrained(good_checkpoint)


def test_missing_tensor_is_named(good_checkpoint):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=rf"tensor {name} is missing \(expected shape \[16, 32\]"):
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named_with_its_file(good_checkpoint):
    name = "model.layers.0.self_attn.k_norm.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(9)}))
    with pytest.raises(MoerlError, match=rf"model\.safetensors: tensor {name} has shape \[9\], expected \[8"):
        load_pretrained(good_checkpoint)


def test_unexpected_tensor_is_rejected(good_checkpoint):
    name = "model.layers.0.mlp.experts.8.up_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(16, 32)}))
    with pytest.raises(MoerlError, match=rf"unexpected tensor {name}"):
        load_pretrained(good_checkpoint)


def test_integer_tensor_is_rejected(good_checkpoint):
    name = "model.norm.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(32, dtype=torch.int8)}))
    with pytest.raises(MoerlError, match=rf"tensor {name} has dtype I8; moerl loads F32, BF16 or F16"):
        load_pretrained(good_checkpoint)


def test_weights_in_several_dtypes_are_refused(good_checkpoint):
    name = "model.norm.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: t[name].bfloat16()}))
    with pytest.raises(MoerlError, match=rf"stored in several dtypes \(BF16: 1 tensor \(e\.g\. {name}\), F32: "):
        check_checkpoint(good_checkpoint)


def test_pickle_only_checkpoint_is_refused(good_checkpoint):
    (good_checkpoint / "model.safetensors").unlink()
    (good_checkpoint / "pytorch_model.bin").write_bytes(b"not read: never unpickled")
    with pytest.raises(MoerlError, match=r"only pickle weights \(pytorch_model\.bin\).*safetensors only; "):
        load_pretrained(good_checkpoint)


def test_missing_shard_is_named(tmp_path):
    model = MoeForCausalLM(MoeConfig(**CONFIGS["dense_layer_top2"]))
    save_pretrained(model, tmp_path, max_shard_bytes=16_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(MoerlError, match=rf"names shard {shard.name}, which is missing"):
        load_pretrained(tmp_path)


def test_bf16_checkpoint_loads_in_requested_dtype(tmp_path):
    model = MoeForCausalLM(MoeConfig(**CONFIGS["dense_layer_top2"])).to(torch.bfloat16)
    save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert checkpoint_dtype(tmp_path) == torch.bfloat16
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight.float())
    as_stored = load_pretrained(tmp_path, dtype=None)
    assert all(p.dtype == torch.bfloat16 for p in as_stored.parameters())


def test_bf16_checkpoints_round_trip_with_transformers(tmp_path, config_kwargs):
    """bf16 both ways round: transformers' dtype auto reads our bf16 checkpoint as bf16 and writes back the same
    bits; its own bf16 checkpoint reads as bf16 in ours; an fp32 forward of either equals transformers'."""
    ours = MoeForCausalLM(MoeConfig(**config_kwargs))
    randomize_(ours, seed=9)
    ours = ours.to(torch.bfloat16)
    save_pretrained(ours, tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert hf.dtype == torch.bfloat16
    hf.save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16
    back = load_state_dict_from_dir(tmp_path / "hf")
    for name, tensor in ours.state_dict().items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor), name

    ids, mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=10)
    hf32 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf32(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(load_pretrained(tmp_path / "hf")(ids, mask), theirs, mask, atol=1e-5)


def test_gradients_match_transformers(tmp_path):
    """The trainer differentiates token log-probs: every parameter's gradient matches transformers'."""
    kwargs = CONFIGS["dense_layer_top2"]
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs))
    randomize_(hf, seed=7)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=8)
    targets = torch.roll(ids, -1, dims=1)
    weight = mask.float()

    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    hf_logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (token_logprobs(hf_logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    inter = kwargs["moe_intermediate_size"]
    checked = 0
    for name, p in ours.named_parameters():
        if ".mlp.experts." in name:  # in memory transformers fuses them: gate_up_proj [E, 2I, H], down_proj
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused_name = "down_proj" if proj == "down_proj" else "gate_up_proj"
            fused = hf_grads[f"{prefix}.mlp.experts.{fused_name}"][expert]
            want = {"gate_proj": fused[:inter], "up_proj": fused[inter:], "down_proj": fused}[proj]
        else:
            want = hf_grads[name]
        torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-4, msg=name)
        checked += 1
    assert checked == len(list(ours.parameters()))
    assert ours.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router learns via top-k weights
