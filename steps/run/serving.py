"""The long-lived servers of a run (rollout servers, the trainer): how they register, answer and are found.

A server is an Argo daemon task of one Workflow (a segment). It listens on an ephemeral port, then writes its
registration, `<run>/servers/<workflow>/<name>.json` (steps/run/keys.py `server_key`): its address and an
instance id that changes with every start. A client reads the registrations of its Workflow and keeps those
whose `/health` answers with the same run and instance, so a stale entry (a killed server, an address that
another pod took over) is never used. Discovery goes through the store, not `{{tasks.X.ip}}`, because a
replacement started by a retry has a new address that a task already running could not learn from Argo.

The face is JSON over HTTP: `GET /health` answers at once, while `POST /<operation>` calls run one at a time
(a server holds one engine or one trainer). An operation that raises MoerlError answers 400 with its message,
which the client raises again as a MoerlError: a bad request fails the same on every server. Anything else
that ends a call without an answer (the server was killed, reclaimed, restarted) is ServerLost: the client
step exits with EXIT_SERVER_LOST and the workflow's retryStrategy sends its unfinished work to another server
or to the replacement.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from steps.errors import MoerlError
from steps.run.keys import server_key, servers_prefix
from steps.store.object_store import Store

# A client whose server went away: the attempt is retried (pipelines/workflow/retry.py), as a reclaim is.
EXIT_SERVER_LOST = 75  # EX_TEMPFAIL
HEALTH_TIMEOUT_S = 5.0
POLL_S = 0.25  # how often a waiting client looks for its server again (a health check is one small request)
# A request is answered when its work is done; a server that is killed resets the connection at once, so this
# only bounds a peer that vanished without a word (a node lost without notice).
REQUEST_TIMEOUT_S = 3600.0


class ServerLost(Exception):
    """The server stopped answering before it finished the request."""


class Unavailable(Exception):
    """Raised by an operation that the server cannot finish now (it is stopping, or opening a new engine):
    answered 503, which the client takes for a lost server (its step exits EXIT_SERVER_LOST and is retried)."""


@dataclass(frozen=True)
class Registration:
    name: str  # the server's name in its Workflow: rollout-server-0, trainer
    address: str  # host:port
    instance: str  # new at every start
    run: str  # the run store's URL
    workflow: str
    pid: int
    started: float  # time.time() at registration

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        host, port = self.address.rsplit(":", 1)
        return http.client.HTTPConnection(host, int(port), timeout=timeout)


def pod_ip() -> str:
    """This pod's address: POD_IP from the downward API (the templates set it), else the loopback."""
    return os.environ.get("POD_IP") or "127.0.0.1"


# ------------------------------------------------------------------------------------------ the server


Operation = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class _Call:
    operation: Operation
    body: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    status: int = 503
    answer: dict[str, Any] = field(default_factory=lambda: {"error": "the server stopped before this call ran"})


