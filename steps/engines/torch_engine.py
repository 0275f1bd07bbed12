"""The torch engine: batched sampling over a policy model (any family of steps/models/registry.py whose attention
kind is softmax over a key/value cache) on CPU (or one GPU), behind the generation interface of
steps/engines/interface.py (SGLang's engine is steps/engines/sglang_engine.py; held-out evaluation, over any
engine, is steps/scoring/evaluation.py).

    engine = TorchEngine.from_checkpoint(model_dir)
    generations = engine.generate(requests, SamplingParams(n=8))

Determinism of the torch engine. A sample's token at step t is the inverse CDF of the (temperature/top-k/
top-p) sampling distribution at the uniform u[t] of the sample's own counter-based random stream, keyed by the
request's seed alone (sample_uniforms): no other row's randomness ever enters. Logits of a row depend on the
other rows only through floating-point noise of the batch shape (matmul blocking, expert grouping), and on
the number of CPU threads; so the rollout step always generates the same chunk as one batch
(steps/experience/rollout_plan.py) with a fixed thread count, and the same chunk then gives bit-identical samples in any
shard and after any restart.

Speed of the torch engine (bench/rollout.py): a prompt is prefilled once for its whole group, its keys and
values are shared by the group's samples, samples that drew the same tokens so far are decoded once, and the
keys and values of the tokens they drew are stored once, as a prefix tree, whatever the splits.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from steps.engines.interface import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    GenerationInterrupted,
    GenerationRequest,
    SamplingParams,
)
from steps.engines.route_recorder import RouteRecorder, indexed_selection_recorder
from steps.engines.sampling import sample_next, sample_uniforms
from steps.engines.state_decoder import StateDecoder
from steps.errors import MoerlError
from steps.models.experts import SWIGLU, expert_spans
from steps.models.family import STATEFUL_ATTENTION, dtype_name
from steps.models.hf_checkpoint import check_checkpoint, checkpoint_dtype, load_pretrained, load_state_dict_from_dir
from steps.models.moe import SparseMoeBlock, group_by_expert
from steps.models.registry import family_of

# PyTorch's CPU bmm runs matrices of fewer multiply-adds than this with a plain loop, several times slower
# per multiply-add than its blocked kernels; RowBatch decoding keeps its per-row products above it.
SMALL_PRODUCT = 400

# What fills the token grid where nothing was sampled and the left padding of prompts: any valid id does, as
# those positions are masked out and never read back.
FILLER_ID = 0

# ----------------------------------------------------------------------------------------------------
# The torch engine
# ----------------------------------------------------------------------------------------------------


def compute_dtype(stored: torch.dtype, device: str | torch.device) -> torch.dtype:
    """The dtype the torch engine computes in over weights stored in `stored`.

    CPU: float32 always. Upcasting bf16/fp16 weights is exact, so the engine evaluates the published policy
    itself, with the same fp32 arithmetic whatever the stored dtype (the one the CPU determinism tests pin),
    and its log-probs equal a float32 transformers forward of the published weights up to float32 rounding.
    A GPU: the stored dtype, as SGLang's dtype auto serves a bf16/fp16 checkpoint.
    """
    return torch.float32 if torch.device(device).type == "cpu" else stored


@dataclass
class TorchEngine:
    """Batched sampling over a policy model (its family's, steps/models/registry.py) on CPU (or one GPU).

    One generate() call is one batch. The distinct prompts are prefilled once, left-padded (Decoder.prefill,
    MoeForCausalLM.forward's arithmetic); the samples of a prompt then share those prompt keys/values (never
    copied per sample).

    Decoding runs over *states*, not samples: samples of one prompt that have drawn the same tokens so far
    are in the same state (same keys, values and next-token logits), so they share one row of the batch and
    one computation; a state splits into new rows when its samples draw different tokens, and the new rows
    keep reading the keys and values their common past left in the prefix tree (DecodeBatch). Each sample still
    draws its own token, with its own uniforms, from its state's logits. Rows whose samples have all finished
    stop costing compute: they are dropped when the batch is rebuilt for a split, or once a quarter of it
    is finished. All of this is decided by the batch alone, so a batch always decodes the same way.

    The engine serves the weights the model had when the engine was built (the decoder keeps a fused copy of
    the expert weights): after changing the model, build a new engine or call update_weights, which replaces
    the model's and the decoder's weights in place from a checkpoint dir (another version of the same run).
    """

    model: nn.Module
    name: str = "torch"
    compact_below: float = 0.75  # drop finished rows when the live ones are at most this share of the batch
    # Keep the generated keys/values in the prefix tree (DecodeBatch) while a query reads at most this many
    # times the columns it attends to; beyond, copy them out per row (RowBatch) for the rest of the batch.
    tree_waste: float = 3.0
    stored_dtype: torch.dtype | None = None  # the checkpoint's (from_checkpoint): every update must keep it
    # Record each sample's routed experts (Generation.routed_experts): every MoE layer's top-k of every token fed
    # through the model, prompt and response, as the router chose them
    record_routes: bool = False
    device: torch.device = field(init=False)
    decoder: Decoder | StateDecoder = field(init=False)

    def __post_init__(self) -> None:
        if family_of(self.model).attention in STATEFUL_ATTENTION:
            self.decoder = StateDecoder(self.model)
        else:
            self.decoder = Decoder(self.model)
        self.device = next(self.model.parameters()).device

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | os.PathLike,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        record_routes: bool = False,
    ) -> TorchEngine:
        """The engine over a checkpoint dir's weights, read in the dtype they are stored in and computed in
        `dtype` (default: compute_dtype for that dtype and the device)."""
        stored = checkpoint_dtype(directory)
        model = load_pretrained(directory, dtype=dtype or compute_dtype(stored, device), device=device).eval()
        return cls(model, stored_dtype=stored, record_routes=record_routes)

    def update_weights(self, model_dir: str | os.PathLike) -> None:
        """Replace the weights in place with checkpoint dir model_dir's (steps/engines/interface.py Engine): each tensor
        is copied into the existing parameter, cast as from_checkpoint casts it (bf16/fp16 to fp32 on CPU is
        exact), and the decoder's fused copies are refreshed in place, so the engine then generates exactly what
        an engine opened on model_dir does. The model must be the same (config.json) and stored in the same dtype.
        """
        cfg = check_checkpoint(model_dir)  # config, every tensor's shape and one dtype, before touching anything
        if cfg != self.model.config:
            raise MoerlError(
                f"{model_dir}: config.json describes another model than this engine serves; an in-place update "
                "takes another version of the same run — open a new engine for another model"
            )
        stored = checkpoint_dtype(model_dir)
        if self.stored_dtype is not None and stored != self.stored_dtype:
            raise MoerlError(
                f"{model_dir}: weights stored as {dtype_name(stored)}, but this engine's checkpoint was "
                f"{dtype_name(self.stored_dtype)} (a run keeps one dtype); open a new engine on it"
            )
        params = self.model.state_dict(keep_vars=True)
        adapter = family_of(self.model).state_dict_adapter  # the checkpoint names its tensors as the family does
        state = adapter.from_hf(load_state_dict_from_dir(model_dir, adapter.to_hf(params)))
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name])
        self.decoder.refresh()

    def close(self) -> None:
        pass

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Generation]:
        if not requests:
            return []
        device, steps, vocab = self.device, params.max_new_tokens, self.model.config.vocab_size
        recorder = selections = None
        if self.record_routes:
            stateful = isinstance(self.decoder, StateDecoder)
            layers = self.model.decoder_layers() if stateful else self.decoder.parts.layers  # type: ignore[union-attr,operator]
            recorder = RouteRecorder(layers, len(requests), steps)
            selections = indexed_selection_recorder(self.model, len(requests))
        self.decoder.routes = None if recorder is None else recorder.taken
        if selections is not None:
            self.decoder.selections = selections.taken  # type: ignore[union-attr]
        batch, logits, state, valid = self._prefill(requests, steps)  # state: each sample's row in the batch
        if recorder is not None:
            recorder.prefilled(*valid.shape, prompt_of=state.clone())
        if selections is not None:
            selections.prefilled(valid, prompt_of=state.clone())

        uniforms = sample_uniforms([r.seed for r in requests], steps).to(device)
        out_tokens = torch.full((len(requests), steps), FILLER_ID, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(len(requests), steps, dtype=torch.float32, device=device)
        lengths = torch.zeros(len(requests), dtype=torch.long, device=device)
        stopped = torch.zeros(len(requests), dtype=torch.bool, device=device)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)

        live = torch.arange(len(requests), device=device)  # the samples still generating
        for step in range(steps):
            tokens, logprobs = sample_next(logits.index_select(0, state[live]), uniforms[live, step], params)
            out_tokens[live, step] = tokens
            out_logprobs[live, step] = logprobs
            lengths[live] += 1
            ended = torch.isin(tokens, stop_ids)
            stopped[live[ended]] = True
            live, tokens = live[~ended], tokens[~ended]
            if live.numel() == 0 or step == steps - 1:
                break
            if should_stop is not None and should_stop():
                raise GenerationInterrupted(f"stopped after {step + 1} of {steps} decode steps")
            # The live samples' next states: one per distinct (state, token), ordered by (state, token).
            keys, inverse = torch.unique(state[live] * vocab + tokens, return_inverse=True)
            rows, row_tokens = keys // vocab, keys % vocab
            rows_kept = len(logits)
            if len(rows) == len(torch.unique(rows)) and len(rows) > self.compact_below * rows_kept:
                # No state split and few finished: keep the rows; finished ones feed padding, unread.
                next_tokens = torch.full((rows_kept,), FILLER_ID, dtype=torch.long, device=device)
                next_tokens[rows] = row_tokens
            else:
                batch, next_tokens = batch.select(rows), row_tokens
                state[live] = inverse
            if isinstance(batch, DecodeBatch) and batch.tree_columns() > self.tree_waste * batch.row_columns():
                batch = batch.to_rows(self.decoder.row_capacity(batch.length))
            logits = self.decoder.step(next_tokens, batch)
            if recorder is not None:
                recorder.stepped(step, live, state[live])
            if selections is not None:
                selections.stepped(step, live, state[live])

        token_lists, logprob_lists = out_tokens.tolist(), out_logprobs.tolist()
        return [
            Generation(
                prompt_id=request.prompt_id,
                sample_index=request.sample_index,
                response_ids=token_lists[row][:n],
                logprobs=logprob_lists[row][:n],
                finish_reason=FINISH_STOP if done else FINISH_LENGTH,
                routed_experts=None if recorder is None else recorder.sample(row, len(request.prompt_ids), n),
                selected_keys=None if selections is None else selections.sample(row, len(request.prompt_ids), n),
            )
            for row, (request, n, done) in enumerate(zip(requests, lengths.tolist(), stopped.tolist(), strict=True))
        ]

    def _prefill(
        self, requests: Sequence[GenerationRequest], steps: int
    ) -> tuple[DecodeBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prefill of the distinct prompts (Decoder.prefill). Returns the decode batch (one row
        per distinct prompt), its next-token logits [P, V], each request's row [R] and the prompts' real
        columns [P, W] (bool, on the CPU)."""
        distinct: dict[tuple[int, ...], int] = {}
        parent = [distinct.setdefault(tuple(r.prompt_ids), len(distinct)) for r in requests]
        prompts = list(distinct)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a GenerationRequest has no prompt tokens; a prompt needs at least one token")
        width = max(len(p) for p in prompts)
        ids = torch.tensor([(FILLER_ID,) * (width - len(p)) + p for p in prompts], dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts])
        valid = torch.arange(width)[None, :] >= (width - lengths)[:, None]
        # Room for the first decode steps' nodes (DecodeBatch): at most one per sample of a prompt and step.
        group = max(Counter(parent).values())
        batch, logits = self.decoder.prefill(ids.to(self.device), valid.to(self.device), room=group * min(steps, 8))
        return batch, logits, torch.tensor(parent, device=self.device), valid


