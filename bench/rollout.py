"""Rollout throughput: the torch engine against transformers' `generate`, same checkpoint, prompts, batch and
lengths, both measured in this run.

    .venv/bin/python bench/rollout.py [--checkpoint DIR] [--task sort6] [--prompts 256] [--samples 8]
                                      [--new-tokens 8] [--fixed-length] [--repeats 3] [--threads 1] [--quick]

The workload is a rollout of the demo: --prompts prompts of --task x --samples samples each (the GRPO group),
at most --new-tokens new tokens, temperature 1, no top-k/top-p. The task, the group size and the length
default to configs/demo.yaml's (read when the script runs), so that a demo checkpoint answers the prompts it
was trained on. By default a sample ends at <eos>, as in a rollout (transformers stops a row at <eos> too,
and the whole batch once every row has); --fixed-length turns <eos> off in both, so every sample has exactly
--new-tokens tokens. Generated tokens count up to and including <eos>. --checkpoint is an HF-format
checkpoint dir (e.g. `moerl sft-demo --out DIR`, or a version of a demo run); without it, the demo model
architecture with random weights (its samples rarely hit <eos>, so they run long).

Both engines run on --threads torch threads (default 1, as the rollout step). Time: the best of --repeats
interleaved runs after a warm-up, wall clock (tokens/s) and this process's CPU time (less sensitive to other
jobs on a shared machine). Peak memory: each engine once more in a fresh child process (after loading and a
warm-up), its peak resident set during generation above its resident set before (Linux /proc; elsewhere the
child's whole peak).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from steps.data.tasks import Task, get_task  # noqa: E402
from steps.demo.char_tokenizer import EOS_ID, PAD_ID, build_tokenizer, encode_prompt  # noqa: E402
from steps.engines.interface import SamplingParams, sample_requests, sample_seed  # noqa: E402
from steps.engines.torch_engine import TorchEngine  # noqa: E402


def rss_mib(field: str) -> float | None:
    """VmRSS / VmHWM of this process in MiB (Linux), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def timed(fn):
    """(result, wall seconds, CPU seconds of this process)."""
    gc.collect()
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - start, time.process_time() - cpu_start


def peak_mib(fn) -> float:
    """Peak resident set while fn runs, above the resident set before it."""
    gc.collect()
    before = rss_mib("VmRSS")
    if reset_peak() and before is not None:
        fn()
        return (rss_mib("VmHWM") or 0.0) - before
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def demo_checkpoint(directory: Path) -> Path:
    from steps.demo.sft import demo_model_config, write_checkpoint
    from steps.models.qwen3_moe.model import MoeForCausalLM

    torch.manual_seed(0)
    return write_checkpoint(MoeForCausalLM(demo_model_config()), directory)


def demo_workload() -> tuple[Task, int, int]:
    """configs/demo.yaml's task, group size and max new tokens."""
    from pipelines.config import load_config

    cfg = load_config(REPO / "configs" / "demo.yaml", {"sft_checkpoint": "/", "run_store": "/tmp/unused"})
    return get_task(cfg.task.name, **cfg.task.params), cfg.group_size, cfg.sampling.max_new_tokens


