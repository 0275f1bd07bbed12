"""Whether a run's trainer plan fits its GPUs: `moerl check` (pipelines/preflight.py) and `moerl simulate` refuse
a plan whose memory table (model_sizing.trainer_memory, under the config's settings) is over the trainer GPU's
memory, naming the biggest term and the settings that would make it fit, tried one change at a time, then two.

A plan is only judged where the GPU is known (the trainer's instance type, or --assume gpu_memory_gb): the local
executor's CPU has no such limit."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

from pipelines.simulate.model_sizing import MemoryTable, ModelSizing, reference_sizing
from pipelines.simulate.sizing import (
    GPU_ASSUMPTIONS,
    Assumptions,
    flops_seq_len,
    model_assumptions,
    rollout_memory_table,
    trainer_memory_table,
    trainer_ranks,
)
from steps.run.config import RunConfig


def with_trainer(cfg: RunConfig, **changes: Any) -> RunConfig:
    """The config with trainer fields changed (no validation: the candidates below stay within each field's
    rules and keep ep_size a divisor of the ranks)."""
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=changes)})


def _single_changes(cfg: RunConfig, m: ModelSizing) -> Iterator[dict[str, Any]]:
    """One setting at a time, the cheapest in time first: checkpointing (one more forward), FSDP of the non-expert
    parameters (their gathers and reduce-scatters), the experts' over their dp replicas, a larger EP group (more
    all-to-all, no more GPUs), a smaller micro-batch (more steps of less work), more trainer nodes."""
    t = cfg.trainer
    if not t.activation_checkpointing:
        yield {"activation_checkpointing": True}
    if not t.fsdp:
        yield {"fsdp": True}
    if not t.shard_experts:
        yield {"shard_experts": True}
    ranks = trainer_ranks(cfg)
    current_ep = t.ep_size or math.gcd(ranks, m.num_experts)
    for ep in sorted(d for d in range(current_ep + 1, ranks + 1) if ranks % d == 0 and m.num_experts % d == 0):
        yield {"ep_size": ep}
    size = t.micro_batch_size // 2
    while size >= 1:
        yield {"micro_batch_size": size}
        size //= 2
    # More nodes, each count the fewest that gives an EP group over every rank of a larger divisor of the experts
    per_node = ranks // t.nodes
    larger = sorted(d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0 and d > current_ep)
    options = {}
    for ep in larger:
        nodes = -(-ep // per_node)
        while (nodes * per_node) % ep:
            nodes += 1
        if nodes > t.nodes and nodes <= 8 * max(t.nodes, ep // per_node):
            options.setdefault(nodes, ep)
    for nodes, ep in sorted(options.items()):
        yield {"nodes": nodes, "ep_size": ep}


def fitting_changes(cfg: RunConfig, m: ModelSizing, a: Assumptions = GPU_ASSUMPTIONS, limit: int = 3) -> list[dict]:
    """Up to `limit` changes of the trainer's settings that make the plan fit: single ones first, then two, then
    three together (the first that fit of each size, cheapest first)."""
    singles = list(_single_changes(cfg, m))
    for size in (1, 2, 3):
        found: list[dict[str, Any]] = []
        for combo in itertools.combinations(singles, size):
            keys = [k for change in combo for k in change]
            if len(keys) != len(set(keys)):
                continue
            change = {k: v for c in combo for k, v in c.items()}
            if trainer_memory_table(with_trainer(cfg, **change), a, m).fits:
                found.append(change)
                if len(found) >= limit:
                    break
        if found:
            return found
    return []


def describe(change: dict[str, Any]) -> str:
    return " and ".join(f"trainer.{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in change.items())


def _moved(cfg: RunConfig, m: ModelSizing) -> Assumptions:
    return model_assumptions(GPU_ASSUMPTIONS, m, reference_sizing(), flops_seq_len(cfg, GPU_ASSUMPTIONS))


def rollout_pod_gpus(cfg: RunConfig) -> int:
    """The GPUs of one rollout pod (placement.rollout.resources.limits nvidia.com/gpu; 0 when none)."""
    value = str(cfg.placement["rollout"].resources.limits.get("nvidia.com/gpu", "0"))
    return int(value) if value.isdigit() else 0


def rollout_memory_problem(cfg: RunConfig, m: ModelSizing, a: Assumptions | None = None) -> str | None:
    """None when the rollout engine's weights leave room for a KV cache under rollout.sglang.mem_fraction (or
    the GPU is unknown); else one message with the engine sizes that would. A KV pool smaller than a chunk is no
    refusal: SGLang runs the chunk's sequences in turns (`moerl simulate` notes it)."""
    a = a or _moved(cfg, m)
    table, _ = rollout_memory_table(cfg, a, m)
    weights = table.rows[0][1]
    if not table.capacity_gb or weights < table.capacity_gb:
        return None
    sg = cfg.rollout.sglang
    pod_gpus = rollout_pod_gpus(cfg)  # an engine runs in one rollout pod (run config check)
    sizes = [n for n in (2, 4, 8, 16, 32, 64)
             if max(sg.tp_size, sg.ep_size) < n <= pod_gpus and m.num_experts % n == 0]  # fmt: skip
    fits = [n for n in sizes
            if rollout_memory_table(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={
                "sglang": sg.model_copy(update={"tp_size": n, "ep_size": n})})}), a, m)[0].rows[0][1]
            < table.capacity_gb * 0.8]  # fmt: skip
    fix = (f"set rollout.sglang.tp_size and ep_size to {fits[0]} (its KV cache then has room)" if fits
           else f"no engine of at most one rollout pod's {pod_gpus} GPUs holds its bf16 weights with room for a KV "
                "cache: a rollout node with more GPU memory, or a smaller model")  # fmt: skip
    return (f"rollout engine memory: {m.name} ({m.total / 1e9:,.1f}B parameters) takes {weights:,.1f} GB of bf16 "
            f"weights a GPU at TP {sg.tp_size} / EP {sg.ep_size}, no less than {table.budget} "
            f"{table.capacity_gb:,.0f} GB, leaving no KV cache; {fix}")  # fmt: skip


def trainer_memory_problem(cfg: RunConfig, m: ModelSizing, a: Assumptions | None = None) -> str | None:
    """None when the trainer's plan fits (or the GPU is unknown); else one message: the need, the GPU, the
    biggest term and what would fit. a: the assumptions (default: the GPU ones moved to model m)."""
    a = a or _moved(cfg, m)
    table: MemoryTable = trainer_memory_table(cfg, a, m)
    if table.fits is not False:
        return None
    what, gb = max(table.rows, key=lambda row: row[1])
    fixes = fitting_changes(cfg, m, a)
    fix = ("set " + "; or ".join(describe(c) for c in fixes)) if fixes else (
        "no trainer setting moerl has makes it fit on these GPUs; train on GPUs with more memory")
    return (f"trainer memory: {m.name} ({m.total / 1e9:,.1f}B parameters) under this plan needs "
            f"{table.total_gb:,.1f} GB a GPU, more than the {table.gpu}'s {table.capacity_gb:,.0f} GB; the biggest "
            f"term is {what} ({gb:,.1f} GB); {fix} (`moerl simulate` prints the table)")  # fmt: skip
