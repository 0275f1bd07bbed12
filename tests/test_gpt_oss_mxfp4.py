"""gpt-oss's MXFP4 checkpoints (steps/models/gpt_oss/mxfp4.py) dequantized to bf16 by import-sft.

A tiny gpt-oss built by transformers' GptOssConfig is saved as the Hub's are: bf16 tensors, each layer's two
fused expert weights replaced by uint8 `_blocks` / `_scales` (built by hand from chosen FP4 codes and exponents,
as transformers' MXFP4 quantizer needs its Triton kernels), config.json with quantization_config mxfp4, two shards
with a blocks tensor and its scales in different files. import-sft then publishes a bf16 v000000 whose experts are
transformers' dequantization bit for bit (its convert_moe_packed_tensors and its own MXFP4 load with
Mxfp4Config(dequantize=True)) and the format's values by hand; moerl and transformers load it with equal logits;
the step says so in one line; and a quantization that is not MXFP4, or blocks and scales that do not match
config.json, are one clear error with nothing published."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from model_helpers import randomize_
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers import GptOssConfig as HfGptOssConfig
from transformers import GptOssForCausalLM as HfGptOssForCausalLM

from steps.demo.char_tokenizer import VOCAB_SIZE, save_tokenizer
from steps.errors import MoerlError
from steps.import_sft import import_sft
from steps.models.gpt_oss.model import GptOssCausalLM
from steps.models.gpt_oss.mxfp4 import dequantize, dequantize_checkpoint
from steps.models.hf_checkpoint import checkpoint_dtype, load_pretrained, read_config_json, tensor_index
from steps.run import checkpoint
from steps.store.object_store import Store

E, H, INTER, LAYERS = 4, 64, 32, 2  # MXFP4 blocks are 32 values along hidden_size and intermediate_size
CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=2, sliding_window=4,
    max_position_embeddings=64, swiglu_limit=3.0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16},
)  # fmt: skip
# As gpt-oss-20b's config.json has it
QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
}  # fmt: skip
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # E2M1 by code
SHARDS = ("model-00000-of-00002.safetensors", "model-00001-of-00002.safetensors")  # the Hub's names
PROJ_SHAPES = {"gate_up_proj": (2 * INTER, H), "down_proj": (H, INTER)}  # (rows N, values per row K) as stored


def packed(proj: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [E, N, K/32, 16] (every FP4 code) and scales [E, N, K/32] (2**-7 .. 2**-2)."""
    n, k = PROJ_SHAPES[proj]
    blocks = torch.randint(0, 256, (E, n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 126, (E, n, k // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def by_hand(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The format, read without transformers: value j of a block is FP4[code] * 2**(scale - 127), code the low
    nibble of byte j // 2 for even j, the high one for odd j; rows of K values, transposed to [E, K, N]. Exact in
    float32 and in bf16 (two significant bits)."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [E, N, K/32, 32]
    values = torch.tensor(FP4)[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.flatten(-2).transpose(1, 2).to(torch.bfloat16)


def hub_like_checkpoint(directory, dtype=torch.bfloat16, seed=0):
    """A tiny gpt-oss saved as the Hub's MXFP4 checkpoints are; returns {fused name: (blocks, scales)}."""
    torch.manual_seed(seed)
    hf = HfGptOssForCausalLM(HfGptOssConfig(**CONFIG))
    randomize_(hf, seed=seed)
    hf.to(dtype).save_pretrained(directory)
    save_tokenizer(directory)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    gen = torch.Generator().manual_seed(seed + 1)
    quantized = {}
    for layer in range(LAYERS):
        for proj in PROJ_SHAPES:
            fused = f"model.layers.{layer}.mlp.experts.{proj}"
            tensors.pop(fused)
            quantized[fused] = packed(proj, gen)
            tensors[f"{fused}_blocks"], tensors[f"{fused}_scales"] = quantized[fused]
    # two shards, as the Hub's: the blocks in one, their scales (and the rest, alternately) in the other
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, name in enumerate(sorted(tensors)):
        shard = 0 if name.endswith("_blocks") else 1 if name.endswith("_scales") else i % 2
        shards[shard][name] = tensors[name]
    weight_map = {}
    for file_name, shard in zip(SHARDS, shards, strict=True):
        save_file(shard, directory / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = read_config_json(directory)
    config["quantization_config"] = QUANTIZATION
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return quantized


def edit_config(directory, **changes):
    config = read_config_json(directory)
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def v0(run_dir):
    return run_dir / "checkpoints" / "v000000"


def expert_tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for name, entry in tensor_index(directory).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            with safe_open(entry.file, framework="pt") as f:
                out[name] = f.get_tensor(name)
    return out


def test_import_dequantizes_mxfp4_experts_to_bf16(tmp_path, capsys):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, run_dir = tmp_path / "sft", tmp_path / "run"
    quantized = hub_like_checkpoint(src)
    import_sft(str(src), str(run_dir))
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "MXFP4" in line]
    assert lines == [
        f"{Store.open(str(src)).uri}: dequantized {2 * LAYERS} MXFP4 expert tensors to bf16 with transformers' "
        "convert_moe_packed_tensors; the run trains and publishes bfloat16 (every version keeps v000000's dtype)"
    ]

    published = v0(run_dir)
    config = read_config_json(published)
    assert "quantization_config" not in config and (config["dtype"], config["torch_dtype"]) == ("bfloat16",) * 2
    assert checkpoint_dtype(published) == torch.bfloat16
    index = tensor_index(published)
    assert {entry.dtype for entry in index.values()} == {"BF16"}
    assert not [name for name in index if name.endswith(("_blocks", "_scales"))]
    experts = expert_tensors(published)
    assert sorted(experts) == sorted(quantized)
    for name, (blocks, scales) in quantized.items():
        ours = experts[name]
        n, k = PROJ_SHAPES[name.rsplit(".", 1)[1]]
        assert ours.shape == (E, k, n) and ours.dtype == torch.bfloat16
        assert torch.equal(ours.view(torch.int16), convert_moe_packed_tensors(blocks, scales).view(torch.int16))
        assert torch.equal(ours.view(torch.int16), by_hand(blocks, scales).view(torch.int16))
        assert torch.equal(dequantize(blocks, scales), ours)
    # the unquantized tensors as they were (bf16 already)
    with safe_open(published / "model.safetensors", framework="pt") as f:
        sinks = f.get_tensor("model.layers.1.self_attn.sinks")
    original = tensor_index(src)["model.layers.1.self_attn.sinks"]
    with safe_open(original.file, framework="pt") as f:
        assert torch.equal(sinks, f.get_tensor("model.layers.1.self_attn.sinks"))

    # transformers' own MXFP4 load (dequantize=True) of the source holds the same experts
    from transformers import Mxfp4Config

    theirs = AutoModelForCausalLM.from_pretrained(
        src, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    ).state_dict()
    for name, ours in experts.items():
        assert torch.equal(theirs[name].view(torch.int16), ours.view(torch.int16)), name

    # idempotent: the same bf16 checkpoint again
    manifest = checkpoint.require_manifest(Store.open(str(run_dir)), 0)
    assert import_sft(str(src), str(run_dir)).created_at == manifest.created_at


def test_the_imported_checkpoint_loads_in_moerl_and_transformers_with_equal_logits(tmp_path):
    src, run_dir = tmp_path / "sft", tmp_path / "run"
    hub_like_checkpoint(src, seed=3)
    import_sft(str(src), str(run_dir))
    ours = load_pretrained(v0(run_dir), dtype=torch.float32)
    assert isinstance(ours, GptOssCausalLM) and next(ours.parameters()).dtype == torch.float32
    assert load_pretrained(v0(run_dir), dtype=None).model.embed_tokens.weight.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(v0(run_dir), dtype=torch.float32).eval()
    assert isinstance(hf, HfGptOssForCausalLM)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB_SIZE, (2, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = ours(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert logits.dtype == torch.float32 and logits[real].abs().mean() > 0.1
    torch.testing.assert_close(logits[real], theirs[real], atol=1e-4, rtol=0)


def test_float32_tensors_beside_mxfp4_experts_become_bf16(tmp_path, capsys):
    directory = tmp_path / "sft"
    hub_like_checkpoint(directory, dtype=torch.float32)
    assert dequantize_checkpoint(directory, shard_bytes=20_000) == 2 * LAYERS
    line = capsys.readouterr().out
    assert f"dequantized {2 * LAYERS} MXFP4 expert tensors to bf16" in line
    # per layer 2 norms, q/k/v/o weights and biases, sinks, the router's weight and bias, the experts' 2 biases
    assert f"cast {3 + LAYERS * 15} other F32 tensors to bf16" in line
    assert not any(directory.glob("model-0000?-of-00002.safetensors")) and not any(directory.glob(".moerl*"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert checkpoint_dtype(directory) == torch.bfloat16
    assert isinstance(load_pretrained(directory), GptOssCausalLM)


def test_a_float_checkpoint_is_left_alone(tmp_path):
    directory = tmp_path / "sft"
    HfGptOssForCausalLM(HfGptOssConfig(**CONFIG)).save_pretrained(directory)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    assert dequantize_checkpoint(directory) == 0
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before


def other_quantization(d):
    edit_config(d, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})


def misshaped_scales(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.down_proj_scales"
    path = d / index["weight_map"][name]
    tensors = load_file(path)
    tensors[name] = tensors[name][:, :, :0]  # intermediate_size 0 in blocks of 32
    save_file(tensors, path)


def wrong_intermediate_size(d):
    edit_config(d, intermediate_size=64)


def scales_missing(d):
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    path = d / index["weight_map"].pop(name)
    tensors = load_file(path)
    tensors.pop(name)
    save_file(tensors, path)
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (other_quantization, r"config\.json: quantization_config\.quant_method = 'fp8' is not supported by moerl "
                             r"\(its import dequantizes gpt-oss's MXFP4 experts only\); dequantize the checkpoint"),
        (misshaped_scales, r"model-00001-of-00002\.safetensors: tensor model\.layers\.1\.mlp\.experts\.down_proj_"
                           r"scales has shape \[4, 64, 0\], expected \[4, 64, 1\] for MXFP4 experts of config\.json"),
        (wrong_intermediate_size, r"model-00000-of-00002\.safetensors: tensor model\.layers\.0\.mlp\.experts\."
                                  r"gate_up_proj_blocks has shape \[4, 64, 2, 16\], expected \[4, 128, 2, 16\].*"
                                  r"fix config\.json or re-download"),
        (scales_missing, r"tensor model\.layers\.0\.mlp\.experts\.gate_up_proj_scales is missing beside "
                         r"model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks"),
    ],
    ids=["not-mxfp4", "misshaped-scales", "config-mismatch", "scales-missing"],
)  # fmt: skip
def test_bad_mxfp4_checkpoint_is_one_clear_error_naming_the_source(tmp_path, breakage, message):
    src, run_dir = tmp_path / "sft", tmp_path / "run"
    hub_like_checkpoint(src)
    breakage(src)
    with pytest.raises(MoerlError, match=message) as err:
        import_sft(str(src), str(run_dir))
    assert "\n" not in str(err.value) and str(src) in str(err.value) and "moerl-import-" not in str(err.value)
    assert not run_dir.exists() or not any(run_dir.rglob("*"))


def test_an_mxfp4_checkpoint_outside_import_names_the_import(tmp_path):
    """Loading one directly (not through import-sft) is refused with the fix: import it, or dequantize it."""
    src = tmp_path / "sft"
    hub_like_checkpoint(src)
    with pytest.raises(MoerlError, match=r"quantization_config = .*python -m steps\.import_sft --src DIR"):
        load_pretrained(src)
    other_quantization(src)
    with pytest.raises(MoerlError, match=r"quantization_config = .*dequantizes MXFP4 only; save the model"):
        load_pretrained(src)
