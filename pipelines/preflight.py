"""Early checks of a run's inputs: `moerl check CONFIG`, and what render, submit and run do first.

They read what the steps will read, before anything starts: the SFT checkpoint's config.json (a refused
architecture is named, with what is supported) and its tokenizer (readable, stop tokens, a chat template for
prompt_format chat), the prompt and held-out files (every record, encoded by that tokenizer in the run's
prompt format, each answer readable by the run's verifier), whether max_new_tokens holds a built-in task's
answers, the reward model (loaded) and the reward function (imported in a worker, as score does), and
whether the trainer's plan and the rollout engine fit their GPUs' memory for that checkpoint's model
(pipelines/simulate/memory_check.py, where a pool's instance type names its GPU). Every
problem is reported at once; an input whose store cannot be reached from here (an s3:// URI without
credentials) is noted as not checked, and so is a reward function that is not installed here when the run is
for a cluster (render, submit).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from steps.errors import MoerlError
from steps.run.config import RunConfig

if TYPE_CHECKING:
    from steps.data.tokenizer import CheckpointTokenizer, PromptFormat, PromptInput
    from steps.models.family import FamilyConfig

MAX_TOKEN_PROBLEMS = 5


def _fetch_small_files(uri: str, local: Path) -> list[str]:
    """config.json and the tokenizer files of a checkpoint, not its weights; returns every name there."""
    from steps.data.tokenizer import TOKENIZER_FILES
    from steps.store.object_store import Store

    store = Store.open(uri)
    names = store.list()
    for name in TOKENIZER_FILES:
        if name in names:
            store.get_file(name, local / name)
    return names


def _probe(uri: str) -> None:
    """Open the store that holds `uri` and look for it (raises when the store cannot be reached)."""
    from steps.store.object_store import Store

    parent, _, name = uri.rstrip("/").rpartition("/")
    if parent and name:
        Store.open(parent).exists(name)


def _unreachable(uri: str, err: Exception) -> bool:
    """Whether reading `uri` failed because its store cannot be reached from here (an s3:// URI: no
    credentials or no network on this machine), not because of what is there."""
    return uri.startswith("s3://")


def preflight(cfg: RunConfig, for_cluster: bool = False) -> tuple[list[str], list[str]]:
    """(problems, notes) of the run's inputs; see the module docstring."""
    from steps.data.tokenizer import CheckpointTokenizer
    from steps.models.hf_checkpoint import load_config

    problems: list[str] = []
    notes: list[str] = []
    tok = None
    model_cfg: FamilyConfig | None = None
    with tempfile.TemporaryDirectory(prefix="moerl-check-") as tmp:
        local = Path(tmp)
        try:
            names = _fetch_small_files(cfg.sft_checkpoint, local)
            if "config.json" not in names:
                problems.append(f"sft_checkpoint {cfg.sft_checkpoint}: no config.json there; point it at an HF "
                                "checkpoint directory (save_pretrained)")  # fmt: skip
            else:
                try:
                    model_cfg = load_config(local)
                    problems += _memory_problems(cfg, local)
                    if cfg.rollout.engine == "sglang":
                        from steps.engines.sglang_engine import family_server_args
                        from steps.models.hf_checkpoint import read_config_json

                        family_server_args(read_config_json(local), cfg.rollout.sglang.moe_a2a_backend,
                                           record_routes=cfg.records_routes)  # fmt: skip
                except MoerlError as err:
                    problems.append(f"sft_checkpoint {str(err).replace(str(local), cfg.sft_checkpoint)}")
                try:
                    tok = CheckpointTokenizer.load(local, source=cfg.sft_checkpoint)
                except MoerlError as err:
                    problems.append(str(err))
        except Exception as err:  # noqa: BLE001  # a store error of any kind: reported, never a traceback
            if _unreachable(cfg.sft_checkpoint, err):
                notes.append(f"sft_checkpoint {cfg.sft_checkpoint} not checked: unreachable from here ({err})")
            else:
                problems.append(f"sft_checkpoint {cfg.sft_checkpoint}: cannot be read ({err}); check the URI")
    fmt = None
    if tok is not None:
        from steps.experience.rollout_plan import prompt_format

        fmt = prompt_format(cfg)
        if cfg.prompt_format == "chat" and tok.chat_template is None:
            problems.append(
                f"{cfg.sft_checkpoint}: prompt_format is chat but the checkpoint has no chat template; add "
                "chat_template.jinja (or chat_template in tokenizer_config.json) or set prompt_format: raw"
            )
            fmt = None
        if model_cfg is not None and tok.vocab_size > model_cfg.vocab_size:
            problems.append(f"{cfg.sft_checkpoint}: the tokenizer has {tok.vocab_size} tokens but config.json has "
                            f"vocab_size {model_cfg.vocab_size}; they must come from the same checkpoint")  # fmt: skip
    problems += _prompt_problems(cfg, tok, fmt, model_cfg, notes)
    problems += _reward_problems(cfg, for_cluster, notes)
    return problems, notes


def _memory_problems(cfg: RunConfig, local: Path) -> list[str]:
    """The trainer's plan and the rollout engine against their GPUs' memory, for the checkpoint's own model."""
    from pipelines.simulate.memory_check import rollout_memory_problem, trainer_memory_problem
    from pipelines.simulate.model_sizing import model_sizing
    from steps.models.hf_checkpoint import read_config_json

    m = model_sizing(read_config_json(local), source=f"{cfg.sft_checkpoint}")
    return [p for p in (trainer_memory_problem(cfg, m), rollout_memory_problem(cfg, m)) if p]


