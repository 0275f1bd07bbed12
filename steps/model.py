"""The policy model: a Qwen3-MoE decoder in plain PyTorch, matching transformers' Qwen3MoeForCausalLM.

Read top to bottom: config (MoeConfig), building blocks (RMSNorm, RoPE, attention, dense MLP), the decoder and
the causal LM (training and scoring; the rollout engine decodes with its own prefill and key/value tree,
steps/engine.py), then checkpoint I/O in Hugging Face format (config.json + safetensors,
per-expert tensor names exactly as `Qwen3MoeForCausalLM.save_pretrained` writes them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from steps.errors import MoerlError
from steps.moe import Expert, MoeBlock

if TYPE_CHECKING:
    from steps.expert_parallel import ExpertPlacement

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
META_BUILD_MIN_PARAMS = 50_000_000  # see load_pretrained
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
CONFIG_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------


SUPPORTED_ARCHITECTURES = "Qwen3-MoE (model_type 'qwen3_moe', Qwen3MoeForCausalLM with num_experts > 0)"
# MoE families users bring that moerl recognises and refuses by name (steps/model.py implements Qwen3-MoE only).
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
    def from_hf_dict(cls, d: dict[str, Any], source: str = CONFIG_NAME) -> MoeConfig:
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

    def validate(self, source: str = CONFIG_NAME) -> None:
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


def read_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """<directory>/config.json as a dict (not validated)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise MoerlError(
            f"{directory}: no {CONFIG_NAME}; a model checkpoint is a Hugging Face model directory "
            "(config.json + *.safetensors, as save_pretrained writes it)"
        )
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MoerlError(f"{path}: not valid JSON ({err}); fix or re-export the config") from err
    if not isinstance(d, dict):
        raise MoerlError(f"{path}: expected a JSON object; fix or re-export the config")
    return d


def load_config(directory: str | os.PathLike) -> MoeConfig:
    """Read and validate <directory>/config.json."""
    d = read_config_json(directory)
    return MoeConfig.from_hf_dict(d, source=str(Path(directory) / CONFIG_NAME))


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms are computed in: fp32 for fp32 and narrower inputs (as Qwen3MoeRMSNorm), fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _rms_normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x / rms(x) over the last dim, 1 / rms(x)), both in the compute dtype."""
    x32 = x.to(_compute_dtype(x.dtype))
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * rstd, rstd


def _rms_normalize_backward(
    grad: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """d/dx of normed = x * rstd(x), given the gradient of normed (all in the compute dtype):
    rstd * (grad - normed * mean(grad * normed)), written into `out` when given."""
    dot = (grad * normed).mean(-1, keepdim=True)
    return torch.addcmul(grad * rstd, normed, dot * rstd, value=-1, out=out)


class _RMSNormFunction(torch.autograd.Function):
    """weight * (x / rms(x)).to(x.dtype), with a hand-written backward: autograd's graph of the formula is
    about twenty small ops per norm, and the training step on the demo model is bound by their count."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        normed, rstd = _rms_normalize(x, eps)
        normed_x = normed.to(x.dtype)
        ctx.save_for_backward(normed, rstd, normed_x, weight)
        ctx.x_dtype = x.dtype
        return weight * normed_x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        normed, rstd, normed_x, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed_x).sum_to_size(weight.shape).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_normed = (grad * weight).to(ctx.x_dtype).to(normed.dtype)
            grad_x = _rms_normalize_backward(grad_normed, normed, rstd).to(ctx.x_dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim: computed in fp32, cast back to x's dtype before the weight."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps)
    # Inference (the rollout engine calls the norms token by token): the same ops, without a Function's cost.
    return weight * _rms_normalize(x, eps)[0].to(x.dtype)


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


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> None:
    """RoPE in Qwen3's rotate-half form, out = x * cos + sign * (-x2, x1) * sin for x = (x1, x2) halves,
    written half by half into `out` (any strides): no rotated copy of x. sign -1 gives the transpose (the
    backward of the rotation)."""
    half = x.shape[-1] // 2
    x1, x2, out1, out2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos[..., :half], out=out1)
    out1.addcmul_(x2, sin[..., :half], value=-sign)
    torch.mul(x2, cos[..., half:], out=out2)
    out2.addcmul_(x1, sin[..., half:], value=sign)


