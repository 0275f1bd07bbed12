"""Step trainer-server: the trainer that stays up for a Workflow (an Argo daemon task), driven by its update steps.

    torchrun --nproc-per-node P --standalone --nnodes 1 -m steps.trainer_server -- --run URI --workflow NAME
                                                                                  [--port P]

On several nodes it is each replica's command of the trainer's PyTorchJob (`--nnodes N`, the rendezvous from
the training operator's PET_* variables), which the segment's trainer-server daemon launches; there it also
gets `--idle-exit-s` (trainer.server_idle_exit_s): rank 0 watches its launcher's heartbeat in the run store
(steps/run/keys.py launcher_heartbeat_key, rewritten by steps/pytorchjob_launcher.py at every poll of the
job) and ends the trainer once it has been still that long, so that a job whose launcher died ends itself,
while a trainer whose launcher lives waits for updates however long they pause (a stalled segment's rollouts).

Its ranks start the process group and the dp x ep mesh once (trainer.ep_size, the model's experts: from the
newest published version's config.json); rank 0 listens, registers as `<run>/servers/<workflow>/trainer.json`
and says it is ready (`GET /health`; the readinessProbe is `python -m steps.server_probe --server trainer`).
The update steps of its Workflow send it `update` {run, iteration} (steps/update.py --workflow); every rank
trains that iteration with the update step's own code (steps/training/update.py), from the state it holds in
memory when that is v(I-1) as published, else from the store, and writes the same candidate bit for bit
(steps/training/trainer_server.py, steps/training/held_state.py). A trainer killed mid-update loses nothing: its
client
exits 75 and is retried, and the restarted trainer reloads v(I-1) from the store.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType

import torch.distributed as dist

from steps.errors import run_cli
from steps.expert_parallel.mesh import build_mesh, resolve_ep_size
from steps.models.family import FamilyConfig
from steps.models.hf_checkpoint import CONFIG_NAME
from steps.models.registry import config_from_hf
from steps.run import checkpoint, serving
from steps.run.config import load_run_config
from steps.run.keys import TRAINER_SERVER_NAME, launcher_heartbeat_key
from steps.store.object_store import Store
from steps.training.trainer_server import LauncherWatch, TrainerService
from steps.training.update import COLLECTIVE_TIMEOUT_SECONDS, init_distributed

EXIT_STOPPED = 143  # SIGTERM: the end of the Workflow's scope, or a reclaim
VERSION_POLL_S = 0.5  # how often a trainer that starts before v000000 exists looks for it


def newest_model_config(run: Store, log: Callable[[str], None]) -> FamilyConfig:
    """The model's config, from the newest published version (every version has v000000's), waiting for
    import-sft's v000000 when there is none yet: the trainer's pod starts with its segment, beside the import."""
    said = False
    while (version := checkpoint.latest_version(run)) is None:
        if not said:
            log("trainer: waiting for the run's first published version (import-sft)")
            said = True
        time.sleep(VERSION_POLL_S)
    data = checkpoint.read_file(run, version, CONFIG_NAME)
    return config_from_hf(json.loads(data), source=run.url(f"v{version:06d}/{CONFIG_NAME}"))


def serve_trainer(run_uri: str, workflow: str, port: int = 0, idle_exit_s: float = 0.0) -> int:
    """Run the trainer until SIGTERM (rank 0), or until its launcher's heartbeat has been still for `idle_exit_s`
    (> 0; a heartbeat never written: no launcher, never), or until rank 0 says stop (the others)."""
    log = lambda line: print(line, flush=True)  # noqa: E731
    rank, world, local_rank, device = init_distributed()
    run = Store.open(run_uri)
    cfg = load_run_config(run)
    model_config = newest_model_config(run, log)
    mesh = build_mesh(rank, world, resolve_ep_size(world, model_config.num_experts, cfg.trainer.ep_size), device)
    command_group = None
    if world > 1:  # the commands' own group: gloo whatever the training backend
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_SECONDS)
        command_group = dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
    service = TrainerService(run, mesh, local_rank, model_config, command_group, log)
    if rank != 0:
        service.follow()
        return 0

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        service.stopping.set()
        raise SystemExit(EXIT_STOPPED)  # between two requests; one in flight is lost and retried

    signal.signal(signal.SIGTERM, on_sigterm)
    server = serving.JsonServer({"update": service.update}, service.health, port=port, main_thread=True)
    server.serve_in_background()
    entry = serving.register(run, workflow, TRAINER_SERVER_NAME, server.port)
    service.instance = entry.instance
    log(f"trainer: {world} rank(s), ep {mesh.ep_size}; listening on {entry.address} for workflow {workflow}")
    launcher = LauncherWatch(run, launcher_heartbeat_key(workflow), idle_exit_s) if idle_exit_s > 0 else None
    try:
        service.serve(server, launcher)
    finally:
        serving.unregister(run, entry)
        server.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.trainer_server", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI (file://, plain path or s3://bucket/prefix)")
    parser.add_argument("--workflow", required=True, help="the Workflow whose update steps it serves")
    parser.add_argument("--port", type=int, default=0, help="port rank 0 listens on (default 0: any free port)")
    parser.add_argument(
        "--idle-exit-s",
        type=float,
        default=0.0,
        help="end (exit 0) once the launcher's heartbeat in the run store has been still this long (the launcher "
        "is gone); default 0: never (trainer.server_idle_exit_s)",
    )
    argv = sys.argv[1:]
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    # cuBLAS needs this before CUDA starts for deterministic GEMMs (torch.use_deterministic_algorithms).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return serve_trainer(args.run, args.workflow, args.port, args.idle_exit_s)


if __name__ == "__main__":
    run_cli(main)
