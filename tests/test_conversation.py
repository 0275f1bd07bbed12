"""The multi-turn conversation loop (steps/environments/conversation.py) with the demo's chat BPE, the demo's
calculator environment (in its worker processes) and fake engines that follow a script per turn:

- token layout: first prompt + the model's turns exactly as sampled + the observations as the chat template renders
  them, the loss mask over the model's tokens only, behaviour log-probs 0 over the observations;
- the limits: max_turns ("turns"), a turn that never stops ("length"), max_total_tokens (a turn's allowance is what
  is left; an observation that does not fit ends the conversation before it is appended);
- per-turn seeds and one generate call per distinct token allowance;
- the environment's reward summed over steps, its metrics' last values, and reset's own first messages;
- the demo SFT's `conversation_examples`, built by the same loop.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from steps.data.tasks import get_task
from steps.data.tokenizer import PromptFormat
from steps.demo.calculator import TOOLS
from steps.demo.sft import SftSettings, conversation_examples, write_tokenizer
from steps.engines.interface import FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams, sample_seed
from steps.environments.conversation import FINISH_TURNS, ConversationLimits, EnvironmentSettings, run_conversations

REPO = Path(__file__).resolve().parents[1]
CALCULATOR = "steps.demo.calculator:CalculatorEnv"
CHAT = PromptFormat("chat")
TASK = get_task("multiply", digits=2)
LOGPROB = -0.25  # what the fake engines report for every token they sample


def calculator(max_turns=3, max_total_tokens=256, workers=1) -> EnvironmentSettings:
    return EnvironmentSettings(CALCULATOR, {}, ConversationLimits(max_turns, max_total_tokens, "qwen"), 10.0, workers)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The demo's chat BPE, trained on a few hundred rendered calculator conversations (as `moerl demo` with
    configs/demo-tool.yaml builds it; its eos <|im_end|> is the one stop token, as in the demo)."""
    settings = SftSettings(task="multiply2", tokenizer="bpe", prompt_format="chat", environment=calculator(),
                           train_prompts=200)  # fmt: skip
    tok = write_tokenizer(settings, tmp_path_factory.mktemp("bpe"))
    assert tok.stop_ids == (tok.eos_id,)
    return tok


class FakeEngine:
    """Writes each sample's turn t as `script(prompt_id, t)` + eos (cut at max_new_tokens without the stop token,
    as an engine does), or, with `never_stop`, max_new_tokens tokens that are never a stop token. Records every
    generate call: (requests, params, generations)."""

    name = "fake"

    def __init__(self, tok, script=None, never_stop=False) -> None:
        self.tok, self.script, self.never_stop = tok, script, never_stop
        self.calls: list[tuple[list, SamplingParams, list[Generation]]] = []
        self.taken: dict[tuple[str, int], int] = {}

    def generate(self, requests, params, should_stop=None):
        out = []
        for r in requests:
            turn = self.taken.get((r.prompt_id, r.sample_index), 0)
            self.taken[(r.prompt_id, r.sample_index)] = turn + 1
            if self.never_stop:
                ids, reason = self.tok.encode_text("7") * params.max_new_tokens, FINISH_LENGTH
            else:
                ids, reason = [*self.tok.encode_text(self.script(r.prompt_id, turn)), self.tok.eos_id], FINISH_STOP
                if len(ids) > params.max_new_tokens:
                    ids, reason = ids[: params.max_new_tokens], FINISH_LENGTH
            out.append(Generation(r.prompt_id, r.sample_index, ids, [LOGPROB] * len(ids), reason))
        self.calls.append((list(requests), params, out))
        return out

    def update_weights(self, model_dir):
        raise NotImplementedError

    def close(self):
        pass

    def turn_calls(self):
        """The generate calls grouped by turn (a sample's turn count when it was asked)."""
        seen: dict[tuple[str, int], int] = {}
        by_turn: dict[int, list] = {}
        for requests, params, generations in self.calls:
            turns = set()
            for r in requests:
                turns.add(seen.get((r.prompt_id, r.sample_index), 0))
                seen[(r.prompt_id, r.sample_index)] = seen.get((r.prompt_id, r.sample_index), 0) + 1
            assert len(turns) == 1, "one generate call holds one turn"
            by_turn.setdefault(turns.pop(), []).append((requests, params, generations))
        return by_turn


