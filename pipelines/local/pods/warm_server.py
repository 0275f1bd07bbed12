"""A warm Python for the local executor: it imports the heavy libraries once, then forks one child per pod.

Every moerl step is `python -m steps.X`, and on this machine most of such a pod's life is spent importing
torch, pyarrow and the model code (2-3 s of CPU each, 5-7 pods an iteration). This process imports them
once (argv: the modules to preload), then serves launches: for each request it forks a child that becomes
the pod's process, as a fresh `python -m MODULE ARGS` would be, with nothing of this server left in it:

- its own session and process group (the executor kills a pod with killpg, torchrun's workers included);
- stdin /dev/null, stdout and stderr appended to the pod's log files, sys.std* rebuilt over them with the
  buffering a fresh interpreter would choose (PYTHONUNBUFFERED included);
- the pod's working directory, exactly the pod's environment, sys.path[0] = the working directory (what
  `-m` sets), torch's intra-op threads from OMP_NUM_THREADS, fresh seeds for `random` and numpy's global
  generator (a forked child would otherwise repeat its siblings' draws);
- the module run by runpy as __main__, after the preloaded copy of that module itself is dropped, so its
  top-level code runs once, in __main__, as with -m;
- the end of an interpreter, up to the part that costs (steps.errors.end_process, as every moerl step ends):
  the exit code of SystemExit (a message printed, exit 1), the traceback and exit 1 of an uncaught exception
  (death by SIGINT for KeyboardInterrupt), the wait for non-daemon threads, atexit callbacks and the flush
  of stdout/stderr (120 if that fails); then os._exit. A forked child skips the interpreter's teardown,
  which frees every object the server preloaded and so touches, and copies, the copy-on-write pages they
  live on: 0.4-0.9 s of each pod's exit on this machine, about a fifth of a demo iteration (bench/README.md).

A request with "ranks": N runs the module as torchrun's N workers on one node would (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, OMP_NUM_THREADS=1 unless set, ...): the child becomes a small launcher that
forks the N workers in its own process group, waits for them and, when one fails, stops the others as
torchrun does (SIGTERM, then SIGKILL after a grace period) and exits 1; rank 0 hosts the TCP store.

The server runs by path (`python warm_server.py MODULE...`) and imports only the standard library,
steps.errors (standard library only: how a process ends) and the preloaded modules, so children carry
nothing of the executor. It must never run a torch op itself: an OpenMP pool started before fork does not
survive into the children.

Protocol, one JSON object a line. The server writes {"ready": true, "preloaded": [...], "failed": {...}}
once its imports are done. Requests on stdin: {"module", "args", "env", "cwd", "stdout", "stderr",
"status", "ranks"}; for each the server answers {"pid": P} (or {"error": ...}) at once and, when the child
ends, writes its returncode (Popen's convention: -N for a signal) to the file named by "status", through a
temporary file and a rename, so that the file appears complete or not at all. EOF on stdin stops the server;
children still running are left to the executor, which owns their process groups.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import sys
import time

from steps.errors import end_process, uncaught_exit_code  # the installed moerl's: this file runs by path

TORCHRUN_GRACE_SECONDS = 30.0  # torchrun's own wait between SIGTERM and SIGKILL of the surviving workers


def serve(preload: list[str]) -> dict:
    """Preload, then serve launches until EOF; returns only in a forked child, with its request."""
    preloaded, failed = [], {}
    for name in preload:
        try:
            importlib.import_module(name)
            preloaded.append(name)
        except Exception as err:  # noqa: BLE001 - a module this environment lacks is imported by the child
            failed[name] = f"{type(err).__name__}: {err}"
    import gc

    gc.freeze()  # children inherit the preloaded objects untouched: no collection walks them, pages stay shared
    try:  # a kernel without pidfds (before 5.3) cannot be served: say so before any fork, and every pod starts cold
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError) as err:
        reply({"ready": False, "error": f"pidfd_open: {err}"})
        os._exit(0)
    reply({"ready": True, "preloaded": preloaded, "failed": failed})
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, None)
    pending = b""
    children: dict[int, tuple[str, int]] = {}  # pid -> (its status file, its pidfd)
    while True:
        for key, _ in selector.select():
            if key.data is None:
                data = os.read(key.fd, 65536)
                if not data:
                    os._exit(0)
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    try:
                        pid = os.fork()
                    except OSError as err:
                        reply({"error": f"fork: {err}"})
                        continue
                    if pid == 0:  # the child keeps none of the server's descriptors but the ones it replaces
                        selector.close()
                        for _, pidfd in children.values():
                            os.close(pidfd)
                        return request
                    pidfd = os.pidfd_open(pid)
                    children[pid] = (request["status"], pidfd)
                    selector.register(pidfd, selectors.EVENT_READ, pid)
                    reply({"pid": pid})
            else:  # a child ended
                pid = key.data
                status_path, pidfd = children.pop(pid)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                write_status(status_path, os.waitstatus_to_exitcode(status))


def reply(message: dict) -> None:
    os.write(sys.stdout.fileno(), (json.dumps(message) + "\n").encode())


def write_status(path: str, returncode: int) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as file:
        file.write(f"{returncode}\n")
    os.rename(temporary, path)


def become_pod(request: dict) -> None:
    """In the forked child: take on the pod's session, files, directory, environment and interpreter state."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    rebuild_stdio(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    sys.path[0] = os.getcwd()


