"""Teacher-forced examples of the SFT step: prompt + target answer as one sequence, and right-padded batches.

Held-out accuracy is not computed here: `steps.engine.evaluate_accuracy` is the one way to measure it, for
every engine (greedy generation, checked by the task's verifier).
"""

from __future__ import annotations

import torch

from steps.tasks import Prompt, sft_target
from steps.tokenizer import EOS_ID, PAD_ID, build_tokenizer, encode, encode_prompt


def encode_example(prompt: Prompt) -> tuple[list[int], int]:
    """Token ids of <bos> + prompt + target answer + <eos>, and the index where the response starts."""
    tok = build_tokenizer()
    prompt_ids = encode_prompt(tok, prompt.text)
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
