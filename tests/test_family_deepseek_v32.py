"""DeepSeek-V3.2 (steps/models/deepseek_v32/, steps/models/dsa.py, steps/models/mla.py) against transformers 5.23's
DeepseekV32ForCausalLM, on tiny random models built by transformers' own config class, with index_topk below the
sequence lengths (selection happens) and 16 index heads (the relu's exact-zero ties between scores, which break
differently for different lengths, vanish in practice). Checked: the tensor names and shapes (the indexer's included,
weights_proj kept float32 in a bf16 checkpoint); the config round trip; the trainer's forward equal to transformers'
fp32 logits on right-padded, left-padded and unpadded rows, on a packed row and through forward_shared_prompts;
gradients equal to transformers' with the indexer frozen; moerl's checkpoint after a step loaded by transformers with
the same logits; an EP=2 forward and backward over gloo; the torch engine's decode (indexed_kv_cache); the
multi-token-prediction layer dropped on import; and one clear error for each config moerl cannot train."""

import dataclasses
import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from family_helpers import (
    assert_close_to_scale,
    assert_same_logits,
    edit_config,
    expert_grads,
    left_padded_batch,
    probe_batch,
    rewrite_weights,
    right_padded_batch,
    save_rows_and_expert_grads,
)
from model_helpers import randomize_, response_logits
from safetensors import safe_open
from safetensors.torch import load_file
from test_expert_parallel import run_gloo
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import DeepseekV32Config as HfConfig
from transformers import DeepseekV32ForCausalLM as HfModel

from steps.demo.char_tokenizer import save_tokenizer
from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.checkpoint_validation import validate_checkpoint_dir
from steps.models.deepseek_v3.spec import DEEPSEEK_V3
from steps.models.deepseek_v32.config import DeepseekV32Config
from steps.models.deepseek_v32.model import DeepseekV32ForCausalLM
from steps.models.deepseek_v32.spec import DEEPSEEK_V32
from steps.models.dsa import LightningIndexer
from steps.models.family import is_frozen
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

# A: default RoPE, one dense layer, 2 groups choose 1, untied. B: YaRN (mscale_all_dim: softmax scale and cos/sin
#    factor), every layer sparse, one group, tied embeddings, no top-k renormalisation, a routed scaling factor.
CONFIGS = {
    "default_rope_dense_layer": dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, index_n_heads=16, index_head_dim=8, index_topk=5, first_k_dense_replace=1,
        routed_scaling_factor=1.0, max_position_embeddings=128,
    ),
    "yarn_tied_all_sparse": dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=6, num_experts_per_tok=3, n_shared_experts=2,
        n_group=1, topk_group=1, q_lora_rank=12, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
        v_head_dim=10, index_n_heads=16, index_head_dim=12, index_topk=4, first_k_dense_replace=0,
        routed_scaling_factor=1.5, norm_topk_prob=False, tie_word_embeddings=True, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
}  # fmt: skip
ATOL = 1e-4  # fp32 logits, both ways round
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def hf_model(kwargs: dict, seed: int) -> HfModel:
    """transformers' model of `kwargs`, weights and correction biases far from their init."""
    torch.manual_seed(seed)
    hf = HfModel(HfConfig(**kwargs))
    randomize(hf, seed)
    return hf.eval()


def randomize(model: torch.nn.Module, seed: int) -> None:
    """randomize_ (parameters) and the correction-bias buffers, so that the bias changes which experts win."""
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)


def written_config(kwargs: dict, tmp_path) -> dict:
    HfConfig(**kwargs).save_pretrained(tmp_path / "cfg")
    return json.loads((tmp_path / "cfg" / "config.json").read_text())


@pytest.fixture(params=sorted(CONFIGS))
def config_kwargs(request):
    return dict(CONFIGS[request.param])


def indexers(model: torch.nn.Module) -> list[LightningIndexer]:
    return [layer.self_attn.indexer for layer in model.model.layers]


# --- names and config ----------------------------------------------------------------------------------------------


