"""What every experiment tracker is to the tracking session (steps/tracking/trackers.py): the Tracker interface,
and how a tracker writes its own files into a file:// run store.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from steps.store.object_store import Store


class Tracker:
    """One experiment tracker. Every call may raise; the caller bounds it and keeps going."""

    name = "tracker"

    def points_at(self, iteration: int, keys: list[str]) -> set[str]:
        """The keys of `keys` the tracker already holds at this step (a crash after a write, before the
        ledger's). Only MLflow can be asked; the others rely on the ledger and fixed file names."""
        return set()

    def log_points(self, source: str, iteration: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def log_params(self, params: dict[str, str]) -> None:
        """Parameters are written once per run (the ledger says when)."""

    def set_tags(self, tags: dict[str, str]) -> None:
        """Tags may be set again; the last value counts."""

    def log_artifacts(self, files: dict[str, Path]) -> None:
        """name -> local file; a rewrite replaces."""

    def close(self) -> None:
        """Flush and let go."""


def write_local_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staged = tempfile.mkstemp(prefix=".moerl-tmp-", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(staged, path)


def local_root(run: Store) -> Path | None:
    """The directory of a file:// store. Trackers' files are written there directly, so that the folders that
    TensorBoard and W&B read hold only their own files, not the store's digest sidecars."""
    return Path(run.uri.removeprefix("file://")) if run.uri.startswith("file://") else None
