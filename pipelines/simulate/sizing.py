"""What the simulator is given: the assumptions a config does not state, the cluster's pools, and each step's
seconds (derived from the config and the assumptions, or measured)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipelines.simulate.model_sizing import (
    GB,
    INSTANCE_GPUS,
    MemoryTable,
    ModelSizing,
    rollout_memory,
    trainer_memory,
)
from pipelines.workflow import commands
from steps.errors import MoerlError
from steps.experience.rollout_plan import prompt_count_for
from steps.run.candidate import OPTIMIZER, WEIGHTS, node_write_loads, shard_writers
from steps.run.config import RunConfig

GPU = "nvidia.com/gpu"
# Step kinds: the workflow's template names. engine_startup is the part of a rollout shard spent before it
# generates (pod start, model load); a measured rollout figure includes it.
STEP_KINDS = ("plan", "import-sft", "rollout", "score", "update", "publish", "report", "next-segment")
ENGINE_STARTUP = "engine_startup"
# A run with engines that stay up measures its rollout and update steps as clients: the server's work and the
# client's own start (step_times_from_status keys them so, as they mean something else than a whole step).
ROLLOUT_CLIENT, UPDATE_CLIENT = "rollout-client", "update-client"
CLIENT_KINDS = (ROLLOUT_CLIENT, UPDATE_CLIENT)

# The share of a version's bf16 checkpoint bytes that its compressed delta against its parent takes (what a
# rollout server fetches per new version with checkpoint.deltas). Measured by bench/weight_update.py (bench/
# README.md, "weight update"): a bf16 version of a synthetic Qwen3-MoE after 4 AdamW steps at lr 1e-6 (the EKS
# config's regime) is 4.2-6.7% of its checkpoint; the larger figure, rounded up. `--assume delta_fraction=X`.
DELTA_FRACTION = 0.07
TIED_GROUP_SHARE = 0.5  # Assumptions.tied_group_share
# Multi-turn rollouts (a config with an environment): one environment step's wall seconds and one observation's
# tokens, both stated assumptions (sources.py); a user should time their own environment's step.
ENVIRONMENT_STEP_S = 0.05
OBSERVATION_TOKENS = 32.0


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
    response_fill: float = 1.0  # mean response (with an environment: a turn's) length as a share of max_new_tokens
    rollout_nodes: int = 0  # nodes of the rollout pool; 0: one per shard
    # Bytes and bandwidths, for engines that stay up (rollout.servers, trainer.server, checkpoint.deltas).
    checkpoint_gb: float = 61.0  # a version's weights as stored (bf16): what an engine loads
    optimizer_gb: float = 366.0  # the AdamW state a candidate carries (fp32 masters, exp_avg, exp_avg_sq)
    s3_gb_per_s: float = 1.0  # one node's S3 throughput, read or write (the figure engine_startup_s assumes)
    nvme_gb_per_s: float = 4.0  # one node's local-disk read (one NVMe drive; a RAID0 of p5en's 8 reads faster)
    engine_update_s: float = 10.0  # the engine's in-place weight update beyond reading the files
    delta_fraction: float = DELTA_FRACTION  # a version's delta as a share of checkpoint_gb
    # One thread of a trainer rank encoding its stored weights into a delta (XOR, byte planes, zstd, sha256s):
    # what bench/weight_update.py's "delta write" gives on one core (173 MB of bf16 in 0.85 s; the GPU config: its
    # encoder alone on Qwen3-30B-A3B-shaped tensors), and how much faster the writer's threads make it
    # (steps/run/weight_delta.py encode_threads: its share of the node's cores).
    delta_encode_gb_per_s: float = 0.2
    delta_encode_speedup: float = 1.0
    # The share of the weights outside the experts (embeddings, attention, routers, norms): every EP rank holds
    # them and EP rank 0's files carry them (steps/run/candidate.py). Qwen3-30B-A3B: ~1.5B of ~30.5B parameters.
    replicated_fraction: float = 0.05
    # The model's routed experts: with trainer.ep_size unset the trainer's EP size is gcd(ranks, num_experts).
    num_experts: int = 128
    # Tokens of the prompt a trainer row carries beside its response: with max_new_tokens, the sequence length of
    # the FLOPs' attention term and of the trainer's activations (a micro-batch is padded to its longest row).
    prompt_tokens: float = 256.0
    # GB of one trainer GPU; 0: from the trainer's instance type (model_sizing.INSTANCE_GPUS).
    gpu_memory_gb: float = 0.0
    # With rollout.dynamic_sampling: the share of groups whose rewards all tie, which sizes how many more prompts an
    # iteration generates (steps/experience/rollout_plan.py generated_prompt_count). 0.5: late in the demos 40-55%
    # of the groups tied (bench/README.md, "demo seeds"); a run's own is its score metrics' tied_group_fraction.
    tied_group_share: float = TIED_GROUP_SHARE
    # A config with an `environment` (multi-turn, tool-using rollouts; steps/environments/conversation.py); all three
    # are ignored without one. turns: the model's mean turns per conversation, at most environment.max_turns; 0
    # stands for environment.max_turns itself (every conversation runs to its turn limit: conversation_turns).
    # response_fill is then a turn's share of max_new_tokens.
    turns: float = 0.0
    environment_step_s: float = ENVIRONMENT_STEP_S  # wall seconds of one environment step (one conversation's turn)
    observation_tokens: float = OBSERVATION_TOKENS  # tokens of one observation the environment appends after a turn

    def override(self, pairs: dict[str, float]) -> Assumptions:
        return dataclasses.replace(self, **pairs)


# H200 / p5en.48xlarge class, a Qwen3-30B-A3B-class MoE (~3B active parameters, ~61 GB of bf16 weights). With a
# readable config.json, model_assumptions moves them to that model (the same ones for Qwen3-30B-A3B itself).
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
    checkpoint_gb=61.0,
    optimizer_gb=366.0,
    s3_gb_per_s=1.0,
    # p5en.48xlarge: 8 x 3.84 TB NVMe; one drive's sequential read, so a RAID0 only makes it faster.
    nvme_gb_per_s=4.0,
    # SGLang's update_weights_from_disk: pause, load the safetensors into the existing parameters (the read is
    # counted above), flush the cache. Peers' in-place updates of this model take 0.7-7 s (issue 21).
    engine_update_s=10.0,
    # bench/weight_update.py's encoder on one thread, 48 bf16 tensors of 768 x 2048 (the file's digest given, as
    # the update gives it): 0.48 GB/s; 0.81 on 2 threads (1.67x). A p5en writer encodes on 192 vCPUs / 8 ranks =
    # 24 threads over 12 cores: 12 cores at the 84% a core measured there.
    delta_encode_gb_per_s=0.48,
    delta_encode_speedup=10.0,
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
    checkpoint_gb=0.01,  # the demo model: a few MB
    optimizer_gb=0.03,
    s3_gb_per_s=0.5,  # the run store is a local directory
    nvme_gb_per_s=0.5,
    engine_update_s=0.5,  # the torch engine copies the tensors into its modules
    replicated_fraction=0.5,  # the demo model's embeddings and attention weigh as much as its experts
    num_experts=8,  # steps/demo/sft.py's demo model
)


# --------------------------------------------------------------------------------------------------- model


def conversation_turns(cfg: RunConfig, a: Assumptions) -> float:
    """The model's mean turns per sample: 1 without an environment; with one the `turns` assumption (0: the config's
    environment.max_turns, every conversation running to its turn limit), at most environment.max_turns."""
    if cfg.environment is None:
        return 1.0
    limit = float(cfg.environment.max_turns)
    return min(a.turns, limit) if a.turns > 0 else limit


def model_tokens(cfg: RunConfig, a: Assumptions) -> float:
    """The model's own (sampled, decoded) tokens per sample: max_new_tokens x response_fill, a turn's with an
    environment, x the turns (conversation_turns); scaled down with the observations where the conversation
    would pass environment.max_total_tokens (response_tokens)."""
    own = conversation_turns(cfg, a) * cfg.sampling.max_new_tokens * a.response_fill
    return own * _length_cap(cfg, a)


def sampled_tokens(cfg: RunConfig, a: Assumptions, samples: float) -> float:
    """The model's tokens of `samples` samples (model_tokens each); without an environment in today's arithmetic,
    samples x max_new_tokens x response_fill, so that its figures stay the same to the last bit."""
    if cfg.environment is None:
        return samples * cfg.sampling.max_new_tokens * a.response_fill
    return samples * model_tokens(cfg, a)


def response_tokens(cfg: RunConfig, a: Assumptions) -> float:
    """Tokens of a sample after its first prompt, as the trainer trains on them (its prompt comes on top):
    max_new_tokens x response_fill without an environment; with one the model's turns and the observations
    between them, turns x max_new_tokens x response_fill + (turns - 1) x observation_tokens, at most
    environment.max_total_tokens (a conversation that reaches it ends: steps/environments/conversation.py)."""
    own = conversation_turns(cfg, a) * cfg.sampling.max_new_tokens * a.response_fill
    return (own + observation_tokens(cfg, a)) * _length_cap(cfg, a)


def observation_tokens(cfg: RunConfig, a: Assumptions) -> float:
    """The observations' tokens per sample before the max_total_tokens cap: (turns - 1) x observation_tokens (the
    last part of a conversation is a model turn); 0 without an environment."""
    if cfg.environment is None:
        return 0.0
    return max(conversation_turns(cfg, a) - 1, 0.0) * a.observation_tokens


def _length_cap(cfg: RunConfig, a: Assumptions) -> float:
    """The share of a conversation that environment.max_total_tokens leaves (1 without an environment)."""
    if cfg.environment is None:
        return 1.0
    whole = conversation_turns(cfg, a) * cfg.sampling.max_new_tokens * a.response_fill + observation_tokens(cfg, a)
    return min(1.0, cfg.environment.max_total_tokens / whole) if whole > 0 else 1.0


def environment_s(cfg: RunConfig, a: Assumptions, conversations: int) -> float:
    """Wall seconds of the environment's steps for `conversations` conversations that advance together (a chunk's):
    each turn's steps run side by side over environment.workers worker processes, so a turn's take
    ceil(conversations / workers) x environment_step_s, for ceil(turns) turns; 0 without an environment."""
    if cfg.environment is None:
        return 0.0
    per_turn = -(-conversations // cfg.environment.workers) * a.environment_step_s
    return math.ceil(conversation_turns(cfg, a)) * per_turn


def flops_seq_len(cfg: RunConfig, a: Assumptions) -> float:
    """The mean context a trained token attends over, for the FLOPs' attention term."""
    return a.prompt_tokens + response_tokens(cfg, a)


