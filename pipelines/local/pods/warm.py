"""Warm starts: a pod whose command is `python -m MODULE ...` (or a single-node `torchrun ... -m MODULE ...`)
starts as a fork of a Python that has already imported torch and the modules its caller names (run_workflow's
`preload`: moerl passes its step modules), instead of a new interpreter that imports them again (2-3 s of
CPU a process on a laptop core; most of a demo step's life).

`WarmStarter.start` returns a `WarmProcess` (the part of subprocess.Popen that `pods.Pod` uses: pid,
poll, wait, returncode) or None, and then the pod starts cold, as before: for any other command, while the
warm server is still importing (the first pods of a run), or when warm starts are off (`moerl local
--cold-start`, MOERL_LOCAL_WARM=0). What a warm child is given so that it behaves as a fresh process is
listed in warm_server.py; the one server per distinct environment (less the variables that differ from pod
to pod and that no preloaded module reads at import: PER_POD_ENV) keeps imports seeing the environment
their pods would have given them.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Imported once per run by the server: the libraries every model step needs, and then the modules the caller
# names (run_workflow's preload: its step modules; importing one only defines it, its main runs in the child).
# Imported on first use by the steps, measured: pyarrow.pandas_compat (pa.table of Python rows; pandas where
# installed). Not torch._dynamo: the update's optimizer (steps.training.optim) never imports it, and preloading it would
# delay every run's first warm start by 1.5-2 s of CPU.
LIBRARIES = ("torch", "pandas", "pyarrow", "pyarrow.parquet", "pyarrow.pandas_compat")
# Set per pod (or per rank) and read by no preloaded module when it is imported (tests/test_local_warm_start.py
# checks the import of the demo's preload for HOME and the sandbox); the thread counts are applied in the child.
PER_POD_ENV = frozenset({"MOERL_LOCAL_SANDBOX", "HOME", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "ARGO_PROGRESS_FILE"})
MAX_SERVERS = 2
SERVER_SCRIPT = Path(__file__).with_name("warm_server.py")
MODULE_RE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")
# The torchrun options a warm start reproduces; any other (rendezvous, restarts, --no-python, ...) runs cold.
TORCHRUN_FLAGS = {"--standalone"}
TORCHRUN_VALUES = {"--nnodes", "--nproc-per-node", "--nproc_per_node"}


@dataclass
class PythonProgram:
    module: str
    args: list[str]
    ranks: int | None  # torchrun's workers on this node; None: one plain process


def python_program(argv: list[str]) -> PythonProgram | None:
    """The module program that argv (already mapped to this host) runs, if a warm start can run it."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        if argv[2] in ("torch.distributed.run", "torch.distributed.launch"):
            return _torchrun_program(argv[3:])
        return PythonProgram(argv[2], argv[3:], None) if MODULE_RE.fullmatch(argv[2]) else None
    if argv and argv[0] == str(Path(sys.executable).parent / "torchrun"):
        return _torchrun_program(argv[1:])
    return None


def _torchrun_program(rest: list[str]) -> PythonProgram | None:
    ranks, nodes = 1, "1"
    i = 0
    while i < len(rest):
        option, has_value, value = rest[i].partition("=")
        if option in ("-m", "--module"):
            module = rest[i + 1] if i + 1 < len(rest) else ""
            args = rest[i + 2 :]
            args = args[1:] if args[:1] == ["--"] else args  # torchrun drops the "--" that ends its options
            if not MODULE_RE.fullmatch(module) or nodes not in ("1", "1:1"):
                return None
            return PythonProgram(module, args, ranks)
        if option in TORCHRUN_FLAGS and not has_value:
            i += 1
            continue
        if option not in TORCHRUN_VALUES:
            return None
        if not has_value:
            if i + 1 >= len(rest):
                return None
            value = rest[i + 1]
        if option == "--nnodes":
            nodes = value
        elif not value.isdigit() or int(value) < 1:
            return None  # "auto", "cpu", "gpu": torchrun's own reading of the machine
        else:
            ranks = int(value)
        i += 1 if has_value else 2
    return None  # a script path, not a module


