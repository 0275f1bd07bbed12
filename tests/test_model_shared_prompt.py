"""MoeForCausalLM.forward_shared_prompts (each GRPO prompt once, its responses attending to its keys/values)
gives the plain forward's per-response-token log-probs and the same gradient for every parameter (fp32,
atol 1e-5): with left-padded prompts of different lengths, right-padded responses of different lengths, a
group of one, one-token responses (no response input at all) and the padding token of the real vocabulary."""

from __future__ import annotations

import pytest
import torch
from test_update_experience import tiny_model

from steps.demo.char_tokenizer import PAD_ID
from steps.models.kernels import token_logprobs
from steps.models.qwen3_moe.model import MoeForCausalLM

# (prompt, [responses]): prompts of 2, 5 and 3 tokens; groups of 3, 1 and 2 responses of 1 to 5 tokens
GROUPS = [
    ([1, 5, 6, 7, 8], [[20, 21, 22, 2], [23], [24, 25]]),
    ([1, 9], [[30, 31, 32, 33, 2]]),
    ([1, 10, 11], [[40], [41, 42, 2]]),
]


def plain_logprobs(model: MoeForCausalLM, groups, pad_id: int) -> torch.Tensor:
    """Log-probs of every response token, from forward over right-padded prompt + response rows (as the
    trainer's plain collate builds them), in (group, response, token) order."""
    rows = [(prompt, response) for prompt, responses in groups for response in responses]
    length = max(len(p) + len(r) for p, r in rows) - 1
    ids = torch.full((len(rows), length), pad_id)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    targets = torch.full((len(rows), length), pad_id)
    on_response = torch.zeros((len(rows), length), dtype=torch.bool)
    for row, (prompt, response) in enumerate(rows):
        seq = torch.tensor(prompt + response)
        n = len(seq) - 1
        ids[row, :n], targets[row, :n], mask[row, :n] = seq[:-1], seq[1:], 1
        on_response[row, len(prompt) - 1 : n] = True
    return token_logprobs(model(ids, mask), targets)[on_response]


def shared_logprobs(model: MoeForCausalLM, groups, pad_id: int) -> torch.Tensor:
    """The same log-probs from forward_shared_prompts: prompts left-padded, responses without their last
    token right-padded, logits slot t predicting response token t."""
    prompt_len = max(len(p) for p, _ in groups)
    prompt_ids = torch.full((len(groups), prompt_len), pad_id)
    prompt_mask = torch.zeros((len(groups), prompt_len), dtype=torch.long)
    for g, (prompt, _) in enumerate(groups):
        prompt_ids[g, prompt_len - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[g, prompt_len - len(prompt) :] = 1
    rows = [(g, response) for g, (_, responses) in enumerate(groups) for response in responses]
    length = max(len(r) for _, r in rows)
    ids = torch.full((len(rows), length - 1), pad_id)
    mask = torch.zeros((len(rows), length - 1), dtype=torch.long)
    targets = torch.full((len(rows), length), pad_id)
    on_response = torch.zeros((len(rows), length), dtype=torch.bool)
    for row, (_, response) in enumerate(rows):
        n = len(response)
        ids[row, : n - 1], mask[row, : n - 1] = torch.tensor(response[:-1]), 1
        targets[row, :n], on_response[row, :n] = torch.tensor(response), True
    index = torch.tensor([g for g, _ in rows])
    logits = model.forward_shared_prompts(prompt_ids, prompt_mask, ids, mask, index)
    assert logits.shape == (len(rows), length, model.config.vocab_size)
    return token_logprobs(logits, targets)[on_response]


def logprobs_and_grads(model: MoeForCausalLM, forward, groups, pad_id: int = PAD_ID):
    """Log-probs and every parameter's gradient of a weighted token-mean of them (weights vary per token so
    that each token's gradient counts with its own sign and size)."""
    model.zero_grad(set_to_none=True)
    logp = forward(model, groups, pad_id)
    weights = torch.linspace(-1.0, 2.0, logp.numel())
    (logp * weights).sum().div(logp.numel()).backward()
    # an expert that no token (padding included) was routed to has no .grad: its gradient is zero
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach(), grads


def assert_same(model: MoeForCausalLM, groups, pad_id: int = PAD_ID) -> None:
    plain, plain_grads = logprobs_and_grads(model, plain_logprobs, groups, pad_id)
    shared, shared_grads = logprobs_and_grads(model, shared_logprobs, groups, pad_id)
    assert plain.numel() == sum(len(r) for _, responses in groups for r in responses)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=0, msg=name)
    assert any(g.abs().max() > 1e-3 for g in plain_grads.values()), "the gradients should not be trivial"


@pytest.fixture(scope="module")
def model() -> MoeForCausalLM:
    return tiny_model(3).train()


def test_groups_of_different_sizes_with_prompts_and_responses_of_different_lengths(model):
    assert_same(model, GROUPS)


def test_a_single_group_of_one(model):
    assert_same(model, [([1, 12, 13, 14], [[50, 51, 2]])])


def test_one_token_responses_feed_no_response_input(model):
    assert_same(model, [([1, 12, 13], [[2], [50]]), ([1, 7], [[51]])])


def test_padding_with_a_real_token_id_changes_nothing(model):
    """Padding slots are masked, whatever token they hold (here one the responses also use)."""
    assert_same(model, GROUPS, pad_id=21)


def test_tied_embeddings_and_a_dense_layer():
    model = tiny_model(5, tie_word_embeddings=True, mlp_only_layers=[0], intermediate_size=24).train()
    assert model.lm_head is None and not model.model.layers[0].mlp.__class__.__name__ == "MoeBlock"
    assert_same(model, GROUPS)


def test_forward_shared_prompts_needs_left_padded_prompts(model):
    prompt_ids = torch.tensor([[1, 5, PAD_ID]])
    with pytest.raises(ValueError, match="left-padded"):
        model.forward_shared_prompts(
            prompt_ids, torch.tensor([[1, 1, 0]]), torch.tensor([[7]]), torch.tensor([[1]]), torch.tensor([0])
        )