class _QKVHeads(torch.autograd.Function):
    """The fused q/k/v projection output [B, T, (heads + 2 kv_heads) * D] -> q [B, heads, T, D] and k, v
    [B, kv_heads, T, D] (contiguous): q and k per-head RMSNormed (q_weight, k_weight) then rotated (cos, sin
    [B, T, D]), v as is. One node with a hand-written backward instead of autograd's graph of two norms,
    two rotations (negations, concatenations) and the transposes; the same arithmetic as rms_norm then
    rotate-half RoPE, and the rotated heads are written straight into the [B, heads, T, D] layout attention
    wants."""

    @staticmethod
    def forward(
        ctx: Any,
        qkv: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        heads: int,
        kv_heads: int,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq, _ = qkv.shape
        dim = q_weight.shape[0]
        qk = qkv[..., : (heads + kv_heads) * dim].view(batch, seq, heads + kv_heads, dim)
        normed, rstd = _rms_normalize(qk, eps)
        normed_x = normed.to(qkv.dtype)
        weight = torch.cat([q_weight.expand(heads, dim), k_weight.expand(kv_heads, dim)])  # [heads + kv, D]
        y = weight * normed_x
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, T, 1, D]
        q = y.new_empty(batch, heads, seq, dim)
        k = y.new_empty(batch, kv_heads, seq, dim)
        _rotate_into(q.transpose(1, 2), y[:, :, :heads], cos, sin, 1)
        _rotate_into(k.transpose(1, 2), y[:, :, heads:], cos, sin, 1)
        v = qkv[..., (heads + kv_heads) * dim :].view(batch, seq, kv_heads, dim).transpose(1, 2).contiguous()
        ctx.save_for_backward(normed, rstd, normed_x, weight, cos, sin)
        ctx.heads, ctx.qkv_dtype = heads, qkv.dtype
        return q, k, v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        normed, rstd, normed_x, weight, cos, sin = ctx.saved_tensors
        heads = ctx.heads
        batch, seq, qk_heads, dim = normed.shape
        grad_y = grad_q.new_empty(batch, seq, qk_heads, dim)  # the gradient of weight * normed_x
        _rotate_into(grad_y[:, :, :heads], grad_q.transpose(1, 2), cos, sin, -1)
        _rotate_into(grad_y[:, :, heads:], grad_k.transpose(1, 2), cos, sin, -1)
        grad_q_weight = grad_k_weight = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            per_head = (grad_y * normed_x).sum((0, 1))  # [heads + kv, D]
            grad_q_weight = per_head[:heads].sum(0).to(weight.dtype)
            grad_k_weight = per_head[heads:].sum(0).to(weight.dtype)
        grad_normed = (grad_y * weight).to(ctx.qkv_dtype).to(normed.dtype)
        grad_qkv = grad_q.new_empty(batch, seq, (qk_heads + grad_v.shape[1]) * dim, dtype=ctx.qkv_dtype)
        grad_qk = grad_qkv[..., : qk_heads * dim].view(batch, seq, qk_heads, dim)
        if grad_qk.dtype == normed.dtype:
            _rms_normalize_backward(grad_normed, normed, rstd, out=grad_qk)
        else:
            grad_qk.copy_(_rms_normalize_backward(grad_normed, normed, rstd))
        grad_qkv[..., qk_heads * dim :].view(batch, seq, grad_v.shape[1], dim).copy_(grad_v.transpose(1, 2))
        return grad_qkv, grad_q_weight, grad_k_weight, None, None, None, None, None


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
        return _QKVHeads.apply(
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


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q [B, heads, T, D], k/v [B, kv_heads, S, D], mask [B, 1, T, S]
    (True: attend) -> [B, heads, T, D]; query head h reads kv head h // (heads / kv_heads), as SDPA with the
    kv heads repeated. The CPU path of Attention.attend: the queries of a kv head's group are one matrix
    against its keys, never expanded; at the demo's sizes (20 tokens, 24-dim heads) SDPA's CPU kernel took
    twice as long, forward and backward (bench/README.md, "update")."""
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return _GroupedAttention.apply(q, k, v, bias, scale)


class _GroupedAttention(torch.autograd.Function):
    """grouped_attention's arithmetic as one node: the scale and the mask bias go into the scores in one pass,
    and the backward folds the scale into its matrix products (autograd's graph adds a scaling pass, a bias
    pass and their backward nodes per layer)."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
    ) -> torch.Tensor:
        batch, heads, seq, dim = q.shape
        kv_heads, keys = k.shape[1], k.shape[2]
        groups = heads // kv_heads
        # The queries of a kv head's group are one [groups * seq, D] matrix against its keys.
        q3 = q.reshape(batch * kv_heads, groups * seq, dim)
        k3, v3 = k.reshape(batch * kv_heads, keys, dim), v.reshape(batch * kv_heads, keys, dim)
        scores = torch.bmm(q3, k3.transpose(1, 2))
        grouped = scores.view(batch, kv_heads, groups, seq, keys)
        torch.add(bias[:, :, None], grouped, alpha=scale, out=grouped)  # bias + scale * q k^T, in place
        weights = torch.softmax(scores, dim=-1)
        ctx.save_for_backward(q3, k3, v3, weights)
        ctx.scale, ctx.shapes = scale, (q.shape, k.shape, v.shape)
        return torch.bmm(weights, v3).view(batch, heads, seq, dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q3, k3, v3, weights = ctx.saved_tensors
        batch_heads, rows, dim = q3.shape
        grad3 = grad_out.reshape(batch_heads, rows, dim)
        grad_v = torch.bmm(weights.transpose(1, 2), grad3)
        grad_scores = torch._softmax_backward_data(torch.bmm(grad3, v3.transpose(1, 2)), weights, -1, weights.dtype)
        # beta=0 ignores the (uninitialised) input: scale * (grad_scores @ k), the scale inside the GEMM
        grad_q = torch.baddbmm(torch.empty_like(q3), grad_scores, k3, beta=0, alpha=ctx.scale)
        grad_k = torch.baddbmm(torch.empty_like(k3), grad_scores.transpose(1, 2), q3, beta=0, alpha=ctx.scale)
        q_shape, k_shape, v_shape = ctx.shapes
        return grad_q.view(q_shape), grad_k.view(k_shape), grad_v.view(v_shape), None, None


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

    placement (steps.expert_parallel.ExpertPlacement) and ep_rank build the model of one expert-parallel
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
        with its own prefill and key/value tree, steps/engine.py).

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


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets) under logits: logits [..., V], targets [...] -> [...] float32 (log_softmax in fp32)."""
    return _TokenLogprobs.apply(logits.float(), targets.unsqueeze(-1).long())


class _TokenLogprobs(torch.autograd.Function):
    """picked logit - logsumexp as one node: the backward is (one-hot - softmax) * grad, one softmax, one
    scaling and a scatter, where autograd's graph recomputes exp(logits - lse) and scatters into zeros."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        picked = logits.gather(-1, targets).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets = ctx.saved_tensors
        grad = grad.unsqueeze(-1)
        grad_logits = torch.softmax(logits, dim=-1).mul_(-grad)
        return grad_logits.scatter_add_(-1, targets, grad), None


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


