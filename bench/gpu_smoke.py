"""GPU check of the torch engine: behaviour log-probs against transformers on CUDA, and tokens/s of the
torch engine against transformers' `generate` on the same GPU, checkpoint, prompts and lengths.

    python bench/gpu_smoke.py [--prompts 256] [--samples 8] [--new-tokens 32]

Needs a CUDA GPU (exits 0 with the reason when there is none). Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from steps.char_tokenizer import EOS_ID, PAD_ID, build_tokenizer, encode_prompt  # noqa: E402
from steps.engine import SamplingParams, TorchEngine, sample_requests, sample_seed  # noqa: E402
from steps.model import MoeForCausalLM, token_logprobs  # noqa: E402
from steps.sft import demo_model_config, write_checkpoint  # noqa: E402
from steps.tasks import get_task  # noqa: E402


def timed_cuda(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA GPU here; nothing to check")
        return
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity, not TF32
    torch.backends.cudnn.allow_tf32 = False
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    prompts = get_task("addition").prompts("train", args.prompts, 0)
    prompt_ids = {p.prompt_id: encode_prompt(tok, p.text) for p in prompts}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        directory = write_checkpoint(MoeForCausalLM(demo_model_config()), Path(tmp))
        engine = TorchEngine.from_checkpoint(directory, device="cuda")
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to("cuda").eval()

    # Fixed-length sampling (no stop) so both sides generate the same number of tokens.
    params = SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, stop_token_ids=())
    requests = sample_requests(
        [(p.prompt_id, prompt_ids[p.prompt_id]) for p in prompts], params,
        seed_of=lambda pid, k: sample_seed(0, 1, pid, k),
    )  # fmt: skip
    engine.generate(requests[:64], params)  # warm-up
    generations, engine_s = timed_cuda(lambda: engine.generate(requests, params))
    engine_tokens = sum(len(g.response_ids) for g in generations)

    # Parity: log-probs that transformers computes for the same sampled tokens.
    worst = 0.0
    with torch.inference_mode():
        for g in generations[:256]:
            seq = torch.tensor([prompt_ids[g.prompt_id] + list(g.response_ids)], device="cuda")
            logits = hf(seq).logits.float()
            ref = token_logprobs(logits[:, :-1], seq[:, 1:])[0, -len(g.response_ids) :]
            worst = max(worst, float((ref.cpu() - torch.tensor(g.logprobs)).abs().max()))

    # transformers generate on the same prompts (left-padded batch of prompts x samples).
    batch = [prompt_ids[p.prompt_id] for p in prompts for _ in range(args.samples)]
    width = max(map(len, batch))
    input_ids = torch.tensor([[PAD_ID] * (width - len(b)) + b for b in batch], device="cuda")
    mask = (input_ids != PAD_ID).long()

    def hf_generate():
        return hf.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=True, max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens, pad_token_id=PAD_ID, eos_token_id=EOS_ID, top_k=0,
        )  # fmt: skip

    with torch.inference_mode():
        hf_generate()  # warm-up
        out, hf_s = timed_cuda(hf_generate)
    hf_tokens = int(out[:, width:].numel())
    report = {
        "device": torch.cuda.get_device_name(),
        "logprob_max_abs_diff_vs_transformers": worst,
        "logprob_parity_atol_1e-4": worst <= 1e-4,
        "torch_engine_tokens_per_s": engine_tokens / engine_s,
        "transformers_generate_tokens_per_s": hf_tokens / hf_s,
        "ratio": (engine_tokens / engine_s) / (hf_tokens / hf_s),
        "shape": f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens",
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
