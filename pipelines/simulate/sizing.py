"""What the simulator is given: the assumptions a config does not state, the cluster's pools, and each step's
seconds (derived from the config and the assumptions, or measured)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipelines.workflow import commands
from steps.errors import MoerlError
from steps.run_config import RunConfig

GPU = "nvidia.com/gpu"
# Step kinds: the workflow's template names. engine_startup is the part of a rollout shard spent before it
# generates (pod start, model load); a measured rollout figure includes it.
STEP_KINDS = ("plan", "import-sft", "rollout", "score", "update", "publish", "report", "next-segment")
ENGINE_STARTUP = "engine_startup"


@dataclass(frozen=True)
class Assumptions:
    """What the config does not say. Every field can be overridden: `moerl simulate --assume NAME=VALUE`.

    Throughputs count sampled response tokens. "Per GPU" reads "per process" for a config without GPUs.
    """

    rollout_tokens_per_gpu_s: float  # decode throughput of the rollout engine at large batch
    trainer_tokens_per_gpu_s: float  # forward + backward (+ log-prob recompute) of the update
    engine_startup_s: float  # a rollout pod before its first token: process, engine, model load, graphs
    trainer_startup_s: float  # an update before its first step: rendezvous, comm init, weights + AdamW state
    pod_start_s: float  # Argo notices the task, the pod is scheduled and its container starts
    step_startup_s: float  # a Python step's own start: interpreter, imports, run.json
    score_samples_per_s: float  # rule verifiers (and the reward model, if any) on the score pod
    import_sft_s: float  # copy the SFT checkpoint into the run store as v000000
    publish_s: float  # verify the candidate's digests, assemble the HF dir, store AdamW state, move LATEST
    report_s: float  # metrics table and the reward/accuracy PNG
    node_replacement_s: float  # a reclaimed Spot node until its replacement has joined the pool
    response_fill: float = 1.0  # mean response length as a share of max_new_tokens (1: all run to the cap)
    rollout_nodes: int = 0  # nodes of the rollout pool; 0: one per shard

    def override(self, pairs: dict[str, float]) -> Assumptions:
        return dataclasses.replace(self, **pairs)


# H200 / p5en.48xlarge class, a Qwen3-30B-A3B-class MoE (~3B active parameters, ~61 GB of bf16 weights).
GPU_ASSUMPTIONS = Assumptions(
    # SGLang with EP over the node's 8 GPUs at hundreds of concurrent sequences: ~20k output tokens/s a node.
    rollout_tokens_per_gpu_s=2500.0,
    # ~2.6e10 FLOPs a token (6 x active parameters for forward + backward, 2 x for the log-prob pass) at an
    # effective ~100 TFLOP/s a GPU (about 10% of bf16 peak, usual for MoE training over all-to-all).
    trainer_tokens_per_gpu_s=4000.0,
    # Load ~61 GB from S3 at ~1 GB/s a node, then SGLang start-up, DeepEP buffers and CUDA-graph capture.
    engine_startup_s=150.0,
    # PyTorchJob rendezvous over the trainer nodes, NCCL/DeepEP init, bf16 weights + fp32 masters and AdamW state
    # (the optimizer state, which the update resumes from) per rank.
    trainer_startup_s=120.0,
    pod_start_s=10.0,
    step_startup_s=5.0,
    score_samples_per_s=500.0,
    import_sft_s=300.0,
    # Server-side digests and copies of ~61 GB of bf16 weights and ~366 GB of fp32 optimizer state (master,
    # exp_avg, exp_avg_sq: a version keeps the SFT checkpoint's bf16, the masters travel with the optimizer) on S3.
    publish_s=90.0,
    report_s=30.0,
    # Karpenter launches a p5en Spot node, it boots, joins, gets its GPU/EFA plugins and pulls the image.
    node_replacement_s=420.0,
)

# This machine (2 CPU cores, the demo model), measured on it while other jobs shared the cores: a step's
# time is almost all process start-up (Python, torch import, model load); generation and training are small.
CPU_ASSUMPTIONS = Assumptions(
    rollout_tokens_per_gpu_s=5000.0,  # one torch thread: ~10k tokens/s alone, about half with 2 shards at once
    trainer_tokens_per_gpu_s=1500.0,  # response tokens a rank per second (prompt tokens train too)
    engine_startup_s=10.0,  # a rollout shard's start, torch import, model load, 2 shards at once
    trainer_startup_s=15.0,  # torchrun, 2 ranks importing torch, gloo rendezvous, weights + AdamW state
    pod_start_s=0.05,  # the local executor spawns a process
    step_startup_s=4.0,  # Python and the torch import
    score_samples_per_s=5000.0,
    import_sft_s=1.0,
    publish_s=3.0,
    report_s=1.0,
    node_replacement_s=0.0,  # the executor retries on this same machine
)


# ------------------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Pool:
    """Nodes that run one role's pods. slots_per_node None: any number of pods at once (the local executor)."""

    name: str
    nodes: int
    gpus_per_node: int
    spot: bool
    slots_per_node: int | None = 1
    label: str = ""


