"""Step update: train the policy on one iteration's scored experience and write an unpublished candidate.

    torchrun --nproc-per-node P [--nnodes N ...] -m steps.update -- --run URI --iteration I
    python -m steps.update --run URI --iteration I          (one process)
    python -m steps.update --run URI --iteration I --workflow W    (a client of the trainer, trainer.server)

(The `--` matters under torchrun: its own parser would take --run for an abbreviation of its --run-path.)

Inputs, all published: the run config (<run>/run.json), checkpoint v(I-1) with its optimizer state
(<run>/optimizer/v(I-1)/, absent for v000000), the reference policy v000000 when kl_coef > 0, and
<run>/experience/iter-I/scored.parquet, whose policy_version must be v(I-1-staleness).

Precision: the policy trains in fp32 and is published in the run's checkpoint dtype, v000000's (bf16 stays
bf16). When that dtype is narrower than fp32, the optimizer state also holds each parameter's fp32 master
(`<name>.master`), and the next update starts from the masters, not from the rounded published weights.

Output: the candidate <run>/candidates/iter-I/ (its format: steps/run/candidate.py), one weight shard per EP rank,
WEIGHTS.json once they and the small files are stored, one optimizer-state shard per EP rank and CANDIDATE.json
last; and <run>/metrics/iter-I.update.json (loss, clip fraction, KL, importance weights, grad norm, entropy,
tokens/s, the per-expert routed row counts and the expert placement used; a separate file so that score's
metrics/iter-I.json is never rewritten). Rank 0 then hands the metrics to the run's experiment trackers
(steps/tracking/trackers.py; none by default). With rollout servers and checkpoint.deltas, each rank that writes a
weight shard also writes its delta blob against v(I-1)'s bits at <run>/deltas/v(I)/ (steps/run/weight_delta.py),
listed in WEIGHTS.json; after CANDIDATE.json (a trainer that stays up: after WEIGHTS.json), rank 0 indexes them
(DELTA.json, steps/training/publication.py), and from then on rollout servers may take v(I) while publish writes
the full checkpoint. An indexed version is final: the update refuses to train it again, except to replay it
(below).

Expert placement (trainer.expert_placement, default balanced): which E/ep experts each EP rank holds, per
MoE layer. Update I balances the EP ranks' routed rows with the per-expert row counts that update I-1
recorded in metrics/iter-(I-1).update.json (steps.models.placement.balanced_placement);
iteration 1, one EP rank, 'contiguous', or absent or malformed counts give the contiguous placement (said in
the log and the metrics). The placement is a pure function of published inputs, so a restart chooses the
same one. Tensors keep their global names, so weights and optimizer state of v(I-1) are read by name
whichever rank's file of the previous iteration holds them.

Each EP rank's files are uploaded by one of its dp replicas; nothing is gathered to rank 0 but the file names
and digests. A crash leaves no CANDIDATE.json, and a restart deletes the partial candidate and trains again
from the same published inputs: same plan, same arithmetic, same bits. A complete candidate, or an already
published version I, makes the step a no-op (--force retrains a complete candidate). A candidate with
WEIGHTS.json and an indexed delta but no CANDIDATE.json (a trainer that stays up lost after it answered,
before it stored the optimizer shards) is replayed: trained again from the same inputs, its weights checked bit
for bit against WEIGHTS.json, and only the optimizer shards and CANDIDATE.json written.

With trainer.server and --workflow (the Workflow's name, `{{workflow.name}}`), the step is a client of its
Workflow's trainer that stays up (steps/trainer_server.py): it waits up to trainer.server_wait_s for the
server registered as "trainer" to be ready, sends it `update` {run, iteration, optimizer_later} and checks
that the candidate's weights are complete (WEIGHTS.json): the trainer stores the optimizer shards after it
answered, while it trains the next update, except after the segment's last update (optimizer_later false).
The client runs on a CPU node (it holds no GPU: the trainer's nodes are the trainer
server's), so with no trainer ready within that time, or a trainer lost mid-request, it ends with
steps/run/serving.py EXIT_SERVER_LOST (75), which its retryStrategy retries: the retry reaches the restarted
trainer, which reloads v(I-1) from the store and trains the same bits.

The update itself is steps/training/update.py (shared with the trainer server).
"""

from __future__ import annotations

import argparse
import os
import sys

