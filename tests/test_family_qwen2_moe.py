"""Qwen2-MoE (steps/models/qwen2_moe/) against transformers' Qwen2MoeForCausalLM, on tiny random instances built by
transformers' own config class and saved with its save_pretrained: the same logits both ways round (fp32, forward
and forward_shared_prompts, left-padded), the same tensor names on disk (the shared expert renamed by the adapter
only), bf16 round trips, the torch engine's log-probs, an EP=2 forward over gloo, the same gradients, and one clear
error for each bad checkpoint or refused config field."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
import transformers as hf
from family_helpers import assert_same_logits, edit_config, left_padded_batch, rewrite_weights
from model_helpers import randomize_, response_logprobs
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo

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
from steps.models.moe import SparseMoeBlock, count_parameters
from steps.models.placement import ExpertPlacement
from steps.models.qwen2_moe.config import Qwen2MoeConfig
from steps.models.qwen2_moe.model import Qwen2MoeForCausalLM
from steps.models.qwen2_moe.spec import QWEN2_MOE
from steps.models.registry import config_from_hf, family_of, resolve

ATOL = 1e-4  # fp32 logits and log-probs against transformers

# A: one dense layer via mlp_only_layers, renormalised top-2, untied head, q/k/v biases (the default).
# B: every other layer sparse via decoder_sparse_step, top-3 without renormalisation, tied head, no q/k/v bias,
#    head_dim 16 where hidden_size // num_attention_heads is 8 (transformers reads head_dim when config.json has it).
CONFIGS = {
    "dense_layer_top2": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=True, rope_theta=1000.0,
        max_position_embeddings=64,
    ),
    "sparse_step_top3_tied": dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
        tie_word_embeddings=True, qkv_bias=False, rms_norm_eps=1e-5, max_position_embeddings=64,
    ),
}  # fmt: skip


def hf_model(kwargs: dict, seed: int) -> hf.Qwen2MoeForCausalLM:
    model = hf.Qwen2MoeForCausalLM(hf.Qwen2MoeConfig(**kwargs))
    randomize_(model, seed=seed)
    return model.eval()


def first_moe_layer(cfg: Qwen2MoeConfig) -> int:
    return next(layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer))


def hf_names(model: Qwen2MoeForCausalLM) -> dict[str, tuple[int, ...]]:
    """The model's tensors under the checkpoint's names (the adapter's to_hf), with their shapes."""
    return {n: tuple(t.shape) for n, t in QWEN2_MOE.state_dict_adapter.to_hf(model.state_dict()).items()}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    """(config kwargs, transformers' model, its save_pretrained directory)."""
    kwargs = dict(CONFIGS[request.param])
    model = hf_model(kwargs, seed=2)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory)
    return kwargs, model, directory


# --- transformers -> moerl and back: logits, names, dtypes -----------------------------------------------------


def test_transformers_checkpoint_loads_with_equal_logits(hf_checkpoint, tmp_path):
    kwargs, theirs_model, directory = hf_checkpoint
    theirs_model.save_pretrained(tmp_path, max_shard_size="8KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=3)
    with torch.no_grad():
        theirs = theirs_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        for source in (directory, tmp_path):  # one file, and shards
            model = load_pretrained(source)
            assert isinstance(model, Qwen2MoeForCausalLM) and family_of(model) is QWEN2_MOE
            assert_same_logits(model(ids, mask), theirs, mask, atol=ATOL)
        assert_same_logits(model(ids), theirs_model(input_ids=ids).logits, torch.ones_like(mask), atol=ATOL)


def test_forward_shared_prompts_equals_transformers(hf_checkpoint):
    """Each prompt once (left-padded), its responses (right-padded) attending to its keys/values: every logit is
    transformers' on the unpadded prompt + response."""
    kwargs, theirs_model, directory = hf_checkpoint
    model = load_pretrained(directory)
    groups = [([5, 6, 7, 8, 9], [[20, 21, 22, 23], [24]]), ([9, 10], [[30, 31, 32, 33, 34]]),
              ([1, 11, 12], [[40, 41], [42, 43, 44]])]  # fmt: skip
    prompt_len = max(len(p) for p, _ in groups)
    prompt_ids = torch.zeros(len(groups), prompt_len, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for g, (prompt, _) in enumerate(groups):
        prompt_ids[g, prompt_len - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[g, prompt_len - len(prompt) :] = 1
    rows = [(g, response) for g, (_, responses) in enumerate(groups) for response in responses]
    length = max(len(r) for _, r in rows) - 1
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (_, response) in enumerate(rows):
        ids[row, : len(response) - 1], mask[row, : len(response) - 1] = torch.tensor(response[:-1]), 1
    index = torch.tensor([g for g, _ in rows])
    with torch.no_grad():
        shared = model.forward_shared_prompts(prompt_ids, prompt_mask, ids, mask, index)
        for row, (g, response) in enumerate(rows):
            prompt = groups[g][0]
            full = theirs_model(input_ids=torch.tensor([prompt + response[:-1]])).logits[0]
            want = full[len(prompt) - 1 :]  # the prompt's last position, then the response's
            torch.testing.assert_close(shared[row, : len(response)], want, atol=ATOL, rtol=0)


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, hf_checkpoint):
    kwargs = hf_checkpoint[0]
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**kwargs))
    randomize_(model, seed=1)
    save_pretrained(model, tmp_path)

    config = hf.AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == "Qwen2MoeConfig" and config.layer_types[0] == "full_attention"
    assert (config.num_experts, config.qkv_bias) == (kwargs["num_experts"], kwargs.get("qkv_bias", True))
    assert config.tie_word_embeddings == kwargs.get("tie_word_embeddings", False)
    theirs_model = hf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert isinstance(theirs_model, hf.Qwen2MoeForCausalLM)
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"])
    with torch.no_grad():
        theirs = theirs_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(model(ids, mask), theirs, mask, atol=ATOL)
    assert Qwen2MoeConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text())) == model.config


