"""The torch engine's decoder (steps.engines.torch_engine.Decoder) computes what MoeForCausalLM.forward computes: its
own
prefill (fused q/k/v and experts, last-position logits only) and its decode steps over the prefix tree of
keys and values (DecodeBatch), where rows that split share their ancestors' keys instead of copying them."""

import pytest
import torch
from experience_helpers import tiny_model

from steps.demo.char_tokenizer import PAD_ID
from steps.engines.torch_engine import Decoder

# Three prompts of different lengths (left padding); token ids below the tiny vocabulary.
PROMPTS = [(1, 7, 9, 4, 12), (1, 5), (1, 8, 8, 3)]


def left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([(PAD_ID,) * (width - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    return ids, valid


@pytest.fixture(scope="module", params=["dense_layer", "tied_bias_top3"])
def model(request):
    if request.param == "dense_layer":
        return tiny_model(seed=3, mlp_only_layers=[1], intermediate_size=24)
    return tiny_model(seed=4, tie_word_embeddings=True, attention_bias=True, num_experts_per_tok=3)


def projected_keys_values(model, ids, valid):
    """MoeForCausalLM.forward's last-position logits, and every layer's keys and values [L, B, kv_heads, T, D]
    as its attention computed them (Attention.project, recorded)."""
    keys, values = [], []
    originals = [layer.self_attn.project for layer in model.model.layers]

    def recording(project):
        def record(x, rope):
            q, k, v = project(x, rope)
            keys.append(k)
            values.append(v)
            return q, k, v

        return record

    try:
        for layer, project in zip(model.model.layers, originals, strict=True):
            layer.self_attn.project = recording(project)
        logits = model(ids, valid.long())[:, -1]
    finally:
        for layer in model.model.layers:
            del layer.self_attn.project  # the instance attribute: the method shows through again
    return logits, torch.stack(keys), torch.stack(values)


@torch.inference_mode()
def test_prefill_equals_the_model_forward(model):
    ids, valid = left_padded(PROMPTS)
    batch, logits = Decoder(model).prefill(ids, valid, room=4)
    expected, keys, values = projected_keys_values(model, ids, valid)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    width = ids.shape[1]
    # The real tokens' keys and values (padding ones are never attended to).
    real = valid[None, :, None, :, None].expand_as(keys)
    torch.testing.assert_close(batch.keys[..., :width, :][real], keys[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch.values[..., :width, :][real], values[real], atol=1e-5, rtol=0)
    assert torch.equal(batch.position, torch.tensor([len(p) for p in PROMPTS]))
    assert batch.used == width and batch.keys.shape[3] == width + 4


@pytest.mark.parametrize("to_rows_after", [None, 0, 3], ids=["tree", "rows_from_the_start", "rows_midway"])
@torch.inference_mode()
def test_decode_steps_over_splitting_states_equal_the_full_forward(model, to_rows_after):
    """States split (a row repeats in select), prompts lose all their rows, the node room has to grow, the
    keys and values may be copied out of the tree per row (RowBatch): every row's logits still equal
    MoeForCausalLM.forward over its prompt and the tokens it was fed."""
    decoder = Decoder(model)
    ids, valid = left_padded(PROMPTS)
    batch, _ = decoder.prefill(ids, valid, room=2)  # too little room: add_nodes must grow it
    fed = [[] for _ in PROMPTS]  # each row's tokens so far
    prompt_of = list(range(len(PROMPTS)))
    # (rows to keep, in order, with repeats: the splits) before each step; None keeps the batch as it is
    plan = [None, [0, 0, 1, 2, 2, 2], [0, 1, 2, 3, 4, 5], [1, 1, 3, 4], None, [2, 3, 2], [1, 0, 2, 2]]
    prompts_kept = []
    generator = torch.Generator().manual_seed(0)
    for step, rows in enumerate(plan):
        if rows is not None:
            batch = batch.select(torch.tensor(rows))
            fed, prompt_of = [list(fed[r]) for r in rows], [prompt_of[r] for r in rows]
        if step == to_rows_after:
            batch = batch.to_rows(decoder.row_capacity(batch.length))
        prompts_kept.append(batch.prompt_bias.shape[0])
        tokens = torch.randint(3, model.config.vocab_size, (len(fed),), generator=generator)
        for row, token in enumerate(tokens.tolist()):
            fed[row].append(token)
        logits = decoder.step(tokens, batch)
        for row in range(len(fed)):
            sequence = torch.tensor([PROMPTS[prompt_of[row]] + tuple(fed[row])])
            expected = model(sequence)[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=2e-5, rtol=0)
    if to_rows_after is None:
        # Keys and values are shared until half of the prompts have no row: prompt 1 lost its rows in the
        # fourth select (kept: 2 of 3 prompts used), prompt 0 in the sixth (dropped: 1 of 3 used).
        assert prompts_kept == [3, 3, 3, 3, 3, 1, 1]


@torch.inference_mode()
def test_a_split_shares_the_keys_and_values_instead_of_copying_them():
    decoder = Decoder(tiny_model(seed=5))
    batch, _ = decoder.prefill(*left_padded(PROMPTS), room=8)
    decoder.step(torch.tensor([4, 5, 6]), batch)
    split = batch.select(torch.tensor([0, 0, 1, 2, 2]))
    assert split.keys.data_ptr() == batch.keys.data_ptr() and split.values.data_ptr() == batch.values.data_ptr()
    # Both copies of row 0 have the same ancestor node, and their next nodes are their own.
    assert split.ancestors[0].tolist() == split.ancestors[1].tolist() == batch.ancestors[0].tolist()
    decoder.step(torch.tensor([7, 8, 9, 10, 11]), split)
    nodes = split.ancestors[:, -1].tolist()
    assert nodes[0] != nodes[1] and nodes[3] != nodes[4]
