"""The torch engine: behaviour log-probs equal transformers' Qwen3MoeForCausalLM, sampling follows the
(temperature, top-k, top-p) distribution exactly, and a sample's randomness is its own."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from experience_helpers import tiny_model, write_checkpoint
from model_helpers import response_logits, response_logprobs
from transformers import AutoModelForCausalLM

from steps.data.tasks import get_task
from steps.demo.char_tokenizer import EOS_ID, build_tokenizer, encode, encode_prompt
from steps.demo.sft import char_checkpoint_tokenizer
from steps.engines.interface import (
    FINISH_LENGTH,
    FINISH_STOP,
    Generation,
    GenerationInterrupted,
    GenerationRequest,
    SamplingParams,
    sample_requests,
    sample_seed,
)
from steps.engines.sampling import sample_next, sample_uniforms
from steps.engines.torch_engine import TorchEngine, compute_dtype
from steps.models.hf_checkpoint import load_state_dict_from_dir
from steps.scoring.evaluation import evaluate_accuracy

TOK = build_tokenizer()
# Prompts of different lengths (left padding), including two samples' worth of the same prompt text.
PROMPTS = get_task("addition").prompts("train", 5, 0) + get_task("sort").prompts("train", 3, 0)
PROMPT_IDS = [(p.prompt_id, encode_prompt(TOK, p.text)) for p in PROMPTS]

DEMO_STOP = (2,)  # the demo tokenizer's <eos>: these checkpoints stop there (steps.demo.char_tokenizer.EOS_ID)


def seeds(iteration=1):
    return lambda prompt_id, k: sample_seed(7, iteration, prompt_id, k)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny checkpoints: untied head with one dense layer (fp32, and rounded to bf16 as a bf16 run publishes
    it); tied head with q/k/v/o bias and top-3."""
    base = tmp_path_factory.mktemp("ckpt")
    return {
        "dense_layer": write_checkpoint(
            tiny_model(seed=3, mlp_only_layers=[1], intermediate_size=24), base / "dense_layer"
        ),
        "dense_layer_bf16": write_checkpoint(
            tiny_model(seed=3, mlp_only_layers=[1], intermediate_size=24).to(torch.bfloat16), base / "dense_layer_bf16"
        ),
        "tied_bias_top3": write_checkpoint(
            tiny_model(seed=4, tie_word_embeddings=True, attention_bias=True, num_experts_per_tok=3),
            base / "tied_bias_top3",
        ),
    }


@pytest.mark.parametrize("name", ["dense_layer", "dense_layer_bf16", "tied_bias_top3"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(stop_token_ids=DEMO_STOP, n=3, max_new_tokens=10),
        SamplingParams(stop_token_ids=DEMO_STOP, n=2, max_new_tokens=10, temperature=1.7, top_k=6, top_p=0.8),
        SamplingParams(stop_token_ids=DEMO_STOP, n=1, max_new_tokens=10, temperature=0.0),
    ],
    ids=["plain", "temperature_topk_topp", "greedy"],
)
def test_behaviour_logprobs_equal_transformers(checkpoints, name, params):
    """On CPU the engine computes in fp32 whatever the stored dtype, so a bf16 checkpoint's log-probs equal a
    fp32 transformers forward of the same (exactly upcast) published weights."""
    engine = TorchEngine.from_checkpoint(checkpoints[name])
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
    requests = sample_requests(PROMPT_IDS, params, seeds())
    generations = engine.generate(requests, params)
    assert [(g.prompt_id, g.sample_index) for g in generations] == [(r.prompt_id, r.sample_index) for r in requests]
    lengths = {len(g.response_ids) for g in generations}
    assert max(lengths) > 1  # real decoding, not just the prefill's token
    for request, generation in zip(requests, generations, strict=True):
        expected = response_logprobs(hf, request.prompt_ids, generation.response_ids)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=0)
        if params.greedy:  # each token is the policy's argmax at its position
            argmax = response_logits(hf, request.prompt_ids, generation.response_ids).argmax(-1)
            assert argmax.tolist() == generation.response_ids


