"""The Qwen3.5-MoE family (steps/models/qwen3_5_moe/) against transformers 5.23's Qwen3_5MoeForConditionalGeneration,
on tiny random vision-language models built by transformers' own config classes (text_config and vision_config):
gated DeltaNet (linear_attention) and gated softmax (full_attention) token mixers with Qwen3.5's separate DeltaNet
projections, every layer sparse with the sigmoid-gated shared expert, tied and untied embeddings, text-only mRoPE;
the vision tower carried as buffers. transformers' save_pretrained writes one tensor per routed expert, the release
(and moerl) the fused layout, so each checkpoint here is transformers' save rewritten by the import conversion
(steps/models/import_conversions.py). Checked: the conversion and the release's tensor names and shapes; the config
round trip (transformers and SGLang's reading of moerl's config.json); the trainer's forward equal to transformers'
fp32 logits (atol 1e-4) on right-padded, left-padded and unpadded rows, on a packed row and through
forward_shared_prompts; gradients equal to transformers' for every parameter and none for the tower; moerl's
checkpoint loaded by transformers with the same logits and the tower bit for bit; an EP=2 forward over gloo; the
torch engine's decode; the multi-token-prediction module dropped on import; and one clear error for each checkpoint
moerl cannot train."""

import dataclasses
import json
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from family_helpers import (
    assert_close_to_scale,
    assert_engine_records_the_routers_choice,
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
from transformers import AutoConfig, AutoModelForImageTextToText
from transformers import Qwen3_5MoeConfig as HfQwen3_5MoeConfig
from transformers import Qwen3_5MoeForConditionalGeneration as HfQwen3_5MoeForConditionalGeneration

import steps.models.hf_checkpoint as hf_checkpoint_module
from steps.demo.char_tokenizer import save_tokenizer
from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.sglang_engine import sglang_model_mismatch
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.checkpoint_validation import validate_checkpoint_dir
from steps.models.hf_checkpoint import (
    check_checkpoint,
    expected_tensor_shapes,
    load_pretrained,
    save_pretrained,
    tensor_index,
)
from steps.models.import_conversions import convert_on_import
from steps.models.kernels import token_logprobs
from steps.models.placement import ExpertPlacement, is_expert_param
from steps.models.qwen3_5_moe.config import Qwen3_5MoeConfig
from steps.models.qwen3_5_moe.fuse_experts import fuse_per_expert_checkpoint
from steps.models.qwen3_5_moe.model import Qwen3_5MoeCausalLM, Qwen3_5MoeGatedDeltaNet
from steps.models.qwen3_5_moe.spec import QWEN3_5_MOE
from steps.models.registry import config_from_hf, family_of, resolve

LINEAR, FULL = "linear_attention", "full_attention"
# A: full attention every 2nd layer (layer_types given), untied, 2 key heads serving 4 value heads, 8 experts top-2,
#    multimodal RoPE sections over the 8 rotated dims (4 frequencies: 2 temporal, 1 height, 1 width), which on text
#    (one position on every axis) is the plain RoPE; a vision tower of 2 blocks.
# B: the default interval 4 (layer_types left out: transformers derives it, layer 3 full attention), tied
#    embeddings, one kv head, one key head serving 2 value heads of another size, 6 experts top-3, rope_theta and a
#    partial rotary factor of 0.5; a vision tower of 1 block. transformers (and SGLang) tie by the top-level
#    tie_word_embeddings, text_config's is ignored (test_the_top_level_tie_word_embeddings_decides).
CONFIGS = {
    "interval2_mrope": dict(
        text=dict(
            vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, layer_types=[LINEAR, FULL, LINEAR, FULL],
            max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [2, 1, 1]},
        ),
        vision=dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, patch_size=4),
    ),
    "interval4_tied": dict(
        text=dict(
            vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
            linear_value_head_dim=12, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, max_position_embeddings=256, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
            bos_token_id=1, eos_token_id=2,
        ),
        vision=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=64,
                    num_position_embeddings=16, patch_size=4),
    ),
}  # fmt: skip
ATOL = 1e-4  # fp32 logits, both ways round
# Gradients against transformers: max |ours - theirs| <= GRAD_REL * max |theirs|. Not 1e-4: on interval2_mrope's random
# model the fp32 backward is sensitive to rounding: moerl's fp32 gradients differ from its float64 ones by up to
# 1.8e-4 of the scale (embed_tokens, layer 0's in_proj_z and an expert's down_proj), transformers' by up to 3.1e-4,
# and the two by 1.4e-4 (seed 9).
GRAD_REL = 3e-4
SCALE = 0.1  # randomize_'s std: larger weights grow the hidden states past 100, where fp32 rounding exceeds ATOL


