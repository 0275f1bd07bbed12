"""The Qwen3-Next family (steps/models/qwen3_next/) against transformers 5.23's Qwen3NextForCausalLM, on tiny random
models built by transformers' own config class with every layer kind: gated DeltaNet (linear_attention) and gated
softmax (full_attention) token mixers, sparse layers with the sigmoid-gated shared expert and a dense layer
(mlp_only_layers), tied and untied embeddings. Checked: the tensor names and shapes of the release, which
save_pretrained writes (per expert: transformers splits its fused experts back on save); the config round trip; the
trainer's forward equal to transformers' fp32 logits (atol 1e-4) on right-padded and left-padded rows, on a packed
row (trainer.sequence_packing: each sequence as alone) and through forward_shared_prompts; gradients equal to
transformers' and finite for every parameter; moerl's checkpoint loaded by transformers as Qwen3NextForCausalLM with
the same logits; an EP=2 forward over gloo; the multi-token-prediction module (mtp.*) dropped on import; the torch
engine's decode (every behaviour log-prob equal to transformers' forward); and one clear error for each config moerl
cannot train."""

import dataclasses
import json
import os

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
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import Qwen3NextConfig as HfQwen3NextConfig
from transformers import Qwen3NextForCausalLM as HfQwen3NextForCausalLM

from steps.demo.char_tokenizer import save_tokenizer
from steps.engines.interface import SamplingParams, sample_requests, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh
from steps.models.checkpoint_validation import validate_checkpoint_dir
from steps.models.hf_checkpoint import check_checkpoint, expected_tensor_shapes, load_pretrained, save_pretrained
from steps.models.kernels import token_logprobs
from steps.models.placement import ExpertPlacement
from steps.models.qwen3_next.config import Qwen3NextConfig
from steps.models.qwen3_next.model import Qwen3NextCausalLM, Qwen3NextGatedDeltaNet
from steps.models.qwen3_next.spec import QWEN3_NEXT
from steps.models.registry import config_from_hf, family_of, resolve

