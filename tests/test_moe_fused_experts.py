"""The fused SwiGLU experts (steps.models.moe: one [gate; up] matmul, hand-written backward) give the output and every
gradient (input, router, each expert parameter) of plain per-expert autograd, down(silu(gate(x)) * up(x)),
through run_experts, LocalDispatch, a dense Expert and the all-to-all backend over 2 gloo processes;
including experts without rows, batches without tokens and ranks whose experts receive nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo

from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import build_mesh, sync_gradients
from steps.models.experts import run_experts
from steps.models.qwen3_moe.model import Expert, MoeBlock

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 16, 12, 4, 2, 24
OUT_REL, GRAD_REL = 1e-6, 1e-5


def assert_rel(got: torch.Tensor | None, want: torch.Tensor | None, rel: float, what: str) -> None:
    """max |got - want| <= rel * max |want|; a missing gradient counts as zeros (a parameter no row used)."""
    if got is None and want is None:
        return
    ref = want if want is not None else torch.zeros_like(got)
    got = got if got is not None else torch.zeros_like(ref)
    assert got.shape == ref.shape, what
    scale = max(float(ref.abs().max()), 1e-30) if ref.numel() else 1.0
    err = float((got - ref).abs().max()) if ref.numel() else 0.0
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} > {rel} * {scale:.3g}"


def plain_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def plain_moe(block: MoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The MoE block in plain autograd ops: softmax router, top-k, renormalised weights, and per expert
    w * down(silu(gate(x)) * up(x)) on the tokens that chose it, added with index_add."""
    probs = torch.softmax(F.linear(x, block.gate.weight), dim=-1, dtype=torch.float32)
    weight, idx = torch.topk(probs, block.top_k, dim=-1)
    if block.norm_topk_prob:
        weight = weight / weight.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(block.num_experts):
        token, choice = (idx == e).nonzero(as_tuple=True)
        if token.numel():
            ex = block.experts[str(e)]
            y = plain_swiglu(x[token], ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)
            out = out.index_add(0, token, y * weight[token, choice].unsqueeze(-1).to(x.dtype))
    return out


def full_block(router_bias: float = 0.0) -> MoeBlock:
    torch.manual_seed(0)
    block = MoeBlock(HIDDEN, INTER, EXPERTS, TOP_K, norm_topk_prob=True)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
        block.gate.weight[:2, 0] += router_bias  # with x[:, 0] = 1: experts 0 and 1 get every token
    return block


def tokens(seed: int, n: int = TOKENS, router_bias: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, probe = torch.randn(n, HIDDEN, generator=gen), torch.randn(n, HIDDEN, generator=gen)
    if router_bias:
        x[:, 0] = 1.0
    return x, probe


def output_and_grads(block: MoeBlock, x: torch.Tensor, probe: torch.Tensor, forward) -> dict:
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = forward(block, x)
    if out.requires_grad:  # (without tokens LocalDispatch returns plain zeros)
        (out * probe).sum().backward()
    result = {f"grad.{n}": p.grad for n, p in block.named_parameters()}
    result.update(out=out.detach(), input_grad=x.grad)
    return result


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in got:
        assert_rel(got[name], want[name], OUT_REL if name == "out" else GRAD_REL, name)


@pytest.mark.parametrize("router_bias", [0.0, 20.0], ids=["spread", "experts-2-and-3-without-rows"])
def test_local_dispatch_matches_plain_autograd(router_bias):
    block = full_block(router_bias)
    x, probe = tokens(1, router_bias=router_bias)
    got = output_and_grads(block, x, probe, lambda b, h: b(h))
    want = output_and_grads(block, x, probe, plain_moe)
    assert_same(got, want)
    assert got["grad.gate.weight"].abs().sum() > 0  # the router learns through the combine weights
    if router_bias:
        assert got["grad.experts.2.gate_proj.weight"] is None  # no row: no gradient, as autograd
        assert got["grad.experts.0.up_proj.weight"].abs().sum() > 0


def test_no_tokens_reach_any_expert():
    block = full_block()
    x, probe = tokens(1, n=0)
    got = output_and_grads(block, x, probe, lambda b, h: b(h))
    assert got["out"].shape == (0, HIDDEN)
    assert all(v is None for k, v in got.items() if k.startswith("grad."))
    assert_same(got, output_and_grads(block, x, probe, plain_moe))


def test_run_experts_with_experts_without_rows():
    block = full_block()
    experts = block.local_experts()
    counts = [5, 0, 7, 0]
    gen = torch.Generator().manual_seed(3)
    rows, probe = torch.randn(12, HIDDEN, generator=gen), torch.randn(12, HIDDEN, generator=gen)

    def fused(b: MoeBlock, h: torch.Tensor) -> torch.Tensor:
        return run_experts(experts, h, counts)

    def plain(b: MoeBlock, h: torch.Tensor) -> torch.Tensor:
        parts = [
            plain_swiglu(part, ex.gate_proj.weight, ex.up_proj.weight, ex.down_proj.weight)
            for ex, part in zip(experts, h.split(counts), strict=True)
            if part.shape[0]
        ]
        return torch.cat(parts)

    assert_same(output_and_grads(block, rows, probe, fused), output_and_grads(block, rows, probe, plain))
    # no rows at all: the empty output stays in the graph (the all-to-all backward needs every rank)
    empty = torch.zeros(0, HIDDEN, requires_grad=True)
    out = run_experts(experts, empty, [0, 0, 0, 0])
    assert out.shape == (0, HIDDEN) and out.grad_fn is not None
    out.sum().backward()
    assert empty.grad is not None and empty.grad.shape == (0, HIDDEN)
    with pytest.raises(ValueError, match="do not split"):
        run_experts(experts, rows, [5, 0, 6, 0])


def test_dense_expert_matches_plain_autograd():
    torch.manual_seed(0)
    mlp = Expert(HIDDEN, 3 * INTER)
    gen = torch.Generator().manual_seed(4)
    x, probe = torch.randn(3, 5, HIDDEN, generator=gen), torch.randn(3, 5, HIDDEN, generator=gen)
    results = []
    for forward in (mlp, lambda h: plain_swiglu(h, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)):
        mlp.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_(True)
        out = forward(h)
        (out * probe).sum().backward()
        results.append([out.detach(), h.grad, *(p.grad for p in mlp.parameters())])
    assert results[0][0].shape == x.shape
    for i, (got, want) in enumerate(zip(*results, strict=True)):
        assert_rel(got, want, OUT_REL if i == 0 else GRAD_REL, f"tensor {i}")
    assert [n for n, _ in mlp.named_parameters()] == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]