def hf_config(config: dict) -> HfQwen3_5MoeConfig:
    return HfQwen3_5MoeConfig(
        text_config=dict(config["text"]),
        vision_config=dict(config["vision"]),
        tie_word_embeddings=config["text"]["tie_word_embeddings"],
    )


def hf_model(config: dict, seed: int) -> HfQwen3_5MoeForConditionalGeneration:
    torch.manual_seed(seed)
    hf = HfQwen3_5MoeForConditionalGeneration(hf_config(config))
    randomize_(hf, seed=seed, scale=SCALE)
    return hf.eval()


def convert(directory: Path) -> list[str]:
    """The import conversion of `directory` (per-expert -> fused, in place); what it said."""
    said: list[str] = []
    convert_on_import(Path(directory), said.append)
    return said


def hf_checkpoint(config: dict, seed: int, directory: Path) -> HfQwen3_5MoeForConditionalGeneration:
    """transformers' save of hf_model(config, seed) in `directory`, fused on import as the trainer's import does;
    returns the model."""
    hf = hf_model(config, seed)
    hf.save_pretrained(directory)
    assert len(convert(directory)) == 1
    return hf


def written_config(config: dict, tmp_path: Path) -> dict:
    hf_config(config).save_pretrained(tmp_path / "cfg")
    return json.loads((tmp_path / "cfg" / "config.json").read_text())


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(entry.shape) for name, entry in tensor_index(directory).items()}


@pytest.fixture(params=sorted(CONFIGS))
def config(request):
    return CONFIGS[request.param]


def hf_name(name: str) -> str:
    """moerl's parameter name -> transformers' in-memory one (the routed experts aside)."""
    if name.startswith("model."):
        name = "model.language_model." + name.removeprefix("model.")
    return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")


# --- names, the import conversion and config ------------------------------------------------------------------------


def test_state_dict_names_are_the_releases(tmp_path, config):
    """transformers' per-expert save, fused on import, holds exactly the release's names and shapes (the tower under
    model.visual., Qwen3.5's DeltaNet projections, fused experts, the shared expert): what moerl expects and
    writes, with each expert's gate rows then up rows as transformers holds them in memory."""
    hf = hf_model(config, seed=1)
    hf.save_pretrained(tmp_path / "hf")
    per_expert = tensor_shapes(tmp_path / "hf")
    assert per_expert["model.language_model.layers.0.mlp.experts.0.gate_proj.weight"] == (16, 64)
    assert not any(name.endswith("gate_up_proj") for name in per_expert)
    said = convert(tmp_path / "hf")
    assert len(said) == 1 and "\n" not in said[0] and "fused the per-expert tensors of 4 layers" in said[0]
    assert fuse_per_expert_checkpoint(tmp_path / "hf", said.append) == 0 and len(said) == 1  # nothing left to do
    assert convert(tmp_path / "hf") == []
    on_disk = tensor_shapes(tmp_path / "hf")
    cfg = load_pretrained(tmp_path / "hf").config
    save_pretrained(Qwen3_5MoeCausalLM(cfg), tmp_path / "ours")
    assert tensor_shapes(tmp_path / "ours") == on_disk == expected_tensor_shapes(cfg)
    text, vision = config["text"], config["vision"]
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    e, lm = text["num_experts"], "model.language_model.layers."
    assert on_disk[lm + "0.linear_attn.in_proj_qkv.weight"] == (2 * hk * dk + hv * dv, 64)
    assert on_disk[lm + "0.linear_attn.in_proj_z.weight"] == (hv * dv, 64)
    assert on_disk[lm + "0.linear_attn.in_proj_b.weight"] == on_disk[lm + "0.linear_attn.in_proj_a.weight"] == (hv, 64)
    assert on_disk[lm + "0.linear_attn.conv1d.weight"] == (2 * hk * dk + hv * dv, 1, 4)
    assert on_disk[lm + "3.self_attn.q_proj.weight"] == (4 * 16 * 2, 64)  # query and gate per head
    assert on_disk[lm + "3.mlp.experts.gate_up_proj"] == (e, 32, 64)
    assert on_disk[lm + "3.mlp.experts.down_proj"] == (e, 64, 16)
    assert on_disk[lm + "3.mlp.shared_expert.gate_proj.weight"] == (text["shared_expert_intermediate_size"], 64)
    assert on_disk[lm + "3.mlp.shared_expert_gate.weight"] == (1, 64)
    assert on_disk["model.visual.pos_embed.weight"] == (16, 16)
    assert on_disk["model.visual.patch_embed.proj.weight"] == (16, 3, 2, 4, 4)
    assert on_disk["model.visual.merger.linear_fc2.weight"] == (64, 64)
    assert f"model.visual.blocks.{vision['depth'] - 1}.attn.qkv.weight" in on_disk
    assert f"model.visual.blocks.{vision['depth']}.attn.qkv.weight" not in on_disk
    assert {n for n in on_disk if n.startswith("model.visual.")} == {
        f"model.visual.{n}" for n in hf.model.visual.state_dict()
    }
    assert not any(".experts.0." in name or name.startswith("mtp.") for name in on_disk)
    assert ("lm_head.weight" in on_disk) is not text["tie_word_embeddings"]
    # the fused tensors are transformers' own in-memory experts (gate rows first), bit for bit
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        for name, tensor in hf.state_dict().items():
            if name in on_disk and ".mlp.experts." in name:
                assert torch.equal(f.get_tensor(name), tensor), name


