"""`moerl simulate CONFIG`: a discrete-event model of the run's workflow on a cluster.

It answers sizing questions before a cluster is rented: how long an iteration takes, how many tokens per second
the rollout pool turns out, how much of each GPU pool sits idle, and what asynchronous training (staleness 1)
buys over synchronous training (staleness 0). Both staleness values are always simulated and compared.

The model, in the order a run meets it:

- The DAG is the workflow's own: `pipelines.workflow.graph.dependencies` per segment (plan, import-sft, then
  rollout-i x shards -> score-i -> update-i -> publish-i, with staleness 1 letting rollout-(i+1) overlap
  update-i), the report exit handler after each segment, and the next segment's Workflow after that.
- Pools come from the config's placement. Rollout: a Spot GPU pool of one node per shard (one SGLang engine per
  node), `nvidia.com/gpu` GPUs each. Trainer: an on-demand gang of trainer.nodes nodes that one update takes
  whole. CPU: score and the control steps, never short of room. A config without GPUs is this machine: one node
  on which the local executor starts every ready step at once (the rendered Workflow sets no parallelism).
- Step durations are measured figures (`--step-times`: per-step seconds, or a `moerl local --status-out` status
  that `step_times_from_status` reduces to its median per step kind) or derived from the config and the
  `Assumptions` below. A rollout shard is an engine start-up (model load) followed by its chunks.
- Spot interruptions: a Poisson process per rollout node (X per node-hour). An interrupted node takes its pods
  with it and comes back after `node_replacement_s`; an interrupted shard keeps its finished chunks (they are
  resumable), loses the chunk it was generating, and is requeued after the config's retry backoff; it then
  waits for a free node and pays the engine start-up again. A shard that runs out of retries (limit or
  max_duration) is counted: the real run would have failed there.

Iteration time is the time between two successive publications (the first one counted from the end of
import-sft), the same definition that `iteration_times_from_status` applies to a real run. Tokens are sampled
response tokens: prompts_per_iteration x group_size x max_new_tokens x response_fill.

Deterministic: one `random.Random(seed)` per simulated run, events ordered by (time, sequence number).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import heapq
import itertools
import json
import math
import random
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pipelines.config import load_config, parse_overrides
from pipelines.local.executor import backoff_seconds
from pipelines.local.expressions import parse_duration
from pipelines.workflow import graph
from steps.errors import MoerlError
from steps.run_config import RunConfig

GPU = "nvidia.com/gpu"
# Step kinds: the workflow's template names. engine_startup is the part of a rollout shard spent before it
# generates (pod start, model load); a measured rollout figure includes it.
STEP_KINDS = ("plan", "import-sft", "rollout", "score", "update", "publish", "report", "next-segment")
ENGINE_STARTUP = "engine_startup"


# ---------------------------------------------------------------------------------------------- assumptions


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

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


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
    return {"rollout": "rollout", "update": "trainer"}.get(step, "cpu")


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


# ------------------------------------------------------------------------------------ reading a real status

_ITERATION_TASK = re.compile(r"\.(?P<step>rollout|score|update|publish)-(?P<iteration>\d+)(\(|$)")


def _nodes(status: dict[str, Any]) -> dict[str, Any]:
    """The nodes of an Argo status, of a whole Workflow object (`argo get -o json`), or of `moerl local`."""
    if isinstance(status.get("status"), dict):
        status = status["status"]
    nodes = status.get("nodes")
    if not isinstance(nodes, dict):
        raise MoerlError("the status has no 'nodes'; pass the file `moerl local --status-out FILE` wrote")
    return nodes


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def pod_attempts(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Every Succeeded pod: step kind, iteration (None for plan, import-sft, report), start and end seconds.

    A preempted or failed attempt is no measure of a step's duration and is left out."""
    out = []
    for node in _nodes(status).values():
        if node.get("type") != "Pod" or node.get("phase") != "Succeeded" or not node.get("finishedAt"):
            continue
        match = _ITERATION_TASK.search(node["name"])
        out.append(
            {
                "step": node.get("templateName", ""),
                "iteration": int(match["iteration"]) if match else None,
                "start": _seconds(node["startedAt"]),
                "end": _seconds(node["finishedAt"]),
            }
        )
    return sorted(out, key=lambda p: (p["start"], p["end"]))


