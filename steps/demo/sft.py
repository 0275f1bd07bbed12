"""Supervised fine-tuning of the small demo MoE on a toy task, on the CPU.

This makes the SFT checkpoint that the demo's RL run starts from: trained just long enough to
follow the task format and get a fair share of held-out problems right, leaving room for RL.
Deterministic for a seed: data order, initialisation and every update derive from it.

The checkpoint's tokenizer is written first and SFT encodes through it exactly as the RL steps will
(steps/data/tokenizer.py): the demo's character tokenizer with raw prompts (`moerl demo`), or a BPE trained on
the task's text with a chat template (`moerl demo --config configs/demo-chat.yaml`).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steps.data.tasks import Prompt, get_task, sft_target, verify_ids
from steps.data.tokenizer import RAW, CheckpointTokenizer, PromptFormat
from steps.demo import bpe_tokenizer, char_tokenizer
from steps.engines.interface import FINISH_STOP, Generation, GenerationRequest, SamplingParams
from steps.engines.torch_engine import TorchEngine
from steps.environments.conversation import EnvironmentSettings, run_conversations
from steps.environments.tool_calls import parse_turn
from steps.environments.worker import resolve
from steps.errors import MoerlError
from steps.models.causal_lm import MoeCausalLM
from steps.models.deepseek_v3.config import DeepseekConfig
from steps.models.hf_checkpoint import save_pretrained
from steps.models.qwen3_moe.config import MoeConfig
from steps.models.registry import family_of


def encode_example(
    prompt: Prompt, tok: CheckpointTokenizer, fmt: PromptFormat = RAW
) -> tuple[list[int], list[bool]]:
    """Token ids of the prompt (as rollout encodes it) + target answer + eos, and which of them are trained on."""
    prompt_ids = tok.prompt_ids(prompt.content, fmt)
    response = [*tok.encode_text(sft_target(prompt)), tok.eos_id]
    return prompt_ids + response, [False] * len(prompt_ids) + [True] * len(response)


class ScriptedEngine:
    """An engine that writes each conversation's turns from a script (the SFT targets of a tool task), so that the
    SFT examples of a multi-turn task are made by the RL rollout's own conversation loop, token for token."""

    name = "scripted"

    def __init__(self, tok: CheckpointTokenizer, turns: dict[str, list[str]]) -> None:
        self.tok, self.turns = tok, turns
        self.taken: dict[tuple[str, int], int] = {}

    def generate(self, requests: Any, params: SamplingParams, should_stop: Any = None) -> list[Generation]:
        out = []
        for r in requests:
            turn = self.taken.get((r.prompt_id, r.sample_index), 0)
            self.taken[(r.prompt_id, r.sample_index)] = turn + 1
            ids = [*self.tok.encode_text(self.turns[r.prompt_id][turn]), self.tok.eos_id]
            out.append(Generation(r.prompt_id, r.sample_index, ids, [0.0] * len(ids), FINISH_STOP))
        return out

    def update_weights(self, model_dir: Any) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    def close(self) -> None:
        pass


def conversation_examples(
    prompts: list[Prompt], tok: CheckpointTokenizer, fmt: PromptFormat, environment: EnvironmentSettings
) -> list[tuple[list[int], list[bool]]]:
    """The SFT examples of a tool task: each prompt's conversation with the environment, the task's scripted turns
    as the model's (Multiplication.sft_turns), the model's tokens trained on and the environment's not."""
    script = {p.prompt_id: get_task(p.task).sft_turns(p) for p in prompts}  # type: ignore[attr-defined]
    longest = max(len(tok.encode_text(t)) + 1 for turns in script.values() for t in turns)
    params = SamplingParams(temperature=0.0, max_new_tokens=longest, stop_token_ids=tok.stop_ids)
    with environment.open_pool(len(prompts)) as pool:
        conversations = run_conversations(ScriptedEngine(tok, script), tok, fmt, pool, prompts, params,
                                          environment.limits, lambda p, k: 0)  # fmt: skip
    return [(c.prompt_ids + c.response_ids, [False] * len(c.prompt_ids) + [bool(m) for m in c.loss_mask])
            for c in conversations]  # fmt: skip


