"""Profile of one demo iteration: where each step's wall time goes.

    .venv/bin/python bench/profile_demo.py --sft DIR          # DIR: an existing demo SFT checkpoint
    .venv/bin/python bench/profile_demo.py                    # builds the SFT checkpoint first (minutes)
    .venv/bin/python bench/profile_demo.py --analyze DIR/profile   # re-read a profile already taken

It runs the real thing, `moerl demo --workdir W --iterations N`, with this file loaded into every Python
process of the run (the `moerl` executor, each step, torchrun's agent and its workers) through a
`sitecustomize` on PYTHONPATH that does nothing unless $MOERL_PROFILE_DIR is set. In each process a
sampling thread reads the main thread's stack every --interval seconds and files the time since the last
sample under one category, by the frames on the stack (first match wins):

    imports      an `import` is running (importlib's _find_and_load); the module being loaded is noted
    store I/O    steps/store/ (the Store and its backends) or steps/run/checkpoint.py: reading, writing, hashing
                 run-store objects
    dist init    torch.distributed process-group set-up and tear-down
    model load   building the model, reading and checking safetensors, the tokenizer, optimizer state
    held-out eval  score's greedy held-out accuracy (generation on the held-out prompts)
    work         the rest of the step's own code: generation, scoring, training, publication, ...

and wraps subprocess.Popen to record when each child was spawned and when its parent saw it exit. From
these the step's wall time (spawn to exit seen by the executor) splits exactly into: interpreter start-up
(spawn to sitecustomize), the sampled categories, torchrun's elastic agent (all it does before spawning
the workers and after they exit: its own start-up, its torch import, rendezvous, teardown; rank 0 stands
for the workers), and shutdown (the last sample to the exit the parent saw: interpreter teardown plus the
parent's poll interval). The gap before a step is the executor's time between the previous pod's exit
and this pod's spawn.

Each sample also charges the main thread's CPU time (pthread CPU clock) to its category: on a machine shared
with other jobs wall times grow with the load, CPU seconds much less. `--freeze-at-exit` is an experiment:
every process calls gc.freeze() at exit, to measure what that saves in interpreter teardown.

Prints the tables and writes bench/profile_demo.png (a stacked bar per step) when matplotlib is installed.
The sampler wakes 200 times a second and walks one stack: cheap next to torch work but not free; compare
the wall column with a plain `moerl demo` when in doubt.
"""

from __future__ import annotations

# Only the standard library at the top: this file is loaded into every process of the profiled run.
import atexit
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

PROFILE_ENV = "MOERL_PROFILE_DIR"
INTERVAL_ENV = "MOERL_PROFILE_INTERVAL"
FREEZE_ENV = "MOERL_PROFILE_FREEZE_AT_EXIT"  # the experiment behind --freeze-at-exit
REPO = Path(__file__).resolve().parents[1]

CATEGORIES = (
    "start-up",
    "imports",
    "torchrun agent",
    "dist init",
    "model load",
    "store I/O",
    "held-out eval",
    "work",
    "shutdown",
)
WORK = {
    "rollout": "generation",
    "score": "scoring",
    "update": "training",
    "publish": "publication",
    "import_sft": "import",
    "plan": "plan",
    "report": "report",
}
STORE_FILES = ("/steps/store/object_store.py", "/steps/store/local.py", "/steps/store/s3.py",
               "/steps/run/checkpoint.py")  # fmt: skip
MODEL_FILES = ("/steps/models/qwen3_moe/model.py", "/steps/models/moe.py", "/steps/models/layers.py")
MODEL_LOAD_FUNCTIONS = {
    "load_pretrained",
    "load_state_dict_from_dir",
    "from_checkpoint",
    "check_checkpoint",
    "validate_checkpoint_dir",
    "tensor_index",
    "check_finite",
    "read_optimizer_state",
    "load_tokenizer",
    "version_tokenizer",
}
DIST_FUNCTIONS = {"init_distributed", "init_process_group", "destroy_process_group"}


