"""A micro-batch's tensors (MicroBatch), in each layout the trainer runs: plain rows (right-padded, prompt then
response), packed rows (trainer.sequence_packing: the real tokens one sequence after another, PackedRow) and shared
prompts (trainer.shared_prompts: each GRPO group's prompt once, then its responses), with the samples' recorded routes
and key selections laid out as the forward sees its tokens (steps/training/routes.py). Built in numpy from the
samples' token lists: this runs for every micro-batch of every step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from steps.errors import MoerlError
from steps.experience.tables import Sample
from steps.models.layers import SelectionShape
from steps.training.routes import (
    forward_selections,
    routes_tensor,
    sample_routes,
    selection_grid,
    shared_prompt_selections,
)


@dataclass
class PackedRow:
    """A micro-batch's sequences in one row [1, N] without padding: input_ids and targets of every real token,
    segment_ids the row of [B, L] each came from, and index each one's flat slot in [B, L] (row-major), so
    per-token values of the packed forward go back to the [B, L] layout (unpack)."""

    input_ids: torch.Tensor  # [1, N] long
    segment_ids: torch.Tensor  # [1, N] long
    targets: torch.Tensor  # [1, N] long
    index: torch.Tensor  # [N] long
    shape: tuple[int, int]  # (B, L)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """values [N] (one per packed token) -> [B, L], zero at the padding slots (differentiable)."""
        rows, length = self.shape
        return values.new_zeros(rows * length).index_put((self.index,), values).view(rows, length)


@dataclass
class MicroBatch:
    """One row per sample. Plain (collate): right-padded sequences prompt + response, shifted for next-token
    targets; position p predicts targets[p] = token p+1.

    Shared prompts (collate_groups, prompt_ids set): the group's prompts once, left-padded, in prompt_ids;
    input_ids holds each response without its last token, right-padded ([B, T]); targets and the per-token
    tensors are [B, T + 1] with slot t predicting response token t (see MoeCausalLM.forward_shared_prompts).

    Either way loss_mask marks the slots whose target is a response token, where behavior_logp holds the
    engine's log-prob of that token.

    Packed (collate with packed=True, trainer.sequence_packing): the per-token tensors keep the [B, L] layout
    the loss reads, and `packed` holds what the forward runs instead: the rows' real tokens one sequence after
    another in one row, without padding.
    """

    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    targets: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L] bool
    behavior_logp: torch.Tensor  # [B, L] float32
    advantages: torch.Tensor  # [B] float32
    old_logp: torch.Tensor | None = None  # [B, L], set when the update has more than one optimizer step
    prompt_ids: torch.Tensor | None = None  # [G, P] long, shared prompts only
    prompt_mask: torch.Tensor | None = None  # [G, P] long
    prompt_index: torch.Tensor | None = None  # [B] long: each row's prompt row
    packed: PackedRow | None = None  # sequence packing only
    # [MoE layers, T, k] the experts the engine routed the forward's T tokens to (in the order the MoE layers see
    # them: the packed row's, else input_ids flattened, or the shared prompts then the responses), -1 where none
    routes: torch.Tensor | None = None
    # The keys the engine's indexers selected (a model with DeepSeek sparse attention): per forward call ("forward",
    # or "prompts" and "responses" with shared prompts) the (bits, recorded) of its RecordedSelection
    # (steps/models/layers.py), laid out as that call's queries and keys
    selections: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_real_tokens(self) -> int:
        """Tokens the forward runs (padding excluded): a shared prompt counts once."""
        prompt_tokens = 0 if self.prompt_mask is None else int(self.prompt_mask.sum())
        return int(self.attention_mask.sum()) + prompt_tokens


def collate(
    samples: list[Sample],
    ids: list[int],
    device: torch.device,
    pad_id: int = 0,
    old_logps: dict[int, torch.Tensor] | None = None,
    packed: bool = False,
    route_shape: tuple[int, int] | None = None,
    selection_shape: SelectionShape | None = None,
) -> MicroBatch:
    """The plain micro-batch (MicroBatch) of samples `ids`; packed=True also packs its real tokens into one row
    for the forward (PackedRow); route_shape (MoE layers, top_k): with the samples' recorded routes;
    selection_shape (the model's indexers): with their recorded key selections."""
    if not ids:  # see rank_micro_batches: one padding token, no loss, still takes part in the exchanges
        zero_long = torch.full((1, 1), pad_id, dtype=torch.long, device=device)
        zero = torch.zeros((1, 1), device=device)
        routes = selections = None
        if route_shape is not None:
            routes = torch.full((route_shape[0], 1, route_shape[1]), -1, dtype=torch.long, device=device)
        if selection_shape is not None:
            selections = {"forward": selection_grid([], selection_shape.layers, (1, 1, 1), device)}
        return MicroBatch(
            [], zero_long, torch.ones_like(zero_long), zero_long, torch.zeros_like(zero, dtype=torch.bool),
            zero, torch.zeros(1, device=device), zero if old_logps is not None else None, routes=routes,
            selections=selections,
        )  # fmt: skip
    # Built in numpy from flat token lists and masks: a torch op per row costs ~10 us, and this runs for every
    # micro-batch of every step (it was a tenth of the update's CPU time).
    rows = [samples[i] for i in ids]
    lengths = np.array([s.num_tokens for s in rows])  # prompt + response
    starts = np.array([len(s.prompt_ids) - 1 for s in rows])  # the first response token is predicted here
    columns = np.arange(lengths.max())
    tokens = np.full((len(rows), len(columns)), pad_id, dtype=np.int64)
    tokens[columns < lengths[:, None]] = np.fromiter(
        (t for s in rows for t in (*s.prompt_ids, *s.response_ids)), dtype=np.int64, count=int(lengths.sum())
    )
    columns = columns[:-1]
    attention = columns < (lengths - 1)[:, None]
    loss_mask = attention & (columns >= starts[:, None])
    if any(s.loss_mask is not None for s in rows):  # multi-turn: the environment's tokens are context only
        loss_mask[loss_mask] = np.concatenate(
            [np.ones(len(s.response_ids), dtype=bool) if s.loss_mask is None else s.loss_mask for s in rows]
        )
    behavior = np.zeros(loss_mask.shape, dtype=np.float32)
    behavior[loss_mask] = np.fromiter((x for s in rows for x in s.trained(s.behavior_logprobs)), dtype=np.float32)
    old = None
    if old_logps is not None:
        old = torch.zeros(loss_mask.shape, dtype=torch.float32)
        old[torch.from_numpy(loss_mask)] = torch.cat([old_logps[i] for i in ids]).to(torch.float32)
    input_ids = np.where(attention, tokens[:, :-1], pad_id)
    advantages = np.array([s.advantage for s in rows], dtype=np.float32)
    to = {"device": device}
    routes = None
    if route_shape is not None:  # position p of a row is its sequence's position p: the first length - 1 slots
        grid = np.full((*attention.shape, *route_shape), -1, dtype=np.int16)
        grid[attention] = np.concatenate([sample_routes(s, route_shape) for s in rows])
        routes = grid.reshape(-1, *route_shape)
    selections = None
    if selection_shape is not None:  # a row's slot p is its sequence's position p; packed: after the earlier rows'
        selections = {"forward": forward_selections(rows, attention.sum(axis=1), attention.shape[1], packed,
                                                    selection_shape, device)}  # fmt: skip
    row = None
    if packed:  # the real slots in row-major order: each sequence whole, one after another
        index = np.flatnonzero(attention)
        if routes is not None:
            routes = routes[index]
        segments = np.repeat(np.arange(len(rows)), attention.sum(axis=1))
        row = PackedRow(
            torch.from_numpy(input_ids.reshape(-1)[index][None]).to(**to), torch.from_numpy(segments[None]).to(**to),
            torch.from_numpy(np.ascontiguousarray(tokens[:, 1:]).reshape(-1)[index][None]).to(**to),
            torch.from_numpy(index).to(**to), attention.shape,
        )  # fmt: skip
    return MicroBatch(
        list(ids), torch.from_numpy(input_ids).to(**to), torch.from_numpy(attention.astype(np.int64)).to(**to),
        torch.from_numpy(np.ascontiguousarray(tokens[:, 1:])).to(**to), torch.from_numpy(loss_mask).to(**to),
        torch.from_numpy(behavior).to(**to), torch.from_numpy(advantages).to(**to),
        None if old is None else old.to(**to), packed=row, routes=routes_tensor(routes, device),
        selections=selections,
    )  # fmt: skip


def collate_groups(
    samples: list[Sample],
    ids: list[int],
    device: torch.device,
    pad_id: int = 0,
    old_logps: dict[int, torch.Tensor] | None = None,
    route_shape: tuple[int, int] | None = None,
    selection_shape: SelectionShape | None = None,
) -> MicroBatch:
    """A shared-prompt micro-batch (see MicroBatch) of whole groups: each prompt_id's prompt once (its routes and
    key selections those its first sample recorded: the engine ran the prompt once for its group)."""
    if not ids:
        return collate(samples, ids, device, pad_id, old_logps, route_shape=route_shape,
                       selection_shape=selection_shape)  # fmt: skip
    prompts: dict[str, list[int]] = {}
    for i in ids:
        s = samples[i]
        prompt = prompts.setdefault(s.prompt_id, s.prompt_ids)
        if prompt != s.prompt_ids:
            raise MoerlError(
                f"samples of prompt_id {s.prompt_id!r} have different prompt_ids; trainer.shared_prompts needs "
                "one prompt per prompt_id: fix the experience or turn shared_prompts off"
            )
    row_of = {prompt_id: row for row, prompt_id in enumerate(prompts)}
    prompt_len = max(len(p) for p in prompts.values())
    prompt_ids = torch.full((len(prompts), prompt_len), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), prompt_len), dtype=torch.long)
    for row, prompt in enumerate(prompts.values()):  # left padding: the last column is the last prompt token
        prompt_ids[row, prompt_len - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, prompt_len - len(prompt) :] = 1

    batch, length = len(ids), max(len(samples[i].response_ids) for i in ids)
    input_ids = torch.full((batch, length - 1), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, length - 1), dtype=torch.long)
    targets = torch.full((batch, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((batch, length), dtype=torch.bool)
    behavior = torch.zeros((batch, length), dtype=torch.float32)
    old = torch.zeros((batch, length), dtype=torch.float32) if old_logps is not None else None
    for row, i in enumerate(ids):
        s = samples[i]
        n = len(s.response_ids)
        response = torch.tensor(s.response_ids, dtype=torch.long)
        input_ids[row, : n - 1] = response[:-1]
        attention[row, : n - 1] = 1
        targets[row, :n] = response
        loss_mask[row, :n] = True if s.loss_mask is None else torch.from_numpy(s.loss_mask)
        behavior[row, :n] = torch.tensor(s.behavior_logprobs, dtype=torch.float32)
        if old is not None:
            old[row][loss_mask[row]] = old_logps[i]  # type: ignore[index]
    prompt_index = torch.tensor([row_of[samples[i].prompt_id] for i in ids], dtype=torch.long)
    advantages = torch.tensor([samples[i].advantage for i in ids], dtype=torch.float32)
    routes = None
    if route_shape is not None:
        first: dict[str, Sample] = {}
        for i in ids:
            first.setdefault(samples[i].prompt_id, samples[i])
        prompt_routes = np.full((len(prompts), prompt_len, *route_shape), -1, dtype=np.int16)
        for row, prompt_id in enumerate(prompts):
            n = len(prompts[prompt_id])
            prompt_routes[row, prompt_len - n :] = sample_routes(first[prompt_id], route_shape)[:n]
        response_routes = np.full((batch, length - 1, *route_shape), -1, dtype=np.int16)
        for row, i in enumerate(ids):
            n, p = len(samples[i].response_ids), len(samples[i].prompt_ids)
            response_routes[row, : n - 1] = sample_routes(samples[i], route_shape)[p:]
        routes = np.concatenate([prompt_routes.reshape(-1, *route_shape), response_routes.reshape(-1, *route_shape)])
    selections = None
    if selection_shape is not None:
        selections = shared_prompt_selections(samples, ids, list(prompts), prompt_len, length - 1, selection_shape,
                                              device)  # fmt: skip
    to = {"device": device}
    return MicroBatch(
        list(ids), input_ids.to(**to), attention.to(**to), targets.to(**to), loss_mask.to(**to),
        behavior.to(**to), advantages.to(**to), None if old is None else old.to(**to),
        prompt_ids.to(**to), prompt_mask.to(**to), prompt_index.to(**to), routes=routes_tensor(routes, device),
        selections=selections,
    )  # fmt: skip
