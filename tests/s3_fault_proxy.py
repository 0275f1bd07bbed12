"""A fault-injecting HTTP proxy on 127.0.0.1 in front of an S3 endpoint (the moto server of the tests).

    proxy = S3FaultProxy(s3_server.endpoint_url).start()       # AWS_ENDPOINT_URL=proxy.url
    proxy.add(Fault("slowdown", r"^PUT /bucket/run/checkpoints/.*/model\\.safetensors$", times=4))
    ...
    assert proxy.fired() == {...}
    proxy.stop()

Every request is matched against the faults in the order they were added, as the line
"METHOD /path?query" (path as sent, '%'-decoded). A fault lets its first `after` matching requests through
and then hits the next `times` ones (times=None: every one after that), so what is injected depends only on
the sequence of requests, never on timing. The first fault that is due is applied; the others still count
the match.

Actions:
  slowdown        answer 503 SlowDown (S3's throttling) without forwarding the request
  internal_error  answer 500 InternalError without forwarding the request
  reset           forward the request (S3 applies it), then send the first half of the response and reset
                  the connection (RST): the client sees a connection reset mid-response
  torn_upload     read half of the request body, then reset the connection: the upload is cut in flight
                  and nothing reaches S3
  truncate_upload forward only the first half of the request body as if it were the whole body: what an
                  S3-compatible service that ignored the framing would store (S3 itself answers such a
                  request with an error)

Each request is recorded (method, path, query, status, the action applied, sha256 of the body), so a test
can tell what reached S3 and how often.
"""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import struct
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

ACTIONS = ("slowdown", "internal_error", "reset", "torn_upload", "truncate_upload")
# Headers that describe one hop of a connection, not the request: never forwarded.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
              "expect"}  # fmt: skip


@dataclass
class Fault:
    action: str
    match: str  # regex searched in "METHOD /path?query"
    after: int = 0  # matching requests let through before the first hit
    times: int | None = 1  # hits, then the fault is spent (None: never spent)
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {ACTIONS}")
        self.pattern = re.compile(self.match)

    def due(self, line: str) -> bool:
        """Count a matching request; whether this one is to be hit."""
        if not self.pattern.search(line):
            return False
        self.seen += 1
        return self.seen > self.after and (self.times is None or self.fired < self.times)


@dataclass
class Request:
    method: str
    path: str
    query: str
    action: str | None
    status: int | None  # what S3 answered (None: S3 never saw it, or the proxy answered itself)
    body_sha256: str
    body_size: int

    @property
    def line(self) -> str:
        return f"{self.method} {self.path}" + (f"?{self.query}" if self.query else "")


def s3_error(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        "<RequestId>moerl-fault-proxy</RequestId></Error>"
    ).encode()


PROXY_ANSWERS = {
    "slowdown": (503, "Slow Down", s3_error("SlowDown", "Please reduce your request rate.")),
    "internal_error": (500, "Internal Server Error", s3_error("InternalError", "We encountered an internal error.")),
}


class S3FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
        self.faults: list[Fault] = []
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.url = ""

    # -- control -------------------------------------------------------------------------------------

    def start(self) -> S3FaultProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def clear(self) -> None:
        """Forget the faults and the recorded requests."""
        with self._lock:
            self.faults.clear()
            self.requests.clear()

    def fired(self) -> list[tuple[str, str, int]]:
        """(action, match, hits) of every fault."""
        with self._lock:
            return [(f.action, f.match, f.fired) for f in self.faults]

    def hit(self) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.action is not None]

    # -- per request -----------------------------------------------------------------------------------

    def _choose(self, line: str) -> str | None:
        with self._lock:
            chosen = None
            for fault in self.faults:
                if fault.due(line) and chosen is None:
                    fault.fired += 1
                    chosen = fault.action
            return chosen

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)


class _Handler(BaseHTTPRequestHandler):
    owner: S3FaultProxy
    protocol_version = "HTTP/1.1"  # keep-alive, and `Expect: 100-continue` answered as S3 does

    def log_message(self, format: str, *args: object) -> None:
        pass  # no access log in test output

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _proxy(self) -> None:
        path, _, query = self.path.partition("?")
        line = f"{self.command} {unquote(path)}" + (f"?{query}" if query else "")
        action = self.owner._choose(line)
        if action == "torn_upload":
            self._cut_upload(path, query)
            return
        body = self._read_body()
        record = Request(self.command, unquote(path), query, action, None, hashlib.sha256(body).hexdigest(), len(body))
        if action in PROXY_ANSWERS:
            status, reason, payload = PROXY_ANSWERS[action]
            self.owner._record(record)
            self._answer(status, reason, [("Content-Type", "application/xml")], payload)
            return
        if action == "truncate_upload":
            body = body[: len(body) // 2]
        status, reason, headers, payload = self._forward(body)
        record.status = status
        self.owner._record(record)
        if action == "reset":
            self._answer_then_reset(status, reason, headers, payload)
        else:
            self._answer(status, reason, headers, payload)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        upstream = http.client.HTTPConnection(self.owner.upstream_host, self.owner.upstream_port, timeout=60)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():  # Host as the client sent it: it is signed
                if name.lower() not in HOP_BY_HOP and name.lower() != "content-length":
                    upstream.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body or None)
            response = upstream.getresponse()
            payload = response.read()
            headers = [(k, v) for k, v in response.getheaders() if k.lower() not in HOP_BY_HOP]
            return response.status, response.reason, headers, payload
        finally:
            upstream.close()

    def _head(self, status: int, reason: str, headers: list[tuple[str, str]], length: int) -> bytes:
        lines = [f"HTTP/1.1 {status} {reason}"]
        for name, value in headers:
            if name.lower() != "content-length" or self.command == "HEAD":
                lines.append(f"{name}: {value}")
        if self.command != "HEAD":
            lines.append(f"Content-Length: {length}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _answer(self, status: int, reason: str, headers: list[tuple[str, str]], payload: bytes) -> None:
        if self.command == "HEAD":
            headers = [h for h in headers if h[0].lower() != "content-length"] + [("Content-Length", "0")] \
                if status >= 300 else headers  # fmt: skip
            payload = b""
        self.wfile.write(self._head(status, reason, headers, len(payload)) + payload)
        self.wfile.flush()

    def _answer_then_reset(self, status: int, reason: str, headers: list[tuple[str, str]], payload: bytes) -> None:
        head = self._head(status, reason, headers, len(payload))
        data = head + payload[: len(payload) // 2] if payload and self.command != "HEAD" else head[: len(head) // 2]
        self.wfile.write(data)
        self.wfile.flush()
        self._reset()

    def _cut_upload(self, path: str, query: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        part = self.rfile.read(length // 2) if length else b""
        sha = hashlib.sha256(part).hexdigest()
        self.owner._record(Request(self.command, unquote(path), query, "torn_upload", None, sha, len(part)))
        self._reset()

    def _reset(self) -> None:
        """Close with SO_LINGER 0: the peer gets a TCP RST, as from a dropped connection."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass
