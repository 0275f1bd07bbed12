"""The SGLang engine: offline generation with `sglang.Engine` on GPUs, behind the same interface as TorchEngine.

Supported SGLang: 0.5.17 or newer (the rollout image pins it; see images/). It is imported lazily, so nothing
else in moerl needs it installed.

How the interface maps onto SGLang (names as in SGLang's ServerArgs, SamplingParams and GenerateReqInput):
    checkpoint dir          Engine(model_path=dir, skip_tokenizer_init=True): we pass token ids and read token
                            ids back, so SGLang never tokenizes (our tokenizer travels with the checkpoint)
    weights' dtype          Engine(dtype=...) from the checkpoint's config.json (`dtype`, or transformers'
                            older `torch_dtype`; none: float32, as SGLang and transformers read it). Never
                            "auto": SGLang's _get_and_verify_dtype serves a float32 checkpoint in float16
    expert parallelism      Engine(tp_size, ep_size, moe_a2a_backend="deepep" | "none", mem_fraction_static)
    determinism             Engine(enable_deterministic_inference=True, random_seed): batch-invariant kernels,
                            so a sample does not depend on what else is in the batch
    one sample's seed       sampling_params["sampling_seed"] (per request)
    temperature, top_p,     sampling_params["temperature"] (0 is greedy), ["top_p"], ["top_k"] (-1 is off),
    top_k, max_new_tokens,  ["max_new_tokens"], ["stop_token_ids"]; ["no_stop_trim"]=True keeps the stop token in
    stop tokens             the output, as the torch engine does
    behaviour log-probs     generate(return_logprob=True): meta_info["output_token_logprobs"], one
                            (logprob, token_id, text) per generated token. SGLANG_RETURN_ORIGINAL_LOGPROB=1 (set
                            before the engine starts; its scheduler processes read it) makes those the raw policy
                            log_softmax(logits) before temperature, which is what the torch engine records and the
                            trainer recomputes (steps/engines/interface.py)
    routed experts          Engine(enable_return_routed_experts=True) and generate(return_routed_experts=True)
                            (rollout.record_routes): meta_info["routed_experts"], base64 of int32 C-order
                            [prompt + completion - 1, num_hidden_layers, num_experts_per_tok], logical expert
                            ids captured before any EPLB remap (layers/moe/topk.py _post_process_topk_ids), rows
                            of dense layers never written (zeros), cached prefix tokens included (the capturer's
                            host buffer is keyed by KV slot: srt/layers/moe/state_capturer/routed_experts.py,
                            base.py get_topk). See RoutesLayout
    finish reason           meta_info["finish_reason"]["type"]: "stop" or "length" ("abort" is an error, unless
                            we aborted the batch: see "SIGTERM")
    new weights in place    Engine.update_weights_from_disk(model_path=dir) -> (success, message,
                            num_paused_requests) (TokenizerManager.update_weights_from_disk): the scheduler
                            reloads the dir's safetensors into the running model (DefaultModelLoader, the
                            config.json it started with: same model, same dtype) and flushes the prefix cache

In-place updates (update_weights). SGLang 0.5.17 reports a failed load as success False and a message (no
weights iterator for the dir; a tensor that does not fit the model, or a load that raises, e.g. out of
memory: "Failed to update weights: ... Rolling back to original weights."), and raises when its weight cache
is on (--weight-cache-mode, which moerl never sets): srt/model_executor/model_runner_components/
weight_updater.py, WeightUpdater.update_weights_from_disk. Its "rollback" reloads from
model_config.model_path, which it has already pointed at the new dir, so after a failure the weights are not
known to be either version's: the engine is `broken` and refuses to generate from then on; the rollout
server then closes it and opens a new one from the run store, answering 503 meanwhile
(steps/experience/rollout_server.py RolloutService.bring_to and recover). A tensor the dir lacks is not an error for
SGLang (the old one stays), so the dir must be a whole verified checkpoint (steps/engines/weight_sync.py makes it
one). config.json is not read again (update_weights_from_disk takes only model_path and load_format), so a
dir of another model or dtype is refused here before SGLang sees it: another shape or computation
(steps/models/hf_checkpoint.py model_architecture, normalised across transformers' config layouts) or another
dtype. Every published version carries v000000's config.json (steps/publish.py keep_parent_config), so
within a run this only ever refuses a dir of another run.

SIGTERM. SGLang's request loop (TokenizerManager.auto_create_handle_loop) hands SIGTERM to its asyncio loop,
whose handler drains the requests and then SIGKILLs its own process tree, the engine's process included: the
step would end with 137 (and keep generating for a while) instead of stopping at once with the rollout
step's 143. The engine makes SGLang create that loop right after start-up, takes SIGTERM back from it and
puts back the handler that was there (the rollout step's or the rollout server's), so a Spot reclaim stops
the process at once, as with the torch engine. SGLang installs its handler only once per engine, so it stays
ours. It must create it on the engine's own loop: auto_create_handle_loop takes get_or_create_event_loop()
(srt/utils/common.py: the running loop, else a new one), and Engine.generate and update_weights_from_disk
run Engine.loop (entrypoints/engine.py), so a request loop made outside it would never read an output.
A batch runs inside SGLang's loop, where the rollout step's handler raises at once (Preempted). A rollout
server's handler only says stop (steps/rollout_server.py): generate polls should_stop on that loop and
aborts every request in flight (TokenizerManager.abort_request(abort_all=True): they finish with
finish_reason "abort"), then raises GenerationInterrupted, which the server answers with 503 (retried).

SGLang draws its own random numbers, so its samples differ from the torch engine's for the same seeds; what
both guarantee is that a sample depends only on its request (prompt, seed, sampling settings, weights).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from steps.engines.interface import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    GenerationInterrupted,
    GenerationRequest,
    SamplingParams,
)
from steps.errors import MoerlError
from steps.models.gated_hybrid import interval_layer_types

if TYPE_CHECKING:
    from steps.run.config import SGLangConfig

MIN_SGLANG_VERSION = (0, 5, 17)
SGLANG_SEED_MODULUS = 2**63  # sampling_seed is a signed 64-bit integer on SGLang's side
STOP_POLL_S = 0.1  # how often a batch in flight asks should_stop (a callback on SGLang's loop)


@dataclass(frozen=True)
class SGLangSettings:
    """SGLang serving settings (rollout.sglang in the run config)."""

    tp_size: int = 1
    ep_size: int = 1
    moe_a2a_backend: str = "none"  # "deepep": DeepEP all-to-all between the expert-parallel ranks
    mem_fraction: float = 0.85
    deterministic: bool = True  # enable_deterministic_inference: batch-invariant kernels
    random_seed: int = 0
    record_routes: bool = False  # enable_return_routed_experts, and every request asks for its routed experts

    @classmethod
    def from_config(cls, sglang: SGLangConfig, random_seed: int, record_routes: bool = False) -> SGLangSettings:
        """The run's `rollout.sglang` section, field by field, the run's seed and whether it records routes."""
        return cls(**dict(sglang), random_seed=random_seed, record_routes=record_routes)


@dataclass(frozen=True)
class RoutesLayout:
    """How SGLang 0.5.17 lays out a request's routed experts, for one model: rows (token, layer, choice) over
    every decoder layer (RoutedExpertsCapturer.create: num_layers = hf_text_config.num_hidden_layers, topk_size =
    num_experts_per_tok; state_capturer/routed_experts.py:69-70), so the MoE layers' rows are picked out."""

    num_layers: int
    top_k: int
    moe_layers: tuple[int, ...]

    @classmethod
    def of(cls, config: dict[str, Any], source: str = "config.json") -> RoutesLayout:
        from steps.models.placement import moe_layer_indices  # lazy: torch, only when routes are recorded
        from steps.models.registry import config_from_hf

        cfg = config_from_hf(config, source)
        return cls(int(cfg.num_hidden_layers), int(cfg.num_experts_per_tok), tuple(moe_layer_indices(cfg)))

    def routes(self, encoded: str, positions: int, where: str) -> np.ndarray:
        """meta_info["routed_experts"] -> [positions, MoE layers, top_k] int16 (Generation.routed_experts).

        A MoE layer's row whose k ids repeat is refused: a top-k never chooses an expert twice, and a row SGLang
        never wrote is all zeros (an MoE runner that bypasses the capturer, e.g. flashinfer_trtllm's fused top-k:
        layers/moe/topk.py TopK.forward_cuda returns BypassedTopKOutput)."""
        flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
        per_position = self.num_layers * self.top_k
        if flat.size != positions * per_position:
            raise MoerlError(
                f"{where}: SGLang returned {flat.size} routed-expert ids, not {positions} tokens x {self.num_layers} "
                f"layers x top-{self.top_k}; use SGLang {'.'.join(map(str, MIN_SGLANG_VERSION))}"
            )
        routes = flat.reshape(positions, self.num_layers, self.top_k)[:, list(self.moe_layers)]
        if self.top_k > 1 and positions:
            ordered = np.sort(routes, axis=-1)
            repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)  # [positions, MoE layers]
            if repeated.any():
                layer = self.moe_layers[int(np.argwhere(repeated)[0][1])]
                raise MoerlError(
                    f"{where}: SGLang's routed experts of layer {layer} repeat an expert in a top-{self.top_k}: it "
                    "recorded no routes there (its MoE runner bypasses the capturer); set rollout.record_routes "
                    "and trainer.routing_replay off, or use the triton MoE runner"
                )
        return routes.astype(np.int16)