class PromptGrid:
    """The rows of a batch laid out by prompt in a grid [P, slots] (slot: the row's rank among its prompt's
    rows; empty slots repeat row 0, and their results are never read), so that attention reads each prompt's
    keys once for all of its rows, as one matrix product per prompt and kv head."""

    def __init__(self, parent: torch.Tensor, prompts: int) -> None:
        self.parent = parent  # [B] the prompt of each row
        rows = parent.shape[0]
        counts = torch.bincount(parent, minlength=prompts)
        order = torch.argsort(parent, stable=True)
        first_of_prompt = counts.cumsum(0) - counts
        self.slot = torch.empty_like(parent)  # each row's rank among its prompt's rows
        self.slot[order] = torch.arange(rows, device=parent.device) - first_of_prompt[parent[order]]
        self.slots = int(counts.max())
        self.grid = torch.zeros((prompts, self.slots), dtype=torch.long, device=parent.device)
        self.grid[parent, self.slot] = torch.arange(rows, device=parent.device)
        self.row_in_grid = parent * self.slots + self.slot

    def to_grid(self, per_row: torch.Tensor) -> torch.Tensor:
        """[B, kv, g, X] -> [P * kv, slots * g, X]: rows laid out by prompt."""
        _, kv, g, x = per_row.shape
        grid = per_row.index_select(0, self.grid.view(-1)).view(-1, self.slots, kv, g, x)  # [P, slots, kv, g, X]
        return grid.transpose(1, 2).reshape(-1, self.slots * g, x)

    def from_grid(self, grid: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """[P * kv, slots * g, X] -> [B, kv, g, X]."""
        total, slots_g, x = grid.shape
        prompts, g = total // kv_heads, slots_g // self.slots
        per_slot = grid.view(prompts, kv_heads, self.slots, g, x).transpose(1, 2).reshape(-1, kv_heads, g, x)
        return per_slot.index_select(0, self.row_in_grid)


class DecodeBatch(PromptGrid):
    """The decode state of one batch. A row is a state (TorchEngine): the samples of one prompt that drew the
    same tokens so far. Keys and values are stored per prompt as a prefix tree, never per row:

        keys, values    [layers, P, kv, N, Dk | Dv]  per distinct prompt, its W prefill tokens (left-padded), then its
                                nodes: one column per (decode step, row of the prompt at that step) holding
                                the key/value of the token that row fed. A node is shared by every later row
                                that descends from it, so a state that splits copies nothing;
        prompt_bias     [P, W]   0 for a real prompt token, -inf for padding
        parent          [B]      the prompt of each row
        ancestors       [B, length]  the node column of each row's token at each generated step
        used            int      columns of keys/values in use (W, then the nodes written so far)
        position        [B]      RoPE position of each row's next token

    Attention (Decoder.step): each prompt's queries, laid out by the grid, read all of its columns in one
    matrix product, with a bias that lets a row see the real prompt tokens and its own ancestors only. So a
    query reads more columns than it attends to (its prompt's other nodes): W + the nodes so far, up to
    W + steps x samples per prompt. While that is a few times W + length it costs less than copying each
    row's keys and values whenever a state splits (the demo's 8-token rollouts, bench/README.md "rollout");
    beyond, TorchEngine copies them out per row once (to_rows, RowBatch) and decodes the rest that way.
    """

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        prompt_bias: torch.Tensor,
        parent: torch.Tensor,
        ancestors: torch.Tensor,
        used: int,
        position: torch.Tensor,
    ) -> None:
        super().__init__(parent, keys.shape[1])
        self.keys, self.values, self.prompt_bias = keys, values, prompt_bias
        self.ancestors, self.used, self.position = ancestors, used, position

    @property
    def length(self) -> int:
        """Tokens generated so far (the same for every row)."""
        return self.ancestors.shape[1]

    def select(self, rows: torch.Tensor) -> DecodeBatch:
        """Only these rows, in this order (a row may repeat: a state that splits). The keys and values are
        shared, not copied, unless half of the prompts or more have no row left: then only the used prompts'
        are kept (until then the others stay, in empty rows of the grid)."""
        parent = self.parent.index_select(0, rows)
        keys, values, bias = self.keys, self.values, self.prompt_bias
        prompts, compact_parent = torch.unique(parent, return_inverse=True)
        if len(prompts) <= keys.shape[1] // 2:
            keys, values = keys.index_select(1, prompts), values.index_select(1, prompts)
            bias, parent = bias.index_select(0, prompts), compact_parent
        return DecodeBatch(
            keys,
            values,
            bias,
            parent,
            self.ancestors.index_select(0, rows),
            self.used,
            self.position.index_select(0, rows),
        )

    def add_nodes(self) -> torch.Tensor:
        """Columns for this step's nodes, `slots` of them per prompt (doubling the room when it is full).
        Records each row's node column among its ancestors; returns where the row's key of each kv head goes
        in a layer's keys viewed as [P * kv * N, D] ([B * kv], row-major)."""
        needed = self.used + self.slots
        if needed > self.keys.shape[3]:
            grow = max(needed, 2 * self.keys.shape[3]) - self.keys.shape[3]
            self.keys = torch.cat([self.keys, self.keys.new_zeros((*self.keys.shape[:3], grow, self.keys.shape[4]))], 3)
            self.values = torch.cat(
                [self.values, self.values.new_zeros((*self.values.shape[:3], grow, self.values.shape[4]))], dim=3
            )
        column = self.slot + self.used
        self.ancestors = torch.cat([self.ancestors, column[:, None]], dim=1)
        self.used = needed
        kv_heads, capacity = self.keys.shape[2], self.keys.shape[3]
        head = torch.arange(kv_heads, device=column.device)
        return ((self.parent[:, None] * kv_heads + head) * capacity + column[:, None]).view(-1)

    def tree_columns(self) -> int:
        """Columns the next step's queries read: the prompt and every node of their prompt so far."""
        return self.used + self.slots

    def row_columns(self) -> int:
        """Columns the next step's queries attend to: the prompt and their own tokens."""
        return self.prompt_bias.shape[1] + self.length + 1

    def to_rows(self, capacity: int) -> RowBatch:
        """The same state with each row's generated keys and values copied out of the tree into its own
        `capacity` (>= length) columns."""
        width = self.prompt_bias.shape[1]
        layers, _, kv_heads, _, key_dim = self.keys.shape
        shape = (layers, self.parent.shape[0], kv_heads, capacity)
        values = self.values.new_zeros((*shape, self.values.shape[4]))
        keys = self.keys.new_zeros((*shape, key_dim))
        # [B, length, layers, kv, D] -> [layers, B, kv, length, D]
        chains = (self.parent[:, None], slice(None), self.ancestors)
        keys[:, :, :, : self.length] = self.keys[(slice(None), *chains)].permute(2, 0, 3, 1, 4)
        values[:, :, :, : self.length] = self.values[(slice(None), *chains)].permute(2, 0, 3, 1, 4)
        return RowBatch(
            self.keys[:, :, :, :width].transpose(3, 4).contiguous(),
            self.values[:, :, :, :width].contiguous(),
            self.prompt_bias,
            self.parent,
            keys.transpose(3, 4).contiguous(),
            values,
            self.position,
            self.length,
        )

    def attention_bias(self, window: int | None = None) -> torch.Tensor:
        """[P, slots, used]: 0 where a grid cell's row may attend (real prompt tokens, its own ancestors),
        -inf elsewhere. Empty cells see the prompt only (finite, never read). With a sliding window, a row
        sees only the keys at positions > its query's position - window: prompt token j at its position among
        the prompt's real tokens, the node of generated step t at prompt length + t (the query's position is
        the prompt length + length - 1)."""
        prompts, width = self.prompt_bias.shape
        bias = torch.full((prompts * self.slots, self.used), float("-inf"), device=self.prompt_bias.device)
        bias.view(prompts, self.slots, self.used)[:, :, :width] = self.prompt_bias[:, None, :]
        ancestors = self.ancestors
        if window is not None:
            far = prompt_positions(self.prompt_bias)[self.parent] <= (self.position - window)[:, None]  # [B, W]
            rows = bias[self.row_in_grid, :width]
            bias[self.row_in_grid, :width] = rows.masked_fill_(far, float("-inf"))
            ancestors = ancestors[:, max(0, self.length - window) :]  # the last `window` tokens
        bias[self.row_in_grid[:, None], ancestors] = 0.0
        return bias.view(prompts, self.slots, self.used)