def test_state_dict_names_are_what_transformers_writes(tmp_path, config_kwargs):
    """transformers' save_pretrained (per expert, every layer's self_attn.indexer.*) == expected_tensor_shapes ==
    moerl's save_pretrained."""
    HfModel(HfConfig(**config_kwargs)).save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = load_pretrained(tmp_path / "hf").config
    assert isinstance(cfg, DeepseekV32Config)
    save_pretrained(DeepseekV32ForCausalLM(cfg), tmp_path / "ours")
    with safe_open(tmp_path / "ours" / "model.safetensors", framework="pt") as f:
        ours = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert ours == on_disk == expected_tensor_shapes(cfg)
    heads, dim, hidden = config_kwargs["index_n_heads"], config_kwargs["index_head_dim"], 32
    for layer in range(config_kwargs["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.self_attn.indexer."
        assert on_disk[prefix + "wq_b.weight"] == (heads * dim, config_kwargs["q_lora_rank"])
        assert on_disk[prefix + "wk.weight"] == (dim, hidden)
        assert on_disk[prefix + "k_norm.weight"] == on_disk[prefix + "k_norm.bias"] == (dim,)
        assert on_disk[prefix + "weights_proj.weight"] == (heads, hidden)
    assert any(n.endswith(".mlp.experts.3.down_proj.weight") for n in on_disk)  # per expert, not fused
    assert not any("gate_up_proj" in n for n in on_disk)
    assert ("lm_head.weight" in on_disk) is not config_kwargs.get("tie_word_embeddings", False)


def test_bf16_round_trip_keeps_weights_proj_float32(tmp_path):
    """A bf16 checkpoint: transformers' bf16 save as it writes it, moerl reads it (dtype None) with the indexer's
    weights_proj and the correction bias float32 and the rest bf16, and publishes it so (F32 beside BF16)."""
    hf = hf_model(CONFIGS["default_rope_dense_layer"], seed=21).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    written = load_state_dict_from_dir(tmp_path / "hf")
    weights_proj = "model.layers.0.self_attn.indexer.weights_proj.weight"
    assert written["model.layers.0.self_attn.q_a_proj.weight"].dtype == torch.bfloat16
    # transformers' .to(bfloat16) casts everything (its _keep_in_fp32_modules apply when loading), so its save
    # writes weights_proj and the correction bias BF16 too; moerl reads them into float32
    assert written[weights_proj].dtype == torch.bfloat16
    assert written["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    assert checkpoint_dtype(tmp_path / "hf") == torch.bfloat16
    loaded = load_pretrained(tmp_path / "hf", dtype=None)
    for name, tensor in loaded.state_dict().items():
        kept = name.endswith(("indexer.weights_proj.weight", "e_score_correction_bias"))
        assert tensor.dtype == (torch.float32 if kept else torch.bfloat16), name
        assert torch.equal(tensor, written[name].to(tensor.dtype)), name
    save_pretrained(loaded, tmp_path / "ours")
    ours = load_state_dict_from_dir(tmp_path / "ours")
    assert ours[weights_proj].dtype == torch.float32
    assert ours["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert ours["model.layers.1.self_attn.indexer.wq_b.weight"].dtype == torch.bfloat16
    assert checkpoint_dtype(tmp_path / "ours") == torch.bfloat16
    assert all(torch.equal(ours[n], t) for n, t in loaded.state_dict().items())
    # transformers reads moerl's bf16 save back (dtype auto) with the same bits
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype="auto")
    assert back.dtype == torch.bfloat16
    back_state = back.state_dict()
    assert torch.equal(back_state[weights_proj].float(), ours[weights_proj].float())


def test_the_family_is_registered_and_its_config_round_trips(tmp_path, config_kwargs):
    """resolve and family_of name DeepSeek-V3.2 (not DeepSeek-V3, whose config class it extends); to_hf_dict reads
    back equal, and transformers reads it as DeepseekV32Config with the same index fields."""
    d = written_config(config_kwargs, tmp_path)
    cfg = config_from_hf(d)
    assert resolve(d) is DEEPSEEK_V32 and family_of(cfg) is DEEPSEEK_V32 and family_of(cfg) is not DEEPSEEK_V3
    assert type(cfg) is DeepseekV32Config and cfg.family_name == "DeepSeek-V3.2"
    assert (DEEPSEEK_V32.attention, DEEPSEEK_V32.router) == ("indexed_kv_cache", "sigmoid_group_topk")
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (
        config_kwargs["index_n_heads"], config_kwargs["index_head_dim"], config_kwargs["index_topk"]
    )  # fmt: skip
    assert (cfg.rope_scaling is None) == ("rope_parameters" not in config_kwargs)
    ours = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert (ours["architectures"], ours["model_type"]) == (["DeepseekV32ForCausalLM"], "deepseek_v32")
    assert "rope_interleave" not in ours
    assert config_from_hf(ours) == cfg and DeepseekV32Config.from_hf_dict(ours) == cfg
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(ours))
    hf_config = AutoConfig.from_pretrained(tmp_path / "ours")
    theirs = HfConfig(**config_kwargs)
    assert type(hf_config) is HfConfig
    for name in ("index_n_heads", "index_head_dim", "index_topk", "mlp_layer_types", "layer_types", "q_lora_rank",
                 "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor", "tie_word_embeddings",
                 "norm_topk_prob"):  # fmt: skip
        assert getattr(hf_config, name) == getattr(theirs, name), name
    assert hf_config.rope_parameters["rope_type"] == theirs.rope_parameters["rope_type"]
    assert hf_config.rope_parameters.get("factor") == theirs.rope_parameters.get("factor")


# --- the trainer's forward against transformers ----------------------------------------------------------------------


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, config_kwargs):
    """Right padding (the trainer's rows), left padding (prompts, with transformers given the positions), no mask;
    single and sharded files; and the indexer really selected (with every topk above the length, logits differ)."""
    hf = hf_model(config_kwargs, seed=2)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    vocab = config_kwargs["vocab_size"]
    right_ids, right_mask = right_padded_batch(vocab, seed=3, length=14, real=(9, 6))
    left_ids, left_mask, positions = left_padded_batch(vocab, seed=4, length=16)
    with torch.no_grad():
        theirs_right = hf(input_ids=right_ids, attention_mask=right_mask).logits
        theirs_left = hf(input_ids=left_ids, attention_mask=left_mask, position_ids=positions).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert isinstance(model, DeepseekV32ForCausalLM)
            assert_same_logits(model(right_ids, right_mask), theirs_right, right_mask, atol=ATOL)
            assert_same_logits(model(left_ids, left_mask), theirs_left, left_mask, atol=ATOL)
        assert_same_logits(model(right_ids), hf(input_ids=right_ids).logits, torch.ones_like(right_mask), atol=ATOL)
        selecting = model(right_ids, right_mask)
        for indexer in indexers(model):
            indexer.topk = 1000
        dense = model(right_ids, right_mask)
    # a query past index_topk tokens attends to fewer keys than dense attention: its logits move
    beyond = config_kwargs["index_topk"] + 1
    assert (selecting[0, beyond:] - dense[0, beyond:]).abs().max() > 1e-3
    torch.testing.assert_close(selecting[:, : config_kwargs["index_topk"]], dense[:, : config_kwargs["index_topk"]])


def test_packed_row_equals_each_sequence_alone(tmp_path, config_kwargs):
    """trainer.sequence_packing: three sequences in one row with segment ids; each gets transformers' logits of the
    sequence alone (the indexer selects within the sequence only)."""
    hf = hf_model(config_kwargs, seed=5)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(6)
    sequences = [torch.randint(0, config_kwargs["vocab_size"], (n,), generator=gen) for n in (9, 3, 13)]
    row = torch.cat(sequences)[None]
    segments = torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)])[None]
    with torch.no_grad():
        packed = model(row, None, segments)[0]
        start = 0
        for seq in sequences:
            theirs = hf(input_ids=seq[None]).logits[0]
            torch.testing.assert_close(packed[start : start + len(seq)], theirs, atol=ATOL, rtol=0)
            assert theirs.abs().mean() > 0.1
            start += len(seq)
        # unpacked, the later sequences would see (and select) the earlier ones' keys
        assert (model(row)[0, 9:12] - packed[9:12]).abs().max() > 1e-3


