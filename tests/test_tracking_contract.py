"""steps/tracking/'s calls into mlflow-skinny 3.17.2, wandb 0.31.0 and tensorboard 2.21.0, held to the pinned
versions' own signatures, settings and constants (read in their source: mlflow/tracking/client.py,
mlflow/environment_variables.py, mlflow/utils/rest_utils.py, wandb/sdk/wandb_init.py, wandb_settings.py,
wandb_run.py, tensorboard/summary/writer/record_writer.py, backend/event_processing/io_wrapper.py)."""

from __future__ import annotations

import inspect
import io

import pytest

from pipelines.workflow.placement import MLFLOW_SECRET_KEYS
from steps.run.config import WandbTracking
from steps.tracking import trackers as tracking
from steps.tracking.tensorboard_tracker import TensorboardTracker, tfrecord
from steps.tracking.wandb_tracker import WandbTracker


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_mlflow_client_calls_match_the_pinned_client():
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    assert params(MlflowClient.__init__)[:2] == ["self", "tracking_uri"]
    assert params(MlflowClient.log_batch) == ["self", "run_id", "metrics", "params", "tags", "synchronous"]
    assert params(MlflowClient.get_metric_history) == ["self", "run_id", "key"]
    assert params(MlflowClient.create_run)[:5] == ["self", "experiment_id", "start_time", "tags", "run_name"]
    assert {"experiment_ids", "filter_string", "max_results"} <= set(params(MlflowClient.search_runs))
    assert params(MlflowClient.get_experiment_by_name) == ["self", "name"]
    assert params(MlflowClient.create_experiment)[:2] == ["self", "name"]
    assert params(MlflowClient.log_artifact) == ["self", "run_id", "local_path", "artifact_path"]
    # Positional order of the entities as mlflow_tracker.py builds them.
    assert params(Metric.__init__)[:5] == ["self", "key", "value", "timestamp", "step"]
    assert params(Param.__init__) == ["self", "key", "value"]
    assert params(RunTag.__init__) == ["self", "key", "value"]


def test_mlflow_timeouts_are_read_from_the_environment_at_each_request(monkeypatch):
    from mlflow import environment_variables as env
    from mlflow.utils import rest_utils, validation

    names = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR")
    for name in names:
        variable = getattr(env, name)
        assert variable.name == name
        monkeypatch.setenv(name, "3")
        assert variable.get() == 3  # read when called, not at import: mlflow_tracker.py sets them before the client
    source = inspect.getsource(rest_utils.http_request)
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT.get()" in source and "MLFLOW_HTTP_REQUEST_MAX_RETRIES.get()" in source
    # mlflow_tracker.py cuts parameter values at this length; the client chunks batches itself.
    assert validation.MAX_PARAM_VAL_LENGTH == 6000
    for name in MLFLOW_SECRET_KEYS:  # the Secret's keys are the client's own variables
        assert getattr(env, name).name == name


def test_wandb_init_and_settings_take_what_tracking_passes(tmp_path):
    import wandb
    from wandb.sdk import wandb_run

    assert {"project", "entity", "id", "name", "resume", "mode", "dir", "config", "settings"} <= set(
        params(wandb.init)
    )
    fields = WandbTracker.settings_fields(WandbTracking(base_url="https://wandb.example.com"), 7.0)
    settings = wandb.Settings(**fields)  # pydantic: an unknown field or a bad value raises here
    assert settings.init_timeout == 7.0 and settings.x_graphql_timeout_seconds == 7.0
    assert settings.base_url == "https://wandb.example.com" and settings.console == "off"
    assert wandb.Settings(mode="offline").mode == "offline"
    run_cls = wandb_run.Run
    assert params(run_cls.define_metric)[:3] == ["self", "name", "step_metric"]
    assert {"glob_str", "base_path", "policy"} <= set(params(run_cls.save))
    assert callable(wandb.teardown)


def test_wandb_run_id_is_a_valid_wandb_id_and_stable():
    run_id = tracking.wandb_run_id("s3://bucket/runs/a")
    assert run_id == tracking.wandb_run_id("s3://bucket/runs/a") != tracking.wandb_run_id("s3://bucket/runs/b")
    assert not set(run_id) & set("/\\#?%:") and len(run_id) <= 64


def test_tensorboard_record_writer_and_protos():
    from tensorboard.backend.event_processing import io_wrapper
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    # tfrecord frames records as tensorboard's own writer does, byte for byte.
    for payload in (b"", b"x", bytes(range(256)) * 5, event_pb2.Event(step=7).SerializeToString()):
        buffer = io.BytesIO()
        RecordWriter(buffer).write(payload)
        assert tfrecord(payload) == buffer.getvalue()
    data = TensorboardTracker.event_file_bytes(3, {"score/accuracy": 0.5}, wall_time=1.0)
    assert data == TensorboardTracker.event_file_bytes(3, {"score/accuracy": 0.5}, wall_time=1.0)
    event = event_pb2.Event()
    assert {"wall_time", "step", "summary", "file_version"} <= {f.name for f in event.DESCRIPTOR.fields}
    # The loader takes any name holding 'tfevents': the store's digest sidecar of an event file would be read
    # too, which is why tensorboard_tracker.py writes a file:// store's event files directly.
    name = TensorboardTracker.event_file_name(3, "score")
    assert io_wrapper.IsSummaryEventsFile(name) and io_wrapper.IsSummaryEventsFile(".moerl-sha256-" + name)
    # Names sort by iteration, then source: the loader reads files in name order, steps never go back.
    names = [TensorboardTracker.event_file_name(i, s) for i in (2, 10, 1) for s in tracking.SOURCES]
    assert [n.split(".")[3] for n in sorted(names)] == ["0000000001"] * 3 + ["0000000002"] * 3 + ["0000000010"] * 3


@pytest.mark.parametrize("module", ["mlflow", "wandb", "tensorboard"])
def test_pinned_versions(module):
    import importlib.metadata

    expected = {"mlflow": ("mlflow-skinny", "3.17.2"), "wandb": ("wandb", "0.31.0"),
                "tensorboard": ("tensorboard", "2.21.0")}[module]  # fmt: skip
    assert importlib.metadata.version(expected[0]) == expected[1]


def test_every_parameter_and_metric_key_passes_mlflows_name_rules():
    from mlflow.utils.validation import path_not_unique, validate_param_and_metric_name

    from steps.run.config import validate_config

    cfg = validate_config({"sft_checkpoint": "file:///x", "run_store": "file:///y",
                           "argo": {"labels": {"team@x": "a", "example.com/owner": "b"}},
                           "placement": {"trainer": {"resources": {"limits": {"nvidia.com/gpu": 8}}}}})  # fmt: skip
    keys = list(tracking.config_params(cfg.model_dump(mode="json")))
    keys += list(tracking.metric_points("update", {"is_weight": {"mean": 1.0}, "odd key!": 2.0}))
    assert "argo.labels.team_x" in keys and "update/odd key_" in keys
    for key in keys:
        assert validate_param_and_metric_name(key) and not path_not_unique(key), key
