"""Step rollout-server: a long-lived rollout server of one Workflow (an Argo daemon task).

    python -m steps.rollout_server --run URI --workflow NAME --name rollout-server-K [--port P]
                                   [--device cpu|cuda] [--threads N]

It listens (port 0: any free port), registers as `<run>/servers/<workflow>/<name>.json`, opens its engine on
the version the run's next iteration samples from (in the node cache, steps/engines/weight_sync.py; waiting for
v000000 when it starts beside import-sft) and then says it is ready (`GET /health`; the readinessProbe is
`python -m steps.server_probe`). The rollout steps of its Workflow send it their chunks (`POST /chunk`,
steps/experience/rollout_server.py); it brings its engine to each request's policy version in place and writes the
chunk to the store. An in-place update that breaks the engine (SGLang's failed load) is answered 503 and a
new engine is opened from the store, the server not ready and answering 503 until it is
(steps/experience/rollout_server.py). On SIGTERM (the end of its Workflow's scope, or a Spot reclaim) it stops the
request in flight (the torch engine between two decode steps; SGLang's by aborting its requests,
steps/engines/sglang_engine.py "SIGTERM"), answers it 503, unregisters and exits with 143; that request's client
fails and is retried.

--threads as for steps.rollout: the same torch CPU thread count everywhere gives the same samples.
"""

from __future__ import annotations

import argparse
import signal
from types import FrameType

import torch

from steps.errors import run_cli
from steps.experience.rollout_chunks import EXIT_PREEMPTED
from steps.experience.rollout_server import RolloutService
from steps.run import serving
from steps.store.object_store import Store


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.rollout_server", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI (file://, plain path or s3://bucket/prefix)")
    parser.add_argument("--workflow", required=True, help="the Workflow whose rollout steps it serves")
    parser.add_argument("--name", required=True, help="its name among the Workflow's servers: rollout-server-K")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: any free port)")
    parser.add_argument("--device", default="cpu", help="torch engine device: cpu (default) or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1; see above)")
    args = parser.parse_args()
    log = lambda line: print(line, flush=True)  # noqa: E731

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        service.stopping.set()

    run = Store.open(args.run)
    service = RolloutService(run, args.name, device=args.device, log=log)
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    server = serving.JsonServer(
        {"chunk": service.chunk, "generate": service.generate},
        service.health, port=args.port, main_thread=True, unavailable=service.unavailable
    )
    server.serve_in_background()
    entry = serving.register(run, args.workflow, args.name, server.port)
    service.instance = entry.instance
    log(f"{args.name}: listening on {entry.address} for workflow {args.workflow}")
    try:
        if service.start():
            # The engine runs on this thread, where SIGTERM interrupts it; between calls, a broken engine is
            # replaced (service.recover: at once, and again after a failed open).
            server.run_operations(service.stopping, idle=service.recover, idle_every_s=0.0)
    finally:
        serving.unregister(run, entry)
        server.close()
        service.close()
    log(f"{args.name}: SIGTERM: stopped after {service.health()['requests']} requests")
    return EXIT_PREEMPTED


if __name__ == "__main__":
    run_cli(main)