def padded_seq_len(cfg: RunConfig, a: Assumptions) -> int:
    """A trainer row as a micro-batch pads it: the prompt and a response at the cap (max_new_tokens; with an
    environment its conversation's, environment.max_total_tokens)."""
    cap = cfg.sampling.max_new_tokens if cfg.environment is None else cfg.environment.max_total_tokens
    return int(a.prompt_tokens + cap)


def model_assumptions(base: Assumptions, m: ModelSizing, reference: ModelSizing, seq_len: float) -> Assumptions:
    """The GPU assumptions, written for `reference` (Qwen3-30B-A3B), moved to model `m`:

    - decode: rollout_tokens_per_gpu_s / (m's compute parameters / the reference's): a decoded token's FLOPs
      and weight reads follow the parameters it goes through;
    - update: trainer_tokens_per_gpu_s / (m's training FLOPs a token / the reference's, model_sizing's formula at
      seq_len);
    - bytes: checkpoint_gb (a version in the checkpoint's dtype), optimizer_gb (12 bytes a parameter), the share
      of the weights outside the routed experts and their count; the steps that move them (a rollout engine's load
      from S3 at s3_gb_per_s, import-sft, publish) by the extra bytes.
    The same model as the reference gives the same throughputs."""
    checkpoint_gb, optimizer_gb = m.version_bytes / GB, m.optimizer_bytes / GB
    moved = (checkpoint_gb + optimizer_gb) / (base.checkpoint_gb + base.optimizer_gb)
    return dataclasses.replace(
        base,
        rollout_tokens_per_gpu_s=base.rollout_tokens_per_gpu_s * reference.compute / m.compute,
        trainer_tokens_per_gpu_s=base.trainer_tokens_per_gpu_s
        * reference.flops_per_token(seq_len) / m.flops_per_token(seq_len),
        engine_startup_s=max(base.engine_startup_s + (checkpoint_gb - base.checkpoint_gb) / base.s3_gb_per_s, 0.0),
        import_sft_s=base.import_sft_s * checkpoint_gb / base.checkpoint_gb,
        publish_s=base.publish_s * moved,
        checkpoint_gb=checkpoint_gb,
        optimizer_gb=optimizer_gb,
        replicated_fraction=m.replicated_fraction,
        num_experts=m.num_experts,
    )


