"""The policy-update loop: scored experience -> mini-batches -> PPO steps over the dp x ep mesh.

Read top to bottom: the settings, the deterministic batch plan (which samples each optimizer step sees, which
rank gets which, in which micro-batch; their tensors: steps/training/micro_batch.py), the trainer itself, and the
optimizer with its learning-rate schedule. The samples come from steps/experience/rollout_plan.py
(read_scored_experience); the optimizer state's files are steps/training/optimizer_state.py.

Determinism: the plan depends only on the experience, the run seed and the iteration (never on timing or
the number of rollout shards); every reduction has a fixed order; so a restarted update repeats the same
arithmetic and produces the same bits.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from steps.errors import MoerlError
from steps.experience.tables import Sample
from steps.expert_parallel.mesh import Mesh, all_reduce_sum, clip_grad_norm, gather_ranks, sync_gradients
from steps.models.causal_lm import MoeCausalLM
from steps.models.kernels import token_logprobs
from steps.models.layers import SelectionShape
from steps.models.placement import moe_layer_indices
from steps.training.micro_batch import MicroBatch, collate, collate_groups
from steps.training.mismatch import MismatchStats
from steps.training.optim import AdamW, AnyOptimizer
from steps.training.rl_loss import LossSettings, aggregate, token_entropy, token_terms
from steps.training.routes import check_routes, check_selections

if TYPE_CHECKING:
    from steps.run.config import RunConfig

# ----------------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSettings:
    loss: LossSettings = field(default_factory=LossSettings)
    micro_batch_size: int = 32
    epochs: int = 1
    steps_per_epoch: int = 1
    lr: float = 2e-4
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # after the warmup: "constant", "cosine" or "linear" to lr * lr_final_ratio
    lr_final_ratio: float = 0.0
    run_steps: int = 0  # the run's optimizer steps (iterations x epochs x steps_per_epoch): where a decay ends
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    old_logprobs: str = "recompute"  # or "behavior": see steps.run.config.TrainerConfig.old_logprobs
    shared_prompts: bool = False  # run each GRPO group's prompt once: see plan_group_steps, collate_groups
    sequence_packing: bool = False  # a micro-batch's sequences in one row without padding: see collate
    routing_replay: str = "none"  # "rollout": the policy's forwards use the engine's recorded experts (see train)
    # Leave samples with advantage exactly 0 out of the forward/backward when they cannot move the weights
    # (kl_coef 0): see trained_steps. False runs them anyway (same gradients; the tests' reference).
    skip_zero_advantage: bool = True
    seed: int = 0

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> TrainSettings:
        """The run's `trainer` section by field name (every LossSettings field, and the TrainSettings fields
        it has; the rest of it places the ranks: steps/update.py) and the run's seed."""
        section = dict(cfg.trainer)
        loss = LossSettings(**{f.name: section[f.name] for f in fields(LossSettings)})
        run_steps = cfg.iterations * cfg.trainer.epochs * cfg.trainer.steps_per_epoch
        # trainer.loss names the policy loss (LossSettings.loss), not TrainSettings.loss
        own = {f.name: section[f.name] for f in fields(cls) if f.name in section and f.name != "loss"}
        return cls(loss=loss, **own, seed=cfg.seed, run_steps=run_steps)

    @property
    def total_steps(self) -> int:
        return self.epochs * self.steps_per_epoch


# ----------------------------------------------------------------------------------------------------
# The batch plan
# ----------------------------------------------------------------------------------------------------


def plan_steps(num_samples: int, settings: TrainSettings, iteration: int) -> list[list[int]]:
    """Sample indices of each optimizer step, in order: per epoch a shuffle seeded by (seed, iteration,
    epoch), cut into steps_per_epoch contiguous mini-batches."""
    if num_samples < settings.steps_per_epoch:
        raise MoerlError(
            f"{num_samples} samples cannot fill trainer.steps_per_epoch={settings.steps_per_epoch} mini-batches; "
            "lower steps_per_epoch or generate more samples per iteration"
        )
    steps = []
    for epoch in range(settings.epochs):
        order = list(range(num_samples))
        random.Random(f"moerl-update/{settings.seed}/{iteration}/{epoch}").shuffle(order)
        steps += [chunk.tolist() for chunk in np.array_split(np.array(order), settings.steps_per_epoch)]
    return steps