def rebuild_stdio(unbuffered: bool) -> None:
    """sys.stdin/out/err over fds 0-2 as interpreter start-up makes them for files (not a terminal):
    stdout block-buffered (write-through with PYTHONUNBUFFERED), stderr line-buffered, backslashreplace."""
    import io

    encoding = sys.stdout.encoding
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding=encoding)
    raw_out = open(1, "wb", buffering=0 if unbuffered else -1, closefd=False)
    sys.stdout = io.TextIOWrapper(raw_out, encoding=encoding, write_through=unbuffered)
    raw_err = open(2, "wb", buffering=0 if unbuffered else -1, closefd=False)
    sys.stderr = io.TextIOWrapper(
        raw_err, encoding=encoding, errors="backslashreplace", line_buffering=True, write_through=unbuffered
    )
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr


def fresh_process_state() -> None:
    """What a new interpreter would have that a fork of this one does not."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def launch_workers(ranks: int) -> None:
    """Be torchrun's agent for `--standalone --nnodes 1 --nproc-per-node ranks`: returns in each worker
    (with its rank's environment); the launcher itself waits for them and exits with torchrun's code."""
    port = free_port()
    run_id = f"warm-{os.getpid()}"
    threads = os.environ.get("OMP_NUM_THREADS") or ("1" if ranks > 1 else None)
    workers = {}
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "GROUP_RANK": "0",
                    "ROLE_RANK": str(rank),
                    "ROLE_NAME": "default",
                    "LOCAL_WORLD_SIZE": str(ranks),
                    "WORLD_SIZE": str(ranks),
                    "GROUP_WORLD_SIZE": "1",
                    "ROLE_WORLD_SIZE": str(ranks),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0",
                    "TORCHELASTIC_RUN_ID": run_id,
                    "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0 hosts the store: there is no agent
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
                    **({"OMP_NUM_THREADS": threads} if threads else {}),
                }
            )
            return
        workers[pid] = rank
    os._exit(supervise(workers))


def supervise(workers: dict[int, int]) -> int:
    """Wait for all workers; at the first failure stop the rest (SIGTERM, SIGKILL after the grace period)."""
    terminated = False

    def on_sigterm(signum: int, frame: object) -> None:  # the pod is being stopped: its workers got it too
        nonlocal terminated
        terminated = True

    signal.signal(signal.SIGTERM, on_sigterm)
    failure: tuple[int, int] | None = None  # (rank, returncode)
    kill_at = None
    while workers:
        flags = os.WNOHANG if kill_at is not None else 0
        pid, status = os.waitpid(-1, flags)
        if pid == 0:
            if time.monotonic() >= kill_at:
                for other in workers:
                    try_kill(other, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.05)
            continue
        rank = workers.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and failure is None:
            failure = (rank, code)
            for other in workers:
                try_kill(other, signal.SIGTERM)
            kill_at = time.monotonic() + TORCHRUN_GRACE_SECONDS
    if failure is not None:
        rank, code = failure
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        print(f"warm torchrun: rank {rank} failed ({how}); the other ranks were stopped", file=sys.stderr, flush=True)
        return 143 if terminated else 1
    return 143 if terminated else 0


def try_kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    sys.path[0] = os.getcwd()  # run by path, sys.path[0] was this file's directory; the executor's is -m's
    request = serve(sys.argv[1:])
    become_pod(request)
    if request.get("ranks"):
        launch_workers(int(request["ranks"]))
    fresh_process_state()
    module = request["module"]
    sys.modules.pop(module, None)  # its top level runs once, as __main__, as `python -m` runs it
    sys.argv = [module, *request["args"]]
    end_process(run_as_main(module))


def run_as_main(module: str) -> int:
    """Run the module as `python -m` would; the exit code the interpreter would give its outcome (a module
    whose main goes through steps.errors.run_cli ends the process itself, the same way)."""
    import runpy

    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except BaseException as err:  # noqa: BLE001 - every uncaught exception ends the process, as in Python
        return uncaught_exit_code(err)
    return 0


if __name__ == "__main__":
    main()
