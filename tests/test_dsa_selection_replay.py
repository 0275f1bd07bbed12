"""Replay of the engine's DeepSeek-sparse-attention selection (issue: the 2026 families, item 2): with
rollout.record_routes the torch engine records, beside the routes, the keys each query past index_topk attended to
in every layer with an indexer (Generation.selected_keys, the experience's selected_keys column); the trainer
compares its indexers' choice with them (routing.indexer in the update metrics) and, with trainer.routing_replay:
rollout, attends to the engine's keys, in every micro-batch layout (plain, packed, shared prompts) and through
activation checkpointing. Also: the torch engine records routes for every family it decodes with the family's own
state (DSA and the gated-DeltaNet hybrids), as the trainer's routers choose them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_family_deepseek_v32 import CONFIGS as V32_CONFIGS
from test_family_deepseek_v32 import hf_model as v32_hf_model
from test_family_glm_moe_dsa import CONFIGS as GLM_CONFIGS
from test_family_glm_moe_dsa import hf_model as glm_hf_model
from test_routing_replay import own_routes

import steps.models.dsa as dsa
from steps.engines.interface import GenerationRequest, SamplingParams
from steps.engines.torch_engine import TorchEngine
from steps.errors import MoerlError
from steps.experience.tables import Sample, _int_lists
from steps.expert_parallel.mesh import Mesh
from steps.models.hf_checkpoint import load_pretrained
from steps.models.layers import SelectionShape
from steps.training.micro_batch import collate, collate_groups
from steps.training.rl_loss import LossSettings
from steps.training.routes import check_selections
from steps.training.trainer import PolicyTrainer, TrainSettings

V32 = V32_CONFIGS["default_rope_dense_layer"]  # index_topk 5, 16 index heads: no ties
GLM = GLM_CONFIGS["freq_offset_dense_layer"]  # layers full, shared, full, shared
PROMPTS = [("a", (5, 9, 17, 3)), ("b", (40, 41)), ("c", (7, 8, 9, 10, 11, 12, 13))]


def checkpoint(tmp_path, kwargs: dict, family: str = "v32", **changes):
    directory = tmp_path / f"{family}-ckpt"
    make = v32_hf_model if family == "v32" else glm_hf_model
    make({**kwargs, **changes}, seed=17).save_pretrained(directory)
    return directory


def generate(model, max_new_tokens: int = 9, samples: int = 3):
    engine = TorchEngine(model, record_routes=True)
    requests = [GenerationRequest(pid, ids, k, seed=100 * i + k) for i, (pid, ids) in enumerate(PROMPTS)
                for k in range(samples)]  # fmt: skip
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    return requests, engine.generate(requests, params)


def own_selection(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """[fed, indexer layers, fed] bool: the keys the model's indexers select over prompt + response[:-1] in one
    forward."""
    chosen = []
    original = dsa.LightningIndexer.select

    def select(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        chosen.append(out[0])
        return out

    dsa.LightningIndexer.select = select
    try:
        with torch.no_grad():
            model(torch.tensor([prompt + response[:-1]]))
    finally:
        dsa.LightningIndexer.select = original
    return torch.stack(chosen, dim=1).numpy()


def unpacked(g, prompt_len: int) -> np.ndarray:
    fed = prompt_len + len(g.response_ids) - 1
    return np.unpackbits(g.selected_keys, axis=-1, count=fed).astype(bool)


def samples_of(requests, generations, advantages: bool = True) -> list[Sample]:
    return [
        Sample(r.prompt_id, r.sample_index, list(r.prompt_ids), g.response_ids, g.logprobs,
               advantage=(1.0 if i % 2 else -1.0) if advantages else 0.0, routed_experts=g.routed_experts,
               selected_keys=None if g.selected_keys is None else g.selected_keys.reshape(-1))
        for i, (r, g) in enumerate(zip(requests, generations, strict=True))
    ]  # fmt: skip


@pytest.mark.parametrize("family", ["v32", "glm"])
def test_the_engine_records_each_query_past_index_topk_as_the_trainer_selects(tmp_path, family):
    """DeepSeek-V3.2 (an indexer in every layer) and GLM-5 (shared layers reuse the last full layer's keys: only
    the full layers are recorded): every query past index_topk, exactly index_topk keys, the trainer's own choice."""
    kwargs = V32 if family == "v32" else GLM
    model = load_pretrained(checkpoint(tmp_path, kwargs, family))
    layers = len(model.indexed_attention())
    assert layers == (len(model.model.layers) if family == "v32" else 2)
    topk = kwargs["index_topk"]
    requests, generations = generate(model)
    recorded = 0
    for request, g in zip(requests, generations, strict=True):
        prompt = list(request.prompt_ids)
        fed = len(prompt) + len(g.response_ids) - 1
        assert g.selected_keys.dtype == np.uint8
        assert g.selected_keys.shape == (max(0, fed - topk), layers, (fed + 7) // 8)
        chosen = unpacked(g, len(prompt))
        assert (chosen.sum(-1) == topk).all()
        assert np.array_equal(chosen, own_selection(model, prompt, g.response_ids)[topk:])
        recorded += len(chosen)
        # the routes of a model the engine decodes with its own state: every layer, every position
        assert (g.routed_experts >= 0).all()
        assert np.array_equal(np.sort(g.routed_experts, -1), np.sort(own_routes(model, prompt, g.response_ids), -1))
    assert recorded > 30
    column = pa.chunked_array([pa.array([generations[0].selected_keys.reshape(-1)], type=pa.list_(pa.uint8()))])
    assert np.array_equal(_int_lists(column, np.uint8)[0], generations[0].selected_keys.reshape(-1))


def settings(replay: str, **changes) -> TrainSettings:
    base = {"micro_batch_size": 3, "steps_per_epoch": 1, "lr": 1e-2, "loss": LossSettings(kl_coef=0.0)}
    return TrainSettings(**{**base, **changes, "routing_replay": replay})


LAYOUTS = {"plain": {}, "packed": {"sequence_packing": True}, "shared_prompts": {"shared_prompts": True},
           "checkpointed": {"activation_checkpointing": True}}  # fmt: skip


def train(directory, samples, replay: str, **changes) -> tuple[dict, dict[str, torch.Tensor]]:
    model = load_pretrained(directory).train()
    model.activation_checkpointing = changes.pop("activation_checkpointing", False)
    metrics = PolicyTrainer(model, Mesh(), settings(replay, **changes)).train(samples, iteration=1)
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_replaying_its_own_selection_is_the_plain_update(tmp_path, layout):
    directory = checkpoint(tmp_path, V32)
    samples = samples_of(*generate(load_pretrained(directory)))
    plain = train(directory, samples, "none", **LAYOUTS[layout])
    replayed = train(directory, samples, "rollout", **LAYOUTS[layout])
    for metrics in (plain[0], replayed[0]):
        indexer = metrics["routing"]["indexer"]
        assert indexer["disagreement"] == 0.0 and indexer["queries"] > 0
    assert all(torch.equal(replayed[1][n], w) for n, w in plain[1].items())


def moved(samples: list[Sample], layers: int, topk: int, layer: int) -> list[Sample]:
    """The samples with indexer layer `layer`'s recorded keys moved: each recorded query keeps its own position
    (a query always sees itself in DSA only when chosen) and takes the earliest other keys."""
    out = []
    for s in samples:
        fed = len(s.prompt_ids) + len(s.response_ids) - 1
        rows = s.selected_keys.reshape(max(0, fed - topk), layers, -1).copy()
        for q in range(len(rows)):
            keys = np.zeros(fed, dtype=bool)
            keys[: topk - 1] = True
            keys[topk + q] = True
            rows[q, layer] = np.packbits(keys)
        out.append(dataclasses.replace(s, selected_keys=rows.reshape(-1)))
    return out


def forced_logprobs(model, samples: list[Sample], layer: int, topk: int) -> list[torch.Tensor]:
    """Each sample's log-probs of its response with indexer layer `layer` attending to the moved keys (moved)."""
    from steps.models.kernels import token_logprobs

    out = []
    attention = model.indexed_attention()[layer]
    original = attention.indexer.select
    for s in samples:
        ids = s.prompt_ids + s.response_ids[:-1]
        fed = len(ids)
        forced = torch.zeros(1, fed, fed, dtype=torch.bool)
        for t in range(fed):
            if t < topk:
                forced[0, t, : t + 1] = True
            else:
                forced[0, t, : topk - 1] = True
                forced[0, t, t] = True
        attention.indexer.select = lambda *a, forced=forced, **k: forced
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids]))
        finally:
            attention.indexer.select = original
        targets = torch.tensor([s.prompt_ids[1:] + s.response_ids])
        out.append(token_logprobs(logits, targets)[0, len(s.prompt_ids) - 1 :])
    return out