def test_shared_prompt_forward_equals_transformers(tmp_path, config_kwargs):
    """forward_shared_prompts (trainer.shared_prompts): left-padded prompts once, right-padded responses selecting
    among their prompt's index keys and their own, equal transformers' forward over each prompt + response (longer
    than index_topk) without padding."""
    hf = hf_model(config_kwargs, seed=7)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    vocab, gen = config_kwargs["vocab_size"], torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (8, 3)]
    responses = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 6, 9)]
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
        assert len(prompt) + len(r) > config_kwargs["index_topk"] + 3
        theirs = response_logits(hf, prompt, r + [0])[: len(r) + 1]
        torch.testing.assert_close(ours[row, : len(r) + 1], theirs, atol=ATOL, rtol=0)


def test_gradients_match_transformers_and_the_indexer_is_frozen(tmp_path, config_kwargs):
    """Every trainable parameter gets a finite gradient equal to transformers' (its experts fused in memory); the
    indexer's parameters are frozen (requires_grad off, no gradient), as transformers' no_grad indexer gets none."""
    hf = hf_model(config_kwargs, seed=9).train()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).train()
    ids = torch.randint(0, config_kwargs["vocab_size"], (4, 20), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, 15:], mask[3, 9:] = 0, 0
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    (token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    inter = config_kwargs["moe_intermediate_size"]
    trainable = unchosen = 0
    for name, p in ours.named_parameters():
        assert p.requires_grad != is_frozen(name), name  # the sizing's rule (steps/models/family.py FROZEN_MODULES)
        if ".self_attn.indexer." in name:
            assert not p.requires_grad and p.grad is None, name
            their = hf_grads[name]
            assert their is None or not their.any(), name
            continue
        trainable += 1
        assert p.requires_grad, name
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = hf_grads[f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][expert]
            want = {"gate_proj": fused[:inter], "up_proj": fused[inter:], "down_proj": fused}[proj]
        else:
            want = hf_grads[name]
        if p.grad is None:  # an expert no token chose (group routing leaves some out): none in transformers either
            assert ".mlp.experts." in name and not want.any(), name
            unchosen += 1
            continue
        assert torch.isfinite(p.grad).all(), name
        assert_close_to_scale(p.grad, want, name)
    assert trainable > 0 and unchosen < trainable // 4
    layers = config_kwargs["num_hidden_layers"]
    assert sum(".self_attn.indexer." in n for n, _ in ours.named_parameters()) == len(INDEXER) * layers
    assert ours.moe_blocks()[0].gate.weight.grad.abs().sum() > 0  # the router learns via the top-k weights


# --- publishing ------------------------------------------------------------------------------------------------------


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config_kwargs):
    """moerl's save after one SGD step is read by transformers as DeepseekV32ForCausalLM with moerl's logits, the
    indexer unchanged by the step (frozen), and reads back into moerl bit for bit."""
    hf_model(config_kwargs, seed=11).save_pretrained(tmp_path / "sft")
    model = load_pretrained(tmp_path / "sft")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask = right_padded_batch(config_kwargs["vocab_size"], seed=12, length=14, real=(9, 6))
    (token_logprobs(model(ids, mask), torch.roll(ids, -1, 1)) * mask).sum().backward()
    optimizer.step()
    after = model.state_dict()
    for name, tensor in after.items():
        if ".self_attn.indexer." in name:
            assert torch.equal(tensor, before[name]), name
    assert not torch.equal(after["model.layers.0.self_attn.q_a_proj.weight"],
                           before["model.layers.0.self_attn.q_a_proj.weight"])  # fmt: skip
    save_pretrained(model, tmp_path / "published")
    config = json.loads((tmp_path / "published" / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV32ForCausalLM"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32).eval()
    assert type(hf) is HfModel
    left_ids, left_mask, positions = left_padded_batch(config_kwargs["vocab_size"], seed=13, length=14)
    with torch.no_grad():
        assert_same_logits(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, mask, atol=ATOL)
        theirs = hf(input_ids=left_ids, attention_mask=left_mask, position_ids=positions).logits
        assert_same_logits(model(left_ids, left_mask), theirs, left_mask, atol=ATOL)
    back = load_pretrained(tmp_path / "published").state_dict()
    assert back.keys() == after.keys()
    assert all(torch.equal(back[name], t) for name, t in after.items())


# --- expert parallelism ----------------------------------------------------------------------------------------------

EP_CONFIG = CONFIGS["default_rope_dense_layer"]  # MoE layers 1, 2
EP_PLACEMENT = ExpertPlacement.from_lists([[3, 0, 6, 1, 5, 2, 7, 4], [7, 6, 5, 4, 3, 2, 1, 0]], ep_size=2)
EP_ROWS = (slice(0, 2), slice(2, 3))


def ep_worker(rank: int, world: int, out_dir) -> None:
    """EP rank `rank`'s model (its experts only, read from the checkpoint), its rows, the all-to-all dispatch: its
    logits and its experts' gradients of sum(logits * probe) over every rank's rows."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    model = load_pretrained(out_dir / "ckpt", placement=EP_PLACEMENT, ep_rank=mesh.ep_rank).train()
    cfg = model.config
    assert set(model.state_dict()) == set(expected_tensor_shapes(cfg, EP_PLACEMENT, mesh.ep_rank))
    model.set_dispatch(make_dispatch("alltoall", mesh, cfg.num_experts))
    save_rows_and_expert_grads(model, rank, EP_ROWS[rank], probe_batch(EP_CONFIG["vocab_size"], seed=16), out_dir)


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    """EP=2 over gloo: each rank's logits and its experts' gradients equal the full model's."""
    hf_model(EP_CONFIG, seed=15).save_pretrained(tmp_path / "ckpt")
    cfg = check_checkpoint(tmp_path / "ckpt")
    shapes = expected_tensor_shapes(cfg, EP_PLACEMENT, ep_rank=1)
    assert "model.layers.1.mlp.experts.2.gate_proj.weight" in shapes  # slot 5 of layer 1 is expert 2
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" not in shapes
    assert "model.layers.2.self_attn.indexer.wq_b.weight" in shapes  # replicated with the attention
    full = load_pretrained(tmp_path / "ckpt").train()
    ids, mask, probe = probe_batch(EP_CONFIG["vocab_size"], seed=16)
    logits = full(ids, mask)
    (logits * probe).sum().backward()
    run_gloo(ep_worker, 2, tmp_path)
    for rank, rows in enumerate(EP_ROWS):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert_same_logits(got["logits"], logits[rows].detach(), mask[rows], atol=1e-5)
        grads = expert_grads(got)
        for moe_layer, layer in enumerate((1, 2)):
            held = {n.split(".experts.")[1].split(".")[0] for n in grads if f".layers.{layer}." in n}
            assert held == {str(e) for e in EP_PLACEMENT.held(moe_layer, rank)}
        chosen = 0
        for name, grad in grads.items():
            want = full.get_parameter(name).grad
            if want is None:  # no row of either rank chose it
                assert not grad.any(), name
            else:
                chosen += 1
                assert_close_to_scale(grad, want, name)
        assert chosen > len(grads) // 2


# --- the torch engine ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_torch_engine_decodes_as_one_full_forward(tmp_path, name):
    """indexed_kv_cache: prompts of different lengths (left-padded in the prefill), several samples each, sampled
    and greedy, prompt + response past index_topk: every behaviour log-prob equals transformers' fp32 forward."""
    kwargs = CONFIGS[name]
    hf = hf_model(kwargs, seed=17)
    hf.save_pretrained(tmp_path)
    engine = TorchEngine.from_checkpoint(tmp_path)
    vocab = kwargs["vocab_size"]
    prompts = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13]]
    sampled, greedy = SamplingParams(temperature=1.0, max_new_tokens=10, n=3), SamplingParams(max_new_tokens=10)
    longest = 0
    for params in (sampled, dataclasses.replace(greedy, temperature=0.0)):
        requests = sample_requests([(f"p{i}", p) for i, p in enumerate(prompts)], params,
                                   seed_of=lambda pid, k: sample_seed(0, 1, pid, k))  # fmt: skip
        for request, generation in zip(requests, engine.generate(requests, params), strict=True):
            assert generation.response_ids and all(0 <= t < vocab for t in generation.response_ids)
            longest = max(longest, len(request.prompt_ids) + len(generation.response_ids))
            logits = response_logits(hf, request.prompt_ids, generation.response_ids)
            expected = token_logprobs(logits, torch.tensor(generation.response_ids))
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=ATOL, rtol=0)
            if params.greedy:
                assert generation.response_ids == logits.argmax(dim=-1).tolist()
    assert longest > kwargs["index_topk"] + 3


