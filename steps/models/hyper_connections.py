"""Manifold-constrained hyper-connections (mHC; Xie et al. 2026), a shared component: the residual stream widened to
`hc_mult` parallel streams [B, T, N, H] (DeepSeek-V4). Before a block (attention or MLP) the streams collapse into
its input with weights `pre`; after it its output is spread back over the streams with weights `post`, beside the
streams mixed among themselves by `comb`, a doubly stochastic N x N matrix (Sinkhorn-Knopp). All three come from
one projection of the token's normalised streams. As transformers 5.23's DeepseekV4HyperConnection and
DeepseekV4HyperHead compute them, in float32 (their parameters are held in float32 whatever the weights' dtype:
ModelFamily.float32_tensors):

    flat          = x.flatten(N, H) / rms                                  (no weight)
    [pre | post | comb] = flat @ fn^T                                      fn [(2 + N) N, N H]
    pre  = sigmoid(pre * scale_0 + base_pre) + eps
    post = 2 sigmoid(post * scale_1 + base_post)
    comb = Sinkhorn(softmax(comb * scale_2 + base_comb) + eps)             rows, then columns, sum to 1
    block input  = sum_n pre_n x_n
    x'           = post (x) block output + comb^T x                       (HyperConnection.mix)

HyperHead collapses the streams once more, before the final norm (pre only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, the rms in float32 (DeepseekV4UnweightedRMSNorm)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """One block's hyper-connection (DeepseekV4HyperConnection): parameters `fn` [(2 + N) N, N H], `base`
    [(2 + N) N] and `scale` [3]."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        size = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(size, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.empty(size))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, N, H] -> (post [B, T, N], comb [B, T, N, N], both float32, and the block's input
        [B, T, H] in the streams' dtype)."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.reshape(*streams.shape[:2], -1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = comb_w.view(*comb_w.shape[:-1], n, n) * comb_scale + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def mix(post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The streams after the block: post [.., N] spreads its output [.., H] over them, beside comb^T streams."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )


class HyperHead(nn.Module):
    """The final collapse of the streams before the model's norm (DeepseekV4HyperHead): `fn` [N, N H], `base` [N],
    `scale` [1]."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.empty(hc_mult))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """[.., N, H] -> [.., H]."""
        flat = unweighted_rms_norm(streams.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def init_hyper_connection(module: nn.Module, std: float) -> None:
    """As DeepseekV4PreTrainedModel._init_weights: fn normal(0, std), base 0, scale 1."""
    if isinstance(module, HyperConnection | HyperHead):
        module.fn.normal_(0.0, std)
        module.base.zero_()
        module.scale.fill_(1.0)
