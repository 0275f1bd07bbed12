"""The trainer's memory and speed settings give the plain update: activation checkpointing
(trainer.activation_checkpointing) and the experts as one grouped GEMM (trainer.grouped_gemm), alone and
together, on 4 CPU ranks over gloo as EP=2 x DP=2 (the all-to-all dispatch, AdamW, the routers trained with
their load-balancing loss, the routed rows counted once), bit for bit; each family's forward, shared-prompt
forward and gradients under checkpointing, bit for bit; and checkpointing keeps less of the forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_expert_parallel import run_gloo
from test_expert_parallel_training import MICRO_BATCH, old_logprobs, samples, sharded
from test_sequence_packing import tiny_models
from test_update_experience import experience_table, make_run, start_ranks, tiny_model, wait_ranks, write_experience

from steps.demo.char_tokenizer import save_tokenizer
from steps.expert_parallel.dispatch import make_dispatch
from steps.expert_parallel.mesh import all_reduce_sum, build_mesh, sync_gradients
from steps.import_sft import import_sft
from steps.models.experts import set_grouped_gemm
from steps.models.hf_checkpoint import save_pretrained
from steps.models.placement import ExpertPlacement
from steps.publish import publish
from steps.run.candidate import MARKER
from steps.run.config import RunConfig
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store
from steps.training.micro_batch import collate
from steps.training.optimizer_state import optimizer_state_tensors
from steps.training.rl_loss import LossSettings
from steps.training.sharding import full_tensor, shard_experts, shard_non_experts
from steps.training.trainer import PolicyTrainer, TrainSettings, rank_micro_batches

# name -> the settings on; "plain" (none) is what the others must equal
SETTINGS: dict[str, set[str]] = {
    "plain": set(),
    "checkpointing": {"activation_checkpointing"},
    "grouped": {"grouped_gemm"},
    "checkpointing+grouped": {"activation_checkpointing", "grouped_gemm"},
    "fsdp": {"fsdp"},
    "fsdp+checkpointing+grouped": {"fsdp", "activation_checkpointing", "grouped_gemm"},
    "shard_experts": {"shard_experts"},
    "packing": {"sequence_packing"},
    "everything": {"activation_checkpointing", "grouped_gemm", "fsdp", "shard_experts", "sequence_packing"},
}
# FSDP2 reduce-scatters the gradients where the plain update all-reduces them, and a packed row runs
# its matmuls over other shapes than the padded rows: the same sums in another order, so those agree to float32
# rounding, not bit for bit.
FSDP_TOLERANCE = {"atol": 2e-6, "rtol": 1e-5}
PACKING_TOLERANCE = {"atol": 2e-5, "rtol": 1e-4}


def ep_rank_setup(rank: int, world: int, ep: int) -> tuple:
    """This gloo rank's mesh, the contiguous expert placement, the all-to-all dispatch, the samples and their ids."""
    mesh = build_mesh(rank, world, ep, torch.device("cpu"))
    num_experts, num_layers = tiny_model().config.num_experts, len(tiny_model().moe_blocks())
    placement = ExpertPlacement.contiguous(num_layers, num_experts, ep)
    batch = samples()
    return mesh, placement, make_dispatch("alltoall", mesh, num_experts), batch, list(range(len(batch)))


def update_every_setting(rank: int, world: int, out_dir: Path, ep: int) -> None:
    """Two AdamW steps of the PPO objective on this rank's share, once per setting, from the same weights."""
    mesh, placement, dispatch, batch, everything = ep_rank_setup(rank, world, ep)
    for name, on in SETTINGS.items():
        packing = "sequence_packing" in on
        micro = [
            collate(batch, ids, mesh.device, old_logps=old_logprobs(batch), packed=packing)
            for ids in rank_micro_batches(everything, mesh, MICRO_BATCH)
        ]
        assert all((mb.packed is not None) == packing for mb in micro if mb.sample_ids)
        model = sharded(tiny_model(0), placement, mesh.ep_rank)
        model.set_dispatch(dispatch)
        if "shard_experts" in on:
            assert shard_experts(model, mesh)
        if "fsdp" in on:
            assert shard_non_experts(model, mesh)
        checkpointing, grouped = "activation_checkpointing" in on, "grouped_gemm" in on
        model.router_aux_loss_coef = 0.05
        model.activation_checkpointing = checkpointing
        model.count_routed_rows()
        set_grouped_gemm(grouped)
        settings = TrainSettings(
            loss=LossSettings(clip_low=0.2, clip_high=0.28, loss_agg="token-mean", kl_coef=0.0, is_cap=2.0),
            micro_batch_size=MICRO_BATCH, grad_clip=1.0,
        )  # fmt: skip
        trainer = PolicyTrainer(model, mesh, settings, torch.optim.AdamW(model.parameters(), lr=1e-2))
        out = {}
        for step in range(2):
            local = trainer.backward_step(micro, trainer.normalizer(batch, everything))
            out[f"stats{step}"] = all_reduce_sum(local[:10], mesh).float()
            sync_gradients(model, mesh)
            out.update({f"grad{step}.{n}": full_tensor(p.grad).clone() for n, p in model.named_parameters()})
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        out.update({f"weight.{n}": full_tensor(p.detach()).clone() for n, p in model.named_parameters()})
        out.update({f"state.{n}": t for n, t in optimizer_state_tensors(model, trainer.optimizer).items()})
        out["routed_rows"] = model.routed_rows().float()
        save_file(out, str(out_dir / f"{name}.rank{rank}.safetensors"))
    set_grouped_gemm(True)