def rank_micro_batches(step_indices: list[int], mesh: Mesh, micro_batch_size: int) -> list[list[int]]:
    """This rank's micro-batches of one step. Ranks take contiguous, near-equal slices of the mini-batch;
    every rank runs the same number of micro-batches (the MoE exchanges are collective), so a rank with too
    few samples gets empty micro-batches, which `collate` fills with a fully masked padding row."""
    shares = np.array_split(np.array(step_indices, dtype=np.int64), mesh.world_size)
    count = max(1, math.ceil(max(len(s) for s in shares) / micro_batch_size))
    return [chunk.tolist() for chunk in np.array_split(shares[mesh.rank], count)]


def prompt_groups(samples: list[Sample], indices: list[int] | None = None) -> list[list[int]]:
    """The sample indices (all, or `indices`) of each prompt_id, groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i in range(len(samples)) if indices is None else indices:
        groups.setdefault(samples[i].prompt_id, []).append(i)
    return list(groups.values())


def plan_group_steps(samples: list[Sample], settings: TrainSettings, iteration: int) -> list[list[int]]:
    """plan_steps for trainer.shared_prompts: per epoch a seeded shuffle of whole GRPO groups (the samples of
    one prompt_id), cut into steps_per_epoch contiguous mini-batches of groups; a step lists each group's
    samples together, so rank_group_micro_batches can keep them on one rank and in one micro-batch."""
    groups = prompt_groups(samples)
    if len(groups) < settings.steps_per_epoch:
        raise MoerlError(
            f"{len(groups)} prompts cannot fill trainer.steps_per_epoch={settings.steps_per_epoch} mini-batches "
            "with trainer.shared_prompts on (a prompt's samples stay in one step); lower steps_per_epoch, "
            "use more prompts per iteration or turn shared_prompts off"
        )
    steps = []
    for epoch in range(settings.epochs):
        order = list(range(len(groups)))
        random.Random(f"moerl-update/{settings.seed}/{iteration}/{epoch}/groups").shuffle(order)
        for chunk in np.array_split(np.array(order), settings.steps_per_epoch):
            steps.append([i for g in chunk.tolist() for i in groups[g]])
    return steps


def trained_steps(samples: list[Sample], plan: list[list[int]], settings: TrainSettings) -> list[list[int]]:
    """The plan without the samples whose gradient is exactly zero, when there are such samples.

    With kl_coef 0 a token's loss is -min(r A, clip(r) A) times its IS weight: with A = 0 (every sample of
    a GRPO group got the same reward) it is 0 whatever the weights, and so is its gradient. Such samples
    are not run; the loss normaliser stays that of the whole step (PolicyTrainer.normalizer), so the
    gradients are those of the full step. A step left empty still takes its optimizer step (AdamW moves the
    weights on momentum and weight decay), on padding rows only. Entropy and the IS-weight statistics are
    then over the trained tokens.
    """
    if not settings.skip_zero_advantage or settings.loss.kl_coef > 0:
        return plan
    return [[i for i in step if samples[i].advantage != 0.0] for step in plan]


def split_groups(groups: list[list[int]], parts: int) -> list[list[list[int]]]:
    """Cut a list of groups into `parts` contiguous runs of near-equal sample counts (some may be empty):
    cut j falls at the group boundary nearest to j/parts of the samples."""
    bounds = np.concatenate([[0], np.cumsum([len(g) for g in groups])])
    cuts = [0]
    for j in range(1, parts):
        target = bounds[-1] * j / parts
        cuts.append(max(cuts[-1], int(np.argmin(np.abs(bounds - target)))))
    cuts.append(len(groups))
    return [groups[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def rank_group_micro_batches(
    step_indices: list[int], samples: list[Sample], mesh: Mesh, micro_batch_size: int
) -> list[list[int]]:
    """rank_micro_batches for trainer.shared_prompts: whole groups only. Ranks take contiguous runs of groups
    with near-equal sample counts, cut into the same number of micro-batches on every rank (an empty one
    gets collate's padding row); a micro-batch holds whole groups, so it may exceed micro_batch_size by less
    than one group."""
    shares = split_groups(prompt_groups(samples, step_indices), mesh.world_size)
    largest = max(sum(len(g) for g in share) for share in shares)
    count = max(1, math.ceil(largest / micro_batch_size))
    return [[i for g in part for i in g] for part in split_groups(shares[mesh.rank], count)]


# ----------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------

# Statistics summed over micro-batches and ranks each step, in this order (one all-reduce per step).
_SUMS = ("loss", "pg_loss", "kl_sum", "clip_count", "is_weight_sum", "is_capped_count", "entropy_sum",
         "response_tokens", "real_tokens", "sequences", "aux_loss", "micro_batches")  # fmt: skip


@dataclass
class StepResult:
    loss: float
    pg_loss: float
    kl: float
    clip_fraction: float
    is_weight_mean: float
    is_weight_max: float | None  # None where the step trained no token (there is no extreme)
    is_weight_min: float | None
    is_capped_fraction: float
    entropy: float
    grad_norm: float
    response_tokens: int
    real_tokens: int
    sequences: int
    router_aux_loss: float = 0.0  # the routers' load-balancing term, mean over the micro-batches (0: off)


class PolicyTrainer:
    """Runs PPO steps on this rank's share of the batch; every rank calls the same methods in lockstep.

    optimizer: AdamW by default (settings.lr, betas, weight_decay); tests pass plain SGD.
    ref_model: the reference policy (v000000) with the same expert slice, needed when kl_coef > 0.
    """

    def __init__(
        self,
        model: MoeCausalLM,
        mesh: Mesh,
        settings: TrainSettings,
        optimizer: AnyOptimizer | None = None,
        ref_model: MoeCausalLM | None = None,
        pad_id: int = 0,
    ) -> None:
        if settings.loss.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs the reference model")
        self.model = model
        self.mesh = mesh
        self.settings = settings
        self.ref_model = ref_model
        self.pad_id = pad_id if pad_id is not None else 0
        self.optimizer = optimizer or new_adamw(model, settings)
        self.route_shape: tuple[int, int] | None = None  # (MoE layers, top_k) while the samples' routes are read
        # (indexer layers, index_topk) while the samples' key selections are read (DeepSeek sparse attention), and
        # [indexer layers, 2] the indexers' disagreement with them while counted (route_disagreement)
        self.selection_shape: SelectionShape | None = None
        self.selection_counts: torch.Tensor | None = None

    # -- forward pieces ------------------------------------------------------------------------------

    def forward_logprobs(self, model: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log p(target) [B, L], logits) of `model` on the micro-batch: logits [B, L, V], or [1, N, V] of the
        packed row (token_entropies reads either). The policy's forward sees the micro-batch's engine routes
        (compared with its routers', and replayed with routing_replay: rollout); the reference model's routers
        choose alone, as in slime, Miles and verl."""
        if model is not self.model or (mb.routes is None and mb.selections is None):
            return self._forward_logprobs(model, mb)
        replay = self.settings.routing_replay == "rollout"
        self.model.set_engine_routes(mb.routes, replay=replay)
        self.model.set_engine_selections(mb.selections, replay=replay)
        try:
            result = self._forward_logprobs(model, mb)
            counts = self.model.selection_disagreement()
            if counts is not None and self.selection_counts is not None:
                self.selection_counts += counts
            return result
        finally:
            self.model.set_engine_routes(None)
            self.model.set_engine_selections(None)

    def _forward_logprobs(self, model: nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if mb.packed is not None:
            p = mb.packed
            logits = model(p.input_ids, None, p.segment_ids)
            return p.unpack(token_logprobs(logits, p.targets)[0]), logits
        if mb.prompt_ids is not None:
            logits = model.forward_shared_prompts(  # type: ignore[operator]
                mb.prompt_ids, mb.prompt_mask, mb.input_ids, mb.attention_mask, mb.prompt_index
            )
        else:
            logits = model(mb.input_ids, mb.attention_mask)
        return token_logprobs(logits, mb.targets), logits

    @staticmethod
    def token_entropies(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
        """The next-token entropy [B, L] at every slot, from forward_logprobs' logits."""
        entropy = token_entropy(logits)
        return mb.packed.unpack(entropy[0]) if mb.packed is not None else entropy

    @torch.no_grad()
    def reference_logprobs(self, model: nn.Module, mb: MicroBatch) -> torch.Tensor:
        return self.forward_logprobs(model, mb)[0]

    # -- one optimizer step --------------------------------------------------------------------------

    def backward_step(
        self, micro_batches: list[MicroBatch], normalizer: float, mismatch: MismatchStats | None = None
    ) -> torch.Tensor:
        """Forward + backward of every micro-batch (gradients accumulate); returns the local sums of _SUMS.

        normalizer: the global count the loss is averaged over (response tokens for token-mean, sequences
        for seq-mean). Each micro-batch's loss is scaled by the world size, see steps.expert_parallel.
        """
        s = self.settings.loss
        sums = torch.zeros(len(_SUMS), dtype=torch.float64)
        is_max = torch.tensor(-math.inf, dtype=torch.float64)
        is_min = torch.tensor(math.inf, dtype=torch.float64)
        self.model.train()
        for mb in micro_batches:
            logp, logits = self.forward_logprobs(self.model, mb)
            old = mb.old_logp if mb.old_logp is not None else logp.detach()
            if mismatch is not None:  # the weights the samples were drawn for: before the first optimizer step
                mismatch.add(logp, mb.behavior_logp, mb.loss_mask)
            ref = self.reference_logprobs(self.ref_model, mb) if s.kl_coef > 0 else None
            terms = token_terms(logp, old, mb.behavior_logp, mb.advantages, mb.loss_mask, s, ref)
            loss = aggregate(terms.loss, terms.mask, s.loss_agg, normalizer)
            # The load-balancing term is a mean over this rank's micro-batches; the gradient sync averages the
            # ranks' (the policy loss, normalised by the global count, is scaled by the world size instead).
            aux = getattr(self.model, "aux_loss", None)
            total = loss * self.mesh.world_size
            if aux is not None:
                total = total + aux / len(micro_batches)
            total.backward()
            with torch.no_grad():
                mask = terms.mask
                entropy = torch.where(mask, self.token_entropies(mb, logits.detach()), torch.zeros_like(logp))
                weights = terms.is_weight[mask].double()
                sums += torch.stack([
                    loss.detach().double(),
                    aggregate(terms.pg, mask, s.loss_agg, normalizer).detach().double(),
                    terms.kl.sum().double(),
                    terms.clip_active.sum().double(),
                    weights.sum(),
                    terms.is_corrected.sum().double(),  # capped (tis) or masked (mis)
                    entropy.sum().double(),
                    mask.sum().double(),
                    torch.tensor(float(mb.num_real_tokens if mb.sample_ids else 0), dtype=torch.float64),
                    torch.tensor(float(len(mb.sample_ids)), dtype=torch.float64),
                    (aux.detach().double() if aux is not None else torch.zeros((), dtype=torch.float64)).cpu(),
                    torch.tensor(1.0, dtype=torch.float64),
                ]).cpu()  # fmt: skip
                if weights.numel():
                    is_max = torch.maximum(is_max, weights.max().cpu())
                    is_min = torch.minimum(is_min, weights.min().cpu())
        return torch.cat([sums, is_max.view(1), -is_min.view(1)])

    def step(
        self, micro_batches: list[MicroBatch], normalizer: float, mismatch: MismatchStats | None = None
    ) -> StepResult:
        """One optimizer step: accumulate, reduce the statistics, stop on a non-finite loss, sync and clip
        the gradients, update the weights. mismatch: add the step's tokens to it (before the step's update)."""
        local = self.backward_step(micro_batches, normalizer, mismatch)
        n = len(_SUMS)
        # one collective for the sums and the maxima: every rank's vector, reduced here in rank order
        per_rank = gather_ranks(local.to(self.mesh.device), self.mesh).cpu()
        summed, extremes = per_rank[:, :n].sum(0), per_rank[:, n:].max(0).values
        stats = dict(zip(_SUMS, summed.tolist(), strict=True))
        if not math.isfinite(stats["loss"]):
            self.optimizer.zero_grad(set_to_none=True)
            raise MoerlError(
                f"the policy loss is {stats['loss']} (not finite); nothing was written. Check the experience "
                "(advantages, behavior_logprobs) and the input checkpoint for inf/NaN, or lower trainer.lr"
            )
        sync_gradients(self.model, self.mesh)
        grad_norm = clip_grad_norm(self.model, self.mesh, self.settings.grad_clip)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise MoerlError(
                f"the gradient norm is {grad_norm} (not finite); nothing was written. Lower trainer.lr or "
                "check the input checkpoint"
            )
        set_learning_rate(self.optimizer, self.settings)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(stats["response_tokens"], 1.0)
        is_max, is_min = float(extremes[0]), float(-extremes[1])
        return StepResult(
            loss=stats["loss"], pg_loss=stats["pg_loss"], kl=stats["kl_sum"] / tokens,
            clip_fraction=stats["clip_count"] / tokens, is_weight_mean=stats["is_weight_sum"] / tokens,
            is_weight_max=is_max if math.isfinite(is_max) else None,
            is_weight_min=is_min if math.isfinite(is_min) else None,
            is_capped_fraction=stats["is_capped_count"] / tokens, entropy=stats["entropy_sum"] / tokens,
            grad_norm=grad_norm, response_tokens=int(stats["response_tokens"]),
            real_tokens=int(stats["real_tokens"]), sequences=int(stats["sequences"]),
            router_aux_loss=stats["aux_loss"] / max(stats["micro_batches"], 1.0),
        )  # fmt: skip

    # -- a whole iteration ---------------------------------------------------------------------------

    def normalizer(self, samples: list[Sample], step_indices: list[int]) -> float:
        """Global count for the loss mean of one step; every rank computes it from the same experience."""
        if self.settings.loss.loss_agg == "seq-mean":
            return float(len(step_indices))
        return float(sum(samples[i].num_trained_tokens for i in step_indices))

    @torch.no_grad()
    def old_logprobs(self, samples: list[Sample], plan: list[list[int]]) -> dict[int, torch.Tensor]:
        """log p(response) of this rank's samples under the weights before the update (for updates with
        more than one optimizer step). Runs the same micro-batches as training, so the exchanges match."""
        self.model.eval()
        out: dict[int, torch.Tensor] = {}
        for step_indices in plan:
            for mb in self.micro_batches(samples, step_indices):
                logp, _ = self.forward_logprobs(self.model, mb)
                for row, i in enumerate(mb.sample_ids):
                    out[i] = logp[row][mb.loss_mask[row]].cpu()
        return out

    def plan(self, samples: list[Sample], iteration: int) -> list[list[int]]:
        """The sample indices of each optimizer step (whole groups with shared_prompts)."""
        if self.settings.shared_prompts:
            return plan_group_steps(samples, self.settings, iteration)
        return plan_steps(len(samples), self.settings, iteration)

    def micro_batches(
        self, samples: list[Sample], step_indices: list[int], old: dict[int, torch.Tensor] | None = None
    ) -> list[MicroBatch]:
        """This rank's micro-batches of one step (grouped ones with shared_prompts), with the samples' routes
        once train() found them usable (route_shape)."""
        size, device = self.settings.micro_batch_size, self.mesh.device
        recorded = {"route_shape": self.route_shape, "selection_shape": self.selection_shape}
        if self.settings.shared_prompts:
            return [
                collate_groups(samples, ids, device, self.pad_id, old, **recorded)
                for ids in rank_group_micro_batches(step_indices, samples, self.mesh, size)
            ]
        return [
            collate(samples, ids, device, self.pad_id, old, packed=self.settings.sequence_packing, **recorded)
            for ids in rank_micro_batches(step_indices, self.mesh, size)
        ]

    def use_routes(self, samples: list[Sample]) -> None:
        """Read the samples' recorded routes from now on (route_shape) when they all have them (check_routes)."""
        blocks, replay = self.model.moe_blocks(), self.settings.routing_replay == "rollout"
        self.route_shape = self.selection_shape = None
        if blocks and check_routes(samples, len(blocks), blocks[0].top_k, blocks[0].num_experts, replay=replay):
            self.route_shape = (len(blocks), blocks[0].top_k)
        shape = self.model.selection_shape()
        if shape is not None and check_selections(samples, shape, replay=replay):
            self.selection_shape = shape

    def route_disagreement(self) -> dict[str, Any] | None:
        """The routing figures counted since model.count_route_disagreement (every rank's tokens; every rank
        calls it), over the tokens with a recorded route, overall and per MoE layer: router_disagreement, the share
        whose trainer routers' top-k set differs from the engine's; disagreement, the share whose experts the
        forward used differ from the engine's (the same without replay; 0 with it); `layers` the same per MoE
        layer, keyed by its decoder layer's index (a tracker logs update/routing/layers/<index>/...). None without
        routes."""
        counts = self.model.route_disagreement()
        selected, self.selection_counts = self.selection_counts, None
        if counts is None or self.route_shape is None:
            return None
        total = all_reduce_sum(counts.to(self.mesh.device), self.mesh).cpu().double()
        router, used, tokens = total[:, 0], total[:, 1], total[:, 2]
        indices = moe_layer_indices(self.model.config)
        indexer = None
        if selected is not None:  # every rank has it when one has: the samples decide (use_routes)
            differs, queries = all_reduce_sum(selected.to(self.mesh.device), self.mesh).cpu().double().unbind(1)
            indexer = {"disagreement": float(differs.sum() / queries.sum().clamp(min=1)), "queries": int(queries.sum()),
                       "layers": [float(d / max(q, 1)) for d, q in zip(differs, queries, strict=True)]}  # fmt: skip
        return {
            "indexer": indexer,
            "replay": self.settings.routing_replay == "rollout",
            "router_disagreement": float(router.sum() / tokens.sum().clamp(min=1)),
            "disagreement": float(used.sum() / tokens.sum().clamp(min=1)),
            "tokens": int(tokens.sum()),
            "layers": {
                str(index): {"router_disagreement": float(router[n] / max(tokens[n], 1)),
                             "disagreement": float(used[n] / max(tokens[n], 1)), "tokens": int(tokens[n])}
                for n, index in enumerate(indices)
            },  # fmt: skip
        }

    def train(
        self, samples: list[Sample], iteration: int, on_step: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """All optimizer steps of one iteration; returns the iteration's metrics (same on every rank).
        on_step(done, steps) is called before the first step and after each."""
        start = time.perf_counter()
        plan = self.plan(samples, iteration)
        trained = trained_steps(samples, plan, self.settings)
        self.use_routes(samples)
        old = None  # one step: the ratio's old policy is the current one, detached (see step)
        # The mismatch (steps/training/mismatch.py) and the routers' disagreement with the engine's routes: over
        # every trained sample when the update recomputes the old log-probs, else over the first step's, whose
        # forward runs before any update
        mismatch, recomputed, routing = MismatchStats(), False, None
        self.model.count_route_disagreement()
        if self.selection_shape is not None:
            self.selection_counts = torch.zeros(self.selection_shape.layers, 2, dtype=torch.int64)
        if len(plan) > 1 and self.settings.old_logprobs == "behavior":  # the engine's: no extra forward pass
            old = {i: torch.tensor(s.trained(s.behavior_logprobs), dtype=torch.float32) for i, s in enumerate(samples)}
        elif len(plan) > 1:
            old, recomputed = self.old_logprobs(samples, trained), True
            routing = self.route_disagreement()
            for i, logp in old.items():  # this rank's trained samples (every rank adds its own)
                behaviour = torch.tensor(samples[i].trained(samples[i].behavior_logprobs))
                mismatch.add(logp, behaviour, torch.ones(len(logp)))
        results = []
        if on_step is not None:
            on_step(0, len(plan))
        for step_indices, trained_indices in zip(plan, trained, strict=True):
            micro = self.micro_batches(samples, trained_indices, old)
            first = not results and not recomputed
            results.append(self.step(micro, self.normalizer(samples, step_indices), mismatch if first else None))
            if first:
                routing = self.route_disagreement()
            if on_step is not None:
                on_step(len(results), len(plan))
        self.route_shape = self.selection_shape = None
        seconds = time.perf_counter() - start
        metrics = iteration_metrics(results, seconds)
        metrics["mismatch"] = mismatch.reduce(self.mesh)
        metrics["routing"] = routing
        metrics["zero_advantage_skipped"] = sum(len(p) - len(t) for p, t in zip(plan, trained, strict=True))
        return metrics


def iteration_metrics(results: list[StepResult], seconds: float) -> dict[str, Any]:
    """Per-iteration metrics: token-weighted means over the steps, the last grad norm, throughput."""
    tokens = sum(r.response_tokens for r in results) or 1

    def mean(attr: str) -> float:
        return sum(getattr(r, attr) * r.response_tokens for r in results) / tokens

    real_tokens = sum(r.real_tokens for r in results)
    return {
        "loss": sum(r.loss for r in results) / len(results),
        "pg_loss": sum(r.pg_loss for r in results) / len(results),
        "kl": mean("kl"),
        "clip_fraction": mean("clip_fraction"),
        "entropy": mean("entropy"),
        "is_weight": {
            "mean": mean("is_weight_mean"),
            "min": min((r.is_weight_min for r in results if r.is_weight_min is not None), default=None),
            "max": max((r.is_weight_max for r in results if r.is_weight_max is not None), default=None),
            "capped_fraction": mean("is_capped_fraction"),
        },
        "router_aux_loss": sum(r.router_aux_loss for r in results) / len(results),
        "grad_norm": results[-1].grad_norm,
        "grad_norms": [r.grad_norm for r in results],
        "steps": len(results),
        "sequences": sum(r.sequences for r in results),
        "response_tokens": sum(r.response_tokens for r in results),
        "tokens": real_tokens,
        "seconds": seconds,
        "tokens_per_s": real_tokens / seconds if seconds > 0 else 0.0,
    }


# ----------------------------------------------------------------------------------------------------
# Optimizer and its state as tensors
# ----------------------------------------------------------------------------------------------------


def new_adamw(model: nn.Module, settings: TrainSettings) -> AdamW:
    # steps.training.optim.AdamW: torch.optim.AdamW(foreach=False)'s arithmetic, one parameter at a time (the same
    # whatever the parameter grouping), without the torch._dynamo import that any torch.optim optimizer costs
    return AdamW(model.parameters(), lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)


def completed_steps(optimizer: AnyOptimizer) -> int:
    """Optimizer steps taken so far in the run: AdamW's per-parameter count, which travels with the optimizer
    state from one iteration's update to the next (0 for an optimizer without that state)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0


def warmup_lr(settings: TrainSettings, completed: int) -> float:
    """The learning rate of the run's optimizer step number completed + 1: a linear ramp over warmup_steps, then
    the schedule (scheduled_lr).

    A fresh Adam's first updates are lr * sign(gradient) on every weight (its second moments hold one noisy
    sample): at lr 4e-4 that cost an addition3 SFT policy 15 points of held-out accuracy in one iteration."""
    step = completed + 1
    if settings.warmup_steps > 0 and step <= settings.warmup_steps:
        return settings.lr * step / settings.warmup_steps
    return scheduled_lr(settings, step)


def scheduled_lr(settings: TrainSettings, step: int) -> float:
    """trainer.lr_schedule after the warmup, for optimizer step `step` (1-based) of the run's run_steps: progress
    p = (step - warmup - 1) / (run_steps - warmup - 1) in [0, 1] (the first step after the warmup takes lr, the
    run's last lr * f); cosine lr * (f + (1 - f) (1 + cos(pi p)) / 2) (Loshchilov
    and Hutter 2017, SGDR, without restarts; transformers' cosine_with_min_lr with min_lr_rate f), linear
    lr * (1 - (1 - f) p), f = lr_final_ratio; the last step of the run takes lr * f. constant: lr."""
    if settings.lr_schedule == "constant" or settings.run_steps <= settings.warmup_steps:
        return settings.lr
    span = max(settings.run_steps - settings.warmup_steps - 1, 1)
    progress = min(max((step - settings.warmup_steps - 1) / span, 0.0), 1.0)
    final = settings.lr_final_ratio
    if settings.lr_schedule == "cosine":
        return settings.lr * (final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    if settings.lr_schedule == "linear":
        return settings.lr * (1.0 - (1.0 - final) * progress)
    raise ValueError(f"lr_schedule {settings.lr_schedule!r}: use 'constant', 'cosine' or 'linear'")


def set_learning_rate(optimizer: AnyOptimizer, settings: TrainSettings) -> float:
    """Set the rate of the optimizer's next step (warmup_lr: the warmup, then the schedule) and return it."""
    lr = warmup_lr(settings, completed_steps(optimizer))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