def test_the_conversion_refuses_a_damaged_per_expert_checkpoint(tmp_path):
    """A layer with both layouts, or one expert tensor missing, is one MoerlError line naming the tensor, raised
    before anything is written."""
    directory = tmp_path / "hf"
    hf_model(CONFIGS["interval4_tied"], seed=1).save_pretrained(directory)
    fused = "model.language_model.layers.2.mlp.experts.gate_up_proj"
    rewrite_weights(directory, lambda t: t.update({fused: torch.zeros(6, 32, 64)}))
    before = tensor_shapes(directory)
    with pytest.raises(MoerlError, match=rf"layer 2's experts are stored both fused \({fused}\) and per expert") as err:
        convert(directory)
    assert "\n" not in str(err.value) and tensor_shapes(directory) == before
    missing = "model.language_model.layers.1.mlp.experts.4.up_proj.weight"
    rewrite_weights(directory, lambda t: (t.pop(fused), t.pop(missing)))
    before = tensor_shapes(directory)
    with pytest.raises(MoerlError, match=rf"tensor {missing} is missing") as err:
        convert(directory)
    assert "\n" not in str(err.value) and tensor_shapes(directory) == before
    # unconverted, the loader refuses the per-expert layout too (it reads only the released one)
    with pytest.raises(MoerlError):
        load_pretrained(directory)


def test_the_conversion_refuses_experts_in_another_dtype_and_streams_by_layer(tmp_path):
    """One expert tensor in another dtype is refused before anything is written; a sharded per-expert checkpoint is
    rewritten layer by layer into shards of the released layout, with the same tensors."""
    directory = tmp_path / "hf"
    hf_model(CONFIGS["interval4_tied"], seed=2).save_pretrained(directory)
    odd = "model.language_model.layers.3.mlp.experts.5.down_proj.weight"
    rewrite_weights(directory, lambda t: t.update({odd: t[odd].to(torch.bfloat16)}))
    before = tensor_shapes(directory)
    with pytest.raises(MoerlError, match=rf"tensor {re.escape(odd)} has dtype BF16 beside F32") as err:
        convert(directory)
    assert "\n" not in str(err.value) and tensor_shapes(directory) == before
    sharded = tmp_path / "sharded"
    hf = hf_model(CONFIGS["interval4_tied"], seed=2)
    hf.save_pretrained(sharded, max_shard_size="40KB")
    inputs = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(inputs) > 2
    fuse_per_expert_checkpoint(sharded, say=lambda line: None, shard_bytes=60_000)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and not list(sharded.glob(".moerl-*"))
    assert tensor_shapes(sharded) == expected_tensor_shapes(load_pretrained(sharded).config)
    model = load_pretrained(sharded)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_same_logits(model(ids), hf.eval()(input_ids=ids).logits, torch.ones_like(ids), atol=ATOL)


