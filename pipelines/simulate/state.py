"""What the event simulation tracks: nodes, pods (jobs) and their tasks, long-lived servers, and the intervals
it records for the pool shares and the timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.simulate.sizing import Pool
from pipelines.workflow.graph import ROLLOUT_SERVER

TRAINER_SERVER = "trainer-server"


@dataclass
class Segment:
    """One interval of a pod on a node, for the pool shares and the timeline."""

    pool: str
    node: int
    start: float
    end: float
    step: str
    iteration: int | None
    # "startup", "work", "lost" (generation an interruption threw away), "down" (node gone); a server's
    # "sync" (bringing its weights to the version asked for) and "ready" (up, nothing to do).
    phase: str


@dataclass
class PoolUsage:
    slots_per_node: int | None  # 1: a pod takes a whole node, so the shares below are shares of GPU time
    node_seconds: float = 0.0  # nodes up x time, over the run
    # Node time with at least one pod on the node; a server on a node of its own counts only while it starts,
    # updates its weights or works (a ready server waiting for requests holds idle GPUs).
    busy_seconds: float = 0.0
    startup_seconds: float = 0.0
    lost_seconds: float = 0.0
    sync_seconds: float = 0.0  # servers bringing their weights to a new version

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

    @property
    def sync_share(self) -> float | None:
        """Share of node time spent updating servers' weights; None where pods share a node."""
        if self.slots_per_node != 1 or not self.node_seconds:
            return None
        return self.sync_seconds / self.node_seconds


@dataclass
class Node:
    pool: Pool
    index: int
    up: bool = True
    up_since: float = 0.0
    jobs: list[Job] = field(default_factory=list)
    busy_since: float | None = None

    def has_room(self) -> bool:
        slots = self.pool.slots_per_node
        return self.up and (slots is None or len(self.jobs) < slots)

    def counts_busy(self, job: Job) -> bool:
        """Whether the job's presence makes the node busy: a server on a node of its own counts by its phases."""
        return job.server is None or self.pool.slots_per_node is None

    def occupied(self) -> bool:
        return any(self.counts_busy(job) for job in self.jobs)


@dataclass
class Job:
    """One pod of a task (a rollout shard, or the single pod of any other step) and its retries; or a server's
    pod (`server` set), or a client step's pod (`client`: its work is its requests to a server)."""

    task: Task
    step: str
    pool: str
    shard: int = 0
    chunks_left: int = 0  # a rollout shard's (or client's) chunks; an update client's one request
    duration: float = 0.0  # a fixed step's seconds
    attempt: int = 1
    first_start: float | None = None
    node: Node | None = None
    started: float = 0.0
    token: int = 0  # bumped when an attempt is interrupted: its pending events are void
    client: bool = False
    server: Server | None = None  # the server this pod runs
    connected: Server | None = None  # a client's server once it has sent it a request


@dataclass
class Task:
    key: tuple[int, str]  # (segment index, task name)
    step: str
    iteration: int | None
    waiting_for: int  # unfinished dependencies
    dependents: list[tuple[int, str]] = field(default_factory=list)
    pods_left: int = 0
    first_start: float | None = None
    end: float | None = None


@dataclass
class Server:
    """A long-lived server of one segment (a daemon task): rollout-server-K or the trainer. A replacement (its
    daemon's retry) is the same server under the same name, so the clients that wait for it find it."""

    kind: str  # ROLLOUT_SERVER or TRAINER_SERVER
    index: int
    segment: int
    job: Job  # its pod: placement, node, retries
    ready: bool = False
    stopped: bool = False  # the segment is done: Argo stops its daemons
    version: int | None = None  # the policy version its engine holds (rollout servers)
    queue: list[Job] = field(default_factory=list)  # clients whose next request waits
    current: Job | None = None  # the client whose request it is serving
    current_start: float = 0.0
    current_sync: float = 0.0  # seconds of the current request spent bringing the weights
    idle_since: float | None = None  # ready, with nothing to do
    awaiting_v0: bool = False  # on its node, waiting for import-sft's v000000 before its engine starts
    startup_from: float = 0.0  # when its engine (or trainer) began to start
    waiting: list[Job] = field(default_factory=list)  # clients waiting for it to be ready
    clients: list[Job] = field(default_factory=list)  # clients with a request sent or queued
    token: int = 0  # bumped when the server is lost: its pending events are void
    optimizer_until: float = 0.0  # the trainer: when the optimizer shards of its last update are stored

    @property
    def name(self) -> str:
        return f"{ROLLOUT_SERVER}-{self.index}" if self.kind == ROLLOUT_SERVER else TRAINER_SERVER
