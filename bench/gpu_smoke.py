"""GPU smoke check on one CUDA GPU (an H200 in mind), in one call of at most ~10 minutes:

    engine   the torch engine on CUDA, fp32 and bf16: behaviour log-probs against transformers on the same
             sampled tokens (tolerances below), tokens/s against transformers' `generate` (same checkpoint,
             prompts, samples and lengths)
    trainer  one PolicyTrainer step (PPO loss, clipping, AdamW) on CUDA against the same step on CPU: in fp32
             (TF32 off) the weights after the step agree to TRAINER_FP32_ATOL; under bf16 autocast the step's
             weight change agrees to TRAINER_BF16_RTOL (relative to the CPU step's change)
    deepep   DeepEP's ElasticBuffer on one rank (a 1-rank NCCL group) through moerl's DeepEPDispatch, against
             the local dispatcher: MoE block output and every gradient, forward and backward; then a second,
             bigger buffer made in the same process after the first is dropped, as a trainer that stays up
             does when a batch outgrows its buffer (steps/expert_parallel/dispatch.py HeldDispatch). DeepEP
             comes from an installed deep_ep, or is built here from a checkout at images/versions.env's
             DEEPEP_COMMIT in the ignored folder .gpu/ (`pip install --no-build-isolation --no-deps --target`;
             no registry)
    sharded  the trainer's memory settings on CUDA: one PolicyTrainer step with trainer.fsdp (FSDP2 over a
             1-rank NCCL world: its gathers, reduce-scatters and DTensor AdamW) and activation checkpointing,
             against the plain step (weights to TRAINER_FP32_ATOL, TF32 off); and the experts as one grouped
             GEMM in bf16 (torch.nn.functional.grouped_mm's CUDA kernel) against expert by expert, forward
             and backward, to GROUPED_BF16_RTOL. The same function runs on the CPU in the tests
    weights  a rollout server's in-place version change on CUDA: the torch engine opened on v0 and brought
             to v1 with update_weights generates, fp32 and bf16, exactly what an engine opened on v1 does;
             the seconds of the update against opening the new engine

    python bench/gpu_smoke.py [--only engine,trainer,deepep,sharded,weights] [--prompts 256] [--samples 8]
                              [--new-tokens 32] [--deepep-src .gpu/DeepEP] [--out FILE]

Every section prints one JSON line (with "ok" when it has a pass/fail, "skipped" with the reason otherwise);
the last line is a summary. Exit 0 when no section failed (skips are not failures), 1 otherwise. Without
CUDA every section is skipped with the reason. Figures go to bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(REPO))

SECTIONS = ("engine", "trainer", "deepep", "sharded", "weights")
GPU_DIR = REPO / ".gpu"  # ignored by git: DeepEP's checkout and what is built from it
DEFAULT_DEEPEP_SRC = GPU_DIR / "DeepEP"
DEEPEP_SITE = GPU_DIR / "deepep-site"
# Tolerances, stated once: fp32 against fp32 differs by reduction order only; bf16 keeps 8 mantissa bits.
LOGPROB_FP32_ATOL = 1e-4
LOGPROB_BF16_ATOL = 0.1
TRAINER_FP32_ATOL = 1e-5
TRAINER_BF16_RTOL = 0.1
DEEPEP_ATOL, DEEPEP_RTOL = 3e-2, 2e-2  # DeepEP moves activations and gradients in bf16
GROUPED_BF16_RTOL = 2e-2  # a grouped GEMM kernel against cuBLAS per expert, both bf16 with fp32 accumulation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python bench/gpu_smoke.py", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[2:]),
    )  # fmt: skip
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--deepep-src", type=Path, default=DEFAULT_DEEPEP_SRC,
        help="DeepEP checkout to build when deep_ep is not importable (default .gpu/DeepEP)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the JSON lines to this file")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"--only {args.only}: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.sections = chosen
    return args


def cuda_problem() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU here"
    return None


def timed_cuda(fn: Callable):
    return timed(fn, "cuda")


def timed(fn: Callable, device: str):
    """fn's result and seconds, the device's queued work included."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - start


def demo_checkpoint(directory: Path) -> Path:
    import torch

    from steps.demo.sft import demo_model_config, write_checkpoint
    from steps.models.qwen3_moe.model import MoeForCausalLM

    torch.manual_seed(0)
    return write_checkpoint(MoeForCausalLM(demo_model_config()), directory)