class WarmProcess:
    """A pod's process forked by a warm server: what pods.Pod uses of a Popen."""

    def __init__(self, pid: int, status_path: Path, server: subprocess.Popen):
        self.pid = pid
        self.args = [f"warm child {pid}"]
        self.returncode: int | None = None
        self._status_path = status_path
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._status_path.is_file():
                self.returncode = int(self._status_path.read_text())
            elif self._server.poll() is not None and not _alive(self.pid):
                self.returncode = -signal.SIGKILL  # its server died and cannot tell how it ended
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WarmServer:
    def __init__(self, env: dict[str, str], preload: tuple[str, ...], log: Path):
        self.log = log
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(SERVER_SCRIPT), *preload],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                start_new_session=True,  # Ctrl-C in the terminal is the executor's to handle, not the server's
            )
        self.ready = False
        self.broken = False

    def poll_ready(self, wait: bool = False) -> bool:
        """Whether the server has finished its imports; blocks on a server still importing only if asked to."""
        if self.ready or self.broken:
            return self.ready
        stdout = self.process.stdout
        assert stdout is not None
        if wait or select.select([stdout], [], [], 0)[0]:
            message = self._read()
            self.ready = bool(message and message.get("ready"))
            self.broken = not self.ready
        return self.ready

    def launch(self, request: dict) -> int | None:
        stdin = self.process.stdin
        assert stdin is not None
        try:
            stdin.write((json.dumps(request) + "\n").encode())
            stdin.flush()
        except (BrokenPipeError, OSError):
            self.broken = True
            return None
        message = self._read()
        if not message or "pid" not in message:
            self.broken = message is None
            return None
        return int(message["pid"])

    def _read(self) -> dict | None:
        stdout = self.process.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            self.broken = True
            return None
        return json.loads(line)

    def close(self) -> None:
        if not self.ready:  # still importing (it has forked nothing): no reason to wait for it
            self.process.kill()
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class WarmStarter:
    """The warm servers of one run, one per distinct environment, started on the first pod that needs one."""

    def __init__(self, preload: tuple[str, ...] = LIBRARIES, wait_for_server: bool = False):
        """wait_for_server: a pod waits for its server's imports instead of starting cold meanwhile."""
        self.preload = preload
        self.wait_for_server = wait_for_server
        self.servers: dict[tuple, WarmServer] = {}
        self.dir: Path | None = None  # the servers' logs and the children's status files, made on first use
        self._launches = 0

    def importing(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether argv would start warm from a server that exists and is still importing."""
        if python_program(argv) is None:
            return False
        server = self.servers.get(self._key(env))
        return server is not None and not server.poll_ready()

    @staticmethod
    def _key(env: dict[str, str]) -> tuple:
        return tuple(sorted((name, value) for name, value in env.items() if name not in PER_POD_ENV))

    def prestart(self, argv: list[str], env: dict[str, str]) -> bool:
        """Start the server that argv's pods in env will use, before the first of them (the executor calls
        this for the workflow's templates as it starts, so that the imports overlap the pods that come
        first). Returns whether argv can start warm at all."""
        return python_program(argv) is not None and self._server(self._key(env)) is not None

    def _server(self, key: tuple) -> WarmServer | None:
        """The server of an environment, started on first need; at most MAX_SERVERS a run."""
        server = self.servers.get(key)
        if server is None and len(self.servers) < MAX_SERVERS:
            if self.dir is None:
                self.dir = Path(tempfile.mkdtemp(prefix="moerl-warm-"))
            server_env = {**dict(key), **{k: v for k, v in os.environ.items() if k in PER_POD_ENV}}
            log = self.dir / f"server-{len(self.servers)}.log"
            server = self.servers[key] = WarmServer(server_env, self.preload, log)
        return server

    def start(self, argv: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path) -> WarmProcess | None:
        """Start argv warm, or return None for the caller to start it cold."""
        program = python_program(argv)
        if program is None:
            return None
        # A pod that starts its environment's server starts cold meanwhile (the pods that come while it
        # imports wait for it: pods.Pod, `importing`).
        server = self._server(self._key(env))
        if server is None or not server.poll_ready(wait=self.wait_for_server):
            return None
        self._launches += 1
        status = self.dir / f"{self._launches}.status"
        pid = server.launch(
            {
                "module": program.module,
                "args": program.args,
                "env": env,
                "cwd": str(cwd),
                "stdout": str(stdout),
                "stderr": str(stderr),
                "status": str(status),
                "ranks": program.ranks,
            }
        )
        return None if pid is None else WarmProcess(pid, status, server.process)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def warm_starts_enabled() -> bool:
    """On unless MOERL_LOCAL_WARM=0; Linux only (the server watches its children through pidfds, and forking
    a process that has loaded torch is not safe on macOS)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return False
    return os.environ.get("MOERL_LOCAL_WARM", "1").strip().lower() not in ("0", "false", "no", "off")
