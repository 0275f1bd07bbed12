"""Kimi-K2.5 (steps/models/kimi_k25/) against transformers 5.23's Kimi_K25ForConditionalGeneration, on tiny random
vision-language models built by transformers' own config class: DeepSeek-V3's language model (MLA with a q LoRA, one
dense layer then a sigmoid group-top-k MoE layer with a shared expert) under text_config, and a one-block MoonViT tower
with its projector under vision_config, carried as buffers. transformers' save_pretrained writes three groups of names
the release never had, so each checkpoint here is transformers' save renamed by the import conversion
(steps/models/import_conversions.py). Checked: the conversion and the release's tensor names and shapes; the config
round trip (transformers' reading of moerl's config.json, the release's vt_* vision keys); the trainer's forward equal
to transformers' fp32 logits on right-padded, left-padded and unpadded rows, single and sharded; gradients equal to
transformers' for every parameter and none for the tower; moerl's checkpoint after a step loaded by transformers with
the same logits and the tower bit for bit; an EP=2 forward and backward over gloo; the torch engine's decode; one
clear error for each checkpoint moerl cannot train; and SGLang's server arguments and refusals."""

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
from safetensors.torch import load_file
from test_expert_parallel import run_gloo
from transformers import AutoConfig
from transformers import Kimi_K25Config as HfConfig
from transformers import Kimi_K25ForConditionalGeneration as HfModel

from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.sglang_engine import family_server_args, kimi_k25_mismatch
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.deepseek_v3.spec import DEEPSEEK_V3
from steps.models.hf_checkpoint import (
    check_checkpoint,
    expected_tensor_shapes,
    load_pretrained,
    save_pretrained,
    tensor_index,
)
from steps.models.import_conversions import convert_on_import
from steps.models.kernels import token_logprobs
from steps.models.kimi_k25.config import KimiK25Config
from steps.models.kimi_k25.layout import rename_to_release_layout
from steps.models.kimi_k25.model import KimiK25ForCausalLM
from steps.models.kimi_k25.spec import KIMI_K25
from steps.models.placement import ExpertPlacement
from steps.models.registry import config_from_hf, family_of, resolve

TEXT = dict(
    model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, routed_scaling_factor=1.0,
)  # fmt: skip
VISION = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=24, num_attention_heads=2, pos_emb_height=4,
              pos_emb_width=4, pos_emb_time=2)  # fmt: skip
PROJECTION = 16
ATOL = 1e-4  # fp32 logits, both ways round
TRITON = {"attention_backend": "triton", "moe_runner_backend": "triton"}  # SGLang's arguments off Hopper
REPO = Path(__file__).resolve().parents[1]
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}  # fmt: skip


def hf_config() -> HfConfig:
    return HfConfig(text_config=dict(TEXT), vision_config=dict(VISION), projection_hidden_size=PROJECTION,
                    tie_word_embeddings=False)  # fmt: skip


def hf_model(seed: int) -> HfModel:
    """transformers' model, weights and correction biases far from their init."""
    torch.manual_seed(seed)
    hf = HfModel(hf_config())
    randomize_(hf, seed=seed, scale=0.3)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)
    return hf.eval()


def convert(directory: Path) -> list[str]:
    """The import conversion of `directory` (in place); what it said."""
    said: list[str] = []
    convert_on_import(Path(directory), said.append)
    return said


def hf_checkpoint(seed: int, directory: Path, **save_kwargs) -> HfModel:
    """transformers' save of hf_model(seed) in `directory`, renamed on import as the trainer's import does."""
    hf = hf_model(seed)
    hf.save_pretrained(directory, **save_kwargs)
    assert renamed_line(convert(directory))
    return hf


def renamed_line(said: list[str]) -> str:
    """The conversion's line saying it renamed the tensors (each line it says is one line)."""
    assert said and all("\n" not in line for line in said), said
    lines = [line for line in said if "from transformers' saved layout to the Kimi-K2.5 release's" in line]
    assert len(lines) == 1, said
    return lines[0]


def tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(entry.shape) for name, entry in tensor_index(directory).items()}


def carried_originals(directory: Path) -> dict[str, torch.Tensor]:
    """The tower's and projector's tensors of a converted checkpoint, under their release names."""
    return {
        name: tensor
        for name, tensor in load_file_all(directory).items()
        if name.startswith(("vision_tower.", "mm_projector."))
    }


def load_file_all(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(file))
    return out


def hf_name(name: str) -> str:
    """moerl's parameter name -> transformers' in-memory one (the routed experts aside)."""
    return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name


def moerl_hf_dict(tmp_path: Path) -> dict:
    """moerl's config.json dict of transformers' written config."""
    hf_config().save_pretrained(tmp_path / "cfg")
    cfg = config_from_hf(json.loads((tmp_path / "cfg" / "config.json").read_text()))
    return json.loads(json.dumps(cfg.to_hf_dict()))


def release_config() -> dict:
    """The release's config.json (bench/model_configs/kimi-k2.5.json) without its INT4 quantization_config."""
    d = json.loads((REPO / "bench" / "model_configs" / "kimi-k2.5.json").read_text())
    d.pop("quantization_config", None)
    d["text_config"].pop("quantization_config", None)
    return d


# --- names, the import conversion and config ------------------------------------------------------------------------


def test_the_conversion_renames_transformers_save_to_the_releases_names(tmp_path):
    """transformers' save holds three groups of names the release never had; after the conversion (one line, and a
    second call does nothing) the names are the release's == expected_tensor_shapes == moerl's save."""
    hf = hf_model(seed=1)
    hf.save_pretrained(tmp_path / "hf")
    saved = tensor_shapes(tmp_path / "hf")
    assert "language_model.model.blocks.1.mlp.gate.weight" in saved
    assert not any(n.startswith("language_model.model.layers.") for n in saved)
    assert saved["model.mm_projector.pre_norm.weight"] == (PROJECTION,)
    assert saved["vision_tower.encoder.patch_embed.proj.weight"] == (16, 3, 14, 14)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "Kimi_K25ForConditionalGeneration"
    ]  # transformers' class name, which SGLang does not register
    said = convert(tmp_path / "hf")
    assert "renamed 42 tensors" in renamed_line(said)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "KimiK25ForConditionalGeneration"
    ]
    assert convert(tmp_path / "hf") == []  # a second call does nothing
    on_disk = tensor_shapes(tmp_path / "hf")
    cfg = load_pretrained(tmp_path / "hf").config
    assert isinstance(cfg, KimiK25Config)
    save_pretrained(KimiK25ForCausalLM(cfg), tmp_path / "ours")
    assert tensor_shapes(tmp_path / "ours") == on_disk == expected_tensor_shapes(cfg)
    assert not any(n.startswith(("model.", "language_model.model.blocks.", "vision_tower.encoder.patch_embed."))
                   for n in on_disk)  # fmt: skip
    lm = "language_model.model.layers."
    assert on_disk[lm + "0.self_attn.q_a_proj.weight"] == (16, 32)
    assert on_disk[lm + "1.mlp.experts.3.down_proj.weight"] == (32, 16)  # per expert, as the release
    assert on_disk[lm + "1.mlp.gate.e_score_correction_bias"] == (4,)
    assert on_disk["language_model.model.embed_tokens.weight"] == on_disk["language_model.lm_head.weight"] == (96, 32)
    assert on_disk["vision_tower.encoder.blocks.0.wqkv.weight"] == (48, 16)
    assert on_disk["vision_tower.encoder.blocks.0.wqkv.bias"] == (48,)
    assert on_disk["vision_tower.encoder.blocks.0.mlp.fc0.weight"] == (24, 16)
    assert "vision_tower.encoder.blocks.1.wqkv.weight" not in on_disk
    assert on_disk["vision_tower.patch_embed.pos_emb.weight"] == (4, 4, 16)  # [h, w, D]
    assert on_disk["vision_tower.patch_embed.proj.weight"] == (16, 3, 14, 14)
    assert on_disk["mm_projector.pre_norm.weight"] == on_disk["mm_projector.pre_norm.bias"] == (PROJECTION,)
    assert on_disk["mm_projector.proj.0.weight"] == (64, 64) and on_disk["mm_projector.proj.2.weight"] == (32, 64)
    # the renamed tensors are transformers' own, bit for bit
    theirs = hf.state_dict()
    ours = load_file_all(tmp_path / "hf")
    assert torch.equal(ours[lm + "1.mlp.gate.weight"], theirs["model.language_model.layers.1.mlp.gate.weight"])
    assert torch.equal(ours["mm_projector.pre_norm.weight"], theirs["model.mm_projector.pre_norm.weight"])
    assert torch.equal(ours["vision_tower.patch_embed.proj.weight"],
                       theirs["model.vision_tower.patch_embed.proj.weight"])  # fmt: skip


