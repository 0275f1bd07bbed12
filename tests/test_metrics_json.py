"""Every metrics file is strict JSON (RFC 8259): a metric with no value is null, never Python's `Infinity` or
`NaN`, which jq, browsers and most trackers refuse. An update that trains no token (every group solved) is
the case that showed it: the extremes of its importance weights are the extremes of an empty set."""

from __future__ import annotations

import json
import math

import pytest
import torch
from experience_helpers import tiny_model
from model_helpers import response_logprobs

from steps.experience.tables import Sample
from steps.expert_parallel.mesh import Mesh
from steps.store.object_store import Store, json_text
from steps.training.trainer import PolicyTrainer, TrainSettings


def strict_loads(text: str):
    def refuse(token: str):
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_json_text_writes_a_value_that_is_not_finite_as_null():
    text = json_text({"max": -math.inf, "min": math.inf, "nan": math.nan, "ok": 1.5, "list": [math.inf, 2]})
    assert strict_loads(text) == {"list": [None, 2], "max": None, "min": None, "nan": None, "ok": 1.5}


def test_strict_loads_refuses_what_json_dumps_writes_by_default():
    with pytest.raises(ValueError, match="Infinity is not JSON"):
        strict_loads(json.dumps({"max": math.inf}))


def test_an_update_that_trains_no_token_writes_strict_json_metrics(tmp_path):
    torch.manual_seed(0)
    model = tiny_model().train()
    generator = torch.Generator().manual_seed(1)
    samples = []
    for group in range(2):  # every group solved: all advantages 0, nothing to train
        prompt = torch.randint(3, model.config.vocab_size, (4,), generator=generator).tolist()
        for i in range(4):
            response = torch.randint(3, model.config.vocab_size, (2,), generator=generator).tolist()
            logprobs = response_logprobs(model, prompt, response).tolist()
            samples.append(Sample(f"p{group}", i, prompt, response, logprobs, 0.0))
    trainer = PolicyTrainer(model, Mesh(), TrainSettings(micro_batch_size=4, steps_per_epoch=2))
    metrics = trainer.train(samples, iteration=1)
    assert metrics["response_tokens"] == 0
    assert metrics["is_weight"]["min"] is None and metrics["is_weight"]["max"] is None
    run = Store.open(tmp_path.as_uri())
    run.put_json("metrics/iter-000001.update.json", {"update": metrics, "iteration": 1})
    written = strict_loads((tmp_path / "metrics" / "iter-000001.update.json").read_text())
    assert written["update"]["is_weight"] == {**metrics["is_weight"], "min": None, "max": None}