def main() -> None:
    task, group_size, max_new_tokens = demo_workload()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="HF-format checkpoint dir (default: demo model, random init)")
    parser.add_argument("--task", help=f"a task of steps.data.tasks (default: the demo's, {task.name})")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=group_size, help="samples per prompt (default: the demo's)")
    parser.add_argument("--new-tokens", type=int, default=max_new_tokens, help="max new tokens (default: the demo's)")
    parser.add_argument("--fixed-length", action="store_true", help="no <eos> stop: exactly --new-tokens each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="32 prompts x 4 samples x 16 tokens, 1 repeat")
    parser.add_argument("--memory-child", choices=["torch engine", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.samples, args.new_tokens, args.repeats = 32, 4, 16, 1
    if args.task:
        task = get_task(args.task)
    args.task = task.name  # the memory child runs the same workload
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, GenerationConfig

    tmp = tempfile.TemporaryDirectory(prefix="moerl-bench-")
    if args.checkpoint is None:
        args.checkpoint = demo_checkpoint(Path(tmp.name) / "demo")
        label = "demo model (random init)"
    else:
        label = str(args.checkpoint)
    engine = TorchEngine.from_checkpoint(args.checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()

    tok = build_tokenizer()
    prompts = task.prompts("train", args.prompts, 0)
    prompt_ids = [(p.prompt_id, encode_prompt(tok, p.text)) for p in prompts]
    stops = () if args.fixed_length else (EOS_ID,)
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_token_ids=stops, n=args.samples)
    requests = sample_requests(prompt_ids, params, lambda pid, k: sample_seed(0, 1, pid, k))

    width = max(len(ids) for _, ids in prompt_ids)
    input_ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (_, ids) in enumerate(prompt_ids):  # left padding, as batched generation needs
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    generation_config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens,
        num_return_sequences=args.samples, eos_token_id=None if args.fixed_length else EOS_ID,
        pad_token_id=PAD_ID, bos_token_id=None,
    )  # fmt: skip

    def ours() -> int:
        return sum(len(g.response_ids) for g in engine.generate(requests, params))

    def theirs() -> int:
        with torch.inference_mode():
            out = hf.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config)
        new = out[:, width:]
        if args.fixed_length:
            return new.numel()
        ended = (new == EOS_ID).long()
        return int(((ended.cumsum(1) - ended) == 0).sum())  # tokens up to and including the first <eos>

    runs = {"torch engine": ours, "transformers": theirs}
    if args.memory_child:  # one engine, fresh process: its peak memory only
        runs[args.memory_child]()  # warm-up
        print(json.dumps({"peak_mib": peak_mib(runs[args.memory_child])}))
        return
    for fn in runs.values():  # warm-up
        fn()
    results: dict[str, list[tuple[int, float, float]]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            results[name].append(timed(fn))
    # Per engine: the fastest run by wall clock, and the lowest CPU time of any run.
    best = {name: (*min(r, key=lambda x: x[1])[:2], min(x[2] for x in r)) for name, r in results.items()}
    peaks = {name: memory_in_child(name, args) for name in runs}

    stop = "exactly that many (no <eos> stop)" if args.fixed_length else "stop at <eos>"
    print(
        f"rollout bench: {args.prompts} {task.name} prompts x {args.samples} samples, max {args.new_tokens} new "
        f"tokens, {stop}, "
        f"{args.threads} thread(s), checkpoint {label}"
    )
    # Other jobs on a shared machine slow both engines, not always alike: keep the load next to the figures.
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'engine':>14}  {'tokens':>8}  {'wall s':>8}  {'tokens/s':>9}  {'CPU s':>7}  {'peak MiB':>9}")
    for name, (tokens, seconds, cpu) in best.items():
        print(f"{name:>14}  {tokens:>8}  {seconds:>8.3f}  {tokens / seconds:>9.0f}  {cpu:>7.3f}  {peaks[name]:>9.1f}")
    (ours_tokens, ours_s, ours_cpu), (hf_tokens, hf_s, hf_cpu) = best["torch engine"], best["transformers"]
    print(
        f"ratio (torch engine / transformers tokens/s): {(ours_tokens / ours_s) / (hf_tokens / hf_s):.2f}x wall clock, "
        f"{(ours_tokens / ours_cpu) / (hf_tokens / hf_cpu):.2f}x per CPU second"
    )
    tmp.cleanup()


def memory_in_child(name: str, args: argparse.Namespace) -> float:
    command = [
        sys.executable, __file__, "--memory-child", name, "--checkpoint", str(args.checkpoint),
        "--prompts", str(args.prompts), "--samples", str(args.samples), "--new-tokens", str(args.new_tokens),
        "--threads", str(args.threads), "--task", args.task, *(["--fixed-length"] if args.fixed_length else []),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mib"]


if __name__ == "__main__":
    main()