def test_the_family_is_registered_and_its_config_round_trips(tmp_path):
    """resolve and family_of give Kimi-K2.5 (not DeepSeek-V3, whose config it extends); to_hf_dict reads back equal,
    and transformers reads it as Kimi_K25Config with the same text fields and tower."""
    hf_config().save_pretrained(tmp_path / "cfg")
    d = json.loads((tmp_path / "cfg" / "config.json").read_text())
    cfg = config_from_hf(d)
    assert resolve(d) is KIMI_K25 and family_of(cfg) is KIMI_K25 and family_of(cfg) is not DEEPSEEK_V3
    assert type(cfg) is KimiK25Config and cfg.family_name == "Kimi-K2.5"
    assert (KIMI_K25.attention, KIMI_K25.router) == ("softmax_kv_cache", "sigmoid_group_topk")
    assert cfg.tie_word_embeddings is False and cfg.projection_hidden_size == PROJECTION
    assert (cfg.num_experts, cfg.q_lora_rank, cfg.hidden_size) == (4, 16, 32)
    ours = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert (ours["architectures"], ours["model_type"], ours["dtype"]) == (
        ["KimiK25ForConditionalGeneration"], "kimi_k25", "bfloat16"
    )  # fmt: skip
    assert ours["text_config"]["model_type"] == "deepseek_v3"
    assert config_from_hf(ours) == cfg and KimiK25Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(ours))
    hf = AutoConfig.from_pretrained(tmp_path / "ours")
    theirs = hf_config()
    assert type(hf) is HfConfig and type(hf.text_config) is type(theirs.text_config)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok",
                 "n_shared_experts", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "routed_scaling_factor",
                 "norm_topk_prob", "rope_interleave", "rms_norm_eps"):  # fmt: skip
        assert getattr(hf.text_config, name) == getattr(theirs.text_config, name), name
    assert hf.text_config.rope_parameters["rope_type"] == theirs.text_config.rope_parameters["rope_type"]
    assert hf.tie_word_embeddings is False and hf.projection_hidden_size == PROJECTION
    for name, value in VISION.items():
        assert getattr(hf.vision_config, name) == value, name


def test_the_releases_vt_vision_keys_size_the_same_tensors(tmp_path):
    """The release writes the tower's sizes under MoonViT's own keys (vt_hidden_size, ...; init_pos_emb_*,
    mm_hidden_size): they name the same tensors as transformers' keys."""
    ours = moerl_hf_dict(tmp_path)
    want = expected_tensor_shapes(config_from_hf(ours))
    release_keys = release_config()["vision_config"]
    assert {"vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "vt_intermediate_size",
            "init_pos_emb_height", "init_pos_emb_width", "mm_hidden_size"} <= set(release_keys)  # fmt: skip
    vision = dict(release_keys, vt_hidden_size=16, vt_num_hidden_layers=1, vt_num_attention_heads=2,
                  vt_intermediate_size=24, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=2,
                  mm_hidden_size=PROJECTION, text_hidden_size=32)  # fmt: skip
    d = {**ours, "vision_config": vision}
    d.pop("projection_hidden_size")
    cfg = config_from_hf(d)
    assert cfg.projection_hidden_size == PROJECTION and expected_tensor_shapes(cfg) == want
    # the release's keys win over transformers' where both are written
    both = {**ours, "vision_config": dict(ours["vision_config"], vt_num_hidden_layers=2)}
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in expected_tensor_shapes(config_from_hf(both))


