"""Each model family through the whole workflow, as a user's checkpoint: a tiny random instance built by
transformers' own config class and saved with save_pretrained, with the demo's tokenizer beside it, imported,
rolled out by the torch engine, scored, updated on two expert-parallel ranks (alltoall over gloo) for two
iterations and published. The published version loads in transformers with moerl's logits; and a trainer that
stays up (trainer.server: its experts move between the EP ranks in memory when the balanced placement changes)
publishes the same bits as updates that reload every version from the store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import transformers
from faults_helpers import run_local, tiny_config

from steps.data.tokenizer import CheckpointTokenizer
from steps.demo import char_tokenizer
from steps.models.hf_checkpoint import load_pretrained
from steps.run.config import RunConfig
from steps.store.object_store import Store

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48,
         "max_position_embeddings": 64}  # fmt: skip
FAMILIES = {
    "qwen2_moe": ("Qwen2MoeConfig", {
        **SMALL, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {
        **SMALL, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "deepseek_v3": ("DeepseekV3Config", {
        **SMALL, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "routed_scaling_factor": 1.0}),
    # DeepSeek sparse attention: each query attends to the index_topk keys its indexer selects (16 index heads: with
    # few, exact-zero scores tie and break differently between call shapes, dsa.py)
    "deepseek_v32": ("DeepseekV32Config", {
        **SMALL, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "index_n_heads": 16,
        "index_head_dim": 8, "index_topk": 4, "routed_scaling_factor": 1.0}),
    # DeepSeek-V3.2's sparse attention with a shared indexer layer (layer 1 reuses layer 0's selection)
    "glm_moe_dsa": ("GlmMoeDsaConfig", {
        **SMALL, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "q_lora_rank": 16,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "index_n_heads": 16,
        "index_head_dim": 8, "index_topk": 4, "routed_scaling_factor": 1.0, "indexer_types": ["full", "shared"]}),
    # a vision-language checkpoint whose language model is DeepSeek-V3's: the MoonViT tower and projector carried;
    # transformers saves three groups of names the release never had, which import renames
    "kimi_k25": ("Kimi_K25Config", {
        **SMALL, "model_type": "deepseek_v3", "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "routed_scaling_factor": 1.0}),
    "glm4_moe": ("Glm4MoeConfig", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0}),
    # its checkpoint fuses a layer's experts into one tensor: each EP rank reads its rows, the candidate writer
    # gathers them (tests/test_fused_experts_ep.py)
    "gpt_oss": ("GptOssConfig", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    # its released config.json's fields SGLang reads (steps/models/minimax_m2/config.py SERVED_AS_BUILT); half of
    # each head rotated; the correction bias (zero from transformers' init) is published beside the weights
    "minimax_m2": ("MiniMaxM2Config", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8, "rotary_dim": 4, "num_local_experts": 4,
        "num_experts_per_tok": 2, "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
        "use_routing_bias": True}),
    # gated DeltaNet beside gated softmax attention: the torch engine decodes each row's recurrent state
    # (steps/engines/state_decoder.py), the trainer runs the chunked form
    "qwen3_next": ("Qwen3NextConfig", {
        **SMALL, "num_key_value_heads": 2, "head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8, "full_attention_interval": 2, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}),
    # a vision-language checkpoint: the language model (text_config) trains, the vision tower is carried through
    # unchanged; transformers saves its experts per expert, which import fuses into the released layout
    "qwen3_5_moe": ("Qwen3_5MoeConfig", {
        **{k: v for k, v in SMALL.items() if k != "intermediate_size"}, "num_key_value_heads": 2, "head_dim": 8,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}),
    # hyper-connections, a sliding window with sinks, compressed entries (a CSA layer's chosen by its indexer) and a
    # hash-routed first layer; transformers saves names the release never had, which import renames
    "deepseek_v4": ("DeepseekV4Config", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
        "head_dim": 16, "q_lora_rank": 16, "partial_rotary_factor": 0.5, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "layer_types": ["compressed_sparse_attention",
        "heavily_compressed_attention"], "mlp_layer_types": ["hash_moe", "moe"], "compress_rates": {
        "compressed_sparse_attention": 2, "heavily_compressed_attention": 4}, "sliding_window": 4, "index_topk": 2,
        "index_n_heads": 8, "index_head_dim": 8, "hc_mult": 2, "o_groups": 2, "o_lora_rank": 8}),
}  # fmt: skip
# families whose transformers-initialised checkpoint leaves a table the release fills: model_type -> what fills it
FILLED = {"deepseek_v4": "tid2eid"}  # the hash layers' token -> experts table (zero from transformers' init)
# vision-language families: model_type -> (transformers' class, a tiny vision_config, other config fields)
VISION_LANGUAGE = {
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", {
        "depth": 1, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": 32,
        "num_position_embeddings": 16, "patch_size": 4}, {}),
    "kimi_k25": ("Kimi_K25ForConditionalGeneration", {
        "num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 2,
        "pos_emb_height": 4, "pos_emb_width": 4, "pos_emb_time": 2}, {"projection_hidden_size": 16}),
}  # fmt: skip


def transformers_class(model_type: str) -> type:
    """The Auto class transformers loads a published checkpoint of the family with."""
    if model_type in VISION_LANGUAGE:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def user_checkpoint(directory: Path, model_type: str) -> Path:
    """A tiny random checkpoint of the family, written by transformers, with the demo's tokenizer."""
    char_tokenizer.save_tokenizer(directory)
    tok = CheckpointTokenizer.load(directory)
    class_name, kwargs = FAMILIES[model_type]
    ids = {"bos_token_id": tok.token_id("bos_token"), "eos_token_id": tok.stop_ids[0], "pad_token_id": tok.pad_id}
    torch.manual_seed(0)
    if model_type in VISION_LANGUAGE:
        model_class, vision, extra = VISION_LANGUAGE[model_type]
        text = {"vocab_size": tok.vocab_size, **kwargs, **ids}
        tied = {"tie_word_embeddings": False}  # the release's (SGLang ties Kimi-K2.5 by text_config's, default false)
        config = getattr(transformers, class_name)(text_config=text, vision_config=vision, **extra, **tied)
        model = getattr(transformers, model_class)(config)
    else:
        config = getattr(transformers, class_name)(vocab_size=tok.vocab_size, **kwargs, **ids)
        model = transformers.AutoModelForCausalLM.from_config(config)
    if model_type in FILLED:  # distinct experts per token, each token's own, as a release's table has
        experts = config.num_local_experts
        with torch.no_grad():
            for name, table in model.named_buffers():
                if name.endswith(FILLED[model_type]):
                    tokens = torch.arange(table.shape[0])[:, None]
                    table.copy_((tokens + torch.arange(table.shape[1])[None] * (1 + tokens % 3)) % experts)
    model.save_pretrained(directory)
    return directory