def teacher_forced_batch(
    examples: list[tuple[list[int], list[bool]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded inputs, next-token targets, and the mask of targets that are trained on."""
    length = max(len(ids) for ids, _ in examples)
    inputs = torch.full((len(examples), length - 1), pad_id, dtype=torch.long)
    targets = torch.full_like(inputs, pad_id)
    target_mask = torch.zeros_like(inputs, dtype=torch.bool)
    for row, (ids, trained) in enumerate(examples):
        seq = torch.tensor(ids)
        inputs[row, : len(ids) - 1] = seq[:-1]
        targets[row, : len(ids) - 1] = seq[1:]
        target_mask[row, : len(ids) - 1] = torch.tensor(trained[1:])
    return inputs, targets, target_mask


def char_checkpoint_tokenizer() -> CheckpointTokenizer:
    """The demo's character tokenizer, read back as a checkpoint's (the default of the demo's SFT)."""
    with tempfile.TemporaryDirectory(prefix="moerl-char-tokenizer-") as tmp:
        char_tokenizer.save_tokenizer(tmp)
        return CheckpointTokenizer.load(tmp)


def demo_model_config(tok: CheckpointTokenizer | None = None, arch: str = "qwen3_moe") -> Any:
    """The demo's model as family `arch` (DEMO_ARCHS) builds it, for the checkpoint's tokenizer."""
    if arch not in DEMO_ARCHS:
        raise MoerlError(f"demo architecture {arch!r} is not one of {sorted(DEMO_ARCHS)}")
    return DEMO_ARCHS[arch](tok or char_checkpoint_tokenizer())


def token_ids(tok: CheckpointTokenizer) -> dict[str, Any]:
    """The checkpoint tokenizer's special ids, as config.json names them."""
    return {
        "bos_token_id": tok.token_id("bos_token"),
        "eos_token_id": list(tok.stop_ids) if len(tok.stop_ids) > 1 else tok.stop_ids[0],
        "pad_token_id": tok.pad_id,
    }


def qwen3_moe_demo(tok: CheckpointTokenizer) -> MoeConfig:
    """About 0.5M parameters: 8 experts, top-2, small enough to train in a minute or two on 2 cores."""
    return MoeConfig(
        vocab_size=tok.vocab_size,
        hidden_size=96,
        intermediate_size=192,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
        **token_ids(tok),
    )


def deepseek_v3_demo(tok: CheckpointTokenizer) -> DeepseekConfig:
    """The same budget as a tiny DeepSeek-V3: multi-head latent attention (q and kv low-rank, the rope/nope
    split), a dense first layer, 8 routed experts top-2 chosen by sigmoid scores with the selection bias in 4
    groups of which 2 are kept, and a shared expert."""
    return DeepseekConfig(
        vocab_size=tok.vocab_size,
        hidden_size=96,
        intermediate_size=192,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        max_position_embeddings=64,
        **token_ids(tok),
    )


# The families `moerl sft-demo --arch` builds the demo's model as.
DEMO_ARCHS: dict[str, Callable[[CheckpointTokenizer], Any]] = {
    "qwen3_moe": qwen3_moe_demo,
    "deepseek_v3": deepseek_v3_demo,
}


@dataclass
class SftSettings:
    # sort6 learns its format and half its held-out problems in 50 steps (~20 s on 2 cores), and RL takes
    # it from there: addition3 needed 400 steps for 45%, and RL hardly moved that policy (see configs/demo.yaml).
    task: str = "sort6"
    seed: int = 0
    steps: int = 50
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.01
    train_prompts: int = 4096
    eval_prompts: int = 256
    tokenizer: str = "char"  # "char": the demo's character tokenizer; "bpe": a BPE with a chat template
    arch: str = "qwen3_moe"  # the model family (DEMO_ARCHS)
    prompt_format: str = "raw"  # "raw" or "chat": as the RL run's prompt_format
    system_prompt: str | None = None
    # a tool task's environment (the RL run's `environment`): SFT then trains on whole conversations with it
    environment: EnvironmentSettings | None = None
    vocab_size: int = bpe_tokenizer.DEFAULT_VOCAB_SIZE  # the BPE's
    max_positions: int = 64  # the model's max_position_embeddings (a conversation with tools is longer)
    # Stop as soon as greedy accuracy on `check_prompts` train-split prompts (not the held-out ones) reaches this,
    # checked every `check_every` steps: a skill that appears suddenly (copying the tool's answer) leaves a
    # checkpoint with room for RL whatever the seed. None: train all `steps`.
    stop_at_accuracy: float | None = None
    check_every: int = 10
    check_after: int = 0  # no check before this step (an early policy's answers are all wrong, and slow to check)
    check_prompts: int = 64

    @property
    def format(self) -> PromptFormat:
        return PromptFormat(self.prompt_format, self.system_prompt)


def write_tokenizer(settings: SftSettings, directory: Path) -> CheckpointTokenizer:
    """Write the checkpoint's tokenizer files into `directory` and read them back as every step will."""
    if settings.tokenizer == "char":
        char_tokenizer.save_tokenizer(directory)
    elif settings.tokenizer == "bpe":
        task = get_task(settings.task)
        corpus = []
        for p in task.prompts("train", settings.train_prompts, settings.seed):
            if settings.environment is not None:
                corpus.append(bpe_tokenizer.render_conversation(*scripted_conversation(p, settings)))
                continue
            turns = settings.format.messages(p.content) + [{"role": "assistant", "content": sft_target(p)}]
            corpus.append(bpe_tokenizer.chatml(turns))
        bpe_tokenizer.train_chat_tokenizer(corpus, directory, settings.vocab_size)
    else:
        raise ValueError(f"unknown demo tokenizer {settings.tokenizer!r}; use 'char' or 'bpe'")
    return CheckpointTokenizer.load(directory)


def scripted_conversation(prompt: Prompt, settings: SftSettings) -> tuple[list[dict[str, Any]], list[Any] | None]:
    """A tool task's whole conversation as messages (its scripted turns, the environment's answers, in process) and
    the environment's tools: the BPE's training text, before there is a tokenizer to run the conversation loop."""
    assert settings.environment is not None
    env = resolve(settings.environment.class_path)(**settings.environment.params)
    first = env.reset(prompt=prompt.content, answer=prompt.answer, metadata=dict(prompt.metadata), seed=0)
    messages = settings.format.messages(first if first is not None else prompt.content)
    for text in get_task(prompt.task).sft_turns(prompt):  # type: ignore[attr-defined]
        messages.append(parse_turn(text, settings.environment.limits.tool_call_format))
        observation, _, done, _ = env.step(messages)
        if done:
            break
        messages.extend(observation)
    if callable(getattr(env, "close", None)):
        env.close()
    return messages, getattr(env, "tools", None)


def train_sft(
    settings: SftSettings,
    tok: CheckpointTokenizer | None = None,
    progress: Callable[[int, float], None] | None = None,
    on_check: Callable[[int, float], None] | None = None,
) -> MoeCausalLM:
    """Train the demo model on the task's train split (tok: the checkpoint's tokenizer, by default the demo's
    characters); returns the model in eval mode."""
    tok = tok or char_checkpoint_tokenizer()
    config = demo_model_config(tok, settings.arch)
    config.max_position_embeddings = settings.max_positions
    torch.manual_seed(settings.seed)
    model = family_of(config).build(config)
    task = get_task(settings.task)
    prompts = task.prompts("train", settings.train_prompts, settings.seed)
    if settings.environment is not None:
        examples = conversation_examples(prompts, tok, settings.format, settings.environment)
    else:
        examples = [encode_example(p, tok, settings.format) for p in prompts]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, foreach=True
    )
    if settings.stop_at_accuracy is None:
        schedule: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=settings.lr, total_steps=settings.steps
        )
    else:  # a run that stops on a check: the rate stays up until the skill appears, however late
        warmup = max(settings.check_every, 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    order = random.Random(settings.seed)
    checks = []
    if settings.stop_at_accuracy is not None:
        checks = task.prompts("train", settings.check_prompts, settings.seed + 1)
    model.train()
    for step in range(settings.steps):
        inputs, targets, mask = teacher_forced_batch(order.sample(examples, settings.batch_size), tok.pad_id)
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits[mask], targets[mask])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress(step + 1, loss.item())
        if checks and (step + 1) % settings.check_every == 0 and step + 1 >= settings.check_after:
            accuracy = greedy_accuracy(model.eval(), tok, checks, settings)
            model.train()
            if on_check is not None:
                on_check(step + 1, accuracy)
            if accuracy >= settings.stop_at_accuracy:  # type: ignore[operator]
                break
    return model.eval()


def greedy_accuracy(
    model: MoeCausalLM, tok: CheckpointTokenizer, prompts: list[Prompt], settings: SftSettings
) -> float:
    """Share of `prompts` the model answers right greedily (a conversation with the environment for a tool task)."""
    engine = TorchEngine(model)
    task = get_task(settings.task)
    turn = max(len(tok.encode_text(t)) for p in prompts for t in sft_turns_or_target(p)) + 2
    params = SamplingParams(temperature=0.0, max_new_tokens=turn, stop_token_ids=tok.stop_ids)
    if settings.environment is not None:
        env = settings.environment
        with env.open_pool(len(prompts)) as pool:
            conversations = run_conversations(engine, tok, settings.format, pool, prompts, params, env.limits, _no_seed)
        finals = [c.last_turn_ids for c in conversations]
    else:
        requests = [GenerationRequest(p.prompt_id, tuple(tok.prompt_ids(p.content, settings.format)), 0, 0)
                    for p in prompts]  # fmt: skip
        finals = [g.response_ids for g in engine.generate(requests, params)]
    return sum(verify_ids(task, tok, ids, p.answer).correct for p, ids in zip(prompts, finals, strict=True)) / len(
        prompts
    )


def _no_seed(prompt_id: str, sample: int) -> int:
    return 0  # greedy decoding draws nothing


def sft_turns_or_target(prompt: Prompt) -> list[str]:
    """The turns a perfect policy writes for `prompt`: a tool task's sft_turns, else its one answer."""
    task = get_task(prompt.task)
    return task.sft_turns(prompt) if hasattr(task, "sft_turns") else [sft_target(prompt)]


def write_checkpoint(model: MoeCausalLM, directory: Path) -> Path:
    """An HF-format checkpoint: config.json, safetensors weights, beside the tokenizer write_tokenizer wrote
    (the demo's character tokenizer when there is none yet)."""
    directory = Path(directory)
    save_pretrained(model, directory)
    if not (directory / "tokenizer.json").is_file():
        char_tokenizer.save_tokenizer(directory)
    return directory