# --- the trainer's forward against transformers ----------------------------------------------------------------------


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path):
    """Right padding (the trainer's rows), left padding (prompts; the VLM wrapper hands position_ids to its language
    model as they are), no mask; single and sharded files."""
    hf = hf_checkpoint(seed=2, directory=tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    said: list[str] = []  # the conversion of a sharded save, rewritten in shards again (the rewrite's shard size)
    assert rename_to_release_layout(tmp_path / "sharded", said.append, shard_bytes=20_000) == 42
    assert renamed_line(said)
    assert len({entry.file for entry in tensor_index(tmp_path / "sharded").values()}) > 1
    vocab = TEXT["vocab_size"]
    right_ids, right_mask = right_padded_batch(vocab, seed=3)
    left_ids, left_mask, positions = left_padded_batch(vocab, seed=4)
    with torch.no_grad():
        theirs_right = hf(input_ids=right_ids, attention_mask=right_mask).logits
        theirs_left = hf(input_ids=left_ids, attention_mask=left_mask, position_ids=positions).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert isinstance(model, KimiK25ForCausalLM)
            assert_same_logits(model(right_ids, right_mask), theirs_right, right_mask, atol=ATOL)
            assert_same_logits(model(left_ids, left_mask), theirs_left, left_mask, atol=ATOL)
        assert_same_logits(model(right_ids), hf(input_ids=right_ids).logits, torch.ones_like(right_mask), atol=ATOL)
    # the tower and projector are loaded as the checkpoint holds them
    carried = carried_originals(tmp_path / "single")
    state = model.state_dict()
    assert carried and all(torch.equal(state["vision." + n], t) for n, t in carried.items())


def test_gradients_match_transformers_and_the_tower_is_buffers(tmp_path):
    """Every parameter's gradient equals transformers' language model's (its experts fused in memory); the tower and
    projector are buffers, out of the optimizer, with no gradient."""
    hf = hf_checkpoint(seed=9, directory=tmp_path).train()
    ours = load_pretrained(tmp_path).train()
    ids = torch.randint(0, TEXT["vocab_size"], (4, 20), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, 15:], mask[3, 9:] = 0, 0
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    (token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    inter = TEXT["moe_intermediate_size"]
    names, unchosen = set(), 0
    for name, p in ours.named_parameters():
        names.add(name)
        assert p.requires_grad, name
        if ".mlp.experts." in name:  # transformers fuses them in memory: gate_up_proj [E, 2I, H], down_proj
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = hf_grads[hf_name(f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")]
            want = {"gate_proj": fused[expert][:inter], "up_proj": fused[expert][inter:], "down_proj": fused[expert]}
            want = want[proj]
        else:
            want = hf_grads[hf_name(name)]
        if p.grad is None:  # an expert no token chose: none in transformers either
            assert ".mlp.experts." in name and not want.any(), name
            unchosen += 1
            continue
        assert torch.isfinite(p.grad).all(), name
        assert_close_to_scale(p.grad, want, name)
    assert unchosen <= 3
    assert not any(name.startswith("vision.") for name in names)
    # every transformers language-model parameter has its counterpart (experts: 3 per fused pair of each)
    e = TEXT["n_routed_experts"]
    counted = sum(
        3 * e // 2 if ".mlp.experts." in n else 1
        for n in hf_grads
        if not n.startswith(("model.vision_tower.", "model.mm_projector."))
    )
    assert len(names) == counted
    carried = dict(ours.vision.named_buffers())
    assert len(carried) == len(KIMI_K25.carried(ours.config)) and len(list(ours.vision.parameters())) == 0
    assert all(not t.requires_grad and t.grad is None for t in carried.values())
    assert ours.moe_blocks()[0].gate.weight.grad.abs().sum() > 0  # the router learns via the top-k weights


# --- publishing ------------------------------------------------------------------------------------------------------


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path):
    """moerl's save after one SGD step is read by transformers as Kimi_K25ForConditionalGeneration with nothing
    missing, unexpected or mismatched, with moerl's logits, the tower and projector the original's bit for bit; and
    reads back into moerl bit for bit."""
    original = hf_checkpoint(seed=11, directory=tmp_path / "sft")
    model = load_pretrained(tmp_path / "sft")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids, mask = right_padded_batch(TEXT["vocab_size"], seed=12)
    (token_logprobs(model(ids, mask), torch.roll(ids, -1, 1)) * mask).sum().backward()
    optimizer.step()
    after = model.state_dict()
    assert not torch.equal(after["model.layers.0.self_attn.q_a_proj.weight"],
                           before["model.layers.0.self_attn.q_a_proj.weight"])  # fmt: skip
    assert all(torch.equal(after[n], before[n]) for n in after if n.startswith("vision."))
    save_pretrained(model, tmp_path / "published")
    config = json.loads((tmp_path / "published" / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    hf, info = HfModel.from_pretrained(tmp_path / "published", dtype=torch.float32, output_loading_info=True)
    hf.eval()
    assert type(hf) is HfModel and all(not v for v in info.values()), info
    left_ids, left_mask, positions = left_padded_batch(TEXT["vocab_size"], seed=13)
    with torch.no_grad():
        assert_same_logits(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, mask, atol=ATOL)
        theirs = hf(input_ids=left_ids, attention_mask=left_mask, position_ids=positions).logits
        assert_same_logits(model(left_ids, left_mask), theirs, left_mask, atol=ATOL)
    for part in ("vision_tower", "mm_projector"):
        tower, published = getattr(original.model, part).state_dict(), getattr(hf.model, part).state_dict()
        assert tower.keys() == published.keys() and all(torch.equal(published[n], t) for n, t in tower.items())
    changed = hf.model.language_model.layers[1].mlp.experts.gate_up_proj
    assert not torch.equal(changed, original.model.language_model.layers[1].mlp.experts.gate_up_proj)
    back = load_pretrained(tmp_path / "published").state_dict()
    assert back.keys() == after.keys()
    assert all(torch.equal(back[name], t) for name, t in after.items())
    assert convert(tmp_path / "published") == []  # moerl publishes the release's layout


# --- expert parallelism ----------------------------------------------------------------------------------------------

EP_PLACEMENT = ExpertPlacement.from_lists([[3, 0, 2, 1]], ep_size=2)  # the one MoE layer (layer 1)
EP_ROWS = (slice(0, 2), slice(2, 3))


def ep_worker(rank: int, world: int, out_dir) -> None:
    """EP rank `rank`'s model (its experts only, read from the checkpoint), its rows, the all-to-all dispatch: its
    logits and its experts' gradients of sum(logits * probe) over every rank's rows."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    model = load_pretrained(out_dir / "ckpt", placement=EP_PLACEMENT, ep_rank=mesh.ep_rank).train()
    cfg = model.config
    held = set(KIMI_K25.state_dict_adapter.to_hf(model.state_dict()))
    assert held == set(expected_tensor_shapes(cfg, EP_PLACEMENT, mesh.ep_rank))
    model.set_dispatch(make_dispatch("alltoall", mesh, cfg.num_experts))
    save_rows_and_expert_grads(model, rank, EP_ROWS[rank], probe_batch(TEXT["vocab_size"], seed=16), out_dir)


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    """EP=2 over gloo: each rank's logits and its experts' gradients equal the full model's."""
    hf_checkpoint(seed=15, directory=tmp_path / "ckpt")
    cfg = check_checkpoint(tmp_path / "ckpt")
    shapes = expected_tensor_shapes(cfg, EP_PLACEMENT, ep_rank=1)
    assert "language_model.model.layers.1.mlp.experts.2.gate_proj.weight" in shapes  # slot 2 is expert 2
    assert "language_model.model.layers.1.mlp.experts.3.gate_proj.weight" not in shapes
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in shapes  # carried on every rank
    full = load_pretrained(tmp_path / "ckpt").train()
    ids, mask, probe = probe_batch(TEXT["vocab_size"], seed=16)
    logits = full(ids, mask)
    (logits * probe).sum().backward()
    run_gloo(ep_worker, 2, tmp_path)
    for rank, rows in enumerate(EP_ROWS):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert_same_logits(got["logits"], logits[rows].detach(), mask[rows], atol=1e-5)
        grads = expert_grads(got)
        held = {n.split(".experts.")[1].split(".")[0] for n in grads}
        assert held == {str(e) for e in EP_PLACEMENT.held(0, rank)}
        for name, grad in grads.items():
            want = full.get_parameter(name).grad
            if want is None:  # no row of either rank chose it
                assert not grad.any(), name
            else:
                assert_close_to_scale(grad, want, name)


# --- the torch engine ------------------------------------------------------------------------------------------------


def test_the_torch_engine_decodes_as_one_full_forward(tmp_path):
    """Prompts of different lengths (left-padded in the prefill), several samples each, sampled and greedy: every
    behaviour log-prob equals transformers' fp32 forward of prompt + response."""
    hf = hf_checkpoint(seed=17, directory=tmp_path)
    engine = TorchEngine.from_checkpoint(tmp_path)
    vocab = TEXT["vocab_size"]
    prompts = [[5, 9, 17, 3], [40, 41], [7, 8, 9, 10, 11, 12, 13]]
    sampled, greedy = SamplingParams(temperature=1.0, max_new_tokens=10, n=3), SamplingParams(max_new_tokens=10)
    for params in (sampled, dataclasses.replace(greedy, temperature=0.0)):
        requests = sample_requests([(f"p{i}", p) for i, p in enumerate(prompts)], params,
                                   seed_of=lambda pid, k: sample_seed(0, 1, pid, k))  # fmt: skip
        generations = engine.generate(requests, params)
        assert max(len(g.response_ids) for g in generations) > 1
        for request, generation in zip(requests, generations, strict=True):
            assert generation.response_ids and all(0 <= t < vocab for t in generation.response_ids)
            logits = response_logits(hf, request.prompt_ids, generation.response_ids)
            expected = token_logprobs(logits, torch.tensor(generation.response_ids))
            torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
            if params.greedy:
                assert generation.response_ids == logits.argmax(dim=-1).tolist()


# --- checkpoints moerl refuses ---------------------------------------------------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    hf_checkpoint(seed=18, directory=tmp_path / "ckpt")
    return tmp_path / "ckpt"


def edit_text_config(directory: Path, **changes) -> None:
    """Set entries of config.json's text_config (None: remove the entry)."""
    path = directory / "config.json"
    d = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            d["text_config"].pop(key, None)
        else:
            d["text_config"][key] = value
    path.write_text(json.dumps(d))


def own_part(message: str) -> str:
    return message.split("; moerl supports:")[0]  # the registry's refusal then lists every family


@pytest.mark.parametrize(
    "where, changes, message",
    [
        ("top", dict(quantization_config=INT4), r"quantization_config = .*compressed-tensors.*bf16"),
        ("text_config", dict(quantization_config=INT4),
         r"text_config: quantization_config = .*compressed-tensors.*bf16"),
        ("top", dict(vision_config=None), r"a config.json without text_config and vision_config objects"),
        ("text_config", dict(model_type="qwen3"),
         r"text_config: model_type = 'qwen3' is not supported .*Kimi-K2.5's language model is DeepSeek-V3's"),
    ],
    ids=["int4_top_level", "int4_text_config", "no_vision_config", "text_model_type"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, where, changes, message):
    """One MoerlError line naming the field and the fix; where it names the family, it names Kimi-K2.5."""
    if where == "top":
        edit_config(good_checkpoint, **changes)
    else:
        edit_text_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        check_checkpoint(good_checkpoint)
    text = str(err.value)
    assert "\n" not in text
    if "INT4" in text or "release" in text:
        assert "Kimi-K2.5" in text
    # DeepSeek-V3 may be named only as the language model's architecture
    assert not re.search(r"DeepSeek-V3(?!'s)|DeepseekV3", own_part(text)), text


def test_the_int4_refusal_names_the_release_and_the_fix(good_checkpoint):
    """The released checkpoint's INT4 experts: the message says what to do (decompress to bf16)."""
    edit_config(good_checkpoint, quantization_config=INT4)
    with pytest.raises(MoerlError) as err:
        check_checkpoint(good_checkpoint)
    text = str(err.value)
    assert "\n" not in text and "Kimi-K2.5" in text and "compressed-tensors" in text and "bf16" in text


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("vision_tower.encoder.blocks.0.wqkv.weight", (48, 8), "[48, 16]"),
        ("vision_tower.patch_embed.pos_emb.weight", (16, 16), "[4, 4, 16]"),
        ("mm_projector.proj.2.weight", (32, 32), "[32, 64]"),
    ],
    ids=["tower_block", "pos_emb", "projector"],
)
def test_misshaped_carried_tensor_is_named(good_checkpoint, name, shape, expected):
    """A tower or projector tensor of another shape than vision_config gives is named in one line."""
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(shape)}))
    shown = ", ".join(map(str, shape))
    with pytest.raises(MoerlError, match=re.escape(f"tensor {name} has shape [{shown}], expected {expected}")) as err:
        load_pretrained(good_checkpoint)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name", ["vision_tower.encoder.blocks.1.wqkv.weight", "mm_projector.proj.4.weight",
             "language_model.model.layers.1.mlp.extra.weight"]
)  # fmt: skip
def test_an_extra_tensor_is_named(good_checkpoint, name):
    """A tensor the config does not give (a second tower block, a projector layer, in a language layer) is refused
    by name."""
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(2)}))
    with pytest.raises(MoerlError, match=re.escape(f"unexpected tensor {name}")) as err:
        load_pretrained(good_checkpoint)
    assert "\n" not in str(err.value)


