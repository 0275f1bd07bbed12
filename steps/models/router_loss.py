"""The routers' load-balancing loss (trainer.router_aux_loss_coef): Switch Transformers' auxiliary loss (Fedus et
al. 2021, eq. 4), as Megatron-LM computes it per MoE layer (switch_load_balancing_loss_func):

    loss = E * sum_e f_e * P_e

f_e: the share of the layer's (token, choice) rows routed to expert e; P_e: the mean router probability of
expert e over the tokens. Only real tokens count (padding is masked out, as transformers' load_balancing_loss_func
does with the attention mask). It is 1 when the routing is uniform and grows as tokens crowd onto few experts; its
gradient reaches the routers through P_e only (f_e counts discrete choices).

The router probabilities are the ones the router kind weighs with: softmax over all experts (softmax_topk,
topk_softmax), and for sigmoid routers the sigmoid scores normalised over the experts (DeepSeek-V3's
sequence-wise balance loss, its eq. 18-20, over the micro-batch instead of a sequence).
"""

from __future__ import annotations

import torch


def router_probabilities(router_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """[T, E] fp32 probabilities of the router kind (see the module docstring)."""
    if kind in ("sigmoid_group_topk", "sqrtsoftplus_topk"):
        logits = router_logits.float()
        scores = logits.sigmoid() if kind == "sigmoid_group_topk" else torch.nn.functional.softplus(logits).sqrt()
        return scores / scores.sum(dim=-1, keepdim=True)
    return torch.softmax(router_logits.float(), dim=-1)


def load_balancing_loss(
    router_logits: torch.Tensor, topk_idx: torch.Tensor, kind: str, token_mask: torch.Tensor
) -> torch.Tensor:
    """E * sum_e f_e P_e over the tokens token_mask [T] (bool) marks real: router_logits [T, E], topk_idx [T, k].
    0 (connected to the logits) when no token is real."""
    num_experts = router_logits.shape[-1]
    probs = router_probabilities(router_logits, kind)[token_mask]
    if probs.shape[0] == 0:
        return router_logits.sum() * 0.0
    chosen = topk_idx[token_mask].reshape(-1)
    share = torch.bincount(chosen, minlength=num_experts).float() / chosen.numel()
    return num_experts * (share * probs.mean(dim=0)).sum()