class JsonServer:
    """An HTTP server of named operations, run one at a time; `health()` answers between them.

    With `main_thread`, the operations run on the thread that calls `run_operations` (the main one), not on
    the connections' threads: an engine may need it (SGLang's asyncio loop), and a SIGTERM handler, which
    Python runs on the main thread, then interrupts the operation itself. `unavailable()`, when given, says
    why the server cannot take an operation now (None: it can): such a call is answered 503 at once, not
    queued behind the work that makes it unavailable (a rollout server opening a new engine)."""

    def __init__(
        self,
        operations: dict[str, Operation],
        health: Callable[[], dict[str, Any]],
        port: int = 0,
        main_thread: bool = False,
        unavailable: Callable[[], str | None] | None = None,
    ):
        self.operations = operations
        self.health = health
        self.unavailable = unavailable
        self._lock = threading.Lock()  # one engine: one operation at a time
        self._calls: queue.Queue[_Call] | None = queue.Queue() if main_thread else None
        self.httpd = ThreadingHTTPServer(("0.0.0.0", port), self._handler())
        self.httpd.daemon_threads = True

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def _execute(self, operation: Operation, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            try:
                return 200, operation(body)
            except MoerlError as err:
                return 400, {"error": str(err)}
            except Unavailable as err:
                return 503, {"error": str(err)}
            except Exception as err:  # noqa: BLE001 - the client must hear of it; the server serves on
                return 500, {"error": f"{type(err).__name__}: {err}"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass  # the operations log what they do; a line per health check would drown it

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/health":
                    self._answer(404, {"error": f"no such path {self.path}"})
                    return
                self._answer(200, server.health())

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                operation = server.operations.get(self.path.lstrip("/"))
                if operation is None:
                    self._answer(404, {"error": f"no such operation {self.path}"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except ValueError as err:
                    self._answer(400, {"error": f"request body is not JSON: {err}"})
                    return
                reason = server.unavailable() if server.unavailable is not None else None
                if reason is not None:
                    self._answer(503, {"error": reason})
                    return
                if server._calls is None:
                    self._answer(*server._execute(operation, body))
                    return
                call = _Call(operation, body)
                server._calls.put(call)
                call.done.wait()
                self._answer(call.status, call.answer)

        return Handler

    def serve_in_background(self) -> threading.Thread:
        thread = threading.Thread(target=self.httpd.serve_forever, name="json-server", daemon=True)
        thread.start()
        return thread

    def run_operations(
        self, stop: threading.Event, idle: Callable[[], None] | None = None, idle_every_s: float = 60.0
    ) -> None:
        """Run the calls that arrive on this thread until `stop` is set (main_thread servers); `idle` runs on
        it too, after every `idle_every_s` without a call (a trainer's heartbeat to its other ranks)."""
        assert self._calls is not None, "JsonServer(main_thread=True) runs its operations here"
        quiet_since = time.monotonic()
        while not stop.is_set():
            try:
                call = self._calls.get(timeout=0.2)  # returns as soon as a call arrives; the timeout sees stop
            except queue.Empty:
                if idle is not None and time.monotonic() - quiet_since >= idle_every_s:
                    idle()
                    quiet_since = time.monotonic()
                continue
            call.status, call.answer = self._execute(call.operation, call.body)
            call.done.set()
            quiet_since = time.monotonic()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        while self._calls is not None and not self._calls.empty():  # came too late: answered 503
            self._calls.get_nowait().done.set()


# ------------------------------------------------------------------------------------------ registry


def register(run: Store, workflow: str, name: str, port: int) -> Registration:
    """Write this server's registration (after it listens: a client may call it as soon as it reads this)."""
    entry = Registration(
        name=name,
        address=f"{pod_ip()}:{port}",
        instance=uuid.uuid4().hex,
        run=run.uri,
        workflow=workflow,
        pid=os.getpid(),
        started=time.time(),
    )
    run.put_json(server_key(workflow, name), asdict(entry))
    return entry


def unregister(run: Store, entry: Registration) -> None:
    """Remove the registration if it is still this instance's (a replacement may have written its own)."""
    key = server_key(entry.workflow, entry.name)
    try:
        if run.get_json(key).get("instance") == entry.instance:
            run.delete(key)
    except (MoerlError, OSError, ValueError):
        pass  # a stale registration is harmless: health checks leave it out


def registrations(run: Store, workflow: str, kind: str = "") -> list[Registration]:
    """The registrations of one Workflow's servers whose names start with `kind`, by name."""
    found = []
    for key in sorted(run.list(servers_prefix(workflow) + "/")):
        name = key.rsplit("/", 1)[-1].removesuffix(".json")
        if not name.startswith(kind):
            continue
        try:
            found.append(Registration(**run.get_json(key)))
        except (MoerlError, OSError, ValueError, TypeError):
            continue  # being rewritten or removed right now: the next look sees it
    return found


def health(entry: Registration, timeout: float = HEALTH_TIMEOUT_S) -> dict[str, Any] | None:
    """The server's /health if it answers as this registration's instance of this run, else None."""
    try:
        conn = entry.connection(timeout)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            body = json.loads(response.read())
        finally:
            conn.close()
    except (OSError, ValueError, http.client.HTTPException):
        return None
    if response.status != 200 or body.get("instance") != entry.instance or body.get("run") != entry.run:
        return None
    return body


def live_servers(run: Store, workflow: str, kind: str, ready: bool = True, exact: bool = False) -> list[Registration]:
    """The registered servers of `kind` (a name prefix; `exact`: the name) that answer as themselves (and,
    with `ready`, say they are ready)."""
    out = []
    for entry in registrations(run, workflow, kind):
        if exact and entry.name != kind:
            continue
        state = health(entry)
        if state is not None and (state.get("ready") or not ready):
            out.append(entry)
    return out


def wait_for_servers(
    run: Store, workflow: str, kind: str, wait_s: float, log: Callable[[str], None] = print, exact: bool = False
) -> list[Registration]:
    """Live, ready servers of `kind` (as live_servers), waiting up to wait_s for a first one; [] when none came."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        found = live_servers(run, workflow, kind, exact=exact)
        if found or time.monotonic() >= deadline:
            return found
        if not said:
            log(f"waiting up to {wait_s:.0f}s for a ready {kind} server of workflow {workflow}")
            said = True
        time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))


def call(entry: Registration, operation: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict:
    """POST one operation and return its answer; MoerlError for a refused request, ServerLost otherwise."""
    data = json.dumps(body).encode()
    try:
        conn = entry.connection(timeout)
        try:
            conn.request("POST", f"/{operation}", body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = json.loads(response.read())
        finally:
            conn.close()
    except (OSError, ValueError, http.client.HTTPException) as err:  # a timeout is an OSError
        raise ServerLost(f"server {entry.name} at {entry.address}: {type(err).__name__}: {err}") from err
    if response.status == 400:
        raise MoerlError(f"server {entry.name} refused {operation}: {answer.get('error')}")
    if response.status != 200:
        raise ServerLost(f"server {entry.name} at {entry.address} failed {operation}: {answer.get('error')}")
    return answer
