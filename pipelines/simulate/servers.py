"""Engines that stay up, in the event simulation: a segment's rollout servers and trainer server (Argo daemon
tasks) and the per-iteration steps that are their clients.

- A server starts after its segment's plan, on its pool (a rollout server takes a rollout node; the trainer,
  the trainer gang), waits there for v000000 in the first segment (import-sft runs meanwhile), pays the
  start-up of today's per-step engine once (rollout_startup_s; trainer_startup_s), and is stopped when the
  segment's DAG is done.
- A rollout server opens the version the next iteration samples from (behaviour_version(LATEST + 1); with
  versions indexed before publish that often trails the newest usable one). It serves one request at a time (a
  request is a whole chunk at the node's throughput), in arrival order; before a chunk of a version it does not
  hold, it brings its weights there: weight_sync_s a version on (a delta, or the whole checkpoint without
  checkpoint.deltas), with deltas a chain of them while it is cheaper than full_sync_s (the whole checkpoint),
  as the real server chooses; full_sync_s for any other move.
- A chunk's generation is the server's (served_chunk_s) and the client's own work on it is the client's
  (client_chunk_s, on the CPU pool: the verifier's verdicts of its samples, and with an environment its steps):
  after each answer the client does it, and only then counts the chunk and sends its next request, while the
  server serves other clients. With an environment the chunk is one request (its turns' generate calls
  together), its steps after it; a server lost meanwhile loses the chunk, as one lost mid-conversation would.
- The trainer server serves one update at a time: train_s (train, write the weights), answers, then writes the
  optimizer shards (optimizer_write_s) while it waits for and trains the next update, which joins that write
  before it writes its own weights; the segment's last update writes them before it answers. Publish of an
  iteration waits for its optimizer shards.
- A client step (a rollout shard, on the CPU pool; the update, likewise) starts in client_s, then sends its
  requests one after the other to its server: shard K to rollout-server-(K mod servers) when it is ready, else
  to any ready one, else to the first ready within rollout.server_wait_s; the update to the trainer.
- A lost server (its Spot node reclaimed, or a crash) fails the attempts of the clients it was serving
  (their chunk in flight is lost, their finished chunks are kept), which are retried after their backoff and
  find the server ready then; the server itself is retried by its daemon's retryStrategy, waits for a node,
  and pays its start-up again. No wait is unbounded: a client finds no ready server and fails again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipelines.simulate.state import TRAINER_SERVER, Job, Server, Task
from pipelines.workflow.graph import ROLLOUT_SERVER
from steps.run.candidate import optimizer_after_answer
from steps.run.keys import behaviour_version

if TYPE_CHECKING:
    from pipelines.simulate.sizing import StepModel
    from pipelines.simulate.state import Node, PoolUsage
    from steps.run.config import RunConfig


class ServedSteps:
    """The server and client half of Simulation (model.py), which provides the attributes typed here."""

    cfg: RunConfig
    steps: StepModel
    now: float
    staleness: int
    latest: int
    has_v0: bool
    usage: dict[str, PoolUsage]
    queues: dict[str, list[Job]]

    if TYPE_CHECKING:

        def at(self, time: float, callback: Callable[[], None]) -> None: ...
        def submit(self, job: Job) -> None: ...
        def dispatch(self, pool: str) -> None: ...
        def leave_node(self, job: Job) -> None: ...
        def record(self, job: Job, start: float, end: float, phase: str, iteration: int | None = None) -> None: ...
        def retry(self, job: Job, role: str) -> None: ...
        def task_done(self, task: Task) -> None: ...

    def init_servers(self) -> None:
        self.rollout_served = self.cfg.rollout.servers > 0
        self.trainer_served = self.cfg.trainer.server
        self.servers: dict[int, list[Server]] = {}  # per segment: its rollout servers, then the trainer
        self.server_starts = {ROLLOUT_SERVER: 0, TRAINER_SERVER: 0}
        self.candidate_complete: dict[int, float] = {}  # iteration -> when the trainer stored its optimizer shards

    # -- the servers' lives
    def start_servers(self, segment: int) -> None:
        kinds = [(ROLLOUT_SERVER, k) for k in range(self.cfg.rollout.servers) if self.rollout_served]
        kinds += [(TRAINER_SERVER, 0)] if self.trainer_served else []
        servers = []
        for kind, index in kinds:
            pool = "rollout" if kind == ROLLOUT_SERVER else "trainer"
            name = f"{kind}-{index}" if kind == ROLLOUT_SERVER else kind
            job = Job(Task((segment, name), kind, None, 0), kind, pool)
            job.server = Server(kind, index, segment, job)
            servers.append(job.server)
        self.servers[segment] = servers
        for server in servers:
            self.submit(server.job)

    def start_server(self, server: Server) -> None:
        """Its pod is on a node: the engine (or the trainer) starts, a rollout server on the version the next
        iteration samples from (steps/experience/rollout_server.py), the trainer on the newest."""
        if not self.has_v0:
            server.awaiting_v0 = True  # its node held, idle: counted as a ready server's
            return
        self.server_starts[server.kind] += 1
        server.startup_from = self.now
        rollout = server.kind == ROLLOUT_SERVER
        server.version = behaviour_version(self.latest + 1, self.staleness) if rollout else self.latest
        startup = self.steps.rollout_startup_s if server.kind == ROLLOUT_SERVER else self.steps.trainer_startup_s
        token = server.token
        self.at(self.now + startup, lambda: self.server_ready(server, token))

    def v0_published(self) -> None:
        self.has_v0 = True
        for server in [s for servers in self.servers.values() for s in servers if s.awaiting_v0]:
            server.awaiting_v0 = False
            self.record(server.job, server.job.started, self.now, "ready")
            self.start_server(server)

    def server_ready(self, server: Server, token: int) -> None:
        if token != server.token:
            return
        self.record(server.job, server.startup_from, self.now, "startup")
        server.ready, server.idle_since = True, self.now
        waiting, server.waiting = server.waiting, []
        for client in waiting:
            self.connect(client, server)

    def lose_server(self, server: Server) -> None:
        """Its pod ends (a reclaimed node, a crash): the request in flight is lost, its clients' attempts fail,
        and the daemon's retryStrategy starts it again."""
        job = server.job
        if server.current is not None:
            sync_end = min(server.current_start + server.current_sync, self.now)
            iteration = server.current.task.iteration
            self.record(job, server.current_start, sync_end, "sync", iteration)
            self.record(job, sync_end, self.now, "lost", iteration)
        elif server.awaiting_v0:
            self.record(job, job.started, self.now, "ready")
        elif not server.ready:
            self.record(job, server.startup_from, self.now, "startup")
        self.end_idle(server)
        server.ready, server.current, server.queue, server.awaiting_v0 = False, None, [], False
        server.token += 1
        # a trainer's optimizer write in flight is lost with it (its replacement's replay of that update before it
        # serves is not modelled: the publish waiting for it finishes as if the write had gone on)
        server.optimizer_until = 0.0
        clients, server.clients = server.clients, []
        for client in clients:
            self.client_fails(client)
        self.leave_node(job)
        job.token += 1
        self.retry(job, "rollout" if server.kind == ROLLOUT_SERVER else "trainer")

    def crash(self, server: Server) -> None:
        """A server's pod crashes on a node that stays up (the trainer's only failure: it runs on-demand)."""
        if server.job.node is not None and not server.stopped:
            pool = server.job.pool
            self.lose_server(server)
            self.dispatch(pool)

    def stop_servers(self, segment: int) -> None:
        servers = self.servers.pop(segment, [])
        for server in servers:  # all first: a node freed below must not start a server of this segment
            server.stopped = True
            server.token += 1
            queue = self.queues[server.job.pool]
            if server.job in queue:  # waiting for a node (a retry in its backoff is voided by `stopped`)
                queue.remove(server.job)
        for server in servers:
            job = server.job
            if job.node is None:
                continue
            if not server.ready:
                self.record(job, server.startup_from, self.now, "startup")
            self.end_idle(server)
            self.leave_node(job)
            self.dispatch(job.pool)

    def end_idle(self, server: Server) -> None:
        if server.idle_since is not None:
            self.record(server.job, server.idle_since, self.now, "ready")
            server.idle_since = None

    # -- requests
    def serve_next(self, server: Server) -> None:
        if not server.ready or server.current is not None or not server.queue:
            return
        client = server.queue.pop(0)
        self.end_idle(server)
        if server.kind == ROLLOUT_SERVER:
            wanted = behaviour_version(client.task.iteration or 0, self.staleness)
            sync = self.sync_seconds(server.version, wanted)
            server.version = wanted
            work = self.steps.served_chunk_s  # the environment's steps are the client's (request_done)
        else:
            sync, work = 0.0, self.update_seconds(server, client.task.iteration or 0)
        server.current, server.current_start, server.current_sync = client, self.now, sync
        token = server.token
        self.at(self.now + sync + work, lambda: self.request_done(server, client, token))

    def update_seconds(self, server: Server, iteration: int) -> float:
        """The trainer's update `iteration` until it answers: train, join the previous update's optimizer write
        (if it is still going), write the weights; the optimizer shards after the answer, except for the segment's
        last update (steps/training/optimizer_write.py). Records when candidate `iteration` is complete (publish
        waits for it)."""
        steps = self.steps
        trained = self.now + steps.train_s - steps.weights_write_s
        answered = max(trained, server.optimizer_until) + steps.weights_write_s
        later = optimizer_after_answer(self.cfg, iteration)  # what the update's client asks (steps/update.py)
        if not later:
            answered += steps.optimizer_write_s
        server.optimizer_until = answered + (steps.optimizer_write_s if later else 0.0)
        self.candidate_complete[iteration] = server.optimizer_until
        return answered - self.now

    def sync_seconds(self, held: int | None, wanted: int) -> float:
        """A rollout server's move from the version it holds to the one a request names."""
        if held == wanted:
            return 0.0
        if held is not None and wanted > held and self.cfg.checkpoint.deltas:
            # versions on: the chain of their deltas while it is cheaper (steps/engines/weight_sync.py)
            return min((wanted - held) * self.steps.weight_sync_s, self.steps.full_sync_s)
        if held is not None and wanted == held + 1:
            return self.steps.weight_sync_s  # one version on, without deltas: the whole checkpoint
        return self.steps.full_sync_s

    def request_done(self, server: Server, client: Job, token: int) -> None:
        if token != server.token:
            return
        sync_end = server.current_start + server.current_sync
        self.record(server.job, server.current_start, sync_end, "sync", client.task.iteration)
        self.record(server.job, sync_end, self.now, "work", client.task.iteration)
        server.current = None
        stepping = self.steps.client_chunk_s if server.kind == ROLLOUT_SERVER else 0.0
        if stepping > 0:  # the client steps its chunk's conversations, the server goes on without it
            client_token = client.token
            self.at(self.now + stepping, lambda: self.environment_done(server, client, client_token))
        else:
            self.chunk_done(server, client)
        if not server.queue:
            server.idle_since = self.now
        self.serve_next(server)

    def chunk_done(self, server: Server, client: Job) -> None:
        client.chunks_left -= 1
        if client.chunks_left > 0:
            server.queue.append(client)  # the client sends its next request on the answer
        else:
            server.clients.remove(client)
            self.client_done(client)

    def environment_done(self, server: Server, client: Job, token: int) -> None:
        """A client's environment steps of its chunk are done: the chunk is, and its next request goes out."""
        if token != client.token or client.connected is not server:
            return  # the client's attempt failed meanwhile (its server was lost)
        self.chunk_done(server, client)
        self.serve_next(server)

    # -- clients
    def client_started(self, job: Job, token: int) -> None:
        if token != job.token:
            return
        if job.chunks_left == 0:
            self.client_done(job)
            return
        server = self.server_of(job)
        if server.ready:
            self.connect(job, server)
            return
        ready = [s for s in self.servers.get(job.task.key[0], []) if s.kind == server.kind and s.ready]
        if ready and job.step != "update":  # steps/rollout.py: its own server is down, any ready one at once
            self.connect(job, ready[0])
            return
        server.waiting.append(job)
        self.at(self.now + self.cfg.rollout.server_wait_s, lambda: self.wait_over(job, server, token))

    def server_of(self, job: Job) -> Server:
        """Shard K's rollout-server-(K mod servers); the update's trainer."""
        servers = self.servers[job.task.key[0]]
        if job.step == "update":
            return next(s for s in servers if s.kind == TRAINER_SERVER)
        return servers[job.shard % self.cfg.rollout.servers]

    def wait_over(self, job: Job, server: Server, token: int) -> None:
        """Its server is not up within rollout.server_wait_s: any ready server of the kind, or a failed attempt."""
        if token != job.token or job not in server.waiting:
            return
        server.waiting.remove(job)
        ready = [s for s in self.servers.get(job.task.key[0], []) if s.kind == server.kind and s.ready]
        if ready:
            self.connect(job, ready[0])
        else:
            self.client_fails(job)

    def connect(self, job: Job, server: Server) -> None:
        job.connected = server
        server.clients.append(job)
        server.queue.append(job)
        self.serve_next(server)

    def client_done(self, job: Job) -> None:
        self.record(job, job.started, self.now, "work")
        job.connected = None
        self.leave_node(job)
        job.task.pods_left -= 1
        if job.task.pods_left == 0:
            self.task_done(job.task)
        self.dispatch(job.pool)

    def client_fails(self, job: Job) -> None:
        """The client's attempt exits (its server was lost, or none is ready): retried after its backoff, with
        its finished chunks kept."""
        self.record(job, job.started, self.now, "work")
        job.connected = None
        self.leave_node(job)
        job.token += 1
        self.retry(job, "rollout" if job.step == "rollout" else "trainer")
        self.dispatch(job.pool)

    def server_nodes(self) -> list[Node]:
        """The nodes that hold a server now (for tests and the timeline)."""
        return [s.job.node for servers in self.servers.values() for s in servers if s.job.node is not None]
