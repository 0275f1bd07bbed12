"""The run config's checks that a field's own type cannot express (steps/run/config.py validate_config runs
them after the schema): across fields, names Kubernetes and Argo take, store URIs, resource quantities and
durations, the reward function's dotted path, cron schedules and time zones. Each returns (field path, 'what is
wrong; the fix') pairs, which validate_config merges into its one error.
"""

from __future__ import annotations

import difflib
import re
import typing
import zoneinfo
from typing import Any

from pydantic import BaseModel

from steps.errors import MoerlError

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[+]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")
_DURATION = re.compile(r"^\d+(\.\d+)?(ns|us|ms|s|m|h)?$")
_DOTTED_FN = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
_URI = re.compile(r"^(file://|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/|$))")


def _is_uri(text: str) -> bool:
    return bool(_URI.match(text)) or "://" not in text


_HTTP_URL = re.compile(r"^https?://[^\s/]+")
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_ENV_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _check_tracking(tracking: Any, bad: typing.Callable[[str, str], None]) -> None:
    """URLs are http(s), Secret names are Kubernetes names: a typo fails at load, not in the tracked step."""
    urls = {"tracking.argo_ui_url": tracking.argo_ui_url}
    names = {}
    if tracking.mlflow is not None:
        urls["tracking.mlflow.tracking_uri"] = tracking.mlflow.tracking_uri
        names["tracking.mlflow.secret"] = tracking.mlflow.secret
    if tracking.wandb is not None:
        urls["tracking.wandb.base_url"] = tracking.wandb.base_url
        names["tracking.wandb.api_key_secret"] = tracking.wandb.api_key_secret
        if not _ENV_KEY.match(tracking.wandb.api_key_secret_key):
            bad("tracking.wandb.api_key_secret_key", f"{tracking.wandb.api_key_secret_key!r} is not a Secret key; "
                "use letters, digits, '-', '_' or '.', e.g. WANDB_API_KEY")  # fmt: skip
    for path, url in urls.items():
        if url is not None and not _HTTP_URL.match(url):
            bad(path, f"{url!r} is not an http(s) URL; write e.g. https://mlflow.example.com")
    for path, name in names.items():
        if name is not None and (not _SECRET_NAME.match(name) or len(name) > 253):
            bad(path, f"{name!r} is not a Kubernetes Secret name; use lowercase letters, digits, '-' and '.'")


def _check_task(task: Any, bad: typing.Callable[[str, str], None]) -> None:
    """A task family of steps.data.tasks whose parameters build a task (whether max_new_tokens holds its answers
    needs the checkpoint's tokenizer: pipelines/preflight.py checks that)."""
    from steps.data.tasks import FAMILIES, get_task  # here: the config module is read by tools that never build a task

    if task.name.rstrip("0123456789") not in FAMILIES:
        hint = difflib.get_close_matches(task.name, FAMILIES, n=1)
        bad(
            "task.name",
            f"unknown task {task.name!r}; use one of {', '.join(FAMILIES)} or a prompt_file"
            + (f" (did you mean {hint[0]!r}?)" if hint else ""),
        )
        return
    try:
        get_task(task.name, **task.params)
    except MoerlError as err:
        bad("task", str(err))