def step_times_from_status(status_json: dict[str, Any] | str | Path) -> dict[str, float]:
    """Median seconds per step kind (plan, import-sft, rollout per shard, score, update, publish, report) of
    the Succeeded pods in a `moerl local --status-out` status (or an Argo Workflow's status).

    Argo and the local executor stamp pods with whole seconds, so a step shorter than a few seconds is
    measured to about a second; the median keeps one slow or retried outlier from steering the figure."""
    status = _read_json(status_json) if isinstance(status_json, str | Path) else status_json
    durations: dict[str, list[float]] = {}
    for pod in pod_attempts(status):
        if pod["step"] in STEP_KINDS:
            durations.setdefault(pod["step"], []).append(pod["end"] - pod["start"])
    if not durations:
        raise MoerlError("the status holds no Succeeded pod of a moerl step; run the workflow to the end first")
    return {kind: statistics.median(values) for kind, values in durations.items()}


def iteration_times_from_status(status_json: dict[str, Any] | str | Path) -> list[float]:
    """Seconds between successive publications; the first from the end of import-sft (or plan, if the run
    resumed). The same definition as SimResult.iteration_times."""
    status = _read_json(status_json) if isinstance(status_json, str | Path) else status_json
    pods = pod_attempts(status)
    starts = [p["end"] for p in pods if p["step"] == "import-sft"] or [p["end"] for p in pods if p["step"] == "plan"]
    published = sorted(p["end"] for p in pods if p["step"] == "publish")
    if not starts or not published:
        raise MoerlError("the status has no plan/import-sft and publish pods; it is not of a moerl run")
    marks = [min(starts), *published]
    return [b - a for a, b in itertools.pairwise(marks)]