def test_the_family_is_registered_and_its_config_round_trips(tmp_path, config):
    """moerl's config.json is the one transformers reads as the same Qwen3_5MoeConfig (text and vision), carries
    full_attention_interval for SGLang (which transformers' own config.json lacks) and has no SGLang mismatch."""
    d = written_config(config, tmp_path)
    cfg = config_from_hf(d)
    assert resolve(d) is QWEN3_5_MOE and family_of(cfg) is QWEN3_5_MOE and isinstance(cfg, Qwen3_5MoeConfig)
    assert cfg.layer_types == d["text_config"]["layer_types"]
    assert cfg.layer_types == config["text"].get("layer_types", [LINEAR, LINEAR, LINEAR, FULL])
    assert (QWEN3_5_MOE.attention, QWEN3_5_MOE.router) == ("recurrent_state", "softmax_topk")
    ours = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert (ours["architectures"], ours["model_type"], ours["dtype"]) == (
        ["Qwen3_5MoeForConditionalGeneration"], "qwen3_5_moe", "bfloat16"
    )  # fmt: skip
    assert config_from_hf(ours) == cfg and Qwen3_5MoeConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    interval = 2 if "layer_types" in config["text"] else 4
    assert ours["text_config"]["full_attention_interval"] == interval
    assert sglang_model_mismatch(ours) is None
    assert "full_attention_interval" in sglang_model_mismatch(d)  # transformers writes layer_types alone
    # transformers reads moerl's config.json as the same model
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(ours))
    hf = AutoConfig.from_pretrained(tmp_path / "ours")
    assert type(hf).__name__ == "Qwen3_5MoeConfig" and type(hf.text_config).__name__ == "Qwen3_5MoeTextConfig"
    text = hf.text_config
    for name in ("layer_types", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
                 "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "tie_word_embeddings", "num_key_value_heads", "vocab_size"):  # fmt: skip
        assert getattr(text, name) == getattr(cfg, name), name
    assert hf.tie_word_embeddings == cfg.tie_word_embeddings == config["text"]["tie_word_embeddings"]
    assert text.rope_parameters["rope_theta"] == cfg.rope_theta == config["text"]["rope_parameters"]["rope_theta"]
    assert text.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary_factor == 0.5
    assert text.rope_parameters.get("mrope_section") == config["text"]["rope_parameters"].get("mrope_section")
    for name, value in config["vision"].items():
        assert getattr(hf.vision_config, name) == value, name
    model = Qwen3_5MoeCausalLM(cfg)
    kinds = [isinstance(getattr(layer, "linear_attn", None), Qwen3_5MoeGatedDeltaNet) for layer in model.model.layers]
    assert kinds == [kind == LINEAR for kind in cfg.layer_types] and any(kinds) and not all(kinds)
    assert len(model.moe_blocks()) == 4  # every layer sparse
    assert [name for name, _ in QWEN3_5_MOE.state_dict_adapter.expert_params(cfg, 0, 2)] == [
        f"model.layers.0.mlp.experts.2.{p}" for p in ("gate_up_proj", "down_proj")
    ]  # fmt: skip


# --- the trainer's forward against transformers ----------------------------------------------------------------------


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, config):
    """Right padding (the trainer's rows), left padding (prompts), no mask; single and sharded files."""
    hf = hf_model(config, seed=2)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert convert(tmp_path / "single")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    fuse_per_expert_checkpoint(tmp_path / "sharded", say=lambda _: None, shard_bytes=20_000)
    assert len({entry.file for entry in tensor_index(tmp_path / "sharded").values()}) > 1
    vocab = config["text"]["vocab_size"]
    right_ids, right_mask = right_padded_batch(vocab, seed=3)
    left_ids, left_mask, positions = left_padded_batch(vocab, seed=4)
    with torch.no_grad():
        theirs_right = hf(input_ids=right_ids, attention_mask=right_mask).logits
        # Qwen3_5MoeModel computes 3-D (mRoPE) positions only when given none and there is an image or video; a
        # 2-D position_ids goes to the text model as it is, which expands it to 4 x B x T (the text positions and
        # the three mRoPE axes alike): left_padded_batch's positions, counted from each row's first real token as
        # moerl's forward counts them from the mask (and as generate passes them). Without them transformers counts
        # from the row's first (padding) column, a shift per row that RoPE's relative scores do not see.
        theirs_left = hf(input_ids=left_ids, attention_mask=left_mask, position_ids=positions).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert isinstance(model, Qwen3_5MoeCausalLM)
            assert_same_logits(model(right_ids, right_mask), theirs_right, right_mask, atol=ATOL)
            assert_same_logits(model(left_ids, left_mask), theirs_left, left_mask, atol=ATOL)
        assert_same_logits(model(right_ids), hf(input_ids=right_ids).logits, torch.ones_like(right_mask), atol=ATOL)


