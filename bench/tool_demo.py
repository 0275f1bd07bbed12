"""The tool demo over seeds: held-out accuracy before and after RL, and the workflow's wall time, per seed.

    .venv/bin/python bench/tool_demo.py [--seeds 0 1 2 3 4] [--workdir DIR] [--png bench/tool_demo.png]

For each seed, the demo SFT checkpoint of configs/demo-tool.yaml is built as `moerl demo --config
configs/demo-tool.yaml --seed S` builds it (whole conversations with the calculator environment) and the whole RL
workflow runs on it with the local executor, one seed after the other. Printed per seed: the SFT checkpoint's
held-out accuracy (v000000), the final version's (the report step's), the gain, the workflow's wall seconds (RL
only: the SFT is built before it starts), the mean turns and tool calls of the last iteration's conversations; the
plot has each seed's held-out accuracy by policy version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipelines.config import load_config  # noqa: E402
from pipelines.demo import demo_sft_settings, run_config  # noqa: E402
from steps.errors import MoerlError, run_cli  # noqa: E402

CONFIG = REPO / "configs" / "demo-tool.yaml"


def accuracy_by_version(run: Path) -> dict[int, float]:
    """Held-out accuracy of every version the run measured: the behaviour policies' (score) and the final one's
    (the report's `Result:` line)."""
    out = {}
    for path in sorted((run / "metrics").glob("iter-*[0-9].json")):
        metrics = json.loads(path.read_text())
        if "heldout_accuracy" in metrics:
            out[int(metrics["policy_version"])] = float(metrics["heldout_accuracy"])
    report = (run / "report" / "report.md").read_text()
    final = re.search(r"-> ([\d.]+)% \(v(\d+)\)", report)
    if final is None:
        raise MoerlError(f"{run}/report/report.md: no held-out result line")
    out[int(final[2])] = float(final[1]) / 100
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moerl-bench-tool-demo"))
    parser.add_argument("--png", type=Path, default=REPO / "bench" / "tool_demo.png")
    args = parser.parse_args()
    rows, curves = [], {}
    for seed in args.seeds:
        base = args.workdir / f"seed-{seed}"
        if (base / "run").exists():
            raise MoerlError(f"{base}/run exists: pass another --workdir or delete it")
        sft_dir = base / "sft-demo"
        overrides = {"sft_checkpoint": str(sft_dir), "run_store": str(base / "run"), "seed": seed}
        cfg = load_config(CONFIG, overrides)
        if not (sft_dir / "config.json").is_file():
            from pipelines.sft_demo import sft_demo

            sft_demo(str(sft_dir), demo_sft_settings(cfg, seed))
        started = time.monotonic()
        result = run_config(cfg, base)
        seconds = time.monotonic() - started
        if not result.succeeded:
            raise MoerlError(f"seed {seed}: the workflow ended {result.phase}: {result.message}")
        curves[seed] = accuracy_by_version(base / "run")
        last = json.loads(sorted((base / "run" / "metrics").glob("iter-*[0-9].json"))[-1].read_text())
        start, final = curves[seed][0], curves[seed][max(curves[seed])]
        rows.append({"seed": seed, "sft": start, "final": final, "gain": final - start, "seconds": seconds,
                     "turns": last["turns_mean"], "tool_calls": last["env/tool_calls"]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'seed':>4} {'SFT':>6} {'final':>6} {'gain':>7} {'seconds':>8} {'turns':>6} {'calls':>6}")
    for r in rows:
        print(f"{r['seed']:>4} {r['sft']:>6.1%} {r['final']:>6.1%} {r['gain'] * 100:>+6.1f}p {r['seconds']:>7.0f}s "
              f"{r['turns']:>6.2f} {r['tool_calls']:>6.2f}")  # fmt: skip
    plot(curves, args.png)
    print(f"plot: {args.png}")
    return 0


def plot(curves: dict[int, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for seed, points in curves.items():
        versions = sorted(points)
        ax.plot(versions, [points[v] * 100 for v in versions], marker="o", label=f"seed {seed}")
    ax.set_xlabel("policy version (RL iterations)")
    ax.set_ylabel("held-out accuracy, greedy (%)")
    ax.set_title("Tool demo: multiply with a calculator environment (configs/demo-tool.yaml)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    run_cli(main)