# A: full attention every 2nd layer, layer 1 dense (mlp_only_layers), untied, 2 key heads serving 4 value heads.
# B: the default interval 4 (layer 3 full attention), tied embeddings, one kv head, one key head serving 2 value
#    heads of another size, no top-k renormalisation, rope_theta and a partial rotary factor of 0.5.
CONFIGS = {
    "interval2_dense_layer": dict(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[1], full_attention_interval=2,
        max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "interval4_tied": dict(
        vocab_size=128, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=12, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, norm_topk_prob=False, max_position_embeddings=256,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                   "partial_rotary_factor": 0.5},
        bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip
ATOL = 1e-4  # fp32 logits, both ways round
SCALE = 0.1  # randomize_'s std: larger weights grow the hidden states past 100, where fp32 rounding exceeds ATOL


def hf_model(kwargs: dict, seed: int) -> HfQwen3NextForCausalLM:
    torch.manual_seed(seed)
    hf = HfQwen3NextForCausalLM(HfQwen3NextConfig(**kwargs))
    randomize_(hf, seed=seed, scale=SCALE)
    return hf.eval()


def written_config(kwargs: dict, tmp_path) -> dict:
    HfQwen3NextConfig(**kwargs).save_pretrained(tmp_path / "cfg")
    return json.loads((tmp_path / "cfg" / "config.json").read_text())


@pytest.fixture(params=sorted(CONFIGS))
def config_kwargs(request):
    return dict(CONFIGS[request.param])


# --- names and config ----------------------------------------------------------------------------------------------


def test_state_dict_names_are_the_releases(tmp_path, config_kwargs):
    """transformers' save_pretrained writes the released layout (per-expert tensors, linear_attn.in_proj_qkvz /
    in_proj_ba / conv1d / A_log / dt_bias / norm / out_proj, self_attn with q/k norms, shared_expert and its gate):
    moerl expects and writes exactly those names and shapes."""
    HfQwen3NextForCausalLM(HfQwen3NextConfig(**config_kwargs)).save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        on_disk = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    cfg = load_pretrained(tmp_path / "hf").config
    save_pretrained(Qwen3NextCausalLM(cfg), tmp_path / "ours")
    with safe_open(tmp_path / "ours" / "model.safetensors", framework="pt") as f:
        ours = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert ours == on_disk == expected_tensor_shapes(cfg)
    hk, hv = config_kwargs["linear_num_key_heads"], config_kwargs["linear_num_value_heads"]
    dk, dv = config_kwargs["linear_key_head_dim"], config_kwargs["linear_value_head_dim"]
    assert on_disk["model.layers.0.linear_attn.in_proj_qkvz.weight"] == (2 * hk * dk + 2 * hv * dv, 64)
    assert on_disk["model.layers.0.linear_attn.in_proj_ba.weight"] == (2 * hv, 64)
    assert on_disk["model.layers.0.linear_attn.conv1d.weight"] == (2 * hk * dk + hv * dv, 1, 4)
    assert on_disk["model.layers.0.linear_attn.norm.weight"] == (dv,)
    assert on_disk["model.layers.3.self_attn.q_proj.weight"] == (4 * 16 * 2, 64)  # query and gate per head
    assert on_disk["model.layers.3.self_attn.q_norm.weight"] == (16,)
    assert on_disk["model.layers.3.mlp.experts.0.gate_proj.weight"] == (16, 64)
    assert on_disk["model.layers.3.mlp.shared_expert_gate.weight"] == (1, 64)
    assert not any("gate_up_proj" in name or name.startswith("mtp.") for name in on_disk)
    assert ("lm_head.weight" in on_disk) is not config_kwargs["tie_word_embeddings"]
    if config_kwargs.get("mlp_only_layers"):
        assert "model.layers.1.mlp.gate_proj.weight" in on_disk and "model.layers.1.mlp.gate.weight" not in on_disk


def test_the_family_is_registered_and_its_config_round_trips(tmp_path, config_kwargs):
    d = written_config(config_kwargs, tmp_path)
    cfg = config_from_hf(d)
    assert resolve(d) is QWEN3_NEXT and family_of(cfg) is QWEN3_NEXT and isinstance(cfg, Qwen3NextConfig)
    assert cfg.layer_types == d["layer_types"]
    assert (QWEN3_NEXT.attention, QWEN3_NEXT.router) == ("recurrent_state", "softmax_topk")
    ours = json.loads(json.dumps(cfg.to_hf_dict(torch.bfloat16)))
    assert (ours["architectures"], ours["model_type"], ours["dtype"]) == (
        ["Qwen3NextForCausalLM"], "qwen3_next", "bfloat16"
    )  # fmt: skip
    assert Qwen3NextConfig.from_hf_dict(ours) == cfg
    # transformers reads moerl's config.json as the same model
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "config.json").write_text(json.dumps(ours))
    hf_config = AutoConfig.from_pretrained(tmp_path / "ours")
    assert type(hf_config).__name__ == "Qwen3NextConfig"
    for name in ("layer_types", "mlp_only_layers", "head_dim", "linear_num_value_heads", "norm_topk_prob",
                 "tie_word_embeddings", "decoder_sparse_step", "shared_expert_intermediate_size"):  # fmt: skip
        assert getattr(hf_config, name) == getattr(cfg, name), name
    assert hf_config.rope_parameters["partial_rotary_factor"] == cfg.partial_rotary_factor
    assert hf_config.rope_parameters["rope_theta"] == cfg.rope_theta
    model = Qwen3NextCausalLM(cfg)
    kinds = [isinstance(getattr(layer, "linear_attn", None), Qwen3NextGatedDeltaNet) for layer in model.model.layers]
    assert kinds == [kind == "linear_attention" for kind in cfg.layer_types] and any(kinds) and not all(kinds)
    assert len(model.moe_blocks()) == sum(cfg.is_moe_layer(i) for i in range(4))
    assert [name for name, _ in QWEN3_NEXT.state_dict_adapter.expert_params(cfg, 0, 2)] == [
        f"model.layers.0.mlp.experts.2.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
    ]  # fmt: skip


# --- the trainer's forward against transformers ----------------------------------------------------------------------


def test_transformers_checkpoint_loads_in_ours_with_equal_logits(tmp_path, config_kwargs):
    """Right padding (the trainer's rows), left padding (prompts), no mask; single and sharded files."""
    hf = hf_model(config_kwargs, seed=2)
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    vocab = config_kwargs["vocab_size"]
    right_ids, right_mask = right_padded_batch(vocab, seed=3)
    left_ids, left_mask, positions = left_padded_batch(vocab, seed=4)
    with torch.no_grad():
        theirs_right = hf(input_ids=right_ids, attention_mask=right_mask).logits
        theirs_left = hf(input_ids=left_ids, attention_mask=left_mask, position_ids=positions).logits
        for sub in ("single", "sharded"):
            model = load_pretrained(tmp_path / sub)
            assert isinstance(model, Qwen3NextCausalLM)
            assert_same_logits(model(right_ids, right_mask), theirs_right, right_mask, atol=ATOL)
            assert_same_logits(model(left_ids, left_mask), theirs_left, left_mask, atol=ATOL)
        assert_same_logits(model(right_ids), hf(input_ids=right_ids).logits, torch.ones_like(right_mask), atol=ATOL)


def test_packed_row_equals_each_sequence_alone(tmp_path, config_kwargs):
    """trainer.sequence_packing: three sequences in one row with segment ids; each gets transformers' logits of
    the sequence alone (no DeltaNet state, conv tap or attention crosses a boundary)."""
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
            alone = model(seq[None])[0]  # moerl's own forward of the sequence alone: the same up to fp32 rounding
            torch.testing.assert_close(packed[start : start + len(seq)], alone, atol=5e-5, rtol=0)
            assert theirs.abs().mean() > 0.1
            start += len(seq)
        # and unpacked, the row would differ: the state leaks
        assert (model(row)[0, 9:12] - packed[9:12]).abs().max() > 1e-3


def test_shared_prompt_forward_equals_transformers(tmp_path, config_kwargs):
    """forward_shared_prompts (trainer.shared_prompts): left-padded prompts once, right-padded responses that
    continue from their prompt's DeltaNet state and attend to its k/v, equal transformers' forward over each
    prompt + response without padding."""
    hf = hf_model(config_kwargs, seed=7)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    vocab, gen = config_kwargs["vocab_size"], torch.Generator().manual_seed(8)
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


def test_gradients_are_finite_and_match_transformers(tmp_path, config_kwargs):
    """The trainer differentiates token log-probs over right-padded rows: every parameter gets a finite gradient
    (every expert is chosen by some token), equal to transformers' to 1e-4 of its largest entry (its experts fused
    in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    hf = hf_model(config_kwargs, seed=9).train()
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).train()
    ids = torch.randint(0, config_kwargs["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, 17:], mask[3, 9:] = 0, 0
    targets, weight = torch.roll(ids, -1, dims=1), mask.float()
    (token_logprobs(ours(ids, mask), targets) * weight).sum().backward()
    (token_logprobs(hf(input_ids=ids, attention_mask=mask).logits, targets) * weight).sum().backward()
    hf_grads = {name: p.grad for name, p in hf.named_parameters()}
    inter = config_kwargs["moe_intermediate_size"]
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            expert, proj = int(rest.split(".")[0]), rest.split(".")[1]
            fused = hf_grads[f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][expert]
            want = {"gate_proj": fused[:inter], "up_proj": fused[inter:], "down_proj": fused}[proj]
        else:
            want = hf_grads[name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")]
        assert_close_to_scale(p.grad, want, name)


# --- publishing ------------------------------------------------------------------------------------------------------


def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, config_kwargs):
    """moerl's save (after a training step changed every weight) is read by transformers as Qwen3NextForCausalLM
    with moerl's logits, and reads back into moerl bit for bit."""
    hf_model(config_kwargs, seed=11).save_pretrained(tmp_path / "sft")
    model = load_pretrained(tmp_path / "sft")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids, mask = right_padded_batch(config_kwargs["vocab_size"], seed=12)
    (token_logprobs(model(ids, mask), torch.roll(ids, -1, 1)) * mask).sum().backward()
    optimizer.step()
    save_pretrained(model, tmp_path / "published")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32).eval()
    assert type(hf) is HfQwen3NextForCausalLM
    with torch.no_grad():
        assert_same_logits(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits, mask, atol=ATOL)
    back = load_pretrained(tmp_path / "published").state_dict()
    assert all(torch.equal(back[name], t) for name, t in model.state_dict().items())