def test_replay_attends_to_the_engine_keys_in_every_layout(tmp_path):
    """Moved keys in the last indexer layer: with replay the trainer's log-probs (plain, packed, shared prompts) are
    those of a forward whose last layer attends to the moved keys; without replay its own; the disagreement is
    counted in that layer only (the earlier layers' records are the trainer's own choice)."""
    directory = checkpoint(tmp_path, V32)
    model = load_pretrained(directory)
    layers, topk = len(model.indexed_attention()), V32["index_topk"]
    samples = moved(samples_of(*generate(model)), layers, topk, layer=layers - 1)
    want = forced_logprobs(model, samples, layer=layers - 1, topk=topk)
    ids = list(range(len(samples)))
    shape = model.selection_shape()
    assert shape == SelectionShape(layers, topk) and check_selections(samples, shape, replay=True)
    for replay in ("rollout", "none"):
        trainer = PolicyTrainer(model, Mesh(), settings(replay))
        for make in (lambda: collate(samples, ids, torch.device("cpu"), selection_shape=shape),
                     lambda: collate(samples, ids, torch.device("cpu"), packed=True, selection_shape=shape),
                     lambda: collate_groups(samples, ids, torch.device("cpu"), selection_shape=shape)):  # fmt: skip
            mb = make()
            trainer.selection_counts = torch.zeros(layers, 2, dtype=torch.int64)
            with torch.no_grad():
                logp, _ = trainer.forward_logprobs(model, mb)
            for row, s in enumerate(samples):
                got = logp[row][mb.loss_mask[row]]
                if replay == "rollout":
                    torch.testing.assert_close(got, want[row], atol=1e-5, rtol=0)
                else:
                    torch.testing.assert_close(got, torch.tensor(s.behavior_logprobs), atol=1e-4, rtol=0)
            differs, queries = trainer.selection_counts.unbind(1)
            assert not differs[:-1].any() and 0 < differs[-1] <= queries[-1]
    moved_away = [not torch.allclose(w, torch.tensor(s.behavior_logprobs), atol=1e-3)
                  for w, s in zip(want, samples, strict=True)]  # fmt: skip
    assert any(moved_away)