def test_bf16_weights_are_read_as_stored_and_upcast_exactly_on_cpu(checkpoints):
    stored = load_state_dict_from_dir(checkpoints["dense_layer_bf16"])
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    assert compute_dtype(torch.bfloat16, "cpu") == compute_dtype(torch.float16, "cpu") == torch.float32
    assert compute_dtype(torch.bfloat16, "cuda") == torch.bfloat16  # as SGLang's dtype auto serves it
    engine = TorchEngine.from_checkpoint(checkpoints["dense_layer_bf16"])
    weights = engine.model.state_dict()
    assert set(weights) == set(stored)
    for name, tensor in stored.items():
        assert weights[name].dtype == torch.float32 and torch.equal(weights[name], tensor.float()), name


def test_bf16_arithmetic_is_as_close_to_the_policy_as_transformers_bf16(checkpoints):
    """The GPU path's arithmetic (the engine computing in the stored bf16), run here on CPU: its log-probs are
    as far from the fp32 evaluation of the same weights as transformers' own bf16 forward is, and close to
    it. Two bf16 forwards that round in a different order cannot agree to fp32 precision."""
    directory = checkpoints["dense_layer_bf16"]
    engine = TorchEngine.from_checkpoint(directory, dtype=torch.bfloat16)
    assert engine.model.lm_head.weight.dtype == torch.bfloat16
    exact = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    hf_bf16 = AutoModelForCausalLM.from_pretrained(directory, dtype="auto").eval()
    assert hf_bf16.dtype == torch.bfloat16  # config.json's dtype, as the published checkpoint says
    params = SamplingParams(n=3, max_new_tokens=10)
    requests = sample_requests(PROMPT_IDS, params, seeds())
    ours, theirs, between = [], [], []
    for request, generation in zip(requests, engine.generate(requests, params), strict=True):
        truth = response_logprobs(exact, request.prompt_ids, generation.response_ids)
        hf = response_logprobs(hf_bf16, request.prompt_ids, generation.response_ids)
        logprobs = torch.tensor(generation.logprobs)
        ours.append((logprobs - truth).abs())
        theirs.append((hf - truth).abs())
        between.append((logprobs - hf).abs())
    ours, theirs, between = torch.cat(ours), torch.cat(theirs), torch.cat(between)
    assert len(ours) > 50 and theirs.mean() > 1e-3  # enough tokens; bf16 really rounds
    assert ours.mean() < 1.5 * theirs.mean() and ours.max() < 1.5 * theirs.max()
    assert between.mean() < 0.05


def test_inverse_cdf_sampling_is_exactly_the_sampling_distribution():
    """On a grid of uniforms, each token gets exactly its probability mass (to the grid's resolution)."""
    torch.manual_seed(0)
    logits = torch.randn(1, 20) * 2
    grid = 20_000
    uniforms = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    rows = logits.expand(grid, 20)

    def frequencies(params):
        tokens, logprobs = sample_next(rows, uniforms, params)
        torch.testing.assert_close(logprobs, torch.log_softmax(rows, -1).gather(1, tokens[:, None]).squeeze(1))
        return torch.bincount(tokens, minlength=20).double() / grid

    probs = torch.softmax(logits[0].double() / 0.7, -1)
    torch.testing.assert_close(frequencies(SamplingParams(temperature=0.7)), probs, atol=2 / grid, rtol=0)

    top5 = probs.argsort(descending=True)[:5]
    expected = torch.zeros(20, dtype=torch.float64)
    expected[top5] = probs[top5] / probs[top5].sum()
    torch.testing.assert_close(frequencies(SamplingParams(temperature=0.7, top_k=5)), expected, atol=2 / grid, rtol=0)

    ordered = probs.argsort(descending=True)
    mass_before = probs[ordered].cumsum(0) - probs[ordered]
    nucleus = ordered[mass_before < 0.6]
    expected = torch.zeros(20, dtype=torch.float64)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    assert 1 < len(nucleus) < 20
    torch.testing.assert_close(frequencies(SamplingParams(temperature=0.7, top_p=0.6)), expected, atol=2 / grid, rtol=0)

    greedy = frequencies(SamplingParams(stop_token_ids=DEMO_STOP, temperature=0.0))
    assert greedy[logits[0].argmax()] == 1.0


