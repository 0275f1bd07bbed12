"""The local experts as one grouped GEMM (trainer.grouped_gemm, torch.nn.functional.grouped_mm) against the
per-expert loop: the same outputs and gradients, bit for bit on the CPU, for every kind of expert, with experts
that get no rows; and the calls the grouped path makes held to grouped_mm's CUDA rules at the pinned torch
(its meta kernels implement _grouped_mm_cuda's checks: bf16, 16-byte strides), so the GPU path does not crash."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from steps.models import experts as ex
from steps.models.experts import (
    SWIGLU,
    ClampedSwiGLU,
    RoutedExpert,
    SwiGLUExpert,
    SwiGLUWeights,
    grouped_gemm_usable,
    run_experts,
    set_grouped_gemm,
    swiglu_backward_input,
    swiglu_backward_weights,
    swiglu_forward,
)


class _Swi(SwiGLUExpert):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate, self.up = torch.nn.Linear(hidden, inter, bias=False), torch.nn.Linear(hidden, inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def projections(self) -> tuple[torch.nn.Linear, torch.nn.Linear, torch.nn.Linear]:
        return self.gate, self.up, self.down


class _Clamped(RoutedExpert):
    arithmetic = ClampedSwiGLU()

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w_gu = torch.nn.Parameter(torch.randn(hidden, 2 * inter) * 0.3)
        self.b_gu = torch.nn.Parameter(torch.randn(2 * inter) * 0.3)
        self.w_down = torch.nn.Parameter(torch.randn(inter, hidden) * 0.3)
        self.b_down = torch.nn.Parameter(torch.randn(hidden) * 0.3)

    def expert_weights(self) -> list[torch.Tensor]:
        return [self.w_gu, self.b_gu, self.w_down, self.b_down]


@pytest.fixture(autouse=True)
def _restore_setting():
    yield
    set_grouped_gemm(True)


def _run(experts: list[torch.nn.Module], rows: torch.Tensor, counts: list[int], grouped: bool):
    set_grouped_gemm(grouped)
    for p in (p for e in experts for p in e.parameters()):
        p.grad = None
    x = rows.clone().requires_grad_()
    out = run_experts(experts, x, counts)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), x.grad, [None if p.grad is None else p.grad.clone() for e in experts for p in e.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [_Swi, _Clamped])
def test_grouped_gemm_gives_the_loops_bits_forward_and_backward(kind, dtype):
    torch.manual_seed(0)
    experts = [kind(16, 8).to(dtype) for _ in range(5)]
    counts = [3, 0, 7, 1, 0]  # experts without rows keep no gradient on both paths
    rows = torch.randn(sum(counts), 16, dtype=dtype)
    assert grouped_gemm_usable([w for e in experts for w in e.expert_weights()])
    loop, grouped = _run(experts, rows, counts, False), _run(experts, rows, counts, True)
    assert torch.equal(loop[0], grouped[0]) and torch.equal(loop[1], grouped[1])
    for a, b in zip(loop[2], grouped[2], strict=True):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)
    assert all(p.grad is None for p in experts[1].parameters()) and all(p.grad is None for p in experts[4].parameters())


def test_the_setting_turns_the_grouped_gemm_off_and_other_devices_keep_the_loop():
    weights = [torch.zeros(4, 8) for _ in range(3)]
    assert grouped_gemm_usable(weights)
    assert isinstance(SWIGLU.fuse(weights).gate_up, torch.Tensor)
    set_grouped_gemm(False)
    assert not grouped_gemm_usable(weights)
    assert isinstance(SWIGLU.fuse(weights).gate_up, list)
    set_grouped_gemm(True)
    assert not grouped_gemm_usable([w.to(torch.float64) for w in weights])  # grouped_mm has no float64 kernel
    assert not grouped_gemm_usable([w.to("meta") for w in weights])


def test_grouped_mm_keeps_the_signature_the_experts_call():
    params = inspect.signature(F.grouped_mm).parameters
    assert list(params)[:2] == ["mat_a", "mat_b"]
    assert params["offs"].kind is inspect.Parameter.KEYWORD_ONLY and params["offs"].default is None


def _meta_swiglu(hidden: int, inter: int, dtype: torch.dtype) -> None:
    """Every grouped_mm call of the SwiGLU path on meta tensors: torch's meta kernel runs _grouped_mm_cuda's
    argument checks."""
    num, counts = 4, [5, 0, 9, 2]
    spans = ex.expert_spans(counts)
    rows = sum(counts)
    meta = {"device": "meta", "dtype": dtype}
    w = SwiGLUWeights(torch.empty(num, 2 * inter, hidden, **meta), torch.empty(num, hidden, inter, **meta), True)
    x, out = torch.empty(rows, hidden, **meta), torch.empty(rows, hidden, **meta)
    run = swiglu_forward(x, spans, w, out)
    grad_x = torch.empty(rows, hidden, **meta)
    d_gate_up = swiglu_backward_input(run, torch.empty(rows, hidden, **meta), w, grad_x)
    grads: list = [None] * (2 * num)
    swiglu_backward_weights(run, d_gate_up, torch.empty(rows, hidden, **meta), x, grads, grouped=True)
    assert grads[0].shape == (2 * inter, hidden) and grads[1].shape == (hidden, inter) and grads[2] is None


def _meta_clamped(hidden: int, inter: int, dtype: torch.dtype) -> None:
    num, counts = 3, [4, 6, 0]
    spans = ex.expert_spans(counts)
    rows = sum(counts)
    meta = {"device": "meta", "dtype": dtype}
    fused = (torch.empty(num, hidden, 2 * inter, **meta), torch.empty(num, 2 * inter, **meta),
             torch.empty(num, inter, hidden, **meta), torch.empty(num, hidden, **meta), True)  # fmt: skip
    kind = ClampedSwiGLU()
    x, out = torch.empty(rows, hidden, **meta), torch.empty(rows, hidden, **meta)
    # the row biases come from counts on the CPU; on meta tensors repeat_interleave needs output_size, given
    run = kind.forward(x, spans, fused, out)
    grad_x = torch.empty(rows, hidden, **meta)
    saved = kind.backward_input(run, torch.empty(rows, hidden, **meta), fused, grad_x)
    grads: list = [None] * (4 * num)
    kind.backward_weights(run, saved, torch.empty(rows, hidden, **meta), x, grads)
    assert grads[0].shape == (hidden, 2 * inter) and grads[2].shape == (inter, hidden) and grads[8] is None


@pytest.mark.parametrize("meta_run", [_meta_swiglu, _meta_clamped])
def test_the_grouped_calls_meet_grouped_mms_cuda_rules_in_bf16(meta_run):
    meta_run(64, 32, torch.bfloat16)  # what grouped_gemm_usable lets through on CUDA: bf16, dims multiples of 8


@pytest.mark.parametrize("meta_run", [_meta_swiglu, _meta_clamped])
def test_grouped_mms_cuda_rules_refuse_what_grouped_gemm_usable_keeps_on_the_loop(meta_run):
    with pytest.raises(RuntimeError, match="BF16"):
        meta_run(64, 32, torch.float32)  # the trainer's float32 weights on CUDA run expert by expert
    with pytest.raises(RuntimeError, match="16 bytes"):
        meta_run(60, 32, torch.bfloat16)  # a hidden size not a multiple of 8


def test_weights_whose_strides_grouped_mm_refuses_keep_the_loop():
    """grouped_mm wants 16-byte strides on the CPU too: a hidden or intermediate size of 6 float32 values (24
    bytes) runs expert by expert, with the same results."""
    assert not grouped_gemm_usable([torch.zeros(4, 6) for _ in range(3)])
    assert not grouped_gemm_usable([torch.zeros(6, 8) for _ in range(3)])
    assert grouped_gemm_usable([torch.zeros(4, 8) for _ in range(3)])
    torch.manual_seed(0)
    experts = [_Swi(6, 5) for _ in range(3)]
    counts = [2, 0, 3]
    rows = torch.randn(5, 6)
    loop, grouped = _run(experts, rows, counts, False), _run(experts, rows, counts, True)
    assert torch.equal(loop[0], grouped[0])