# ---------------------------------------------------------------------------------------------------
# The hook: runs inside every profiled process.


def classify(frame) -> tuple[str, str | None]:  # noqa: ANN001 - a frame object
    """(category, detail) of one stack, innermost frame given; detail is the module an import loads."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first
    imported = [f for f in frames if f.f_code.co_name == "_find_and_load" and "importlib" in f.f_code.co_filename]
    if imported:
        names = [str(f.f_locals.get("name", "?")) for f in imported]
        third_party = [n for n in names if n.split(".")[0] not in ("steps", "pipelines")]
        return "imports", (third_party[0].split(".")[0] if third_party else names[-1])
    files = [f.f_code.co_filename for f in frames]
    functions = [f.f_code.co_name for f in frames]
    if any(name.endswith(STORE_FILES) for name in files):
        return "store I/O", None
    if DIST_FUNCTIONS.intersection(functions):
        return "dist init", None
    if MODEL_LOAD_FUNCTIONS.intersection(functions) or any(
        f.f_code.co_name == "__init__" and f.f_code.co_filename.endswith(MODEL_FILES)
        for f in frames
    ):
        return "model load", None
    if "evaluate_accuracy" in functions:
        return "held-out eval", None
    return "work", None


class Sampler:
    """Samples the main thread's stack and keeps a timeline of (start, end, category) segments."""

    def __init__(self, out_dir: Path, interval: float):
        self.out_dir = out_dir
        self.interval = interval
        self.hook_time = time.time()
        self.segments: list[list] = []  # [start, end, category]
        self.imports: dict[str, float] = {}
        self.main_id = threading.main_thread().ident
        # The main thread's CPU seconds by category: on a shared machine they do not grow with the load.
        self.cpu: dict[str, float] = {}
        self.cpu_clock = time.pthread_getcpuclockid(self.main_id)
        self.last_cpu = time.clock_gettime(self.cpu_clock)
        self.children: dict[int, dict] = {}
        self.last = self.hook_time
        self.stopped = False
        self.lock = threading.Lock()

    def sample(self) -> None:
        frame = sys._current_frames().get(self.main_id)
        now = time.time()
        category, detail = classify(frame) if frame is not None else ("work", None)
        cpu = time.clock_gettime(self.cpu_clock)
        with self.lock:
            self.cpu[category] = self.cpu.get(category, 0.0) + cpu - self.last_cpu
            self.last_cpu = cpu
            if self.segments and self.segments[-1][2] == category:
                self.segments[-1][1] = now
            else:
                self.segments.append([self.last, now, category])
            if detail:
                self.imports[detail] = self.imports.get(detail, 0.0) + now - self.last
            self.last = now

    def run(self) -> None:
        while not self.stopped:
            time.sleep(self.interval)
            if not self.stopped:
                self.sample()

    def write(self) -> None:
        self.sample()
        self.stopped = True
        record = {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "argv": list(getattr(sys, "orig_argv", sys.argv)),
            "sandbox": os.environ.get("MOERL_LOCAL_SANDBOX"),
            "rank": os.environ.get("RANK"),
            "created": process_created(),
            "hook": self.hook_time,
            "exit": self.last,
            "cpu": sum(os.times()[:2]),  # user + system seconds, teardown excluded
            "interval": self.interval,
            "segments": self.segments,
            "imports": self.imports,
            "cpu_by_category": self.cpu,
            "children": list(self.children.values()),
        }
        path = self.out_dir / f"{os.getpid()}.json"
        path.write_text(json.dumps(record))


