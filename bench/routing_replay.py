"""Routing replay against a mismatched engine: a bf16 engine samples, the fp32 trainer recomputes, and the update
reports, on the same samples, how often its routers chose other experts than the engine's and how far its
log-probs are from the engine's, with trainer.routing_replay none and rollout.

    .venv/bin/python bench/routing_replay.py [--checkpoint DIR] [--prompts 64] [--samples 8] [--new-tokens 12]
                                             [--router-noise 0.0] [--threads 2]

The mismatch is the one a GPU run has: SGLang serves a bf16 checkpoint in bf16 with its own kernels, the trainer
recomputes in fp32 masters, and where a token's router scores nearly tie the two choose different experts. Here
the torch engine computes in bfloat16 on the CPU (TorchEngine.from_checkpoint(dtype=torch.bfloat16), recording
its routes), and the trainer is moerl's PolicyTrainer in float32 on the same checkpoint; --router-noise adds
Gaussian noise of that relative size to the engine's router weights on top (an engine whose router logits are
perturbed). Both settings measure the same samples through the update's own code path (PolicyTrainer.train: the
mismatch and the routing figures are taken on the first step's forward, before any weight moves).

--checkpoint: an HF-format checkpoint dir of the demo's task (e.g. `moerl sft-demo --out DIR`); without it the
demo SFT checkpoint is trained first (about 20 s). Prompts are the demo task's training prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from pipelines.config import load_config  # noqa: E402
from pipelines.demo import DEMO_CONFIG  # noqa: E402
from steps.data.tokenizer import CheckpointTokenizer  # noqa: E402
from steps.engines.interface import sample_requests, sample_seed  # noqa: E402
from steps.engines.torch_engine import TorchEngine  # noqa: E402
from steps.experience.rollout_chunks import encoded_prompt  # noqa: E402
from steps.experience.rollout_plan import RolloutPlan  # noqa: E402
from steps.experience.tables import Sample  # noqa: E402
from steps.expert_parallel.mesh import Mesh  # noqa: E402
from steps.models.hf_checkpoint import load_pretrained  # noqa: E402
from steps.training.rl_loss import LossSettings  # noqa: E402
from steps.training.trainer import PolicyTrainer, TrainSettings  # noqa: E402


def demo_checkpoint(directory: Path) -> Path:
    from pipelines.sft_demo import sft_demo
    from steps.demo.sft import SftSettings

    sft_demo(str(directory), SftSettings())
    return directory


def engine_samples(checkpoint: Path, args: argparse.Namespace) -> list[Sample]:
    """The demo task's prompts sampled by a bf16 torch engine that records its routes, as the rollout writes them."""
    cfg = load_config(DEMO_CONFIG, {"sft_checkpoint": str(checkpoint), "run_store": "file:///tmp/unused",
                                    "prompts_per_iteration": args.prompts, "group_size": args.samples,
                                    "sampling.max_new_tokens": args.new_tokens, "rollout.num_shards": 1})  # fmt: skip
    tok = CheckpointTokenizer.load(checkpoint)
    plan = RolloutPlan.for_iteration(cfg, 1, 0, stop_token_ids=tok.stop_ids)
    prompts = [(p.prompt_id, encoded_prompt(tok, p, plan)) for p in plan.prompts]
    engine = TorchEngine.from_checkpoint(checkpoint, dtype=torch.bfloat16, record_routes=True)
    if args.router_noise > 0:
        gen = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            for block in engine.model.moe_blocks():
                weight = block.gate.weight
                noise = torch.randn(weight.shape, generator=gen).to(weight.dtype)
                weight.add_(noise * weight.std() * args.router_noise)
    requests = sample_requests(prompts, plan.sampling, lambda pid, k: sample_seed(args.seed, 1, pid, k))
    generations = engine.generate(requests, plan.sampling)
    ids = dict(prompts)
    # Advantages of both signs, so the step's loss is not degenerate (the figures are taken before it updates)
    return [Sample(g.prompt_id, g.sample_index, list(ids[g.prompt_id]), g.response_ids, g.logprobs,
                   1.0 if g.sample_index % 2 else -1.0, g.routed_experts.reshape(-1))
            for g in generations]  # fmt: skip


def measure(checkpoint: Path, samples: list[Sample], replay: str) -> dict:
    model = load_pretrained(checkpoint, dtype=torch.float32)
    settings = TrainSettings(loss=LossSettings(kl_coef=0.0), micro_batch_size=64, steps_per_epoch=1, lr=1e-6,
                             routing_replay=replay)  # fmt: skip
    metrics = PolicyTrainer(model, Mesh(), settings).train(samples, iteration=1)
    return {"routing": metrics["routing"], "mismatch": metrics["mismatch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--router-noise", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moerl-replay-") as tmp:
        checkpoint = args.checkpoint or demo_checkpoint(Path(tmp) / "sft-demo")
        samples = engine_samples(checkpoint, args)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
        print(f"{len(samples)} samples from a bf16 torch engine (router noise {args.router_noise}), {tokens} tokens "
              f"with recorded routes; trainer float32")  # fmt: skip
        results = {replay: measure(checkpoint, samples, replay) for replay in ("none", "rollout")}
    print(f"{'routing_replay':<15} {'router disagr.':>14} {'experts used':>13} {'k3 KL':>10} {'ratio p99':>10} "
          f"{'ratio max':>10}  per-layer router disagreement")  # fmt: skip
    for replay, got in results.items():
        routing, mismatch = got["routing"], got["mismatch"]
        by_layer = routing["layers"]
        layers = " ".join(f"{by_layer[i]['router_disagreement']:.4f}" for i in sorted(by_layer, key=int))
        print(f"{replay:<15} {routing['router_disagreement']:>14.4%} {routing['disagreement']:>13.4%} "
              f"{mismatch['k3']:>10.3e} {mismatch['ratio']['p99']:>10.4f} {mismatch['ratio']['max']:>10.4f}  {layers}")
    none, rollout = results["none"]["mismatch"], results["rollout"]["mismatch"]
    print(f"k3 with replay / without: {rollout['k3'] / none['k3']:.3f}; "
          f"ratio max with / without: {rollout['ratio']['max'] / none['ratio']['max']:.3f} "
          f"({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