# --- Per-family server arguments (SGLang 0.5.17, the rollout image's pin; paths under python/sglang/srt/). ---
# SGLang dispatches on config.json's architectures[0] (models/*.py EntryClass); a config without one (a
# transformers config class's to_dict) is named by its model_type. Kimi-K2 is model_type kimi_k2 with
# DeepseekV3ForCausalLM, so it is served, and resolved, as DeepSeek-V3.
SGLANG_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                        "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                        "glm4_moe": "Glm4MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                        "gpt_oss": "GptOssForCausalLM", "minimax_m2": "MiniMaxM2ForCausalLM",
                        "qwen3_next": "Qwen3NextForCausalLM",
                        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
                        "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM",
                        "kimi_k25": "KimiK25ForConditionalGeneration",
                        "deepseek_v4": "DeepseekV4ForCausalLM"}  # fmt: skip
# The model classes SGLang 0.5.17 registers (models/*.py EntryClass, where ModelRegistry finds them) for the MoE
# architectures moerl has a family for or names (steps/models/registry.py); tests/test_sglang_families.py holds
# every family's architecture to it.
SGLANG_MODELS = {
    "Qwen3MoeForCausalLM": "models/qwen3_moe.py:1243", "Qwen2MoeForCausalLM": "models/qwen2_moe.py:1221",
    "DeepseekV3ForCausalLM": "models/deepseek_v2.py:3224", "DeepseekV32ForCausalLM": "models/deepseek_v2.py:3224",
    "Glm4MoeForCausalLM": "models/glm4_moe.py:1534", "GlmMoeDsaForCausalLM": "models/glm4_moe.py:1534",
    "MixtralForCausalLM": "models/mixtral.py:480", "GptOssForCausalLM": "models/gpt_oss.py:1424",
    "MiniMaxM2ForCausalLM": "models/minimax_m2.py:1436", "Qwen3NextForCausalLM": "models/qwen3_next.py:1293",
    "Qwen3_5MoeForConditionalGeneration": "models/qwen3_5.py:2319",
    "DeepseekV4ForCausalLM": "models/deepseek_v4.py:3195", "KimiK25ForConditionalGeneration": "models/kimi_k25.py:980",
}  # fmt: skip
# MiniMax-M2: SGLang turns on TF32 for its matmuls (arg_groups/overrides.py _minimax_m2_overrides, "to improve gate
# gemm performance"), so its router logits are TF32 where moerl's trainer computes them in fp32: watch the update's
# router_disagreement, and consider trainer.routing_replay: rollout (which SGLang cannot record for it: below).
# server_args.py:220 DETERMINISTIC_ATTENTION_BACKEND_CHOICES and :228 RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND
# (the backends _handle_deterministic_inference accepts for DeepSeek/MLA models, server_args.py:7849-7855).
DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "flashinfer", "triton")
MLA_DETERMINISTIC_ATTENTION_BACKENDS = ("ascend", "fa3", "fa4", "triton")
# server_args.py:5334 _handle_model_specific_adjustments, GptOssForCausalLM: the backends with attention sinks.
GPT_OSS_ATTENTION_BACKENDS = ("triton", "trtllm_mha", "fa3", "fa4", "ascend", "intel_amx", "intel_xpu", "aiter")
# Architectures whose SGLang model has no DeepEP path: moe_a2a_backend "deepep" cannot serve them.
NO_DEEPEP_PATH = {
    "MixtralForCausalLM": "models/mixtral.py MixtralMoE runs FusedMoE and then a tensor-parallel all-reduce, with no "
                          "DeepEP forward (qwen2_moe, qwen3_moe, glm4_moe and deepseek_v2 have one)",
    "GptOssForCausalLM": "models/gpt_oss.py GptOssSparseMoeBlock.forward raises NotImplementedError('forward_deepep "
                         "branch not implemented yet')",
}  # fmt: skip
# Architectures for which SGLang, on sm100 with moe_a2a_backend "none" and moe_runner_backend "auto", picks the
# flashinfer_trtllm MoE runner (arg_groups/overrides.py:1740 _deepseek_moe_quant_resolution, :1308
# _qwen3_moe_family_overrides, :1339 _glm4_moe_overrides); deterministic inference configures only the
# triton runner (layers/moe/moe_runner/triton_utils/fused_moe_triton_config.py:72 get_moe_configs, :190
# get_default_config), which is what "auto" already is for bf16 weights elsewhere
# (layers/quantization/unquant.py:568 UnquantizedFusedMoEMethod: MoeRunnerBackend.TRITON).
# Qwen3-Next and Qwen3.5-MoE are among them (overrides.py:1283-1291 registers _qwen3_moe_family_overrides for both).
# Kimi-K2.5 is among them (overrides.py:1667 _DEEPSEEK_FAMILY_ARCHS; with no quantization_config, :1726, :1740).
TRTLLM_MOE_ON_SM100 = frozenset({"DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                                 "Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                                 "KimiK25ForConditionalGeneration"})  # fmt: skip
HOPPER_SM = 90
# Qwen3-Next (gated DeltaNet beside gated softmax attention) on SGLang 0.5.17, on every GPU:
# - attention_backend "triton". On sm100 SGLang would pick trtllm_mha itself (arg_groups/overrides.py:1240-1265
#   _qwen3_5_hybrid_overrides: trtllm_mha with page_size 64 whenever the mamba radix cache runs its extra_buffer
#   strategy, which overlap scheduling turns on, overrides.py:1493-1499), and _deterministic_attention_backend then
#   raises (overrides.py:2003-2008). On Hopper its fa3 is deterministic for the attention layers, but the scheduler
#   aligns a chunked-prefill split only for triton and flashinfer (managers/scheduler.py:1479-1494
#   init_deterministic_inference_config; managers/schedule_policy.py:1220-1229: a split at a multiple of 4096), so
#   under fa3 a long prompt is cut wherever the batch's token budget ends. The linear-attention layers' chunked
#   kernel restarts its 64-token chunks at every cut (kernels/ops/attention/fla/chunk.py:33 CHUNK_SIZE = 64), so
#   their output would depend on the rest of the batch; 4096 is a multiple of 64. triton is SGLang's own sm100
#   pick for the model (overrides.py:1242), deterministic and radix-capable (server_args.py:220, :228). Given a
#   backend, _qwen3_5_hybrid_overrides sets nothing (overrides.py:1241): page_size stays 1.
# - disable_radix_cache. Deterministic inference leaves the radix cache on for triton/fa3 (server_args.py:7864-
#   7869 turns it off only for the other backends), and for a hybrid model that is the mamba radix cache
#   (overrides.py:1408-1427 _MAMBA_RADIX_CACHE_ARCHS, :1462-1503): a request that hits a cached prefix starts its
#   linear-attention layers from a conv/SSM state another request left (mem_cache/mamba_radix_cache.py:541-571
#   cache_finished_req, with none of radix_cache.py:438's deterministic handling), so its sample would depend on
#   which requests ran before it. Without it every request computes from its own prompt (no shared prefix prefill:
#   slower for groups of samples of one prompt, never another result).
# - SSM state: float32 by default (configs/mamba_utils.py:47-71 mamba2_state_dtype; moerl writes no mamba_ssm_dtype),
#   the mamba pool sized by SGLang (max_mamba_cache_size None, mamba_full_memory_ratio 0.9: server_args.py:2461-2497).
# - in-place updates work: update_weights_from_disk runs Qwen3NextForCausalLM.load_weights (weight_updater.py:180-191,
#   model_loader/loader.py:848), whose loaders all write into the parameters the running kernels hold: the packed
#   in_proj_qkvz / in_proj_ba loader copies (models/qwen3_next.py:300), conv1d's loader assigns into its slice
#   (layers/attention/mamba/mamba.py:177-181) which the linear attention reads through a view (models/qwen3_next.py:
#   239), A_log and dt_bias go through sharded_weight_loader's copy_ (model_loader/weight_utils.py:1406-1433, :1381),
#   and the shared expert, fused as expert num_experts, is renamed to it on every load (models/qwen3_next.py:1172).
# - DeepEP and recorded routes: its MoE is Qwen2MoeSparseMoeBlock, with a DeepEP forward (models/qwen2_moe.py:461)
#   and TopK(..., layer_id=layer_id) (qwen2_moe.py:270-274), captured before the fused shared expert is appended
#   (layers/moe/topk.py:1906): in neither NO_DEEPEP_PATH nor NO_ROUTES_CAPTURE.
# Qwen3.5-MoE (Qwen3_5MoeForConditionalGeneration, models/qwen3_5.py:2319) is the same hybrid to SGLang: its config
# class derives from Qwen3NextConfig (configs/qwen3_5.py:15), the same overrides apply (overrides.py:1234-1265
# _qwen3_5_hybrid_overrides, :1414 _MAMBA_RADIX_CACHE_ARCHS), its MoE is Qwen2MoeSparseMoeBlock (qwen3_5.py:710-726),
# and update_weights_from_disk runs its load_weights (qwen3_5.py:1991-2300), whose loaders write in place as above;
# it loads the released fused experts (qwen3_5.py:2035-2038, :2207-2232) and the vision tower (:2284-2287), and
# skips mtp.* (:2113). So it gets the same arguments.
QWEN3_NEXT_SERVER_ARGS = {"attention_backend": "triton", "disable_radix_cache": True}


