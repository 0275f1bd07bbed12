"""The run config: the shipped configs load, and every kind of bad config ends in one message per bad field
that names the field's path and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import load_config
from steps.errors import MoerlError
from steps.run.config import OPERATIONAL_FIELDS, RunConfig, training_view, validate_config
from steps.run.config_checks import cron_problem

REPO = Path(__file__).resolve().parents[1]
BASE = {"sft_checkpoint": "file:///tmp/sft", "run_store": "file:///tmp/run"}


def problems(data: dict) -> str:
    with pytest.raises(MoerlError) as err:
        validate_config({**BASE, **data}, "bad.yaml")
    return str(err.value)


def test_demo_config_suits_this_machine(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.run_store == (tmp_path / "runs" / "demo").as_uri()  # relative paths resolve to file:// URIs
    assert cfg.sft_checkpoint.startswith("file://")
    assert cfg.rollout.num_shards == 2 and cfg.rollout.engine == "torch"
    assert (cfg.trainer.ep_backend, cfg.trainer.nproc_per_node, cfg.trainer.nodes) == ("alltoall", 2, 1)
    assert cfg.task.name == "sort" and cfg.task.params == {"length": 6} and 5 <= cfg.iterations <= 8
    assert cfg.placement["rollout"].spot and not cfg.placement["trainer"].spot
    assert cfg.argo.semaphore is None and not cfg.argo.report_artifact


def test_response_room_is_checked_with_the_checkpoints_tokenizer_not_here():
    # how many tokens an answer takes depends on the checkpoint's tokenizer: moerl check counts them
    # (tests/test_check.py); the config alone accepts any max_new_tokens >= 1
    base = {"sft_checkpoint": "/tmp/sft", "run_store": "/tmp/run"}
    validate_config({**base, "task": {"name": "sort8"}, "sampling": {"max_new_tokens": 2}})


def test_workload_fields_are_checked():
    base = {"sft_checkpoint": "/tmp/sft", "run_store": "/tmp/run"}
    cfg = validate_config({**base, "prompt_file": "/tmp/p.parquet", "prompt_format": "chat", "system_prompt": "Hi",
                           "chat_template_kwargs": {"enable_thinking": False}, "prompt_fields": {"prompt": "question"},
                           "rewards": {"verifier": "math", "reward_fn": "my_rewards.gsm8k:score"}})  # fmt: skip
    assert cfg.task is None and cfg.prompt_fields.prompt == "question" and cfg.heldout_fraction == 0.1
    with pytest.raises(MoerlError) as refused:
        validate_config({**base, "system_prompt": "Hi", "heldout_file": "/tmp/h.jsonl",
                         "rewards": {"verifier": "regex", "reward_fn": "not a path"}})  # fmt: skip
    message = str(refused.value)
    assert "prompt_format: system_prompt and chat_template_kwargs apply to chat prompts" in message
    assert "heldout_file: needs a prompt_file" in message
    assert "rewards.answer_pattern: the regex verifier needs rewards.answer_pattern" in message
    assert "rewards.reward_fn: 'not a path' is not a dotted path" in message
    with pytest.raises(MoerlError, match="rewards.verifier"):
        validate_config({**base, "rewards": {"verifier": "fuzzy"}})


def test_task_parameters_out_of_range_are_a_config_error():
    with pytest.raises(MoerlError, match=r"task: unknown task 'sort12'"):
        validate_config({"sft_checkpoint": "/tmp/sft", "run_store": "/tmp/run", "task": {"name": "sort12"}})


def test_eks_config_mirrors_48_p5en_in_one_zone():
    cfg = load_config(REPO / "configs" / "eks-p5en.yaml")
    trainer, rollout = cfg.placement["trainer"], cfg.placement["rollout"]
    assert cfg.trainer.nodes == 16 and cfg.trainer.nproc_per_node == 8 and cfg.trainer.ep_backend == "deepep"
    assert cfg.rollout.num_shards == 32 and cfg.rollout.engine == "sglang"
    assert trainer.resources.limits["nvidia.com/gpu"] == 8 and rollout.resources.limits["nvidia.com/gpu"] == 8
    assert trainer.resources.limits["vpc.amazonaws.com/efa"] == 16 and "hugepages-2Mi" in trainer.resources.limits
    zones = {p.node_selector.get("topology.kubernetes.io/zone") for p in cfg.placement.values()}
    assert zones == {"us-east-2b"}
    assert rollout.spot and not trainer.spot
    assert cfg.run_store.startswith("s3://") and cfg.sft_checkpoint.startswith("s3://")


def test_defaults_fill_every_role_and_the_task():
    cfg = validate_config(BASE)
    assert set(cfg.placement) == set(cfg.retries) == {"rollout", "score", "trainer", "control"}
    assert cfg.task is not None and cfg.task.name == "addition"
    partial = validate_config({**BASE, "placement": {"trainer": {"priority_class": "p"}}})
    assert partial.placement["trainer"].priority_class == "p" and partial.placement["rollout"].spot


def test_the_resolved_config_round_trips_through_json():
    cfg = load_config(REPO / "configs" / "eks-p5en.yaml")
    assert RunConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_unknown_fields_get_a_did_you_mean():
    message = problems({"rollout": {"num_shard": 2}, "trainr": {}})
    assert "rollout.num_shard: unknown field; did you mean 'num_shards'?" in message
    assert "trainr: unknown field; did you mean 'trainer'?" in message
    assert "2 problems" in message


def test_an_unknown_role_is_named_with_the_roles_there_are():
    assert "placement.trainr: unknown key; did you mean 'trainer'?" in problems({"placement": {"trainr": {}}})


def test_missing_uris_say_what_to_add():
    with pytest.raises(MoerlError) as err:
        validate_config({}, "empty.yaml")
    assert "sft_checkpoint: required field is missing; add it (the SFT checkpoint" in str(err.value)
    assert "run_store: required field is missing" in str(err.value)


def test_wrong_values_name_the_field_the_value_and_the_allowed_range():
    message = problems({"staleness": 2, "rollout": {"engine": "vllm", "num_shards": 0}, "trainer": {"lr": -1}})
    assert "staleness: Input should be 0 or 1 (got 2)" in message
    assert "rollout.engine: Input should be 'torch' or 'sglang' (got 'vllm')" in message
    assert "rollout.num_shards: Input should be greater than or equal to 1 (got 0)" in message
    assert "trainer.lr: Input should be greater than 0 (got -1)" in message


def test_a_value_of_the_wrong_type_is_one_line():
    message = problems({"placement": {"rollout": {"resources": {"limits": {"cpu": [1]}}}}})
    assert message.count("placement.rollout.resources.limits.cpu") == 1


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"staleness": 1, "checkpoint": {"keep_last": 1}}, "checkpoint.keep_last: staleness 1 samples from"),
        ({"placement": {"trainer": {"spot": True}}}, "placement.trainer.spot: the trainer runs on on-demand"),
        ({"rollout": {"engine": "sglang"}}, "placement.rollout.resources.limits: rollout.engine 'sglang' needs GPUs"),
        ({"trainer": {"ep_backend": "deepep"}}, "trainer.ep_backend 'deepep' needs GPUs; add 'nvidia.com/gpu: N'"),
        ({"trainer": {"ep_backend": "local"}}, "trainer.ep_backend: 'local' runs one rank"),
        ({"rollout": {"num_shards": 9, "chunk_size": 16}}, "rollout.num_shards: 9 shards but only 4 chunks"),
        ({"prompt_file": "s3://bucket/p.jsonl", "task": {"name": "sort"}}, "prompt_file: both task and prompt_file"),
        ({"task": {"name": "adition"}}, "task.name: unknown task 'adition'; use one of addition, sort, sortdesc"),
        ({"name": "My_Run"}, "name: 'My_Run' is not a valid run name"),
        ({"run_store": "gs://bucket/x"}, "run_store: 'gs://bucket/x' is not a store URI"),
        ({"rewards": {"reward_model_weight": 0.5}}, "rewards.reward_model: reward_model_weight is set but no"),
        ({"trainer": {"betas": [0.9, 1.5]}}, "trainer.betas: [0.9, 1.5] must be two numbers in [0, 1)"),
        ({"rollout": {"sglang": {"moe_a2a_backend": "deepep"}}}, "rollout.sglang.ep_size: moe_a2a_backend 'deepep'"),
        (
            {"placement": {"score": {"resources": {"limits": {"memory": "lots"}}}}},
            "'lots' is not a Kubernetes quantity",
        ),
        (
            {"placement": {"trainer": {"resources": {"requests": {"vpc.amazonaws.com/efa": 16}}}}},
            "placement.trainer.resources.requests.vpc.amazonaws.com/efa: vpc.amazonaws.com/efa must be set in limits",
        ),
        ({"retries": {"rollout": {"backoff": {"duration": "soon"}}}}, "retries.rollout.backoff.duration: 'soon' is"),
        ({"schedule": {"schedules": ["*/5 * *"]}}, "schedule.schedules.0: '*/5 * *': has 3 fields; write 5"),
        ({"schedule": {"timezone": "Mars/Olympus"}}, "schedule.timezone: unknown timezone 'Mars/Olympus'"),
        ({"images": {"cpu": "x{{workflow.name}}"}}, "'{{' would be read by Argo as a template variable"),
    ],
)
def test_inconsistent_configs_name_the_field_and_the_fix(data, expected):
    assert expected in problems(data)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(MoerlError, match="cannot read the run config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(MoerlError, match=r"bad\.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(MoerlError, match="must be a YAML mapping of fields, got list"):
        load_config(bad)


def test_overrides_set_dotted_fields(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sft_checkpoint: sft\nrun_store: run\n")
    cfg = load_config(path, {"rollout.num_shards": 1, "iterations": 3, "run_store": "s3://bkt/r"})
    assert cfg.rollout.num_shards == 1 and cfg.iterations == 3 and cfg.run_store == "s3://bkt/r"


def test_tolerations_take_kubernetes_spelling():
    tol = {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}
    cfg = validate_config({**BASE, "placement": {"rollout": {"tolerations": [tol]}}})
    assert cfg.placement["rollout"].tolerations[0].toleration_seconds == 30


def test_training_view_leaves_out_what_a_run_may_change():
    cfg = validate_config(BASE).model_dump(mode="json")
    view = training_view(cfg)
    assert not OPERATIONAL_FIELDS & view.keys()
    assert not {"num_shards", "servers", "server_wait_s"} & view["rollout"].keys()
    assert "server" not in view["trainer"] and "deltas" not in view["checkpoint"]
    assert view["trainer"]["lr"] == cfg["trainer"]["lr"] and view["seed"] == cfg["seed"]


@pytest.mark.parametrize(
    ("expr", "ok"),
    [("0 */6 * * *", True), ("@daily", True), ("30 2 * * MON-FRI", True), ("0 */6 * *", False), ("61 ** * * *", False)],
)
def test_cron_expressions(expr, ok):
    assert (cron_problem(expr) is None) == ok
