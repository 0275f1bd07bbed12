"""The run config's schema: every field of a run config, its default and its checks; the schema of run.json.

`validate_config(data)` checks a parsed config and returns a `RunConfig`. Every field has a default that suits
the CPU demo on this machine except the two URIs (`sft_checkpoint`, `run_store`), which a config must name.
The resolved config travels to the steps as `<run>/run.json` (`RunConfig.model_dump(mode="json")`, written
by import-sft), so the steps read their settings from there and the workflow only passes run, iteration and
shard on the command line. pipelines/config.py reads the YAML, applies `--set` overrides and resolves paths.

Each section is the one owner of its settings: the libraries are built from their section by keyword
(TrainSettings and LossSettings from `trainer`, SamplingParams from `sampling`, SGLangSettings from
`rollout.sglang`, RewardWeights from the `rewards` weights), so a new setting is a field here plus the code
that uses it.

A bad config ends in one MoerlError that lists every bad field by its path (`rollout.num_shards`) with what
is wrong and how to fix it; an unknown field is refused with the nearest known name ("did you mean ...").
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from steps.errors import MoerlError
from steps.run.config_checks import semantic_problems
from steps.run.keys import RUN_CONFIG
from steps.store.object_store import Store

# Placement roles: where each kind of pod runs. `control` holds the small CPU steps that move state:
# plan, import-sft, publish, the report and the hand-over to the next segment.
ROLES = ("rollout", "score", "trainer", "control")

# Config fields that may change between the segments or scheduled continuations of one run: they say where
# and how often pods run, not what is trained. Everything else must match the run's run.json.
OPERATIONAL_FIELDS = frozenset(
    {
        "name",
        "iterations",
        "segment_size",
        "images",
        "placement",
        "retries",
        "argo",
        "schedule",
        "namespace",
        "service_account",
    }
)
OPERATIONAL_SECTION_FIELDS = {
    "rollout": frozenset({"num_shards", "servers", "server_wait_s"}),
    "trainer": frozenset({"server", "server_wait_s", "server_idle_exit_s", "publish_wait_s", "optimizer_after_answer"}),
    "checkpoint": frozenset({"deltas"}),
}



class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


def _field(default: Any, description: str, **constraints: Any) -> Any:
    return Field(default, description=description, **constraints)


# ---------------------------------------------------------------------------------------------- what


class TaskConfig(_Section):
    name: str = _field("addition", "a task of steps.data.tasks: 'addition', 'sort' or 'sortdesc'")
    params: dict[str, int | float | str | bool] = _field(
        {}, "difficulty parameters of the task, e.g. {digits: 3} for addition or {length: 6} for sort"
    )


class PromptFieldsConfig(_Section):
    prompt: str = _field("prompt", "field of a prompt-file record holding the prompt (a string or chat messages)")
    answer: str = _field("answer", "field holding the reference answer (dotted for nested: reward_model.ground_truth)")
    id: str = _field("prompt_id", "field holding the prompt's id; records without one get a stable hash of the prompt")


class SGLangConfig(_Section):
    tp_size: int = _field(1, "tensor-parallel size of each SGLang engine", ge=1)
    ep_size: int = _field(1, "expert-parallel size of each SGLang engine (GPUs the experts are spread over)", ge=1)
    moe_a2a_backend: Literal["deepep", "none"] = _field(
        "none", "SGLang's MoE all-to-all backend: 'deepep' (needs ep_size > 1) or 'none'"
    )
    mem_fraction: float = _field(0.85, "share of GPU memory SGLang may take (0-1]", gt=0, le=1)


class RolloutConfig(_Section):
    num_shards: int = _field(2, "rollout pods per iteration (withSequence fan-out)", ge=1, le=1024)
    chunk_size: int = _field(16, "prompts per generation chunk; fixed for a run, independent of the shard count", ge=1)
    engine: Literal["torch", "sglang"] = _field("torch", "generation engine: 'torch' (CPU or one GPU) or 'sglang'")
    sglang: SGLangConfig = _field(SGLangConfig(), "SGLang serving settings (engine: sglang)")
    servers: int = _field(
        0,
        "long-lived rollout servers per segment (Argo daemon tasks, each holding one engine whose weights it "
        "updates in place from the run store); the rollout steps send them their chunks. 0: each rollout step "
        "opens an engine of its own",
        ge=0,
        le=1024,
    )
    dynamic_sampling: bool = _field(
        False,
        "DAPO's dynamic sampling: generate more prompts than prompts_per_iteration (as many as the share of "
        "tied groups in the last scored iteration the policy version descends from says are needed, at most "
        "dynamic_sampling_max_factor times as many) and train on the first prompts_per_iteration groups, in plan "
        "order, whose rewards are not all equal (topped up with tied groups only when too few are mixed)",
    )
    dynamic_sampling_max_factor: float = _field(
        3.0,
        "with dynamic_sampling: at most this many times prompts_per_iteration prompts are generated an iteration "
        "(also what the first iterations generate, with no scored iteration to estimate from)",
        ge=1,
        le=16,
    )
    record_routes: bool = _field(
        False,
        "record, for every token the engine runs, the experts each MoE layer routed it to (the torch engine from "
        "its routers; SGLang with enable_return_routed_experts), stored with the samples (the experience's "
        "routed_experts column): the update then reports how often its own routers choose other experts, per "
        "layer, and trainer.routing_replay: rollout can replay them. On whenever routing_replay is rollout",
    )
    server_wait_s: float = _field(
        600.0,
        "how long a rollout step waits for a ready rollout server (rollout.servers > 0) before it exits to be "
        "retried (exit 75, as for a lost server); it never generates with an engine of its own then",
        ge=0,
    )


class SamplingConfig(_Section):
    temperature: float = _field(1.0, "sampling temperature, > 0", gt=0)
    top_p: float = _field(1.0, "nucleus sampling mass in (0, 1]", gt=0, le=1)
    top_k: int = _field(0, "sample from the k most likely tokens; 0 turns top-k off", ge=0)
    max_new_tokens: int = _field(8, "longest response in tokens", ge=1)


class EnvironmentConfig(_Section):
    class_path: str = Field(
        description="the environment: a class 'package.module:Class' installed in the cpu image (contract: README, "
        "'Environments: multi-turn and tools', and steps/environments/worker.py)"
    )
    params: dict[str, Any] = _field({}, "keyword arguments the class is constructed with, once per conversation")
    max_turns: int = _field(4, "the model's turns in one conversation at most", ge=1, le=64)
    max_total_tokens: int = _field(
        1024,
        "tokens of a conversation after its first prompt at most (the model's and the environment's); a turn is "
        "also cut at sampling.max_new_tokens",
        ge=1,
    )
    tool_call_format: Literal["qwen", "none"] = _field(
        "qwen",
        "how tool calls are read from the model's turns: 'qwen' (<tool_call>{json}</tool_call>, the Hermes "
        "format of Qwen2.5, Qwen3, Qwen3-MoE and Qwen3-Next templates); 'none': turns are plain text",
    )
    step_timeout_s: float = _field(10.0, "longest one reset or step of the environment may take", gt=0)
    workers: int = _field(4, "environment worker processes per rollout client (conversations are spread over them)",
                          ge=1, le=256)  # fmt: skip


class RewardsConfig(_Section):
    verifier: Literal["exact", "numeric", "math", "regex"] | None = _field(
        None,
        "rule verifier of the answers: 'exact', 'numeric' (last number, or the one after ####), 'math' "
        "(math-verify) or 'regex' (answer_pattern); default: a built-in task's own, 'exact' for a prompt file",
    )
    answer_pattern: str | None = _field(
        None, "regex verifier: the answer is the last match's first group (or the whole match)"
    )
    exact_match_weight: float = _field(1.0, "weight of the verifier's verdict 'correct'")
    format_weight: float = _field(0.1, "weight of the verifier's verdict 'well_formed' (an answer was found)")
    reward_fn: str | None = _field(
        None,
        "a reward function 'package.module:function' installed in the cpu image (contract: README, "
        "steps/scoring/user_reward.py)",
    )
    reward_fn_weight: float = _field(1.0, "weight of the reward function's reward (needs reward_fn)")
    reward_fn_timeout_s: float = _field(10.0, "longest the reward function may take on one sample", gt=0)
    environment_weight: float = _field(
        1.0, "weight of the environment's reward (the sum of its steps' rewards; needs environment)"
    )
    reward_model: str | None = _field(
        None, "optional reward model: a store URI of a sequence-classification checkpoint"
    )
    reward_model_weight: float = _field(0.0, "weight of the reward model's score (needs reward_model)")
    normalize_std: bool = _field(True, "divide group advantages by the group's reward std (GRPO); false: mean only")


class TrainerConfig(_Section):
    ep_backend: Literal["local", "alltoall", "deepep"] = _field(
        "alltoall",
        "expert-parallel dispatch: 'local' (one rank), 'alltoall' (gloo or NCCL) or 'deepep' (GPU)",
    )
    expert_placement: Literal["balanced", "contiguous"] = _field(
        "balanced",
        "which experts each expert-parallel rank holds, per MoE layer: 'balanced' (split so that the ranks' "
        "routed rows are even, from the previous update's per-expert row counts; contiguous on iteration 1) or "
        "'contiguous' (rank r holds experts [r*E/ep, (r+1)*E/ep) in every layer)",
    )
    ep_size: int | None = _field(
        None,
        "expert-parallel group size: the trainer ranks that split each MoE layer's experts; the data-parallel "
        "size is the ranks (nodes x nproc_per_node) / ep_size. Must divide the ranks and num_experts; "
        "nproc_per_node or less keeps every expert exchange inside a node. null: the largest size that divides "
        "both the ranks and num_experts",
        ge=1,
    )
    nproc_per_node: int = _field(2, "torchrun processes per node (GPUs per node on a cluster)", ge=1, le=64)
    nodes: int = _field(
        1,
        "trainer nodes; more than 1 runs the update (with trainer.server, the trainer) as a Kubeflow PyTorchJob",
        ge=1,
    )
    micro_batch_size: int = _field(32, "sequences per forward/backward pass on one rank", ge=1)
    epochs: int = _field(1, "passes over the iteration's experience", ge=1)
    steps_per_epoch: int = _field(
        1, "optimizer steps per pass (the experience is split into this many mini-batches)", ge=1
    )
    lr: float = _field(2e-4, "AdamW learning rate", gt=0)
    warmup_steps: int = _field(
        0, "optimizer steps of the run over which the learning rate ramps linearly up to lr (0: none)", ge=0
    )
    lr_schedule: Literal["constant", "cosine", "linear"] = _field(
        "constant",
        "the learning rate after the warmup, over the run's optimizer steps (iterations x epochs x steps_per_epoch): "
        "'constant' (lr), 'cosine' or 'linear' down to lr x lr_final_ratio at the run's last step",
    )
    lr_final_ratio: float = _field(
        0.0, "with lr_schedule cosine or linear: the learning rate of the run's last step, as a share of lr", ge=0, le=1
    )
    weight_decay: float = _field(0.0, "AdamW weight decay", ge=0)
    betas: tuple[float, float] = _field((0.9, 0.999), "AdamW betas, two numbers in [0, 1)")
    grad_clip: float = _field(1.0, "clip the global gradient norm to this; 0 turns clipping off", ge=0)
    clip_low: float = _field(0.2, "PPO ratio clip below 1 (ratio >= 1 - clip_low)", gt=0, lt=1)
    clip_high: float = _field(0.28, "PPO ratio clip above 1 (ratio <= 1 + clip_high; DAPO clip-higher)", gt=0)
    loss_agg: Literal["token-mean", "seq-mean"] = _field("token-mean", "loss aggregation: 'token-mean' or 'seq-mean'")
    kl_coef: float = _field(0.0, "weight of the k3 KL penalty to the SFT policy; 0 turns it off", ge=0)
    router: Literal["freeze", "train"] = _field(
        "freeze",
        "the MoE routers during RL: 'freeze' keeps every router weight (and DeepSeek-V3's selection bias, which is "
        "never trained) at its SFT value, as NeMo-RL's MoE GRPO recipes do (freeze_moe_router: true, against "
        "log-prob divergence between the engine and the trainer); 'train' lets the policy gradient move them",
    )
    router_aux_loss_coef: float = _field(
        0.0,
        "weight of the routers' load-balancing loss (Switch Transformers' E * sum f_e P_e per MoE layer, their mean) "
        "added to the policy loss; 0 turns it off, as the peers' RL recipes do (NeMo-RL: "
        "moe_router_load_balancing_type none); needs router: train",
        ge=0,
    )
    activation_checkpointing: bool = _field(
        False,
        "recompute each decoder layer in the backward instead of keeping its activations (torch.utils.checkpoint, "
        "non-reentrant): a training forward then holds one layer's activations at a time plus every layer's "
        "input, for one more forward's compute; the update is the same bit for bit",
    )
    fsdp: bool = _field(
        False,
        "shard the non-expert parameters (attention, norms, routers, shared experts, dense layers, embeddings, "
        "output projection), their gradients and AdamW state over all trainer ranks with FSDP2 (fully_shard per "
        "decoder layer; torchtitan's layout): a GPU holds 1/ranks of them instead of all, for an all-gather of "
        "each layer's in the forward and the backward and a reduce-scatter of its gradients; the routed experts "
        "stay split by trainer.ep_size. The same update up to the order of the gradient sums",
    )
    shard_experts: bool = _field(
        False,
        "shard each EP rank's routed experts, their gradients and AdamW state over the dp replicas that hold the "
        "same experts (FSDP2 over the replica group, one unit per MoE layer): a GPU keeps 1/dp of its experts, "
        "for an all-gather of each layer's in the forward and the backward and a reduce-scatter of their "
        "gradients; what fits when EP inside a node leaves too many experts a GPU. The same update up to the "
        "order of the gradient sums",
    )
    sequence_packing: bool = _field(
        False,
        "run a micro-batch's sequences as one row without padding: each token attends within its own sequence, "
        "positions start again at each sequence, so the log-probs and gradients are the padded ones' (to float "
        "rounding) for the real tokens only; the experts, norms and output projection then see no padding. "
        "Attention runs under a block-diagonal mask over the packed row. Not with shared_prompts",
    )
    grouped_gemm: bool = _field(
        True,
        "run a rank's local experts as one grouped GEMM (torch.nn.functional.grouped_mm) where the device has it "
        "(the CPU; CUDA in bf16 on sm80+ with dimensions that are multiples of 8), expert by expert elsewhere; "
        "false: always expert by expert. On the CPU both give the same bits",
    )
    is_cap: float = _field(
        2.0, "upper bound of the importance weight behaviour -> trainer (tis truncates to it, mis masks above it)", gt=0
    )
    is_correction: Literal["none", "tis", "mis"] = _field(
        "tis",
        "the engine -> trainer importance correction (steps/training/rl_loss.py): 'tis' truncates the weight at "
        "is_cap, 'mis' masks the tokens (or sequences) whose weight is outside [is_lower, is_cap] out of the "
        "gradient, 'none' uses weight 1",
    )
    is_level: Literal["token", "sequence"] = _field(
        "token",
        "the importance weight per token, or per sequence (the geometric mean of its tokens' ratios, for every "
        "token of it)",
    )
    is_lower: float | None = _field(
        None, "with is_correction mis: the band's lower bound (null: 1 / is_cap)", gt=0
    )
    loss: Literal["ppo", "gspo", "cispo"] = _field(
        "ppo",
        "the policy-gradient loss: 'ppo' (PPO-clip with clip_low/clip_high), 'gspo' (a sequence-level ratio and "
        "clipping; use clip ranges of order 3e-4 / 4e-4 and loss_agg seq-mean) or 'cispo' (the clipped ratio as a "
        "weight, the gradient through every token's log-prob)",
    )
    old_logprobs: Literal["recompute", "behavior"] = _field(
        "recompute",
        "the PPO ratio's old policy, for updates of more than one step: 'recompute' (one extra forward pass "
        "with the weights before the update; the truncated IS weight corrects behaviour -> trainer) or "
        "'behavior' (the rollout engine's own log-probs: no extra pass, IS weight 1; right when the engine "
        "computes what the trainer would, i.e. the torch engine in fp32 at staleness 0 on an fp32 checkpoint: "
        "a bf16/fp16 version is the trainer's fp32 masters rounded)",
    )
    routing_replay: Literal["none", "rollout"] = _field(
        "none",
        "'rollout': the policy's forward passes in the update (the old log-probs and every step's; not the "
        "reference model's) route each token to the experts the rollout engine routed it to (Rollout Routing "
        "Replay, R3), the routers still weighing those experts, so the trainer computes the log-probs of the "
        "experts that generated the samples; records the routes (rollout.record_routes). 'none': the trainer's "
        "routers choose",
    )
    shared_prompts: bool = _field(
        False,
        "run each prompt once per micro-batch and let its GRPO group's responses attend to its keys/values "
        "(the same loss and gradients, fewer tokens trained); a prompt's samples then stay in one optimizer "
        "step and one rank's micro-batch, so micro-batches hold whole groups. Measured on the demo: steps of "
        "whole groups learn far slower than steps of samples shuffled across prompts (bench/README.md)",
    )
    server: bool = _field(
        False,
        "a trainer that stays up for the segment (an Argo daemon task holding the EP group, the weights and "
        "AdamW's state in memory; over trainer.nodes > 1, the daemon launches it as one PyTorchJob), driven "
        "iteration by iteration by the update steps; false: each update step starts its own torchrun or job",
    )
    server_wait_s: float = _field(
        600.0,
        "with trainer.server: how long an update step waits for its Workflow's trainer to be ready before it "
        "exits 75 to be retried (it runs on a CPU node: it has no GPU to train on)",
        ge=0,
    )
    publish_wait_s: float = _field(
        1800.0,
        "with trainer.server: how long a trainer that does not hold the version an update starts from (restarted "
        "since it trained it) waits for that version's publish, which runs beside it, before it refuses the update "
        "naming the publish (it failed, or is not running); and how long a publish waits for the optimizer shards "
        "a trainer that stays up writes after it answered the update",
        ge=0,
    )
    optimizer_after_answer: bool = _field(
        True,
        "with trainer.server, rollout servers and deltas: the trainer answers an update once the weights are stored "
        "and indexed, and stores the optimizer shards (six times the weights' bytes) after it, off the path to the "
        "next rollout and update (a trainer lost meanwhile is replaced by one that trains that update again and "
        "checks its weights bit for bit); false: before it answers",
    )
    server_idle_exit_s: float = _field(
        3600.0,
        "with trainer.server over trainer.nodes > 1: the trainer's PyTorchJob ends itself once its launcher "
        "(the segment's trainer-server daemon) has not refreshed its heartbeat in the run store for this long "
        "(0: never), so that a job whose launcher was killed before it could delete it frees its nodes; while "
        "the launcher lives, the trainer waits for updates however long they pause",
        ge=0,
    )


class CheckpointConfig(_Section):
    keep_last: int = _field(3, "published versions kept besides v000000 (older ones are deleted)", ge=1)
    deltas: bool = _field(
        True,
        "with rollout servers, each version's compressed delta against its parent is also written (deltas/v(i)/: "
        "the update's ranks write their weight files' blobs, publish indexes them), which the servers fetch "
        "instead of the whole checkpoint; the full checkpoint stays the source of truth",
    )


# --------------------------------------------------------------------------------------------- where


class Toleration(_Section):
    # Kubernetes spells these in camelCase; both spellings are accepted.
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


Quantity = Annotated[int | str, Field(description="a Kubernetes quantity such as 8, '64Gi' or '500m'")]


class Resources(_Section):
    requests: dict[str, Quantity] = _field({}, "resource requests, e.g. {cpu: 4, memory: 16Gi}")
    limits: dict[str, Quantity] = _field(
        {}, "resource limits; GPUs (nvidia.com/gpu), EFA (vpc.amazonaws.com/efa) and hugepages-2Mi go here"
    )


class Placement(_Section):
    node_selector: dict[str, str] = _field({}, "node labels the pods must match (instance type, zone, pool)")
    tolerations: list[Toleration] = _field([], "taints the pods tolerate (GPU, Spot)")
    resources: Resources = _field(Resources(), "container resources")
    priority_class: str | None = _field(None, "Kubernetes PriorityClass of the pods")
    spot: bool = _field(False, "Spot capacity: retry preemptions (pod deleted, node shutdown, 137/143) elsewhere")
    shm_size: str | None = _field(None, "size of the in-memory /dev/shm (torchrun, NCCL, SGLang), e.g. 16Gi")


def _default_placement() -> dict[str, Placement]:
    return {
        "rollout": Placement(spot=True, shm_size="1Gi"),
        "score": Placement(spot=True),
        "trainer": Placement(shm_size="1Gi"),
        "control": Placement(),
    }


class Backoff(_Section):
    duration: str = _field("2s", "wait before the first retry (Argo duration: 30s, 2m)")
    factor: int = _field(2, "each wait is the previous one times this", ge=1)
    max_duration: str | None = _field("1h", "give up retrying after this long since the first attempt")
    cap: str | None = _field(None, "longest single wait")


class Retry(_Section):
    limit: int = _field(3, "retries after the first attempt", ge=0)
    backoff: Backoff = _field(Backoff(), "exponential backoff between attempts")


def _default_retries() -> dict[str, Retry]:
    return {
        "rollout": Retry(limit=6),
        "score": Retry(limit=4),
        "trainer": Retry(limit=2),
        "control": Retry(limit=3),
    }


class Images(_Section):
    trainer: str = _field("moerl-trainer:latest", "image of the update (torchrun) pods")
    rollout: str = _field("moerl-rollout:latest", "image of the rollout pods (SGLang)")
    cpu: str = _field("moerl-cpu:latest", "image of the CPU steps: plan, import-sft, score, publish, report")


class Semaphore(_Section):
    config_map: str = _field("moerl-semaphores", "ConfigMap holding the semaphore's limit")
    key: str = _field("runs", "key in that ConfigMap whose value is the number of runs at once")


class ArgoConfig(_Section):
    semaphore: Semaphore | None = _field(Semaphore(), "semaphore bounding concurrent moerl runs; null: none")
    report_artifact: bool = _field(
        True, "publish the report PNG as an Argo output artifact (needs an artifact repository)"
    )
    run_mutex: bool = _field(True, "a mutex per run: two Workflows of one run (a submit, the cron) never overlap")
    ttl_seconds_after_success: int = _field(7 * 24 * 3600, "delete a Succeeded Workflow after this long", ge=0)
    ttl_seconds_after_failure: int = _field(14 * 24 * 3600, "delete a Failed Workflow after this long", ge=0)
    pod_gc: Literal["OnPodCompletion", "OnPodSuccess", "OnWorkflowCompletion", "OnWorkflowSuccess"] = _field(
        "OnPodSuccess", "when Argo deletes finished pods (failed ones stay for their logs with OnPodSuccess)"
    )
    pod_gc_delay: str | None = _field("10m", "wait this long before deleting a pod (keeps logs readable)")
    active_deadline_seconds: int | None = _field(None, "fail a Workflow that runs longer than this", ge=1)
    labels: dict[str, str] = _field({}, "extra labels on every Workflow of the run")


class ScheduleConfig(_Section):
    schedules: list[str] = _field(["0 */6 * * *"], "cron expressions (5 fields) for the CronWorkflow")
    timezone: str = _field("UTC", "IANA timezone of the schedules, e.g. Europe/Berlin")
    starting_deadline_seconds: int = _field(600, "skip a scheduled start missed by more than this", ge=0)
    suspend: bool = _field(False, "create the CronWorkflow suspended")


# ------------------------------------------------------------------------------------------ tracking


class MlflowTracking(_Section):
    tracking_uri: str | None = _field(
        None, "MLflow tracking server (http(s)://host:port); null: the pods' MLFLOW_TRACKING_URI (from `secret`)"
    )
    experiment: str = _field("moerl", "MLflow experiment the run is logged to (created when missing)")
    secret: str | None = _field(
        None,
        "Kubernetes Secret whose keys MLFLOW_TRACKING_URI, MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD (each optional) become the tracked steps' env; never a value in the YAML",
    )


class TensorboardTracking(_Section):
    enabled: bool = _field(True, "write TensorBoard event files under <run>/tensorboard/ (any store, S3 too)")


class WandbTracking(_Section):
    project: str = _field("moerl", "Weights & Biases project")
    entity: str | None = _field(None, "Weights & Biases entity (team or user); null: the API key's default")
    mode: Literal["online", "offline"] = _field(
        "online", "'online' or 'offline' (no network: run files go to <run>/wandb/, upload with `wandb sync`)"
    )
    base_url: str | None = _field(None, "a self-hosted W&B server URL; null: WANDB_BASE_URL or wandb.ai")
    api_key_secret: str | None = _field(
        None, "Kubernetes Secret holding the API key; rendered as a secretKeyRef env WANDB_API_KEY, never a value"
    )
    api_key_secret_key: str = _field("WANDB_API_KEY", "the key of the API key inside api_key_secret")


class TrackingConfig(_Section):
    mlflow: MlflowTracking | None = _field(None, "log to an MLflow tracking server; null: not")
    tensorboard: TensorboardTracking | None = _field(
        None, "TensorBoard event files under <run>/tensorboard/ ({} turns them on; configs/demo.yaml does)"
    )
    wandb: WandbTracking | None = _field(None, "log to Weights & Biases; null: not")
    timeout_seconds: float = _field(
        10.0, "longest wait for one tracker call; a tracker that misses it is skipped with a warning", gt=0, le=300
    )
    argo_ui_url: str | None = _field(
        None, "base URL of the Argo UI (https://argo.example.com), for the tracker's link to the Workflow"
    )


# ---------------------------------------------------------------------------------------------- root


class RunConfig(_Section):
    name: str = _field("demo", "run name: lowercase letters, digits and '-', at most 40 characters")
    seed: int = _field(0, "seed of every random choice (prompts, sampling, init)", ge=0)
    sft_checkpoint: str = Field(description="the SFT checkpoint to start from: a file:// or s3:// URI or a path")
    run_store: str = Field(description="the run store: a file:// or s3://bucket/prefix URI or a path")
    iterations: int = _field(6, "RL iterations of the run", ge=1, le=100_000)
    segment_size: int = _field(
        25,
        "iterations per Workflow object; longer runs are split into segments that resume from LATEST",
        ge=1,
    )
    staleness: Literal[0, 1] = _field(0, "0: synchronous; 1: rollout of iteration i+1 overlaps update i")
    task: TaskConfig | None = _field(None, "the built-in task to train on (default: addition)")
    prompt_file: str | None = _field(
        None, "prompts from a JSONL or Parquet file on a store instead of a built-in task"
    )
    prompt_fields: PromptFieldsConfig = _field(PromptFieldsConfig(), "field names of the prompt file's records")
    heldout_file: str | None = _field(None, "held-out prompts of a prompt-file run (same format and fields)")
    heldout_fraction: float = _field(
        0.1,
        "without heldout_file: share of the prompt file held out by a stable hash of the prompt id (0: none)",
        ge=0,
        lt=1,
    )
    prompt_format: Literal["raw", "chat"] = _field(
        "raw", "'raw': the prompt text as it is; 'chat': through the checkpoint's chat template"
    )
    system_prompt: str | None = _field(None, "prompt_format chat: a system message put before each prompt")
    chat_template_kwargs: dict[str, Any] = _field(
        {}, "prompt_format chat: keyword arguments of the chat template, e.g. {enable_thinking: false}"
    )
    prompts_per_iteration: int = _field(64, "training prompts sampled per iteration", ge=1)
    group_size: int = _field(8, "samples per prompt (the GRPO group)", ge=1)
    heldout_size: int = _field(128, "held-out prompts scored for accuracy each iteration", ge=0)
    rollout: RolloutConfig = _field(RolloutConfig(), "experience generation")
    environment: EnvironmentConfig | None = _field(
        None,
        "multi-turn rollouts: the environment each conversation talks to (its observations and tool results) "
        "between the model's turns; none: one prompt, one response",
    )
    sampling: SamplingConfig = _field(SamplingConfig(), "sampling settings of the rollout engine")
    rewards: RewardsConfig = _field(RewardsConfig(), "reward functions and advantages")
    trainer: TrainerConfig = _field(TrainerConfig(), "policy update: expert parallelism, optimizer and loss")
    checkpoint: CheckpointConfig = _field(CheckpointConfig(), "checkpoint retention")
    images: Images = _field(Images(), "container image per role")
    placement: dict[Literal["rollout", "score", "trainer", "control"], Placement] = _field(
        {}, "where each role's pods run: rollout, score, trainer, control"
    )
    retries: dict[Literal["rollout", "score", "trainer", "control"], Retry] = _field(
        {}, "retry limit and backoff per role: rollout, score, trainer, control"
    )
    capacity_label: str | None = _field(
        "karpenter.sh/capacity-type",
        "node label that tells Spot from on-demand nodes; each role is pinned to 'spot' or 'on-demand' with it "
        "unless its node_selector names the label itself; null: pin nothing",
    )
    namespace: str = _field("moerl", "Kubernetes namespace of the Workflows")
    service_account: str = _field("moerl-workflow", "service account of the pods (IRSA gives it S3 access)")
    argo: ArgoConfig = _field(ArgoConfig(), "Argo Workflow settings")
    schedule: ScheduleConfig = _field(ScheduleConfig(), "the CronWorkflow that continues the run")
    tracking: TrackingConfig = _field(
        TrackingConfig(), "experiment trackers the steps log to: mlflow, tensorboard, wandb (default: none)"
    )

    def model_post_init(self, context: Any) -> None:
        # Roles left out get their defaults, so `placement: {trainer: ...}` needs not repeat the others.
        self.placement = {**_default_placement(), **self.placement}
        self.retries = {**_default_retries(), **self.retries}
        if self.task is None and self.prompt_file is None:
            self.task = TaskConfig()

    def role(self, role: str) -> Placement:
        return self.placement[role]

    def segment_last(self, iteration: int) -> int:
        """The last iteration of the segment (one Workflow: segment_size iterations) that runs `iteration`:
        the Workflow's daemons, a trainer that stays up among them, end after it."""
        return min(-(-iteration // self.segment_size) * self.segment_size, self.iterations)

    @property
    def records_routes(self) -> bool:
        """Whether the rollout records the routed experts (rollout.record_routes, or the trainer replays them)."""
        return self.rollout.record_routes or self.trainer.routing_replay == "rollout"


def training_view(config: dict[str, Any]) -> dict[str, Any]:
    """A dumped config without the fields that may change between the Workflows of one run.

    Those are OPERATIONAL_FIELDS and, within their sections, OPERATIONAL_SECTION_FIELDS: chunks, not shards or
    servers, fix what is sampled, and a trainer that stays up trains the bits of one started per iteration.
    """
    out = {k: v for k, v in config.items() if k not in OPERATIONAL_FIELDS}
    for section, fields in OPERATIONAL_SECTION_FIELDS.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k not in fields}
    return out



def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that holds the field at `loc` (for did-you-mean on unknown fields)."""
    annotation: Any = RunConfig
    for part in loc:
        model = _unwrap_model(annotation)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
            continue
        origin = typing.get_origin(annotation)
        if origin in (dict, list):  # a key or an index: step into the value type
            annotation = typing.get_args(annotation)[-1]
            continue
        model = _unwrap_model(annotation)
        if model is None:
            return None
        annotation = model
    return _unwrap_model(annotation)


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _describe(loc: tuple[Any, ...]) -> str:
    """The description of the field at `loc` (or of its nearest described parent): the hint after an error."""
    while loc:
        model = _model_at(loc[:-1])
        if model is not None and loc[-1] in model.model_fields and model.model_fields[loc[-1]].description:
            return model.model_fields[loc[-1]].description or ""
        loc = loc[:-1]
    return ""


def _explain(err: Any) -> tuple[str, str]:
    # Pydantic puts union members and validator kinds into the path ('int', 'function-after[...]') and marks
    # a bad dict key with '[key]': keep only the user's own path.
    raw = err["loc"]
    bad_key = "[key]" in raw
    kind = err["type"]
    # The last part of an unknown field's path is the user's own key, whatever it looks like ('a[0]', 'int').
    head, tail = (raw[:-1], raw[-1:]) if kind == "extra_forbidden" else (raw, ())
    is_tag = lambda p: isinstance(p, str) and ("[" in p or p in ("int", "str", "float", "bool"))  # noqa: E731
    loc = tuple(p for p in head if not is_tag(p)) + tuple(tail)
    path = ".".join(str(p) for p in loc) or "(top level)"
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        known = sorted(model.model_fields) if model else []
        guess = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        fix = f"did you mean {guess[0]!r}?" if guess else f"remove it; known fields here: {', '.join(known)}"
        return path, f"unknown field; {fix}"
    if kind == "missing":
        return path, f"required field is missing; add it ({_describe(loc)})"
    if bad_key:
        allowed = re.findall(r"'([^']+)'", str(err.get("ctx", {}).get("expected", "")))
        guess = difflib.get_close_matches(str(err.get("input")), allowed, n=1)
        fix = f"did you mean {guess[0]!r}?" if guess else f"use one of: {', '.join(allowed)}"
        return path, f"unknown key; {fix}"
    got = err.get("input")
    got_text = "" if isinstance(got, dict | list) else f" (got {got!r})"
    hint = _describe(loc)
    return path, f"{err['msg']}{got_text}" + (f"; {hint}" if hint else "")


def _merge(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One line per field: a value that fits no member of a union (int | str) yields one error per member."""
    merged: dict[str, str] = {}
    for path, message in problems:
        if path in merged:
            first, _, hint = merged[path].partition("; ")
            extra = message.partition("; ")[0].removeprefix("Input should be ")
            merged[path] = f"{first} or {extra}" + (f"; {hint}" if hint else "")
        else:
            merged[path] = message
    return list(merged.items())


def _format(source: str, problems: list[tuple[str, str]]) -> str:
    lines = [f"{source}: {len(problems)} problem{'s' if len(problems) > 1 else ''} in the run config:"]
    lines += [f"  {path}: {message}" for path, message in problems]
    return "\n".join(lines)


def validate_config(data: Any, source: str = "run config") -> RunConfig:
    """Validate a parsed config mapping; one MoerlError lists every problem."""
    if not isinstance(data, dict):
        raise MoerlError(f"{source}: the run config must be a YAML mapping of fields, got {type(data).__name__}")
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise MoerlError(_format(source, _merge([_explain(e) for e in err.errors()]))) from None
    problems = semantic_problems(cfg)
    if problems:
        raise MoerlError(_format(source, problems))
    return cfg


def load_run_config(run: Store) -> RunConfig:
    """<run>/run.json, validated as a RunConfig (import-sft writes it)."""
    if not run.exists(RUN_CONFIG):
        raise MoerlError(
            f"{run.url(RUN_CONFIG)}: no run config; the run has not been imported yet — run "
            "`python -m steps.import_sft --src SFT_URI --run RUN_URI --run-config-json ...` (the workflow's "
            "import-sft step) first, or check the --run URI"
        )
    return validate_config(run.get_json(RUN_CONFIG), run.url(RUN_CONFIG))