def test_a_sample_depends_only_on_its_own_request(checkpoints):
    engine = TorchEngine.from_checkpoint(checkpoints["dense_layer"])
    params = SamplingParams(stop_token_ids=DEMO_STOP, n=4, max_new_tokens=10)
    requests = sample_requests(PROMPT_IDS, params, seeds())
    batch = engine.generate(requests, params)
    again = engine.generate(requests, params)
    assert batch == again
    reversed_batch = engine.generate(requests[::-1], params)[::-1]
    alone = [engine.generate([r], params)[0] for r in requests[::5]]
    for mine, other in [*zip(batch, reversed_batch, strict=True), *zip(batch[::5], alone, strict=True)]:
        assert mine.response_ids == other.response_ids
        assert mine.finish_reason == other.finish_reason
        # fp32 log-probs of a few nats: another batch shape blocks the GEMMs differently, a few tens of ulps
        torch.testing.assert_close(mine.logprobs, other.logprobs, atol=1e-5, rtol=1e-5)
    # Different seeds (another iteration) give different samples of the same prompts.
    other_iteration = engine.generate(sample_requests(PROMPT_IDS, params, seeds(iteration=2)), params)
    assert sum(a.response_ids != b.response_ids for a, b in zip(batch, other_iteration, strict=True)) > len(batch) // 2