def test_packed_row_equals_each_sequence_alone(tmp_path, config):
    """trainer.sequence_packing: three sequences in one row with segment ids; each gets the logits of the sequence
    alone (no DeltaNet state, conv tap or attention crosses a boundary): exactly so in float64, and transformers'
    fp32 logits up to fp32 rounding."""
    hf = hf_checkpoint(config, seed=5, directory=tmp_path)
    model, model64 = load_pretrained(tmp_path), load_pretrained(tmp_path, dtype=torch.float64)
    gen = torch.Generator().manual_seed(6)
    sequences = [torch.randint(0, config["text"]["vocab_size"], (n,), generator=gen) for n in (9, 3, 13)]
    row = torch.cat(sequences)[None]
    segments = torch.cat([torch.full((len(s),), i) for i, s in enumerate(sequences)])[None]
    with torch.no_grad():
        packed, packed64 = model(row, None, segments)[0], model64(row, None, segments)[0]
        start = 0
        for seq in sequences:
            rows = slice(start, start + len(seq))
            torch.testing.assert_close(packed64[rows], model64(seq[None])[0], atol=1e-6, rtol=0)
            theirs = hf(input_ids=seq[None]).logits[0]
            # 2 x ATOL: interval4_tied's random model amplifies fp32 rounding: its fp32 forwards, moerl's packed and
            # alone and transformers', each differ from the float64 forward by up to 1.6e-4 (seed 5, first
            # sequence), while float64's packed and alone agree to the last bit (above).
            torch.testing.assert_close(packed[rows], theirs, atol=2 * ATOL, rtol=0)
            torch.testing.assert_close(packed[rows], packed64[rows], atol=2 * ATOL, rtol=0)
            assert theirs.abs().mean() > 0.1
            start += len(seq)
        # and unpacked, the row would differ: the state leaks
        assert (model(row)[0, 9:12] - packed[9:12]).abs().max() > 1e-3


def test_shared_prompt_forward_equals_transformers(tmp_path, config):
    """forward_shared_prompts (trainer.shared_prompts): left-padded prompts once, right-padded responses that
    continue from their prompt's DeltaNet state and attend to its k/v, equal transformers' forward over each
    prompt + response without padding."""
    hf = hf_checkpoint(config, seed=7, directory=tmp_path)
    model = load_pretrained(tmp_path)
    vocab, gen = config["text"]["vocab_size"], torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (7, 2)]
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
        empty = model.forward_shared_prompts(prompt_ids, prompt_mask, response_ids[:, :0], response_mask[:, :0],
                                             prompt_index)  # fmt: skip
    for row, r in enumerate(responses):
        prompt = prompts[int(prompt_index[row])]
        theirs = response_logits(hf, prompt, r + [0])[: len(r) + 1]
        torch.testing.assert_close(ours[row, : len(r) + 1], theirs, atol=ATOL, rtol=0)
        torch.testing.assert_close(empty[row, 0], theirs[0], atol=ATOL, rtol=0)