@dataclass(frozen=True)
class Cluster:
    rollout: Pool
    trainer: Pool
    cpu: Pool
    local: bool = False  # this machine: the whole run is one Workflow, as `moerl local` runs it

    def pools(self) -> tuple[Pool, Pool, Pool]:
        return (self.rollout, self.trainer, self.cpu)


def _gpus(cfg: RunConfig, role: str) -> int:
    value = cfg.placement[role].resources.limits.get(GPU, 0)
    try:
        return int(value)
    except ValueError:
        raise MoerlError(f"placement.{role}.resources.limits.{GPU}: {value!r} is not a whole number of GPUs") from None


def is_local(cfg: RunConfig) -> bool:
    """A config whose rollout and trainer ask for no GPU runs on this machine."""
    return _gpus(cfg, "rollout") == 0 and _gpus(cfg, "trainer") == 0


def cluster_for(cfg: RunConfig, assumptions: Assumptions) -> Cluster:
    if is_local(cfg):
        return local_cluster(cfg)
    t = cfg.trainer
    rollout_nodes = assumptions.rollout_nodes or cfg.rollout.num_shards
    rollout_gpus = _gpus(cfg, "rollout")
    trainer_gpus = _gpus(cfg, "trainer")
    spot = cfg.placement["rollout"].spot
    return Cluster(
        rollout=Pool("rollout", rollout_nodes, rollout_gpus, spot,
                     label=f"{rollout_nodes} nodes x {rollout_gpus} GPUs ({'Spot' if spot else 'on-demand'})"),
        # One update takes every trainer node at once: the pool is one schedulable gang.
        trainer=Pool("trainer", 1, t.nodes * trainer_gpus, cfg.placement["trainer"].spot,
                     label=f"{t.nodes} nodes x {trainer_gpus} GPUs (on-demand)"),
        cpu=Pool("cpu", 1, 0, False, slots_per_node=None, label="score and control pods"),
    )  # fmt: skip


def local_cluster(cfg: RunConfig) -> Cluster:
    """This machine: one node; the local executor starts every ready step at once, so no role ever waits."""
    return Cluster(
        rollout=Pool("rollout", 1, 0, cfg.placement["rollout"].spot, slots_per_node=None,
                     label=f"this machine, {cfg.rollout.num_shards} shard processes"),
        trainer=Pool("trainer", 1, 0, False, slots_per_node=None,
                     label=f"this machine, {cfg.trainer.nproc_per_node} torchrun ranks"),
        cpu=Pool("cpu", 1, 0, False, slots_per_node=None, label="this machine"),
        local=True,
    )  # fmt: skip


def pool_of(step: str) -> str:
    """The pool a step's pods run on: the one its image is built for (rollout, trainer, cpu)."""
    return commands.STEP_KINDS[step].image if step in commands.STEP_KINDS else "cpu"  # next-segment: no pod of its own


# ---------------------------------------------------------------------------------------------- step times


@dataclass(frozen=True)
class StepModel:
    """Seconds each step takes on its pool. A rollout shard: rollout_startup_s, then its chunks."""

    plan_s: float
    import_sft_s: float
    rollout_startup_s: float
    rollout_chunk_s: float
    score_s: float
    update_s: float
    publish_s: float
    report_s: float
    next_segment_s: float
    source: str  # where the figures come from, for the printout

    def fixed(self, step: str) -> float:
        return {
            "plan": self.plan_s,
            "import-sft": self.import_sft_s,
            "score": self.score_s,
            "update": self.update_s,
            "publish": self.publish_s,
            "report": self.report_s,
            "next-segment": self.next_segment_s,
        }[step]


