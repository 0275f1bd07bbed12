"""The demo's iteration time with an engine per rollout step against long-lived rollout servers (and a trainer
that stays up), measured in one run of this script.

    .venv/bin/python bench/engines.py [--iterations 8] [--config configs/demo.yaml] [--shapes per-step,servers]

Each shape is `moerl demo` on the same config, seed and SFT checkpoint, one after another, in a workdir of its
own:

    per-step   rollout.servers 0: each rollout step opens its own engine on the iteration's policy version
    servers    rollout.servers = rollout.num_shards: daemon servers hold an engine for the whole run and bring
               it to each request's version; the rollout steps are their clients
    trainer    servers, plus trainer.server: the update steps drive a trainer that stays up

From each run's status (steps/tracking/workflow_status.py) it prints the first iteration (import-sft's end to
publish-1's end: it holds the servers' start), the steady iteration (publish-1's end to publish-N's, over N-1),
the rollout step's median wall time and the whole workflow, and the ratio of each to per-step's.
It also checks that every shape published the same final weights (the invariant: servers change where the
samples are generated, not their bits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from steps.tracking.workflow_status import step_nodes  # noqa: E402

SHAPES = {
    "per-step": lambda cfg: {"rollout": {"servers": 0}},
    "servers": lambda cfg: {"rollout": {"servers": cfg["rollout"]["num_shards"]}},
    "trainer": lambda cfg: {"rollout": {"servers": cfg["rollout"]["num_shards"]}, "trainer": {"server": True}},
}


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def run_shape(config: dict, shape: str, workdir: Path, iterations: int, sft: Path | None) -> dict:
    cfg_path = workdir / f"{shape}.yaml"
    cfg_path.write_text(yaml.safe_dump(merged(config, SHAPES[shape](config))))
    work = workdir / shape
    work.mkdir()
    if sft is not None:
        shutil.copytree(sft, work / "sft-demo")
    moerl = Path(sys.executable).parent / "moerl"
    argv = [str(moerl), "demo", "--config", str(cfg_path), "--workdir", str(work), "--iterations", str(iterations)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{shape}: moerl demo failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    status = json.loads((work / "status.json").read_text())
    nodes = [n for n in step_nodes(status) if n.type == "Pod" and n.finished is not None]
    ends = {n.iteration: n.finished for n in nodes if n.step == "publish" and n.iteration is not None}
    imported = max(n.finished for n in nodes if n.template == "import-sft")
    # Argo's timestamps are whole seconds: the span of iterations 2..N over N-1, not a median of rounded gaps.
    steady = (ends[iterations] - ends[1]).total_seconds() / (iterations - 1) if iterations > 1 else float("nan")
    rollouts = {}
    for n in nodes:
        if n.step == "rollout" and n.started is not None:
            first, last = rollouts.get(n.iteration, (n.started, n.finished))
            rollouts[n.iteration] = (min(first, n.started), max(last, n.finished))
    started = min(n.started for n in nodes if n.started is not None)
    final = work / "run" / "checkpoints" / f"v{iterations:06d}"
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(final.glob("*.safetensors")))).hexdigest()
    return {
        "first": (ends[1] - imported).total_seconds(),
        "steady": steady,
        "rollout": statistics.median((b - a).total_seconds() for a, b in rollouts.values()),
        "workflow": (max(n.finished for n in nodes) - started).total_seconds(),
        "weights": digest,
        "sft": work / "sft-demo",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--shapes", default="per-step,servers", help=f"comma-separated, of {', '.join(SHAPES)}")
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    config = yaml.safe_load(Path(args.config).read_text())
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        sft = None
        for shape in shapes:
            print(f"running {shape} ({args.iterations} iterations) ...", flush=True)
            results[shape] = run_shape(config, shape, Path(tmp), args.iterations, sft)
            sft = sft or results[shape]["sft"]
    base = results[shapes[0]]
    print(
        f"\n{'shape':10} {'first it. s':>12} {'steady it. s':>13} {'rollout s':>10} {'workflow s':>11}  ratio (steady)"
    )
    for shape, r in results.items():
        ratio = r["steady"] / base["steady"] if base["steady"] else float("nan")
        print(f"{shape:10} {r['first']:12.2f} {r['steady']:13.2f} {r['rollout']:10.2f} {r['workflow']:11.1f}  "
              f"{ratio:.2f}x of {shapes[0]}")  # fmt: skip
    same = len({r["weights"] for r in results.values()}) == 1
    print(f"final weights identical across shapes: {same}")
    if not same:
        sys.exit("the shapes published different weights")


if __name__ == "__main__":
    main()
