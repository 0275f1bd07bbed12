"""MLflow: one MLflow run per moerl run through MlflowClient over the REST API (mlflow-skinny), metrics at step =
iteration. Named mlflow_tracker, not mlflow, so that it never stands for the library.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from steps.run.keys import MLFLOW_RUN_KEY
from steps.store.object_store import Store
from steps.tracking.interface import Tracker

RUN_STORE_TAG = "moerl.run_store"


class MlflowTracker(Tracker):
    """MlflowClient over the REST API: one MLflow run per moerl run, metrics with step = iteration."""

    name = "mlflow"

    def __init__(self, run: Store, settings: Any, config: dict[str, Any], timeout: float):
        # The client reads these per request (mlflow.environment_variables): one try and one retry, each of
        # half the deadline, instead of the default 7 retries with backoff and 120 s a request.
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, int(timeout / 2)))
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "1"
        os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "0"
        from mlflow.tracking import MlflowClient

        uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise RuntimeError("no tracking URI: set tracking.mlflow.tracking_uri or MLFLOW_TRACKING_URI")
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.run_id = self._find_or_create_run(run, settings.experiment, config)

    def _find_or_create_run(self, run: Store, experiment_name: str, config: dict[str, Any]) -> str:
        if run.exists(MLFLOW_RUN_KEY):
            known = run.get_json(MLFLOW_RUN_KEY)
            if known.get("tracking_uri") == self.uri:
                return known["run_id"]
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(experiment_name)
        # A step that created the run and died before writing MLFLOW_RUN_KEY: the tag finds it again.
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_STORE_TAG}` = '{run.uri}'", max_results=1
        )
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {RUN_STORE_TAG: run.uri, "moerl.run": str(config.get("name", ""))}
            run_id = self.client.create_run(experiment_id, tags=tags, run_name=str(config.get("name"))).info.run_id
        run.put_json(MLFLOW_RUN_KEY, {"tracking_uri": self.uri, "experiment_id": experiment_id, "run_id": run_id})
        return run_id

    def points_at(self, iteration: int, keys: list[str]) -> set[str]:
        present = set()
        for key in keys:
            if any(m.step == iteration for m in self.client.get_metric_history(self.run_id, key)):
                present.add(key)
        return present

    def log_points(self, source: str, iteration: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, iteration) for key, value in sorted(values.items())]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # MLflow keeps a parameter's value to 6000 characters (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
        items = [Param(key, value[:6000]) for key, value in sorted(params.items())]
        self.client.log_batch(self.run_id, params=items, synchronous=True)

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in sorted(tags.items())], synchronous=True)

    def log_artifacts(self, files: dict[str, Path]) -> None:
        for path in files.values():
            self.client.log_artifact(self.run_id, str(path), artifact_path="report")