def splitmix64(seed: int, counter: int) -> int:
    """The reference SplitMix64 output number `counter` (1-based) of a stream seeded with `seed`, top 53 bits."""
    mask = 2**64 - 1
    z = (seed + counter * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 11 << 11


def test_seeds_and_uniforms_are_stable_and_independent():
    assert sample_seed(0, 1, "addition3/012345", 0) == sample_seed(0, 1, "addition3/012345", 0)
    assert sample_seed(0, 1, "addition3/012345", 0) == 8442703951936270916  # fixed forever: changing it changes runs
    variants = {sample_seed(*args) for args in [(0, 1, "a", 0), (1, 1, "a", 0), (0, 2, "a", 0), (0, 1, "b", 0),
                                                 (0, 1, "a", 1)]}  # fmt: skip
    assert len(variants) == 5 and all(0 <= s < 2**63 for s in variants)

    u = sample_uniforms([1, 2, 2**64 - 1], 4)
    assert u.dtype == torch.float64 and u.shape == (3, 4)
    for row, seed in enumerate([1, 2, 2**64 - 1]):
        assert u[row].tolist() == [splitmix64(seed, t) / 2**64 for t in range(1, 5)]
    assert torch.equal(sample_uniforms([2], 4)[0], u[1])  # a row's stream does not depend on other rows
    assert torch.equal(sample_uniforms([2**64 - 1], 2)[0], u[2, :2])  # nor on how many steps are drawn
    many = sample_uniforms(list(range(1000)), 50)
    assert 0 <= many.min() and many.max() < 1
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005


def test_stop_tokens_end_a_sample_and_are_kept(checkpoints):
    engine = TorchEngine.from_checkpoint(checkpoints["tied_bias_top3"])
    stops = tuple(encode(TOK, "0123"))
    params = SamplingParams(n=3, max_new_tokens=9, stop_token_ids=stops)
    generations = engine.generate(sample_requests(PROMPT_IDS, params, seeds()), params)
    reasons = {g.finish_reason for g in generations}
    assert reasons == {FINISH_STOP, FINISH_LENGTH}
    for g in generations:
        assert len(g.logprobs) == len(g.response_ids) <= 9
        assert not set(g.response_ids[:-1]) & set(stops)
        if g.finish_reason == FINISH_STOP:
            assert g.response_ids[-1] in stops
        else:
            assert len(g.response_ids) == 9 and g.response_ids[-1] not in stops


def test_should_stop_interrupts_between_decode_steps(checkpoints):
    engine = TorchEngine.from_checkpoint(checkpoints["dense_layer"])
    params = SamplingParams(n=2, max_new_tokens=10, stop_token_ids=())
    polls = []

    def should_stop():
        polls.append(1)
        return len(polls) == 3

    with pytest.raises(GenerationInterrupted, match="after 3 of 10 decode steps"):
        engine.generate(sample_requests(PROMPT_IDS, params, seeds()), params, should_stop=should_stop)
    assert engine.generate([], params) == []


class AnswerEngine:
    """A stub engine that answers prompts from a table, to test evaluate_accuracy's own logic."""

    name = "stub"

    def __init__(self, responses):
        self.responses, self.seen_params = responses, []

    def generate(self, requests, params, should_stop=None):
        self.seen_params.append(params)
        return [Generation(r.prompt_id, r.sample_index, self.responses[r.prompt_id], [0.0], FINISH_STOP)
                for r in requests]  # fmt: skip

    def close(self):
        pass


def test_evaluate_accuracy_is_greedy_exact_match(checkpoints):
    tok = char_checkpoint_tokenizer()
    prompts = get_task("addition").prompts("heldout", 8, 0)
    right = {p.prompt_id: [*encode(TOK, p.answer), EOS_ID] for p in prompts}
    responses = dict(right)
    for p in prompts[:3]:
        responses[p.prompt_id] = [*encode(TOK, "9" + p.answer), EOS_ID]  # wrong answer
    responses[prompts[3].prompt_id] = encode(TOK, prompts[3].answer)  # right digits but never ended
    stub = AnswerEngine(responses)
    assert evaluate_accuracy(stub, tok, prompts, "addition", batch_size=3) == 4 / 8
    assert all(p.greedy and p.stop_token_ids == (EOS_ID,) for p in stub.seen_params) and len(stub.seen_params) == 3
    assert evaluate_accuracy(AnswerEngine(right), tok, prompts) == 1.0

    model = tiny_model(seed=3)
    assert evaluate_accuracy(model, tok, prompts) == evaluate_accuracy(TorchEngine(model), tok, prompts, "addition")
    with pytest.raises(ValueError, match="at least one prompt"):
        evaluate_accuracy(stub, tok, [])


def test_requests_without_prompt_tokens_are_refused(checkpoints):
    engine = TorchEngine.from_checkpoint(checkpoints["dense_layer"])
    with pytest.raises(ValueError, match="no prompt tokens"):
        engine.generate([GenerationRequest("p", (), 0, 1)], SamplingParams(stop_token_ids=DEMO_STOP))


def test_samples_that_drew_the_same_tokens_share_a_state(checkpoints):
    """Greedy samples of a prompt never split: four of them decode as one row and equal a single sample."""
    engine = TorchEngine.from_checkpoint(checkpoints["dense_layer"])
    group = SamplingParams(stop_token_ids=DEMO_STOP, n=4, max_new_tokens=9, temperature=0.0)
    single = SamplingParams(stop_token_ids=DEMO_STOP, n=1, max_new_tokens=9, temperature=0.0)
    rows_per_step = []
    real_step = engine.decoder.step
    engine.decoder.step = lambda tokens, batch: rows_per_step.append(len(tokens)) or real_step(tokens, batch)
    grouped = engine.generate(sample_requests(PROMPT_IDS, group, seeds()), group)
    assert max(rows_per_step) <= len(PROMPT_IDS)  # one row per prompt, not per sample
    alone = engine.generate(sample_requests(PROMPT_IDS, single, seeds()), single)
    for index, one in enumerate(alone):
        for g in grouped[4 * index : 4 * index + 4]:
            assert (g.response_ids, g.logprobs, g.finish_reason) == (one.response_ids, one.logprobs, one.finish_reason)


@pytest.mark.parametrize("name", ["dense_layer", "dense_layer_bf16", "tied_bias_top3"])
def test_an_engine_updated_in_place_generates_what_a_fresh_engine_does(checkpoints, name, tmp_path):
    """The in-place update (TorchEngine.update_weights, what a rollout server does between versions) gives
    bit-identical samples and log-probs to an engine opened on the new version."""
    from delta_helpers import moved

    from steps.models.hf_checkpoint import load_pretrained

    newer = write_checkpoint(moved(load_pretrained(checkpoints[name], dtype=None), seed=1, lr=0.05), tmp_path / "v1")
    params = SamplingParams(stop_token_ids=DEMO_STOP, n=3, max_new_tokens=10, temperature=1.3, top_k=8)
    requests = sample_requests(PROMPT_IDS, params, seeds())
    live = TorchEngine.from_checkpoint(checkpoints[name])
    before = live.generate(requests, params)
    weights = [p.data_ptr() for p in live.model.parameters()]
    live.update_weights(newer)
    assert [p.data_ptr() for p in live.model.parameters()] == weights  # the same tensors, new values
    fresh = TorchEngine.from_checkpoint(newer)
    after = live.generate(requests, params)
    assert after == fresh.generate(requests, params)
    assert after != before


def test_an_in_place_update_refuses_another_model_or_dtype(checkpoints):
    from steps.errors import MoerlError

    live = TorchEngine.from_checkpoint(checkpoints["dense_layer"])
    with pytest.raises(MoerlError, match="describes another model than this engine serves"):
        live.update_weights(checkpoints["tied_bias_top3"])
    with pytest.raises(MoerlError, match="stored as bfloat16, but this engine's checkpoint was float32"):
        live.update_weights(checkpoints["dense_layer_bf16"])
