"""The model family registry (steps/models/registry.py): config.json's model_type -> a ModelFamily; refused and
unknown model types said in one line; and a family's Hugging Face tensor names written in its folder only."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from steps.errors import MoerlError
from steps.models.hf_checkpoint import expected_tensor_shapes
from steps.models.placement import ExpertPlacement
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.qwen3_moe.model import MoeForCausalLM
from steps.models.qwen3_moe.spec import QWEN3_MOE
from steps.models.registry import FAMILIES, REFUSED, config_from_hf, family_of, resolve, supported

STEPS = Path(__file__).resolve().parents[1] / "steps"
QWEN3_MOE_FOLDER = STEPS / "models" / "qwen3_moe"
SHARED_DECODERS = tuple(STEPS / "models" / name for name in ("causal_lm.py", "gated_hybrid.py", "mla.py", "dsa.py",
                                                             "compressed_attention.py", "hyper_connections.py"))

# Qwen3-MoE's Hugging Face tensor names, piece by piece: written in steps/models/qwen3_moe/ and nowhere else.
QWEN3_MOE_TENSOR_NAMES = (
    "model.layers", "model.norm", "embed_tokens", "lm_head", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj",
    "q_norm", "k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate", "mlp.experts", "gate_proj",
    "up_proj", "down_proj",
)  # fmt: skip


def tiny_config(**changes) -> MoeConfig:
    kwargs = dict(vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, intermediate_size=24,
                  mlp_only_layers=[1])  # fmt: skip
    return MoeConfig(**{**kwargs, **changes})


def test_a_supported_model_type_resolves_to_its_family():
    d = tiny_config().to_hf_dict()
    assert resolve(d) is QWEN3_MOE is FAMILIES["qwen3_moe"]
    cfg = config_from_hf(d)
    assert cfg == tiny_config()
    assert family_of(cfg) is QWEN3_MOE and family_of(MoeForCausalLM(cfg)) is QWEN3_MOE
    assert (QWEN3_MOE.attention, QWEN3_MOE.router) == ("softmax_kv_cache", "softmax_topk")
    assert d["architectures"] == list(QWEN3_MOE.architectures)


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_refused_model_type_names_the_nearest_supported_family(model_type):
    name, nearest, _ = REFUSED[model_type]
    with pytest.raises(MoerlError) as err:
        resolve({"model_type": model_type, "architectures": ["X"]}, source="sft/config.json")
    message = str(err.value)
    assert message.startswith(f"sft/config.json: {name} (model_type {model_type!r}) is a MoE architecture")
    assert f"the nearest supported family is {FAMILIES[nearest].name} (model_type {nearest!r})" in message
    assert "\n" not in message


def test_an_unknown_model_type_lists_the_supported_families():
    with pytest.raises(MoerlError, match=r"model_type 'llama', .*: not supported \(dense and other .*\); moerl "
                                         r"supports: Qwen3-MoE \(model_type 'qwen3_moe', Qwen3MoeForCausalLM"):
        config_from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    assert supported() == "; ".join(family.description for family in FAMILIES.values())


def test_a_family_refuses_a_config_of_its_model_type_it_cannot_take():
    with pytest.raises(MoerlError, match=r"no experts \(num_experts 0\).*a dense Qwen3.*moerl supports: Qwen3-MoE"):
        resolve({**tiny_config().to_hf_dict(), "num_experts": 0})


def test_family_of_refuses_what_no_family_registered():
    with pytest.raises(TypeError, match="no registered family's config"):
        family_of(object())


def test_the_adapter_names_every_tensor_of_the_model():
    """Qwen3-MoE's modules are named as its checkpoint: the adapter is the identity and its names and shapes are
    the model's state_dict, for the full model and for one EP rank's experts."""
    cfg = tiny_config(tie_word_embeddings=False)
    adapter = QWEN3_MOE.state_dict_adapter
    model = MoeForCausalLM(cfg)
    state = model.state_dict()
    assert {n: tuple(t.shape) for n, t in state.items()} == expected_tensor_shapes(cfg) == adapter.expected_shapes(cfg)
    assert adapter.to_hf(state) is state and adapter.from_hf(state) is state
    placement = ExpertPlacement.from_lists([[3, 0, 2, 1], [1, 2, 3, 0]], ep_size=2)
    part = MoeForCausalLM(cfg, placement, ep_rank=1)
    assert {n: tuple(t.shape) for n, t in part.state_dict().items()} == expected_tensor_shapes(cfg, placement, 1)
    expert = adapter.expert_params(cfg, 1, 3)
    assert [name for name, _ in expert] == [f"model.layers.2.mlp.experts.3.{p}.weight"
                                           for p in ("gate_proj", "up_proj", "down_proj")]  # fmt: skip
    assert all(tuple(state[name].shape) == shape for name, shape in expert)


def test_the_decode_view_reads_the_models_own_modules():
    cfg = tiny_config(tie_word_embeddings=True)
    model = MoeForCausalLM(cfg)
    parts = QWEN3_MOE.decode(model)
    assert parts.output is model.model.embed_tokens.weight and parts.embed is model.model.embed_tokens
    assert len(parts.layers) == cfg.num_hidden_layers
    assert parts.layers[1].mlp is model.model.layers[1].mlp
    assert parts.layers[0].project.projections[2] is model.model.layers[0].self_attn.v_proj


def test_qwen3_moe_tensor_names_are_written_only_in_family_folders():
    """grep: the family's Hugging Face tensor names appear in no file under steps/ outside the family folders
    (steps/models/<model_type>/, which share many of them) and the shared decoders' module names
    (steps/models/causal_lm.py, gated_hybrid.py, mla.py, dsa.py, compressed_attention.py, hyper_connections.py: the
    model's own names, which each family's state-dict
    adapter maps): the loader,
    the trainer's held state, the engine and the MoE block ask the family."""
    pattern = re.compile("|".join(re.escape(name) for name in QWEN3_MOE_TENSOR_NAMES))
    folders = [STEPS / "models" / model_type for model_type in FAMILIES]
    found = []
    for path in sorted(STEPS.rglob("*.py")):
        if any(folder in path.parents for folder in folders) or path in SHARED_DECODERS:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in pattern.finditer(line):
                found.append(f"{path.relative_to(STEPS.parent)}:{number}: {match.group()}")
    assert not found
    # and the folder does write them: the test would pass vacuously on a renamed folder
    assert "mlp.experts" in (QWEN3_MOE_FOLDER / "state_dict_adapter.py").read_text()