def chunks_per_iteration(cfg: RunConfig) -> int:
    return -(-cfg.prompts_per_iteration // cfg.rollout.chunk_size)


def shard_chunks(cfg: RunConfig, shard: int) -> int:
    """Chunks of one shard: the iteration's chunks dealt out over the shards like cards."""
    return len(range(shard, chunks_per_iteration(cfg), cfg.rollout.num_shards))


def tokens_per_iteration(cfg: RunConfig, assumptions: Assumptions) -> float:
    return cfg.prompts_per_iteration * cfg.group_size * cfg.sampling.max_new_tokens * assumptions.response_fill


def derived_step_model(cfg: RunConfig, a: Assumptions) -> StepModel:
    """Step seconds from the config's sizes and the assumed throughputs."""
    rollout_devices = max(_gpus(cfg, "rollout"), 1)
    trainer_devices = cfg.trainer.nodes * (_gpus(cfg, "trainer") or cfg.trainer.nproc_per_node)
    chunk_tokens = cfg.rollout.chunk_size * cfg.group_size * cfg.sampling.max_new_tokens * a.response_fill
    samples = cfg.prompts_per_iteration * cfg.group_size
    train_s = cfg.trainer.epochs * tokens_per_iteration(cfg, a) / (a.trainer_tokens_per_gpu_s * trainer_devices)
    python_step = a.pod_start_s + a.step_startup_s
    heldout_s = 0.0
    if is_local(cfg) and cfg.heldout_size:
        # Score evaluates held-out accuracy with the torch engine when the model is small (the demo's is):
        # an engine load and greedy decoding on top of the rewards.
        heldout_tokens = cfg.heldout_size * cfg.sampling.max_new_tokens * a.response_fill
        heldout_s = a.engine_startup_s - a.step_startup_s + heldout_tokens / a.rollout_tokens_per_gpu_s
    return StepModel(
        plan_s=python_step,
        import_sft_s=python_step + a.import_sft_s,
        rollout_startup_s=a.pod_start_s + a.engine_startup_s,
        rollout_chunk_s=chunk_tokens / (a.rollout_tokens_per_gpu_s * rollout_devices),
        score_s=python_step + samples / a.score_samples_per_s + heldout_s,
        update_s=a.pod_start_s + a.trainer_startup_s + train_s,
        publish_s=python_step + a.publish_s,
        report_s=python_step + a.report_s,
        next_segment_s=a.pod_start_s,  # Argo creates the next Workflow itself: no pod
        source="derived from the config and the assumptions",
    )


def measured_step_model(cfg: RunConfig, a: Assumptions, measured: dict[str, float], source: str) -> StepModel:
    """Measured per-step seconds where given, derived ones elsewhere.

    A measured rollout figure is one whole shard: its start-up (measured `engine_startup` if given, else the
    assumed one, at most the whole figure) and then the shard's share of the iteration's chunks."""
    derived = derived_step_model(cfg, a)
    values = {kind: measured[kind] for kind in STEP_KINDS if kind in measured}
    startup, chunk = derived.rollout_startup_s, derived.rollout_chunk_s
    if "rollout" in values:
        shard_s = values["rollout"]
        startup = min(measured.get(ENGINE_STARTUP, startup), shard_s)
        chunk = (shard_s - startup) / (chunks_per_iteration(cfg) / cfg.rollout.num_shards)
    elif ENGINE_STARTUP in measured:
        startup = measured[ENGINE_STARTUP]

    def pick(kind: str, default: float) -> float:
        return values.get(kind, default)

    return StepModel(
        plan_s=pick("plan", derived.plan_s),
        import_sft_s=pick("import-sft", derived.import_sft_s),
        rollout_startup_s=startup,
        rollout_chunk_s=chunk,
        score_s=pick("score", derived.score_s),
        update_s=pick("update", derived.update_s),
        publish_s=pick("publish", derived.publish_s),
        report_s=pick("report", derived.report_s),
        next_segment_s=pick("next-segment", derived.next_segment_s),
        source=f"measured ({source}: {', '.join(sorted(values)) or 'none'}); the rest derived",
    )
