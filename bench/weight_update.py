"""Weight transfers to a live engine: bytes per version (full checkpoint vs delta) and the time to bring a live
torch engine to the next version in place vs opening a new engine on it, in one run.

    .venv/bin/python bench/weight_update.py [--model synthetic|demo] [--versions 3] [--regime eks|demo|both]

The model: `synthetic` (default) is a Qwen3-MoE-shaped checkpoint of 86M parameters (hidden 512, 4 layers of
32 experts, top-4, vocab 32000: 344 MB in fp32, 172 MB in bf16), big enough that transfers dominate fixed
costs; `demo` is the demo's model (steps.demo.sft.demo_model_config, 0.5M parameters).

The versions: each is the previous one after the optimizer steps of one iteration, real torch AdamW on fp32
master weights with synthetic gradients (Gaussian, independent per step), published in fp32 (the masters) and
in bf16 (the masters rounded, as a bf16 run publishes them). Why synthetic gradients: how many bits of a
weight change, which is what a delta's size depends on, is set by AdamW's step size relative to the weight
(|lr * m/sqrt(v)| is about lr per element whatever the gradient's scale), not by the gradient's direction; real
gradients, correlated across steps, move a weight somewhat further than independent ones over a few steps,
and leave rows of the embedding that no token used untouched, so these figures are if anything a little
pessimistic for the delta. Weights start at realistic magnitudes (matrices N(0, 0.02), norms 1). Regimes:
    eks   lr 1e-6, 4 AdamW steps a version, weight decay 0.01 (configs/eks-p5en.yaml)
    demo  lr 1.5e-4, 16 AdamW steps a version, weight decay 0.0 (configs/demo.yaml)

Printed per version: the checkpoint's bytes, the delta's (steps/run/weight_delta.py: XOR, byte planes, zstd) and
for reference the XOR compressed without byte planes, the share of elements whose stored bits changed, and the
time publish spends writing the delta; then the encoder alone on one thread and on this machine's cores (the
update's writers encode on their share of a node's cores). Then, per dtype, on a local run store and a node
cache on local disk: `WeightSync.bring` of a live TorchEngine from v(i-1) to v(i) (delta fetch and apply,
update_weights in place) against the baseline, a new engine: the full checkpoint downloaded (verified) and
TorchEngine.from_checkpoint on it, and whether the two engines then generate bit-identical samples. Local disk
means the fetch times here are copies through the page cache; on S3 the bytes column is what counts.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from steps.engines.interface import SamplingParams, sample_requests, sample_seed  # noqa: E402
from steps.engines.torch_engine import TorchEngine  # noqa: E402
from steps.engines.weight_sync import WeightSync  # noqa: E402
from steps.models.hf_checkpoint import save_pretrained  # noqa: E402
from steps.models.qwen3_moe.config import MoeConfig  # noqa: E402
from steps.models.qwen3_moe.model import MoeForCausalLM  # noqa: E402
from steps.run import checkpoint  # noqa: E402
from steps.run.weight_delta import (  # noqa: E402
    LANES,
    Layout,
    TensorReader,
    _write_blob,
    encode_threads,
    read_layout,
    write_delta,
)
from steps.store.object_store import Store  # noqa: E402

ENCODER_TENSORS, ENCODER_SHAPE = 48, (768, 2048)  # one expert projection a layer of Qwen3-30B-A3B
REGIMES = {"eks": (1e-6, 4, 0.01), "demo": (1.5e-4, 16, 0.0)}  # lr, AdamW steps a version, weight decay
SYNTHETIC = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
    norm_topk_prob=True, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip


def build_model(name: str) -> MoeForCausalLM:
    if name == "demo":
        from steps.demo.sft import demo_model_config

        cfg = demo_model_config()
    else:
        cfg = MoeConfig(**SYNTHETIC)
    torch.manual_seed(0)
    model = MoeForCausalLM(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in pname else torch.randn_like(p) * 0.02)
    return model.eval()


def save(model: MoeForCausalLM, dtype: torch.dtype, directory: Path) -> Path:
    save_pretrained(model if dtype == torch.float32 else copy.deepcopy(model).to(dtype), directory)
    return directory


def xor_only_bytes(new_dir: Path, old_dir: Path) -> tuple[int, float]:
    """The XOR of each tensor compressed without byte planes, and the share of elements whose bits changed."""
    total, changed, elements = 0, 0, 0
    new, old = read_layout(new_dir / "model.safetensors"), read_layout(old_dir / "model.safetensors")
    old_spans = {s.name: s for s in old.tensors}
    with open(new.path, "rb") as fn, open(old.path, "rb") as fo:
        for span in new.tensors:
            o = old_spans[span.name]
            fn.seek(span.start)
            fo.seek(o.start)
            lanes = LANES[span.dtype]
            x = np.frombuffer(fn.read(span.end - span.start), lanes) ^ np.frombuffer(fo.read(o.end - o.start), lanes)
            total += len(pa.compress(x, codec="zstd", asbytes=True))
            changed += int(np.count_nonzero(x))
            elements += x.size
    return total, changed / elements


def make_versions(args: argparse.Namespace, regime: str, root: Path) -> dict[torch.dtype, Store]:
    """Publish v0..v(versions) in fp32 and bf16 into two local run stores, printing bytes per version."""
    lr, steps, weight_decay = REGIMES[regime]
    master = build_model(args.model)
    params = list(master.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(1)
    stores: dict[torch.dtype, Store] = {}
    dirs: dict[torch.dtype, list[Path]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        stores[dtype] = Store.open((root / f"run-{regime}-{dtype_name(dtype)}").as_uri())
        dirs[dtype] = [save(master, dtype, root / f"{regime}-{dtype_name(dtype)}-v0")]
        checkpoint.publish_dir(stores[dtype], dirs[dtype][0], 0, parent=None, iteration=0)
    numel = sum(p.numel() for p in params)
    print(
        f"\n{args.model} model, {numel / 1e6:.1f}M parameters; regime {regime}: lr {lr:g}, {steps} AdamW steps a "
        f"version, weight decay {weight_decay:g}"
    )
    print(
        f"{'dtype':>5} {'version':>8} {'full (MB)':>10} {'delta (MB)':>11} {'delta/full':>11} "
        f"{'xor+zstd only':>14} {'changed':>8} {'delta write (s)':>16}"
    )
    for version in range(1, args.versions + 1):
        for _ in range(steps):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * 1e-3
            optimizer.step()
        for dtype in (torch.float32, torch.bfloat16):
            new_dir = save(master, dtype, root / f"{regime}-{dtype_name(dtype)}-v{version}")
            started = time.perf_counter()
            summary = write_delta(stores[dtype], version, new_dir, parent_dir=dirs[dtype][-1])
            written = time.perf_counter() - started
            checkpoint.publish_dir(stores[dtype], new_dir, version, parent=version - 1, iteration=version)
            plain, changed = xor_only_bytes(new_dir, dirs[dtype][-1])
            dirs[dtype].append(new_dir)
            print(
                f"{dtype_name(dtype):>5} {f'v{version:06d}':>8} {summary.full_bytes / 1e6:10.1f} "
                f"{summary.delta_bytes / 1e6:11.1f} {summary.delta_bytes / summary.full_bytes:11.1%} "
                f"{plain / summary.full_bytes:14.1%} {changed:8.1%} {written:16.2f}"
            )
    time_encoder(root, regime)
    return stores


def time_encoder(root: Path, regime: str) -> None:
    """The delta encoder (weight_delta._write_blob, the parent's tensors from disk, the file's digest given as the
    update gives it) on one thread and on every thread this machine gives a process (encode_threads): GB/s and the
    speed-up, best of 3. The file holds ENCODER_TENSORS expert projections of Qwen3-30B-A3B's shape (bf16), moved
    by the regime's AdamW steps: the tensor sizes a writer of a real checkpoint encodes (the synthetic model's
    are far smaller, and per-tensor overheads would decide)."""
    lr, steps, weight_decay = REGIMES[regime]
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(*ENCODER_SHAPE, generator=gen) * 0.02) for _ in range(ENCODER_TENSORS)]
    before = {f"expert.{i}": p.detach().to(torch.bfloat16) for i, p in enumerate(params)}
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
        optimizer.step()
    after = {f"expert.{i}": p.detach().to(torch.bfloat16) for i, p in enumerate(params)}
    parent_dir, weights = root / "encoder-parent", root / "encoder-new.safetensors"
    parent_dir.mkdir()
    save_file(before, str(parent_dir / "model.safetensors"))
    save_file(after, str(weights))
    del params, optimizer, before, after
    layout, size, sha = read_layout(weights), weights.stat().st_size, checkpoint.file_digest(weights)[1]
    counts = sorted({1, encode_threads()})
    rates = {}
    with TensorReader(parent_dir) as parent:
        for threads in counts:
            best = min(_timed(layout, parent, root / "blob", sha, threads) for _ in range(3))
            rates[threads] = size / best / 1e9
    line = ", ".join(f"{t} thread(s) {rates[t]:.2f} GB/s" for t in counts)
    print(
        f"delta encoder, {ENCODER_TENSORS} bf16 tensors of {ENCODER_SHAPE[0]}x{ENCODER_SHAPE[1]} ({size / 1e6:.0f} MB, "
        f"regime {regime}): {line}; {rates[counts[-1]] / rates[1]:.2f}x on {counts[-1]} threads"
    )


def _timed(layout: Layout, parent: TensorReader, out: Path, sha: str, threads: int) -> float:
    started = time.perf_counter()
    _write_blob(layout, parent, out, sha, threads=threads)
    return time.perf_counter() - started


def dtype_name(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16"


def same_generations(a: TorchEngine, b: TorchEngine) -> bool:
    params = SamplingParams(n=2, max_new_tokens=6, temperature=1.0)
    prompts = [("p0", [1, 5, 9, 13]), ("p1", [1, 7, 3])]
    requests = sample_requests(prompts, params, lambda pid, k: sample_seed(0, 1, pid, k))
    return a.generate(requests, params) == b.generate(requests, params)


def time_engines(args: argparse.Namespace, stores: dict[torch.dtype, Store], root: Path) -> None:
    print(
        f"\n{'dtype':>5} {'version':>8} {'path':>6} {'fetched (MB)':>13} {'bring (s)':>10} {'update (s)':>11} "
        f"{'new: fetch (s)':>15} {'open (s)':>9} {'new/bring':>10} {'identical':>10}"
    )
    for dtype, run in stores.items():
        sync = WeightSync(run, root / f"cache-{dtype_name(dtype)}")
        sync.materialize(0)
        live = TorchEngine.from_checkpoint(sync.version_dir(0))
        for version in range(1, args.versions + 1):
            result = sync.bring(live, version - 1, version)
            started = time.perf_counter()
            full_dir = checkpoint.download(run, version, root / f"full-{dtype_name(dtype)}-v{version}")
            fetched = time.perf_counter()
            fresh = TorchEngine.from_checkpoint(full_dir)
            opened = time.perf_counter()
            identical = same_generations(live, fresh)
            baseline = opened - started
            print(
                f"{dtype_name(dtype):>5} {f'v{version:06d}':>8} {result.path:>6} {result.bytes_fetched / 1e6:13.1f} "
                f"{result.seconds:10.2f} {result.update_seconds:11.2f} {fetched - started:15.2f} "
                f"{opened - fetched:9.2f} {baseline / result.seconds:9.1f}x {'yes' if identical else 'NO':>10}"
            )
            del fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="synthetic", choices=["synthetic", "demo"])
    parser.add_argument("--versions", type=int, default=3, help="versions after v000000")
    parser.add_argument("--regime", default="both", choices=["eks", "demo", "both"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    regimes = list(REGIMES) if args.regime == "both" else [args.regime]
    with tempfile.TemporaryDirectory(prefix="moerl-bench-weights-") as tmp:
        for regime in regimes:
            root = Path(tmp) / regime
            root.mkdir()
            stores = make_versions(args, regime, root)
            time_engines(args, stores, root)


if __name__ == "__main__":
    main()