def test_every_setting_gives_the_plain_update_on_ep2_by_dp2(tmp_path):
    run_gloo(update_every_setting, 4, tmp_path, 2, timeout=900)
    padding_routed: dict[str, float] = {}
    for rank in range(4):
        plain = load_file(tmp_path / f"plain.rank{rank}.safetensors")
        assert plain["stats0"][0] != 0 and plain["routed_rows"].sum() > 0
        for name in SETTINGS:
            got = load_file(tmp_path / f"{name}.rank{rank}.safetensors")
            assert got.keys() == plain.keys()
            for key in plain:
                where, on = f"{name}, rank {rank}: {key}", SETTINGS[name]
                if "sequence_packing" in on and key == "routed_rows":  # the padded rows route their padding too
                    assert 0 < got[key].sum() <= plain[key].sum(), where
                    padding_routed[name] = padding_routed.get(name, 0) + float(plain[key].sum() - got[key].sum())
                elif "sequence_packing" in on:
                    torch.testing.assert_close(got[key], plain[key], **PACKING_TOLERANCE, msg=where)
                elif on & {"fsdp", "shard_experts"}:
                    torch.testing.assert_close(got[key], plain[key], **FSDP_TOLERANCE, msg=where)
                else:
                    assert torch.equal(got[key], plain[key]), f"{where} differs from the plain update"
    assert padding_routed["packing"] > 0 and padding_routed["everything"] > 0  # packing routes no padding
    grads = load_file(tmp_path / "plain.rank0.safetensors")
    assert any(".gate." in k and v.abs().sum() > 0 for k, v in grads.items() if k.startswith("grad0."))  # routers


def _grads_of(model: torch.nn.Module, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = run()
    (logits.square().mean() + (model.aux_loss if model.aux_loss is not None else 0)).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_checkpointing_gives_each_familys_logits_and_gradients_bit_for_bit(family):
    model = tiny_models()[family]
    model.router_aux_loss_coef = 0.1
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, vocab, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    prompt_ids, prompt_mask = ids[:2, :5], torch.ones(2, 5, dtype=torch.long)
    response_ids, response_mask = ids[:, 5:], torch.ones(3, 4, dtype=torch.long)
    response_mask[2, 2:] = 0
    prompt_index = torch.tensor([0, 0, 1])
    runs = {
        "forward": lambda: model(ids, mask),
        "forward_shared_prompts": lambda: model.forward_shared_prompts(
            prompt_ids, prompt_mask, response_ids, response_mask, prompt_index
        ),
    }
    for what, run in runs.items():
        results = {}
        for checkpointing in (False, True):
            model.activation_checkpointing = checkpointing
            model.count_routed_rows()
            logits, grads = _grads_of(model, run)
            results[checkpointing] = (logits, grads, model.routed_rows().clone(), model.aux_loss.detach())
        (logits, grads, rows, aux), (logits_ac, grads_ac, rows_ac, aux_ac) = results[False], results[True]
        assert torch.equal(logits, logits_ac) and torch.equal(aux, aux_ac), what
        assert torch.equal(rows, rows_ac), f"{what}: checkpointing counted the routed rows again"
        assert grads.keys() == grads_ac.keys() and any(".gate." in k or "router" in k for k in grads)
        for name in grads:
            assert torch.equal(grads[name], grads_ac[name]), f"{what}: {name}"


def test_checkpointing_keeps_less_of_the_forward_for_the_backward():
    model = tiny_model(0, num_hidden_layers=4)
    ids = torch.randint(1, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))

    def saved_bytes(checkpointing: bool) -> int:
        model.activation_checkpointing = checkpointing
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids).sum()
        return total[0]

    plain, checkpointed = saved_bytes(False), saved_bytes(True)
    assert checkpointed < plain / 2, (checkpointed, plain)
    with torch.no_grad():  # a forward without a graph (log-probs, scoring) is never checkpointed
        model.activation_checkpointing = True
        assert torch.equal(model(ids), model(ids))