def test_with_tied_index_scores_the_trainer_matches_the_engine_only_with_replay(tmp_path):
    """One index head: the relu leaves many keys at exactly 0, and top-k breaks those ties by the length it runs
    over, so a decode step and a full forward choose differently. Replayed, the trainer's log-probs are the
    engine's; without replay some recorded queries disagree."""
    directory = checkpoint(tmp_path, V32, index_n_heads=1, index_topk=3)
    model = load_pretrained(directory)
    samples = samples_of(*generate(model, max_new_tokens=12))
    ids = list(range(len(samples)))
    shape = model.selection_shape()
    gaps = {}
    for replay in ("rollout", "none"):
        trainer = PolicyTrainer(model, Mesh(), settings(replay))
        trainer.selection_counts = torch.zeros(shape.layers, 2, dtype=torch.int64)
        mb = collate(samples, ids, torch.device("cpu"), selection_shape=shape)
        with torch.no_grad():
            logp, _ = trainer.forward_logprobs(model, mb)
        gaps[replay] = (logp - mb.behavior_logp).abs()[mb.loss_mask].max().item()
        gaps[replay + "_disagreeing"] = int(trainer.selection_counts[:, 0].sum())
    # (with replay the later layers see the engine's hidden states, so they count other ties than without)
    assert gaps["rollout_disagreeing"] > 0 and gaps["none_disagreeing"] > 0
    assert gaps["rollout"] < 1e-4 < gaps["none"], gaps


