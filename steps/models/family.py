"""What a model family is: the spec each family folder (steps/models/<family>/spec.py) fills in and the registry
(steps/models/registry.py) maps config.json's `model_type` to, in the manner of torchtitan's `ModelSpec`.

A family brings its config class (config.json's names, its checks), its model builder (the layers, which use the
shared components: the MoE block and its router kind, an attention kind, the kernels), its state-dict adapter (the
one place its Hugging Face tensor names are written) and its decode (what the torch engine's decoder reads of a
built model). Everything else (loading and saving checkpoints, the trainer, expert parallelism, the engines) asks
the family through this spec and never spells a family's names.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement

# How a family's layers attend, and how its MoE layers route. The spec names them so that the torch engine picks
# the decoder of the kind (and refuses a kind it has none for), and so that gated DeltaNet linear attention or
# DeepSeek sparse attention come as new kinds beside these, each a shared component used by every family that has
# it. Softmax attention over a key/value cache covers GQA with or without q/k norms, partial rotary, and multi-head
# latent attention (its keys and values materialised per head; keys wider than values).
# recurrent_state: some layers keep a state per row instead of a key/value cache (gated DeltaNet's conv window and
# recurrent matrix, Qwen3-Next and Qwen3.5-MoE, beside softmax layers): the family decodes its own layers through a
# StatefulDecode, and the torch engine drives it row by row (steps/engines/state_decoder.py).
# indexed_kv_cache: DeepSeek sparse attention (DeepSeek-V3.2): each query attends to the keys a lightning indexer
# selects among the cached ones (steps/models/dsa.py), decoded through a StatefulDecode as recurrent_state is.
# compressed_kv_cache: DeepSeek-V4's attention (steps/models/compressed_attention.py): a sliding window of one shared
# key=value head plus entries that each pool a window of tokens (some layers' chosen by an indexer), and
# hyper-connections; decoded through a StatefulDecode holding each row's keys and the compressors' inputs.
AttentionKind = Literal["softmax_kv_cache", "recurrent_state", "indexed_kv_cache", "compressed_kv_cache"]
# The kinds whose family decodes its own layers (a StatefulDecode), driven by steps/engines/state_decoder.py
STATEFUL_ATTENTION: tuple[str, ...] = ("recurrent_state", "indexed_kv_cache", "compressed_kv_cache")
# softmax_topk: softmax over all experts in fp32, top-k, optional renormalisation (Qwen3-MoE, Qwen2-MoE, Mixtral);
# sigmoid_group_topk: sigmoid scores, a selection-only correction bias, group-limited top-k (DeepSeek-V3, GLM-4.5);
# topk_softmax: a router with a bias, top-k of its logits, softmax over the k chosen (gpt-oss);
# sqrtsoftplus_topk: sqrt(softplus) scores, a selection-only correction bias, top-k (DeepSeek-V4; its first layers
# choose by a fixed token-to-experts table instead)
RouterKind = Literal["softmax_topk", "sigmoid_group_topk", "topk_softmax", "sqrtsoftplus_topk"]


# Modules whose parameters every family that has them keeps frozen (requires_grad off: no gradient, no optimizer
# state, published as loaded): the lightning indexers of DeepSeek sparse attention (steps/models/dsa.py) and of
# DeepSeek-V4's compressed sparse attention (steps/models/compressed_attention.py), whose discrete choice gives them
# no gradient from a log-prob loss. By module name, in model and checkpoint names alike.
FROZEN_MODULES = ("indexer",)


def is_frozen(name: str) -> bool:
    """Whether parameter or checkpoint tensor `name` belongs to a frozen module (FROZEN_MODULES)."""
    return any(f".{module}." in f".{name}" for module in FROZEN_MODULES)


# Why a family drops the tensors of its multi-token-prediction layers on import (DeepSeek-V3, GLM-4-MoE, MiniMax-M2).
MTP_DROPPED = "a multi-token-prediction layer: moerl trains and publishes the model without it"


def beyond_the_last_layer(cfg: Any, name: str, layers_prefix: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a decoder layer past num_hidden_layers: `layers_prefix` (the
    family's name of its decoder layers, with the dot) then an index >= num_hidden_layers, where GLM-4.5's and
    MiniMax-M2's releases keep their multi-token-prediction layers."""
    match = re.match(re.escape(layers_prefix) + r"(\d+)\.", name)
    return match is not None and int(match.group(1)) >= cfg.num_hidden_layers