from steps import progress
from steps.errors import run_cli
from steps.run import candidate, checkpoint, serving
from steps.run.config import load_run_config
from steps.run.keys import TRAINER_SERVER_NAME
from steps.store.object_store import Store
from steps.training.update import choose_placement, fetch_checkpoint, index_candidate_delta, run_update

__all__ = ["choose_placement", "fetch_checkpoint", "main", "run_update", "serve_update"]


def finished(run: Store, iteration: int) -> bool:
    """Whether update `iteration` has nothing left to do: its candidate is complete or v(I) is published."""
    return checkpoint.read_manifest(run, iteration) is not None or candidate.read_marker(run, iteration) is not None


def answered(run: Store, iteration: int) -> bool:
    """Whether the trainer's answer to update `iteration` holds: the candidate's weights are complete (it stores
    the optimizer shards after it answered) or v(I) is published."""
    return checkpoint.read_manifest(run, iteration) is not None or (
        candidate.read_weights_marker(run, iteration) is not None
    )



def serve_update(run_uri: str, iteration: int, workflow: str, ep_size: int | None, force: bool) -> int:
    """The update as a client of the Workflow's trainer (see the module docstring); the step's exit code."""
    log = lambda line: print(line, flush=True)  # noqa: E731
    run = Store.open(run_uri)
    cfg = load_run_config(run)
    progress.report(0, 2)
    if finished(run, iteration) and not force:
        index_candidate_delta(run, cfg, iteration)  # a retry after the trainer wrote the candidate, not its index
        log(f"update {iteration}: its candidate is complete or v{iteration:06d} published; nothing to do")
        progress.report(2, 2)
        return 0
    wait_s = cfg.trainer.server_wait_s
    servers = serving.wait_for_servers(run, workflow, TRAINER_SERVER_NAME, wait_s, log, exact=True)
    if not servers:  # this pod holds no GPU: the retry waits for the trainer's replacement
        log(
            f"update {iteration}: no trainer of workflow {workflow} was ready within trainer.server_wait_s="
            f"{wait_s:.0f}s (its pod: the Workflow's {TRAINER_SERVER_NAME} task; `argo retry` does not restart "
            f"daemons, argoproj/argo-workflows#13484: resubmit the run instead); exiting {serving.EXIT_SERVER_LOST}"
        )
        return serving.EXIT_SERVER_LOST
    trainer = servers[0]
    log(f"update {iteration}: sent to {trainer.name} at {trainer.address}")
    # The trainer stores the optimizer shards after it answers, while it trains the next update, except after the
    # last update of the segment: the Workflow's end stops the trainer (steps/training/optimizer_write.py).
    later = candidate.optimizer_after_answer(cfg, iteration)
    request = {"run": run.uri, "iteration": iteration, "ep_size": ep_size, "force": force, "optimizer_later": later}
    try:
        answer = serving.call(trainer, "update", request)
        progress.report(1, 2)
        if not answered(run, iteration):
            raise serving.ServerLost(f"{trainer.name} answered update {iteration} but its candidate's weights are not")
        index_candidate_delta(run, cfg, iteration)  # the trainer indexed it; this step's end is what rollout awaits
    except serving.ServerLost as err:
        log(f"update {iteration}: trainer lost ({err}); exiting {serving.EXIT_SERVER_LOST} for a retry")
        return serving.EXIT_SERVER_LOST
    log(f"update {iteration}: {answer.get('outcome')} by {trainer.name} ({answer.get('source')})")
    progress.report(2, 2)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.update", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI (file://, plain path or s3://bucket/prefix)")
    parser.add_argument("--iteration", required=True, type=int, help="the iteration to train (>= 1)")
    parser.add_argument(
        "--ep-size", type=int, default=None,
        help="expert-parallel group size (default: the run's trainer.ep_size, else the largest that divides "
        "both the ranks and num_experts)",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="retrain even if the candidate is complete")
    parser.add_argument(
        "--workflow", default=None,
        help="the Workflow's name: with trainer.server, send the update to that Workflow's trainer",
    )  # fmt: skip
    argv = sys.argv[1:]
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    if args.workflow and load_run_config(Store.open(args.run)).trainer.server:
        return serve_update(args.run, args.iteration, args.workflow, args.ep_size, args.force)
    # cuBLAS needs this before CUDA starts for deterministic GEMMs (torch.use_deterministic_algorithms).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    run_update(args.run, args.iteration, args.ep_size, args.force)
    return 0


if __name__ == "__main__":
    run_cli(main)