def test_gradients_are_finite_and_match_transformers(tmp_path, config):
    """The trainer differentiates token log-probs over right-padded rows: every parameter gets a finite nonzero
    gradient (every expert is chosen by some token) equal to transformers' to 1e-4 of its largest entry (an
    expert's gate_up_proj and down_proj: its row of transformers' fused tensors); the vision tower is buffers, out
    of the optimizer, with no gradient."""
    hf = hf_checkpoint(config, seed=9, directory=tmp_path).train()
    ours = load_pretrained(tmp_path).train()
    ids = torch.randint(0, config["text"]["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, 17:], mask[3, 9:] = 0, 0
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    (token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    names = set()
    for name, p in ours.named_parameters():
        names.add(name)
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = rest.split(".")
            want = hf_grads[hf_name(f"{prefix}.mlp.experts.{proj}")][int(expert)]
        else:
            want = hf_grads[hf_name(name)]
        assert_close_to_scale(p.grad, want, name, rel=GRAD_REL)
    assert not any(name.startswith("visual.") for name in names)
    tower = dict(ours.visual.named_buffers())
    assert len(tower) == len(hf.model.visual.state_dict()) and len(list(ours.visual.parameters())) == 0
    assert all(not t.requires_grad and t.grad is None for t in tower.values())
    assert all(f"visual.{n}" in ours.state_dict() for n in tower)
    # every transformers language-model parameter has its counterpart (experts: E each)
    e = config["text"]["num_experts"]
    want = sum(e if ".mlp.experts." in n else 1 for n in hf_grads if not n.startswith("model.visual."))
    assert len(names) == want


# --- publishing ------------------------------------------------------------------------------------------------------


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config):
    """moerl's save (after a training step changed every weight) is read by transformers as
    Qwen3_5MoeForConditionalGeneration with moerl's logits, its vision tower the imported one bit for bit, and
    reads back into moerl bit for bit."""
    original = hf_checkpoint(config, seed=11, directory=tmp_path / "sft")
    model = load_pretrained(tmp_path / "sft")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids, mask = right_padded_batch(config["text"]["vocab_size"], seed=12)
    (token_logprobs(model(ids, mask), torch.roll(ids, -1, 1)) * mask).sum().backward()
    optimizer.step()
    save_pretrained(model, tmp_path / "published")
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "published", dtype=torch.float32).eval()
    assert type(hf) is HfQwen3_5MoeForConditionalGeneration
    with torch.no_grad():
        assert_same_logits(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, mask, atol=ATOL)
    tower, published = original.model.visual.state_dict(), hf.model.visual.state_dict()
    assert tower.keys() == published.keys() and all(torch.equal(published[n], t) for n, t in tower.items())
    changed = hf.model.language_model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(changed, original.model.language_model.layers[0].mlp.experts.gate_up_proj)
    back = load_pretrained(tmp_path / "published").state_dict()
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[name], t) for name, t in model.state_dict().items())


# --- expert parallelism ----------------------------------------------------------------------------------------------

EP_CONFIG = CONFIGS["interval2_mrope"]  # every layer a MoE layer
EP_PLACEMENT = ExpertPlacement.from_lists(
    [[3, 0, 2, 1, 7, 4, 6, 5], [1, 2, 5, 0, 4, 6, 7, 3], list(range(8)), [7, 6, 5, 4, 3, 2, 1, 0]], ep_size=2
)
EP_ROWS = (slice(0, 2), slice(2, 3))


