"""Where a step's container paths live on this machine.

Many pods of one workflow write the same container path (`/tmp/hello_world.txt`), so each pod gets
its own root directory, `<pod dir>/root`, and the container paths that matter are rewritten to it:

- every `outputs.parameters[].valueFrom.path` maps into the pod's root, and so does every directory
  above it, except `/` and the top-level directories this machine has itself (`/tmp`, `/var`, ...):
  `/tmp/out/x.json` -> `<root>/tmp/out/x.json` and `/tmp/out` -> `<root>/tmp/out`, while a host path
  such as `/tmp/runs/demo` in the same command still means the host's (a run store, a checkpoint);
- every `volumeMounts[].mountPath` maps to its volume: an emptyDir to a directory of this pod, a
  persistentVolumeClaim or volumeClaimTemplate to one directory of the run shared by all its pods,
  a hostPath to that host path itself.

A mount on a directory that this machine shares with every container (`/tmp`, `/var/tmp`,
`/dev/shm`: SHARED_DIRS) is the exception to the last rule, because run stores, checkpoints and test
directories live there too: only the mount path itself (`HOME=/tmp`) and the declared output paths
under it (with the directories between them and the mount) map to the volume; every other path under
it, such as a `file:///tmp/...` run store or a host path given as a workflow argument, stays the host's.

These paths are rewritten wherever they appear as a whole path (or, except a shared mount path, as the
leading directories of a longer one) in the command, args, script source, env values and workingDir.
Paths a program builds at run time without naming them in its arguments are not seen: such a program
writes to the host path, as it would to a shared disk. The pod sees its root in $MOERL_LOCAL_SANDBOX.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

# Directories that hold the host's own files as well as a container's (see the module docstring).
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm")


class Sandbox:
    def __init__(self, root: Path, mounts: dict[str, Path], declared_files: list[str]):
        """mounts: container mountPath -> host directory; declared_files: container file paths."""
        self.root = root
        self.mounts = {_normal(path): host for path, host in mounts.items()}
        self.declared_files = [_normal(path) for path in declared_files]
        self.paths: dict[str, Path] = {}  # rewritten as whole paths and as leading directories
        self.whole_paths: dict[str, Path] = {}  # rewritten as whole paths only
        for mount, host in self.mounts.items():
            (self.whole_paths if mount in SHARED_DIRS else self.paths)[mount] = host
        for normal in self.declared_files:
            if normal not in self.whole_paths:
                self.paths.setdefault(normal, self.host_path(normal))
            for parent in map(str, PurePosixPath(normal).parents):
                if self._host_owns(parent):
                    break
                self.paths.setdefault(parent, self.host_path(parent))
        self._pattern: re.Pattern | None = None
        if self.paths or self.whole_paths:
            prefix = rf"(?P<prefix>{_alternatives(self.paths)})(?=$|[^\w.-])"
            whole = rf"(?P<whole>{_alternatives(self.whole_paths)})(?=$|[^\w./-])"
            self._pattern = re.compile(rf"(?<![\w.~/-])(?:{prefix}|{whole})")

    def _host_owns(self, path: str) -> bool:
        """Whether a directory above a declared file is the host's: `/`, a top-level directory this
        machine has, a shared mount point or a directory above one."""
        if path == "/" or (path.count("/") == 1 and Path(path).exists()):
            return True
        return any(mount == path or mount.startswith(path + "/") for mount in self.whole_paths)

    def host_path(self, container_path: str) -> Path:
        """The host path of a container path: inside a mount if one holds it, else under the root."""
        normal = _normal(container_path)
        for mount in sorted(self.mounts, key=len, reverse=True):
            if normal == mount or normal.startswith(mount + "/"):
                return self.mounts[mount] / normal[len(mount) :].lstrip("/")
        return self.root / normal.lstrip("/")

    def rewrite(self, text: str) -> str:
        if self._pattern is None:
            return text

        def host(match: re.Match) -> str:
            prefix = match["prefix"]
            return str(self.paths[prefix] if prefix is not None else self.whole_paths[match["whole"]])

        return self._pattern.sub(host, text)

    def prepare(self) -> None:
        """Create the root and the mount directories, and the top-level directories of declared
        paths that every image has (those this host has too, such as /tmp), as a container has them."""
        self.root.mkdir(parents=True, exist_ok=True)
        for host in self.mounts.values():
            host.mkdir(parents=True, exist_ok=True)
        for normal in self.declared_files:
            top = "/" + normal.split("/")[1]
            if top != normal and Path(top).is_dir():
                self.host_path(top).mkdir(parents=True, exist_ok=True)


def _alternatives(paths: dict[str, Path]) -> str:
    """Longest first, so that /tmp/plan/latest wins over /tmp/plan; none: a pattern that never matches."""
    return "|".join(re.escape(p) for p in sorted(paths, key=len, reverse=True)) or "(?!)"


def _normal(path: str) -> str:
    text = str(PurePosixPath("/") / path)
    return text.rstrip("/") or "/"