def test_multi_token_prediction_tensors_are_dropped_on_import(good_checkpoint):
    """The layer after the last (language_model.model.layers.2: DeepSeek-V3's multi-token-prediction layer, which
    transformers' own config writes num_nextn_predict_layers 1 for) is skipped by the loader, under the release's
    prefix."""
    before = load_pretrained(good_checkpoint).state_dict()
    name = "language_model.model.layers.2.eh_proj.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(32, 64)}))
    after = load_pretrained(good_checkpoint).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)


def test_a_missing_tower_tensor_is_named(good_checkpoint):
    name = "vision_tower.encoder.final_layernorm.bias"
    rewrite_weights(good_checkpoint, lambda t: t.pop(name))
    with pytest.raises(MoerlError, match=re.escape(f"tensor {name} is missing")) as err:
        load_pretrained(good_checkpoint)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(moe_intermediate_size=None), r"text_config: missing required .*\['moe_intermediate_size'\]"),
        (dict(hidden_act="gelu"), r"text_config: hidden_act = 'gelu' is not supported by moerl"),
        (dict(scoring_func="softmax"), r"text_config: scoring_func = 'softmax' is not supported by moerl"),
        (dict(num_key_value_heads=2), r"text_config: num_key_value_heads = 2 is not supported"),
    ],
    ids=["missing_field", "gelu", "softmax_scoring", "kv_heads"],
)  # fmt: skip
def test_refusals_of_the_language_model_name_kimi_k25(good_checkpoint, changes, message):
    """DeepSeek-V3's checks of text_config, inherited: one line naming text_config's field; where the message names
    the family, it names Kimi-K2.5 (not DeepSeek-V3)."""
    edit_text_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        check_checkpoint(good_checkpoint)
    text = str(err.value)
    assert "\n" not in text, text
    # the family is Kimi-K2.5; transformers' class of its language model (DeepseekV3ForCausalLM) may be named
    assert not re.search(r"DeepSeek-V3(?!'s)", own_part(text)), text