def ep_worker(rank: int, world: int, out_dir) -> None:
    """EP rank `rank`'s model (its experts only: its rows of the checkpoint's fused tensors), its rows, the
    all-to-all dispatch: its logits and its experts' gradients of sum(logits * probe) over every rank's rows."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    model = load_pretrained(out_dir / "ckpt", placement=EP_PLACEMENT, ep_rank=mesh.ep_rank).train()
    held = {n for n, _ in model.named_parameters() if is_expert_param(n)}
    adapter = QWEN3_5_MOE.state_dict_adapter
    assert held == {name for layer in range(4) for e in EP_PLACEMENT.held(layer, mesh.ep_rank)
                    for name, _ in adapter.expert_params(model.config, layer, e)}  # fmt: skip
    model.set_dispatch(make_dispatch("alltoall", mesh, model.config.num_experts))
    save_rows_and_expert_grads(
        model, rank, EP_ROWS[rank], probe_batch(EP_CONFIG["text"]["vocab_size"], seed=16), out_dir
    )


def test_ep_rank_reads_only_its_rows_of_the_fused_experts(tmp_path, monkeypatch):
    """With a placement, the fused expert tensors are not read whole: each held expert is its row of them."""
    hf_checkpoint(EP_CONFIG, seed=15, directory=tmp_path)
    read_whole: list[str] = []
    load_whole = hf_checkpoint_module.load_state_dict_from_dir

    def spy(directory, wanted, *args, **kwargs):
        read_whole.extend(wanted)
        return load_whole(directory, wanted, *args, **kwargs)

    monkeypatch.setattr(hf_checkpoint_module, "load_state_dict_from_dir", spy)
    model = load_pretrained(tmp_path, placement=EP_PLACEMENT, ep_rank=1)
    assert read_whole and not any(".mlp.experts." in name for name in read_whole)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        for layer in range(4):
            prefix = f"model.language_model.layers.{layer}.mlp.experts."
            fused = {w: f.get_tensor(prefix + w) for w in ("gate_up_proj", "down_proj")}
            held = EP_PLACEMENT.held(layer, 1)
            for e in range(8):
                for w, tensor in fused.items():
                    name = f"model.layers.{layer}.mlp.experts.{e}.{w}"
                    if e in held:
                        assert torch.equal(model.get_parameter(name), tensor[e]), name
                    else:
                        assert name not in model.state_dict(), name


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    """EP=2 over gloo (every layer a MoE layer): each rank's logits and expert gradients equal the full model's."""
    hf_checkpoint(EP_CONFIG, seed=15, directory=tmp_path / "ckpt")
    full = load_pretrained(tmp_path / "ckpt").train()
    ids, mask, probe = probe_batch(EP_CONFIG["text"]["vocab_size"], seed=16)
    logits = full(ids, mask)
    (logits * probe).sum().backward()
    run_gloo(ep_worker, 2, tmp_path)
    for rank, rows in enumerate(EP_ROWS):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert_same_logits(got["logits"], logits[rows].detach(), mask[rows], atol=ATOL)
        grads = expert_grads(got)
        for layer in range(4):
            held = {n.split(".experts.")[1].split(".")[0] for n in grads if f".layers.{layer}." in n}
            assert held == {str(e) for e in EP_PLACEMENT.held(layer, rank)}
        for name, grad in grads.items():
            assert_close_to_scale(grad, full.get_parameter(name).grad, name)


# --- the torch engine ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_torch_engine_decodes_with_each_layers_state_as_one_full_forward(tmp_path, name):
    """Prompts of different lengths (left-padded in the prefill), several samples each (rows split and are selected
    as they draw different tokens), sampled and greedy: every behaviour log-prob equals transformers' fp32 forward
    of prompt + response."""
    hf = hf_checkpoint(CONFIGS[name], seed=17, directory=tmp_path)
    engine = TorchEngine.from_checkpoint(tmp_path)
    vocab = CONFIGS[name]["text"]["vocab_size"]
    prompts = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13]]
    sampled, greedy = SamplingParams(temperature=1.0, max_new_tokens=12, n=3), SamplingParams(max_new_tokens=12)
    for params in (sampled, dataclasses.replace(greedy, temperature=0.0)):
        requests = sample_requests([(f"p{i}", p) for i, p in enumerate(prompts)], params,
                                   seed_of=lambda pid, k: sample_seed(0, 1, pid, k))  # fmt: skip
        for request, generation in zip(requests, engine.generate(requests, params), strict=True):
            assert generation.response_ids and all(0 <= t < vocab for t in generation.response_ids)
            logits = response_logits(hf, request.prompt_ids, generation.response_ids)
            expected = token_logprobs(logits, torch.tensor(generation.response_ids))
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
            if params.greedy:
                assert generation.response_ids == logits.argmax(dim=-1).tolist()


def test_the_torch_engine_records_the_routes_of_a_recurrent_state_model(tmp_path):
    hf_checkpoint(CONFIGS["interval4_tied"], seed=17, directory=tmp_path)
    assert_engine_records_the_routers_choice(tmp_path, CONFIGS["interval4_tied"]["text"]["vocab_size"])


# --- checkpoints moerl refuses or trims -----------------------------------------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    hf_checkpoint(CONFIGS["interval2_mrope"], seed=18, directory=tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_mtp_tensors_are_dropped_on_import(good_checkpoint, capsys):
    """The release holds a multi-token-prediction module (mtp.*): the loader skips it, import says so in one line
    with the reason, and any other extra tensor is refused."""
    before = load_pretrained(good_checkpoint).state_dict()
    names = ("mtp.fc.weight", "mtp.layers.0.mlp.experts.gate_up_proj", "mtp.norm.weight")
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(8, 64) for name in names}))
    after = load_pretrained(good_checkpoint).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    save_tokenizer(good_checkpoint)
    validate_checkpoint_dir(good_checkpoint)
    out = capsys.readouterr().out
    assert "3 tensors dropped on import (a multi-token-prediction layer" in out and out.count("\n") == 1
    extra = "model.language_model.layers.4.self_attn.q_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({extra: torch.ones(2)}))
    with pytest.raises(MoerlError, match=re.escape(f"unexpected tensor {extra}")):
        load_pretrained(good_checkpoint)


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("model.language_model.layers.0.linear_attn.in_proj_b.weight", (3, 64), "[4, 64]"),
        ("model.language_model.layers.1.mlp.experts.gate_up_proj", (8, 16, 64), "[8, 32, 64]"),
        ("model.visual.blocks.1.attn.qkv.weight", (48, 8), "[48, 16]"),  # a damaged tower is refused as well
    ],
    ids=["deltanet", "fused_experts", "vision_tower"],
)
def test_misshaped_tensor_is_named(good_checkpoint, name, shape, expected):
    """A tensor of another shape than config.json gives (DeltaNet, fused experts, vision tower) is named in one line."""
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(shape)}))
    shown = ", ".join(map(str, shape))
    with pytest.raises(MoerlError, match=re.escape(f"tensor {name} has shape [{shown}], expected {expected}")) as err:
        load_pretrained(good_checkpoint)
    assert "\n" not in str(err.value)


def edit_sub_config(directory: Path, sub: str, **changes) -> None:
    """Set entries of config.json's `sub` object (text_config, vision_config; None: remove the entry)."""
    path = directory / "config.json"
    d = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            d[sub].pop(key, None)
        else:
            d[sub][key] = value
    path.write_text(json.dumps(d))


