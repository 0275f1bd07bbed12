"""AdamW for the policy update, bit-identical to torch.optim.AdamW(foreach=False) without torch.optim.Optimizer.

Why it exists: constructing any torch.optim optimizer (and stepping one) imports torch._dynamo, 1.5-2 s of CPU
per process on a small machine, most of a short demo update's life (and what the local warm server had to
preload for it). The functional kernel torch.optim.adam.adam does not import it outside torch.compile, so
this class keeps only what moerl uses of an optimizer (param_groups, state, step, zero_grad) around it.

Same arithmetic: torch's single-tensor kernel with decoupled weight decay, one parameter at a time (so the
result does not depend on the parameter grouping), the learning rate read from param_groups at each step
(the trainer's warmup sets it). Same state layout: state[param] = {"step": 0-dim float32 CPU tensor,
"exp_avg", "exp_avg_sq"}, so optimizer state files written with torch.optim.AdamW load unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.adam import adam


class AdamW:
    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        group = {"params": list(params), "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        if not group["params"]:
            raise ValueError("AdamW got an empty parameter list")
        self.param_groups: list[dict[str, Any]] = [group]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW step of every parameter that has a gradient (the others keep their weights and state)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                if not self.state.get(p):
                    self.state[p] = {
                        "step": torch.tensor(0.0, dtype=torch.float32),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam(
                params,
                [p.grad for p in params],
                [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states],
                [],
                [s["step"] for s in states],
                foreach=False,
                fused=False,
                capturable=False,
                differentiable=False,
                has_complex=any(torch.is_complex(p) for p in params),
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()


# What the trainer accepts as its optimizer: this AdamW (new_adamw) or any torch one (tests pass SGD).
AnyOptimizer = torch.optim.Optimizer | AdamW
