"""The causal LM every family shares: embeddings, a stack of pre-norm decoder layers (attention, then an MLP that
is a SparseMoeBlock or a dense expert), a final norm and the output projection; the training forward and the
GRPO forward that runs each prompt once for its group.

A family (steps/models/<family>/model.py) subclasses MoeCausalLM and DecoderLayer's parts: it builds `self.model`
(embed_tokens, layers, norm: the names of the checkpoint's `model.` prefix) and `self.lm_head`, gives its rotary
tables (`rotary`), and its attention modules implement the Attention protocol below. Everything else here (the
masks, the positions, the shared-prompt forward, the expert-parallel hooks) is written once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from steps.models.layers import AttentionMasks, RecordedSelection, RMSNorm, SelectionShape
from steps.models.moe import SparseMoeBlock
from steps.models.placement import check_placement

if TYPE_CHECKING:
    from steps.models.placement import ExpertPlacement


class Attention(Protocol):
    """A family's attention module, as the decoder layer calls it.

    project: x [B, T, H] and the family's rotary tables for those tokens (MoeCausalLM.rotary) -> q [B, heads, T,
             Dk], k [B, kv_heads, T, Dk], v [B, kv_heads, T, Dv], normed and rotated as the family does.
    attend:  q over k/v [B, kv_heads, S, *] under a boolean mask [B, 1, T, S] -> [B, T, H] (scores, softmax,
             values, output projection).
    sliding_window: None, or the number of keys a query sees (its own and the window - 1 before it).
    """

    sliding_window: int | None

    def project(self, x: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)). The attribute names are the
    checkpoint's (model.layers.N.self_attn / mlp / input_layernorm / post_attention_layernorm)."""

    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module, post_attention_layernorm: nn.Module
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def forward(self, x: torch.Tensor, rope: Any, masks: AttentionMasks) -> torch.Tensor:
        attn = self.self_attn
        q, k, v = attn.project(self.input_layernorm(x), rope)
        x = x + attn.attend(q, k, v, masks.get(attn.sliding_window))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_shared_prompts(
        self,
        prompt_x: torch.Tensor,
        response_x: torch.Tensor,
        prompt_rope: Any,
        response_rope: Any,
        prompt_masks: AttentionMasks,
        response_masks: AttentionMasks,
        prompt_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on prompts [G, P, H] and responses [R, T, H]: prompts attend among themselves; responses
        attend to the k/v of their prompt (row prompt_index[r]) followed by their own."""
        attn = self.self_attn
        qp, kp, vp = attn.project(self.input_layernorm(prompt_x), prompt_rope)
        qr, kr, vr = attn.project(self.input_layernorm(response_x), response_rope)
        # index_select: each response reads its prompt's k/v; the backward sums the responses' gradients
        k = torch.cat([kp.index_select(0, prompt_index), kr], dim=2)
        v = torch.cat([vp.index_select(0, prompt_index), vr], dim=2)
        window = attn.sliding_window
        prompt_x = prompt_x + attn.attend(qp, kp, vp, prompt_masks.get(window))
        response_x = response_x + attn.attend(qr, k, v, response_masks.get(window))
        return mlp_over_prompts_and_responses(self, prompt_x, response_x)


def mlp_over_prompts_and_responses(
    layer: nn.Module, prompt_x: torch.Tensor, response_x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of a layer's forward_shared_prompts: x + layer.mlp(layer.post_attention_layernorm(x)) over the
    prompts [G, P, H] and the responses [R, T, H] in ONE MLP call, so that an MoE layer routes and exchanges them in
    a single dispatch, exactly once per layer as in forward (every EP rank must make the same calls)."""
    hidden = prompt_x.shape[-1]
    tokens = torch.cat([prompt_x.reshape(-1, hidden), response_x.reshape(-1, hidden)])
    out = layer.mlp(layer.post_attention_layernorm(tokens))
    num_prompt = prompt_x.shape[0] * prompt_x.shape[1]
    return prompt_x + out[:num_prompt].view_as(prompt_x), response_x + out[num_prompt:].view_as(response_x)


class BlockSparseDecoderLayer(DecoderLayer):
    """The decoder layer with its MoE block registered as `block_sparse_moe`, the name of Mixtral's and
    MiniMax-M2's checkpoints; `mlp`, the name the shared code reads, is the same module."""

    def __init__(
        self, self_attn: nn.Module, block: nn.Module, input_layernorm: nn.Module, post_attention_layernorm: nn.Module
    ) -> None:
        super().__init__(self_attn, block, input_layernorm, post_attention_layernorm)
        self.block_sparse_moe = self._modules.pop("mlp")

    @property  # type: ignore[override]
    def mlp(self) -> nn.Module:
        return self.block_sparse_moe


class DecoderStack(nn.Module):
    """The decoder stack; its attribute names give the `model.` prefix of the checkpoint tensor names."""

    def __init__(self, embed_tokens: nn.Embedding, layers: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class MoeCausalLM(nn.Module):
    """A family's causal LM. state_dict() keys are the family's module names (its state-dict adapter maps them to
    the checkpoint's).

    placement (steps.models.placement.ExpertPlacement) and ep_rank build the model of one expert-parallel rank:
    in every MoE layer only the experts the placement gives that rank; their names keep the global index, so its
    state_dict is a subset of the full one. Without a placement the model holds every expert.

    A subclass's __init__ calls super().__init__, then build() with its decoder layers and final norm.
    """

    model: nn.Module
    lm_head: nn.Linear | None

    def __init__(self, config: Any, placement: ExpertPlacement | None = None, ep_rank: int = 0) -> None:
        super().__init__()
        config.validate()
        check_placement(config, placement, ep_rank)
        self.config = config
        self.placement = placement
        self.ep_rank = ep_rank
        # trainer.router_aux_loss_coef: > 0 makes each forward also compute `aux_loss`, the coefficient times the
        # MoE layers' mean load-balancing loss over the real tokens (steps/models/router_loss.py)
        self.router_aux_loss_coef = 0.0
        self.aux_loss: torch.Tensor | None = None
        # trainer.activation_checkpointing: a training forward keeps only each decoder layer's input and runs the
        # layer again in the backward (run_layer)
        self.activation_checkpointing = False
        # The rollout engine's recorded key selections for the next forwards (set_engine_selections), by call:
        # "forward" (forward, plain or packed rows), "prompts" and "responses" (forward_shared_prompts)
        self.engine_selections: dict[str, RecordedSelection] | None = None

    def build(self, layer: Callable[[int], nn.Module], norm: Callable[[], nn.Module]) -> None:
        """self.model (the embeddings, layer(i) for every decoder layer i, the final norm()) and self.lm_head
        (None when tied: logits use the embedding matrix and no lm_head.weight exists, as save_pretrained omits
        it), then init_weights(): the end of a family's __init__."""
        cfg = self.config
        embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.model = DecoderStack(embed_tokens, [layer(i) for i in range(cfg.num_hidden_layers)], norm())
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.init_weights()

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """The rotary tables of tokens at positions [B, T], in the form the family's attention reads them."""
        raise NotImplementedError(f"{type(self).__name__} must give its rotary tables")

    @torch.no_grad()
    def init_weights(self) -> None:
        """As transformers: normal(0, initializer_range) for linear/embedding/router, zero biases, ones for
        norms; a family adds its own parameters' rule in init_extra."""
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
            self.init_extra(module)

    def init_extra(self, module: nn.Module) -> None:
        """A family's initialisation of parameters init_weights does not know (none by default)."""

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight [V, H]: the embedding's when they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers, first to last (FSDP2's units: steps/training/sharding.py)."""
        return list(self.model.layers)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def indexed_attention(self) -> list[nn.Module]:
        """The attention modules that select their keys with an indexer of their own (DeepSeek sparse attention,
        steps/models/dsa.py), in layer order; empty for every other model."""
        attention = [getattr(layer, "self_attn", None) for layer in self.model.layers]
        return [a for a in attention if getattr(a, "indexer", None) is not None]  # type: ignore[misc]

    def selection_shape(self) -> SelectionShape | None:
        """What the model's indexers choose (steps/models/layers.py SelectionShape), as the engine records it for
        replay; None without indexers. DeepSeek sparse attention's here; a family with other indexers overrides."""
        attention = self.indexed_attention()
        return SelectionShape(len(attention), attention[0].indexer.topk) if attention else None  # type: ignore[union-attr]

    def router_parameters(self) -> list[nn.Parameter]:
        """The routers' parameters (trainer.router: freeze keeps them at their SFT values)."""
        return [p for block in self.moe_blocks() for p in block.gate.parameters()]

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

    def set_engine_routes(self, routes: torch.Tensor | None, replay: bool = False) -> None:
        """For the forward passes until the next call: routes [num MoE layers, T, k] the experts (global ids; a
        row of -1 where none was recorded) the rollout engine routed each token to, T the tokens in the order the
        MoE layers see them (input_ids flattened, or MoeCausalLM.forward_shared_prompts' prompts then
        responses); replay: the forward uses them in place of its routers' choice (routing replay; the routers
        still weigh the experts, SparseMoeBlock.weigh). None: the routers choose alone."""
        blocks = self.moe_blocks()
        if routes is not None and routes.shape[0] != len(blocks):
            raise ValueError(f"routes for {routes.shape[0]} MoE layers, but the model has {len(blocks)}")
        for index, block in enumerate(blocks):
            block.engine_routes = None if routes is None else routes[index]
            block.replay_routes = replay and routes is not None

    def set_engine_selections(
        self, selections: dict[str, tuple[torch.Tensor, torch.Tensor]] | None, replay: bool = False
    ) -> None:
        """For the forward passes until the next call, the keys the rollout engine's indexers selected (a model
        with DeepSeek sparse attention, steps/models/dsa.py): per call ("forward", or "prompts" and "responses" of
        forward_shared_prompts) the (bits, recorded) of a RecordedSelection in that call's layout; replay: the
        forward attends to them instead of its indexers' choice. None: the indexers choose alone."""
        shape = self.selection_shape()
        layers = 0 if shape is None else shape.layers
        if selections is not None:
            for call, (bits, _) in selections.items():
                if bits.shape[0] != layers:
                    raise ValueError(f"{call}: selections for {bits.shape[0]} indexer layers, the model has {layers}")
        self.engine_selections = None if selections is None else {
            call: RecordedSelection(bits, recorded, replay) for call, (bits, recorded) in selections.items()
        }  # fmt: skip

    def selection_disagreement(self) -> torch.Tensor | None:
        """[indexer layers, 2] int64: (recorded queries whose indexer's own top-k differs from the engine's,
        recorded queries) of the forwards since set_engine_selections (this process's); None without them."""
        if self.engine_selections is None:
            return None
        shape = self.selection_shape()
        counts = torch.zeros(0 if shape is None else shape.layers, 2, dtype=torch.int64)
        for selection in self.engine_selections.values():
            for index, count in selection.disagreement.items():
                counts[index] += count.cpu()
        return counts

    def count_route_disagreement(self) -> None:
        """Start (or restart) counting, per MoE layer, the tokens whose router's own top-k set differs from the
        engine's recorded one (see route_disagreement)."""
        for block in self.moe_blocks():
            block.route_disagreement = torch.zeros(3, dtype=torch.int64, device=block.gate.weight.device)

    def route_disagreement(self) -> torch.Tensor | None:
        """[num MoE layers, 3] int64 (tokens whose routers' top-k differs from the engine's, tokens whose experts
        used differ from the engine's, tokens with a recorded route) counted since count_route_disagreement (this
        process's tokens), which it stops; None when it was not started."""
        blocks = self.moe_blocks()
        counts = [block.route_disagreement for block in blocks]
        for block in blocks:
            block.route_disagreement = None
        if not counts or any(c is None for c in counts):
            return None
        return torch.stack(counts)  # type: ignore[arg-type]

    def run_layer(self, layer: nn.Module, method: Callable[..., Any], *args: Any) -> Any:
        """layer's `method` on args; with activation_checkpointing in a forward that builds a graph, through
        torch.utils.checkpoint (non-reentrant): the layer's activations are dropped and the backward runs the
        layer again. The rerun must repeat the forward exactly (the same routing, the same expert dispatch on
        every EP rank, the same ops saving tensors), and must not count twice what the forward records: the MoE
        block's routed rows are not counted again, and its load-balancing loss is computed again (the graph
        needs it) into a value that is then dropped; the rerun replays the engine routes the forward had and does
        not count their disagreement again."""
        if not (self.activation_checkpointing and torch.is_grad_enabled()):
            return method(*args)
        block = layer.mlp if isinstance(getattr(layer, "mlp", None), SparseMoeBlock) else None

        @contextlib.contextmanager
        def rerun(
            mask: torch.Tensor | None = block.balance_mask if block else None,
            routes: torch.Tensor | None = block.engine_routes if block else None,
            replay: bool = block.replay_routes if block else False,
        ) -> Iterator[None]:
            if block is None:
                yield
                return
            kept = block.routed_rows, block.balance_mask, block.balance_loss, block.engine_routes
            kept_count, kept_replay = block.route_disagreement, block.replay_routes
            block.routed_rows, block.balance_mask, block.route_disagreement = None, mask, None
            block.engine_routes, block.replay_routes = routes, replay
            try:
                yield
            finally:
                block.routed_rows, block.balance_mask, block.balance_loss, block.engine_routes = kept
                block.route_disagreement, block.replay_routes = kept_count, kept_replay

        return checkpoint(method, *args, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), rerun()))

    def _balance(self, real_tokens: torch.Tensor | None) -> None:
        """Before a forward (real_tokens [T], in the order the MoE layers see the tokens): have every MoE layer whose
        router chooses its experts (not DeepSeek-V4's hash layers, SparseMoeBlock.router_chooses) compute its
        load-balancing loss when router_aux_loss_coef > 0. After it (None): aux_loss = the coefficient times their
        mean."""
        if self.router_aux_loss_coef <= 0:
            self.aux_loss = None
            return
        blocks = [block for block in self.moe_blocks() if block.router_chooses]
        if real_tokens is not None:
            for block in blocks:
                block.balance_mask, block.balance_loss = real_tokens, None
            return
        losses = [block.balance_loss for block in blocks if block.balance_loss is not None]
        for block in blocks:
            block.balance_mask = block.balance_loss = None
        self.aux_loss = self.router_aux_loss_coef * torch.stack(losses).mean() if losses else None

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] in float32 (training and scoring: the rollout engine decodes
        with its own prefill and key/value tree, steps/engines/torch_engine.py).

        attention_mask [B, T] marks the real tokens (1) and the padding (0); prompts are left-padded, and
        positions count real tokens only. segment_ids [B, T] (trainer.sequence_packing): sequences packed into a
        row one after another, each a run of one id; a token attends within its own sequence only and positions
        start again at each sequence's first token, so every sequence gets the logits it would get alone.
        """
        batch, seq = input_ids.shape
        if attention_mask is None:
            valid = torch.ones(batch, seq, dtype=torch.bool, device=input_ids.device)
        else:
            if attention_mask.shape != input_ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {(batch, seq)}"
                )
            valid = attention_mask.to(torch.bool)
        if segment_ids is not None:
            if segment_ids.shape != input_ids.shape:
                raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} != input_ids shape {(batch, seq)}")
            index = torch.arange(seq, device=input_ids.device).expand(batch, seq)
            first = torch.ones_like(segment_ids, dtype=torch.bool)
            first[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
            positions = index - torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
            masks = AttentionMasks.packed(valid, segment_ids, positions)
        else:
            # Left padding: a row's first real token gets position 0; padding gets 0 too (it is masked anyway).
            positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
            masks = AttentionMasks.causal(valid, positions)
        masks.engine_selection = None if self.engine_selections is None else self.engine_selections.get("forward")
        masks.token_ids = input_ids
        x = self.embed(input_ids)
        rope = self.rotary(positions, x.dtype)
        self._balance(valid.reshape(-1))
        for layer in self.model.layers:
            x = self.run_layer(layer, layer, x, rope, masks)
        self._balance(None)
        return F.linear(self.final_norm(x), self.output_weight()).float()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for tokens input_ids [B, T]: their embeddings [B, T, H] (a family with a wider
        residual stream widens them: DeepSeek-V4's hyper-connections)."""
        return self.model.embed_tokens(input_ids)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output -> the hidden states the output projection reads (the final norm)."""
        return self.model.norm(x)

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

        # Positions as forward counts them: real tokens from 0; a response continues after its prompt.
        prompt_positions = (prompt_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        prompt_lengths = prompt_valid.long().sum(dim=1).index_select(0, prompt_index)
        response_positions = prompt_lengths[:, None] + (response_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        prompt_masks = AttentionMasks.causal(prompt_valid, prompt_positions)
        response_masks = AttentionMasks.after_prompt(
            prompt_valid.index_select(0, prompt_index), prompt_positions.index_select(0, prompt_index),
            response_valid, response_positions,
        )  # fmt: skip
        if self.engine_selections is not None:
            prompt_masks.engine_selection = self.engine_selections.get("prompts")
            response_masks.engine_selection = self.engine_selections.get("responses")

        prompt_masks.token_ids, response_masks.token_ids = prompt_ids, response_ids
        prompt_x = self.embed(prompt_ids)
        response_x = self.embed(response_ids)
        prompt_rope = self.rotary(prompt_positions, prompt_x.dtype)
        response_rope = self.rotary(response_positions, response_x.dtype)
        self._balance(torch.cat([prompt_valid.reshape(-1), response_valid.reshape(-1)]))  # the MLPs' token order
        for layer in self.model.layers:
            prompt_x, response_x = self.run_layer(
                layer, layer.forward_shared_prompts,
                prompt_x, response_x, prompt_rope, response_rope, prompt_masks, response_masks, prompt_index,
            )  # fmt: skip
        self._balance(None)
        # Only the prompts' last positions are needed from the prompts: norm and lm_head run per token.
        last = prompt_x[:, -1:].index_select(0, prompt_index)  # [R, 1, H]
        x = self.final_norm(torch.cat([last, response_x], dim=1))
        return F.linear(x, self.output_weight()).float()