# --- expert parallelism ----------------------------------------------------------------------------------------------

EP_CONFIG = CONFIGS["interval2_dense_layer"]  # MoE layers 0, 2, 3
EP_PLACEMENT = ExpertPlacement.from_lists(
    [[3, 0, 2, 1, 7, 4, 6, 5], [1, 2, 5, 0, 4, 6, 7, 3], list(range(8))], ep_size=2
)
EP_ROWS = (slice(0, 2), slice(2, 3))


def ep_full_model(directory) -> Qwen3NextCausalLM:
    return load_pretrained(directory).train()


def ep_worker(rank: int, world: int, out_dir) -> None:
    """EP rank `rank`'s model (its experts only, read from the checkpoint), its rows, the all-to-all dispatch: its
    logits and its experts' gradients of sum(logits * probe) over every rank's rows."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    model = load_pretrained(out_dir / "ckpt", placement=EP_PLACEMENT, ep_rank=mesh.ep_rank).train()
    mine = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    adapter = QWEN3_NEXT.state_dict_adapter
    assert set(adapter.to_hf(mine)) == set(adapter.expected_shapes(model.config, EP_PLACEMENT, mesh.ep_rank))
    model.set_dispatch(make_dispatch("alltoall", mesh, model.config.num_experts))
    save_rows_and_expert_grads(model, rank, EP_ROWS[rank], probe_batch(EP_CONFIG["vocab_size"], seed=16), out_dir)


def test_ep2_forward_over_gloo_equals_the_full_model(tmp_path):
    hf_model(EP_CONFIG, seed=15).save_pretrained(tmp_path / "ckpt")
    full = ep_full_model(tmp_path / "ckpt")
    ids, mask, probe = probe_batch(EP_CONFIG["vocab_size"], seed=16)
    logits = full(ids, mask)
    (logits * probe).sum().backward()
    run_gloo(ep_worker, 2, tmp_path)
    for rank, rows in enumerate(EP_ROWS):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        assert_same_logits(got["logits"], logits[rows].detach(), mask[rows], atol=ATOL)
        grads = expert_grads(got)
        for moe_layer, layer in enumerate((0, 2, 3)):
            held = {n.split(".experts.")[1].split(".")[0] for n in grads if f".layers.{layer}." in n}
            assert held == {str(e) for e in EP_PLACEMENT.held(moe_layer, rank)}
        for name, grad in grads.items():
            assert_close_to_scale(grad, full.get_parameter(name).grad, name)


# --- the torch engine ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_torch_engine_decodes_with_each_layers_state_as_one_full_forward(tmp_path, name):
    """Prompts of different lengths (left-padded in the prefill), several samples each (rows split and are selected
    as they draw different tokens), sampled and greedy: every behaviour log-prob equals transformers' fp32 forward
    of prompt + response."""
    hf = hf_model(CONFIGS[name], seed=17).eval()
    hf.save_pretrained(tmp_path)
    engine = TorchEngine.from_checkpoint(tmp_path)
    vocab = CONFIGS[name]["vocab_size"]
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
    hf_model(CONFIGS["interval4_tied"], seed=17).save_pretrained(tmp_path)
    assert_engine_records_the_routers_choice(tmp_path, CONFIGS["interval4_tied"]["vocab_size"])


# --- checkpoints moerl refuses or trims -----------------------------------------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    hf_model(CONFIGS["interval2_dense_layer"], seed=18).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_mtp_tensors_are_dropped_on_import(good_checkpoint, capsys):
    """The release holds a multi-token-prediction module (mtp.*): the loader skips it, import says so in one line
    with the reason, and any other extra tensor is refused."""
    before = load_pretrained(good_checkpoint).state_dict()
    names = ("mtp.fc.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight", "mtp.norm.weight")
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(8, 64) for name in names}))
    after = load_pretrained(good_checkpoint).state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    save_tokenizer(good_checkpoint)
    validate_checkpoint_dir(good_checkpoint)
    assert "3 tensors dropped on import (a multi-token-prediction layer" in capsys.readouterr().out
    rewrite_weights(good_checkpoint, lambda t: t.update({"model.layers.4.self_attn.q_proj.weight": torch.ones(2)}))
    with pytest.raises(MoerlError, match=r"unexpected tensor model\.layers\.4\.self_attn\.q_proj\.weight"):
        load_pretrained(good_checkpoint)


def test_misshaped_tensor_is_named(good_checkpoint):
    name = "model.layers.0.linear_attn.in_proj_ba.weight"
    rewrite_weights(good_checkpoint, lambda t: t.update({name: torch.ones(4, 64)}))
    with pytest.raises(MoerlError, match=rf"tensor {name} has shape \[4, 64\], expected \[8, 64\]"):
        load_pretrained(good_checkpoint)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         r"quantization_config = .* is not supported by moerl \(the FP8 Qwen3-Next release"),
        (dict(attention_bias=True), r"attention_bias = True is not supported .*set it to false"),
        (dict(layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"]),
         r"layer_types = .* is not supported .*full_attention_interval"),
        (dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              full_attention_interval=4), r"layer_types = .* is not supported .*here 4"),
        (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
         r"layer_types = .* is not supported .*'linear_attention' or 'full_attention'"),
        (dict(partial_rotary_factor=0.5), r"partial_rotary_factor = 0.5 but rope_parameters.partial_rotary_factor"),
        (dict(hidden_act="gelu"), r"hidden_act = 'gelu' is not supported by moerl"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
         r"rope_parameters.rope_type 'yarn' is not supported"),
        (dict(num_experts=0), r"no experts \(num_experts 0\)"),
        (dict(shared_expert_intermediate_size=None), r"missing required Qwen3-Next fields "
                                                      r"\['shared_expert_intermediate_size'\]"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok = 9 exceeds num_experts = 8"),
        (dict(linear_num_value_heads=3), r"linear_num_value_heads = 3 is not a multiple of linear_num_key_heads"),
    ],
    ids=["fp8_quantized", "attention_bias", "layer_types_no_interval", "layer_types_other_interval",
         "sliding_layer", "partial_factor_disagrees", "gelu", "yarn", "zero_experts", "missing_field",
         "top_k_over_experts", "value_heads"],
)  # fmt: skip
def test_unsupported_config_is_refused_with_the_reason(good_checkpoint, changes, message):
    edit_config(good_checkpoint, **changes)
    with pytest.raises(MoerlError, match=message) as err:
        check_checkpoint(good_checkpoint)
    assert "\n" not in str(err.value)