# ---------------------------------------------------------------------------------------------- engine


def engine_section(args: argparse.Namespace) -> dict:
    import torch

    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        return {"skipped": f"transformers is not installed ({err}); the engine's reference needs it"}
    from steps.data.tasks import get_task
    from steps.demo.char_tokenizer import EOS_ID, PAD_ID, build_tokenizer, encode_prompt
    from steps.engines.interface import SamplingParams, sample_requests, sample_seed
    from steps.engines.torch_engine import TorchEngine
    from steps.models.kernels import token_logprobs

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity, not TF32
    torch.backends.cudnn.allow_tf32 = False
    tok = build_tokenizer()
    prompts = get_task("addition").prompts("train", args.prompts, 0)
    prompt_ids = {p.prompt_id: encode_prompt(tok, p.text) for p in prompts}
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, stop_token_ids=())  # fixed length
    requests = sample_requests(
        [(p.prompt_id, prompt_ids[p.prompt_id]) for p in prompts], params,
        seed_of=lambda pid, k: sample_seed(0, 1, pid, k),
    )  # fmt: skip
    batch = [prompt_ids[p.prompt_id] for p in prompts for _ in range(args.samples)]
    width = max(map(len, batch))
    input_ids = torch.tensor([[PAD_ID] * (width - len(b)) + b for b in batch], device="cuda")
    mask = (input_ids != PAD_ID).long()
    out: dict = {"shape": f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens"}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        directory = demo_checkpoint(Path(tmp))
        for dtype, atol in ((torch.float32, LOGPROB_FP32_ATOL), (torch.bfloat16, LOGPROB_BF16_ATOL)):
            name = str(dtype).removeprefix("torch.")
            engine = TorchEngine.from_checkpoint(directory, device="cuda", dtype=dtype)
            hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to("cuda").eval()
            engine.generate(requests[:64], params)  # warm-up
            generations, engine_s = timed_cuda(lambda engine=engine: engine.generate(requests, params))
            engine_tokens = sum(len(g.response_ids) for g in generations)
            worst = 0.0
            with torch.inference_mode():
                for g in generations[:256]:
                    seq = torch.tensor([prompt_ids[g.prompt_id] + list(g.response_ids)], device="cuda")
                    logits = hf(seq).logits.float()
                    ref = token_logprobs(logits[:, :-1], seq[:, 1:])[0, -len(g.response_ids) :]
                    worst = max(worst, float((ref.cpu() - torch.tensor(g.logprobs)).abs().max()))

            def hf_generate(hf=hf):
                return hf.generate(
                    input_ids=input_ids, attention_mask=mask, do_sample=True, max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens, pad_token_id=PAD_ID, eos_token_id=EOS_ID, top_k=0,
                )  # fmt: skip

            with torch.inference_mode():
                hf_generate()  # warm-up
                generated, hf_s = timed_cuda(hf_generate)
            hf_tokens = int(generated[:, width:].numel())
            out[name] = {
                "logprob_max_abs_diff_vs_transformers": worst, "atol": atol, "ok": worst <= atol,
                "torch_engine_tokens_per_s": engine_tokens / engine_s,
                "transformers_generate_tokens_per_s": hf_tokens / hf_s,
                "ratio": (engine_tokens / engine_s) / (hf_tokens / hf_s),
            }  # fmt: skip
            ok &= worst <= atol
            engine.close()
            del hf
    out["ok"] = ok
    out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return out


# --------------------------------------------------------------------------------------------- trainer


def one_trainer_step(directory: Path, device: str, autocast_bf16: bool) -> tuple[dict, float]:
    """The weights after one PolicyTrainer step from the checkpoint, on `device`; and the step's loss."""
    import torch

    from bench.update import synthetic_samples
    from steps.expert_parallel.mesh import Mesh
    from steps.models.hf_checkpoint import load_pretrained
    from steps.training.micro_batch import collate
    from steps.training.trainer import PolicyTrainer, TrainSettings

    torch.manual_seed(0)
    model = load_pretrained(directory, dtype=torch.float32, device=device)
    mesh = Mesh(device=torch.device(device))
    trainer = PolicyTrainer(model, mesh, TrainSettings(micro_batch_size=16, lr=1e-4))
    samples = synthetic_samples(64)
    everything = list(range(len(samples)))
    micro = [collate(samples, everything[i : i + 16], mesh.device) for i in range(0, len(samples), 16)]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_bf16):
        result = trainer.step(micro, trainer.normalizer(samples, everything))
    loss = float(getattr(result, "loss", float("nan")))
    return {n: p.detach().float().cpu() for n, p in model.named_parameters()}, loss