# --- SGLang ----------------------------------------------------------------------------------------------------------


def test_sglang_server_args_of_our_config(tmp_path):
    """An imported checkpoint's config.json (the import adds the release's vt_*, text_hidden_size and mm_hidden_size
    beside transformers' tower keys) and moerl's config of it: triton attention and MoE runner off Hopper (SGLang's
    DeepSeek overrides would pick trtllm), nothing on Hopper. transformers' own config.json, without them, is
    refused: SGLang's projector would read text_hidden_size's default, 7168."""
    hf_checkpoint(seed=1, directory=tmp_path / "ckpt")
    imported = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert imported["vision_config"]["vt_hidden_size"] == imported["vision_config"]["hidden_size"] == 16
    ours = json.loads(json.dumps(config_from_hf(imported).to_hf_dict()))
    for config in (imported, ours):
        assert family_server_args(config, sm=100) == TRITON
        assert family_server_args(config, sm=90) == {}
    with pytest.raises(MoerlError, match=r"text_hidden_size 7168: SGLang's projector would not output") as err:
        family_server_args(moerl_hf_dict(tmp_path), sm=90)
    assert "\n" not in str(err.value)


def test_sglang_server_args_and_refusals(tmp_path):
    """The release's config passes (triton off Hopper, nothing on Hopper); refused where SGLang would build another
    model than transformers: a top-level tie differing from text_config's, a tower sized by vt_* keys alone."""
    ours = moerl_hf_dict(tmp_path)
    assert ours["vision_config"]["hidden_size"] == 16 and "vt_hidden_size" not in ours["vision_config"]
    assert kimi_k25_mismatch(release_config()) is None
    assert family_server_args(release_config(), sm=90) == {}
    assert family_server_args(release_config(), sm=100) == {
        "attention_backend": "triton",
        "moe_runner_backend": "triton",
    }
    # a top-level tie differing from text_config's
    tied = release_config()
    tied["tie_word_embeddings"] = True
    with pytest.raises(MoerlError, match=r"tie_word_embeddings True at the top level but False in text_config") as err:
        family_server_args(tied, sm=90)
    assert "\n" not in str(err.value) and "set rollout.engine: torch" in str(err.value)
    # a vision_config with only vt_* keys of sizes other than SGLang's defaults (1152/27/16/4304)
    small = release_config()
    small["vision_config"] = {k: v for k, v in small["vision_config"].items()
                              if k not in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size")}  # fmt: skip
    small["vision_config"].update(vt_hidden_size=16, vt_num_hidden_layers=1, vt_num_attention_heads=2,
                                  vt_intermediate_size=24)  # fmt: skip
    with pytest.raises(MoerlError, match=r"vision_config.hidden_size 1152 \(SGLang's reading; the tower has 16") as err:
        family_server_args(small, sm=100)
    assert "\n" not in str(err.value)
    # both keys written: SGLang reads what the release means
    both = json.loads(json.dumps(small))
    both["vision_config"].update(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=24)
    assert kimi_k25_mismatch(both) is None
