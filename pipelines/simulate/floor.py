"""The physical floor of an iteration: what no design could beat on the config's GPUs and network, so a reader
of `moerl simulate` sees how far the config's iteration time is from the limit.

    rollout   every engine generates its share of the iteration's samples as one batch (in waves when its KV
              pool cannot hold them all at full length): the model's tokens of a sample (max_new_tokens x
              response_fill; with an environment its turns': sizing.model_tokens) decode steps a wave, each no shorter
              than its compute (the batch's tokens x the forward FLOPs of a token, on the engine's GPUs at their
              peak dense bf16 rate) nor its memory traffic (the engine's weights on each GPU and the batch's KV
              cache read once, at the GPU's HBM bandwidth); prefill is left out (it is compute the same way), so
              are an environment's observations (prefill) and its steps (a design can overlap them with others'
              decoding)
    training  the iteration's tokens (prompt and response, with an environment its observations included) x the
              training FLOPs of a token (6N + attention: model_sizing), over every trainer GPU at its peak dense
              bf16 rate: model FLOPs only, so activation checkpointing's extra forward and the log-prob pass are
              the design's, not the floor's
    weights   the bytes a rollout node must receive per version (the delta when the run writes deltas, else the
              whole version) at the node's network bandwidth

Synchronous, the three follow each other; asynchronous (staleness 1), generation overlaps the rest: the floor is
the longer of the rollout and training + weights. Peak rates are the vendors' datasheet figures (GPU_SPECS,
INSTANCE_NETWORK_GBPS); a config's ratio to the floor is its iteration time over this.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.simulate.model_sizing import GB, ModelSizing
from pipelines.simulate.sizing import (
    Assumptions,
    cluster_for,
    delta_gb,
    padded_seq_len,
    response_tokens,
    rollout_gpu,
    sampled_tokens,
    trainer_gpu,
    trainer_ranks,
)
from steps.run.config import RunConfig

# Dense bf16 TFLOPS (without sparsity) and HBM TB/s of one GPU, from NVIDIA's datasheets: H100 SXM5 989 TFLOPS
# ("1,979 with sparsity"), 3.35 TB/s; H200 SXM 989 TFLOPS, 4.8 TB/s; B200 (HGX B200: 18 PFLOPS FP16/BF16 with
# sparsity for 8 GPUs) 2,250 TFLOPS, 8 TB/s; A100 SXM 312 TFLOPS, 2.039 TB/s (80 GB) and 1.555 TB/s (40 GB).
GPU_SPECS: dict[str, tuple[float, float]] = {
    "H100": (989.0, 3.35),
    "H200": (989.0, 4.8),
    "B200": (2250.0, 8.0),
    "A100 80GB": (312.0, 2.039),
    "A100 40GB": (312.0, 1.555),
}
# A node's network in Gbit/s (the EC2 instance type pages: EFA on the p5, p5en and p6 families).
INSTANCE_NETWORK_GBPS: dict[str, float] = {
    "p5en.48xlarge": 3200.0,
    "p5e.48xlarge": 3200.0,
    "p5.48xlarge": 3200.0,
    "p5.4xlarge": 100.0,
    "p6-b200.48xlarge": 3200.0,
    "p4de.24xlarge": 400.0,
    "p4d.24xlarge": 400.0,
}


@dataclass(frozen=True)
class Floor:
    rollout_s: float
    training_s: float
    weights_s: float
    rollout_note: str
    training_note: str
    weights_note: str

    @property
    def sync_s(self) -> float:
        return self.rollout_s + self.training_s + self.weights_s

    @property
    def async_s(self) -> float:
        return max(self.rollout_s, self.training_s + self.weights_s)

    def lines(self, sync_s: float, async_s: float) -> list[str]:
        return [
            f"  rollout   {self.rollout_s:10,.1f} s  ({self.rollout_note})",
            f"  training  {self.training_s:10,.1f} s  ({self.training_note})",
            f"  weights   {self.weights_s:10,.1f} s  ({self.weights_note})",
            f"  an iteration's floor: {self.sync_s:,.1f} s sync, {self.async_s:,.1f} s async; this config: "
            f"{sync_s:,.1f} s = {sync_s / self.sync_s:.1f}x the floor sync, {async_s:,.1f} s = "
            f"{async_s / self.async_s:.1f}x async",
        ]


def _spec(gpu: str) -> tuple[float, float] | None:
    name = gpu.split(",")[0].strip()
    return GPU_SPECS.get(name)


def physical_floor(cfg: RunConfig, m: ModelSizing, a: Assumptions) -> Floor | None:
    """The floor of one iteration of `cfg` for model `m` (module docstring); None when a pool's GPU is unknown."""
    rollout_name, rollout_capacity = rollout_gpu(cfg)
    trainer_name, _ = trainer_gpu(cfg, a)
    rollout_spec, trainer_spec = _spec(rollout_name), _spec(trainer_name)
    if rollout_spec is None or trainer_spec is None:
        return None
    cluster = cluster_for(cfg, a)
    sg = cfg.rollout.sglang
    engine_gpus = max(sg.tp_size, sg.ep_size, 1)
    engines = max(1, cluster.rollout.nodes * max(cluster.rollout.gpus_per_node, engine_gpus) // engine_gpus)
    samples = cfg.prompts_per_iteration * cfg.group_size
    per_engine = -(-samples // engines)
    response = response_tokens(cfg, a)  # after the first prompt; with an environment observations too
    mean_context = a.prompt_tokens + response / 2
    weights_gb = m.engine_weight_bytes(sg.tp_size, sg.ep_size) / GB
    kv_token_gb = m.kv_bytes_per_token(sg.tp_size) / GB
    pool_gb = max(sg.mem_fraction * rollout_capacity - weights_gb, 0.0)
    state_gb = m.sequence_state_bytes(sg.tp_size) / GB  # a linear-attention layer's state, whatever the length
    full_seq_gb = kv_token_gb * padded_seq_len(cfg, a) + state_gb
    batch = max(1, min(per_engine, int(pool_gb / full_seq_gb))) if full_seq_gb else per_engine
    waves = -(-per_engine // batch)  # batches one after the other (not a conversation's turns)
    tflops, hbm = rollout_spec
    forward_flops = m.flops_per_token(mean_context) / 3  # a token's forward: a third of forward + backward
    compute_s = batch * forward_flops / (engine_gpus * tflops * 1e12)
    memory_s = (weights_gb + batch * (mean_context * kv_token_gb + state_gb)) / (hbm * 1e3)  # GB at TB/s
    step_s = max(compute_s, memory_s)
    rollout_s = sampled_tokens(cfg, a, waves) * step_s  # waves x the model's tokens of a sample: its decode steps
    bound = "compute" if compute_s >= memory_s else "HBM"
    rollout_note = (f"{engines} engines of {engine_gpus} {rollout_name}s, {per_engine:,} sequences each in {waves} "
                    f"wave(s) of {batch:,}; a decode step {step_s * 1e3:.1f} ms, {bound}-bound")  # fmt: skip

    train_tokens = samples * (a.prompt_tokens + response) * cfg.trainer.epochs
    ttflops, _ = trainer_spec
    seq = a.prompt_tokens + response
    training_s = train_tokens * m.flops_per_token(seq) / (trainer_ranks(cfg) * ttflops * 1e12)
    training_note = (f"{train_tokens:,.0f} tokens x {m.flops_per_token(seq):.3g} FLOPs on {trainer_ranks(cfg)} "
                     f"{trainer_name}s at {ttflops:,.0f} TFLOPS")  # fmt: skip

    instance = cfg.placement["rollout"].node_selector.get("node.kubernetes.io/instance-type", "")
    gbps = INSTANCE_NETWORK_GBPS.get(instance, 0.0)
    moved_gb = delta_gb(a) if cfg.checkpoint.deltas and cfg.rollout.servers else m.version_bytes / GB
    weights_s = moved_gb / (gbps / 8) if gbps else 0.0
    weights_note = (f"{moved_gb:,.1f} GB a rollout node at {gbps / 8:,.0f} GB/s" if gbps
                    else "the rollout node's network is unknown")  # fmt: skip
    return Floor(rollout_s, training_s, weights_s, rollout_note, training_note, weights_note)
