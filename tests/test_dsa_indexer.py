"""DeepSeek sparse attention's lightning indexer (steps/models/dsa.py) against transformers 5.23's own
DeepseekV32Indexer on the same weights and rotary tables: the index keys and the selection of every query, with
index_topk below the sequence length so that selection happens, under causal, left-padded and packed visibility; a
decode step against cached keys selects what the full forward selects; the indexer is frozen. Rows whose k-th and
(k+1)-th scores tie (a relu makes exact zeros common) may break the tie differently in two call shapes: they are
counted and must be rare, the rest must agree exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

from steps.models.dsa import LightningIndexer
from steps.models.layers import rotary_cos_sin

SIZES = dict(hidden_size=32, q_lora_rank=16, index_n_heads=4, index_head_dim=16, qk_rope_head_dim=8, index_topk=5)
SEQ, BATCH = 13, 3


def indexers(seed: int = 0) -> tuple[DeepseekV32Indexer, LightningIndexer]:
    config = DeepseekV32Config(
        vocab_size=64, hidden_size=SIZES["hidden_size"], q_lora_rank=SIZES["q_lora_rank"],
        index_n_heads=SIZES["index_n_heads"], index_head_dim=SIZES["index_head_dim"],
        qk_rope_head_dim=SIZES["qk_rope_head_dim"], index_topk=SIZES["index_topk"], num_hidden_layers=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    theirs = DeepseekV32Indexer(config, 0).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = LightningIndexer(**SIZES)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, SIZES["hidden_size"], generator=gen)
    q_resid = torch.randn(BATCH, SEQ, SIZES["q_lora_rank"], generator=gen)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return hidden, q_resid, rotary_cos_sin(positions, SIZES["qk_rope_head_dim"], 10000.0, torch.float32)


def causal(valid: torch.Tensor | None = None) -> torch.Tensor:
    """visible [B, T, T]: a query sees itself and the keys before it (and, with valid [B, T], only real ones)."""
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().expand(BATCH, SEQ, SEQ)
    return mask if valid is None else mask & valid[:, None, :]


def their_selection(theirs, hidden, q_resid, rope, visible) -> torch.Tensor:
    with torch.no_grad():
        chosen = theirs(hidden, q_resid, rope, visible, position_ids=None).long()
    return torch.zeros_like(visible).scatter_(-1, chosen, True) & visible


def boundary_ties(ours: LightningIndexer, hidden, q_resid, rope, visible) -> torch.Tensor:
    """[B, T]: rows whose k-th and (k+1)-th visible scores are equal (the selection there is a tie-break)."""
    cos, sin = rope
    with torch.no_grad():
        index = ours.scores(ours.queries(q_resid, cos, sin), ours.head_weights(hidden), ours.keys(hidden, cos, sin))
    index = index.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values
    k = SIZES["index_topk"]
    return (index[..., k - 1] == index[..., k]) & torch.isfinite(index[..., k])


@pytest.mark.parametrize("layout", ["causal", "left_padded", "packed"])
def test_the_selection_is_transformers(layout):
    theirs, ours = indexers()
    hidden, q_resid, rope = inputs(seed=1)
    if layout == "causal":
        visible = causal()
    elif layout == "left_padded":
        valid = torch.ones(BATCH, SEQ, dtype=torch.bool)
        valid[1, :4], valid[2, :9] = False, False
        visible = causal(valid)
    else:  # two sequences in a row: a query sees only its own sequence's keys
        segment = (torch.arange(SEQ) >= 6).long()
        visible = causal() & (segment[:, None] == segment[None, :])
    ours_selected = ours.select(hidden, q_resid, rope, visible)
    expected = their_selection(theirs, hidden, q_resid, rope, visible)
    ties = boundary_ties(ours, hidden, q_resid, rope, visible)
    assert int(ties.sum()) <= 2
    assert torch.equal(ours_selected[~ties], expected[~ties])
    assert not (ours_selected & ~visible).any()
    seen = visible.sum(-1)
    assert torch.equal(ours_selected.sum(-1), seen.clamp(max=SIZES["index_topk"]))  # selection happened: 13 > 5
    assert (seen > SIZES["index_topk"]).any()
    cos, sin = rope
    their_keys = theirs.k_norm(theirs.wk(hidden))
    rotated = torch.cat([their_keys[..., :8] * cos + torch.cat([-their_keys[..., 4:8], their_keys[..., :4]], -1) * sin,
                         their_keys[..., 8:]], dim=-1)  # fmt: skip
    torch.testing.assert_close(ours.keys(hidden, cos, sin), rotated)


def test_a_decode_step_selects_from_its_cached_keys_what_the_full_forward_selects():
    _, ours = indexers(seed=3)
    hidden, q_resid, rope = inputs(seed=4)
    cos, sin = rope
    visible = causal()
    full = ours.select(hidden, q_resid, rope, visible)
    ties = boundary_ties(ours, hidden, q_resid, rope, visible)
    cache = ours.keys(hidden, cos, sin)  # a decode keeps each token's index key as it comes
    for t in range(SEQ):
        step_rope = (cos[:, t : t + 1], sin[:, t : t + 1])
        step = ours.select(hidden[:, t : t + 1], q_resid[:, t : t + 1], step_rope, visible[:, t : t + 1, : t + 1],
                           keys=cache[:, : t + 1])  # fmt: skip
        for b in range(BATCH):
            if not ties[b, t]:
                assert torch.equal(step[b, 0], full[b, t, : t + 1]), (b, t)


def test_the_indexer_is_frozen():
    _, ours = indexers()
    assert not any(p.requires_grad for p in ours.parameters())
    hidden, q_resid, rope = inputs(seed=5)
    hidden.requires_grad_(True)
    assert not ours.select(hidden, q_resid, rope, causal()).requires_grad


def test_index_topk_beyond_the_visible_keys_selects_them_all():
    _, ours = indexers()
    ours.topk = 64
    hidden, q_resid, rope = inputs(seed=6)
    assert torch.equal(ours.select(hidden, q_resid, rope, causal()), causal())


def test_scoring_the_queries_in_blocks_selects_what_scoring_them_at_once_does(monkeypatch):
    """A long sequence's per-head products are scored a block of queries at a time (dsa.SCORE_BLOCK_ELEMENTS): the
    selection is the same whatever the block."""
    import steps.models.dsa as dsa

    _, ours = indexers(seed=7)
    hidden, q_resid, rope = inputs(seed=8)
    whole = ours.select(hidden, q_resid, rope, causal())
    for queries_a_block in (1, 2, 5):
        monkeypatch.setattr(dsa, "SCORE_BLOCK_ELEMENTS", BATCH * SIZES["index_n_heads"] * SEQ * queries_a_block)
        assert torch.equal(ours.select(hidden, q_resid, rope, causal()), whole)