def trainer_gpu(cfg: RunConfig, a: Assumptions) -> tuple[str, float]:
    """(name, GB) of one trainer GPU: --assume gpu_memory_gb, else the trainer's instance type's."""
    instance = cfg.placement["trainer"].node_selector.get("node.kubernetes.io/instance-type", "")
    name, gb = INSTANCE_GPUS.get(instance, (instance or "no instance type named", 0.0))
    if a.gpu_memory_gb:
        return (f"{name}, as assumed" if gb else "GPU, as assumed"), a.gpu_memory_gb
    return name, gb


def trainer_memory_table(cfg: RunConfig, a: Assumptions, m: ModelSizing) -> MemoryTable:
    """model_sizing.trainer_memory under the config's EP and DP, micro-batch, sequence length and settings."""
    ep = trainer_ep_size(cfg, a)
    gpu, capacity = trainer_gpu(cfg, a)
    per_node = _gpus(cfg, "trainer") or cfg.trainer.nproc_per_node
    return trainer_memory(
        m, ep, trainer_ranks(cfg) // ep, cfg.trainer.micro_batch_size, padded_seq_len(cfg, a),
        cfg.trainer.kl_coef > 0, gpu, capacity, activation_checkpointing=cfg.trainer.activation_checkpointing,
        deepep_ranks=(ep, per_node) if cfg.trainer.ep_backend == "deepep" else None, fsdp=cfg.trainer.fsdp,
        shard_experts=cfg.trainer.shard_experts,
    )  # fmt: skip


