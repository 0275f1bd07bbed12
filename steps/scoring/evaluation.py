"""Held-out accuracy of a published policy version: greedy generation on the run's held-out prompts, checked
by the run's verifier.

The held-out prompts are the task's held-out split, or the prompt file's (heldout_file, else the stable-hash
split that training never sees; steps/experience/rollout_plan.py). They are encoded by the version's own tokenizer in
the
run's prompt format, exactly as rollout encodes training prompts. The score step records the accuracy for the
behaviour policy of each iteration, and the report step for the final version, so that a run shows where it
started and where it ended. `evaluate_accuracy` does the measuring, the same for every engine of
steps/engines/interface.py (and for a bare policy model, wrapped in a torch engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from steps.data.tasks import Prompt, Task, get_task, verify_ids
from steps.data.tokenizer import RAW, CheckpointTokenizer, PromptFormat, load_tokenizer
from steps.engines.interface import Engine, GenerationRequest, SamplingParams, sample_seed
from steps.engines.torch_engine import TorchEngine
from steps.environments.conversation import EnvironmentSettings, run_conversations
from steps.experience.rollout_plan import heldout_prompts, prompt_format
from steps.run import weight_delta
from steps.run.config import RunConfig
from steps.run.keys import version_prefix
from steps.scoring.rewards import sample_verifier
from steps.store.object_store import Store

HELDOUT_EVAL_MAX_BYTES = 512 << 20


def evaluate_accuracy(
    engine_or_model: Engine | nn.Module,
    tokenizer: CheckpointTokenizer,
    prompts: Sequence[Prompt],
    verifier: Callable[[Prompt], Task] | Task | str | None = None,
    prompt_format: PromptFormat = RAW,
    max_new_tokens: int = 16,
    batch_size: int = 256,
    environment: EnvironmentSettings | None = None,
) -> float:
    """Share of prompts whose greedy (temperature 0) response the verifier accepts: the answer, then one of the
    tokenizer's stop tokens, within max_new_tokens.

    `verifier`: a task (or its name) for every prompt, a function of the prompt, or None for each prompt's own
    task. A bare policy model (an nn.Module) is wrapped in a TorchEngine for the call (built from its current
    weights). With an environment each prompt is a conversation (steps/environments/conversation.py), max_new_tokens
    a turn's, and the verifier reads its last turn.
    """
    if not prompts:
        raise ValueError("evaluate_accuracy needs at least one prompt")
    engine = TorchEngine(engine_or_model) if isinstance(engine_or_model, nn.Module) else engine_or_model
    fixed = get_task(verifier) if isinstance(verifier, str) else verifier
    if fixed is None:
        verifier_of: Callable[[Prompt], Task] = lambda p: get_task(p.task)  # noqa: E731
    elif callable(fixed) and not hasattr(fixed, "verify"):
        verifier_of = fixed  # type: ignore[assignment]
    else:
        verifier_of = lambda p: fixed  # type: ignore[assignment,return-value]  # noqa: E731
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tokenizer.stop_ids)
    correct = 0
    if environment is not None:
        with environment.open_pool(len(prompts)) as pool:
            for start in range(0, len(prompts), batch_size):
                batch = prompts[start : start + batch_size]
                conversations = run_conversations(  # each prompt's environment seeded by its id
                    engine, tokenizer, prompt_format, pool, batch, params, environment.limits,
                    lambda p, k: sample_seed(0, 0, p, k),
                )
                for prompt, c in zip(batch, conversations, strict=True):
                    correct += verify_ids(verifier_of(prompt), tokenizer, c.last_turn_ids, prompt.answer).correct
        return correct / len(prompts)
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        requests = [
            GenerationRequest(p.prompt_id, tuple(tokenizer.prompt_ids(p.content, prompt_format)), 0, 0) for p in batch
        ]
        for prompt, generation in zip(batch, engine.generate(requests, params), strict=True):
            verdict = verify_ids(verifier_of(prompt), tokenizer, generation.response_ids, prompt.answer)
            correct += verdict.correct
    return correct / len(prompts)


def heldout_accuracy(run: Store, cfg: RunConfig, version: int, log: Any) -> float | None:
    """Greedy held-out accuracy of `version`, or None when there is no held-out set or the model is big."""
    prompts = heldout_prompts(cfg)
    if not prompts:
        return None
    files = weight_delta.require_version_files(run, version)  # published, or indexed before publish
    weight_bytes = sum(int(m["size"]) for name, m in files.items() if name.endswith(".safetensors"))
    if weight_bytes > HELDOUT_EVAL_MAX_BYTES:
        log(f"held-out accuracy skipped: {weight_bytes / 2**30:.1f} GiB of weights is too big to evaluate on CPU")
        return None
    model_dir = weight_delta.fetch_version(run, version)
    tokenizer = load_tokenizer(model_dir, source=run.url(version_prefix(version)))
    engine = TorchEngine.from_checkpoint(model_dir)
    verifiers = {p.task: sample_verifier(p.task, cfg.rewards.verifier, cfg.rewards.answer_pattern) for p in prompts}
    environment = None if cfg.environment is None else EnvironmentSettings.from_config(cfg.environment)
    return evaluate_accuracy(
        engine, tokenizer, prompts, lambda p: verifiers[p.task], prompt_format(cfg), cfg.sampling.max_new_tokens,
        environment=environment,
    )  # fmt: skip
