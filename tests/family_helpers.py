"""Shared by the family tests (tests/test_family_*.py, tests/test_model_hf_parity.py): a left-padded batch, the
logits comparison against transformers, the edits that make a bad checkpoint out of a good one, and the pieces of
the EP=2 gloo workers that run their rows and save their logits and expert gradients; and the bytes a forward
keeps for its backward (the memory tables' activation terms are checked against it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from steps.models.placement import is_expert_param


def left_padded_batch(vocab: int, seed: int = 0, length: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and positions [3, length]: row 0 unpadded, rows 1 and 2 left-padded by 4 and 7."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, length), generator=gen)
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # what HF generate passes for left-padded prompts
    return ids, mask, positions


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, atol: float = 1e-4) -> None:
    """fp32 logits equal within `atol` at the real (mask 1) tokens, and not near zero."""
    real = mask.bool()
    assert ours.dtype == torch.float32 and not torch.isnan(ours).any()
    torch.testing.assert_close(ours[real], theirs[real], atol=atol, rtol=0)
    assert ours[real].abs().mean() > 0.1  # a real comparison, not two near-zero tensors


def edit_config(directory: Path, **changes) -> None:
    """Set entries of directory/config.json (None: remove the entry)."""
    path = directory / "config.json"
    d = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    path.write_text(json.dumps(d))


def rewrite_weights(directory: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Apply `change` to the tensors of directory/model.safetensors in place and save them back."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def probe_batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded batch (seed `seed`) and a random probe of its logits' shape (seed `seed + 1`): the loss
    sum(logits * probe) gives every logit a gradient."""
    ids, mask, _ = left_padded_batch(vocab, seed=seed)
    probe = torch.randn(*ids.shape, vocab, generator=torch.Generator().manual_seed(seed + 1))
    return ids, mask, probe


def save_rows_and_expert_grads(
    model: torch.nn.Module, rank: int, rows: slice, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out_dir
) -> None:
    """An EP rank's part: the logits of its `rows` of `batch` (probe_batch), the backward of sum(logits * probe),
    and out_dir/rank{rank}.safetensors with the logits and its experts' gradients (grad.NAME; zeros for an expert no
    row chose, which has none: group-limited routing leaves some)."""
    ids, mask, probe = batch
    logits = model(ids[rows], mask[rows])
    (logits * probe[rows]).sum().backward()
    out = {f"grad.{n}": torch.zeros_like(p) if p.grad is None else p.grad
           for n, p in model.named_parameters() if is_expert_param(n)}  # fmt: skip
    save_file({"logits": logits.detach(), **out}, str(out_dir / f"rank{rank}.safetensors"))


def expert_grads(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The experts' gradients a rank saved (save_rows_and_expert_grads), under their parameter names."""
    return {k.removeprefix("grad."): v for k, v in saved.items() if k.startswith("grad.")}


def saved_activation_bytes(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """Bytes of what model(input_ids)'s graph keeps for the backward, each storage once, the parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids)
    return sum(saved.values())


def right_padded_batch(
    vocab: int, seed: int, length: int = 11, real: tuple[int, int] = (7, 4)
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and mask [3, length]: row 0 whole, rows 1 and 2 right-padded after real[0] and real[1] real tokens (the
    trainer's rows)."""
    ids = torch.randint(0, vocab, (3, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, length, dtype=torch.long)
    mask[1, real[0] :], mask[2, real[1] :] = 0, 0
    return ids, mask


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 1e-4) -> None:
    """Gradients equal up to fp32 rounding: max |got - want| <= rel * max |want| (summed log-probs' gradients reach
    hundreds, where an elementwise atol of 1e-5 is below fp32's resolution)."""
    scale = float(want.abs().max())
    assert scale > 0, name
    assert float((got - want).abs().max()) <= rel * scale, (name, float((got - want).abs().max()), scale)


def assert_engine_records_the_routers_choice(directory: Path, vocab: int) -> None:
    """The torch engine opened with record_routes on checkpoint `directory` records, for every sample, every MoE
    layer's experts at every position fed (prompt + response - 1), as the model's routers choose them in one
    training forward over the sample (a family it decodes with its own state runs every layer at every position)."""
    import numpy as np

    from steps.engines.interface import GenerationRequest, SamplingParams
    from steps.engines.torch_engine import TorchEngine

    engine = TorchEngine.from_checkpoint(directory, record_routes=True)
    model = engine.model
    prompts = [(3, 7, 11, 5), (vocab - 2,), (9, 8, 7, 6, 5, 4, 3)]
    requests = [GenerationRequest(f"p{i}", p, k, seed=10 * i + k) for i, p in enumerate(prompts) for k in range(2)]
    generations = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=8))
    blocks = model.moe_blocks()
    for request, g in zip(requests, generations, strict=True):
        ids = list(request.prompt_ids) + g.response_ids[:-1]
        chosen: list[torch.Tensor] = []
        for block in blocks:
            block.recorded_choices = chosen
        try:
            with torch.no_grad():
                model(torch.tensor([ids]))
        finally:
            for block in blocks:
                block.recorded_choices = None
        own = torch.stack(chosen, dim=1).numpy()
        routes = g.routed_experts
        assert routes.shape == (len(ids), len(blocks), blocks[0].top_k) and (routes >= 0).all()
        assert np.array_equal(np.sort(routes, -1), np.sort(own, -1))