def dtype_name(dtype: torch.dtype) -> str:
    """config.json's name of a dtype: torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


class FamilyConfig(Protocol):
    """A family's config: its hyper-parameters under config.json's names, with the fields every family has and
    the shared code reads (the MoE layers and their experts, the vocabulary, the token ids)."""

    vocab_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_tok: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None

    def is_moe_layer(self, layer: int) -> bool: ...

    def validate(self, source: str = ...) -> None: ...

    def to_hf_dict(self, dtype: torch.dtype = ...) -> dict[str, Any]: ...

    @classmethod
    def refusal(cls, d: dict[str, Any]) -> tuple[str, str] | None: ...

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = ...) -> Any: ...


@dataclass(frozen=True)
class FusedExperts:
    """One checkpoint tensor that holds every routed expert of a MoE layer, stacked along `dim` (gpt-oss's fused
    gate-and-up projection of a layer's experts, [E, H, 2I]): expert e's slice (index e along `dim`) is the model's
    tensor experts[e]. An EP rank holds only some of the slices: the candidate writer gathers them (steps/training/
    candidate_writer.py), the loader reads only the rank's (steps/models/hf_checkpoint.py load_pretrained)."""

    name: str  # the checkpoint's tensor name
    moe_layer: int  # which MoE layer (counting the MoE layers: an ExpertPlacement's layer)
    experts: tuple[str, ...]  # the model's name of expert e's slice, e = 0 .. E-1
    shape: tuple[int, ...]  # the fused tensor's shape (E at `dim`)
    dim: int = 0


def stack_expert_slices(
    state: dict[str, torch.Tensor], expert_slice: re.Pattern[str], rename: Callable[[str], str], family: str
) -> dict[str, torch.Tensor]:
    """A to_hf for a family whose checkpoint fuses a layer's experts (FusedExperts): each expert's slice (a model
    name `expert_slice` matches as (experts' prefix, expert, weight)) stacked into the fused tensor rename(prefix +
    "." + weight), every other name through rename. Writing a fused tensor needs every expert 0..E-1 of its layer (a
    full model's state): an expert-parallel rank's subset is refused."""
    out: dict[str, torch.Tensor] = {}
    slices: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        match = expert_slice.match(name)
        if match is None:
            out[rename(name)] = tensor
            continue
        fused = rename(f"{match.group(1)}.{match.group(3)}")
        slices.setdefault(fused, {})[int(match.group(2))] = tensor
        out.setdefault(fused, tensor)  # a placeholder keeps the state's order
    for fused, by_expert in slices.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(
                f"{family} stores a layer's experts as one tensor ({fused}): writing it needs every expert, "
                f"this state holds experts {sorted(by_expert)} (an expert-parallel rank's subset)"
            )
        out[fused] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def split_fused_experts(
    state: dict[str, torch.Tensor], fused_tensor: re.Pattern[str], rename: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """stack_expert_slices' inverse (a from_hf): each fused tensor (a checkpoint name `fused_tensor` matches as
    (experts' prefix, weight)) split into its experts' slices rename(prefix).{e}.weight (copies: an expert does not
    keep the others' memory alive), every other name through rename."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = fused_tensor.match(name)
        if match is None:
            out[rename(name)] = tensor
            continue
        base = rename(match.group(1))
        for e, part in enumerate(tensor.unbind(0)):
            out[f"{base}.{e}.{match.group(2)}"] = part.clone()
    return out


class StateDictAdapter(Protocol):
    """A family's Hugging Face tensor names: the only place they are written (torchtitan's StateDictAdapter).

    The model's state_dict names are the family's module names; to_hf/from_hf map them to the checkpoint's and
    back (the identity where the modules are named as the checkpoint, as Qwen3-MoE's are)."""

    def expected_shapes(
        self, cfg: Any, placement: ExpertPlacement | None = None, ep_rank: int = 0
    ) -> dict[str, tuple[int, ...]]:
        """Every tensor name a checkpoint of `cfg` holds -> shape; with a placement, only the experts EP rank
        ep_rank holds."""
        ...

    def expert_params(self, cfg: Any, moe_layer: int, expert: int) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of one routed expert's parameters; `moe_layer` counts the MoE layers."""
        ...

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Model state_dict names -> checkpoint names."""
        ...

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint names -> model state_dict names."""
        ...

    def dropped_on_import(self, cfg: Any, name: str) -> str | None:
        """Why a checkpoint tensor outside expected_shapes is skipped when the checkpoint is read (e.g. a
        multi-token-prediction layer the model does not have), or None: such a tensor is then refused."""
        ...

    def fused_experts(self, cfg: Any) -> list[FusedExperts]:
        """The checkpoint tensors that each hold all of a MoE layer's experts (FusedExperts), in checkpoint
        order; [] for a family that stores one tensor per expert (to_hf/from_hf then map an EP rank's experts
        on their own)."""
        ...


class DecodeProjection(Protocol):
    """One layer's queries, keys and values for the torch engine's decoder: x [T, H] (normed) and the rotary
    tables of its tokens (DecodeModel.rotary) -> q [T, heads, Dk] already multiplied by the attention's scale,
    k [T, kv_heads, Dk], v [T, kv_heads, Dv], normed and rotated as the family's forward does. A projection that
    keeps fused copies of weights recomputes them in refresh (after an in-place weight update)."""

    def __call__(self, x: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def refresh(self) -> None: ...


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer of softmax attention over a KV cache, as the torch engine's decoder reads it:
    x + out(attention(project(attention_norm(x)))), then x + mlp(mlp_norm(x)).

    sinks: per query head [heads], an extra logit in each head's softmax whose weight is then dropped
    (gpt-oss's attention sinks); None: none. window: a key is seen from a query only if key position > query
    position - window (a sliding window, as transformers' sliding_window_overlay); None: every earlier key."""

    attention_norm: nn.Module
    project: DecodeProjection
    out: nn.Module  # the output projection
    mlp_norm: nn.Module
    mlp: nn.Module  # a SparseMoeBlock (steps/models/moe.py), or a dense SwiGLUExpert
    sinks: torch.Tensor | None = None
    window: int | None = None


@dataclass(frozen=True)
class DecodeModel:
    """A built model as the torch engine's decoder for its attention kind reads it: the modules (so that weights
    updated in place are seen) and the sizes the decode needs."""

    embed: nn.Embedding
    layers: list[DecodeLayer]
    norm: nn.Module
    output: nn.Parameter  # the output projection's weight [V, H] (the embedding's when they are tied)
    rotary: Callable[[torch.Tensor], Any]  # token positions [T] -> the rotary tables the projections read
    num_heads: int
    num_kv_heads: int
    key_dim: int  # per head: the cached keys' (and the queries') size
    value_dim: int  # per head: the cached values' size (multi-head latent attention's differs from the keys')


class StatefulDecode(Protocol):
    """A built model's incremental forward for the torch engine, for families whose attention kind is
    recurrent_state: the engine samples and keeps the rows; the family runs its layers and keeps each row's state
    (every layer's: recurrent states, conv windows, key/value caches), in any layout it likes."""

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Left-padded prompts ids [P, T] (valid [P, T] marks the real tokens) -> the logits [P, V] after each
        prompt's last token, and the rows' state."""
        ...

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """One token a row (tokens [R], at position `positions` [R] of its sequence) -> logits [R, V] and the
        state after it."""
        ...

    def select(self, state: Any, rows: torch.Tensor) -> Any:
        """The state of rows `rows` [R'] of `state`, in that order (a row may repeat: samples that share a prefix
        split)."""
        ...


@dataclass(frozen=True)
class ModelFamily:
    """One model family (torchtitan's ModelSpec): what every part of moerl asks of a model."""

    name: str  # as people call it: "Qwen3-MoE"
    model_type: str  # config.json's model_type
    architectures: tuple[str, ...]  # the transformers classes (config.json's architectures) it loads as
    description: str  # what moerl supports of it, as errors list it
    config: type[Any]  # the config class (a FamilyConfig): config.json's names and checks
    build: Callable[..., nn.Module]  # (config, placement=None, ep_rank=0) -> the model (its layers)
    state_dict_adapter: StateDictAdapter
    # a built model -> what the torch engine's decoder reads: a DecodeModel (softmax_kv_cache), a StatefulDecode
    # (recurrent_state)
    decode: Callable[[nn.Module], Any]
    attention: AttentionKind
    router: RouterKind
    # config -> the checkpoint tensors (name -> shape) the family keeps and publishes unchanged without computing
    # with them (a vision-language checkpoint's vision tower, steps/models/carried.py); None: none
    carried: Callable[[Any], dict[str, tuple[int, ...]]] | None = None
    # the checkpoint tensors it holds and writes in float32 whatever the weights' dtype, beside the shared ones
    # (steps/models/moe.py stored_dtype), by the ends of their names
    float32_tensors: tuple[str, ...] = ()

    def carried_shapes(self, cfg: Any) -> dict[str, tuple[int, ...]]:
        """The carried checkpoint tensors of `cfg` (name -> shape); {} for a family without any."""
        return {} if self.carried is None else self.carried(cfg)
