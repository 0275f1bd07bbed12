"""Every call moerl's steps make into torch.distributed (and the FSDP2, DTensor, checkpoint and grouped-GEMM APIs
the trainer's memory settings use) held to the function's signature at the pinned torch: each keyword the call
passes is a parameter of that function, and it passes no more positional arguments than it takes. Read from the
source (ast), so a GPU-only path (NCCL, DeepEP's group setup) is checked on this machine too."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import distribute_tensor
from torch.utils.checkpoint import checkpoint

REPO = Path(__file__).resolve().parents[1]

# the name a call is written with in steps/ -> the function it reaches
CALLED = {
    "fully_shard": fully_shard,
    "register_fsdp_forward_method": register_fsdp_forward_method,
    "distribute_tensor": distribute_tensor,
    "DeviceMesh.from_group": DeviceMesh.from_group,
    "checkpoint": checkpoint,
    "F.grouped_mm": F.grouped_mm,
}


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def calls() -> list[tuple[str, str, ast.Call]]:
    """(where, name, call) of every dist.X(...) and CALLED call under steps/."""
    out = []
    for path in sorted((REPO / "steps").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            if name and (name.startswith("dist.") or name in CALLED):
                out.append((f"{path.relative_to(REPO)}:{node.lineno}", name, node))
    return out


def target(name: str):
    if name in CALLED:
        return CALLED[name]
    return getattr(dist, name.removeprefix("dist."))


def test_the_steps_make_the_calls_this_test_reads():
    names = {name for _, name, _ in calls()}
    assert {"dist.all_reduce", "dist.all_to_all_single", "dist.init_process_group", "fully_shard",
            "distribute_tensor", "register_fsdp_forward_method", "DeviceMesh.from_group", "checkpoint",
            "F.grouped_mm"} <= names  # fmt: skip


@pytest.mark.parametrize(("where", "name", "call"), calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_call_fits_the_pinned_signature(where, name, call):
    fn = target(name)
    params = inspect.signature(fn).parameters
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for keyword in call.keywords:
        if keyword.arg is None:  # **mapping: not checkable here
            continue
        assert accepts_kwargs or keyword.arg in params, f"{where}: {name}() has no parameter {keyword.arg!r}"
        if keyword.arg in params:
            assert params[keyword.arg].kind is not inspect.Parameter.POSITIONAL_ONLY, f"{where}: {keyword.arg}"
    positional = [p for p in params.values() if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    takes_varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values())
    if not any(isinstance(a, ast.Starred) for a in call.args):
        assert takes_varargs or len(call.args) <= len(positional), f"{where}: {name}() takes {len(positional)}"


def test_the_sharding_keywords_are_those_torch_names():
    """The FSDP2 and DTensor keywords sharding.py relies on, by name, at the pinned torch."""
    assert {"mesh", "reshard_after_forward", "ignored_params"} <= set(inspect.signature(fully_shard).parameters)
    assert inspect.signature(distribute_tensor).parameters["src_data_rank"].kind is inspect.Parameter.KEYWORD_ONLY
    assert {"use_reentrant", "context_fn"} <= set(inspect.signature(checkpoint).parameters)
    assert torch.__version__.startswith("2.13")
