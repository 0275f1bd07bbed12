"""Weights & Biases: one W&B run per moerl run, online or offline (offline run files copied into the run store).
Named wandb_tracker, not wandb, so that it never stands for the library.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from steps.run.keys import WANDB_PREFIX
from steps.store.object_store import Store
from steps.tracking.interface import Tracker, local_root


class WandbTracker(Tracker):
    """One W&B run per moerl run, resumed by each step (run_id: trackers.wandb_run_id, from the run store URI).
    Points carry `iteration` as their step metric (wandb.define_metric), so score and update of one iteration share it.
    Offline, each step's run directory is copied to <run>/wandb/<source>-iter-NNNNNN/offline-run-*/ (for
    `wandb sync`, which tells offline runs by that name)."""

    name = "wandb"

    def __init__(self, run: Store, settings: Any, config: dict[str, Any], timeout: float, label: str, run_id: str):
        self.store = run
        self.settings = settings
        self.label = label
        self.workdir = Path(tempfile.mkdtemp(prefix="moerl-wandb-"))
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            id=run_id,
            name=str(config.get("name")),
            resume="allow",
            mode=settings.mode,
            dir=str(self.workdir),
            config=config,
            settings=wandb.Settings(**self.settings_fields(settings, timeout)),
        )
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")

    @staticmethod
    def settings_fields(settings: Any, timeout: float) -> dict[str, Any]:
        """wandb.Settings fields: every network wait bounded by the deadline, no console capture or system
        stats (a step is not a notebook)."""
        fields: dict[str, Any] = {
            "init_timeout": timeout,
            "x_graphql_timeout_seconds": timeout,
            "x_file_stream_timeout_seconds": timeout,
            "x_file_stream_retry_max": 1,
            "console": "off",
            "x_disable_stats": True,
            "x_disable_machine_info": True,
            "x_save_requirements": False,
            "disable_git": True,
            "silent": True,
        }
        if settings.base_url:
            fields["base_url"] = settings.base_url
        return fields

    def log_points(self, source: str, iteration: int, values: dict[str, float]) -> None:
        self.run.log({"iteration": iteration, **values})

    def set_tags(self, tags: dict[str, str]) -> None:
        # W&B tags are short labels (64 characters at most): the link goes to the summary, whole.
        self.run.summary.update({f"tag/{k}": v for k, v in tags.items()})
        self.run.tags = tuple(sorted({*(self.run.tags or ()), *(f"{k}={v}"[:64] for k, v in tags.items())}))

    def log_artifacts(self, files: dict[str, Path]) -> None:
        for path in files.values():
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def close(self) -> None:
        self.run.finish()
        # Ends wandb-core, which closes the run's files: only then is the offline transaction log complete.
        self.wandb.teardown()
        if self.settings.mode == "offline":
            self._keep_offline_files()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _keep_offline_files(self) -> None:
        """The pod's disk goes with the pod: the offline run directory goes to the store, as
        <run>/wandb/<source>-iter-NNNNNN/offline-run-<time>-<id>/ (the name `wandb sync` tells offline runs by),
        replacing what an earlier attempt of the same step left."""
        runs = sorted((self.workdir / "wandb").glob("offline-run-*"))
        prefix = f"{WANDB_PREFIX}/{self.label}"
        root = local_root(self.store)
        if root is None:
            self.store.delete_prefix(prefix)
            for run_dir in runs:
                self.store.upload_dir(run_dir, f"{prefix}/{run_dir.name}")
            return
        target = root / prefix
        staged = target.with_name(f".moerl-tmp-{target.name}-{os.getpid()}")
        shutil.rmtree(staged, ignore_errors=True)
        for run_dir in runs:
            shutil.copytree(run_dir, staged / run_dir.name)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staged, target)
