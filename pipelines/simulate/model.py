"""The discrete-event model: one run of the workflow's DAG on the cluster's pools, with Spot interruptions
and the config's retries (see the package docstring for what it models)."""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from pipelines.durations import backoff_seconds, parse_duration
from pipelines.simulate.servers import ServedSteps
from pipelines.simulate.sizing import Assumptions, Cluster, StepModel, pool_of, shard_chunks, tokens_per_iteration
from pipelines.simulate.state import Job, Node, PoolUsage, Segment, Task
from pipelines.workflow import graph
from steps.errors import MoerlError
from steps.run.config import RunConfig


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
    server_starts: dict[str, int] = field(default_factory=dict)  # starts per server kind (segments, replacements)
    servers_out_of_retries: int = 0  # of retries_exhausted: long-lived servers (their daemon's retryStrategy)

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


class Simulation(ServedSteps):
    """Events on a heap: (time, sequence number, callback). One instance simulates one run.

    Engines that stay up (rollout.servers, trainer.server) are ServedSteps' (servers.py)."""

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
        self.tied_group_share = assumptions.tied_group_share
        self.rng = random.Random(seed)
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.sequence = itertools.count()
        self.nodes = {p.name: [Node(p, k) for k in range(p.nodes)] for p in cluster.pools()}
        self.queues: dict[str, list[Job]] = {p.name: [] for p in cluster.pools()}
        self.usage = {p.name: PoolUsage(p.slots_per_node) for p in cluster.pools()}
        self.segments: list[Segment] = []
        self.tasks: dict[tuple[int, str], Task] = {}
        self.unfinished: dict[int, int] = {}  # tasks of each segment's DAG not yet done
        self.interruptions = self.requeues = self.retries_exhausted = self.servers_out_of_retries = 0
        self.latest = 0  # the newest published version
        self.has_v0 = False  # v000000 is there once the first segment's import-sft is done
        self.init_servers()
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
        deps = graph.run_dependencies(segment, self.cfg, servers_run=True, staleness=self.staleness)
        for name, parents in deps.items():
            step, _, number = name.rpartition("-")
            iteration = int(number) if step in graph.STEPS else None
            step = step if iteration is not None else name
            self.tasks[(index, name)] = Task((index, name), step, iteration, len(parents))
        self.unfinished[index] = len(deps)
        for name, parents in deps.items():
            for parent in parents:
                self.tasks[(index, parent)].dependents.append((index, name))
        for name, parents in deps.items():
            if not parents:
                self.start_task(self.tasks[(index, name)])

    def start_task(self, task: Task) -> None:
        if task.step == "rollout":
            served = self.rollout_served
            jobs = [
                Job(task, "rollout", "cpu" if served else "rollout", shard=s,
                    chunks_left=shard_chunks(self.cfg, s, self.tied_group_share), client=served)
                for s in range(self.cfg.rollout.num_shards)
            ]  # fmt: skip
        elif task.step == "update" and self.trainer_served:
            jobs = [Job(task, "update", "cpu", chunks_left=1, client=True)]
        else:
            jobs = [Job(task, task.step, pool_of(task.step), duration=self.steps.fixed(task.step))]
        task.pods_left = len(jobs)
        for job in jobs:
            self.submit(job)

    def task_done(self, task: Task) -> None:
        task.end = self.now
        segment_index, name = task.key
        if name == graph.IMPORT_SFT or (name == graph.PLAN and self.loop_start is None):
            self.loop_start = self.now  # import-sft finishes after plan: it overrides plan's mark
        if task.step == "publish" and task.iteration is not None:
            self.latest = max(self.latest, task.iteration)
        if name == graph.PLAN:
            self.start_servers(segment_index)  # the segment's daemons start after plan (pipelines/workflow)
        if name == graph.IMPORT_SFT:
            self.v0_published()
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
            self.stop_servers(segment_index)  # Argo stops a DAG's daemons once its other tasks are done
            # The DAG is done: the exit handler reports, then (on a cluster) the next segment's Workflow runs.
            report = Task((segment_index, graph.REPORT), graph.REPORT, None, 0)
            self.tasks[report.key] = report
            self.start_task(report)

    # -- pods on pools
    def submit(self, job: Job) -> None:
        if job.server is not None and job.server.stopped:
            return  # a daemon's retry that comes after its segment ended
        self.queues[job.pool].append(job)
        self.dispatch(job.pool)

    def dispatch(self, pool: str) -> None:
        queue = self.queues[pool]
        while queue:
            node = next((n for n in self.nodes[pool] if n.has_room()), None)
            if node is None:
                return
            self.start_job(queue.pop(0), node)

    def start_job(self, job: Job, node: Node) -> None:
        job.node, job.started = node, self.now
        if job.first_start is None:
            job.first_start = self.now
        if job.task.first_start is None:
            job.task.first_start = self.now
        was_occupied = node.occupied()
        node.jobs.append(job)
        if not was_occupied and node.occupied():
            node.busy_since = self.now
        token = job.token
        if job.server is not None:
            self.start_server(job.server)
        elif job.client:
            self.at(self.now + self.steps.client_s, lambda: self.client_started(job, token))
        else:
            self.at(self.now + self.job_seconds(job), lambda: self.finish_job(job, token))

    def job_seconds(self, job: Job) -> float:
        if job.step == "rollout":
            return self.steps.rollout_startup_s + job.chunks_left * self.steps.rollout_chunk_s
        if job.step == "publish" and job.task.iteration is not None:  # it waits for the candidate's optimizer shards
            return max(self.candidate_complete.get(job.task.iteration, 0.0) - self.now, 0.0) + job.duration
        return job.duration

    def leave_node(self, job: Job) -> None:
        node = job.node
        assert node is not None
        node.jobs.remove(job)
        if not node.occupied() and node.busy_since is not None:
            self.usage[node.pool.name].busy_seconds += self.now - node.busy_since
            node.busy_since = None
        job.node = None

    def record(self, job: Job, start: float, end: float, phase: str, iteration: int | None = None) -> None:
        if end <= start or job.node is None:
            return
        pool = job.node.pool.name
        iteration = job.task.iteration if iteration is None else iteration
        self.segments.append(Segment(pool, job.node.index, start, end, job.step, iteration, phase))
        usage = self.usage[pool]
        if phase == "startup":
            usage.startup_seconds += end - start
        elif phase == "lost":
            usage.lost_seconds += end - start
        elif phase == "sync":
            usage.sync_seconds += end - start
        if not job.node.counts_busy(job) and phase != "ready":
            usage.busy_seconds += end - start

    def finish_job(self, job: Job, token: int) -> None:
        if token != job.token:  # this attempt was interrupted; its finish never comes
            return
        if job.step == "rollout" and not job.client:
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
    def schedule_interruption(self, node: Node) -> None:
        self.at(self.now + self.rng.expovariate(self.rate), lambda: self.interrupt(node))

    def interrupt(self, node: Node) -> None:
        self.interruptions += 1
        for job in list(node.jobs):
            if job.server is not None:
                self.lose_server(job.server)
            else:
                self.preempt(job)
        self.usage[node.pool.name].node_seconds += self.now - node.up_since
        node.up = False
        self.segments.append(Segment(node.pool.name, node.index, self.now, self.now + self.node_replacement_s,
                                     "", None, "down"))  # fmt: skip
        self.at(self.now + self.node_replacement_s, lambda: self.replace(node))

    def replace(self, node: Node) -> None:
        node.up, node.up_since = True, self.now
        if self.rate > 0:
            self.schedule_interruption(node)
        self.dispatch(node.pool.name)

    def preempt(self, job: Job) -> None:
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
        self.retry(job, "rollout")

    def retry(self, job: Job, role: str) -> None:
        """The pod's retryStrategy (the config's retries[role]): resubmitted after its backoff."""
        retry = self.cfg.retries[role]
        backoff = retry.backoff.model_dump()
        wait = backoff_seconds(backoff, job.attempt)
        # A server's backoff has no maxDuration (pipelines/workflow/retry.py: it would run from its segment's start).
        timed = retry.backoff.max_duration and job.server is None
        max_duration = parse_duration(retry.backoff.max_duration) if timed else math.inf
        if job.attempt > retry.limit or self.now + wait - (job.first_start or 0.0) > max_duration:
            self.retries_exhausted += 1  # Argo would fail the run here; the model goes on to show the rest
            self.servers_out_of_retries += job.server is not None
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
            server_starts=dict(self.server_starts),
            servers_out_of_retries=self.servers_out_of_retries,
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