@pytest.mark.parametrize(
    "where, changes, message",
    [
        ("top", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         r"quantization_config = .* is not supported by moerl \(the FP8 and NVFP4 Qwen3.5 releases"),
        ("text_config", dict(attention_bias=True), r"text_config: attention_bias = True is not supported .*false"),
        ("text_config", dict(hidden_act="gelu"), r"text_config: hidden_act = 'gelu' is not supported by moerl"),
        ("text_config", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
         r"rope_parameters.rope_type 'yarn' is not supported"),
        ("text_config", dict(num_experts=0), r"no experts \(text_config.num_experts 0\)"),
        ("text_config", dict(shared_expert_intermediate_size=None),
         r"missing required Qwen3.5-MoE text_config fields \['shared_expert_intermediate_size'\]"),
        ("text_config", dict(layer_types=[LINEAR, "sliding_attention", LINEAR, FULL]),
         r"layer_types = .* is not supported .*'linear_attention' or 'full_attention'"),
        ("top", dict(model_type="qwen3_5_moe_text"),
         r"Qwen3.5-MoE \(text-only\) \(model_type 'qwen3_5_moe_text'\).*the nearest supported family is Qwen3.5-MoE "
         r"\(model_type 'qwen3_5_moe'\)"),
        ("top", dict(vision_config=None), r"a config.json without text_config and vision_config objects"),
        ("vision_config", dict(num_heads=3), r"vision_config: hidden_size = 16 is not a multiple of num_heads = 3"),
    ],
    ids=["fp8_quantized", "attention_bias", "gelu", "yarn", "zero_experts", "missing_field", "sliding_layer",
         "text_only_layout", "no_vision_config", "vision_heads"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, where, changes, message):
    """Each config.json moerl cannot train (top level, text_config or vision_config) is one line with the reason."""
    if where == "top":
        edit_config(good_checkpoint, **changes)
    else:
        edit_sub_config(good_checkpoint, where, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        check_checkpoint(good_checkpoint)
    assert "\n" not in str(err.value)


def test_the_top_level_tie_word_embeddings_decides(tmp_path):
    """transformers' save_pretrained of a model tied only at the top level writes text_config.tie_word_embeddings
    false; transformers and SGLang tie by the top-level value, and so does moerl: no lm_head.weight expected."""
    d = json.loads(json.dumps(config_from_hf(written_config(CONFIGS["interval4_tied"], tmp_path)).to_hf_dict()))
    d["text_config"]["tie_word_embeddings"] = False
    cfg = config_from_hf(d)
    assert cfg.tie_word_embeddings is True and "lm_head.weight" not in expected_tensor_shapes(cfg)
    d["tie_word_embeddings"], d["text_config"]["tie_word_embeddings"] = False, True
    assert config_from_hf(d).tie_word_embeddings is False