# DeepSeek sparse attention (DeepSeek-V3.2, GLM-5) on SGLang 0.5.17 cannot run deterministically as the model
# transformers and moerl compute: SGLang treats these architectures, and a DeepseekV3ForCausalLM config with
# index_topk, as DSA (configs/model_config.py:106-121 is_deepseek_dsa) and sets attention_backend "dsa" when none is
# given (arg_groups/overrides.py:551-574), which deterministic inference then refuses (overrides.py:1980-2012: "dsa"
# is not in server_args.py:215's choices); given "triton", the indexer gets no metadata and returns nothing
# (layers/attention/base_attn_backend.py:275-281, dsa_indexer.py Indexer.forward_cuda), so every query attends to
# every key: another model past index_topk tokens. Its indexer also scores in FP8 after a Hadamard rotation
# (dsa_indexer.py act_quant, rotate_activation, deep_gemm fp8_mqa_logits), which a bf16/fp32 trainer's selection
# can only match by replaying the engine's (enable_return_indexer_topk, server_args.py:3369).
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


# DeepSeek-V4 on SGLang 0.5.17: its override sets attention_backend "dsv4" over any given one (arg_groups/overrides.py
# :1081-1090), which deterministic inference refuses (:2004-2008); its attention calls dsv4-only backend methods
# (models/deepseek_v4.py:765, :861) and it serves an FP8 KV cache, FP8 indexer and FP8 wo_a GEMM.
DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)


