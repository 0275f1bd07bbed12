"""steps.training.trainer.collate: right-padded prompt + response rows shifted for next-token targets, with the loss
mask on the response tokens and the engine's (and old) log-probs where those tokens are predicted."""

from __future__ import annotations

import torch

from steps.experience.tables import Sample
from steps.training.micro_batch import collate


def test_collate_lays_out_rows_of_different_lengths():
    samples = [
        Sample("p0", 0, prompt_ids=[5, 6, 7], response_ids=[8, 9], behavior_logprobs=[-0.5, -0.25], advantage=1.0),
        Sample("p1", 0, prompt_ids=[5, 6], response_ids=[3, 4, 2], behavior_logprobs=[-1, -2, -3], advantage=-0.5),
        Sample("p2", 0, prompt_ids=[4], response_ids=[2], behavior_logprobs=[-0.125], advantage=0.0),
    ]  # fmt: skip
    old = {0: torch.tensor([-0.4, -0.3]), 1: torch.tensor([-1.1, -2.1, -3.1]), 2: torch.tensor([-0.2])}
    mb = collate(samples, [1, 0, 2], torch.device("cpu"), pad_id=-1, old_logps=old)
    # row 0 = sample 1: tokens 5 6 3 4 2 (5 tokens, 4 positions); row 1 = sample 0: 5 6 7 8 9; row 2: 4 2
    assert mb.sample_ids == [1, 0, 2]
    assert mb.input_ids.tolist() == [[5, 6, 3, 4], [5, 6, 7, 8], [4, -1, -1, -1]]
    assert mb.targets.tolist() == [[6, 3, 4, 2], [6, 7, 8, 9], [2, -1, -1, -1]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [
        [False, True, True, True], [False, False, True, True], [True, False, False, False],
    ]  # fmt: skip
    assert mb.behavior_logp.tolist() == [[0, -1, -2, -3], [0, 0, -0.5, -0.25], [-0.125, 0, 0, 0]]
    torch.testing.assert_close(
        mb.old_logp, torch.tensor([[0, -1.1, -2.1, -3.1], [0, 0, -0.4, -0.3], [-0.2, 0, 0, 0]]), rtol=0, atol=0
    )
    assert mb.advantages.tolist() == [-0.5, 1.0, 0.0]
    assert (mb.input_ids.dtype, mb.attention_mask.dtype, mb.loss_mask.dtype) == (torch.long, torch.long, torch.bool)
    assert mb.num_response_tokens == 6 and mb.num_real_tokens == 9


def test_an_empty_micro_batch_is_one_masked_padding_token():
    mb = collate([], [], torch.device("cpu"), pad_id=0, old_logps={})
    assert mb.input_ids.shape == (1, 1) and not mb.loss_mask.any() and mb.num_response_tokens == 0
    assert mb.old_logp is not None
