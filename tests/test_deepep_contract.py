"""Our DeepEP wrapper (steps/expert_parallel/deepep.py DeepEPDispatch) against a fake deep_ep that holds the
real ElasticBuffer's signatures and argument rules (tests/fake_deep_ep.py): forward dispatch/combine and the
backward's cached dispatch and combine, on two gloo ranks that the fake places on two nodes (RDMA between
them, as over EFA), matching one process running every expert to bf16 precision."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import fake_deep_ep
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_expert_parallel import EXPERTS, HIDDEN, TOKENS, TOP_K, inputs, make_block, reference, run_gloo, token_split

from steps.errors import MoerlError
from steps.expert_parallel.deepep import DeepEPDispatch, deepep_bandwidths
from steps.expert_parallel.dispatch import ep_group_within_node
from steps.expert_parallel.mesh import Mesh, build_mesh, sync_gradients


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    fake_deep_ep.ElasticBuffer.calls.clear()
    return fake_deep_ep


def one_rank_group(rank: int = 0, size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(rank=lambda: rank, size=lambda: size)


def test_the_fake_holds_deepeps_sm_rules(fake, monkeypatch):
    """What broke: a cached dispatch without num_sms (TypeError), and DeepEP's own bandwidth detection across
    nodes on EFA (ZeroDivisionError). The fake raises both, as DeepEP does."""
    monkeypatch.setattr(fake, "RANKS_PER_NODE", 1)  # two ranks, two nodes
    buffer = fake.ElasticBuffer(one_rank_group(), num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOP_K)
    x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
    idx = torch.zeros(2, TOP_K, dtype=torch.int64)
    with pytest.raises(ZeroDivisionError):
        buffer.dispatch(x, topk_idx=idx, topk_weights=idx.float(), num_experts=EXPERTS)
    handle = fake.EPHandle(EXPERTS, 1, TOKENS, 24, idx, 0, [])
    with pytest.raises(TypeError, match="unsupported operand"):
        buffer.dispatch(x, handle=handle)
    # with the bandwidths given, DeepEP's model never detects them
    assert buffer.get_theoretical_num_sms(EXPERTS, TOP_K, rdma_gbs=50.0, nvlink_gbs=430.0) > 0


def deepep_worker(rank: int, world: int, out_dir: Path, ranks_per_node: int) -> None:
    fake = importlib.import_module("fake_deep_ep")
    fake.install()
    fake.RANKS_PER_NODE = ranks_per_node
    torch.use_deterministic_algorithms(True)  # as the trainer runs; the wrapper must keep DeepEP's assert quiet
    mesh = build_mesh(rank, world, world, torch.device("cpu"))
    block = make_block(0, mesh, slots=(3, 0, 2, 1))  # a non-identity placement: slot ids go to DeepEP
    block.dispatch = DeepEPDispatch(mesh.ep_group, EXPERTS, EXPERTS // world, HIDDEN, TOP_K, TOKENS)
    x, probe = inputs(1)
    mine = token_split(world, rank, None)
    x_local = x[mine].clone().requires_grad_(True)
    out = block(x_local)
    (world * (out * probe[mine]).sum() / TOKENS).backward()
    sync_gradients(block, mesh)
    tensors = {f"grad.{n}": p.grad for n, p in block.named_parameters()}
    tensors["out"] = out.detach()
    tensors["input_grad"] = x_local.grad * 1.0
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / f"rank{rank}.safetensors"))
    calls = [(name, args) for name, args in fake.ElasticBuffer.calls]
    # forward: dispatch with the SM count, combine reusing it; backward: the combine's gradient goes out by a
    # cached dispatch (with the handle's SM count), the dispatch's comes back by a combine with weights
    assert [name for name, _ in calls] == ["dispatch", "combine", "dispatch", "combine"], calls
    assert calls[0][1]["num_sms"] > 0 and not calls[0][1]["cached"]
    assert calls[2][1]["cached"] and calls[2][1]["num_sms"] == calls[0][1]["num_sms"]
    assert calls[3][1]["weights"]


@pytest.mark.parametrize("ranks_per_node", [1, 8], ids=["two-nodes-over-efa", "one-node"])
def test_deepep_wrapper_forward_and_backward_match_one_process(tmp_path, ranks_per_node):
    ref_out, ref_grads = reference(0.0)
    run_gloo(deepep_worker, 2, tmp_path, ranks_per_node)
    for rank in range(2):
        got = load_file(tmp_path / f"rank{rank}.safetensors")
        mine = token_split(2, rank, None)
        # DeepEP moves activations and gradients in bf16
        torch.testing.assert_close(got["out"], ref_out[mine], atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(got["input_grad"], ref_grads["input"][mine] * 2, atol=3e-2, rtol=2e-2)
        for name, grad in got.items():
            if name.startswith("grad."):
                want = ref_grads.get(name.removeprefix("grad."), torch.zeros_like(grad))
                torch.testing.assert_close(grad, want, atol=3e-2, rtol=2e-2, msg=f"rank {rank} {name}")


def test_deepep_bandwidths_come_from_the_environment_or_p5en(monkeypatch):
    monkeypatch.delenv("MOERL_DEEPEP_RDMA_GBS", raising=False)
    monkeypatch.delenv("MOERL_DEEPEP_NVLINK_GBS", raising=False)
    assert deepep_bandwidths() == (50.0, 430.0)
    monkeypatch.setenv("MOERL_DEEPEP_RDMA_GBS", "25")
    assert deepep_bandwidths()[0] == 25.0
    monkeypatch.setenv("MOERL_DEEPEP_RDMA_GBS", "0")
    with pytest.raises(MoerlError, match="MOERL_DEEPEP_RDMA_GBS='0': not a positive bandwidth"):
        deepep_bandwidths()


def test_an_ep_group_inside_a_node_is_told_so_and_one_across_nodes_is_not():
    """Inside a node DeepEP runs its non-Gin path (EP_DISABLE_GIN=1): neither GIN nor /dev/gdrdrv needed."""
    assert ep_group_within_node(Mesh(rank=9, world_size=128, ep_size=8), local_world_size=8)
    assert not ep_group_within_node(Mesh(rank=9, world_size=128, ep_size=16), local_world_size=8)
    assert not ep_group_within_node(Mesh(rank=9, world_size=128, ep_size=128), local_world_size=8)