# ------------------------------------------------------------------------------- all-to-all, 2 gloo ranks

# (router_bias, tokens on each rank): spread routing; every token to rank 0's experts (rank 1's experts
# receive no rows); rank 1 without tokens.
EP_CASES = [(0.0, (14, 10)), (20.0, (12, 12)), (0.0, (TOKENS, 0))]


def alltoall_worker(rank: int, world: int, out_dir: Path) -> None:
    mesh = build_mesh(rank, world, world, torch.device("cpu"))
    for case, (router_bias, sizes) in enumerate(EP_CASES):
        full = full_block(router_bias)
        block = MoeBlock(HIDDEN, INTER, EXPERTS, TOP_K, norm_topk_prob=True, ep_rank=rank, ep_size=world)
        block.load_state_dict({k: v for k, v in full.state_dict().items() if k in block.state_dict()})
        block.dispatch = make_dispatch("alltoall", mesh, EXPERTS)
        x, probe = tokens(1, router_bias=router_bias)
        mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        x_local = x[mine].clone().requires_grad_(True)
        out = block(x_local)
        (world * (out * probe[mine]).sum()).backward()  # each rank's estimate of the global objective
        sync_gradients(block, mesh)
        tensors = {f"grad.{n}": p.grad for n, p in block.named_parameters()}
        tensors.update(out=out.detach(), input_grad=x_local.grad / world)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"case{case}-rank{rank}.safetensors"))


def test_alltoall_matches_plain_autograd(tmp_path):
    run_gloo(alltoall_worker, 2, tmp_path)
    for case, (router_bias, sizes) in enumerate(EP_CASES):
        block = full_block(router_bias)
        x, probe = tokens(1, router_bias=router_bias)
        want = output_and_grads(block, x, probe, plain_moe)
        for rank in range(2):
            got = load_file(tmp_path / f"case{case}-rank{rank}.safetensors")
            mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
            assert_rel(got["out"], want["out"][mine], OUT_REL, f"case {case} rank {rank} out")
            assert_rel(got["input_grad"], want["input_grad"][mine], GRAD_REL, f"case {case} rank {rank} input")
            params = {k: v for k, v in got.items() if k.startswith("grad.")}
            held = {f"grad.experts.{e}.{w}.weight" for e in range(2 * rank, 2 * rank + 2)
                    for w in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
            assert held | {"grad.gate.weight"} == params.keys()
            for name, grad in params.items():
                assert_rel(grad, want[name], GRAD_REL, f"case {case} rank {rank} {name}")