def process_created() -> float:
    """This process's start time (the kernel's, 10 ms resolution), as a time.time() value."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return float("nan")


def watch_children(sampler: Sampler) -> None:
    """Record each subprocess.Popen child's spawn time and the time this process first saw it exit."""
    popen_init, popen_poll, popen_wait = subprocess.Popen.__init__, subprocess.Popen.poll, subprocess.Popen.wait

    def seen_exit(popen: subprocess.Popen) -> None:
        child = sampler.children.get(popen.pid)
        if child is not None and popen.returncode is not None and child["exit_seen"] is None:
            child["exit_seen"] = time.time()
            child["returncode"] = popen.returncode

    def init(self, args, *rest, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        spawn = time.time()
        popen_init(self, args, *rest, **kwargs)
        argv = [str(a) for a in args] if isinstance(args, list | tuple) else [str(args)]
        sampler.children[self.pid] = {"pid": self.pid, "argv": argv, "spawn": spawn, "exit_seen": None}

    def poll(self):  # noqa: ANN001, ANN202
        code = popen_poll(self)
        seen_exit(self)
        return code

    def wait(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        code = popen_wait(self, *args, **kwargs)
        seen_exit(self)
        return code

    subprocess.Popen.__init__ = init
    subprocess.Popen.poll = poll
    subprocess.Popen.wait = wait


def install() -> None:
    """Start profiling this process if $MOERL_PROFILE_DIR is set (called from the sitecustomize)."""
    out = os.environ.get(PROFILE_ENV)
    if not out:
        return
    sampler = Sampler(Path(out), float(os.environ.get(INTERVAL_ENV, "0.005")))
    watch_children(sampler)
    threading.Thread(target=sampler.run, name="moerl-profile", daemon=True).start()
    atexit.register(sampler.write)
    if os.environ.get(FREEZE_ENV):
        import gc

        atexit.register(gc.freeze)  # runs before sampler.write: atexit calls the last registered first


SITECUSTOMIZE = f"""\
# Written by bench/profile_demo.py: loads its sampling hook into every Python process of the run.
import importlib.util as _util
import os as _os
if _os.environ.get({PROFILE_ENV!r}):
    _spec = _util.spec_from_file_location("moerl_profile_hook", {str(Path(__file__).resolve())!r})
    _hook = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_hook)
    _hook.install()
"""


# ---------------------------------------------------------------------------------------------------
# The run and its analysis.


def run_demo(
    workdir: Path, sft: Path | None, iterations: int, interval: float, freeze: bool = False
) -> tuple[Path, float]:
    """Run `moerl demo` once under the hook in a fresh subdirectory; returns (profile dir, wall seconds)."""
    run_dir = workdir / time.strftime("%Y%m%d-%H%M%S")
    profile_dir, hook_dir = run_dir / "profile", run_dir / "hook"
    profile_dir.mkdir(parents=True)
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)
    if sft is not None:
        (run_dir / "sft-demo").symlink_to(sft.resolve())
    env = dict(os.environ)
    # REPO first: the tree this script lives in is the one profiled, whatever the venv's editable install says.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), str(REPO), env.get("PYTHONPATH")) if p)
    env[PROFILE_ENV] = str(profile_dir)
    env[INTERVAL_ENV] = str(interval)
    if freeze:
        env[FREEZE_ENV] = "1"
    # Every step a new interpreter, as a pod in the cluster is: the sampler starts with each process, and the
    # local executor's warm starts (forks of one Python with torch imported) would hide the imports measured here.
    env["MOERL_LOCAL_WARM"] = "0"
    moerl = Path(sys.executable).parent / "moerl"
    command = [str(moerl), "demo", "--workdir", str(run_dir), "--iterations", str(iterations)]
    print("running:", " ".join(command), f"({PROFILE_ENV}={profile_dir})", flush=True)
    start = time.time()
    with open(run_dir / "demo.log", "wb") as log:
        code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    seconds = time.time() - start
    if code != 0:
        sys.exit(f"moerl demo failed (exit {code}); see {run_dir / 'demo.log'}")
    return profile_dir, seconds


def load_records(profile_dir: Path) -> dict[int, dict]:
    return {r["pid"]: r for r in (json.loads(p.read_text()) for p in sorted(profile_dir.glob("*.json")))}


def step_label(argv: list[str]) -> tuple[str, str] | None:
    """(label, step module) of a pod's command, e.g. ("rollout-1/0", "rollout"); None if not a step."""
    if "-m" not in argv:
        return None
    modules = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m" and argv[i + 1].startswith("steps.")]
    if not modules:
        return None
    module = modules[0].removeprefix("steps.")
    label = module.replace("_", "-")
    if "--iteration" in argv:
        label += "-" + argv[argv.index("--iteration") + 1]
    if "--shard" in argv:
        label += "/" + argv[argv.index("--shard") + 1]
    return label, module


def in_window(segments: list[list], start: float, end: float) -> dict[str, float]:
    """Seconds per category of the segments, clipped to [start, end]."""
    seconds: dict[str, float] = {}
    for seg_start, seg_end, category in segments:
        overlap = min(seg_end, end) - max(seg_start, start)
        if overlap > 0:
            seconds[category] = seconds.get(category, 0.0) + overlap
    return seconds


def add(total: dict[str, float], more: dict[str, float], rename: dict[str, str] | None = None) -> None:
    for category, seconds in more.items():
        category = (rename or {}).get(category, category)
        total[category] = total.get(category, 0.0) + seconds


def breakdown(pod: dict, records: dict[int, dict]) -> dict[str, float]:
    """Seconds per category of one pod, from its spawn to the exit the executor saw (they sum to its wall)."""
    main = records.get(pod["pid"])
    parts: dict[str, float] = {}
    if main is None:  # not a Python process, or it did not exit through atexit
        return {"work": pod["exit_seen"] - pod["spawn"]}
    parts["start-up"] = main["hook"] - pod["spawn"]
    workers = [c for c in main["children"] if c["pid"] in records and step_label(records[c["pid"]]["argv"])]
    if not workers:
        add(parts, in_window(main["segments"], main["hook"], main["exit"]))
        parts["shutdown"] = pod["exit_seen"] - main["exit"]
        return parts
    # torchrun: everything the elastic agent does around rank 0's lifetime (its own start-up, its torch
    # import, rendezvous, spawning, monitoring and teardown) is the agent's; rank 0 stands for the workers.
    worker = next((c for c in workers if records[c["pid"]]["rank"] == "0"), workers[0])
    rank0 = records[worker["pid"]]
    agent = worker["spawn"] - pod["spawn"] + pod["exit_seen"] - worker["exit_seen"]
    parts = {"torchrun agent": agent, "start-up": rank0["hook"] - worker["spawn"]}
    add(parts, in_window(rank0["segments"], rank0["hook"], rank0["exit"]))
    parts["shutdown"] = worker["exit_seen"] - rank0["exit"]
    return parts


def cpu_breakdown(pod: dict, records: dict[int, dict]) -> dict[str, float]:
    """Main-thread CPU seconds by category of the pod's process (torchrun: rank 0's, plus all of the agent's)."""
    main = records.get(pod["pid"])
    if main is None or "cpu_by_category" not in main:
        return {}
    ranks = [records[c["pid"]] for c in main["children"] if c["pid"] in records and records[c["pid"]]["rank"]]
    rank0 = next((r for r in ranks if r["rank"] == "0"), None)
    if rank0 is None:
        return dict(main["cpu_by_category"])
    return {**rank0["cpu_by_category"], "torchrun agent": sum(main["cpu_by_category"].values())}


def pod_pids(pod: dict, records: dict[int, dict]) -> list[int]:
    """The profiled processes of a pod: its main process and its children (torchrun's workers)."""
    main = records.get(pod["pid"])
    if main is None:
        return []
    return [pod["pid"]] + [c["pid"] for c in main["children"] if c["pid"] in records]


def pod_imports(pod: dict, records: dict[int, dict]) -> dict[str, float]:
    """Import seconds by module of the pod's process (under torchrun: of its rank-0 worker)."""
    found: dict[str, float] = {}
    main = records.get(pod["pid"])
    if main is None:
        return found
    ranks = [records[c["pid"]] for c in main["children"] if c["pid"] in records and records[c["pid"]]["rank"]]
    add(found, next((r["imports"] for r in ranks if r["rank"] == "0"), main["imports"]))
    return found


def analyze(profile_dir: Path) -> dict:
    """Rows per pod (in spawn order), the executor's gaps, and the run's totals."""
    records = load_records(profile_dir)
    executor = next((r for r in records.values() if any(a.endswith("/moerl") for a in r["argv"][:2])), None)
    if executor is None:
        sys.exit(f"{profile_dir}: no record of the moerl process; was the run profiled?")
    pods = sorted((c for c in executor["children"] if c["exit_seen"] is not None), key=lambda c: c["spawn"])
    rows = []
    for pod in pods:
        main = records.get(pod["pid"], {})
        argv = main.get("argv") or pod["argv"]
        labelled = step_label(argv) or step_label(
            next((records[c["pid"]]["argv"] for c in main.get("children", []) if c["pid"] in records), [])
        )
        if labelled is None:
            continue
        label, module = labelled
        ended_before = [p["exit_seen"] for p in pods if p["exit_seen"] <= pod["spawn"]]
        gap = pod["spawn"] - (max(ended_before) if ended_before else executor["hook"])
        rows.append(
            {
                "step": label,
                "module": module,
                "wall": pod["exit_seen"] - pod["spawn"],
                "gap": gap,
                "parts": breakdown(pod, records),
                "imports": pod_imports(pod, records),
                "cpu_parts": cpu_breakdown(pod, records),
                "cpu": sum(records[pid].get("cpu", float("nan")) for pid in pod_pids(pod, records)),
            }
        )
    first, last = pods[0]["spawn"], max(p["exit_seen"] for p in pods)
    return {
        "rows": rows,
        "workflow": last - first,
        "before_first_pod": first - executor["created"],
        "after_last_pod": executor["exit"] - last,
        "executor_imports": executor["imports"],
        "executor_parts": in_window(executor["segments"], executor["hook"], first),
        "executor_startup": executor["hook"] - executor["created"],
    }


def critical_path(rows: list[dict]) -> list[dict]:
    """The RL iterations' steps in order, with the slowest rollout shard standing for its iteration's."""
    path = []
    for row in rows:
        if row["module"] not in ("rollout", "score", "update", "publish"):
            continue
        iteration = row["step"].split("-")[1].split("/")[0]
        same = [r for r in path if r["module"] == row["module"] and r["step"].split("-")[1].startswith(iteration)]
        if not same:
            path.append(row)
        elif row["wall"] > same[0]["wall"]:
            path[path.index(same[0])] = row
    return path


def print_table(result: dict) -> None:
    rows = result["rows"]
    columns = [c for c in CATEGORIES if any(r["parts"].get(c, 0.0) > 0.005 for r in rows)]
    header = f"{'step':<12}{'wall':>7}{'cpu':>7}{'gap':>6}" + "".join(f"{c:>{max(len(c) + 2, 8)}}" for c in columns)
    print(header)
    totals: dict[str, float] = {}
    for row in rows:
        add(totals, row["parts"])
        cells = "".join(f"{row['parts'].get(c, 0.0):>{max(len(c) + 2, 8)}.2f}" for c in columns)
        print(f"{row['step']:<12}{row['wall']:>7.2f}{row['cpu']:>7.2f}{row['gap']:>6.2f}{cells}")
    wall = sum(r["wall"] for r in rows)
    gaps = sum(r["gap"] for r in rows)
    cells = "".join(f"{totals.get(c, 0.0):>{max(len(c) + 2, 8)}.2f}" for c in columns)
    cpu = sum(r["cpu"] for r in rows)
    print(f"{'sum':<12}{wall:>7.2f}{cpu:>7.2f}{gaps:>6.2f}{cells}")
    print(f"{'share':<12}{'':>20}" + "".join(f"{totals.get(c, 0.0) / wall:>{max(len(c) + 2, 8)}.0%}" for c in columns))
    if any(r["cpu_parts"] for r in rows):
        # Start-up and shutdown happen outside the sampled window: only their wall time is known.
        inside = [c for c in columns if c not in ("start-up", "shutdown")]
        print("\nmain-thread CPU seconds by category (what the same work costs on an idle machine, roughly):")
        print(f"{'step':<12}{'':>20}" + "".join(f"{c:>{max(len(c) + 2, 8)}}" for c in inside))
        cpu_totals: dict[str, float] = {}
        for row in rows:
            add(cpu_totals, row["cpu_parts"])
            cells = "".join(f"{row['cpu_parts'].get(c, 0.0):>{max(len(c) + 2, 8)}.2f}" for c in inside)
            print(f"{row['step']:<12}{'':>20}{cells}")
        cells = "".join(f"{cpu_totals.get(c, 0.0):>{max(len(c) + 2, 8)}.2f}" for c in inside)
        print(f"{'sum':<12}{'':>20}{cells}")
    print("work = " + ", ".join(f"{m.replace('_', '-')}: {w}" for m, w in WORK.items()))
    path = critical_path(rows)
    if path:
        parts: dict[str, float] = {}
        for row in path:
            add(parts, row["parts"])
        seconds = sum(r["wall"] + r["gap"] for r in path)
        shares = ", ".join(f"{c} {parts[c]:.1f} s" for c in sorted(parts, key=lambda c: -parts[c]) if parts[c] >= 0.05)
        print(
            f"\niteration critical path ({' + '.join(r['step'] for r in path)}): {seconds:.2f} s, "
            f"executor gaps {sum(r['gap'] for r in path):.2f} s; {shares}"
        )
    print(
        f"\nworkflow (first spawn to last exit): {result['workflow']:.2f} s; moerl before the first pod: "
        f"{result['before_first_pod']:.2f} s (interpreter {result['executor_startup']:.2f} s, imports "
        f"{result['executor_parts'].get('imports', 0.0):.2f} s, render and set-up "
        f"{result['executor_parts'].get('work', 0.0):.2f} s); after the last pod: {result['after_last_pod']:.2f} s"
    )
    print("\nimports by module (s), per step:")
    for row in rows:
        top = sorted(row["imports"].items(), key=lambda kv: -kv[1])[:5]
        print(f"  {row['step']:<12}" + ", ".join(f"{name} {s:.2f}" for name, s in top if s >= 0.01))
    top = sorted(result["executor_imports"].items(), key=lambda kv: -kv[1])[:5]
    print(f"  {'moerl':<12}" + ", ".join(f"{name} {s:.2f}" for name, s in top if s >= 0.01))


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"][::-1]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    for category in ("gap", *CATEGORIES):
        widths = [r["gap"] if category == "gap" else r["parts"].get(category, 0.0) for r in rows]
        if not any(w > 0.005 for w in widths):
            continue
        label = "executor gap before" if category == "gap" else category
        ax.barh([r["step"] for r in rows], widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds")
    ax.set_title("one demo iteration: where each step's wall time goes")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/moerl-profile"), help="runs go in subdirs")
    parser.add_argument("--sft", type=Path, help="an existing demo SFT checkpoint dir (else moerl demo builds one)")
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.005, help="sampling interval, seconds")
    parser.add_argument(
        "--freeze-at-exit",
        action="store_true",
        help="experiment: gc.freeze() in every process at exit, to measure what it saves in interpreter teardown",
    )
    parser.add_argument("--analyze", type=Path, help="only analyze this profile dir (from an earlier run)")
    parser.add_argument("--plot", type=Path, default=REPO / "bench" / "profile_demo.png")
    parser.add_argument("--json", type=Path, help="also write the analysis here")
    args = parser.parse_args()
    if args.analyze:
        profile_dir = args.analyze
    else:
        profile_dir, seconds = run_demo(args.workdir, args.sft, args.iterations, args.interval, args.freeze_at_exit)
        print(f"moerl demo --iterations {args.iterations}: {seconds:.1f} s wall, profile in {profile_dir}\n")
    result = analyze(profile_dir)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if plot(result, args.plot):
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