def rollout_gpu(cfg: RunConfig) -> tuple[str, float]:
    """(name, GB) of one rollout GPU, from the rollout pool's instance type (0: unknown)."""
    instance = cfg.placement["rollout"].node_selector.get("node.kubernetes.io/instance-type", "")
    return INSTANCE_GPUS.get(instance, (instance or "no instance type named", 0.0))


def rollout_memory_table(cfg: RunConfig, a: Assumptions, m: ModelSizing) -> tuple[MemoryTable, float]:
    """model_sizing.rollout_memory for one engine of the config: its TP and EP, a chunk's sequences (chunk_size x
    group_size, all at once), each a prompt and a response at the cap."""
    gpu, capacity = rollout_gpu(cfg)
    sg = cfg.rollout.sglang
    return rollout_memory(m, sg.tp_size, sg.ep_size, cfg.rollout.chunk_size * cfg.group_size,
                          padded_seq_len(cfg, a), sg.mem_fraction, gpu, capacity)  # fmt: skip


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
    # Engines that stay up (rollout.servers > 0, trainer.server): a server starts once per segment and once per
    # replacement (rollout servers: rollout_startup_s; the trainer: trainer_startup_s); the per-iteration steps
    # are clients that start in client_s and wait for their server's answers.
    client_s: float = 0.0  # a client step's pod and Python start
    weight_sync_s: float = 0.0  # a rollout server's move to the next version: fetch (delta or whole) + apply
    full_sync_s: float = 0.0  # a rollout server's move to any other version: the whole checkpoint + apply
    trainer_startup_s: float = 0.0  # the trainer server's start: pod, rendezvous, comm init, weights + AdamW
    train_s: float = 0.0  # the trainer server's work per update before it answers: train, write the weights
    # Of train_s, the weights' write (with the delta); the optimizer shards follow after the answer, off the path
    # (steps/training/optimizer_write.py), and the next update joins them before it writes its own; the segment's
    # last update writes them before it answers.
    weights_write_s: float = 0.0
    optimizer_write_s: float = 0.0
    # With an environment: the part of rollout_chunk_s that is the environment's steps (the rollout client's, CPU).
    # A rollout server is busy for the rest of it (served_chunk_s) and serves other clients while a client steps.
    environment_s: float = 0.0
    # With rollout servers: the part of rollout_chunk_s that is the client verifying the chunk's samples once it
    # landed (steps/scoring/verdicts.py), which score then does not do; the server serves others meanwhile.
    verdicts_s: float = 0.0

    @property
    def client_chunk_s(self) -> float:
        """A rollout client's own work on a chunk after its server's answer: the environment's steps, the verdicts."""
        return self.environment_s + self.verdicts_s

    @property
    def served_chunk_s(self) -> float:
        """A rollout server's busy time for one chunk: the chunk's generation, without the client's own work."""
        return max(self.rollout_chunk_s - self.client_chunk_s, 0.0)

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