def prompt_positions(prompt_bias: torch.Tensor) -> torch.Tensor:
    """[P, W] the position of each prompt column among its prompt's real tokens (0 from the first real one;
    padding columns 0 too, masked anyway), from the prompt bias (0 real, -inf padding)."""
    return ((prompt_bias == 0).long().cumsum(dim=1) - 1).clamp(min=0)


class RowBatch(PromptGrid):
    """The decode state of a batch whose generated keys and values are stored per row (DecodeBatch.to_rows):
    the prompts' keys/values stay shared, each row holds its own tokens' ones, and a state that splits copies
    them. Attention reads W + capacity columns per query, whatever the group size.

        prompt_keys     [layers, P, kv, D, W]  transposed for the query-key product
        prompt_values   [layers, P, kv, W, D]
        prompt_bias     [P, W]   0 for a real prompt token, -inf for padding
        keys            [layers, B, kv, D, capacity]  the row's generated tokens' keys (transposed), `length`
                                of them; zeros beyond
        values          [layers, B, kv, capacity, D]
        position        [B]      RoPE position of each row's next token
    """

    def __init__(
        self,
        prompt_keys: torch.Tensor,
        prompt_values: torch.Tensor,
        prompt_bias: torch.Tensor,
        parent: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        position: torch.Tensor,
        length: int,
    ) -> None:
        super().__init__(parent, prompt_keys.shape[1])
        self.prompt_keys, self.prompt_values, self.prompt_bias = prompt_keys, prompt_values, prompt_bias
        self.keys, self.values, self.position, self.length = keys, values, position, length
        self.row_bias = prompt_bias[parent]  # [B, W]

    def window_bias(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(prompt bias [B, W], bias of the row's own seen tokens [seen] or None) for a query at each row's
        position: a sliding window hides keys at positions <= position - window (prompt token j at its position
        among the real tokens, own token t at prompt length + t; the query is own token `length`)."""
        if window is None:
            return self.row_bias, None
        prompt_pos = prompt_positions(self.prompt_bias)[self.parent]
        far = prompt_pos <= (self.position - window)[:, None]
        own = torch.zeros(self.length + 1, device=self.row_bias.device)
        own[: max(0, self.length + 1 - window)] = float("-inf")
        return self.row_bias.masked_fill(far, float("-inf")), own

    def select(self, rows: torch.Tensor) -> RowBatch:
        """Only these rows, in this order (a row may repeat: a state that splits), and the prompts they use."""
        prompts, parent = torch.unique(self.parent[rows], return_inverse=True)
        return RowBatch(
            self.prompt_keys.index_select(1, prompts),
            self.prompt_values.index_select(1, prompts),
            self.prompt_bias.index_select(0, prompts),
            parent,
            self.keys.index_select(1, rows),
            self.values.index_select(1, rows),
            self.position.index_select(0, rows),
            self.length,
        )

    def make_room(self) -> None:
        """Double the capacity for generated tokens when it is full."""
        capacity = self.values.shape[3]
        if self.length < capacity:
            return
        self.keys = torch.cat([self.keys, torch.zeros_like(self.keys)], dim=4)
        self.values = torch.cat([self.values, torch.zeros_like(self.values)], dim=3)


class Decoder:
    """The prefill of a batch's prompts into a DecodeBatch, and one decode step (one new token per row) of a
    model over it, for the attention kind softmax over a key/value cache: the model's family says which of its
    modules play which part (ModelFamily.decode, steps/models/family.py DecodeModel), and projects each layer's
    queries, keys and values (DecodeLayer.project: its norms, its rotary embedding, multi-head latent attention's
    per-head keys and values).

    The same layers and arithmetic as the model's forward (steps/models/causal_lm.py), specialised to inference
    (decode: one query per row):
      - attention per prompt and kv head: one matrix product for the queries of all of the prompt's rows and
        all of its columns (prompt tokens and generated nodes, DecodeBatch), a bias keeping each row to its
        own, one softmax, one product with the values. On a RowBatch, in two parts under one softmax: the
        shared prompt keys the same way, the row's own keys with one small product per row and kv head. No
        kv head is ever expanded to its query heads (that copy of the whole cache per layer and step
        dominated decoding on CPU);
      - experts with gate and up projections fused into one matmul (SwiGLU; other kinds of experts, e.g.
        gpt-oss's clamped SwiGLU with biases, through their kind's forward, steps/models/moe.py
        ExpertArithmetic), each expert run once on its tokens; shared experts beside them;
      - per layer, optional attention sinks (an extra logit per query head in its softmax, dropped after it)
        and a sliding window (DecodeLayer.sinks / window).
    Both paths give the same logits up to float rounding; tests/test_engine_torch.py checks the log-probs
    against transformers.
    """

    def __init__(self, model: nn.Module) -> None:
        family = family_of(model)
        if family.attention != "softmax_kv_cache":
            raise MoerlError(
                f"the torch engine decodes softmax attention over a key/value cache; {family.name}'s attention "
                f"kind {family.attention!r} has no decoder here"
            )
        parts = family.decode(model)
        self.model, self.parts = model, parts
        self.key_dim, self.value_dim, self.kv_heads = parts.key_dim, parts.value_dim, parts.num_kv_heads
        self.num_heads = parts.num_heads
        self.groups = parts.num_heads // parts.num_kv_heads
        # Per SwiGLU MoE layer: [gate; up] of each expert as one [H, 2I] matrix, and down as [I, H] (x @ W
        # layout); a MoE layer of another kind of experts is run by its kind (None here: nothing copied).
        self.experts: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]] | None] = {}
        # While a list: each MoE layer's chosen experts [rows, k] of the forwards since it was set, in call order
        # (routing replay's record; TorchEngine.generate sets and reads it)
        self.routes: list[torch.Tensor] | None = None
        with torch.no_grad():
            for index, layer in enumerate(parts.layers):
                if isinstance(layer.mlp, SparseMoeBlock):
                    self.experts[index] = self._fused_experts(layer.mlp)

    @staticmethod
    def _fused_experts(block: SparseMoeBlock) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        if block.num_local_experts != block.num_experts:
            raise ValueError("TorchEngine needs every expert on this process (a full model)")
        if block.experts["0"].arithmetic is not SWIGLU:
            return None
        experts = [block.experts[str(e)].projections() for e in range(block.num_experts)]  # type: ignore[operator]
        gate_up = [torch.cat([gate.weight, up.weight]).t().contiguous() for gate, up, _ in experts]
        down = [down.weight.t().contiguous() for _, _, down in experts]
        return gate_up, down

    def refresh(self) -> None:
        """Recompute the fused copies from the model's current weights, into the tensors they already occupy
        (TorchEngine.update_weights): the same values __init__ computes; one expert's worth of scratch at a time."""
        with torch.no_grad():
            for index, layer in enumerate(self.parts.layers):
                layer.project.refresh()
                if self.experts.get(index) is not None:
                    block = layer.mlp
                    experts = [block.experts[str(e)].projections() for e in range(block.num_experts)]  # type: ignore[operator,union-attr]
                    gate_up, down = self.experts[index]  # type: ignore[misc]
                    for e, (gate, up, down_weight) in enumerate(experts):
                        gate_up[e].copy_(torch.cat([gate.weight, up.weight]).t())
                        down[e].copy_(down_weight.weight.t())

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of each prompt's queries over its columns, one matrix product per prompt and kv head:
        q [P * kv, M * g, Dk] (M query rows of the prompt, each with its g query heads; q carries the scale),
        keys [P * kv, C, Dk] and values [P * kv, C, Dv], bias [P, M, C] (0 or -inf), sinks [heads] or None
        -> [P * kv, M * g, Dv]."""
        prompts, rows, columns = bias.shape
        scores = torch.bmm(q, keys.transpose(1, 2))
        per_head = scores.view(prompts, self.kv_heads, rows, self.groups, columns)
        per_head.add_(bias[:, None, :, None, :])
        weights = torch.softmax(scores, dim=-1) if sinks is None else self._softmax(per_head, sinks).view(scores.shape)
        return torch.bmm(weights, values)

    def _softmax(self, scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax over the last dim of scores [..., kv, M, g, C]; with sinks [heads = kv * g], each head's sink
        is one more logit in its softmax, whose weight is dropped (gpt-oss)."""
        if sinks is None:
            return torch.softmax(scores, dim=-1)
        sink = sinks.to(scores.dtype).view(self.kv_heads, 1, self.groups, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]

    def _mlp(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> x + MLP(post-attention norm(x)) of layer `index`."""
        layer = self.parts.layers[index]
        h = layer.mlp_norm(x)
        return x + (self._experts(layer.mlp, index, h) if index in self.experts else layer.mlp(h))  # type: ignore[arg-type]

    def _windowed(self, index: int, positions: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """sees [P, W, W] (query, key) of a prefill restricted to layer `index`'s sliding window (key position >
        query position - window; a query always sees itself), as a 0/-inf bias."""
        window = self.parts.layers[index].window
        if window is not None:
            near = positions[:, None, :] > positions[:, :, None] - window
            sees = (sees & near) | torch.eye(sees.shape[-1], dtype=torch.bool, device=sees.device)
        return torch.zeros(sees.shape, device=sees.device).masked_fill_(~sees, float("-inf"))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.parts.norm(x), self.parts.output).float()

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, room: int) -> tuple[DecodeBatch, torch.Tensor]:
        """Left-padded prompts ids, valid [P, W] -> (their DecodeBatch, with `room` node columns to start with;
        next-token logits [P, V] float32). MoeForCausalLM.forward's arithmetic on a fresh cache: positions
        count real tokens from 0, a query sees the real tokens up to itself (and itself: padding stays
        finite), every token goes through the MLPs except in the last layer, where only the last position
        (the one whose logits are returned) needs to."""
        key_dim, value_dim, kv_heads, groups = self.key_dim, self.value_dim, self.kv_heads, self.groups
        prompts, width = ids.shape
        position = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
        rope = self.parts.rotary(position.view(-1))
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        sees = (causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=ids.device)
        biases = {window: None for window in {layer.window for layer in self.parts.layers}}
        shape = (len(self.parts.layers), prompts, kv_heads, width + room)
        dtype = self.parts.embed.weight.dtype
        keys = torch.zeros((*shape, key_dim), dtype=dtype, device=ids.device)
        values = torch.zeros((*shape, value_dim), dtype=dtype, device=ids.device)

        x = self.parts.embed(ids.view(-1))  # [P * W, H]
        last = len(self.parts.layers) - 1
        for index, layer in enumerate(self.parts.layers):
            q, k, v = layer.project(layer.attention_norm(x), rope)
            keys[index, :, :, :width] = k.view(prompts, width, kv_heads, key_dim).transpose(1, 2)
            values[index, :, :, :width] = v.view(prompts, width, kv_heads, value_dim).transpose(1, 2)
            q = q.view(prompts, width, kv_heads, groups, key_dim)
            bias = biases[layer.window]
            if bias is None:  # [P, W, W], per distinct window
                bias = biases[layer.window] = self._windowed(index, position, sees)
            if index == last:
                # Past the last layer's keys and values only the last position matters (its logits): the rest
                # of the layer runs on it alone (token by token arithmetic: the same values).
                q, bias, x = q[:, -1:], bias[:, -1:], x.view(prompts, width, -1)[:, -1]
            queries = q.shape[1]
            q = q.transpose(1, 2).reshape(-1, queries * groups, key_dim)
            columns = (
                keys[index].view(-1, width + room, key_dim)[:, :width],
                values[index].view(-1, width + room, value_dim)[:, :width],
            )
            out = self._attend(q, *columns, bias, layer.sinks).view(prompts, kv_heads, queries, groups, value_dim)
            x = x + layer.out(out.transpose(1, 2).reshape(x.shape[0], -1))
            x = self._mlp(index, x)
        prompt_bias = torch.zeros(valid.shape, device=ids.device).masked_fill_(~valid, float("-inf"))
        parent = torch.arange(prompts, device=ids.device)
        ancestors = torch.empty((prompts, 0), dtype=torch.long, device=ids.device)
        batch = DecodeBatch(keys, values, prompt_bias, parent, ancestors, width, position[:, -1] + 1)
        return batch, self._logits(x)

    def step(self, tokens: torch.Tensor, batch: DecodeBatch | RowBatch) -> torch.Tensor:
        """tokens [B] -> next-token logits [B, V] float32; appends the tokens to the batch."""
        if isinstance(batch, RowBatch):
            return self._row_step(tokens, batch)
        rows, kv_heads, groups = tokens.shape[0], self.kv_heads, self.groups
        key_dim, value_dim = self.key_dim, self.value_dim
        node = batch.add_nodes()
        biases = {window: batch.attention_bias(window) for window in {layer.window for layer in self.parts.layers}}
        rope = self.parts.rotary(batch.position)

        x = self.parts.embed(tokens)  # [B, H]
        for index, layer in enumerate(self.parts.layers):
            q, k, v = layer.project(layer.attention_norm(x), rope)
            keys, values = batch.keys[index], batch.values[index]  # [P, kv, N, Dk | Dv]
            keys.view(-1, key_dim).index_copy_(0, node, k.reshape(-1, key_dim))
            values.view(-1, value_dim).index_copy_(0, node, v.reshape(-1, value_dim))
            capacity = keys.shape[2]
            columns = (
                keys.view(-1, capacity, key_dim)[:, : batch.used],
                values.view(-1, capacity, value_dim)[:, : batch.used],
            )
            bias = biases[layer.window]  # [P, slots, used]
            out = self._attend(batch.to_grid(q.view(rows, kv_heads, groups, key_dim)), *columns, bias, layer.sinks)
            x = x + layer.out(batch.from_grid(out, kv_heads).view(rows, -1))
            x = self._mlp(index, x)
        batch.position += 1
        return self._logits(x)

    def row_capacity(self, length: int) -> int:
        """Room for a RowBatch's generated tokens: more than `length`, at least 8, and enough that the per-row
        attention products stay above SMALL_PRODUCT multiply-adds."""
        capacity = 8
        while capacity <= length or self.groups * self.key_dim * capacity <= SMALL_PRODUCT:
            capacity *= 2
        return capacity

    def _row_step(self, tokens: torch.Tensor, batch: RowBatch) -> torch.Tensor:
        """Decoder.step on a RowBatch: attention in two parts under one softmax, against the shared prompt
        keys (one product per prompt and kv head via the grid) and against the row's own keys (one small
        product per row and kv head)."""
        rows, kv_heads, groups = tokens.shape[0], self.kv_heads, self.groups
        key_dim, value_dim = self.key_dim, self.value_dim
        batch.make_room()
        slot, seen = batch.length, batch.length + 1
        prompts, width = batch.prompt_bias.shape
        rope = self.parts.rotary(batch.position)
        biases = {window: batch.window_bias(window) for window in {layer.window for layer in self.parts.layers}}

        x = self.parts.embed(tokens)  # [B, H]
        for index, layer in enumerate(self.parts.layers):
            q, k, v = layer.project(layer.attention_norm(x), rope)
            q = q.view(rows, kv_heads, groups, key_dim)
            batch.keys[index, :, :, :, slot] = k
            batch.values[index, :, :, slot] = v
            capacity = batch.values.shape[3]
            own_keys = batch.keys[index].view(rows * kv_heads, key_dim, capacity)  # zeros beyond `seen`
            own_values = batch.values[index].view(rows * kv_heads, capacity, value_dim)
            prompt_keys = batch.prompt_keys[index].view(prompts * kv_heads, key_dim, width)
            prompt_values = batch.prompt_values[index].view(prompts * kv_heads, width, value_dim)

            # Scores [B, kv, g, W + seen] against the prompt (via the grid) and the row's own tokens.
            to_prompt = batch.from_grid(torch.bmm(batch.to_grid(q), prompt_keys), kv_heads)
            to_own = torch.bmm(q.view(rows * kv_heads, groups, key_dim), own_keys)[:, :, :seen]
            row_bias, own_bias = biases[layer.window]
            to_prompt = to_prompt.add_(row_bias[:, None, None, :])
            to_own = to_own.view(rows, kv_heads, groups, seen)
            if own_bias is not None:
                to_own = to_own + own_bias
            scores = torch.cat([to_prompt, to_own], dim=-1)  # [B, kv, g, W + seen]
            weights = self._softmax(scores.unsqueeze(2), layer.sinks).squeeze(2)
            from_prompt = torch.bmm(batch.to_grid(weights[..., :width]), prompt_values)
            # Own keys and values are used up to the capacity (zero scores and weights beyond `seen`): whole
            # contiguous blocks, and products too big for PyTorch's slow path for tiny matrices (SMALL_PRODUCT).
            own_weights = F.pad(weights[..., width:], (0, capacity - seen)).view(rows * kv_heads, groups, capacity)
            from_own = torch.bmm(own_weights, own_values)
            out = batch.from_grid(from_prompt, kv_heads).view(rows, -1) + from_own.view(rows, -1)
            x = x + layer.out(out)
            x = self._mlp(index, x)
        batch.length += 1
        batch.position += 1
        return self._logits(x)

    def _experts(self, block: SparseMoeBlock, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The MoE block on hidden [T, H]: route, run each expert once on its tokens, combine the top-k."""
        fused = self.experts[index]
        _, topk_idx, topk_weight = block.route(hidden)
        if self.routes is not None:
            self.routes.append(topk_idx)
        num_tokens, top_k = topk_idx.shape
        order, inverse, counts = group_by_expert(topk_idx.reshape(-1), block.num_experts)  # slots by expert
        routed = hidden.index_select(0, order // top_k)
        out = torch.empty_like(routed)
        if fused is None:  # another kind of experts: its own forward over the grouped rows
            experts = block.local_experts()
            arithmetic = experts[0].arithmetic  # type: ignore[union-attr]
            weights = [w for expert in experts for w in expert.expert_weights()]  # type: ignore[operator]
            arithmetic.forward(routed, expert_spans(counts.tolist()), arithmetic.fuse(weights), out)
        else:
            gate_up, down = fused
            inner = down[0].shape[0]
            start = 0
            for expert, count in enumerate(counts.tolist()):
                if count:
                    act = torch.mm(routed[start : start + count], gate_up[expert])
                    torch.mm(F.silu(act[:, :inner]).mul_(act[:, inner:]), down[expert], out=out[start : start + count])
                    start += count
        # Back to token order [T, k, H], then the weighted sum over the k slots (no atomics: deterministic).
        per_slot = out.index_select(0, inverse).view(num_tokens, top_k, -1)
        weight = topk_weight.to(per_slot.dtype)
        combined = per_slot[:, 0] * weight[:, :1]
        for j in range(1, top_k):
            combined = torch.addcmul(combined, per_slot[:, j], weight[:, j : j + 1])
        shared = block.shared_output(hidden)
        return combined if shared is None else combined + shared
