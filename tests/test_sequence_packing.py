"""trainer.sequence_packing: a micro-batch's sequences in one row without padding. The packed mask is each
sequence's causal mask on the diagonal and nothing else; every family's packed forward gives each sequence the
logits it gets alone (sliding windows and rotary positions start again per sequence); the trainer's log-probs,
entropies and gradients equal the padded micro-batch's to float rounding; the update step runs it from the run
config; and it is refused beside shared_prompts."""

from __future__ import annotations

import pytest
import torch
from test_expert_parallel_training import old_logprobs, samples
from test_family_deepseek_v3 import moerl_config as deepseek_config
from test_family_gpt_oss import CONFIGS as GPT_OSS_CONFIGS
from test_family_gpt_oss import our_config as gpt_oss_config
from test_update_experience import experience_table, make_run, start_ranks, tiny_model, wait_ranks, write_experience

from steps.errors import MoerlError
from steps.expert_parallel.mesh import Mesh
from steps.models.layers import AttentionMasks
from steps.models.registry import family_of
from steps.run.config import validate_config
from steps.run.keys import update_metrics_key
from steps.store.object_store import Store
from steps.training.micro_batch import collate
from steps.training.rl_loss import LossSettings
from steps.training.trainer import PolicyTrainer, TrainSettings


def test_the_packed_mask_is_each_sequences_causal_mask_on_the_diagonal():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    mask = AttentionMasks.packed(torch.ones_like(segments, dtype=torch.bool), segments, positions)
    for window in (None, 2):
        got = mask.get(window)[0, 0]
        for start, end in ((0, 3), (3, 5), (5, 9)):
            alone = AttentionMasks.causal(torch.ones(1, end - start, dtype=torch.bool), positions[:, start:end])
            assert torch.equal(got[start:end, start:end], alone.get(window)[0, 0])
        block = torch.block_diag(*(torch.ones(n, n) for n in (3, 2, 4))).bool()
        assert not got[~block].any()  # nothing across sequences


def tiny_models() -> dict[str, torch.nn.Module]:
    """A tiny Qwen3-MoE, DeepSeek-V3 (MLA, dense first layer) and gpt-oss (sliding windows, sinks)."""
    out = {"qwen3_moe": tiny_model(0)}
    for name, cfg in (("deepseek_v3", deepseek_config("q_lora_yarn_interleave")),
                      ("gpt_oss", gpt_oss_config(GPT_OSS_CONFIGS["yarn_window4"]))):  # fmt: skip
        torch.manual_seed(3)
        out[name] = family_of(cfg).build(cfg)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_packed_row_gives_each_sequence_its_own_logits(family):
    model = tiny_models()[family].eval()
    gen = torch.Generator().manual_seed(1)
    lengths = (7, 3, 9)  # gpt-oss's window of 4 is shorter than two of them
    seqs = [torch.randint(1, model.config.vocab_size, (1, n), generator=gen) for n in lengths]
    with torch.no_grad():
        alone = [model(s) for s in seqs]
        segments = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
        packed = model(torch.cat(seqs, dim=1), None, segments)
    start = 0
    for n, logits in zip(lengths, alone, strict=True):
        torch.testing.assert_close(packed[:, start : start + n], logits, atol=1e-5, rtol=1e-5)
        start += n


def test_the_trainers_logprobs_and_gradients_are_the_padded_ones():
    batch = samples()
    ids = list(range(len(batch)))
    results = {}
    for packed in (False, True):
        model = tiny_model(0)
        settings = TrainSettings(loss=LossSettings(kl_coef=0.0), micro_batch_size=len(ids), sequence_packing=packed)
        trainer = PolicyTrainer(model, Mesh(), settings, torch.optim.SGD(model.parameters(), lr=0.1))
        (mb,) = [collate(batch, ids, torch.device("cpu"), old_logps=old_logprobs(batch), packed=packed)]
        assert (mb.packed is not None) == packed
        if packed:  # no padding in the packed row: exactly the real tokens
            assert mb.packed.input_ids.shape[1] == int(mb.attention_mask.sum()) < mb.attention_mask.numel()
        logp, logits = trainer.forward_logprobs(model, mb)
        entropy = trainer.token_entropies(mb, logits.detach())
        sums = trainer.backward_step([mb], trainer.normalizer(batch, ids))
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[packed] = (logp.detach()[mb.loss_mask], entropy[mb.loss_mask], sums, grads)
    (logp, entropy, sums, grads), (plogp, pentropy, psums, pgrads) = results[False], results[True]
    torch.testing.assert_close(plogp, logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pentropy, entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(psums, sums, atol=1e-4, rtol=1e-5)
    assert pgrads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(pgrads[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_the_update_step_packs_from_the_run_config(tmp_path):
    losses = {}
    for packed in (False, True):
        (tmp_path / str(packed)).mkdir()
        run_uri = make_run(tmp_path / str(packed), trainer={"sequence_packing": packed})
        write_experience(run_uri, 1, experience_table(policy_version=0, prompts=4, group=4))
        results = wait_ranks(start_ranks(run_uri, 1, 2))
        assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:]
        losses[packed] = Store.open(run_uri).get_json(update_metrics_key(1))["update"]["loss"]
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)


def test_packing_is_refused_beside_shared_prompts():
    base = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}
    with pytest.raises(MoerlError, match="trainer.sequence_packing: packs whole sequences, while shared_prompts"):
        validate_config({**base, "trainer": {"sequence_packing": True, "shared_prompts": True}})
    assert validate_config({**base, "trainer": {"sequence_packing": True}}).trainer.sequence_packing
