"""The policy model: a Qwen3-MoE decoder in plain PyTorch, matching transformers' Qwen3MoeForCausalLM.

Read top to bottom: config (MoeConfig, under config.json's names), building blocks (RMSNorm, RoPE, attention),
the decoder and the causal LM (training and scoring; the rollout engine decodes with its own prefill and
key/value tree, steps/engines/torch_engine.py). The MoE block and its experts are in steps/models/moe.py, the
hand-written autograd
Functions the blocks call in steps/models/kernels.py, and reading and writing checkpoints in Hugging Face format
(config.json + safetensors) in steps/models/hf_checkpoint.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from steps.errors import MoerlError
from steps.models.kernels import QKVHeads, grouped_attention, rms_norm
from steps.models.moe import Expert, MoeBlock

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement

# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------


SUPPORTED_ARCHITECTURES = "Qwen3-MoE (model_type 'qwen3_moe', Qwen3MoeForCausalLM with num_experts > 0)"
# MoE families users bring that moerl recognises and refuses by name (steps/models/transformer.py implements
# Qwen3-MoE only).
OTHER_MOE_ARCHITECTURES = {
    "mixtral": "Mixtral", "qwen2_moe": "Qwen2-MoE", "deepseek_v3": "DeepSeek-V3", "deepseek_v2": "DeepSeek-V2",
    "olmoe": "OLMoE", "qwen3_next": "Qwen3-Next", "gpt_oss": "gpt-oss", "glm4_moe": "GLM-4-MoE",
}


@dataclass
class MoeConfig:
    """Qwen3-MoE hyper-parameters, under the names config.json uses (Qwen3MoeConfig)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # the dense MLP of layers that are not sparse; 0 when every layer is MoE
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads, as transformers does
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.mlp_only_layers, tuple):
            self.mlp_only_layers = list(self.mlp_only_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """As Qwen3MoeDecoderLayer: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def to_hf_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers (v4 and v5) and SGLang load as Qwen3MoeForCausalLM, for
        weights stored in `dtype` (SGLang's and transformers' dtype auto serve the weights in it)."""
        name = dtype_name(dtype)
        d: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
        d.update(dataclasses.asdict(self))
        d.update(
            {
                "hidden_act": "silu",
                "attention_dropout": 0.0,
                "use_sliding_window": False,
                "sliding_window": None,
                "max_window_layers": self.num_hidden_layers,
                "rope_scaling": None,  # v4 readers (SGLang) read rope_theta + rope_scaling
                "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},  # v5 readers
                "use_cache": True,
                "output_router_logits": False,
                "dtype": name,
                "torch_dtype": name,
            }
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> MoeConfig:
        """Validate a Hugging Face config.json dict (`source` names it in errors) and build the config."""
        model_type = d.get("model_type")
        num_experts = d.get("num_experts", d.get("num_local_experts"))
        if model_type != "qwen3_moe" or not num_experts:
            if model_type in OTHER_MOE_ARCHITECTURES:
                what = f"{OTHER_MOE_ARCHITECTURES[model_type]} (model_type {model_type!r}) is a MoE architecture"
                why = "its router, shared experts or attention differ from Qwen3-MoE's and are not implemented"
            elif model_type != "qwen3_moe":
                what, why = f"model_type {model_type!r}", "dense and other architectures are not implemented"
            else:
                what, why = "no experts (num_experts 0)", "a dense Qwen3 has nothing for expert parallelism"
            raise MoerlError(
                f"{source}: {what}, architectures {d.get('architectures')}: not supported ({why}); moerl "
                f"supports: {SUPPORTED_ARCHITECTURES}"
            )

        def unsupported(name: str, why: str) -> MoerlError:
            return MoerlError(f"{source}: {name} = {d.get(name)!r} is not supported by moerl ({why})")

        if d.get("quantization_config"):
            raise unsupported("quantization_config", "use an unquantized F32/BF16/F16 checkpoint")
        rope_scaling = d.get("rope_scaling")
        if rope_scaling and _rope_type(rope_scaling) != "default":
            raise unsupported("rope_scaling", "only default RoPE; set it to null")
        rope_parameters = d.get("rope_parameters") or {}
        if rope_parameters and _rope_type(rope_parameters) != "default":
            raise MoerlError(
                f"{source}: rope_parameters.rope_type {_rope_type(rope_parameters)!r} is not supported "
                "by moerl (only default RoPE)"
            )
        if d.get("use_sliding_window"):
            raise unsupported("use_sliding_window", "sliding-window attention is not implemented")
        if d.get("hidden_act", "silu") != "silu":
            raise unsupported("hidden_act", "Qwen3-MoE experts use silu")
        if d.get("attention_dropout", 0.0):
            raise unsupported("attention_dropout", "set it to 0.0")

        required = [
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts_per_tok", "moe_intermediate_size",
        ]  # fmt: skip
        missing = [name for name in required if d.get(name) is None]
        if missing:
            raise MoerlError(f"{source}: missing required Qwen3-MoE fields {missing}; fix config.json")

        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        kwargs["num_experts"] = num_experts
        kwargs["rope_theta"] = d.get("rope_theta") or rope_parameters.get("rope_theta") or 10000.0
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs[name] = d.get(name)
        cfg = cls(**kwargs)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Check that the sizes are consistent; raise MoerlError naming the field otherwise."""

        def bad(msg: str) -> MoerlError:
            return MoerlError(f"{source}: {msg}; fix config.json")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "head_dim", "decoder_sparse_step"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(f"{name} = {value!r} must be a positive integer")
        if self.num_experts_per_tok > self.num_experts:
            raise bad(
                f"num_experts_per_tok = {self.num_experts_per_tok} exceeds num_experts = {self.num_experts}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                f"num_attention_heads = {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads = {self.num_key_value_heads}"
            )
        assert self.head_dim is not None
        if self.head_dim % 2:
            raise bad(f"head_dim = {self.head_dim} must be even for rotary embeddings")
        if not isinstance(self.mlp_only_layers, list):
            raise bad(f"mlp_only_layers = {self.mlp_only_layers!r} must be a list of layer indices")
        layers = range(self.num_hidden_layers)
        bad_layers = [i for i in self.mlp_only_layers if not (isinstance(i, int) and i in layers)]
        if bad_layers:
            raise bad(f"mlp_only_layers {bad_layers} outside [0, num_hidden_layers={self.num_hidden_layers})")
        dense = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense and self.intermediate_size < 1:
            raise bad(
                f"layers {dense} are dense (mlp_only_layers / decoder_sparse_step) but "
                f"intermediate_size = {self.intermediate_size}"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise bad(f"{name} = {value!r} must be a number > 0")
        for name in ("norm_topk_prob", "tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} = {getattr(self, name)!r} must be true or false")


def _rope_type(rope: object) -> str:
    if not isinstance(rope, dict):
        return repr(rope)
    return rope.get("rope_type", rope.get("type", "default"))


def dtype_name(dtype: torch.dtype) -> str:
    """config.json's name of a dtype: torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back before the weight (as Qwen3MoeRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> cos, sin [B, T, head_dim], computed in fp32 (both halves share the frequencies)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (before RoPE), as Qwen3MoeAttention."""

    def __init__(self, cfg: MoeConfig, layer_idx: int) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        return self.attend(q, k, v, mask)

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: tuple[torch.Tensor, torch.Tensor],
        response_rope: tuple[torch.Tensor, torch.Tensor],
        prompt_mask: torch.Tensor,
        response_mask: torch.Tensor,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts [G, P, H] attend among themselves; responses [R, T, H] attend to the k/v of their prompt
        (row prompt_index[r]) followed by their own. Masks as MoeForCausalLM.forward_shared_prompts builds them."""
        qp, kp, vp = self.project(prompt_x, *prompt_rope)
        qr, kr, vr = self.project(response_x, *response_rope)
        # index_select: each response reads its prompt's k/v; the backward sums the responses' gradients
        k = torch.cat([kp.index_select(0, prompt_index), kr], dim=2)
        v = torch.cat([vp.index_select(0, prompt_index), vr], dim=2)
        return self.attend(qp, kp, vp, prompt_mask), self.attend(qr, k, v, response_mask)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, heads, T, D], k and v [B, kv_heads, T, D], q and k normed and rotated."""
        # One matmul against [W_q; W_k; W_v] (the concatenation's backward hands each Parameter its rows).
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None
        return QKVHeads.apply(
            F.linear(x, weight, bias), self.q_norm.weight, self.k_norm.weight, cos, sin,
            self.num_heads, self.num_kv_heads, self.q_norm.eps,
        )  # fmt: skip

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked attention of q [B, heads, T, D] over k/v [B, kv_heads, S, D], then o_proj -> [B, T, H]."""
        batch, _, seq, _ = q.shape
        if q.device.type == "cpu":
            out = grouped_attention(q, k, v, mask, self.scaling)
        else:
            # Expand the kv heads to the query heads: with a mask, SDPA's GQA mode falls back to the math
            # kernel on CUDA, while expanded k/v run in the memory-efficient kernel.
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))


def moe_layer_indices(cfg: MoeConfig) -> list[int]:
    """The decoder layers that are MoE layers, in order (an ExpertPlacement's layer l is the l-th of them)."""
    return [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)]


def check_placement(cfg: MoeConfig, placement: ExpertPlacement | None, ep_rank: int) -> None:
    """A placement must describe this config's MoE layers and experts, and ep_rank be one of its ranks."""
    if placement is None:
        if ep_rank != 0:
            raise ValueError(f"ep_rank {ep_rank} without an expert placement")
        return
    num_moe = len(moe_layer_indices(cfg))
    if (placement.num_layers, placement.num_experts) != (num_moe, cfg.num_experts):
        raise ValueError(
            f"expert placement for {placement.num_layers} MoE layers x {placement.num_experts} experts, the "
            f"model has {num_moe} x {cfg.num_experts}"
        )
    if not 0 <= ep_rank < placement.ep_size:
        raise ValueError(f"ep_rank {ep_rank} is not in [0, {placement.ep_size})")


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: MoeConfig,
        layer_idx: int,
        placement: ExpertPlacement | None = None,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer_idx):
            slots, ep_size = None, 1
            if placement is not None:
                slots, ep_size = placement.slots[moe_layer_indices(cfg).index(layer_idx)], placement.ep_size
            self.mlp = MoeBlock(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                slots,
                ep_rank,
                ep_size,
            )
        else:
            self.mlp = Expert(cfg.hidden_size, cfg.intermediate_size)  # Qwen3MoeMLP: the same SwiGLU block
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: tuple[torch.Tensor, torch.Tensor],
        response_rope: tuple[torch.Tensor, torch.Tensor],
        prompt_mask: torch.Tensor,
        response_mask: torch.Tensor,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on prompts [G, P, H] and responses [R, T, H]: see Attention.forward_shared_prompts."""
        attn_prompt, attn_response = self.self_attn.forward_shared_prompts(
            self.input_layernorm(prompt_x), self.input_layernorm(response_x), prompt_rope, response_rope,
            prompt_mask, response_mask, prompt_index,
        )  # fmt: skip
        prompt_x, response_x = prompt_x + attn_prompt, response_x + attn_response
        # One MLP call over the prompt and the response tokens: an MoE layer routes and exchanges them in a
        # single dispatch, exactly once per layer as in forward (every EP rank must make the same calls).
        hidden = prompt_x.shape[-1]
        tokens = torch.cat([prompt_x.reshape(-1, hidden), response_x.reshape(-1, hidden)])
        out = self.mlp(self.post_attention_layernorm(tokens))
        num_prompt = prompt_x.shape[0] * prompt_x.shape[1]
        return prompt_x + out[:num_prompt].view_as(prompt_x), response_x + out[num_prompt:].view_as(response_x)


class MoeModel(nn.Module):
    """The decoder stack; its attribute names give the `model.` prefix of the checkpoint tensor names."""

    def __init__(self, cfg: MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(
            [DecoderLayer(cfg, layer, placement, ep_rank) for layer in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MoeForCausalLM(nn.Module):
    """Qwen3-MoE causal LM. state_dict() keys are the tensor names of a Hugging Face Qwen3-MoE checkpoint.

    placement (steps.models.placement.ExpertPlacement) and ep_rank build the model of one expert-parallel
    rank: in every MoE layer only the experts the placement gives that rank (placement.held(layer, ep_rank));
    their names keep the global index, so its state_dict is a subset of the full one. Without a placement
    the model holds every expert.
    """

    def __init__(self, config: MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__()
        config.validate()
        check_placement(config, placement, ep_rank)
        self.config = config
        self.placement = placement
        self.ep_rank = ep_rank
        self.model = MoeModel(config, placement, ep_rank)
        # Tied: logits use the embedding matrix and no lm_head.weight exists (save_pretrained omits it too).
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """As transformers: normal(0, initializer_range) for linear/embedding/router, ones for norms."""
        if self.model.norm.weight.is_meta:
            return  # built on the meta device to receive loaded weights: nothing to initialise
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, std)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
                if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def moe_blocks(self) -> list[MoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoeBlock)]

    def set_dispatch(self, dispatch: object) -> None:
        """Use `dispatch` (an ExpertDispatch) for the experts of every MoE layer."""
        for block in self.moe_blocks():
            block.dispatch = dispatch  # type: ignore[assignment]

    def count_routed_rows(self) -> None:
        """Start (or restart) counting, per MoE layer and global expert id, the (token, expert) rows this
        process's forward passes route (see routed_rows)."""
        for block in self.moe_blocks():
            block.routed_rows = torch.zeros(block.num_experts, dtype=torch.int64, device=block.gate.weight.device)

    def routed_rows(self) -> torch.Tensor:
        """[num MoE layers, num_experts] int64: the rows counted since count_routed_rows (this process's
        tokens only: sum over the ranks for the global loads)."""
        counts = [block.routed_rows for block in self.moe_blocks()]
        if any(c is None for c in counts):
            raise RuntimeError("routed_rows: call count_routed_rows() before the forward passes")
        return torch.stack(counts)  # type: ignore[arg-type]

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] in float32 (training and scoring: the rollout engine decodes
        with its own prefill and key/value tree, steps/engines/torch_engine.py).

        attention_mask [B, T] marks the real tokens (1) and the padding (0); prompts are left-padded, and
        positions count real tokens only.
        """
        batch, seq = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            new_valid = torch.ones(batch, seq, dtype=torch.bool, device=device)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {(batch, seq)}"
                )
            new_valid = attention_mask.to(torch.bool)

        # Left padding: a row's first real token gets position 0; padding gets 0 too (it is masked anyway).
        positions = (new_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        mask = attention_mask_for(new_valid, 0, seq)

        x = self.model.embed_tokens(input_ids)
        assert self.config.head_dim is not None
        cos, sin = rotary_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()

    def forward_shared_prompts(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        prompt_index: torch.Tensor,
    ) -> torch.Tensor:
        """Training forward for GRPO groups: each prompt runs once, its responses attend to its keys/values.

        prompt_ids, prompt_mask [G, P]: the distinct prompts, LEFT-padded (every row's last column is its last
        real token). response_ids, response_mask [R, T]: the tokens fed after the prompt, RIGHT-padded; for
        training these are each response without its last token (T may be 0). prompt_index [R]: the prompt
        row of each response.

        Returns logits [R, T + 1, V] (float32): slot 0 is the prompt's last position (it predicts the
        response's first token), slot t >= 1 is response position t - 1. For the same token sequences every
        logit, hence every log-prob and gradient, is the one `forward` computes over prompt + response: the
        same positions (a response continues after its prompt's real tokens), the same keys (the prompt's,
        then the response's own, causally), the same per-token norms, MLPs and experts. Prompt and response
        tokens go through each MoE layer in one call, so the expert dispatch is the same as forward's.
        """
        if prompt_ids.shape != prompt_mask.shape or response_ids.shape != response_mask.shape:
            raise ValueError("prompt_mask/response_mask must have the shapes of prompt_ids/response_ids")
        if prompt_index.shape != response_ids.shape[:1]:
            raise ValueError(f"prompt_index has shape {tuple(prompt_index.shape)}, expected ({response_ids.shape[0]},)")
        prompt_valid, response_valid = prompt_mask.to(torch.bool), response_mask.to(torch.bool)
        if not bool(prompt_valid[:, -1].all()):
            raise ValueError("forward_shared_prompts needs left-padded prompts (a real last token in every row)")
        prompt_index = prompt_index.to(device=prompt_ids.device, dtype=torch.long)
        prompt_len = prompt_ids.shape[1]
        response_len = response_ids.shape[1]

        # Positions as forward counts them: real tokens from 0; a response continues after its prompt.
        prompt_positions = (prompt_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        prompt_lengths = prompt_valid.long().sum(dim=1).index_select(0, prompt_index)
        response_positions = prompt_lengths[:, None] + (response_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        prompt_attn = attention_mask_for(prompt_valid, 0, prompt_len)  # [G, 1, P, P]
        # A response query sees its prompt's real tokens, then its own tokens causally ([R, 1, T, P + T]).
        sees_prompt = prompt_valid.index_select(0, prompt_index)[:, None, None, :]
        sees_prompt = sees_prompt.expand(-1, 1, response_len, prompt_len)
        response_attn = torch.cat([sees_prompt, attention_mask_for(response_valid, 0, response_len)], dim=-1)

        prompt_x = self.model.embed_tokens(prompt_ids)
        response_x = self.model.embed_tokens(response_ids)
        assert self.config.head_dim is not None
        prompt_rope = rotary_cos_sin(prompt_positions, self.config.head_dim, self.config.rope_theta, prompt_x.dtype)
        response_rope = rotary_cos_sin(
            response_positions, self.config.head_dim, self.config.rope_theta, response_x.dtype
        )
        for layer in self.model.layers:
            prompt_x, response_x = layer.forward_shared_prompts(
                prompt_x, response_x, prompt_rope, response_rope, prompt_attn, response_attn, prompt_index
            )
        # Only the prompts' last positions are needed from the prompts: norm and lm_head run per token.
        last = prompt_x[:, -1:].index_select(0, prompt_index)  # [R, 1, H]
        x = self.model.norm(torch.cat([last, response_x], dim=1))
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight).float()


def attention_mask_for(key_valid: torch.Tensor, start: int, seq: int) -> torch.Tensor:
    """Boolean SDPA mask [B, 1, seq, start+seq]: query i (slot start+i) sees the valid slots j <= start+i.

    Every query also sees its own slot, so a padding query never has an empty row (softmax of nothing gives
    NaN, and a NaN value, even at weight 0, would poison the real tokens that attend past it).
    """
    total = key_valid.shape[1]
    query_slot = torch.arange(start, start + seq, device=key_valid.device)[:, None]
    key_slot = torch.arange(total, device=key_valid.device)[None, :]
    causal = key_slot <= query_slot
    mask = (causal[None] & key_valid[:, None, :]) | (key_slot == query_slot)[None]
    return mask[:, None]


def count_parameters(model: MoeForCausalLM) -> tuple[int, int]:
    """(total, active per token) for the full model, even when `model` holds only a slice of the experts.

    Active = everything except the experts a token does not use: embeddings, attention, norms, routers,
    dense MLPs, lm_head and num_experts_per_tok experts per MoE layer (the usual "A3B" convention).
    """
    cfg = model.config
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    non_expert = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." not in name)
    num_moe_layers = len(model.moe_blocks())
    total = non_expert + num_moe_layers * cfg.num_experts * per_expert
    active = non_expert + num_moe_layers * cfg.num_experts_per_tok * per_expert
    return total, active