def dsa_refusal(config: dict[str, Any]) -> str | None:
    """Why SGLang 0.5.17 cannot serve config.json dict `config` deterministically as the same model (DeepSeek sparse
    attention, DSA_ARCHITECTURES; DeepSeek-V4's compressed attention, DSV4_ARCHITECTURES), or None."""
    arch = sglang_architecture(config)
    if arch in DSA_ARCHITECTURES or (arch == "DeepseekV3ForCausalLM" and config.get("index_topk") is not None):
        return (
            f"{arch} is DeepSeek sparse attention to SGLang 0.5.17, which serves it only with its 'dsa' attention "
            "backend, refused under deterministic inference (with 'triton' it attends to every key: another model "
            "beyond index_topk tokens)"
        )
    if arch in DSV4_ARCHITECTURES:
        return (
            f"{arch} is compressed attention to SGLang 0.5.17, which serves it only with its 'dsv4' attention backend "
            "(set over any other, arg_groups/overrides.py:1090), refused under deterministic inference "
            "(overrides.py:2004-2008), with an FP8 KV cache and FP8 indexer"
        )
    return None


def sglang_architecture(config: dict[str, Any]) -> str | None:
    """The architecture SGLang serves a config.json dict as: architectures[0], else by model_type."""
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    return SGLANG_ARCHITECTURES.get(str(config.get("model_type")))


def sglang_model_mismatch(config: dict[str, Any]) -> str | None:
    """What SGLang 0.5.17 would compute differently from the model of config.json dict `config` (which moerl and
    transformers build as written), or None. SGLang loads such a checkpoint without complaint (or fails on it
    deep in start-up) and samples from another model, so the rollouts would be off-policy in a way no importance
    weight corrects.

    Qwen2MoeForCausalLM (python/sglang/srt/models/qwen2_moe.py): every layer is sparse ("Qwen2MoE all layers are
    sparse", Qwen2MoeDecoderLayer), the head size is hidden_size // num_attention_heads (Qwen2MoeAttention) and
    output projection is never tied to the embeddings (Qwen2MoeForCausalLM).

    Qwen3NextForCausalLM: qwen3_next_mismatch; Qwen3_5MoeForConditionalGeneration: qwen3_5_moe_mismatch."""
    arch = sglang_architecture(config)
    if arch == "Qwen3NextForCausalLM":
        return qwen3_next_mismatch(config)
    if arch == "Qwen3_5MoeForConditionalGeneration":
        return qwen3_5_moe_mismatch(config)
    if arch == "KimiK25ForConditionalGeneration":
        return kimi_k25_mismatch(config)
    if arch != "Qwen2MoeForCausalLM":
        return None
    heads, hidden = config.get("num_attention_heads") or 1, config.get("hidden_size") or 0
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        return "dense layers (mlp_only_layers / decoder_sparse_step): SGLang's Qwen2-MoE makes every layer sparse"
    if config.get("head_dim") not in (None, hidden // heads):
        return f"head_dim {config['head_dim']}: SGLang's Qwen2-MoE uses hidden_size // num_attention_heads"
    if config.get("tie_word_embeddings"):
        return "tie_word_embeddings: SGLang's Qwen2-MoE keeps an output projection of its own"
    return None


QWEN3_NEXT_ROPE_DEFAULTS = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}  # configs/qwen3_next.py:198, :200