def _prompt_problems(
    cfg: RunConfig,
    tok: CheckpointTokenizer | None,
    fmt: PromptFormat | None,
    model_cfg: FamilyConfig | None,
    notes: list[str],
) -> list[str]:
    from steps.data.prompt_data import read_prompt_uri
    from steps.data.tasks import sft_target
    from steps.experience.rollout_plan import prompt_fields, run_task
    from steps.scoring.rewards import sample_verifier

    if TYPE_CHECKING:
        from steps.data.verifiers import Verifier

    problems: list[str] = []
    room = model_cfg.max_position_embeddings if model_cfg is not None else None
    longest: list[tuple[int, str]] = []

    def prompt_problem(prompt: PromptInput) -> str | None:
        assert tok is not None and fmt is not None
        ids, problem = tok.checked_prompt_ids(prompt, fmt)
        if problem is None:
            longest.append((len(ids), str(prompt)[:40]))
        return problem

    task = run_task(cfg)
    if task is not None and tok is not None and fmt is not None:
        sample = task.prompts("heldout", min(cfg.heldout_size or 64, 64), cfg.seed)
        for p in sample:
            if problem := prompt_problem(p.content):
                problems.append(f"task {task.name}: prompt {p.text!r}: {problem}")
                break
        needed = max(len(tok.encode_text(sft_target(p))) for p in sample) + 1
        if cfg.sampling.max_new_tokens < needed:
            problems.append(
                f"sampling.max_new_tokens: {cfg.sampling.max_new_tokens} cannot hold {task.name}'s longest answer "
                f"({needed - 1} tokens of the checkpoint's tokenizer) and its stop token; use at least {needed}"
            )
    verifier: Verifier | None = None
    if task is None:
        try:
            verifier = sample_verifier("prompt_file", cfg.rewards.verifier, cfg.rewards.answer_pattern)
        except MoerlError as err:
            problems.append(str(err))
    for field, uri in (("prompt_file", cfg.prompt_file), ("heldout_file", cfg.heldout_file)):
        if uri is None:
            continue
        try:
            _probe(uri)
        except Exception as err:  # noqa: BLE001
            if _unreachable(uri, err):
                notes.append(f"{field} {uri} not checked: unreachable from here ({err})")
                continue
        try:
            check = prompt_problem if tok is not None and fmt is not None else None
            read_prompt_uri(uri, prompt_fields(cfg), verifier, check)
        except MoerlError as err:
            problems.append(f"{field}: {err}")
        except Exception as err:  # noqa: BLE001
            if _unreachable(uri, err):
                notes.append(f"{field} {uri} not checked: unreachable from here ({err})")
            else:
                problems.append(f"{field} {uri}: cannot be read ({err}); check the URI")
    if room is not None and longest:
        worst = max(longest)
        generated, setting = cfg.sampling.max_new_tokens, "sampling.max_new_tokens"
        if cfg.environment is not None:  # a conversation after its first prompt (the tools' schemas come on top)
            generated, setting = cfg.environment.max_total_tokens, "environment.max_total_tokens"
        if worst[0] + generated > room:
            problems.append(
                f"prompts: the longest prompt ({worst[1]!r}...) has {worst[0]} tokens, which with {setting} "
                f"{generated} exceeds the checkpoint's max_position_embeddings {room}; shorten the prompts or lower "
                f"{setting}"
            )
    return problems


def _reward_problems(cfg: RunConfig, for_cluster: bool, notes: list[str]) -> list[str]:
    problems: list[str] = []
    spec = cfg.rewards.reward_fn
    if spec is not None:
        from steps.scoring.user_reward import RewardFunction

        try:
            RewardFunction(spec, cfg.rewards.reward_fn_timeout_s).close()
        except MoerlError as err:
            if for_cluster and "cannot import" in str(err):
                notes.append(f"{err} (not installed here: the score step imports it in the cpu image)")
            else:
                problems.append(str(err))
    if cfg.environment is not None:
        from steps.environments.conversation import EnvironmentSettings

        try:  # one worker imports the class, as the rollout's do
            EnvironmentSettings.from_config(cfg.environment).open_pool(1).close()
        except MoerlError as err:
            if for_cluster and "cannot import" in str(err):
                notes.append(f"{err} (not installed here: the rollout step imports it in the cpu image)")
            else:
                problems.append(str(err))
    if cfg.rewards.reward_model is not None:
        from steps.scoring.rewards import RewardModel

        try:
            RewardModel.load(cfg.rewards.reward_model)
        except MoerlError as err:
            problems.append(str(err))
        except Exception as err:  # noqa: BLE001
            if _unreachable(cfg.rewards.reward_model, err):
                notes.append(f"rewards.reward_model {cfg.rewards.reward_model} not checked: unreachable ({err})")
            else:
                problems.append(f"rewards.reward_model {cfg.rewards.reward_model}: cannot be read ({err})")
    return problems


def preflight_or_exit(cfg: RunConfig, for_cluster: bool = False, source: str = "run config") -> list[str]:
    """Run the checks; every problem in one MoerlError (exit code 2), notes to stderr. Returns the notes."""
    problems, notes = preflight(cfg, for_cluster)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if problems:
        lines = "\n  ".join(problems)
        raise MoerlError(f"{source}: {len(problems)} problem(s) with the run's inputs:\n  {lines}")
    return notes
