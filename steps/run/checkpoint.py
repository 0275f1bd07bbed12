"""The checkpoint protocol of a run store (docs/contracts.md, "Run store").

    <run>/checkpoints/v000003/            HF-format model dir (config.json, tokenizer, *.safetensors)
    <run>/checkpoints/v000003/MANIFEST.json   written LAST: every file with size + sha256
    <run>/checkpoints/LATEST              the newest complete version's name, moved after its MANIFEST

A version without MANIFEST.json is unfinished and never read. Readers verify every file against
the manifest, so a torn or corrupted object is refused instead of being trained on.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from steps.errors import MoerlError
from steps.run.keys import CHECKPOINTS, LATEST, MANIFEST, parse_version, version_name, version_prefix
from steps.store.object_store import Store


@dataclass
class Manifest:
    version: int
    parent: int | None
    iteration: int
    files: dict[str, dict[str, int | str]]  # relative name -> {"size": int, "sha256": str}
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            raw = json.loads(text)
            return cls(
                version=int(raw["version"]),
                parent=None if raw["parent"] is None else int(raw["parent"]),
                iteration=int(raw["iteration"]),
                files={str(k): {"size": int(v["size"]), "sha256": str(v["sha256"])} for k, v in raw["files"].items()},
                created_at=str(raw.get("created_at", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise MoerlError(
                f"{where}: unreadable checkpoint manifest ({err!r}); the checkpoint is corrupted — "
                "republish it (python -m steps.publish) or remove the version directory"
            ) from err

    def same_content(self, other: Manifest) -> bool:
        return (self.version, self.parent, self.iteration, self.files) == (
            other.version,
            other.parent,
            other.iteration,
            other.files,
        )


def file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return path.stat().st_size, digest.hexdigest()


def bytes_digest(data: bytes) -> tuple[int, str]:
    """(size, sha256) of bytes in memory, as file_digest gives them for a file."""
    return len(data), hashlib.sha256(data).hexdigest()


def describe_dir(local_dir: Path) -> dict[str, dict[str, int | str]]:
    """Size and sha256 of every file under local_dir, keyed by its '/'-separated relative name."""
    files: dict[str, dict[str, int | str]] = {}
    for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
        name = path.relative_to(local_dir).as_posix()
        if name == MANIFEST:
            continue
        size, sha = file_digest(path)
        files[name] = {"size": size, "sha256": sha}
    return files


def read_latest(run: Store) -> str | None:
    """The name of the newest complete version ("v000003"), or None before import-sft."""
    if not run.exists(LATEST):
        return None
    name = run.get_bytes(LATEST).decode().strip()
    parse_version(name)
    return name


def latest_version(run: Store) -> int | None:
    name = read_latest(run)
    return None if name is None else parse_version(name)


def read_manifest(run: Store, version: int) -> Manifest | None:
    key = f"{version_prefix(version)}/{MANIFEST}"
    if not run.exists(key):
        return None
    return Manifest.from_json(run.get_bytes(key).decode(), run.url(key))


def require_manifest(run: Store, version: int) -> Manifest:
    manifest = read_manifest(run, version)
    if manifest is None:
        raise MoerlError(
            f"{run.url(version_prefix(version))}: checkpoint {version_name(version)} is unfinished "
            "(no MANIFEST.json); it was never published — rerun the step that publishes it"
        )
    return manifest


def publish_dir(run: Store, local_dir: Path, version: int, parent: int | None, iteration: int) -> Manifest:
    """Upload local_dir as checkpoint `version`: files first, MANIFEST.json last, then move LATEST.

    Idempotent: republishing the same content is a no-op; different content under an already
    published version is refused, because readers may already depend on it.
    """
    manifest = Manifest(version=version, parent=parent, iteration=iteration, files=describe_dir(local_dir))
    if not manifest.files:
        raise MoerlError(f"{local_dir}: nothing to publish (empty directory)")
    existing = read_manifest(run, version)
    if existing is not None:
        if existing.same_content(manifest):
            move_latest(run, version)
            return existing
        raise MoerlError(
            f"{run.url(version_prefix(version))}: {version_name(version)} is already published with different "
            "content; a published version never changes — use a new run URI to start over"
        )
    prefix = version_prefix(version)
    for name, meta in manifest.files.items():
        sha = run.put_file(f"{prefix}/{name}", Path(local_dir) / name)
        if sha != meta["sha256"]:
            raise MoerlError(f"{local_dir / name}: file changed while it was being published; publish again")
    run.put_bytes(f"{prefix}/{MANIFEST}", manifest.to_json().encode())
    move_latest(run, version)
    return manifest


def move_latest(run: Store, version: int) -> None:
    """Point LATEST at `version` unless it already points at a newer one (publication is monotonic)."""
    require_manifest(run, version)
    current = latest_version(run)
    if current is None or current < version:
        run.put_bytes(LATEST, (version_name(version) + "\n").encode())


def download(run: Store, version: int, local_dir: Path) -> Path:
    """Fetch a published version into local_dir, verifying each file against the manifest.

    Refuses an unfinished version (no manifest), a missing file, or one whose size or sha256
    differs from what the manifest recorded. Files already present with the right digest are kept,
    so a warm cache costs one hash per file.
    """
    manifest = require_manifest(run, version)
    local_dir = Path(local_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    prefix = version_prefix(version)
    for name, meta in manifest.files.items():
        target = local_dir / name
        if target.is_file() and file_digest(target) == (meta["size"], meta["sha256"]):
            continue
        key = f"{prefix}/{name}"
        if not run.exists(key):
            raise MoerlError(
                f"{run.url(key)}: missing from checkpoint {version_name(version)} although its manifest lists it; "
                "the checkpoint is corrupted — republish it"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        run.get_file(key, target)
        if file_digest(target) != (meta["size"], meta["sha256"]):
            target.unlink()
            raise MoerlError(
                f"{run.url(key)}: size or sha256 differs from MANIFEST.json; the checkpoint is corrupted — "
                "republish it from its candidate or restore the file"
            )
    return local_dir


def read_file(run: Store, version: int, name: str) -> bytes:
    """One file of a published version (e.g. its config.json), checked against the manifest: a small read
    where downloading the whole version would copy its weights."""
    manifest = require_manifest(run, version)
    key = f"{version_prefix(version)}/{name}"
    meta = manifest.files.get(name)
    if meta is None:
        raise MoerlError(f"{run.url(key)}: checkpoint {version_name(version)} has no {name}; republish it")
    data = run.get_bytes(key) if run.exists(key) else b""
    if bytes_digest(data) != (meta["size"], meta["sha256"]):
        raise MoerlError(
            f"{run.url(key)}: missing, or its size or sha256 differs from MANIFEST.json; the checkpoint is "
            "corrupted — republish it or restore the file"
        )
    return data


def cache_dir_for(run: Store, version: int) -> Path:
    """A per-user cache location for a run's version, so pods and tests reuse downloads."""
    key = hashlib.sha256(run.uri.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "moerl-cache" / key / version_name(version)


def fetch(run: Store, version: int) -> Path:
    """Download (or reuse) a published version into the local cache and return its directory."""
    return download(run, version, cache_dir_for(run, version))


def published_versions(run: Store) -> list[int]:
    versions = set()
    for key in run.list(f"{CHECKPOINTS}/"):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == MANIFEST:
            versions.add(parse_version(parts[1]))
    return sorted(versions)


def apply_retention(run: Store, keep_last: int, protect: tuple[int, ...] = (0,)) -> list[int]:
    """Delete all but the newest `keep_last` published versions, never the protected ones.

    v000000 is protected by default: it is the reference policy of the KL penalty. The manifest is
    deleted first so that a version half-way through deletion reads as unfinished, never as complete.
    """
    if keep_last < 1:
        raise MoerlError(f"checkpoint retention keep_last={keep_last}: must be at least 1")
    versions = published_versions(run)
    doomed = [v for v in versions[:-keep_last] if v not in protect]
    for version in doomed:
        run.delete(f"{version_prefix(version)}/{MANIFEST}")
        run.delete_prefix(f"{version_prefix(version)}/")
    return doomed