def call_then_answer(prompts):
    """The perfect policy's turns (Multiplication.sft_turns): the calculator call, then the boxed product."""
    script = {p.prompt_id: TASK.sft_turns(p) for p in prompts}
    return lambda prompt_id, turn: script[prompt_id][turn]


def always_call(prompt_id, turn):
    return '<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>'


def converse(tok, engine, prompts, environment, max_new_tokens=64, n=1, seed_of=lambda p, k: 11):
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tok.stop_ids, n=n)
    with environment.open_pool(len(prompts) * n) as pool:
        return run_conversations(engine, tok, CHAT, pool, prompts, params, environment.limits, seed_of)


def prompt_with_answer_digits(digits):
    return next(p for p in TASK.prompts("train", 64, 0) if len(p.answer) == digits)


# ------------------------------------------------------------------------------------------------ token layout


def test_a_conversation_is_the_prompt_then_the_sampled_turns_and_the_rendered_observation(tok):
    prompt = prompt_with_answer_digits(3)
    engine = FakeEngine(tok, call_then_answer([prompt]))
    (c,) = converse(tok, engine, [prompt], calculator())
    assert (c.finish_reason, c.turns, c.tool_calls) == (FINISH_STOP, 2, 1)
    assert [m["role"] for m in c.messages] == ["user", "assistant", "tool", "assistant"]
    assert c.messages[-1]["content"] == TASK.sft_turns(prompt)[1]
    rendered = tok.render_chat(c.messages, CHAT, add_generation_prompt=False, tools=TOOLS)
    assert rendered == tok.decode(c.prompt_ids + c.response_ids, skip_special_tokens=False) + "\n"
    assert tok.decode(c.prompt_ids, skip_special_tokens=False) == tok.render_chat(c.messages[:1], CHAT, tools=TOOLS)

    first, second = (generations[0].response_ids for _, _, generations in engine.calls)
    assert first[-1] == second[-1] == tok.eos_id  # the stop token is part of the model's turn
    observation = c.response_ids[len(first) : len(c.response_ids) - len(second)]
    assert c.response_ids == first + observation + second
    assert tok.decode(observation, skip_special_tokens=False) == (
        f"\n<|im_start|>user\n<tool_response>\n{prompt.answer}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert c.loss_mask == [1] * len(first) + [0] * len(observation) + [1] * len(second)
    assert c.logprobs == [LOGPROB] * len(first) + [0.0] * len(observation) + [LOGPROB] * len(second)
    assert c.last_turn_ids == second
    # the second turn was asked with the whole conversation so far, token for token
    assert engine.calls[1][0][0].prompt_ids == (*c.prompt_ids, *first, *observation)


# ------------------------------------------------------------------------------------------------------ limits


def test_a_conversation_that_never_ends_stops_after_max_turns_model_turns(tok):
    prompt = prompt_with_answer_digits(3)
    engine = FakeEngine(tok, always_call)
    (c,) = converse(tok, engine, [prompt], calculator(max_turns=3, max_total_tokens=1024))
    assert (c.finish_reason, c.turns, c.tool_calls) == (FINISH_TURNS, 3, 3)
    assert len(engine.calls) == 3
    assert c.loss_mask[-1] == 1 and c.last_turn[1] == len(c.response_ids)  # a model turn is last
    assert c.last_turn_ids == engine.calls[-1][2][0].response_ids
    assert c.loss_mask.count(0) > 0 and [m["role"] for m in c.messages].count("tool") == 2


def test_a_turn_without_a_stop_token_ends_the_conversation_with_length(tok):
    prompt = prompt_with_answer_digits(3)
    engine = FakeEngine(tok, never_stop=True)
    (c,) = converse(tok, engine, [prompt], calculator(), max_new_tokens=12)
    assert (c.finish_reason, c.turns, c.tool_calls) == (FINISH_LENGTH, 1, 0)
    assert len(engine.calls) == 1 and engine.calls[0][1].max_new_tokens == 12
    assert len(c.response_ids) == 12 and c.loss_mask == [1] * 12 and c.logprobs == [LOGPROB] * 12
    assert c.last_turn_ids == c.response_ids
    assert [m["role"] for m in c.messages] == ["user"]  # the cut turn is never handed to the environment


def test_the_first_turn_is_given_at_most_max_total_tokens(tok):
    prompt = prompt_with_answer_digits(3)
    engine = FakeEngine(tok, never_stop=True)
    (c,) = converse(tok, engine, [prompt], calculator(max_total_tokens=20), max_new_tokens=50)
    assert engine.calls[0][1].max_new_tokens == 20
    assert (c.finish_reason, c.turns, len(c.response_ids)) == (FINISH_LENGTH, 1, 20)


def full_conversation(tok, prompt):
    """(tokens of the first turn, tokens of the observation, tokens of the second turn) of the perfect policy."""
    (c,) = converse(tok, FakeEngine(tok, call_then_answer([prompt])), [prompt], calculator())
    start, end = c.last_turn
    assert c.finish_reason == FINISH_STOP and end == len(c.response_ids)
    first = c.loss_mask.index(0)
    return first, start - first, end - start


def test_a_later_turn_is_given_what_is_left_of_max_total_tokens(tok):
    prompt = prompt_with_answer_digits(3)
    first, observation, second = full_conversation(tok, prompt)
    budget = first + observation + second + 2  # the second turn fits in what is left, which is < max_new_tokens
    engine = FakeEngine(tok, call_then_answer([prompt]))
    (c,) = converse(tok, engine, [prompt], calculator(max_total_tokens=budget), max_new_tokens=first + 5)
    assert [params.max_new_tokens for _, params, _ in engine.calls] == [first + 5, second + 2]
    assert (c.finish_reason, c.turns, len(c.response_ids)) == (FINISH_STOP, 2, first + observation + second)


def test_a_turn_that_would_pass_max_total_tokens_is_cut_at_the_budget(tok):
    prompt = prompt_with_answer_digits(3)
    first, observation, second = full_conversation(tok, prompt)
    budget = first + observation + second - 1
    engine = FakeEngine(tok, call_then_answer([prompt]))
    (c,) = converse(tok, engine, [prompt], calculator(max_total_tokens=budget), max_new_tokens=first + 5)
    assert engine.calls[1][1].max_new_tokens == second - 1
    assert (c.finish_reason, c.turns, len(c.response_ids)) == (FINISH_LENGTH, 2, budget)


def test_an_observation_that_would_pass_max_total_tokens_ends_the_conversation_unappended(tok):
    prompt = prompt_with_answer_digits(3)
    first, observation, _ = full_conversation(tok, prompt)
    engine = FakeEngine(tok, call_then_answer([prompt]))
    (c,) = converse(tok, engine, [prompt], calculator(max_total_tokens=first + observation), max_new_tokens=first)
    assert (c.finish_reason, c.turns, c.tool_calls) == (FINISH_LENGTH, 1, 1)
    assert len(engine.calls) == 1
    assert c.response_ids == engine.calls[0][2][0].response_ids and c.loss_mask == [1] * first
    assert c.last_turn_ids == c.response_ids  # the last thing is the model's turn
    assert [m["role"] for m in c.messages] == ["user", "assistant"]  # the tool message was not appended


# ---------------------------------------------------------------------------------------- seeds and batching


def test_each_turn_has_its_own_seed_and_a_turn_makes_one_generate_call_per_allowance(tok):
    prompts = [prompt_with_answer_digits(3), prompt_with_answer_digits(4)]  # observations of different lengths
    sizes = [full_conversation(tok, p) for p in prompts]
    assert len({f + o for f, o, _ in sizes}) == 2
    budget = max(f + o + s for f, o, s in sizes) + 1
    max_new_tokens = max(f for f, _, _ in sizes) + 1  # more than what is left for the second turn

    def seed_of(prompt_id, k):
        return sample_seed(5, 1, prompt_id, k)

    def run():
        engine = FakeEngine(tok, call_then_answer(prompts))
        conversations = converse(tok, engine, prompts, calculator(max_total_tokens=budget, workers=2),
                                 max_new_tokens=max_new_tokens, n=2, seed_of=seed_of)  # fmt: skip
        return engine, conversations

    engine, conversations = run()
    assert [c.finish_reason for c in conversations] == [FINISH_STOP] * 4
    by_turn = engine.turn_calls()
    assert sorted(by_turn) == [0, 1]
    ((requests, params, _),) = by_turn[0]  # every sample's first turn in one call, with the sample's seed
    assert params.n == 1 and params.max_new_tokens == max_new_tokens
    assert [(r.prompt_id, r.sample_index, r.seed) for r in requests] == [
        (p.prompt_id, k, seed_of(p.prompt_id, k)) for p in prompts for k in range(2)
    ]
    first_seeds = {r.seed for r in requests}
    later = by_turn[1]
    assert len(later) == 2  # two allowances: two calls, the smaller first, each with its own samples
    expected = sorted((budget - f - o, p.prompt_id) for p, (f, o, _) in zip(prompts, sizes, strict=True))
    assert expected[-1][0] < max_new_tokens
    assert [(params.max_new_tokens, params.n, {r.prompt_id for r in requests}, len(requests))
            for requests, params, _ in later] == [(a, 1, {prompt_id}, 2) for a, prompt_id in expected]  # fmt: skip
    second_seeds = [r.seed for requests, _, _ in later for r in requests]
    assert len(set(second_seeds)) == 4 and not first_seeds & set(second_seeds)

    again, conversations_again = run()
    assert [[(r.prompt_id, r.sample_index, r.seed, r.prompt_ids) for r in requests] for requests, _, _ in again.calls
            ] == [[(r.prompt_id, r.sample_index, r.seed, r.prompt_ids) for r in requests]
                  for requests, _, _ in engine.calls]  # fmt: skip
    assert [(c.response_ids, c.loss_mask) for c in conversations_again] == [
        (c.response_ids, c.loss_mask) for c in conversations
    ]


# ---------------------------------------------------------------------------------- the environment's answers

USER_ENV = '''
class HalfEnv:
    """Two steps of reward 0.5 each; its own first messages; metrics 'step' (changes) and 'first' (step 1 only)."""

    def __init__(self, steps=2):
        self.steps, self.taken = steps, 0

    def reset(self, prompt, answer, metadata, seed):
        return [{"role": "system", "content": "Count."}, {"role": "user", "content": "Say a number."}]

    def step(self, messages):
        self.taken += 1
        done = self.taken >= self.steps
        metrics = {"step": self.taken, **({"first": 7} if self.taken == 1 else {})}
        return ([] if done else [{"role": "user", "content": "Again."}]), 0.5, done, metrics
'''


@pytest.fixture
def user_env(tmp_path, monkeypatch):
    """`user_envs:HalfEnv`, importable by the worker processes."""
    (tmp_path / "user_envs.py").write_text(USER_ENV)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(REPO)]))
    return EnvironmentSettings("user_envs:HalfEnv", {"steps": 2}, ConversationLimits(4, 256, "none"), 10.0, 1)


