"""The generation-engine contract, the same for every engine: where an engine cannot run here (SGLang without
SGLang or a CUDA GPU) its tests skip with that reason."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import pytest
import torch
from experience_helpers import tiny_model, write_checkpoint
from model_helpers import response_logits, response_logprobs

from steps.data.tasks import get_task
from steps.demo.char_tokenizer import EOS_ID, build_tokenizer, encode_prompt
from steps.engines.interface import FINISH_LENGTH, FINISH_STOP, SamplingParams, sample_requests, sample_seed
from steps.engines.sglang_engine import SGLangSettings, sglang_unavailable_reason
from steps.engines.torch_engine import TorchEngine
from steps.models.hf_checkpoint import load_pretrained

TOK = build_tokenizer()
PROMPTS = get_task("addition").prompts("train", 6, 1) + get_task("sort").prompts("train", 2, 1)
PROMPT_IDS = [(p.prompt_id, encode_prompt(TOK, p.text)) for p in PROMPTS]
# How close each engine's log-probs come to the policy recomputed in fp32 by steps.models.qwen3_moe.model.
LOGPROB_ATOL = {"torch": 1e-4, "sglang": 2e-2}

DEMO_STOP = (2,)  # the demo tokenizer's <eos>: these checkpoints stop there (steps.demo.char_tokenizer.EOS_ID)


def seeds(prompt_id, k):
    return sample_seed(11, 1, prompt_id, k)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_checkpoint(tiny_model(seed=5), tmp_path_factory.mktemp("contract") / "policy")


@pytest.fixture(scope="module")
def policy(checkpoint_dir):
    return load_pretrained(checkpoint_dir).eval()


@pytest.fixture(scope="module", params=["torch", pytest.param("sglang", marks=pytest.mark.gpu)])
def engine(request, checkpoint_dir):
    if request.param == "torch":
        engine = TorchEngine.from_checkpoint(checkpoint_dir)
    else:
        reason = sglang_unavailable_reason()
        if reason:
            pytest.skip(reason)
        from steps.engines.sglang_engine import SGLangEngine

        engine = SGLangEngine(checkpoint_dir, SGLangSettings(mem_fraction=0.3))
    yield engine
    engine.close()


def test_one_generation_per_request_in_order_with_policy_logprobs(engine, policy):
    params = SamplingParams(stop_token_ids=DEMO_STOP, n=3, max_new_tokens=8)
    requests = sample_requests(PROMPT_IDS, params, seeds)
    generations = engine.generate(requests, params)
    assert [(g.prompt_id, g.sample_index) for g in generations] == [(r.prompt_id, r.sample_index) for r in requests]
    for request, g in zip(requests, generations, strict=True):
        assert 1 <= len(g.response_ids) <= 8 and len(g.logprobs) == len(g.response_ids)
        assert all(math.isfinite(x) and x <= 0 for x in g.logprobs)
        assert g.finish_reason in (FINISH_STOP, FINISH_LENGTH)
        assert (g.finish_reason == FINISH_STOP) == (g.response_ids[-1] == EOS_ID)
        assert EOS_ID not in g.response_ids[:-1]
        expected = response_logprobs(policy, request.prompt_ids, g.response_ids)
        torch.testing.assert_close(torch.tensor(g.logprobs), expected, atol=LOGPROB_ATOL[engine.name], rtol=0)
    assert engine.generate([], params) == []


def test_same_request_same_sample_whatever_the_batch(engine):
    params = SamplingParams(stop_token_ids=DEMO_STOP, n=2, max_new_tokens=8)
    requests = sample_requests(PROMPT_IDS, params, seeds)
    first = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in requests[::3]]
    assert [g.response_ids for g in first[::3]] == [g.response_ids for g in alone]
    assert [g.response_ids for g in engine.generate(requests, params)] == [g.response_ids for g in first]


def test_greedy_follows_the_policy_argmax(engine, policy):
    params = SamplingParams(stop_token_ids=DEMO_STOP, n=1, max_new_tokens=6, temperature=0.0)
    requests = sample_requests(PROMPT_IDS, params, seeds)
    for request, g in zip(requests, engine.generate(requests, params), strict=True):
        logprobs = torch.log_softmax(response_logits(policy, request.prompt_ids, g.response_ids), dim=-1)
        for step, token in enumerate(g.response_ids):
            assert logprobs[step, token] >= logprobs[step].max() - LOGPROB_ATOL[engine.name]


def test_no_stop_tokens_runs_to_max_new_tokens(engine):
    params = SamplingParams(n=2, max_new_tokens=5, stop_token_ids=())
    generations = engine.generate(sample_requests(PROMPT_IDS, params, seeds), params)
    assert all(len(g.response_ids) == 5 and g.finish_reason == FINISH_LENGTH for g in generations)


@pytest.fixture(scope="module", params=["torch", pytest.param("sglang", marks=pytest.mark.gpu)])
def recording_engine(request, checkpoint_dir):
    if request.param == "torch":
        engine = TorchEngine.from_checkpoint(checkpoint_dir, record_routes=True)
    else:
        reason = sglang_unavailable_reason()
        if reason:
            pytest.skip(reason)
        from steps.engines.sglang_engine import SGLangEngine

        engine = SGLangEngine(checkpoint_dir, SGLangSettings(mem_fraction=0.3, record_routes=True))
    yield engine
    engine.close()


# The share of recorded routes on which each engine's routers may choose other experts than the fp32 policy's:
# the torch engine's arithmetic is the policy's up to float32 rounding; SGLang's bf16/fused kernels flip near ties.
ROUTE_DISAGREEMENT = {"torch": 0.01, "sglang": 0.1}


def test_recorded_routes_are_every_moe_layers_top_k_of_every_token_run(recording_engine, policy):
    """Generation.routed_experts: [prompt + response - 1, MoE layers, top_k] global expert ids (-1 where the engine
    ran no MLP); the policy's own routers choose the same experts there but for near ties."""
    params = SamplingParams(stop_token_ids=DEMO_STOP, n=2, max_new_tokens=8)
    requests = sample_requests(PROMPT_IDS, params, seeds)
    generations = recording_engine.generate(requests, params)
    blocks = policy.moe_blocks()
    differ = total = 0
    for request, g in zip(requests, generations, strict=True):
        positions = len(request.prompt_ids) + len(g.response_ids) - 1
        assert g.routed_experts.shape == (positions, len(blocks), blocks[0].top_k)
        assert ((g.routed_experts >= -1) & (g.routed_experts < blocks[0].num_experts)).all()
        routes = torch.from_numpy(g.routed_experts.astype("int64")).transpose(0, 1)
        policy.set_engine_routes(routes)
        policy.count_route_disagreement()
        with torch.no_grad():
            policy(torch.tensor([list(request.prompt_ids) + g.response_ids[:-1]]))
        counts = policy.route_disagreement()
        policy.set_engine_routes(None)
        differ, total = differ + int(counts[:, 0].sum()), total + int(counts[:, 2].sum())
    assert total > 0 and differ <= ROUTE_DISAGREEMENT[recording_engine.name] * total