def qwen3_next_mismatch(config: dict[str, Any]) -> str | None:
    """What SGLang 0.5.17's Qwen3-Next (python/sglang/srt/configs/qwen3_next.py, models/qwen3_next.py; its own
    config class, utils/hf_transformers/common.py:85-106 _CONFIG_REGISTRY) would compute differently, or None:

    - layer kinds: layers_block_type makes layer i full attention iff (i + 1) % full_attention_interval == 0
      (configs/qwen3_next.py:259-268), which places the layers (models/qwen3_next.py:902); layer_types is taken and
      dropped (:218), and full_attention_interval has no default there (:183-258 never set it), so a config
      without it fails at start-up with AttributeError. transformers 5 writes layer_types alone;
    - every layer sparse: is_layer_sparse = True (models/qwen3_next.py:525, :695), so mlp_only_layers and
      decoder_sparse_step are ignored;
    - RoPE: the top-level rope_theta and partial_rotary_factor, defaults 10000.0 and 0.25 (configs/qwen3_next.py:
      198-200, :234-236; models/qwen3_next.py:631, :637); transformers 5 reads them from rope_parameters;
    - the gated attention output: attn_output_gate, default True (models/qwen3_next.py:640);
    - an output projection of its own: Qwen3NextForCausalLM never ties its output head to the embeddings
      (models/qwen3_next.py:1024-1031)."""
    layers = config.get("num_hidden_layers")
    interval = config.get("full_attention_interval")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        return (
            f"full_attention_interval {interval!r}: SGLang's Qwen3-Next places the full-attention layers by it alone "
            "and has no default for it (write it, as moerl's published config.json does)"
        )
    layer_types = config.get("layer_types")
    if layer_types is not None and isinstance(layers, int):
        placed = interval_layer_types(layers, interval)
        if list(layer_types) != placed:
            return (
                f"layer_types {list(layer_types)}: SGLang's Qwen3-Next reads full_attention_interval alone and "
                f"would place {placed}"
            )
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        return "dense layers (mlp_only_layers / decoder_sparse_step): SGLang's Qwen3-Next makes every layer sparse"
    rope_parameters = config.get("rope_parameters") or {}
    for name, default in QWEN3_NEXT_ROPE_DEFAULTS.items():
        read = config.get(name, default)
        if isinstance(rope_parameters, dict) and rope_parameters.get(name, read) != read:
            return (
                f"rope_parameters.{name} {rope_parameters[name]}: SGLang's Qwen3-Next reads the top-level {name} "
                f"({read}{'' if name in config else ', its default'})"
            )
    if config.get("attn_output_gate", True) is not True:
        return "attn_output_gate false: SGLang's Qwen3-Next reads it, transformers' always gates the attention output"
    if config.get("tie_word_embeddings"):
        return "tie_word_embeddings: SGLang's Qwen3-Next keeps an output projection of its own"
    return None


