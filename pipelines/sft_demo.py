"""`moerl sft-demo --out URI`: train the small demo MoE on a toy task and write it as an HF checkpoint."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from steps.data.tasks import get_task
from steps.demo.sft import DEMO_ARCHS, SftSettings, train_sft, write_checkpoint, write_tokenizer
from steps.models.checkpoint_validation import validate_checkpoint_dir
from steps.models.moe import count_parameters
from steps.scoring.evaluation import evaluate_accuracy
from steps.store.object_store import Store

DEMO_ARCH_NAMES = sorted(DEMO_ARCHS)


def progress_printer(total: int, start: float) -> Callable[[int, float], None]:
    """One line per tenth of training (a live bar on a terminal would be lost in CI logs)."""
    every = max(total // 10, 1)

    def report(step: int, loss: float) -> None:
        if step % every == 0 or step == total:
            print(f"  sft step {step:>4}/{total}  loss {loss:.3f}  {time.monotonic() - start:5.1f}s", flush=True)

    return report


def check_printer(settings: SftSettings, start: float) -> Callable[[int, float], None]:
    def report(step: int, accuracy: float) -> None:
        stop = "" if accuracy < (settings.stop_at_accuracy or 0) else f"  >= {settings.stop_at_accuracy:.0%}: stop"
        print(f"  sft step {step:>4}  train-prompt accuracy {accuracy:.1%}{stop}  {time.monotonic() - start:5.1f}s",
              flush=True)  # fmt: skip

    return report


DEMO_EVAL_MAX_NEW_TOKENS = 48  # a tool task's turn: the calculator call in the Qwen format


def sft_demo(out_uri: str, settings: SftSettings) -> float:
    """Train, evaluate on the held-out split, write the checkpoint to out_uri; return held-out accuracy."""
    out = Store.open(out_uri)
    out.check_access()
    task = get_task(settings.task)
    start = time.monotonic()
    print(f"sft-demo: {settings.arch}, task {task.name}, {settings.tokenizer} tokenizer, {settings.prompt_format} "
          f"prompts, {settings.steps} steps of {settings.batch_size}, seed {settings.seed}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="moerl-sft-") as tmp:
        tok = write_tokenizer(settings, Path(tmp))
        model = train_sft(settings, tok, progress_printer(settings.steps, start), check_printer(settings, start))
        total, active = count_parameters(model)
        heldout = task.prompts("heldout", settings.eval_prompts, settings.seed)
        turn_tokens = DEMO_EVAL_MAX_NEW_TOKENS if settings.environment else 16
        accuracy = evaluate_accuracy(model, tok, heldout, task, settings.format, max_new_tokens=turn_tokens,
                                     environment=settings.environment)  # fmt: skip
        local = write_checkpoint(model, Path(tmp))
        validate_checkpoint_dir(local)
        # config.json goes last: a reader that finds it finds every other file complete.
        names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        for name in sorted(names, key=lambda n: n == "config.json"):
            out.put_file(name, local / name)
    print(
        f"sft-demo: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token), "
        f"{time.monotonic() - start:.0f}s; held-out exact match {accuracy:.1%} "
        f"on {settings.eval_prompts} {task.name} prompts; wrote {out.uri}"
    )
    return accuracy


def run(args: argparse.Namespace) -> int:
    settings = SftSettings(task=args.task, seed=args.seed, steps=args.steps, tokenizer=args.tokenizer,
                           prompt_format=args.prompt_format, system_prompt=args.system_prompt,
                           arch=args.arch)  # fmt: skip
    sft_demo(args.out, settings)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = SftSettings()
    parser = subparsers.add_parser("sft-demo", help=__doc__.split(":")[1].strip(), description=__doc__)
    parser.add_argument("--out", required=True, help="where to write the checkpoint (path, file:// or s3:// URI)")
    parser.add_argument("--task", default=defaults.task, help=f"toy task (default {defaults.task})")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of data order and init")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--tokenizer", choices=("char", "bpe"), default=defaults.tokenizer,
                        help="the checkpoint's tokenizer: the demo's characters, or a BPE trained on the task's text "
                        "with a chat template")  # fmt: skip
    parser.add_argument("--prompt-format", choices=("raw", "chat"), default=defaults.prompt_format,
                        help="how SFT (and the RL run after it) formats prompts")  # fmt: skip
    parser.add_argument("--system-prompt", help="chat prompts: a system message before each prompt")
    parser.add_argument("--arch", choices=DEMO_ARCH_NAMES, default=defaults.arch,
                        help=f"the model family the demo's model is built as (default {defaults.arch}; deepseek_v3: "
                        "multi-head latent attention, sigmoid routing with group-limited top-k, a shared "
                        "expert)")  # fmt: skip
    parser.set_defaults(func=run)