def test_state_dict_names_are_what_transformers_writes(hf_checkpoint):
    kwargs, _, directory = hf_checkpoint
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = Qwen2MoeConfig(**kwargs)
    model = Qwen2MoeForCausalLM(cfg)
    assert hf_names(model) == on_disk == expected_tensor_shapes(cfg)
    p = f"model.layers.{first_moe_layer(cfg)}.mlp."
    assert p + "experts.3.down_proj.weight" in on_disk  # per expert, not fused
    assert p + "shared_expert.up_proj.weight" in on_disk and p + "shared_expert_gate.weight" in on_disk
    assert p + "shared_experts.up_proj.weight" in model.state_dict()  # the shared block's module name
    adapter = QWEN2_MOE.state_dict_adapter
    assert set(adapter.from_hf(adapter.to_hf(model.state_dict()))) == set(model.state_dict())


def test_bf16_checkpoints_round_trip_with_transformers(tmp_path, hf_checkpoint):
    """transformers' dtype auto reads our bf16 checkpoint as bf16 and writes back the same bits; an fp32 forward
    of that equals transformers'."""
    kwargs = hf_checkpoint[0]
    ours = Qwen2MoeForCausalLM(Qwen2MoeConfig(**kwargs))
    randomize_(ours, seed=9)
    ours = ours.to(torch.bfloat16)
    save_pretrained(ours, tmp_path / "ours")
    theirs = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert theirs.dtype == torch.bfloat16
    theirs.save_pretrained(tmp_path / "hf")
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16
    back = load_state_dict_from_dir(tmp_path / "hf")
    for name, tensor in QWEN2_MOE.state_dict_adapter.to_hf(ours.state_dict()).items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], tensor), name

    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=10)
    hf32 = hf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf32(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert_same_logits(load_pretrained(tmp_path / "hf")(ids, mask), want, mask, atol=ATOL)


def test_gradients_match_transformers(hf_checkpoint):
    """The trainer differentiates token log-probs: every parameter's gradient matches transformers' to 1e-5 of the
    tensor's largest (transformers fuses its routed experts in memory: gate_up_proj [E, 2I, H], down_proj)."""
    kwargs, _, directory = hf_checkpoint
    theirs_model = hf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ours = load_pretrained(directory)
    ids, mask, positions = left_padded_batch(kwargs["vocab_size"], seed=8)
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    logits = theirs_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    (token_logprobs(logits, targets) * weight).sum().backward()
    theirs = {name: p.grad for name, p in theirs_model.named_parameters()}
    inter = kwargs["moe_intermediate_size"]
    grads = QWEN2_MOE.state_dict_adapter.to_hf({n: p.grad for n, p in ours.named_parameters()})
    for name, grad in grads.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = theirs[f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][expert]
            want = {"gate_proj": fused[:inter], "up_proj": fused[inter:], "down_proj": fused}[proj]
        else:
            want = theirs[name]
        scale = max(1.0, float(want.abs().max()))  # the randomised weights give gradients up to ~40
        torch.testing.assert_close(grad, want, atol=1e-5 * scale, rtol=1e-4, msg=name)
    assert len(grads) == len(list(ours.parameters()))
    assert grads[f"model.layers.{first_moe_layer(ours.config)}.mlp.shared_expert_gate.weight"].abs().sum() > 0


# --- the torch engine ------------------------------------------------------------------------------------------


def test_engine_logprobs_equal_a_transformers_recompute(hf_checkpoint):
    """The torch engine's prefill + decode steps (its GqaProjection with q/k/v biases, the shared expert beside the
    fused routed experts): each sampled token's log-prob is transformers' on the same tokens, fp32."""
    kwargs, theirs_model, directory = hf_checkpoint
    engine = TorchEngine.from_checkpoint(directory)
    gen = torch.Generator().manual_seed(4)
    prompts = [(f"p{i}", torch.randint(0, kwargs["vocab_size"], (n,), generator=gen).tolist())
               for i, n in enumerate((3, 7, 5, 1))]  # fmt: skip
    checked = 0
    for params in (SamplingParams(n=3, max_new_tokens=8), SamplingParams(n=1, max_new_tokens=6, temperature=0.0)):
        requests = sample_requests(prompts, params, lambda prompt_id, k: sample_seed(7, 1, prompt_id, k))
        for request, generation in zip(requests, engine.generate(requests, params), strict=True):
            want = response_logprobs(theirs_model, request.prompt_ids, generation.response_ids)
            torch.testing.assert_close(torch.tensor(generation.logprobs), want, atol=ATOL, rtol=0)
            checked += len(generation.response_ids)
    assert checked > 30


def test_engine_update_weights_serves_the_new_checkpoint(tmp_path, hf_checkpoint):
    kwargs, _, directory = hf_checkpoint
    hf_model(kwargs, seed=12).save_pretrained(tmp_path)
    engine = TorchEngine.from_checkpoint(directory)
    engine.update_weights(tmp_path)
    fresh = TorchEngine.from_checkpoint(tmp_path)
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name


# --- expert parallelism ----------------------------------------------------------------------------------------

EP_KWARGS = CONFIGS["dense_layer_top2"]
EP_SLOTS = [[3, 0, 6, 1, 7, 2, 5, 4], [1, 2, 3, 0, 4, 5, 6, 7]]  # per MoE layer (layers 0 and 2), not contiguous


def test_a_rank_holds_its_experts_under_global_names(tmp_path):
    cfg = Qwen2MoeConfig(**EP_KWARGS)
    full = Qwen2MoeForCausalLM(cfg)
    randomize_(full, seed=5)
    save_pretrained(full, tmp_path)
    placement = ExpertPlacement.from_lists(EP_SLOTS, ep_size=2)
    part = load_pretrained(tmp_path, placement=placement, ep_rank=1)
    assert hf_names(part) == expected_tensor_shapes(cfg, placement, ep_rank=1)
    names = set(hf_names(part))
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names  # slots 4..7 of layer 0: experts 7, 2, 5, 4
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" not in names
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in names  # replicated on every rank
    assert "model.layers.2.mlp.shared_expert_gate.weight" in names
    assert names < set(hf_names(full))
    for name, tensor in part.state_dict().items():
        assert torch.equal(tensor, full.state_dict()[name]), name
    assert part.moe_blocks()[0].held == (7, 2, 5, 4)


def ep_forward(rank: int, world: int, out_dir: Path, checkpoint: str) -> None:
    """EP rank `rank` of 2: its experts only, the alltoall dispatch over gloo, its half of the batch."""
    mesh = build_mesh(rank, world, world, torch.device("cpu"))
    model = load_pretrained(checkpoint, placement=ExpertPlacement.from_lists(EP_SLOTS, world), ep_rank=mesh.ep_rank)
    model.set_dispatch(make_dispatch("alltoall", mesh, model.config.num_experts))
    ids, mask, _ = left_padded_batch(EP_KWARGS["vocab_size"], seed=6)
    rows = slice(0, 2) if rank == 0 else slice(2, 3)  # unequal shares: the dispatch's counts differ per rank
    with torch.no_grad():
        logits = model(ids[rows], mask[rows])
    save_file({"logits": logits.contiguous()}, str(out_dir / f"rank{rank}.safetensors"))


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    full = Qwen2MoeForCausalLM(Qwen2MoeConfig(**EP_KWARGS))
    randomize_(full, seed=5)
    save_pretrained(full, tmp_path / "ckpt")
    run_gloo(ep_forward, 2, tmp_path, str(tmp_path / "ckpt"))
    ids, mask, _ = left_padded_batch(EP_KWARGS["vocab_size"], seed=6)
    with torch.no_grad():
        want = full(ids, mask)
    got = torch.cat([load_file(tmp_path / f"rank{r}.safetensors")["logits"] for r in range(2)])
    assert_same_logits(got, want, mask, atol=ATOL)


# --- config, registry, refusals --------------------------------------------------------------------------------


def test_the_registry_resolves_qwen2_moe():
    cfg = Qwen2MoeConfig(**EP_KWARGS, bos_token_id=1, eos_token_id=[2, 3])
    d = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert resolve(d) is QWEN2_MOE and config_from_hf(d) == cfg
    assert d["architectures"] == ["Qwen2MoeForCausalLM"] and d["dtype"] == d["torch_dtype"] == "bfloat16"
    assert (d["rope_theta"], d["rope_parameters"]) == (1000.0, {"rope_theta": 1000.0, "rope_type": "default"})
    assert (QWEN2_MOE.attention, QWEN2_MOE.router) == ("softmax_kv_cache", "softmax_topk")
    block = Qwen2MoeForCausalLM(cfg).moe_blocks()[0]
    assert isinstance(block, SparseMoeBlock) and block.router.kind == "softmax_topk"
    assert block.shared_experts is not None and block.shared_expert_gate is not None


def test_a_published_qwen1_5_moe_config_is_read():
    """Qwen1.5-MoE-A2.7B's config.json as published (transformers v4: rope_theta, no qkv_bias, a sliding_window
    size with use_sliding_window false): its sizes, and its 14.3B parameters, 2.7B active."""
    d = {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
        "max_window_layers": 21, "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
        "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }  # fmt: skip
    cfg = config_from_hf(d)
    assert (cfg.qkv_bias, cfg.head_dim, cfg.rope_theta, cfg.mlp_only_layers) == (True, 128, 1e6, [])
    shapes = expected_tensor_shapes(cfg)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert 14.2e9 < total < 14.4e9
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(cfg)
    assert count_parameters(model)[0] == total and 2.6e9 < count_parameters(model)[1] < 2.8e9


@pytest.fixture
def good_checkpoint(tmp_path):
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**CONFIGS["dense_layer_top2"]))
    save_pretrained(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(use_sliding_window=True), r"use_sliding_window = True is not supported by moerl \(sliding-window "
                                        r"attention is not implemented; set it to false\)"),
        (dict(layer_types=["full_attention", "sliding_attention", "full_attention"]),
         r"layer_types = .* is not supported by moerl \(only full_attention layers"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
         "rope_parameters.rope_type 'yarn' is not supported"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling = .* is not supported"),
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config = .* is not supported"),
        (dict(hidden_act="gelu"), "hidden_act = 'gelu' is not supported by moerl"),
        (dict(shared_expert_intermediate_size=None),
         r"missing required Qwen2-MoE fields \['shared_expert_intermediate_size'\]; fix config.json"),
        (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size = 0 must be a positive integer"),
        (dict(num_experts=0), r"no experts \(num_experts 0\), .*a dense Qwen2 has nothing.*moerl supports"),
        (dict(qkv_bias="yes"), "qkv_bias = 'yes' must be true or false"),
    ],
    ids=["sliding_window", "layer_types", "rope_parameters", "rope_scaling", "quantization", "hidden_act",
         "missing_shared_expert_size", "zero_shared_expert_size", "zero_experts", "qkv_bias_not_bool"],
)  # fmt: skip
def test_unsupported_config_is_refused_in_one_line(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        load_pretrained(good_checkpoint)
    assert str(err.value).startswith(str(good_checkpoint)) and "\n" not in str(err.value)


def test_missing_tensor_is_named(good_checkpoint):
    name = "model.layers.2.mlp.shared_expert.up_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=rf"tensor {name} is missing \(expected shape \[24, 32\] from config.json"
                                         r"\); .*re-export the checkpoint"):  # fmt: skip
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named_with_its_file(good_checkpoint):
    name = "model.layers.0.mlp.shared_expert_gate.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(2, 32)}))
    with pytest.raises(MoerlError, match=rf"model\.safetensors: tensor {name} has shape \[2, 32\], expected \[1, 32\]"):
        load_pretrained(good_checkpoint)


def test_a_tensor_under_the_model_name_is_unexpected(good_checkpoint):
    """A checkpoint written with the shared block's module names (not transformers') is refused by name."""
    old, new = "model.layers.0.mlp.shared_expert.up_proj.weight", "model.layers.0.mlp.shared_experts.up_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({new: t.pop(old)}))
    with pytest.raises(MoerlError, match=rf"tensor {old} is missing"):
        load_pretrained(good_checkpoint)