def semantic_problems(cfg: Any) -> list[tuple[str, str]]:
    """Checks of a RunConfig (steps/run/config.py, which imports this module: hence the plain types) that span
    fields. Returns (field path, 'what is wrong; the fix') pairs."""
    problems: list[tuple[str, str]] = []

    def bad(path: str, message: str) -> None:
        problems.append((path, message))

    if not _DNS_LABEL.match(cfg.name) or len(cfg.name) > 40:
        bad(
            "name",
            f"{cfg.name!r} is not a valid run name; use lowercase letters, digits and '-' "
            "(at most 40 characters, starting and ending with a letter or digit)",
        )
    for path in ("sft_checkpoint", "run_store", "prompt_file", "heldout_file", "rewards.reward_model"):
        value = _get(cfg, path)
        if value is not None and "\x00" in value:
            bad(path, f"{value!r} holds a NUL character; write a plain path or a file:// or s3:// URI")
        elif value is not None and (not value.strip() or not _is_uri(value)):
            bad(
                path,
                f"{value!r} is not a store URI; use file:///abs/path, s3://bucket/prefix or a plain path",
            )
    _check_tracking(cfg.tracking, bad)
    if "{{" in cfg.model_dump_json():
        bad("(any string)", "'{{' would be read by Argo as a template variable; remove it from the config")
    if cfg.task is not None and cfg.prompt_file is not None:
        bad(
            "prompt_file",
            "both task and prompt_file are set; keep one (prompt_file replaces the built-in task)",
        )
    if cfg.task is not None:
        _check_task(cfg.task, bad)
    chunks = -(-cfg.prompts_per_iteration // cfg.rollout.chunk_size)
    if cfg.rollout.num_shards > chunks:
        bad(
            "rollout.num_shards",
            f"{cfg.rollout.num_shards} shards but only {chunks} chunks of "
            f"{cfg.rollout.chunk_size} prompts per iteration; use at most {chunks} shards "
            "or a smaller rollout.chunk_size",
        )
    if cfg.trainer.loss == "gspo" and cfg.trainer.loss_agg != "seq-mean":
        bad(
            "trainer.loss",
            "gspo's ratio is a sequence's and its loss a mean over sequences (Zheng et al. 2025); set "
            "trainer.loss_agg: seq-mean",
        )
    if cfg.trainer.is_lower is not None and cfg.trainer.is_lower >= cfg.trainer.is_cap:
        bad(
            "trainer.is_lower",
            f"{cfg.trainer.is_lower} is not below is_cap {cfg.trainer.is_cap}; the band [is_lower, is_cap] would be "
            "empty",
        )
    if cfg.trainer.sequence_packing and cfg.trainer.shared_prompts:
        bad(
            "trainer.sequence_packing",
            "packs whole sequences, while shared_prompts runs each prompt once for its group; keep one of them",
        )
    sg = cfg.rollout.sglang
    if sg.moe_a2a_backend == "deepep" and sg.ep_size < 2:
        bad(
            "rollout.sglang.ep_size",
            "moe_a2a_backend 'deepep' needs ep_size >= 2; raise ep_size or use 'none'",
        )
    rollout_limits = cfg.placement["rollout"].resources.limits
    if cfg.rollout.engine == "sglang" and "nvidia.com/gpu" not in rollout_limits:
        bad(
            "placement.rollout.resources.limits",
            "rollout.engine 'sglang' needs GPUs; add 'nvidia.com/gpu: N'",
        )
    elif cfg.rollout.engine == "sglang" and str(rollout_limits["nvidia.com/gpu"]).isdigit():
        gpus = int(rollout_limits["nvidia.com/gpu"])
        for field in ("tp_size", "ep_size"):
            size = getattr(sg, field)
            if size > gpus:  # an engine is one SGLang server in one rollout pod: no engine spans two pods
                bad(
                    f"rollout.sglang.{field}",
                    f"{size} GPUs for one engine, but a rollout pod has {gpus} "
                    "(placement.rollout.resources.limits nvidia.com/gpu) and an engine runs inside one pod; use "
                    f"at most {gpus}, or a model whose weights fit {gpus} GPUs",
                )
    if cfg.trainer.ep_backend == "deepep" and "nvidia.com/gpu" not in cfg.placement["trainer"].resources.limits:
        bad(
            "placement.trainer.resources.limits",
            "trainer.ep_backend 'deepep' needs GPUs; add 'nvidia.com/gpu: N'",
        )
    if cfg.trainer.ep_backend == "local" and (cfg.trainer.nproc_per_node > 1 or cfg.trainer.nodes > 1):
        bad(
            "trainer.ep_backend",
            "'local' runs one rank; set nproc_per_node: 1 and nodes: 1, or use 'alltoall'",
        )
    ranks = cfg.trainer.nodes * cfg.trainer.nproc_per_node
    if cfg.trainer.ep_size is not None and ranks % cfg.trainer.ep_size:
        bad(
            "trainer.ep_size",
            f"{cfg.trainer.ep_size} does not divide the {ranks} trainer ranks (nodes x nproc_per_node); use a "
            f"divisor of {ranks} (at most nproc_per_node={cfg.trainer.nproc_per_node} keeps EP inside a node)",
        )
    if cfg.trainer.router_aux_loss_coef > 0 and cfg.trainer.router == "freeze":
        bad(
            "trainer.router_aux_loss_coef",
            f"{cfg.trainer.router_aux_loss_coef} trains the routers, which trainer.router 'freeze' keeps; set "
            "trainer.router: train or the coefficient to 0",
        )
    if not all(0 <= b < 1 for b in cfg.trainer.betas):
        bad("trainer.betas", f"{list(cfg.trainer.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    if cfg.heldout_file is not None and cfg.prompt_file is None:
        bad("heldout_file", "needs a prompt_file (a built-in task has its own held-out split); remove it")
    if cfg.prompt_format == "raw" and (cfg.system_prompt is not None or cfg.chat_template_kwargs):
        bad(
            "prompt_format",
            "system_prompt and chat_template_kwargs apply to chat prompts; set prompt_format: chat or remove them",
        )
    if cfg.rewards.verifier == "regex":
        from steps.data.verifiers import pattern_problem

        if problem := pattern_problem(cfg.rewards.answer_pattern):
            bad("rewards.answer_pattern", problem)
    if cfg.rewards.reward_fn is not None and not _DOTTED_FN.match(cfg.rewards.reward_fn):
        bad(
            "rewards.reward_fn",
            f"{cfg.rewards.reward_fn!r} is not a dotted path; write package.module:function, e.g. "
            "my_rewards.gsm8k:score",
        )
    if cfg.environment is not None:
        if not _DOTTED_FN.match(cfg.environment.class_path):
            bad(
                "environment.class_path",
                f"{cfg.environment.class_path!r} is not a dotted path; write package.module:Class, e.g. "
                "my_envs.calculator:CalculatorEnv",
            )
        if cfg.prompt_format != "chat":
            bad(
                "prompt_format",
                "an environment's conversations are rendered turn by turn by the checkpoint's chat template; set "
                "prompt_format: chat",
            )
        if cfg.environment.max_total_tokens < cfg.sampling.max_new_tokens:
            bad(
                "environment.max_total_tokens",
                f"{cfg.environment.max_total_tokens} is below one turn's sampling.max_new_tokens "
                f"({cfg.sampling.max_new_tokens}); raise it or lower max_new_tokens",
            )
        if cfg.trainer.routing_replay == "rollout" or cfg.rollout.record_routes:
            bad(
                "rollout.record_routes",
                "routes are recorded per generation, and a conversation is several; turn record_routes and "
                "trainer.routing_replay off for multi-turn runs",
            )
    if cfg.rewards.reward_model_weight != 0 and cfg.rewards.reward_model is None:
        bad(
            "rewards.reward_model",
            "reward_model_weight is set but no reward_model; name its URI or set weight 0",
        )
    if cfg.staleness == 1 and cfg.checkpoint.keep_last < 2:
        bad(
            "checkpoint.keep_last",
            "staleness 1 samples from the version before LATEST; keep_last must be >= 2",
        )
    if cfg.placement["trainer"].spot:
        bad(
            "placement.trainer.spot",
            "the trainer runs on on-demand capacity (a reclaimed rank stalls all ranks); set spot: false",
        )
    for role, placement in cfg.placement.items():
        base = f"placement.{role}.resources"
        for kind in ("requests", "limits"):
            for name, quantity in getattr(placement.resources, kind).items():
                if not _QUANTITY.match(str(quantity)):
                    bad(
                        f"{base}.{kind}.{name}",
                        f"{quantity!r} is not a Kubernetes quantity; write e.g. 8, 64Gi, 500m",
                    )
            for name in placement.resources.requests:
                if ("/" in name or name.startswith("hugepages-")) and name not in placement.resources.limits:
                    bad(f"{base}.requests.{name}", f"{name} must be set in limits (requests follow limits)")
        if placement.shm_size is not None and not _QUANTITY.match(placement.shm_size):
            bad(f"placement.{role}.shm_size", f"{placement.shm_size!r} is not a quantity; write e.g. 16Gi")
    for role, retry in cfg.retries.items():
        for name in ("duration", "max_duration", "cap"):
            value = getattr(retry.backoff, name)
            if value is not None and not _DURATION.match(value):
                bad(f"retries.{role}.backoff.{name}", f"{value!r} is not a duration; write e.g. 30s, 5m or 1h")
    if cfg.argo.pod_gc_delay is not None and not _DURATION.match(cfg.argo.pod_gc_delay):
        bad("argo.pod_gc_delay", f"{cfg.argo.pod_gc_delay!r} is not a duration; write e.g. 10m")
    for i, expr in enumerate(cfg.schedule.schedules):
        if cron_problem(expr):
            bad(f"schedule.schedules.{i}", f"{expr!r}: {cron_problem(expr)}")
    if not cfg.schedule.schedules:
        bad("schedule.schedules", "needs at least one cron expression, e.g. '0 */6 * * *'")
    try:
        zoneinfo.ZoneInfo(cfg.schedule.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        bad("schedule.timezone", f"unknown timezone {cfg.schedule.timezone!r}; use an IANA name such as UTC")
    return problems


_CRON_FIELD = re.compile(r"^(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*$|^[A-Za-z]{3}(-[A-Za-z]{3})?$")
_CRON_MACROS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}


def cron_problem(expr: str) -> str | None:
    """What is wrong with a cron expression, or None. Argo takes 5 fields or a macro such as @daily."""
    text = expr.strip()
    if text in _CRON_MACROS or text.startswith("@every "):
        return None
    fields = text.split()
    if len(fields) != 5:
        return f"has {len(fields)} fields; write 5 (minute hour day-of-month month day-of-week), e.g. '0 */6 * * *'"
    for field, name in zip(fields, ("minute", "hour", "day-of-month", "month", "day-of-week"), strict=True):
        if not _CRON_FIELD.match(field):
            return f"the {name} field {field!r} is not valid cron syntax"
    return None


def _get(cfg: BaseModel, path: str) -> Any:
    value: Any = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value