def _read_json(path: str | Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise MoerlError(f"{path}: cannot read it ({err.strerror}); check the path") from None
    except json.JSONDecodeError as err:
        raise MoerlError(f"{path}: not valid JSON ({err}); pass a step-times or status JSON file") from None
    if not isinstance(data, dict):
        raise MoerlError(f"{path}: expected a JSON object of step name -> seconds, or a workflow status")
    return data


def load_step_times(path: str | Path) -> dict[str, float]:
    """A step-times JSON ({"rollout": 12.5, "update": 30, ...}) or a status JSON, reduced to step times."""
    data = _read_json(path)
    if "nodes" in data or isinstance(data.get("status"), dict):
        return step_times_from_status(data)
    known = (*STEP_KINDS, ENGINE_STARTUP)
    out = {}
    for key, value in data.items():
        if key not in known:
            guess = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else f"use {', '.join(known)}"
            raise MoerlError(f"{path}: unknown step {key!r}; {hint}")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or not math.isfinite(value):
            raise MoerlError(f"{path}: {key} must be a number of seconds >= 0, got {value!r}")
        out[key] = float(value)
    return out


# ------------------------------------------------------------------------------------------------ the model


@dataclass
class Segment:
    """One interval of a pod on a node, for the pool shares and the timeline."""

    pool: str
    node: int
    start: float
    end: float
    step: str
    iteration: int | None
    phase: str  # "startup", "work", "lost" (generation an interruption threw away) or "down" (node gone)


@dataclass
class PoolUsage:
    slots_per_node: int | None  # 1: a pod takes a whole node, so the shares below are shares of GPU time
    node_seconds: float = 0.0  # nodes up x time, over the run
    busy_seconds: float = 0.0  # node time with at least one pod on the node
    startup_seconds: float = 0.0
    lost_seconds: float = 0.0

    @property
    def idle_share(self) -> float:
        """Share of node time with no pod on the node (a replaced Spot node counts from when it is back)."""
        return 1.0 - self.busy_seconds / self.node_seconds if self.node_seconds else 0.0

    @property
    def startup_share(self) -> float | None:
        """Share of node time spent starting engines; None where pods share a node (this machine)."""
        if self.slots_per_node != 1 or not self.node_seconds:
            return None
        return self.startup_seconds / self.node_seconds


@dataclass
class SimResult:
    staleness: int
    iterations: int
    iteration_times: list[float]
    makespan: float
    tokens_per_iteration: float
    rollout_spans: list[float]  # first shard start to last shard end, per iteration
    usage: dict[str, PoolUsage]
    interruptions: int
    requeues: int
    retries_exhausted: int
    segments: list[Segment]
    publish_times: list[float]

    @property
    def mean_iteration_s(self) -> float:
        return statistics.fmean(self.iteration_times)

    def percentile(self, q: float) -> float:
        return percentile(self.iteration_times, q)

    @property
    def tokens_per_s(self) -> float:
        """Sampled tokens per second over the iterations: what the run as a whole turns out."""
        return self.tokens_per_iteration * len(self.iteration_times) / sum(self.iteration_times)

    @property
    def generating_tokens_per_s(self) -> float:
        """Sampled tokens per second while an iteration's rollout runs (its first shard start to its last end)."""
        return self.tokens_per_iteration / statistics.fmean(self.rollout_spans)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class _Node:
    pool: Pool
    index: int
    up: bool = True
    up_since: float = 0.0
    jobs: list[_Job] = field(default_factory=list)
    busy_since: float | None = None

    def has_room(self) -> bool:
        slots = self.pool.slots_per_node
        return self.up and (slots is None or len(self.jobs) < slots)


@dataclass
class _Job:
    """One pod of a task (a rollout shard, or the single pod of any other step) and its retries."""

    task: _Task
    step: str
    pool: str
    shard: int = 0
    chunks_left: int = 0
    duration: float = 0.0  # a fixed step's seconds
    attempt: int = 1
    first_start: float | None = None
    node: _Node | None = None
    started: float = 0.0
    token: int = 0  # bumped when an attempt is interrupted: its pending finish event is void


@dataclass
class _Task:
    key: tuple[int, str]  # (segment index, task name)
    step: str
    iteration: int | None
    waiting_for: int  # unfinished dependencies
    dependents: list[tuple[int, str]] = field(default_factory=list)
    pods_left: int = 0
    first_start: float | None = None
    end: float | None = None


class Simulation:
    """Events on a heap: (time, sequence number, callback). One instance simulates one run."""

    def __init__(
        self,
        cfg: RunConfig,
        steps: StepModel,
        cluster: Cluster,
        assumptions: Assumptions,
        *,
        staleness: int,
        iterations: int,
        interruptions_per_hour: float,
        seed: int,
    ):
        self.cfg, self.steps, self.cluster = cfg, steps, cluster
        self.staleness, self.iterations = staleness, iterations
        self.rate = interruptions_per_hour / 3600.0
        self.node_replacement_s = assumptions.node_replacement_s
        self.tokens = tokens_per_iteration(cfg, assumptions)
        self.rng = random.Random(seed)
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.sequence = itertools.count()
        self.nodes = {p.name: [_Node(p, k) for k in range(p.nodes)] for p in cluster.pools()}
        self.queues: dict[str, list[_Job]] = {p.name: [] for p in cluster.pools()}
        self.usage = {p.name: PoolUsage(p.slots_per_node) for p in cluster.pools()}
        self.segments: list[Segment] = []
        self.tasks: dict[tuple[int, str], _Task] = {}
        self.unfinished: dict[int, int] = {}  # tasks of each segment's DAG not yet done
        self.interruptions = self.requeues = self.retries_exhausted = 0
        self.loop_start: float | None = None
        self.finished = False
        # One Workflow on this machine; on a cluster one per segment of segment_size iterations.
        size = iterations if cluster.local else cfg.segment_size
        self.workflow_segments = graph.segments(iterations, size)

    # -- event plumbing
    def at(self, time: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self.heap, (time, next(self.sequence), callback))

    def run(self) -> SimResult:
        if self.rate > 0:
            for node in self.nodes["rollout"]:
                if node.pool.spot:
                    self.schedule_interruption(node)
        self.start_segment(0)
        while self.heap and not self.finished:
            self.now, _, callback = heapq.heappop(self.heap)
            callback()
        return self.result()

    # -- the DAG
    def start_segment(self, index: int) -> None:
        segment = self.workflow_segments[index]
        deps = graph.dependencies(segment, self.staleness)
        for name, parents in deps.items():
            step, _, number = name.rpartition("-")
            iteration = int(number) if step in graph.STEPS else None
            step = step if iteration is not None else name
            self.tasks[(index, name)] = _Task((index, name), step, iteration, len(parents))
        self.unfinished[index] = len(deps)
        for name, parents in deps.items():
            for parent in parents:
                self.tasks[(index, parent)].dependents.append((index, name))
        for name, parents in deps.items():
            if not parents:
                self.start_task(self.tasks[(index, name)])

    def start_task(self, task: _Task) -> None:
        if task.step == "rollout":
            jobs = [
                _Job(task, "rollout", "rollout", shard=s, chunks_left=shard_chunks(self.cfg, s))
                for s in range(self.cfg.rollout.num_shards)
            ]
        else:
            jobs = [_Job(task, task.step, pool_of(task.step), duration=self.steps.fixed(task.step))]
        task.pods_left = len(jobs)
        for job in jobs:
            self.submit(job)

    def task_done(self, task: _Task) -> None:
        task.end = self.now
        segment_index, name = task.key
        if name == graph.IMPORT_SFT or (name == graph.PLAN and self.loop_start is None):
            self.loop_start = self.now  # import-sft finishes after plan: it overrides plan's mark
        if name == graph.REPORT:
            if segment_index + 1 < len(self.workflow_segments):
                self.start_segment(segment_index + 1)
            else:
                self.finished = True
            return
        for key in task.dependents:
            child = self.tasks[key]
            child.waiting_for -= 1
            if child.waiting_for == 0:
                self.start_task(child)
        self.unfinished[segment_index] -= 1
        if self.unfinished[segment_index] == 0:
            # The DAG is done: the exit handler reports, then (on a cluster) the next segment's Workflow runs.
            report = _Task((segment_index, graph.REPORT), graph.REPORT, None, 0)
            self.tasks[report.key] = report
            self.start_task(report)

    # -- pods on pools
    def submit(self, job: _Job) -> None:
        self.queues[job.pool].append(job)
        self.dispatch(job.pool)

    def dispatch(self, pool: str) -> None:
        queue = self.queues[pool]
        while queue:
            node = next((n for n in self.nodes[pool] if n.has_room()), None)
            if node is None:
                return
            self.start_job(queue.pop(0), node)

    def start_job(self, job: _Job, node: _Node) -> None:
        job.node, job.started = node, self.now
        if job.first_start is None:
            job.first_start = self.now
        if job.task.first_start is None:
            job.task.first_start = self.now
        if not node.jobs:
            node.busy_since = self.now
        node.jobs.append(job)
        token = job.token
        self.at(self.now + self.job_seconds(job), lambda: self.finish_job(job, token))

    def job_seconds(self, job: _Job) -> float:
        if job.step == "rollout":
            return self.steps.rollout_startup_s + job.chunks_left * self.steps.rollout_chunk_s
        return job.duration

    def leave_node(self, job: _Job) -> None:
        node = job.node
        assert node is not None
        node.jobs.remove(job)
        if not node.jobs and node.busy_since is not None:
            self.usage[node.pool.name].busy_seconds += self.now - node.busy_since
            node.busy_since = None
        job.node = None

    def record(self, job: _Job, start: float, end: float, phase: str) -> None:
        if end <= start or job.node is None:
            return
        pool = job.node.pool.name
        self.segments.append(Segment(pool, job.node.index, start, end, job.step, job.task.iteration, phase))
        if phase == "startup":
            self.usage[pool].startup_seconds += end - start
        elif phase == "lost":
            self.usage[pool].lost_seconds += end - start

    def finish_job(self, job: _Job, token: int) -> None:
        if token != job.token:  # this attempt was interrupted; its finish never comes
            return
        if job.step == "rollout":
            generate_from = job.started + self.steps.rollout_startup_s
            self.record(job, job.started, generate_from, "startup")
            self.record(job, generate_from, self.now, "work")
        else:
            self.record(job, job.started, self.now, "work")
        self.leave_node(job)
        job.task.pods_left -= 1
        if job.task.pods_left == 0:
            self.task_done(job.task)
        self.dispatch(job.pool)

    # -- Spot interruptions
    def schedule_interruption(self, node: _Node) -> None:
        self.at(self.now + self.rng.expovariate(self.rate), lambda: self.interrupt(node))

    def interrupt(self, node: _Node) -> None:
        self.interruptions += 1
        for job in list(node.jobs):
            self.preempt(job)
        self.usage[node.pool.name].node_seconds += self.now - node.up_since
        node.up = False
        self.segments.append(Segment(node.pool.name, node.index, self.now, self.now + self.node_replacement_s,
                                     "", None, "down"))  # fmt: skip
        self.at(self.now + self.node_replacement_s, lambda: self.replace(node))

    def replace(self, node: _Node) -> None:
        node.up, node.up_since = True, self.now
        if self.rate > 0:
            self.schedule_interruption(node)
        self.dispatch(node.pool.name)

    def preempt(self, job: _Job) -> None:
        """The shard keeps its finished chunks, loses the one in progress, and is retried after a backoff."""
        generate_from = job.started + self.steps.rollout_startup_s
        done = 0
        if self.now > generate_from and self.steps.rollout_chunk_s > 0:
            done = min(int((self.now - generate_from) / self.steps.rollout_chunk_s), job.chunks_left)
        kept_until = min(generate_from + done * self.steps.rollout_chunk_s, self.now)
        self.record(job, job.started, min(generate_from, self.now), "startup")
        self.record(job, generate_from, kept_until, "work")
        self.record(job, max(kept_until, job.started), self.now, "lost")
        self.leave_node(job)
        job.chunks_left -= done
        job.token += 1
        retry = self.cfg.retries["rollout"]
        backoff = retry.backoff.model_dump()
        wait = backoff_seconds(backoff, job.attempt)
        max_duration = parse_duration(retry.backoff.max_duration) if retry.backoff.max_duration else math.inf
        if job.attempt > retry.limit or self.now + wait - (job.first_start or 0.0) > max_duration:
            self.retries_exhausted += 1  # Argo would fail the run here; the model goes on to show the rest
        job.attempt += 1
        self.requeues += 1
        self.at(self.now + wait, lambda: self.submit(job))

    # -- results
    def result(self) -> SimResult:
        for pool, nodes in self.nodes.items():
            for node in nodes:
                if node.up:
                    self.usage[pool].node_seconds += self.now - node.up_since
                if node.busy_since is not None:
                    self.usage[pool].busy_seconds += self.now - node.busy_since
        published = sorted(t.end for t in self.tasks.values() if t.step == "publish" and t.end is not None)
        marks = [self.loop_start or 0.0, *published]
        spans = [
            t.end - t.first_start
            for t in self.tasks.values()
            if t.step == "rollout" and t.end is not None and t.first_start is not None
        ]
        return SimResult(
            staleness=self.staleness,
            iterations=self.iterations,
            iteration_times=[b - a for a, b in itertools.pairwise(marks)],
            makespan=self.now,
            tokens_per_iteration=self.tokens,
            rollout_spans=spans,
            usage=self.usage,
            interruptions=self.interruptions,
            requeues=self.requeues,
            retries_exhausted=self.retries_exhausted,
            segments=self.segments,
            publish_times=published,
        )


def simulate(
    cfg: RunConfig,
    steps: StepModel,
    cluster: Cluster,
    assumptions: Assumptions,
    *,
    staleness: int | None = None,
    iterations: int | None = None,
    interruptions_per_hour: float = 0.0,
    seed: int = 0,
) -> SimResult:
    """Simulate one run of the config's workflow; staleness and iterations default to the config's."""
    if interruptions_per_hour < 0 or not math.isfinite(interruptions_per_hour):
        raise MoerlError("--spot-interruptions-per-hour must be >= 0 (interruptions per node-hour, e.g. 0.05)")
    return Simulation(
        cfg,
        steps,
        cluster,
        assumptions,
        staleness=cfg.staleness if staleness is None else staleness,
        iterations=iterations or cfg.iterations,
        interruptions_per_hour=interruptions_per_hour,
        seed=seed,
    ).run()


def simulate_both(
    cfg: RunConfig,
    steps: StepModel,
    cluster: Cluster,
    assumptions: Assumptions,
    *,
    iterations: int | None = None,
    interruptions_per_hour: float = 0.0,
    seed: int = 0,
) -> dict[int, SimResult]:
    """The same run synchronous (staleness 0) and asynchronous (staleness 1), with the same seed."""
    return {
        staleness: simulate(
            cfg,
            steps,
            cluster,
            assumptions,
            staleness=staleness,
            iterations=iterations,
            interruptions_per_hour=interruptions_per_hour,
            seed=seed,
        )
        for staleness in (0, 1)
    }


# ------------------------------------------------------------------------------------------------ printout


def _fmt_s(seconds: float) -> str:
    return f"{seconds:,.1f} s"


def _fmt_h(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3 * 3600 else _fmt_s(seconds)


def table(results: dict[int, SimResult], configured: int) -> str:
    """Sync and async side by side; the config's own staleness is starred."""
    columns = [0, 1]
    heads = [f"{'sync' if s == 0 else 'async'} (staleness {s}){'*' if s == configured else ''}" for s in columns]
    rows: list[tuple[str, list[str]]] = [
        ("iteration time, mean", [_fmt_s(results[s].mean_iteration_s) for s in columns]),
        ("iteration time, p50", [_fmt_s(results[s].percentile(50)) for s in columns]),
        ("iteration time, p95", [_fmt_s(results[s].percentile(95)) for s in columns]),
        ("rollout tokens/s, whole run", [f"{results[s].tokens_per_s:,.0f}" for s in columns]),
        ("rollout tokens/s, while generating", [f"{results[s].generating_tokens_per_s:,.0f}" for s in columns]),
    ]
    for pool in ("rollout", "trainer"):
        rows.append((f"{pool} pool idle", [f"{results[s].usage[pool].idle_share:.0%}" for s in columns]))
    if results[0].usage["rollout"].startup_share is not None:
        rows.append(
            ("rollout pool in engine start-up", [f"{results[s].usage['rollout'].startup_share:.0%}" for s in columns])
        )
    rows.append(
        ("Spot interruptions / requeues", [f"{results[s].interruptions} / {results[s].requeues}" for s in columns])
    )
    rows.append(("shards out of retries", [str(results[s].retries_exhausted) for s in columns]))
    rows.append(("whole run (with start and report)", [_fmt_h(results[s].makespan) for s in columns]))
    width = max(len(label) for label, _ in rows) + 2
    col = max(max(len(h) for h in heads), 14) + 2
    lines = ["".ljust(width) + "".join(h.rjust(col) for h in heads)]
    lines += [label.ljust(width) + "".join(v.rjust(col) for v in values) for label, values in rows]
    speedup = results[0].mean_iteration_s / results[1].mean_iteration_s
    lines.append(
        f"async vs sync: {speedup:.2f}x iterations per hour "
        f"({results[0].mean_iteration_s - results[1].mean_iteration_s:+.1f} s saved per iteration)"
    )
    return "\n".join(lines)


def describe(cfg: RunConfig, cluster: Cluster, steps: StepModel, a: Assumptions) -> str:
    chunks = chunks_per_iteration(cfg)
    per_shard = chunks / cfg.rollout.num_shards
    shard_s = steps.rollout_startup_s + per_shard * steps.rollout_chunk_s
    lines = [
        f"cluster: rollout {cluster.rollout.label}; trainer {cluster.trainer.label}; cpu: {cluster.cpu.label}",
        f"per iteration: {cfg.prompts_per_iteration} prompts x {cfg.group_size} samples x "
        f"{cfg.sampling.max_new_tokens} tokens (fill {a.response_fill:g}) = "
        f"{tokens_per_iteration(cfg, a):,.0f} tokens in {chunks} chunks over {cfg.rollout.num_shards} shards",
        f"step times ({steps.source}):",
        f"  rollout {shard_s:.1f} s a shard = start-up {steps.rollout_startup_s:.1f} s + {per_shard:g} "
        f"chunk{'' if per_shard == 1 else 's'} x "
        f"{steps.rollout_chunk_s:.2f} s; score {steps.score_s:.1f} s; update {steps.update_s:.1f} s; "
        f"publish {steps.publish_s:.1f} s",
        f"  plan {steps.plan_s:.1f} s; import-sft {steps.import_sft_s:.1f} s; report {steps.report_s:.1f} s",
    ]
    if cluster.local:
        lines.append(
            "note: on this machine overlapping steps share its cores and the model does not slow them down: "
            "measure staleness 1 for its real gain here"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ timeline

STEP_COLORS = {
    "plan": "#9e9e9e",
    "import-sft": "#795548",
    "rollout": "#1f77b4",
    "score": "#ff7f0e",
    "update": "#2ca02c",
    "publish": "#9467bd",
    "report": "#e377c2",
    "next-segment": "#bdbdbd",
}


def plot_timeline(results: dict[int, SimResult], path: str | Path, first_iterations: int = 3) -> Path:
    """A Gantt chart of the first iterations, sync above async: one row per node (up to 16 rollout nodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), squeeze=False)
    for ax, staleness in zip(axes[:, 0], (0, 1), strict=True):
        result = results[staleness]
        shown = min(first_iterations, len(result.publish_times))
        until = result.publish_times[shown - 1] if shown else result.makespan
        all_rollout_rows = sorted({s.node for s in result.segments if s.pool == "rollout"})
        rollout_rows = all_rollout_rows[:16]
        rows = [("rollout", n) for n in rollout_rows] + [("trainer", 0), ("cpu", 0)]
        y_of = {row: k for k, row in enumerate(rows)}
        for seg in result.segments:
            row = (seg.pool, seg.node)
            if row not in y_of or seg.start >= until:
                continue
            end = min(seg.end, until)
            y = y_of[row]
            if seg.phase == "down":
                ax.broken_barh(
                    [(seg.start, end - seg.start)], (y - 0.4, 0.8), facecolor="#f4f4f4", edgecolor="#b0b0b0", hatch="//"
                )
                continue
            color = "#d62728" if seg.phase == "lost" else STEP_COLORS.get(seg.step, "#333333")
            alpha = 0.45 if seg.phase == "startup" else 0.95
            ax.broken_barh([(seg.start, end - seg.start)], (y - 0.4, 0.8), color=color, alpha=alpha)
        labels = [f"rollout node {n}" for _, n in rows[:-2]] + ["trainer", "cpu"]
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, until)
        ax.set_xlabel("seconds")
        ax.set_title(
            f"staleness {staleness} ({'sync' if staleness == 0 else 'async'}): first {shown} iterations, "
            f"mean iteration {result.mean_iteration_s:.1f} s"
            + (
                f" ({len(rollout_rows)} of {len(all_rollout_rows)} rollout nodes shown)"
                if len(all_rollout_rows) > 16
                else ""
            )
        )
    handles = [Patch(color=c, label=k) for k, c in STEP_COLORS.items()]
    handles += [
        Patch(color="#1f77b4", alpha=0.45, label="engine start-up"),
        Patch(color="#d62728", label="lost chunk"),
        Patch(facecolor="#f4f4f4", edgecolor="#b0b0b0", hatch="//", label="Spot node replaced"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=11, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------- command line


def parse_assumptions(pairs: list[str], base: Assumptions) -> Assumptions:
    names = [f.name for f in dataclasses.fields(Assumptions)]
    values: dict[str, float] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in names:
            guess = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else f"known: {', '.join(names)}"
            raise MoerlError(f"--assume {pair!r}: not NAME=VALUE with a known name; {hint}")
        try:
            value = float(text)
        except ValueError:
            raise MoerlError(f"--assume {pair!r}: {text!r} is not a number") from None
        throughput = name.endswith("_per_gpu_s") or name.endswith("_per_s")
        if not math.isfinite(value) or value < 0 or (throughput and value == 0):
            raise MoerlError(f"--assume {pair!r}: must be a finite number >= 0 (a throughput > 0)")
        values[name] = int(value) if name == "rollout_nodes" else value
    return base.override(values)


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, parse_overrides(args.set))
    base = CPU_ASSUMPTIONS if is_local(cfg) else GPU_ASSUMPTIONS
    a = parse_assumptions(args.assume, base)
    cluster = cluster_for(cfg, a)
    if args.step_times:
        steps = measured_step_model(cfg, a, load_step_times(args.step_times), str(args.step_times))
    else:
        steps = derived_step_model(cfg, a)
    if args.iterations is not None and args.iterations < 1:
        raise MoerlError(f"--iterations {args.iterations}: simulate at least 1 iteration")
    iterations = args.iterations or cfg.iterations
    results = simulate_both(
        cfg, steps, cluster, a, iterations=iterations, interruptions_per_hour=args.spot_interruptions_per_hour,
        seed=args.seed,
    )  # fmt: skip
    rate = args.spot_interruptions_per_hour
    print(
        f"moerl simulate {args.config}: {iterations} iterations, seed {args.seed}, "
        + (f"{rate:g} Spot interruptions per rollout node-hour" if rate else "no Spot interruptions")
    )
    print(describe(cfg, cluster, steps, a))
    print()
    print(table(results, cfg.staleness))
    if any(r.retries_exhausted for r in results.values()):
        print(
            f"warning: some rollout shards ran out of retries (retries.rollout limit {cfg.retries['rollout'].limit}):"
            " the real run would have failed there"
        )
    if args.plot:
        print(f"wrote {plot_timeline(results, args.plot)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="model the run's workflow on a cluster: iteration time, throughput, idle GPUs, sync vs async",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("config", type=Path, help="run config YAML (e.g. configs/eks-p5en.yaml)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override a config field, e.g. --set trainer.nodes=8 (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--step-times", type=Path, metavar="FILE.json",
        help="measured seconds per step ({\"rollout\": 12.5, ...}) or a `moerl local --status-out` status",
    )  # fmt: skip
    parser.add_argument(
        "--assume", action="append", default=[], metavar="NAME=VALUE",
        help="override an assumption, e.g. --assume rollout_tokens_per_gpu_s=3000 (see pipelines/simulate.py)",
    )  # fmt: skip
    parser.add_argument(
        "--spot-interruptions-per-hour", type=float, default=0.0, metavar="X",
        help="Spot interruptions per rollout node-hour (Poisson; default 0)",
    )  # fmt: skip
    parser.add_argument("--iterations", type=int, metavar="N", help="iterations to simulate (default: the config's)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the interruptions (default 0)")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="write a timeline of the first iterations")
    parser.set_defaults(func=main)
