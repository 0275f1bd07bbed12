"""Held-out accuracy of a policy under greedy decoding, computed in one teacher-forced forward.

Greedy decoding writes the target answer exactly when, at every answer position (and the <eos> after
it), the argmax given the correct prefix is the correct token: the two are the same event, by
induction over positions. So exact-match accuracy of greedy decoding needs no generation loop.
"""

from __future__ import annotations

import torch

from steps.model import MoeForCausalLM
from steps.tasks import Prompt, sft_target
from steps.tokenizer import BOS_ID, EOS_ID, PAD_ID, build_tokenizer, encode


def encode_example(prompt: Prompt) -> tuple[list[int], int]:
    """Token ids of <bos> + prompt + target answer + <eos>, and the index where the response starts."""
    tok = build_tokenizer()
    prompt_ids = [BOS_ID, *encode(tok, prompt.text)]
    return prompt_ids + [*encode(tok, sft_target(prompt)), EOS_ID], len(prompt_ids)


def teacher_forced_batch(examples: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs, next-token targets, and the mask of targets that belong to the response."""
    length = max(len(ids) for ids, _ in examples)
    inputs = torch.full((len(examples), length - 1), PAD_ID, dtype=torch.long)
    targets = torch.full_like(inputs, PAD_ID)
    response_mask = torch.zeros_like(inputs, dtype=torch.bool)
    for row, (ids, response_start) in enumerate(examples):
        seq = torch.tensor(ids)
        inputs[row, : len(ids) - 1] = seq[:-1]
        targets[row, : len(ids) - 1] = seq[1:]
        response_mask[row, response_start - 1 : len(ids) - 1] = True
    return inputs, targets, response_mask


@torch.inference_mode()
def greedy_accuracy(model: MoeForCausalLM, prompts: list[Prompt], batch_size: int = 256) -> float:
    """Share of prompts whose greedy response is exactly the answer."""
    correct = 0
    for start in range(0, len(prompts), batch_size):
        inputs, targets, mask = teacher_forced_batch([encode_example(p) for p in prompts[start : start + batch_size]])
        # Right padding never reaches a real token under causal attention, so no mask is needed.
        hits = (model(inputs).argmax(-1) == targets) | ~mask
        correct += int(hits.all(dim=1).sum())
    return correct / max(len(prompts), 1)