def chunks_per_iteration(cfg: RunConfig, tied_group_share: float = TIED_GROUP_SHARE) -> int:
    """Chunks an iteration generates: of prompts_per_iteration prompts, or with rollout.dynamic_sampling of what
    the rollout plans after an iteration whose tied share was tied_group_share."""
    return -(-prompt_count_for(cfg, tied_group_share) // cfg.rollout.chunk_size)


def shard_chunks(cfg: RunConfig, shard: int, tied_group_share: float = TIED_GROUP_SHARE) -> int:
    """Chunks of one shard: the iteration's chunks dealt out over the shards like cards."""
    return len(range(shard, chunks_per_iteration(cfg, tied_group_share), cfg.rollout.num_shards))


def tokens_per_iteration(cfg: RunConfig, assumptions: Assumptions) -> float:
    """The iteration's sampled tokens: the model's own (model_tokens), every turn's with an environment."""
    return sampled_tokens(cfg, assumptions, cfg.prompts_per_iteration * cfg.group_size)


def trained_tokens_per_iteration(cfg: RunConfig, assumptions: Assumptions) -> float:
    """The iteration's response tokens the trainer runs (response_tokens: with an environment the observations too,
    which it runs as context though it does not train them); trainer_tokens_per_gpu_s counts these."""
    if cfg.environment is None:  # the sampled tokens, as today
        return tokens_per_iteration(cfg, assumptions)
    return cfg.prompts_per_iteration * cfg.group_size * response_tokens(cfg, assumptions)


def derived_step_model(cfg: RunConfig, a: Assumptions) -> StepModel:
    """Step seconds from the config's sizes and the assumed throughputs."""
    rollout_devices = max(_gpus(cfg, "rollout"), 1)
    trainer_devices = trainer_ranks(cfg)
    conversations = cfg.rollout.chunk_size * cfg.group_size
    chunk_tokens = sampled_tokens(cfg, a, conversations)
    # With an environment a chunk's conversations advance turn by turn: each turn one generate call, then the
    # environment's steps of that turn over the rollout client's workers (environment_s), on the rollout step's clock.
    chunk_environment_s = environment_s(cfg, a, conversations)
    samples = cfg.prompts_per_iteration * cfg.group_size
    # With rollout servers each client verifies its chunks as they land (steps/scoring/verdicts.py); score then
    # verifies none, but still runs a reward function or reward model over every sample, priced at the same rate
    # (which also covers the verifier: an upper bound there).
    verdicts_s = conversations / a.score_samples_per_s if rollout_served(cfg) else 0.0
    scored_in_score = samples if not verdicts_s or cfg.rewards.reward_fn or cfg.rewards.reward_model else 0
    chunk_decode_s = chunk_tokens / (a.rollout_tokens_per_gpu_s * rollout_devices)
    train_s = cfg.trainer.epochs * trained_tokens_per_iteration(cfg, a) / (a.trainer_tokens_per_gpu_s * trainer_devices)
    if cfg.trainer.activation_checkpointing:  # one more forward (1/3 of forward + backward's FLOPs) per step
        train_s *= 4 / 3
    python_step = a.pod_start_s + a.step_startup_s
    heldout_s = 0.0
    if is_local(cfg) and cfg.heldout_size:
        # Score evaluates held-out accuracy with the torch engine when the model is small (the demo's is):
        # an engine load and greedy decoding on top of the rewards.
        heldout_tokens = sampled_tokens(cfg, a, cfg.heldout_size)
        heldout_s = a.engine_startup_s - a.step_startup_s + heldout_tokens / a.rollout_tokens_per_gpu_s
        heldout_s += environment_s(cfg, a, cfg.heldout_size)  # with an environment its conversations' steps
    return StepModel(
        plan_s=python_step,
        import_sft_s=python_step + a.import_sft_s,
        rollout_startup_s=a.pod_start_s + a.engine_startup_s,
        rollout_chunk_s=chunk_decode_s + chunk_environment_s + verdicts_s,
        environment_s=chunk_environment_s,
        verdicts_s=verdicts_s,
        score_s=python_step + scored_in_score / a.score_samples_per_s + heldout_s,
        update_s=a.pod_start_s + a.trainer_startup_s + train_s + candidate_write_s(cfg, a),
        publish_s=python_step + a.publish_s,
        report_s=python_step + a.report_s,
        next_segment_s=a.pod_start_s,  # Argo creates the next Workflow itself: no pod
        source="derived from the config and the assumptions",
        **served_step_times(cfg, a, train_s),
    )


def rollout_served(cfg: RunConfig) -> bool:
    """Rollout steps are clients of the segment's long-lived rollout servers."""
    return cfg.rollout.servers > 0


def deltas_written(cfg: RunConfig) -> bool:
    """The update writes the version's delta: only read by rollout servers, so only paid where there are some
    (steps/run/weight_delta.py wanted)."""
    return cfg.checkpoint.deltas and rollout_served(cfg)


def delta_gb(a: Assumptions) -> float:
    return a.delta_fraction * a.checkpoint_gb


def trainer_ranks(cfg: RunConfig) -> int:
    return cfg.trainer.nodes * (_gpus(cfg, "trainer") or cfg.trainer.nproc_per_node)


def trainer_ep_size(cfg: RunConfig, a: Assumptions) -> int:
    """trainer.ep_size, or the trainer's default (steps/expert_parallel/mesh.py resolve_ep_size)."""
    return cfg.trainer.ep_size or math.gcd(trainer_ranks(cfg), int(a.num_experts))


def shard_gb(cfg: RunConfig, a: Assumptions) -> list[dict[str, float]]:
    """GB of each EP rank's weight and optimizer files: its share of the experts, EP rank 0 also the replicated
    weights (replicated_fraction)."""
    ep = trainer_ep_size(cfg, a)

    def share(r: int) -> float:
        return (1 - a.replicated_fraction) / ep + (a.replicated_fraction if r == 0 else 0.0)

    return [{WEIGHTS: a.checkpoint_gb * share(r), OPTIMIZER: a.optimizer_gb * share(r)} for r in range(ep)]


def node_write_s(
    cfg: RunConfig, a: Assumptions, deltas: bool | None = None, kinds: tuple[str, ...] = (WEIGHTS, OPTIMIZER)
) -> dict[int, float]:
    """Seconds each trainer node spends writing the candidate's files of `kinds`, as the update writes them
    (steps/training/candidate_writer.py writer_plan, steps/run/candidate.py shard_writers): each EP rank's weight
    and optimizer files, each written by one of its dp replicas, spread over the nodes; a node uploads its files at
    s3_gb_per_s. With the delta (deltas_written), the writer of a weight file also encodes that file's delta (on its
    threads: delta_encode_gb_per_s x delta_encode_speedup; a node's writers encode at once) and uploads it."""
    deltas = (deltas_written(cfg) if deltas is None else deltas) and WEIGHTS in kinds
    ranks, ep = trainer_ranks(cfg), trainer_ep_size(cfg, a)
    per_node = max(ranks // cfg.trainer.nodes, 1)
    sizes = shard_gb(cfg, a)
    writers = shard_writers(sizes, ranks // ep, per_node)
    written = [
        {kind: gb * (1 + (a.delta_fraction if deltas and kind == WEIGHTS else 0.0)) if kind in kinds else 0.0
         for kind, gb in s.items()}
        for s in sizes
    ]  # fmt: skip
    seconds = {node: gb / a.s3_gb_per_s for node, gb in node_write_loads(written, writers, per_node).items()}
    if deltas:  # the encoding counted after the node's uploads (as if serial), its slowest writer's
        encode_s: dict[int, float] = {}
        for (r, kind), rank in writers.items():
            if kind == WEIGHTS:
                node = rank // per_node
                rate = a.delta_encode_gb_per_s * a.delta_encode_speedup
                encode_s[node] = max(encode_s.get(node, 0.0), sizes[r][WEIGHTS] / rate)
        seconds = {node: s + encode_s.get(node, 0.0) for node, s in seconds.items()}
    return seconds


def candidate_write_s(cfg: RunConfig, a: Assumptions) -> float:
    """The update writing its candidate (weights, AdamW state and, where wanted, the delta): every node its
    files at once; the node that writes the most decides (node_write_s)."""
    return max(node_write_s(cfg, a).values())


def weights_write_s(cfg: RunConfig, a: Assumptions) -> float:
    """The weights' part of the candidate's write (with the delta): what a trainer that stays up writes before it
    answers the update."""
    return max(node_write_s(cfg, a, kinds=(WEIGHTS,)).values())


def optimizer_write_s(cfg: RunConfig, a: Assumptions) -> float:
    """The optimizer shards' part: what a trainer that stays up writes after it answered."""
    return max(node_write_s(cfg, a, kinds=(OPTIMIZER,)).values())


def busiest_write_gb(cfg: RunConfig, a: Assumptions) -> float:
    """GB the busiest trainer node writes of the candidate (weights + AdamW state, without the delta)."""
    return max(node_write_s(cfg, a, deltas=False).values()) * a.s3_gb_per_s


def delta_write_s(cfg: RunConfig, a: Assumptions) -> float:
    """What the delta adds to the candidate's write: the writers of the weight files encode it against the
    v(i-1) bits they hold and upload it (publish then only indexes it)."""
    if not deltas_written(cfg):
        return 0.0
    return candidate_write_s(cfg, a) - max(node_write_s(cfg, a, deltas=False).values())


def served_step_times(cfg: RunConfig, a: Assumptions, train_s: float) -> dict[str, float]:
    """The StepModel fields of engines that stay up, from bytes and bandwidths.

    A rollout server's next version: its node fetches the delta once (or the whole checkpoint without
    checkpoint.deltas) from S3, reads the reconstructed version from its local disk and updates the engine
    in place. The trainer server pays its start-up once, then per update trains and writes the weights before it
    answers, the optimizer shards after (a step of the segment's last update: servers.py)."""
    apply_s = a.checkpoint_gb / a.nvme_gb_per_s + a.engine_update_s
    fetched_gb = delta_gb(a) if cfg.checkpoint.deltas else a.checkpoint_gb
    return {
        "client_s": a.pod_start_s + a.step_startup_s,
        "weight_sync_s": fetched_gb / a.s3_gb_per_s + apply_s,
        "full_sync_s": a.checkpoint_gb / a.s3_gb_per_s + apply_s,
        "trainer_startup_s": a.pod_start_s + a.trainer_startup_s,
        "train_s": train_s + weights_write_s(cfg, a),
        "weights_write_s": weights_write_s(cfg, a),
        "optimizer_write_s": optimizer_write_s(cfg, a),
    }


def measured_step_model(cfg: RunConfig, a: Assumptions, measured: dict[str, float], source: str) -> StepModel:
    """Measured per-step seconds where given, derived ones elsewhere.

    A measured rollout figure is one whole shard: its start-up (measured `engine_startup` if given, else the
    assumed one, at most the whole figure) and then the shard's share of the iteration's chunks. Measured in
    today's shape (rollout.servers 0, no trainer server), they carry over to servers: a rollout server starts
    as a shard does and generates its chunks as fast; a trainer server's update is the measured one less the
    assumed start-up. Measured as clients (ROLLOUT_CLIENT, UPDATE_CLIENT: a run with servers), a client's
    figure holds its own start and its server's work, which no step of the run times apart: the model then
    puts it all on the server (client_s 0; a rollout client's chunks, the trainer server's update), and
    the start-ups of the servers stay derived (no step of the run times them either)."""
    derived = derived_step_model(cfg, a)
    values = {kind: measured[kind] for kind in STEP_KINDS if kind in measured}
    startup, chunk = derived.rollout_startup_s, derived.rollout_chunk_s
    chunks_per_shard = chunks_per_iteration(cfg, a.tied_group_share) / cfg.rollout.num_shards
    if "rollout" in values:
        shard_s = values["rollout"]
        startup = min(measured.get(ENGINE_STARTUP, startup), shard_s)
        # measured in today's shape, whose chunks carry no verdicts: a served chunk adds its client's (a measured
        # score keeps the verification it did: an upper bound)
        chunk = (shard_s - startup) / chunks_per_shard + derived.verdicts_s
    elif ENGINE_STARTUP in measured:
        startup = measured[ENGINE_STARTUP]
    train_s = derived.train_s
    if "update" in values:  # a whole update: a start-up, the training and the candidate's write, the optimizer
        # shards' part of which a trainer that stays up writes after it answered
        train_s = max(values["update"] - derived.trainer_startup_s - derived.optimizer_write_s, 0.0)
    client_s = derived.client_s
    if any(kind in measured for kind in CLIENT_KINDS):
        client_s = 0.0
        chunk = measured[ROLLOUT_CLIENT] / chunks_per_shard if ROLLOUT_CLIENT in measured else chunk
        train_s = measured.get(UPDATE_CLIENT, train_s + derived.client_s)
        if ROLLOUT_CLIENT not in measured:  # a derived client start, now on the server's side
            chunk += derived.client_s / chunks_per_shard
    fitted = [*values, *(kind for kind in CLIENT_KINDS if kind in measured)]

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
        source=f"measured ({source}: {', '.join(sorted(fitted)) or 'none'}); the rest derived",
        client_s=client_s,
        weight_sync_s=derived.weight_sync_s,
        full_sync_s=derived.full_sync_s,
        trainer_startup_s=derived.trainer_startup_s,
        train_s=train_s,
        weights_write_s=min(derived.weights_write_s, train_s),
        optimizer_write_s=derived.optimizer_write_s,
        environment_s=min(derived.environment_s, chunk),  # a measured chunk holds its environment's steps
        verdicts_s=min(derived.verdicts_s, max(chunk - derived.environment_s, 0.0)),  # and its verdicts
    )