# --- checkpoints moerl refuses or trims -----------------------------------------------------------------------------


NULL = object()  # set_config: write null (edit_config's None removes the entry)


def set_config(directory, **changes) -> None:
    """edit_config, where NULL writes a JSON null."""
    edit_config(directory, **{k: v for k, v in changes.items() if v is not NULL})
    path = directory / "config.json"
    d = json.loads(path.read_text())
    d.update({k: None for k, v in changes.items() if v is NULL})
    path.write_text(json.dumps(d))


@pytest.fixture
def good_checkpoint(tmp_path):
    hf_model(CONFIGS["default_rope_dense_layer"], seed=18).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_mtp_tensors_are_dropped_on_import(good_checkpoint, capsys):
    """The release holds a multi-token-prediction layer (model.layers.{num_hidden_layers}.*, its indexer too): the
    loader skips it, import says so in one line, and any other extra tensor is refused by name."""
    before = load_pretrained(good_checkpoint).state_dict()
    names = ("model.layers.3.eh_proj.weight", "model.layers.3.self_attn.indexer.wk.weight",
             "model.layers.3.mlp.experts.0.gate_proj.weight")  # fmt: skip
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(8, 32) for name in names}))
    after = load_pretrained(good_checkpoint).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    save_tokenizer(good_checkpoint)
    validate_checkpoint_dir(good_checkpoint)
    assert "3 tensors dropped on import (a multi-token-prediction layer" in capsys.readouterr().out
    extra = "model.layers.2.self_attn.indexer.extra.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({extra: torch.ones(2)}))
    with pytest.raises(MoerlError, match=rf"unexpected tensor {extra}"):
        load_pretrained(good_checkpoint)