def qwen3_5_moe_mismatch(config: dict[str, Any]) -> str | None:
    """What SGLang 0.5.17's Qwen3.5-MoE (configs/qwen3_5.py, its Qwen3_5TextConfig a Qwen3NextConfig;
    models/qwen3_5.py) would compute differently from config.json's text_config as transformers 5.23 reads it, or
    None:

    - layer kinds: placed by text_config.full_attention_interval alone, without a default, layer_types dropped (as
      Qwen3-Next's, configs/qwen3_next.py:218, :259-268; models/qwen3_5.py:1351);
    - RoPE: rope_theta from text_config.rope_parameters only (utils/hf_transformers/common.py:300-302; without it
      start-up fails with KeyError), partial_rotary_factor from text_config itself, default 0.25
      (models/qwen3_5.py:872, configs/qwen3_next.py:200), where transformers reads rope_parameters';
    - the gated attention output: attn_output_gate, default True (models/qwen3_5.py:879).
    Tied embeddings follow the top-level tie_word_embeddings (models/qwen3_vl.py:1253-1262), as in transformers."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return "no text_config: SGLang's Qwen3.5-MoE reads the language model's fields from it"
    layers, interval = text.get("num_hidden_layers"), text.get("full_attention_interval")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        return (
            f"text_config.full_attention_interval {interval!r}: SGLang's Qwen3.5-MoE places the full-attention layers "
            "by it alone and has no default for it (write the interval its layer_types follow)"
        )
    layer_types = text.get("layer_types")
    if layer_types is not None and isinstance(layers, int):
        placed = interval_layer_types(layers, interval)
        if list(layer_types) != placed:
            return (
                f"text_config.layer_types {list(layer_types)}: SGLang's Qwen3.5-MoE reads full_attention_interval "
                f"alone and would place {placed}"
            )
    rope = text.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return "text_config.rope_parameters without rope_theta: SGLang's Qwen3.5-MoE reads rope_theta from there only"
    factor = text.get("partial_rotary_factor", QWEN3_NEXT_ROPE_DEFAULTS["partial_rotary_factor"])
    if rope.get("partial_rotary_factor", factor) != factor:
        default = "" if "partial_rotary_factor" in text else ", its default"
        return (
            f"text_config.rope_parameters.partial_rotary_factor {rope['partial_rotary_factor']}: SGLang's Qwen3.5-MoE "
            f"reads text_config.partial_rotary_factor ({factor}{default})"
        )
    if text.get("attn_output_gate", True) is not True:
        return "attn_output_gate false: SGLang's Qwen3.5-MoE reads it, transformers' always gates the attention output"
    return None


# SGLang 0.5.17's Kimi-K2.5 tower (configs/kimi_k25.py:44ff KimiK25VisionConfig) reads transformers' names, with
# these defaults, never the release's vt_* keys (which the projector reads: models/kimi_k25.py:604, :615)
KIMI_K25_TOWER = {"hidden_size": ("vt_hidden_size", 1152), "num_hidden_layers": ("vt_num_hidden_layers", 27),
                  "num_attention_heads": ("vt_num_attention_heads", 16),
                  "intermediate_size": ("vt_intermediate_size", 4304)}  # fmt: skip


def kimi_k25_mismatch(config: dict[str, Any]) -> str | None:
    """What SGLang 0.5.17's Kimi-K2.5 (configs/kimi_k25.py, models/kimi_k25.py) would build differently from
    transformers 5.23's reading of config.json, or None:

    - tied embeddings: SGLang's language model (DeepseekV3ForCausalLM, deepseek_v2.py:2933) reads text_config's
      tie_word_embeddings (DeepseekV3Config's default false: configs/kimi_k25.py:143), transformers the top-level one
      (Kimi_K25Config's default true);
    - the tower: built from vision_config's hidden_size, num_hidden_layers, num_attention_heads, intermediate_size
      (defaults 1152, 27, 16, 4304), where the release writes vt_* (KIMI_K25_TOWER); a tower of other sizes is
      built full size and its weights fail to load; the projector's text_hidden_size defaults to 7168."""
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    top, own = bool(config.get("tie_word_embeddings", True)), bool(text.get("tie_word_embeddings", False))
    if top != own:
        return (
            f"tie_word_embeddings {top} at the top level but {own} in text_config: SGLang's Kimi-K2.5 ties by "
            "text_config's, transformers by the top-level one (write both)"
        )
    for key, (released, default) in KIMI_K25_TOWER.items():
        read = vision.get(key, default)
        meant = vision.get(released, vision.get(key, default))
        if read != meant:
            return (
                f"vision_config.{key} {read} (SGLang's reading; the tower has {meant}, {released}): SGLang would build "
                "another tower (write both keys)"
            )
    hidden, projected = text.get("hidden_size"), vision.get("text_hidden_size", 7168)
    if projected != hidden:
        return f"vision_config.text_hidden_size {projected}: SGLang's projector would not output text_config's {hidden}"
    return None


# Architectures whose SGLang 0.5.17 router records no routes per layer: their TopK is built without layer_id
# (layers/moe/topk.py TopK keeps layer_id None), which the capturer uses as the layer index
# (layers/moe/state_capturer/base.py capture: buffer[:batch, layer_id, :] = topk_ids), so None adds an axis: the
# write fails, or broadcasts one layer's ids over every layer's row.
NO_ROUTES_CAPTURE = {
    "MixtralForCausalLM": "models/mixtral.py MixtralMoE builds TopK(top_k, renormalize) without layer_id",
    "MiniMaxM2ForCausalLM": "models/minimax_m2.py MiniMaxM2MoE builds TopK(...) without layer_id",
}


def family_server_args(
    config: dict[str, Any], moe_a2a_backend: str = "none", sm: int | None = None, record_routes: bool = False
) -> dict[str, Any]:
    """The sglang.Engine kwargs a model family needs beyond moerl's common ones, for deterministic inference
    (enable_deterministic_inference=True, which moerl always sets), from its config.json dict; `sm` is the
    GPU's compute capability as major*10+minor (None: unknown, then an arch-independent choice), and
    moe_a2a_backend the rollout's. One MoerlError for a family SGLang 0.5.17 cannot serve so.

    Why (SGLang 0.5.17, python/sglang/srt/): ServerArgs.__post_init__ collects the per-architecture overrides
    (_handle_model_specific_adjustments) before _handle_deterministic_inference (server_args.py:3530-3536),
    whose _deterministic_attention_backend (arg_groups/overrides.py:1980) fills an unset attention_backend
    deterministically (sm90: fa3; sm100/sm120: triton for DeepSeek, flashinfer otherwise) but raises
    ValueError for one already set outside DETERMINISTIC_ATTENTION_BACKEND_CHOICES. On sm100 two families
    arrive with one set: DeepseekV3ForCausalLM (and Kimi-K2) gets trtllm_mla (overrides.py:639
    _deepseek_family_overrides) and GptOssForCausalLM gets trtllm_mha (overrides.py:880 _gpt_oss_overrides),
    so both would fail to start. Off Hopper they are given "triton": deterministic, allowed for MLA models
    (server_args.py:7849-7855 requires RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND there) and among the
    backends with attention sinks that gpt-oss asserts (server_args.py:5334). On Hopper SGLang's own choice
    (fa3) is already deterministic, so nothing is added. Qwen3-MoE, Qwen2-MoE, GLM-4-MoE and Mixtral get a
    deterministic default everywhere (fa3 or flashinfer). The MoE runner is pinned to triton where SGLang
    would pick flashinfer_trtllm on sm100 (TRTLLM_MOE_ON_SM100), with moe_a2a_backend "none" only (under
    DeepEP SGLang picks no trtllm runner). Mixtral and gpt-oss have no DeepEP path (NO_DEEPEP_PATH). record_routes
    (rollout.record_routes): refused where SGLang records none per layer (NO_ROUTES_CAPTURE).
    Qwen3-Next and Qwen3.5-MoE get QWEN3_NEXT_SERVER_ARGS on every GPU (triton attention, no radix cache: see there),
    and are refused where SGLang would serve another model (qwen3_next_mismatch, qwen3_5_moe_mismatch)."""
    arch = sglang_architecture(config)
    kwargs: dict[str, Any] = {}
    dsa = dsa_refusal(config)
    if dsa is not None:
        raise MoerlError(f"rollout.engine 'sglang': {dsa}; set rollout.engine: torch")
    mismatch = sglang_model_mismatch(config)
    if mismatch is not None:
        raise MoerlError(
            f"rollout.engine 'sglang': SGLang 0.5.17 would serve another model than this {arch} checkpoint "
            f"({mismatch}); set rollout.engine: torch, or start from a checkpoint without it"
        )
    if moe_a2a_backend == "deepep" and arch in NO_DEEPEP_PATH:
        raise MoerlError(
            f"rollout.sglang.moe_a2a_backend 'deepep': SGLang 0.5.17 cannot serve {arch} "
            f"(model_type {config.get('model_type')!r}) over DeepEP ({NO_DEEPEP_PATH[arch]}); set "
            "rollout.sglang.moe_a2a_backend: none (SGLang's own expert parallelism over ep_size)"
        )
    if record_routes and arch in NO_ROUTES_CAPTURE:
        raise MoerlError(
            f"rollout.record_routes / trainer.routing_replay: SGLang 0.5.17 records no per-layer routes for {arch} "
            f"({NO_ROUTES_CAPTURE[arch]}, so its routed-experts capture fails or repeats one layer's experts); set "
            "rollout.record_routes: false and trainer.routing_replay: none, or rollout.engine: torch"
        )
    hopper = sm == HOPPER_SM
    # Kimi-K2.5's language model is DeepSeek-V3's, and it gets DeepSeek's sm100 override (overrides.py:554, :639)
    mla_or_sinks = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "KimiK25ForConditionalGeneration",
                    "GptOssForCausalLM")
    if arch in mla_or_sinks and not hopper:
        kwargs["attention_backend"] = "triton"
    if arch in TRTLLM_MOE_ON_SM100 and moe_a2a_backend == "none" and not hopper:
        kwargs["moe_runner_backend"] = "triton"
    if arch in ("Qwen3NextForCausalLM", "Qwen3_5MoeForConditionalGeneration"):
        kwargs.update(QWEN3_NEXT_SERVER_ARGS)
    return kwargs


def _device_sm() -> int | None:
    """This process's GPU compute capability as major*10+minor, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def sglang_unavailable_reason() -> str | None:
    """Why the SGLang engine cannot run here (for skips and error messages), or None when it can."""
    if importlib.util.find_spec("sglang") is None:
        return "SGLang not installed (pip install 'sglang>=0.5.17' in the GPU rollout image)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU (the SGLang engine needs one)"
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


SGLANG_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
                 "half": "float16"}  # fmt: skip


def checkpoint_dtype(model_dir: str | os.PathLike) -> str:
    """SGLang's `dtype` for a checkpoint: the dtype its config.json records (float32 when it records none)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise MoerlError(f"{path}: cannot read the checkpoint's config ({err}); republish the checkpoint") from err
    recorded = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(recorded).removeprefix("torch.")
    if name not in SGLANG_DTYPES:
        raise MoerlError(
            f"{path}: dtype {recorded!r} is not one SGLang serves; publish the checkpoint in "
            "bfloat16, float16 or float32"
        )
    return SGLANG_DTYPES[name]


def read_config(model_dir: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """The dir's config.json as a dict, and its path (for errors)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise MoerlError(f"{path}: cannot read the checkpoint's config ({err}); republish the checkpoint") from err
    if not isinstance(config, dict):
        raise MoerlError(f"{path}: not a JSON object; republish the checkpoint")
    return config, str(path)


def same_model(started: tuple[dict[str, Any], str], model_dir: str | os.PathLike) -> bool:
    """Whether model_dir's config.json describes the model the engine started with (`started`: read_config of
    its dir): the same shape and computation (steps/models/hf_checkpoint.py model_architecture), compared normalised,
    so a config in transformers' older layout (top-level rope_theta, torch_dtype) and one in the newer
    (rope_parameters, dtype) of the same model are the same model. The dtype is compared on its own
    (checkpoint_dtype)."""
    from steps.models.hf_checkpoint import model_architecture  # lazy: torch, only once an update comes

    return model_architecture(*started) == model_architecture(*read_config(model_dir))


def take_back_sigterm(engine: Any) -> None:
    """Create SGLang's request loop now, on the engine's own loop, and take SIGTERM back from it (module
    docstring, "SIGTERM")."""
    ours = signal.getsignal(signal.SIGTERM)
    manager = engine.tokenizer_manager

    async def create_handle_loop() -> None:  # inside Engine.loop, so get_or_create_event_loop returns it
        manager.auto_create_handle_loop()

    engine.loop.run_until_complete(create_handle_loop())
    if manager.event_loop is not engine.loop:
        raise MoerlError("SGLang's request loop is not its engine's loop; use SGLang 0.5.17 (images/versions.env)")
    manager.event_loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, ours if ours is not None else signal.SIG_DFL)


def sampling_params_for(request: GenerationRequest, params: SamplingParams) -> dict[str, Any]:
    """SGLang's per-request sampling_params for one of our requests."""
    return {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k else -1,
        "max_new_tokens": int(params.max_new_tokens),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": not params.stop_token_ids,  # no stop tokens: do not stop at the model's EOS either
        "no_stop_trim": True,
        "skip_special_tokens": False,
        "sampling_seed": int(request.seed % SGLANG_SEED_MODULUS),
    }


def generation_from_output(
    request: GenerationRequest, output: dict[str, Any], routes: RoutesLayout | None = None
) -> Generation:
    """Our Generation from one SGLang output dict (token ids and log-probs from output_token_logprobs; with
    `routes`, the routed experts from meta_info["routed_experts"])."""
    meta = output.get("meta_info", {})
    finish = (meta.get("finish_reason") or {}).get("type")
    if finish not in (FINISH_STOP, FINISH_LENGTH):
        raise MoerlError(
            f"SGLang did not finish prompt {request.prompt_id} sample {request.sample_index} "
            f"(finish_reason {meta.get('finish_reason')!r}); check the rollout pod's SGLang log"
        )
    entries = meta.get("output_token_logprobs") or []
    tokens = [int(entry[1]) for entry in entries]
    logprobs = [float(entry[0]) for entry in entries]
    if "output_ids" in output and list(output["output_ids"]) != tokens:
        raise MoerlError(
            f"SGLang returned {len(output['output_ids'])} output ids but {len(tokens)} token log-probs for prompt "
            f"{request.prompt_id}; use SGLang {'.'.join(map(str, MIN_SGLANG_VERSION))} or newer"
        )
    routed = None
    if routes is not None:
        where = f"prompt {request.prompt_id} sample {request.sample_index}"
        if not isinstance(meta.get("routed_experts"), str):
            raise MoerlError(
                f"{where}: SGLang returned no routed experts; the engine must start with "
                "enable_return_routed_experts (SGLangSettings.record_routes)"
            )
        routed = routes.routes(meta["routed_experts"], len(request.prompt_ids) + len(tokens) - 1, where)
    return Generation(request.prompt_id, request.sample_index, tokens, logprobs, finish, routed)


def _aborted(output: dict[str, Any]) -> bool:
    return ((output.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "abort"


class _StopWatch:
    """Polls should_stop on SGLang's engine loop while a batch runs there, and aborts every request in flight
    once it says stop. SGLang 0.5.17's abort is TokenizerManager.abort_request(rid: str = "", abort_all: bool =
    False) (srt/managers/tokenizer_manager.py; its Engine has none of its own): abort_all marks every request
    aborted and sends AbortReq to the scheduler (Scheduler.abort_request), which ends them with FINISH_ABORT.
    A callback of the loop, so it never runs in the middle of SGLang's own code, as a signal handler could."""

    def __init__(self, engine: Any, should_stop: Callable[[], bool]) -> None:
        self.engine = engine
        self.should_stop = should_stop
        self.aborted = False
        self.handle = engine.loop.call_later(STOP_POLL_S, self.poll)

    def poll(self) -> None:
        if self.should_stop():
            self.engine.tokenizer_manager.abort_request(abort_all=True)
            self.aborted = True
            return
        self.handle = self.engine.loop.call_later(STOP_POLL_S, self.poll)

    def cancel(self) -> None:
        self.handle.cancel()


class SGLangEngine:
    """sglang.Engine over one checkpoint dir, in this process (offline: no HTTP server)."""

    name = "sglang"

    def __init__(self, model_dir: str | os.PathLike, settings: SGLangSettings) -> None:
        reason = sglang_unavailable_reason()
        if reason is not None:
            raise MoerlError(f"rollout.engine 'sglang': {reason}; or set rollout.engine: torch")
        # Read by SGLang's scheduler processes at start-up: log-probs before temperature (see module docstring).
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
        import sglang

        version = getattr(sglang, "__version__", "0")
        if _version_tuple(version) < MIN_SGLANG_VERSION:
            raise MoerlError(
                f"SGLang {version} is too old; moerl needs {'.'.join(map(str, MIN_SGLANG_VERSION))} or newer"
            )
        kwargs: dict[str, Any] = {
            "model_path": str(model_dir),
            "dtype": checkpoint_dtype(model_dir),
            "skip_tokenizer_init": True,
            "tp_size": settings.tp_size,
            "ep_size": settings.ep_size,
            "mem_fraction_static": settings.mem_fraction,
            "enable_deterministic_inference": settings.deterministic,
            "random_seed": settings.random_seed,
            "log_level": "error",
        }
        if settings.moe_a2a_backend != "none":
            kwargs["moe_a2a_backend"] = settings.moe_a2a_backend
        started_config = read_config(model_dir)
        self.routes = RoutesLayout.of(*started_config) if settings.record_routes else None
        if self.routes is not None:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(
            family_server_args(started_config[0], settings.moe_a2a_backend, _device_sm(), settings.record_routes)
        )
        self.dtype = kwargs["dtype"]
        self.started_config = started_config  # what SGLang read at start-up, once
        self.broken: str | None = None  # why the weights are unknown after a failed in-place update
        self.engine = sglang.Engine(**kwargs)
        take_back_sigterm(self.engine)

    def update_weights(self, model_dir: str | os.PathLike) -> None:
        """SGLang's in-place update from a checkpoint dir on local disk (module docstring, "In-place updates")."""
        if checkpoint_dtype(model_dir) != self.dtype or not same_model(self.started_config, model_dir):
            raise MoerlError(
                f"{model_dir}: another model or dtype than this SGLang engine serves (config.json); an in-place "
                "update takes another version of the same run — open a new engine for another model"
            )
        result = self.engine.update_weights_from_disk(model_path=str(model_dir))
        success, message = bool(result[0]), str(result[1])
        if not success:
            self.broken = f"SGLang could not load {model_dir} in place: {message}"
            raise MoerlError(f"{self.broken}; open a new engine on it (check the rollout pod's SGLang log)")
        self.broken = None

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        """One offline batch. SGLang schedules it internally on its engine loop, so should_stop is polled on
        that loop every STOP_POLL_S while the batch runs; once it returns True, every request in flight is
        aborted (TokenizerManager.abort_request(abort_all=True)) and GenerationInterrupted is raised
        (module docstring, "SIGTERM")."""
        if not requests:
            return []
        if self.broken is not None:
            raise MoerlError(f"{self.broken}: its weights are no version's; open a new engine")
        if should_stop is not None and should_stop():
            raise GenerationInterrupted("stopped before the batch started")
        watch = _StopWatch(self.engine, should_stop) if should_stop is not None else None
        try:
            outputs = self.engine.generate(
                input_ids=[list(r.prompt_ids) for r in requests],
                sampling_params=[sampling_params_for(r, params) for r in requests],
                return_logprob=True,
                return_routed_experts=self.routes is not None,
            )
        except Exception as err:
            if watch is not None and watch.aborted:  # aborted before it reached the scheduler: RequestAbortedError
                raise GenerationInterrupted(f"stopped: SGLang aborted the batch ({err})") from err
            raise
        finally:
            if watch is not None:
                watch.cancel()
        if isinstance(outputs, dict):
            outputs = [outputs]
        if len(outputs) != len(requests):
            raise MoerlError(f"SGLang returned {len(outputs)} outputs for {len(requests)} requests")
        if watch is not None and watch.aborted and any(_aborted(o) for o in outputs):
            raise GenerationInterrupted("stopped: SGLang aborted the batch in flight")
        return [generation_from_output(r, o, self.routes) for r, o in zip(requests, outputs, strict=True)]

    def close(self) -> None:
        self.engine.shutdown()
