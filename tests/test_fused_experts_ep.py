"""A family whose checkpoint fuses each MoE layer's experts into one tensor (gpt-oss: `mlp.experts.gate_up_proj`
[E, H, 2I], ...) under expert parallelism: an EP rank reads only its experts' rows of the fused tensors
(steps/models/hf_checkpoint.py read_expert_rows), and the candidate writer gathers each fused tensor's slices over
the EP group to the EP rank that writes it, in global expert order whatever the placement
(steps/training/candidate_writer.py _stored), so that the candidate publishes with its weight deltas. The whole
workflow on two EP ranks: tests/test_family_workflows.py (gpt_oss)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from model_helpers import randomize_
from safetensors.torch import load_file, save_file
from test_candidate_writers import update_worker
from test_expert_parallel import run_gloo
from test_family_gpt_oss import EP_CONFIG, EP_PLACEMENT, ep_full_model, our_config
from test_update_experience import experience_table, write_experience

from steps.demo.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer
from steps.expert_parallel.mesh import build_mesh
from steps.import_sft import import_sft
from steps.models import hf_checkpoint
from steps.models.gpt_oss.model import GptOssCausalLM
from steps.models.gpt_oss.spec import GPT_OSS
from steps.models.hf_checkpoint import load_pretrained, save_pretrained
from steps.publish import publish
from steps.run import candidate, checkpoint, weight_delta
from steps.run.config import RunConfig
from steps.store.object_store import Store
from steps.training import candidate_writer

ADAPTER = GPT_OSS.state_dict_adapter


# ---------------------------------------------------------------------------------------------- loading


class CountingOpen:
    """safetensors.safe_open that counts the bytes of each tensor read (whole, or through a slice)."""

    def __init__(self, real, read: dict[str, int], *args, **kwargs) -> None:
        self.file, self.read = real(*args, **kwargs), read

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.file.keys()

    def get_tensor(self, name):
        t = self.file.get_tensor(name)
        self.read[name] = self.read.get(name, 0) + t.nbytes
        return t

    def get_slice(self, name):
        return CountingSlice(self.file.get_slice(name), name, self.read)


class CountingSlice:
    def __init__(self, real, name: str, read: dict[str, int]) -> None:
        self.real, self.name, self.read = real, name, read

    def get_shape(self):
        return self.real.get_shape()

    def get_dtype(self):
        return self.real.get_dtype()

    def __getitem__(self, index):
        t = self.real[index]
        self.read[self.name] = self.read.get(self.name, 0) + t.nbytes
        return t


def test_an_ep_rank_reads_only_its_experts_rows_of_the_fused_tensors(tmp_path, monkeypatch):
    full = ep_full_model()
    save_pretrained(full, tmp_path / "full")
    stored = hf_checkpoint.load_state_dict_from_dir(tmp_path / "full")
    fused = {f.name: f for f in ADAPTER.fused_experts(full.config)}
    assert len(fused) == 3 * 4 and all(stored[name].shape == f.shape for name, f in fused.items())
    real = hf_checkpoint.safe_open
    for ep_rank in range(EP_PLACEMENT.ep_size):
        read: dict[str, int] = {}
        monkeypatch.setattr(hf_checkpoint, "safe_open", lambda *a, read=read, **k: CountingOpen(real, read, *a, **k))
        model = load_pretrained(tmp_path / "full", placement=EP_PLACEMENT, ep_rank=ep_rank)
        monkeypatch.setattr(hf_checkpoint, "safe_open", real)
        assert set(read) == set(stored)
        for name, tensor in stored.items():  # a fused tensor: its two experts of four (placement: not contiguous)
            assert read[name] == tensor.nbytes // (2 if name in fused else 1), name
        # the rank's experts, and only them, with the full model's values
        held = {f"model.layers.{n}.mlp.experts.{e}." for n in range(3) for e in EP_PLACEMENT.held(n, ep_rank)}
        mine = model.state_dict()
        assert {n for n in mine if ".experts." in n} == {
            n for n in full.state_dict() if ".experts." in n and n.rsplit(".", 1)[0] + "." in held
        }
        for name, tensor in mine.items():
            assert torch.equal(tensor, full.state_dict()[name]), name
    whole = load_pretrained(tmp_path / "full")  # without a placement: every expert, read whole
    assert all(torch.equal(t, full.state_dict()[n]) for n, t in whole.state_dict().items())


# ---------------------------------------------------------------------------------------------- writing


def gather_worker(rank: int, world: int, out_dir: Path) -> None:
    """EP rank `rank` of EP_PLACEMENT (not contiguous): its stored weights (bf16), its delta parent's bits and its
    weight file's byte estimate."""
    mesh = build_mesh(rank, world, 2, torch.device("cpu"))
    model = load_pretrained(out_dir / "full", placement=EP_PLACEMENT, ep_rank=mesh.ep_rank)
    stored = candidate_writer._stored(model, mesh, torch.bfloat16)
    bits = candidate_writer.stored_bits(model, mesh, torch.bfloat16)
    headers = {n: ("BF16", tuple(t.shape)) for n, t in stored.items()}
    assert {n: (d, s) for n, (d, s, _) in bits.tensors.items()} == headers
    assert all(bits.tensors[n][2] == t.view(torch.uint8).numpy().tobytes() for n, t in stored.items())
    save_file(stored, str(out_dir / f"stored{rank}.safetensors"))
    sizes = candidate_writer._shard_bytes(model, mesh, torch.bfloat16)
    (out_dir / f"sizes{rank}.json").write_text(json.dumps(sizes))


