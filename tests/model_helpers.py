"""Shared by the model and engine tests: weights far from the tiny default init, and the reference log-probs of a
response from one full forward."""

from __future__ import annotations

import torch

from steps.models.kernels import token_logprobs


def randomize_(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Norm weights uniform in [0.5, 1.5), every other parameter normal with std `scale`: far enough from the
    default init that routing and attention patterns are not trivial. The same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


def response_logits(model: torch.nn.Module, prompt_ids, response_ids) -> torch.Tensor:
    """[len(response_ids), V] float32: the logits that predict each response token, from one forward over
    prompt + response without padding. `model` is ours (returns logits) or transformers' (returns .logits)."""
    ids = torch.tensor([[*prompt_ids, *response_ids]])
    with torch.no_grad():
        out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    start = len(prompt_ids) - 1
    return logits[0, start : start + len(response_ids)].float()


def response_logprobs(model: torch.nn.Module, prompt_ids, response_ids) -> torch.Tensor:
    """[len(response_ids)] float32: log p(response token | prefix) under `model` (see response_logits)."""
    return token_logprobs(response_logits(model, prompt_ids, response_ids), torch.tensor(response_ids))