def trainer_section(args: argparse.Namespace) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        directory = demo_checkpoint(Path(tmp))
        from steps.models.hf_checkpoint import load_pretrained

        before = {n: p.detach().float() for n, p in load_pretrained(directory, dtype=torch.float32).named_parameters()}
        cpu, cpu_loss = one_trainer_step(directory, "cpu", autocast_bf16=False)
        fp32, fp32_loss = one_trainer_step(directory, "cuda", autocast_bf16=False)
        bf16, bf16_loss = one_trainer_step(directory, "cuda", autocast_bf16=True)
    fp32_diff = max(float((fp32[n] - cpu[n]).abs().max()) for n in cpu)
    change = torch.cat([(cpu[n] - before[n]).flatten() for n in cpu])
    bf16_change = torch.cat([(bf16[n] - before[n]).flatten() for n in cpu])
    bf16_rel = float((bf16_change - change).norm() / change.norm().clamp_min(1e-30))
    return {
        "fp32": {"weights_max_abs_diff_vs_cpu": fp32_diff, "atol": TRAINER_FP32_ATOL,
                 "ok": fp32_diff <= TRAINER_FP32_ATOL, "loss": fp32_loss, "cpu_loss": cpu_loss},
        "bf16_autocast": {"step_change_rel_diff_vs_cpu": bf16_rel, "rtol": TRAINER_BF16_RTOL,
                          "ok": bf16_rel <= TRAINER_BF16_RTOL, "loss": bf16_loss},
        "ok": fp32_diff <= TRAINER_FP32_ATOL and bf16_rel <= TRAINER_BF16_RTOL,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- deepep


def deepep_build_command(src: Path, site: Path) -> list[str]:
    """Build DeepEP from a checkout into `site` with the machine's torch, NCCL and nvcc, offline."""
    return [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
            "--target", str(site), str(src)]  # fmt: skip


def import_or_build_deep_ep(src: Path) -> tuple[object | None, str]:
    """(deep_ep, how it came) or (None, why not)."""
    try:
        import deep_ep

        return deep_ep, "installed"
    except ImportError:
        pass
    if not (src / "setup.py").is_file():
        return None, (
            f"deep_ep is not installed and {src} holds no DeepEP checkout; clone DeepEP at images/versions.env's "
            "DEEPEP_COMMIT (with its submodules) there, or pass --deepep-src"
        )
    if not (DEEPEP_SITE / "deep_ep").is_dir():
        done = subprocess.run(deepep_build_command(src, DEEPEP_SITE), capture_output=True, text=True, timeout=420)
        if done.returncode != 0:
            return None, f"building DeepEP from {src} failed: {done.stderr[-1500:]}"
    sys.path.insert(0, str(DEEPEP_SITE))
    try:
        import deep_ep
    except ImportError as err:
        return None, f"DeepEP built into {DEEPEP_SITE} but does not import: {err}"
    return deep_ep, f"built from {src}"


def deepep_section(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    deep_ep, how = import_or_build_deep_ep(args.deepep_src)
    if deep_ep is None:
        return {"skipped": how}
    from steps.expert_parallel.deepep import DeepEPDispatch
    from steps.models.qwen3_moe.model import MoeBlock

    hidden, inter, experts, top_k, tokens = 256, 512, 8, 2, 512
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    torch.manual_seed(0)
    block = MoeBlock(hidden, inter, experts, top_k, norm_topk_prob=False).cuda()
    x = torch.randn(tokens, hidden, device="cuda")
    probe = torch.randn(tokens, hidden, device="cuda")

    def run(dispatch: object | None) -> tuple[torch.Tensor, dict]:
        if dispatch is not None:
            block.dispatch = dispatch
        block.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_(True)
        out = block(inp)
        (out * probe).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
        grads["input"] = inp.grad.detach().clone()
        return out.detach(), grads

    ref_out, ref_grads = run(None)  # the block's own LocalDispatch
    group = dist.new_group([0])
    deepep = DeepEPDispatch(group, experts, experts, hidden, top_k, tokens)
    got_out, got_grads = run(deepep)
    run(deepep)  # a second pass reuses the buffer
    out_diff = float((got_out - ref_out).abs().max())
    out_ok = bool(torch.allclose(got_out, ref_out, atol=DEEPEP_ATOL, rtol=DEEPEP_RTOL))
    grad_diffs = {n: float((got_grads[n] - g).abs().max()) for n, g in ref_grads.items()}
    grads_ok = all(torch.allclose(got_grads[n], g, atol=DEEPEP_ATOL, rtol=DEEPEP_RTOL) for n, g in ref_grads.items())
    num_sms = deepep.num_sms
    # HeldDispatch's growth: the old buffer dropped, a bigger one registered by the same process and group.
    del deepep
    block.dispatch = None
    gc.collect()
    torch.cuda.synchronize()
    bigger = DeepEPDispatch(group, experts, experts, hidden, top_k, 2 * tokens)
    again_out, _ = run(bigger)
    again_ok = bool(torch.allclose(again_out, ref_out, atol=DEEPEP_ATOL, rtol=DEEPEP_RTOL))
    return {
        "deep_ep": how, "version": getattr(deep_ep, "__version__", "?"), "num_sms": num_sms,
        "out_max_abs_diff": out_diff, "grad_max_abs_diff": max(grad_diffs.values()), "atol": DEEPEP_ATOL,
        "rtol": DEEPEP_RTOL, "second_buffer_out_max_abs_diff": float((again_out - ref_out).abs().max()),
        "ok": out_ok and grads_ok and again_ok,
    }  # fmt: skip


# --------------------------------------------------------------------------------------------- sharded


def free_port() -> int:
    """A TCP port nothing listens on now, for a process group's store (a fixed one may be taken)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _one_rank_world(device: str) -> bool:
    """A 1-rank process group (NCCL on CUDA, gloo on the CPU) unless one exists; returns whether it made it."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device == "cuda":
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    return True


def sharded_step(directory: Path, device: str, fsdp: bool) -> dict:
    """The weights after one PolicyTrainer step on `device`, plain or with FSDP2 (forced over the 1-rank world)
    and activation checkpointing."""
    import torch
    import torch.distributed as dist

    from bench.update import synthetic_samples
    from steps.expert_parallel.mesh import Mesh
    from steps.models.hf_checkpoint import load_pretrained
    from steps.training.micro_batch import collate
    from steps.training.sharding import full_tensor, shard_non_experts
    from steps.training.trainer import PolicyTrainer, TrainSettings

    torch.manual_seed(0)
    model = load_pretrained(directory, dtype=torch.float32, device=device)
    mesh = Mesh(device=torch.device(device), world_group=dist.group.WORLD)
    if fsdp:
        assert shard_non_experts(model, mesh, force=True)
        model.activation_checkpointing = True
    trainer = PolicyTrainer(model, mesh, TrainSettings(micro_batch_size=16, lr=1e-4))
    samples = synthetic_samples(64)
    everything = list(range(len(samples)))
    micro = [collate(samples, everything[i : i + 16], mesh.device) for i in range(0, len(samples), 16)]
    trainer.step(micro, trainer.normalizer(samples, everything))
    return {n: full_tensor(p.detach()).float().cpu() for n, p in model.named_parameters()}


def grouped_gemm_check(device: str) -> dict:
    """run_experts over bf16 experts whose sizes grouped_mm takes, grouped against expert by expert."""
    import torch

    from steps.models.experts import grouped_gemm_usable, run_experts, set_grouped_gemm
    from steps.models.qwen3_moe.model import Expert

    torch.manual_seed(0)
    experts = [Expert(256, 512).to(device=device, dtype=torch.bfloat16) for _ in range(8)]
    counts = [64, 0, 128, 32, 0, 96, 16, 176]
    rows = torch.randn(sum(counts), 256, device=device, dtype=torch.bfloat16)
    usable = grouped_gemm_usable([w for e in experts for w in e.expert_weights()])
    results = {}
    for grouped in (False, True):
        set_grouped_gemm(grouped)
        for e in experts:
            e.zero_grad(set_to_none=True)
        x = rows.clone().requires_grad_(True)
        out = run_experts(experts, x, counts)
        out.float().square().sum().backward()
        grads = [p.grad.detach().float() for e in experts for p in e.parameters() if p.grad is not None]
        results[grouped] = (out.detach().float(), x.grad.detach().float(), grads)
    set_grouped_gemm(True)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    (out, gx, grads), (gout, ggx, ggrads) = results[False], results[True]
    worst = max([rel(gout, out), rel(ggx, gx), *(rel(a, b) for a, b in zip(ggrads, grads, strict=True))])
    return {"grouped_mm_used": usable, "max_rel_diff": worst, "rtol": GROUPED_BF16_RTOL,
            "ok": usable and worst <= GROUPED_BF16_RTOL}  # fmt: skip


def sharded_check(device: str) -> dict:
    import torch
    import torch.distributed as dist

    made = _one_rank_world(device)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            directory = demo_checkpoint(Path(tmp))
            plain = sharded_step(directory, device, fsdp=False)
            sharded = sharded_step(directory, device, fsdp=True)
        diff = max(float((sharded[n] - plain[n]).abs().max()) for n in plain)
        grouped = grouped_gemm_check(device)
    finally:
        if made:
            dist.destroy_process_group()
    step_ok = diff <= TRAINER_FP32_ATOL
    return {"fsdp_checkpointing_step": {"weights_max_abs_diff_vs_plain": diff, "atol": TRAINER_FP32_ATOL,
                                        "ok": step_ok},
            "grouped_gemm_bf16": grouped, "ok": step_ok and grouped["ok"],
            "torch": torch.__version__}  # fmt: skip


def sharded_section(args: argparse.Namespace) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return sharded_check("cuda")


# --------------------------------------------------------------------------------------------- weights


def weights_section(args: argparse.Namespace) -> dict:
    return weights_check(args.prompts, args.samples, args.new_tokens, "cuda")


def weights_check(prompt_count: int, samples: int, new_tokens: int, device: str) -> dict:
    """The weights section on `device` (tests run it on the CPU)."""
    import torch

    from steps.data.tasks import get_task
    from steps.demo.char_tokenizer import build_tokenizer, encode_prompt
    from steps.demo.sft import write_checkpoint
    from steps.engines.interface import SamplingParams, sample_requests, sample_seed
    from steps.engines.torch_engine import TorchEngine
    from steps.models.hf_checkpoint import load_pretrained

    tok = build_tokenizer()
    prompts = get_task("addition").prompts("train", min(prompt_count, 64), 0)
    params = SamplingParams(n=samples, max_new_tokens=new_tokens, stop_token_ids=())
    requests = sample_requests(
        [(p.prompt_id, encode_prompt(tok, p.text)) for p in prompts], params,
        seed_of=lambda pid, k: sample_seed(0, 1, pid, k),
    )  # fmt: skip
    out: dict = {}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        v0 = demo_checkpoint(Path(tmp) / "v0")
        moved = load_pretrained(v0)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in moved.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
        v1 = write_checkpoint(moved, Path(tmp) / "v1")
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            live = TorchEngine.from_checkpoint(v0, device=device, dtype=dtype)
            live.generate(requests[:8], params)  # warm: the engine has served v0
            _, update_s = timed(lambda live=live: live.update_weights(v1), device)
            updated = live.generate(requests, params)
            fresh, open_s = timed(
                lambda dtype=dtype: TorchEngine.from_checkpoint(v1, device=device, dtype=dtype), device
            )
            expected = fresh.generate(requests, params)
            same = len(updated) == len(expected) and all(
                (a.response_ids, a.logprobs) == (b.response_ids, b.logprobs)
                for a, b in zip(updated, expected, strict=True)
            )
            out[name] = {"identical": same, "update_weights_s": update_s, "open_new_engine_s": open_s}
            ok &= same
            live.close()
            fresh.close()
    out["ok"] = ok
    return out


RUNNERS = {"engine": engine_section, "trainer": trainer_section, "deepep": deepep_section, "sharded": sharded_section,
           "weights": weights_section}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = cuda_problem()
    lines, failed = [], []
    for name in args.sections:
        start = time.perf_counter()
        if problem is not None:
            result = {"skipped": f"{problem}; the {name} check needs a CUDA GPU"}
        else:
            try:
                result = RUNNERS[name](args)
            except Exception as err:  # one section's crash is reported, the others still run
                result = {"ok": False, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        result = {"section": name, **result, "seconds": round(time.perf_counter() - start, 1)}
        if result.get("ok") is False:
            failed.append(name)
        lines.append(json.dumps(result))
        print(lines[-1], flush=True)
    skipped = [r["section"] for r in map(json.loads, lines) if "skipped" in r]
    summary = {"summary": {"failed": failed, "skipped": skipped}}
    lines.append(json.dumps(summary))
    print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