def test_misshaped_indexer_tensor_is_named(good_checkpoint):
    """An indexer tensor of the wrong shape is refused by name, with the shape the config expects."""
    name = "model.layers.1.self_attn.indexer.weights_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(4, 32)}))
    with pytest.raises(MoerlError, match=rf"tensor {name} has shape \[4, 32\], expected \[16, 32\]"):
        load_pretrained(good_checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         r"quantization_config = .* is not supported by moerl \(dequantize the fp8 weights to bf16 first"),
        (dict(q_lora_rank=NULL), r"q_lora_rank = None is not supported by moerl \(the indexer reads the query latent"),
        (dict(rope_interleave=False), r"rope_interleave = False is not supported by moerl \(DeepSeek-V3.2's "
                                      r"attention always rotates interleaved pairs"),
        (dict(layer_types=["indexed_attention", "full_attention", "indexed_attention"]),
         r"layer_types = .* is not supported by moerl \(every DeepSeek-V3.2 layer is 'indexed_attention'\)"),
        (dict(layer_types=["indexed_attention"] * 2), r"layer_types = .* \(every DeepSeek-V3.2 layer"),
        (dict(mlp_layer_types=["dense", "dense", "sparse"]),
         r"mlp_layer_types = .* is not supported by moerl \(moerl takes the first first_k_dense_replace \(1\)"),
        (dict(index_head_dim=2), r"index_head_dim = 2 is below qk_rope_head_dim = 4"),
        (dict(index_topk=0), r"index_topk = 0 must be a positive integer"),
        (dict(n_routed_experts=0), r"no experts \(n_routed_experts 0\).*not supported \(a dense model"),
    ],
    ids=["fp8_quantized", "no_q_lora", "rope_not_interleaved", "other_layer_kind", "layer_types_length",
         "mlp_layer_types", "index_head_dim", "index_topk_zero", "no_experts"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    """One MoerlError line naming the field and the fix (DeepSeek-V3.2, not DeepSeek-V3, where it names the family)."""
    set_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        check_checkpoint(good_checkpoint)
    assert "\n" not in str(err.value)
    own = str(err.value).split("; moerl supports:")[0]  # the registry's refusal then lists every family
    assert not re.search(r"DeepSeek-V3(?!\.2)|DeepseekV3(?!2)", own), own


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(moe_intermediate_size=None), r"missing required DeepSeek-V3.2 fields \['moe_intermediate_size'\]"),
        (dict(hidden_act="gelu"), r"hidden_act = 'gelu' is not supported by moerl"),
        (dict(scoring_func="softmax"), r"scoring_func = 'softmax' is not supported by moerl"),
        (dict(topk_method="greedy"), r"topk_method = 'greedy' is not supported by moerl"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
         r"rope type 'linear' is not supported by moerl"),
    ],
    ids=["missing_field", "gelu", "softmax_scoring", "greedy_topk", "linear_rope"],
)  # fmt: skip
def test_refusals_that_name_the_family_name_deepseek_v32(good_checkpoint, changes, message):
    """DeepSeek-V3's checks, inherited: where the message names the family or its model, it names DeepSeek-V3.2."""
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        check_checkpoint(good_checkpoint)
    text = str(err.value)
    assert "\n" not in text
    assert not re.search(r"DeepSeek-V3(?!\.2)|DeepseekV3(?!2)", text), text
