"""Dynamic sampling and a learning-rate schedule against today's recipe: time to a held-out gain, and the drops.

    .venv/bin/python bench/stability.py [--config configs/demo-chat.yaml] [--seeds 0 1]
        [--variant rollout.dynamic_sampling=true,trainer.lr_schedule=cosine,trainer.lr_final_ratio=0.1]
        [--target-gain 0.15] [--workdir DIR] [--png stability.png]

For each seed, the config's demo SFT checkpoint is built once (as `moerl demo --config CONFIG --seed S` builds it)
and the whole workflow runs twice on it with the local executor, one run after the other: the config as it is
("today") and with the --variant overrides. Both runs are read back from their run stores the way
bench/learning.py reads moerl's side: the held-out accuracy of version v(i) is what score[i+1] recorded, its time is
when publish[i] finished, minus the held-out evaluations that finished before it (they are not training). Printed
per run: the SFT and final accuracy, the best, the seconds to SFT + target gain, and the largest drop of a
version's accuracy below the best one before it (the late-run drops of bench/README.md, "demo seeds"); with
dynamic sampling, the prompts generated per iteration and the mixed groups trained. The plot has every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from learning import Curve, moerl_curve, status_times  # noqa: E402

from pipelines.config import load_config, parse_overrides  # noqa: E402
from pipelines.demo import demo_sft_settings, run_config  # noqa: E402
from steps.errors import MoerlError, run_cli  # noqa: E402

TODAY = "today"
VARIANT = "rollout.dynamic_sampling=true,trainer.lr_schedule=cosine,trainer.lr_final_ratio=0.1"


def read_curve(name: str, workdir: Path, start: float) -> tuple[Curve, list[dict[str, Any]]]:
    run = workdir / "run"
    published = {int(m.parent.name[1:]): m.stat().st_mtime for m in (run / "checkpoints").glob("v*/MANIFEST.json")}
    status = json.loads((workdir / "status.json").read_text())
    published.update(status_times(status, "publish"))
    heldout: dict[int, float] = {}
    evals: dict[int, float] = {}
    scores = []
    for path in sorted((run / "metrics").glob("iter-*[0-9].json")):
        metrics = json.loads(path.read_text())
        scores.append(metrics)
        if "heldout_accuracy" in metrics:
            heldout[int(metrics["policy_version"])] = float(metrics["heldout_accuracy"])
            evals[int(metrics["iteration"])] = float(metrics.get("heldout_seconds", 0.0))
    curve = moerl_curve(start, published, heldout, status_times(status, "score"), evals)
    curve.name = name
    return curve, scores


def largest_drop(curve: Curve) -> float:
    """The largest fall of a version's accuracy below the best version before it (0: never fell)."""
    best, drop = -1.0, 0.0
    for _, accuracy in curve.points:
        drop = max(drop, best - accuracy)
        best = max(best, accuracy)
    return drop


def run_side(config: Path, overrides: dict[str, Any], workdir: Path) -> float:
    cfg = load_config(config, overrides)
    start = time.time()
    result = run_config(cfg, workdir)
    if not result.succeeded:
        raise MoerlError(f"{workdir}: the workflow ended {result.phase}: {result.message}")
    return start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "demo-chat.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--variant", default=VARIANT, help="NAME=VALUE,... overrides of the other run")
    parser.add_argument("--target-gain", type=float, default=0.15)
    parser.add_argument("--iterations", type=int, help="default: the config's")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moerl-bench-stability"))
    parser.add_argument("--png", type=Path, default=REPO / "bench" / "stability.png")
    args = parser.parse_args()
    variant = parse_overrides([pair.strip() for pair in args.variant.split(",") if pair.strip()])
    rows, curves = [], []
    for seed in args.seeds:
        base = args.workdir / f"seed-{seed}"
        sft_dir = base / "sft-demo"
        common: dict[str, Any] = {"sft_checkpoint": str(sft_dir), "seed": seed}
        if args.iterations:
            common["iterations"] = args.iterations
        if not (sft_dir / "config.json").is_file():
            from pipelines.sft_demo import sft_demo

            sft_demo(str(sft_dir), demo_sft_settings(load_config(args.config, common), seed))
        for side, extra in ((TODAY, {}), ("variant", variant)):
            workdir = base / side
            if (workdir / "run").exists():
                raise MoerlError(f"{workdir}/run exists: pass another --workdir or delete it")
            workdir.mkdir(parents=True, exist_ok=True)
            start = run_side(args.config, {**common, **extra, "run_store": str(workdir / "run")}, workdir)
            curve, scores = read_curve(f"seed {seed} {side}", workdir, start)
            curves.append(curve)
            sft = curve.points[0][1]
            reached = curve.time_to(sft + args.target_gain)
            dynamic = [s["dynamic_sampling"] for s in scores if "dynamic_sampling" in s]
            rows.append({
                "seed": seed, "side": side, "sft": sft, "final": curve.points[-1][1], "best": curve.best,
                "seconds_to_gain": reached, "largest_drop": largest_drop(curve),
                "training_seconds": curve.points[-1][0],
                "generated_prompts": [d["generated_groups"] for d in dynamic],
                "trained_mixed": [d["trained_mixed_groups"] for d in dynamic],
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'seed':>4} {'side':>8} {'SFT':>6} {'final':>6} {'best':>6} {'to +' + str(args.target_gain):>9} "
          f"{'drop':>6} {'seconds':>8}  generated prompts / mixed groups trained per iteration")  # fmt: skip
    for r in rows:
        reached = f"{r['seconds_to_gain']:.0f} s" if r["seconds_to_gain"] is not None else "never"
        extra = " ".join(f"{g}/{m}" for g, m in zip(r["generated_prompts"], r["trained_mixed"], strict=True))
        print(f"{r['seed']:>4} {r['side']:>8} {r['sft']:>6.3f} {r['final']:>6.3f} {r['best']:>6.3f} {reached:>9} "
              f"{r['largest_drop'] * 100:>5.1f}p {r['training_seconds']:>7.0f}s  {extra}")  # fmt: skip
    plot(curves, args.png)
    print(f"plot: {args.png}")
    return 0


def plot(curves: list[Curve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for curve in curves:
        xs, ys = zip(*curve.points, strict=True)
        style = "-" if curve.name.endswith(TODAY) else "--"
        ax.plot(xs, ys, style, marker="o", markersize=3, label=curve.name)
    ax.set_xlabel("wall-clock seconds (held-out evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("today's recipe against dynamic sampling + a cosine schedule")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    run_cli(main)