def test_the_update_step_with_both_settings_writes_the_plain_candidate(tmp_path):
    """The real update step (two ranks, EP=2) from the run config: the candidate's weight and optimizer files
    with checkpointing and the grouped GEMM on are the plain update's, byte for byte."""
    files = {}
    for name, trainer in (("plain", {"activation_checkpointing": False, "grouped_gemm": False}),
                          ("both", {"activation_checkpointing": True, "grouped_gemm": True})):  # fmt: skip
        (tmp_path / name).mkdir()
        run_uri = make_run(tmp_path / name, trainer=trainer)
        write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
        results = wait_ranks(start_ranks(run_uri, 1, 2))
        assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
        marker = Store.open(run_uri).get_json(f"{candidate_prefix(1)}/{MARKER}")
        files[name] = {f: d["sha256"] for f, d in marker["files"].items() if f.endswith(".safetensors")}
    assert {f.split("-")[0] for f in files["plain"]} >= {"model", "optimizer"}
    assert files["both"] == files["plain"]


def _candidate_tensors(run: Store, iteration: int, workdir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of candidate `iteration`'s weight and optimizer files, by file and name."""
    marker = run.get_json(f"{candidate_prefix(iteration)}/{MARKER}")
    out = {}
    for name in sorted(f for f in marker["files"] if f.endswith(".safetensors")):
        run.get_file(f"{candidate_prefix(iteration)}/{name}", workdir / name)
        out.update({f"{name}:{k}": v for k, v in load_file(workdir / name).items()})
    return out


def bf16_run(tmp_path: Path, trainer: dict) -> str:
    """make_run's run, its v000000 in bf16 (so the fp32 masters travel with the AdamW state)."""
    sft = tmp_path / "sft"
    save_pretrained(tiny_model().to(torch.bfloat16), sft)
    save_tokenizer(sft)
    run_uri = (tmp_path / "run").as_uri()
    cfg = RunConfig(sft_checkpoint=sft.as_uri(), run_store=run_uri,
                    trainer={"ep_backend": "alltoall", "micro_batch_size": 4, "lr": 1e-2, **trainer})  # fmt: skip
    import_sft(sft.as_uri(), run_uri, cfg.model_dump_json())
    return run_uri


# run -> (its trainer settings, the plain run it must equal, what its update says it sharded)
UPDATE_RUNS = {
    "plain": ({}, None, None),
    "fsdp": ({"fsdp": True, "activation_checkpointing": True}, "plain", "sharded over 2 ranks"),
    "plain-dp2": ({"ep_size": 1}, None, None),
    "experts": ({"ep_size": 1, "shard_experts": True, "fsdp": True, "sequence_packing": True}, "plain-dp2",
                "experts sharded over its 2 dp replicas"),
}


def test_the_update_step_with_sharding_trains_two_iterations_as_the_plain_one(tmp_path):
    """trainer.fsdp (EP=2) and trainer.shard_experts with fsdp and packing (EP=1 x DP=2) in the real update step,
    two ranks, two iterations: the second restores the first's AdamW state and masters (bf16 weights) into the
    sharded parameters; the candidates' tensors are the plain update's to float32 rounding, the same files and
    names."""
    tensors = {}
    for name, (trainer, _, says) in UPDATE_RUNS.items():
        (tmp_path / name).mkdir()
        run_uri = bf16_run(tmp_path / name, trainer)
        run = Store.open(run_uri)
        for iteration in (1, 2):
            write_experience(run_uri, iteration, experience_table(policy_version=iteration - 1, prompts=4, group=4))
            results = wait_ranks(start_ranks(run_uri, iteration, 2))
            assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
            assert says is None or says in results[0][1], results[0][1]
            if iteration == 1:
                publish(run_uri, 1)
        tensors[name] = _candidate_tensors(run, 2, tmp_path / name)
    assert any(".master" in k for k in tensors["plain"])  # bf16 weights: the fp32 masters travel with the state
    for name, (_, plain, _) in UPDATE_RUNS.items():
        if plain is None:
            continue
        assert tensors[name].keys() == tensors[plain].keys(), name
        for key, value in tensors[plain].items():
            torch.testing.assert_close(tensors[name][key].float(), value.float(), atol=1e-5, rtol=1e-2,
                                       msg=f"{name}: {key}")  # fmt: skip


def test_a_trainer_that_stays_up_with_fsdp_trains_the_bytes_of_plain_fsdp_updates(tmp_path):
    """trainer.fsdp with trainer.server: update 1 from the store, update 2 from what the trainer holds (whole
    tensors gathered from the shards, cut again for the next update) write the bytes the update step writes."""
    from test_trainer_server import TRAINER, candidate_files, client, kill_tree, new_run, plain_update, start_trainer

    settings = {**TRAINER, "fsdp": True, "server_wait_s": 300}
    runs = {name: new_run(tmp_path / name, "bf16", settings) for name in ("plain", "served")}
    for run_uri in runs.values():
        for i in (1, 2):
            write_experience(run_uri, i, experience_table(policy_version=i - 1, prompts=4, group=4, seed=i))
    files = {"plain": {}, "served": {}}
    for i in (1, 2):
        done = plain_update(runs["plain"], i)
        assert done.returncode == 0 and "sharded over 2 ranks" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
        files["plain"][i] = candidate_files(runs["plain"], i)
        publish(runs["plain"], i)
    log = tmp_path / "trainer.log"
    trainer = start_trainer(runs["served"], log)
    try:
        for i, source in ((1, "store"), (2, "memory")):
            done = client(runs["served"], i)
            assert done.returncode == 0, done.stdout[-3000:] + log.read_text()[-3000:]
            assert f"update {i}: trained by trainer ({source})" in done.stdout
            files["served"][i] = candidate_files(runs["served"], i)
            publish(runs["served"], i)
    finally:
        kill_tree(trainer)
    assert "sharded over 2 ranks" in log.read_text()
    for i in (1, 2):
        assert {n: f["sha256"] for n, f in files["served"][i].items()} == {
            n: f["sha256"] for n, f in files["plain"][i].items()}, i


def shared_prompt_step(rank: int, world: int, out_dir: Path, ep: int) -> None:
    """One trainer step on GRPO groups (forward_shared_prompts), plain and with fsdp + checkpointing."""
    from steps.training.micro_batch import collate_groups
    from steps.training.trainer import rank_group_micro_batches

    mesh, placement, dispatch, batch, everything = ep_rank_setup(rank, world, ep)
    micro = [collate_groups(batch, ids, mesh.device) for ids in rank_group_micro_batches(everything, batch, mesh, 6)]
    for name, sharded_run in (("plain", False), ("fsdp", True)):
        model = sharded(tiny_model(0), placement, mesh.ep_rank)
        model.set_dispatch(dispatch)
        if sharded_run:
            assert shard_non_experts(model, mesh)
            model.activation_checkpointing = True
        settings = TrainSettings(loss=LossSettings(kl_coef=0.0), micro_batch_size=6, shared_prompts=True)
        trainer = PolicyTrainer(model, mesh, settings, torch.optim.SGD(model.parameters(), lr=0.5))
        trainer.step(micro, trainer.normalizer(batch, everything))
        out = {f"weight.{n}": full_tensor(p.detach()).clone() for n, p in model.named_parameters()}
        save_file(out, str(out_dir / f"{name}.rank{rank}.safetensors"))


def test_shared_prompts_run_through_fsdp_and_checkpointing(tmp_path):
    """forward_shared_prompts is a forward FSDP2 is told of (register_fsdp_forward_method), on the model and on
    each layer, and runs under checkpointing: the step's weights are the plain one's."""
    run_gloo(shared_prompt_step, 2, tmp_path, 2, timeout=600)
    for rank in range(2):
        plain = load_file(tmp_path / f"plain.rank{rank}.safetensors")
        got = load_file(tmp_path / f"fsdp.rank{rank}.safetensors")
        assert got.keys() == plain.keys()
        for key in plain:
            torch.testing.assert_close(got[key], plain[key], **FSDP_TOLERANCE, msg=key)
        assert any(not torch.equal(plain[k], tiny_model(0).state_dict()[k[7:]]) for k in plain)  # it trained