def test_the_reward_is_summed_over_steps_and_metrics_keep_their_last_value(tok, user_env):
    prompt = prompt_with_answer_digits(3)
    engine = FakeEngine(tok, lambda prompt_id, turn: str(turn + 1))
    (c,) = converse(tok, engine, [prompt], user_env)
    assert (c.finish_reason, c.turns, c.tool_calls) == (FINISH_STOP, 2, 0)
    assert c.reward == 1.0
    assert c.metrics == {"step": 2.0, "first": 7.0}


def test_reset_messages_replace_the_prompts_own(tok, user_env):
    prompt = prompt_with_answer_digits(3)
    engine = FakeEngine(tok, lambda prompt_id, turn: str(turn + 1))
    (c,) = converse(tok, engine, [prompt], user_env)
    text = tok.decode(c.prompt_ids, skip_special_tokens=False)
    reset = [{"role": "system", "content": "Count."}, {"role": "user", "content": "Say a number."}]
    assert text == tok.render_chat(reset, CHAT, add_generation_prompt=True)
    assert "Say a number." in text and prompt.text not in text
    assert c.messages[:2] == reset
    rendered = tok.render_chat(c.messages, CHAT, add_generation_prompt=False)
    assert rendered == tok.decode(c.prompt_ids + c.response_ids, skip_special_tokens=False) + "\n"


# ----------------------------------------------------------------------------------------- the demo's SFT data


def test_conversation_examples_train_on_the_model_turns_only(tok):
    prompts = [prompt_with_answer_digits(3), prompt_with_answer_digits(4)]
    examples = conversation_examples(prompts, tok, CHAT, calculator(workers=2))
    engine = FakeEngine(tok, call_then_answer(prompts))
    conversations = converse(tok, engine, prompts, calculator(workers=2), max_new_tokens=64, seed_of=lambda p, k: 0)
    assert len(examples) == len(conversations) == 2
    for (ids, mask), c in zip(examples, conversations, strict=True):
        assert c.finish_reason == FINISH_STOP
        assert ids == c.prompt_ids + c.response_ids
        assert mask == [False] * len(c.prompt_ids) + [bool(m) for m in c.loss_mask]
        assert sum(mask) == sum(len(t) for t in (tok.encode_text(s) + [tok.eos_id] for s in TASK.sft_turns(c.prompt)))