# ----------------------------------------------------------------------------------------------------
# Checkpoints: Hugging Face format, safetensors only
# ----------------------------------------------------------------------------------------------------


def expected_tensor_shapes(
    cfg: MoeConfig, placement: ExpertPlacement | None = None, ep_rank: int = 0
) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of `cfg` holds -> shape; with a placement, only the experts EP rank
    ep_rank holds."""
    assert cfg.head_dim is not None
    h, d = cfg.hidden_size, cfg.head_dim
    moe_layers = moe_layer_indices(cfg)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, out_dim in (("q", cfg.num_attention_heads * d), ("k", cfg.num_key_value_heads * d),
                              ("v", cfg.num_key_value_heads * d)):  # fmt: skip
            shapes[p + f"self_attn.{proj}_proj.weight"] = (out_dim, h)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{proj}_proj.bias"] = (out_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * d)
        if cfg.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.is_moe_layer(layer):
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            held = range(cfg.num_experts) if placement is None else placement.held(moe_layers.index(layer), ep_rank)
            for e in sorted(held):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (cfg.moe_intermediate_size, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (cfg.moe_intermediate_size, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, cfg.moe_intermediate_size)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a checkpoint lives, read from the safetensors headers only."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code: F32, BF16, F16, ...


def _weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint dir, and the index's weight_map when it is sharded."""
    if not directory.is_dir():
        raise MoerlError(f"{directory}: checkpoint directory not found")
    single, index = directory / SAFE_WEIGHTS_NAME, directory / SAFE_WEIGHTS_INDEX_NAME
    if single.is_file():  # the same preference as transformers' from_pretrained
        return [single], None
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict):
            raise MoerlError(f"{index}: not a safetensors index (no 'weight_map' object); re-save it")
        files = sorted({directory / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise MoerlError(f"{index} names shard {f.name}, which is missing; copy the whole checkpoint")
        return files, weight_map
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_WEIGHT_SUFFIXES)
    if pickles:
        raise MoerlError(
            f"{directory} holds only pickle weights ({', '.join(pickles)}): moerl reads safetensors only; "
            'convert with `python -c "from transformers import AutoModelForCausalLM as M; '
            f"M.from_pretrained('{directory}').save_pretrained('OUT_DIR')\"` in an environment you trust "
            "(unpickling can run code), then use OUT_DIR"
        )
    raise MoerlError(
        f"{directory}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}; save the model with "
        "save_pretrained"
    )


def tensor_index(directory: str | os.PathLike) -> dict[str, TensorEntry]:
    """name -> TensorEntry for every tensor of the checkpoint in `directory` (reads headers only)."""
    directory = Path(directory)
    files, weight_map = _weight_files(directory)
    entries: dict[str, TensorEntry] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if weight_map is not None and weight_map.get(name) != path.name:
                        continue  # the index is authoritative, as in transformers
                    info = f.get_slice(name)
                    entries[name] = TensorEntry(path, tuple(info.get_shape()), info.get_dtype())
        except (SafetensorError, OSError) as err:
            raise MoerlError(f"{path}: not a readable safetensors file ({err}); re-save it") from err
    if weight_map is not None:
        for name, file_name in weight_map.items():
            if name not in entries:
                raise MoerlError(
                    f"{directory / SAFE_WEIGHTS_INDEX_NAME} maps tensor {name} to {file_name}, which does "
                    "not hold it; re-save the checkpoint"
                )
    return entries


def _check_float(name: str, entry: TensorEntry) -> None:
    if entry.dtype not in _SAFETENSORS_DTYPES:
        raise MoerlError(
            f"{entry.file}: tensor {name} has dtype {entry.dtype}; moerl loads F32, BF16 or F16 weights "
            "(dequantize the checkpoint first)"
        )


def check_tensors(cfg: MoeConfig, entries: dict[str, TensorEntry], directory: str | os.PathLike) -> None:
    """Every expected tensor present with the config's shape and a float dtype; nothing unexpected."""
    expected = expected_tensor_shapes(cfg)
    for name, shape in expected.items():
        entry = entries.get(name)
        if entry is None:
            raise MoerlError(
                f"{directory}: tensor {name} is missing (expected shape {list(shape)} from config.json); "
                "the weights do not match config.json: re-export the checkpoint"
            )
        if entry.shape != shape:
            raise MoerlError(
                f"{entry.file}: tensor {name} has shape {list(entry.shape)}, expected {list(shape)} from "
                "config.json; the weights do not match config.json: re-export the checkpoint"
            )
        _check_float(name, entry)
    unexpected = sorted(set(entries) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise MoerlError(
            f"{entries[name].file}: unexpected tensor {name} ({len(unexpected)} unexpected in all) for a "
            "Qwen3-MoE model of this config.json; remove it or fix config.json"
        )


def declared_dtype(config: dict[str, Any], source: str) -> torch.dtype | None:
    """The weights' dtype that a config.json dict declares (transformers v5 writes `dtype`, v4 `torch_dtype`;
    moerl writes both), or None when it declares none. `source` names the file in errors."""
    declared = {key: config[key] for key in ("dtype", "torch_dtype") if config.get(key) is not None}
    for key, value in declared.items():
        if value not in CONFIG_DTYPES:
            raise MoerlError(
                f"{source}: {key} = {value!r} is not supported; moerl trains float32, bfloat16 or float16 "
                "checkpoints — save the model in one of them (model.to(torch.bfloat16).save_pretrained(dir))"
            )
    if len(set(declared.values())) > 1:
        raise MoerlError(
            f"{source}: dtype = {declared['dtype']!r} but torch_dtype = {declared['torch_dtype']!r}; they "
            "must agree — set both to the dtype the weights are stored in"
        )
    return CONFIG_DTYPES[next(iter(declared.values()))] if declared else None


def weights_dtype(config: dict[str, Any], entries: dict[str, TensorEntry], source: str) -> torch.dtype:
    """The one dtype every tensor is stored in, which config.json's dtype (when declared) must name.

    A checkpoint is trained and published in one dtype (published versions keep the SFT checkpoint's):
    mixed dtypes, or a config.json that says another dtype than the weights have, are refused, because
    loaders that follow config.json (transformers' dtype="auto", SGLang's dtype auto) would cast them."""
    stored: dict[str, list[str]] = {}
    for name, entry in sorted(entries.items()):
        _check_float(name, entry)
        stored.setdefault(entry.dtype, []).append(name)
    if not stored:
        raise MoerlError(f"{source}: the checkpoint holds no tensors; re-export it with save_pretrained")
    if len(stored) > 1:
        counts = ", ".join(
            f"{code}: {len(names)} tensor{'s' if len(names) > 1 else ''} (e.g. {names[0]})"
            for code, names in sorted(stored.items())
        )
        raise MoerlError(
            f"{source}: the weights are stored in several dtypes ({counts}); moerl trains and publishes one "
            "dtype — save the model in one (model.to(torch.bfloat16).save_pretrained(dir))"
        )
    dtype = _SAFETENSORS_DTYPES[next(iter(stored))]
    declared = declared_dtype(config, f"{source}/{CONFIG_NAME}")
    if declared is not None and declared != dtype:
        raise MoerlError(
            f"{source}/{CONFIG_NAME}: declares dtype {dtype_name(declared)} but the weights are stored as "
            f"{dtype_name(dtype)}; set dtype and torch_dtype in config.json to {dtype_name(dtype)!r}"
        )
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """config.json's name of a dtype: torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(directory: str | os.PathLike) -> torch.dtype:
    """The dtype a checkpoint's weights are stored in (see weights_dtype); reads config.json and headers only."""
    return weights_dtype(read_config_json(directory), tensor_index(directory), str(directory))


def _checked(directory: str | os.PathLike) -> tuple[MoeConfig, dict[str, TensorEntry], torch.dtype]:
    """(config, tensor index, stored dtype) of a checkpoint whose config and tensor headers all check out."""
    cfg = load_config(directory)
    entries = tensor_index(directory)
    check_tensors(cfg, entries, directory)
    return cfg, entries, weights_dtype(read_config_json(directory), entries, str(directory))


def check_checkpoint(directory: str | os.PathLike) -> MoeConfig:
    """Validate config.json (its dtype included) and every tensor header of a checkpoint without reading
    the weights."""
    return _checked(directory)[0]


def load_state_dict_from_dir(
    directory: str | os.PathLike, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """Read the checkpoint's tensors (all, or only `names`) from its safetensors file(s), as stored."""
    entries = tensor_index(directory)
    wanted = list(entries) if names is None else list(names)
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name not in entries:
            raise MoerlError(f"{directory}: tensor {name} is missing; re-export the checkpoint")
        by_file.setdefault(entries[name].file, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, file_names in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in file_names:
                state[name] = f.get_tensor(name)
    return state


def load_pretrained(
    directory: str | os.PathLike,
    dtype: torch.dtype | None = torch.float32,
    device: torch.device | str = "cpu",
    placement: ExpertPlacement | None = None,
    ep_rank: int = 0,
) -> MoeForCausalLM:
    """Build a MoeForCausalLM from a Hugging Face Qwen3-MoE checkpoint directory (safetensors only), its
    weights cast to `dtype` (None: the dtype they are stored in; an upcast to float32 is exact).

    The whole checkpoint is validated first (config, every tensor's presence, shape and dtype, one dtype
    that config.json agrees with, nothing extra); with a placement only the experts EP rank ep_rank holds
    are then read from disk (by name, from whichever files hold them).
    """
    cfg, _, stored = _checked(directory)
    check_placement(cfg, placement, ep_rank)
    wanted = expected_tensor_shapes(cfg, placement, ep_rank)
    state = load_state_dict_from_dir(directory, wanted)
    # Always a copy into torch's own (64-byte aligned) memory: a tensor as safetensors hands it over may sit at
    # any offset, and CPU kernels round differently on unaligned data, so the same weights would train other bits.
    state = {name: t.to(device=device, dtype=dtype or stored, copy=True) for name, t in state.items()}
    # The meta device skips allocating and initialising weights that are about to be replaced, but its
    # first use imports torch's reference ops (~2 s per process); a small model is cheaper to build plainly.
    numel = sum(t.numel() for t in state.values())
    with torch.device("meta") if numel > META_BUILD_MIN_PARAMS else contextlib.nullcontext():
        model = MoeForCausalLM(cfg, placement, ep_rank)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_pretrained(
    model: MoeForCausalLM, directory: str | os.PathLike, max_shard_bytes: int | None = None
) -> list[Path]:
    """Write config.json, generation_config.json and the weights (model.safetensors, or
    model-0000i-of-0000n.safetensors + model.safetensors.index.json above max_shard_bytes). Each file is
    written to a temporary name and renamed into place. Returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    written: list[Path] = []

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size

    if len(shards) == 1:
        written.append(_atomic_save(shards[0], directory / SAFE_WEIGHTS_NAME))
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            written.append(_atomic_save(shard, directory / file_name))
            weight_map.update(dict.fromkeys(shard, file_name))
        index = {
            "metadata": {
                "total_size": sum(t.numel() * t.element_size() for t in state.values()),
                "total_parameters": sum(t.numel() for t in state.values()),
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        written.append(_atomic_write_text(directory / SAFE_WEIGHTS_INDEX_NAME, json.dumps(index, indent=2)))

    cfg = model.config
    written.append(_atomic_write_text(directory / CONFIG_NAME, json.dumps(cfg.to_hf_dict(dtype), indent=2)))
    generation: dict[str, Any] = {"_from_model_config": True}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, name) is not None:
            generation[name] = getattr(cfg, name)
    written.append(_atomic_write_text(directory / GENERATION_CONFIG_NAME, json.dumps(generation, indent=2)))

    # Stale weight files of an earlier save would confuse loaders (a single file wins over an index).
    keep = {p.name for p in written}
    for stale in directory.glob("model*.safetensors*"):
        if stale.name not in keep:
            stale.unlink()
    return written


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def _atomic_write_text(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path
