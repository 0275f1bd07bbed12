"""Expert-parallel dispatch: the alltoall backend over gloo processes gives the same MoE outputs and the same
(synchronised) gradients as one process running every expert, on several dp x ep meshes and routings."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from steps.errors import MoerlError
from steps.expert_parallel.alltoall import AllToAllDispatch
from steps.expert_parallel.deepep import import_deep_ep
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import (
    Mesh,
    build_mesh,
    clip_grad_norm,
    global_grad_norm,
    resolve_ep_size,
    sync_gradients,
)
from steps.models.experts import run_experts
from steps.models.moe import LocalDispatch, group_by_expert
from steps.models.qwen3_moe.model import MoeBlock

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 8, 6, 4, 2, 12
DEEPEP_HIDDEN = 256  # DeepEP needs a multiple of 256 (steps/expert_parallel/deepep.py check_deepep_shape)


# ---------------------------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> mp.context.BaseContext:
    """Forkserver: torch is imported once by the server, and children never inherit OpenMP threads."""
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch.distributed", "steps.expert_parallel.dispatch", "steps.models.qwen3_moe.model"]
    ctx.set_forkserver_preload(preload)
    return ctx


def _child(fn, rank: int, world: int, port: int, out_dir: str, args: tuple, backend: str) -> None:
    try:
        torch.set_num_threads(1)
        kwargs = {}
        if backend == "nccl":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **kwargs
        )
        fn(rank, world, Path(out_dir), *args)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def run_gloo(fn, world: int, out_dir: Path, *args, timeout: float = 120.0, backend: str = "gloo") -> None:
    """Run fn(rank, world, out_dir, *args) in `world` processes on loopback; fail if any rank fails."""
    ctx, port = _context(), free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, str(out_dir), args, backend)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world, "a gloo worker failed (traceback above)"


def make_block(
    seed: int, mesh: Mesh | None = None, router_bias: float = 0.0, slots=None, hidden: int = HIDDEN
) -> MoeBlock:
    """The same weights whatever the experts held: built in full, then sliced to mesh's EP rank's experts
    under `slots` (the layer's placement; default the identity)."""
    torch.manual_seed(seed)
    full = MoeBlock(hidden, INTER, EXPERTS, TOP_K, norm_topk_prob=False)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.5)
        # With inputs(..., router_bias) feature 0 is 1: experts 0 and 1 (EP rank 0's) get every token.
        full.gate.weight[:2, 0] += router_bias
    if mesh is None:
        return full
    block = MoeBlock(hidden, INTER, EXPERTS, TOP_K, norm_topk_prob=False, slots=slots, ep_rank=mesh.ep_rank,
                     ep_size=mesh.ep_size)  # fmt: skip
    block.load_state_dict({k: v for k, v in full.state_dict().items() if k in block.state_dict()})
    return block