def run_two_iterations(tmp_path: Path, sft: Path, name: str, server: bool) -> Store:
    run_dir = tmp_path / name
    trainer = {
        "ep_backend": "alltoall",
        "nproc_per_node": 2,
        "ep_size": 2,
        "micro_batch_size": 8,
        "steps_per_epoch": 2,
        "lr": 1e-2,
        "expert_placement": "balanced",
        "router": "train",
        "server": server,
    }
    cfg = RunConfig.model_validate(tiny_config(sft.as_uri(), run_dir.as_uri(), iterations=2, trainer=trainer,
                                               sampling={"max_new_tokens": 4, "temperature": 1.0}))  # fmt: skip
    result = run_local(cfg, tmp_path / f"{name}-work")
    assert result.succeeded, result.message
    return Store.open(run_dir.as_uri())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_family_trains_through_the_workflow_and_publishes_what_transformers_loads(tmp_path, model_type):
    sft = user_checkpoint(tmp_path / "sft", model_type)
    plain = run_two_iterations(tmp_path, sft, "plain", server=False)
    served = run_two_iterations(tmp_path, sft, "served", server=True)
    published = {}
    for name, run in (("plain", plain), ("served", served)):
        local = tmp_path / f"{name}-v2"
        run.download_dir("checkpoints/v000002", local)
        published[name] = local
    plain_files = sorted(p.name for p in published["plain"].glob("*.safetensors"))
    for file in plain_files:  # the same bits, whoever trained them
        assert (published["plain"] / file).read_bytes() == (published["served"] / file).read_bytes(), file

    ours = load_pretrained(published["plain"]).eval()
    theirs = transformers_class(model_type).from_pretrained(published["plain"], dtype=torch.float32).eval()
    imported = tmp_path / "plain-v0"
    plain.download_dir("checkpoints/v000000", imported)
    before = load_pretrained(imported).state_dict()
    trained = [name for name, t in ours.state_dict().items() if not torch.equal(t, before[name])]
    assert trained and all(name in dict(ours.named_parameters()) for name in trained)  # carried buffers unchanged
    ids = torch.randint(0, ours.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits.float(), atol=1e-4, rtol=0)