def test_selections_of_another_model_or_none_are_refused_in_one_line(tmp_path):
    directory = checkpoint(tmp_path, V32)
    model = load_pretrained(directory)
    layers = len(model.indexed_attention())
    samples = samples_of(*generate(model, samples=1))
    shape = model.selection_shape()
    assert not check_selections([dataclasses.replace(samples[0], selected_keys=None)], shape, replay=False)
    cases = {
        "records no selected keys": [dataclasses.replace(samples[0], selected_keys=None)],
        "bytes, not": [dataclasses.replace(samples[0], selected_keys=samples[0].selected_keys[:-1])],
        "selects other than 5 keys a query sees": [
            dataclasses.replace(samples[0], selected_keys=samples[0].selected_keys * 0)
        ],
    }
    for message, bad in cases.items():
        with pytest.raises(MoerlError, match=message) as err:
            check_selections(bad, shape, replay=True)
        assert "\n" not in str(err.value)
    s = samples[2]  # a key after the query: the last key of the first recorded query's row
    fed = len(s.prompt_ids) + len(s.response_ids) - 1
    rows = s.selected_keys.reshape(-1, layers, (fed + 7) // 8).copy()
    keys = np.unpackbits(rows[0, 0], count=fed).astype(bool)
    keys[np.flatnonzero(keys)[0]], keys[-1] = False, True
    rows[0, 0] = np.packbits(keys)
    with pytest.raises(MoerlError, match="other than 5 keys a query sees"):
        check_selections([dataclasses.replace(s, selected_keys=rows.reshape(-1))], shape, replay=True)


@pytest.mark.slow
def test_the_workflow_records_and_replays_the_selection_through_the_experience(tmp_path):
    """A DeepSeek-V3.2 checkpoint through the local workflow with rollout.record_routes and routing_replay: rollout
    writes selected_keys into the chunks, score keeps them, the EP=2 update reads and replays them and counts its
    indexers' disagreement per layer (transformers' initialisation leaves near-zero index scores: some tie)."""
    from faults_helpers import run_local, tiny_config
    from test_family_workflows import user_checkpoint

    from steps.experience.tables import read_scored_experience
    from steps.run.config import RunConfig
    from steps.run.keys import update_metrics_key
    from steps.store.object_store import Store

    sft = user_checkpoint(tmp_path / "sft", "deepseek_v32")
    trainer = {
        "ep_backend": "alltoall",
        "nproc_per_node": 2,
        "ep_size": 2,
        "micro_batch_size": 8,
        "steps_per_epoch": 2,
        "lr": 1e-2,
        "routing_replay": "rollout",
        "sequence_packing": True,
        "kl_coef": 0.01,
    }  # fmt: skip  (a KL term: no sample is left out for a zero advantage)
    cfg = RunConfig.model_validate(tiny_config(sft.as_uri(), (tmp_path / "run").as_uri(), trainer=trainer,
                                               sampling={"max_new_tokens": 4, "temperature": 1.0}))  # fmt: skip
    assert cfg.records_routes
    result = run_local(cfg, tmp_path / "work")
    assert result.succeeded, result.message
    run = Store.open((tmp_path / "run").as_uri())
    samples = read_scored_experience(run, 1, expected_version=0)
    assert all(s.selected_keys is not None and s.routed_experts is not None for s in samples)
    assert sum(s.selected_keys.size for s in samples) > 0
    indexer = run.get_json(update_metrics_key(1))["update"]["routing"]["indexer"]
    assert indexer["queries"] > 0 and 0.0 <= indexer["disagreement"] < 0.5 and len(indexer["layers"]) == 2