def inputs(seed: int, router_bias: float = 0.0, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, probe = torch.randn(TOKENS, hidden, generator=gen), torch.randn(TOKENS, hidden, generator=gen)
    if router_bias:
        x[:, 0] = 1.0
    return x, probe


def token_split(world: int, rank: int, sizes: tuple[int, ...] | None) -> slice:
    sizes = sizes or tuple(len(c) for c in torch.arange(TOKENS).tensor_split(world))
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def reference(router_bias: float, hidden: int = HIDDEN) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, all experts, all tokens: output and gradients of sum(out * probe) / TOKENS."""
    block = make_block(0, router_bias=router_bias, hidden=hidden)
    x, probe = inputs(1, router_bias, hidden)
    x.requires_grad_(True)
    out = block(x)
    ((out * probe).sum() / TOKENS).backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    grads["input"] = x.grad.clone()
    return out.detach(), grads


def block_worker(rank: int, world: int, out_dir: Path, ep: int, router_bias: float, sizes, slots) -> None:
    mesh = build_mesh(rank, world, ep, torch.device("cpu"))
    block = make_block(0, mesh, router_bias, slots)
    block.dispatch = make_dispatch("alltoall", mesh, EXPERTS)
    x, probe = inputs(1, router_bias)
    mine = token_split(world, rank, sizes)
    x_local = x[mine].clone().requires_grad_(True)
    out = block(x_local)
    # Each rank's loss is its estimate of the global objective (world * its share), as the trainer does.
    (world * (out * probe[mine]).sum() / TOKENS).backward()
    sync_gradients(block, mesh)
    tensors = {f"grad.{n}": p.grad for n, p in block.named_parameters()}
    tensors["out"] = out.detach()
    tensors["input_grad"] = x_local.grad * 1.0  # the input is not a parameter: no world factor to undo
    tensors["norm"] = global_grad_norm(block, mesh).reshape(1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"rank{rank}.safetensors"))


# ---------------------------------------------------------------------------------------------- tests


MESHES = [
    pytest.param(2, 2, 0.0, None, None, id="ep2"),
    pytest.param(2, 1, 0.0, None, None, id="dp2-ep1"),
    pytest.param(4, 2, 0.0, None, None, id="dp2xep2"),
    pytest.param(4, 4, 0.0, None, None, id="ep4-own-block-in-the-middle"),
    pytest.param(2, 2, 6.0, None, None, id="ep2-all-tokens-to-rank0-experts"),
    pytest.param(2, 2, 0.0, (TOKENS, 0), None, id="ep2-rank1-without-tokens"),
    # a non-identity placement: rank 0 holds experts 3 and 0, rank 1 experts 2 and 1
    pytest.param(2, 2, 6.0, None, (3, 0, 2, 1), id="ep2-placement-splits-the-hot-experts"),
    pytest.param(4, 4, 0.0, None, (2, 0, 3, 1), id="ep4-permuted-placement"),
]


@pytest.mark.parametrize("world,ep,router_bias,sizes,slots", MESHES)
def test_alltoall_matches_one_process(tmp_path, world, ep, router_bias, sizes, slots):
    ref_out, ref_grads = reference(router_bias)
    if router_bias:
        topk_idx = make_block(0, router_bias=router_bias).route(inputs(1, router_bias)[0])[1]
        assert (topk_idx < EXPERTS // ep).all()  # EP rank 1 receives nothing, yet takes part
    run_gloo(block_worker, world, tmp_path, ep, router_bias, sizes, slots)
    ref_norm = math.sqrt(sum(float(g.pow(2).sum()) for n, g in ref_grads.items() if n != "input"))
    for rank in range(world):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        mine = token_split(world, rank, sizes)
        torch.testing.assert_close(got["out"], ref_out[mine], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["input_grad"], ref_grads["input"][mine] * world, atol=1e-5, rtol=0)
        params = {k.removeprefix("grad."): v for k, v in got.items() if k.startswith("grad.")}
        per_rank, order = EXPERTS // ep, slots or tuple(range(EXPERTS))
        held = order[(rank % ep) * per_rank : (rank % ep + 1) * per_rank]
        assert {n for n in params if ".experts." in n or n.startswith("experts.")} == {
            f"experts.{e}.{w}.weight" for e in held for w in ("gate_proj", "up_proj", "down_proj")
        }  # fmt: skip
        for name, grad in params.items():
            expected = ref_grads.get(name, torch.zeros_like(grad))
            torch.testing.assert_close(grad, expected, atol=1e-5, rtol=0, msg=f"rank {rank} {name}")
        assert float(got["norm"]) == pytest.approx(ref_norm, abs=1e-5)
    assert ref_grads["gate.weight"].abs().sum() > 0  # the router is trained through the combine weights


def test_local_dispatch_is_the_single_rank_backend():
    mesh = Mesh()
    assert isinstance(make_dispatch("local", mesh, EXPERTS), LocalDispatch)
    assert isinstance(make_dispatch("alltoall", mesh, EXPERTS), LocalDispatch)  # ep 1: nothing to exchange
    with pytest.raises(MoerlError, match="'local' runs on one rank"):
        make_dispatch("local", Mesh(rank=0, world_size=2, ep_size=2), EXPERTS)
    with pytest.raises(MoerlError, match="unknown"):
        make_dispatch("nccl", mesh, EXPERTS)


def test_mesh_layout():
    mesh = Mesh(rank=5, world_size=8, ep_size=4)
    assert (mesh.dp_rank, mesh.ep_rank, mesh.dp_size) == (1, 1, 2)
    assert mesh.ep_ranks() == [4, 5, 6, 7]
    assert mesh.replica_ranks() == [1, 5]
    assert resolve_ep_size(8, 16) == 8
    assert resolve_ep_size(6, 8) == 2
    assert resolve_ep_size(8, 16, requested=4) == 4
    with pytest.raises(MoerlError, match="must divide both"):
        resolve_ep_size(8, 16, requested=3)


def test_clipping_scales_to_the_max_norm():
    block = make_block(0)
    x, probe = inputs(1)
    (block(x) * probe).sum().backward()
    before = float(global_grad_norm(block, Mesh()))
    assert clip_grad_norm(block, Mesh(), before / 4) == pytest.approx(before)
    assert float(global_grad_norm(block, Mesh())) == pytest.approx(before / 4, rel=1e-5)
    assert clip_grad_norm(block, Mesh(), 0.0) == pytest.approx(before / 4, rel=1e-5)  # 0: no clipping


def test_group_by_expert_is_a_stable_grouping():
    """The one grouping every dispatcher uses: rows by expert id, ties in their original order."""
    ids = torch.tensor([3, 0, 3, 1, 0, 3])
    order, inverse, counts = group_by_expert(ids, 5)
    assert order.tolist() == [1, 4, 3, 0, 2, 5]
    assert counts.tolist() == [2, 1, 0, 3, 0]
    assert torch.equal(ids[order][inverse], ids)


def test_run_experts_keeps_rows_without_experts_in_the_graph():
    """An owner that received no rows must still reach its all-to-all backward: the empty output is
    connected to its input."""
    block = make_block(0)
    rows = torch.randn(5, HIDDEN, requires_grad=True)
    out = run_experts(block.local_experts(), rows, [2, 0, 3, 0])
    want = torch.cat([block.experts["0"](rows[:2]), block.experts["2"](rows[2:])])
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    empty = rows[:0]
    out = run_experts(block.local_experts(), empty, [0, 0, 0, 0])
    assert out.shape == (0, HIDDEN) and out.grad_fn is not None
    out.sum().backward()  # reaches `rows` through the empty slice
    assert rows.grad is not None


def test_alltoall_rejects_experts_not_divisible_by_ep():
    with pytest.raises(ValueError, match="not a multiple"):
        AllToAllDispatch(None, 3, EXPERTS, 0, torch.device("cpu"))  # type: ignore[arg-type]


def deepep_worker(rank: int, world: int, out_dir: Path) -> None:
    device = torch.device("cuda", rank)
    mesh = build_mesh(rank, world, world, device)
    block = make_block(0, mesh, slots=(3, 0, 2, 1), hidden=DEEPEP_HIDDEN).to(device)  # non-identity placement
    block.dispatch = make_dispatch("deepep", mesh, EXPERTS, DEEPEP_HIDDEN, TOP_K, max_tokens_per_rank=TOKENS)
    x, probe = (t.to(device) for t in inputs(1, hidden=DEEPEP_HIDDEN))
    mine = token_split(world, rank, None)
    out = block(x[mine])
    (world * (out * probe[mine]).sum() / TOKENS).backward()
    sync_gradients(block, mesh)
    tensors = {f"grad.{n}": p.grad.cpu() for n, p in block.named_parameters()}
    tensors["out"] = out.detach().cpu()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"rank{rank}.safetensors"))


def test_deepep_backend(tmp_path):
    """DeepEP needs the deep_ep package and 2+ CUDA GPUs; where they are, it matches one process (to bf16
    precision: DeepEP sends activations and gradients in bf16)."""
    with pytest.raises(MoerlError, match="needs CUDA GPUs"):
        make_dispatch("deepep", Mesh(rank=0, world_size=2, ep_size=2, ep_group=object()), EXPERTS)
    try:
        import deep_ep  # noqa: F401
    except ImportError as err:
        with pytest.raises(MoerlError, match="DeepEP is not installed"):
            import_deep_ep()
        pytest.skip(f"deep_ep is not installed here ({err}); the deepep backend runs on GPU trainer nodes")
    if torch.cuda.device_count() < 2:
        pytest.skip("the deepep backend needs at least 2 CUDA GPUs (one per EP rank)")
    ref_out, ref_grads = reference(0.0, DEEPEP_HIDDEN)
    run_gloo(deepep_worker, 2, tmp_path, backend="nccl")
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        torch.testing.assert_close(got["out"], ref_out[token_split(2, rank, None)], atol=3e-2, rtol=3e-2)
        for name, grad in ((k.removeprefix("grad."), v) for k, v in got.items() if k.startswith("grad.")):
            torch.testing.assert_close(grad, ref_grads[name], atol=3e-2, rtol=3e-2, msg=name)


def test_a_held_dispatch_is_made_once_and_remade_only_for_a_bigger_batch(monkeypatch):
    """HeldDispatch (the trainer that stays up): one dispatcher across updates; a DeepEP-like one (with a
    buffer size) is remade, as big as the larger batch, only when an update needs more tokens per rank."""
    from steps.expert_parallel import dispatch as dispatch_module

    made = []

    class Buffered:
        def __init__(self, size: int, timer) -> None:
            self.max_tokens_per_rank, self.timer = size, timer

    def make(backend, mesh, num_experts, hidden, top_k, size, timer=None):
        made.append((backend, size))
        return Buffered(size, timer) if backend == "deepep" else object()

    monkeypatch.setattr(dispatch_module, "make_dispatch", make)
    held = dispatch_module.HeldDispatch()
    mesh = object()
    first = held.get("deepep", mesh, 8, 16, 2, 100)
    assert held.get("deepep", mesh, 8, 16, 2, 60) is first and held.get("deepep", mesh, 8, 16, 2, 100) is first
    bigger = held.get("deepep", mesh, 8, 16, 2, 150)
    assert bigger is not first and bigger.max_tokens_per_rank == 150
    assert held.get("deepep", mesh, 8, 16, 2, 120) is bigger  # still big enough
    other_shape = held.get("deepep", mesh, 8, 32, 2, 10)
    assert other_shape.max_tokens_per_rank == 10  # another model: its own size
    plain = held.get("alltoall", mesh, 8, 16, 2, 10)
    assert held.get("alltoall", mesh, 8, 16, 2, 10_000) is plain  # no buffer: never remade for size
    assert made == [("deepep", 100), ("deepep", 150), ("deepep", 10), ("alltoall", 10)] and held.made == 4