def test_ep_ranks_write_the_full_models_fused_tensors_between_them(tmp_path):
    full = ep_full_model()
    save_pretrained(full, tmp_path / "full")
    run_gloo(gather_worker, 2, tmp_path)
    expected = {n: t.to(torch.bfloat16) for n, t in ADAPTER.to_hf(full.state_dict()).items()}
    fused = {f.name: f for f in ADAPTER.fused_experts(full.config)}
    got = [load_file(tmp_path / f"stored{rank}.safetensors") for rank in range(2)]
    assert not set(got[0]) & set(got[1]) and set(got[0]) | set(got[1]) == set(expected)
    for rank, tensors in enumerate(got):
        # EP rank 0: the replicated tensors and the fused ones of MoE layers 0 and 2; EP rank 1: those of layer 1
        assert {n for n in tensors if n in fused} == {n for n, f in fused.items() if f.moe_layer % 2 == rank}
        assert all(n in fused for n in tensors) or rank == 0
        for name, tensor in tensors.items():
            assert torch.equal(tensor, expected[name]), name
        sizes = json.loads((tmp_path / f"sizes{rank}.json").read_text())
        assert sizes[candidate.WEIGHTS] == sum(t.nbytes for t in tensors.values())


def gpt_oss_run(tmp_path: Path) -> str:
    """A file:// run store whose v000000 is a tiny gpt-oss (the demo's tokenizer), ep_size 2, deltas on."""
    sft = tmp_path / "sft"
    model = GptOssCausalLM(
        our_config({**EP_CONFIG, "vocab_size": VOCAB_SIZE, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
                    "pad_token_id": PAD_ID})
    )  # fmt: skip
    randomize_(model, seed=3, scale=0.2)
    save_pretrained(model, sft)
    save_tokenizer(sft)
    run_uri = (tmp_path / "run").as_uri()
    cfg = RunConfig(
        sft_checkpoint=sft.as_uri(), run_store=run_uri, rollout={"servers": 1}, checkpoint={"deltas": True},
        trainer={"ep_backend": "alltoall", "micro_batch_size": 4, "lr": 1e-2, "ep_size": 2},
    )  # fmt: skip
    import_sft(sft.as_uri(), run_uri, cfg.model_dump_json())
    return run_uri


def test_a_dp2_ep2_update_of_gpt_oss_publishes_with_the_ranks_deltas(tmp_path, capsys):
    """World 4 (ep 2, dp 2, two ranks a node): the weight files come from one dp row (the EP ranks gather the
    fused tensors), the optimizer files from either; the update indexes the deltas the ranks wrote (v000001
    usable before publish), publish keeps that index, and it rebuilds v000001 from v000000."""
    run_uri = gpt_oss_run(tmp_path)
    write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
    run_gloo(update_worker, 4, tmp_path, run_uri, 2, 2, True, timeout=300.0)
    wrote = {r: json.loads((tmp_path / f"wrote-{r}.json").read_text()) for r in range(4)}
    weight_rows = {r // 2 for r, keys in wrote.items() for k in keys if "/model-rank" in k}
    assert len(weight_rows) == 1, wrote
    assert sum(len(keys) for keys in wrote.values()) == 6  # 2 weight + 2 optimizer files, 2 delta blobs
    capsys.readouterr()
    publish(run_uri, 1)
    assert "(indexed by the update)" in capsys.readouterr().out
    run = Store.open(run_uri)
    v1 = checkpoint.fetch(run, 1)
    rebuilt = tmp_path / "rebuilt"
    rebuilt.mkdir()
    weight_delta.apply_delta(run, 1, checkpoint.fetch(run, 0), rebuilt)
    files = sorted(p.name for p in v1.glob("*.safetensors"))
    assert len(files) == 2
    for name in files:
        assert (rebuilt / name).read_bytes() == (v1 / name).read_bytes(), name
    trained, before = load_pretrained(v1), load_pretrained(checkpoint.fetch(run, 0))
    pairs = zip(trained.state_dict().values(), before.state_dict().values(), strict=True)
    assert any(not torch.equal(a, b) for a, b in pairs)
