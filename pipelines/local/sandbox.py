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

These paths are rewritten wherever they appear as a whole path (or as the leading directories of a
longer one) in the command, args, script source, env values and workingDir. Paths a program builds
at run time without naming them in its arguments are not seen: such a program writes to the host
path, as it would to a shared disk. The pod sees its root in $MOERL_LOCAL_SANDBOX.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath


class Sandbox:
    def __init__(self, root: Path, mounts: dict[str, Path], declared_files: list[str]):
        """mounts: container mountPath -> host directory; declared_files: container file paths."""
        self.root = root
        self.mounts = {_normal(path): host for path, host in mounts.items()}
        self.paths: dict[str, Path] = {}
        for mount, host in self.mounts.items():
            self.paths[mount] = host
        for file_path in declared_files:
            normal = _normal(file_path)
            self.paths.setdefault(normal, self.host_path(normal))
            for parent in map(str, PurePosixPath(normal).parents):
                if parent != "/" and not (parent.count("/") == 1 and Path(parent).exists()):
                    self.paths.setdefault(parent, self.host_path(parent))
        if self.paths:
            alternatives = "|".join(re.escape(p) for p in sorted(self.paths, key=len, reverse=True))
            self._pattern: re.Pattern | None = re.compile(rf"(?<![\w.~/-])({alternatives})(?=$|[^\w.-])")
        else:
            self._pattern = None

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
        return self._pattern.sub(lambda m: str(self.paths[m.group(1)]), text)

    def prepare(self, declared_files: list[str]) -> None:
        """Create the root and the mount directories, and the top-level directories of declared
        paths that every image has (those this host has too, such as /tmp), as a container has them."""
        self.root.mkdir(parents=True, exist_ok=True)
        for host in self.mounts.values():
            host.mkdir(parents=True, exist_ok=True)
        for file_path in declared_files:
            top = "/" + _normal(file_path).split("/")[1]
            if top != _normal(file_path) and Path(top).is_dir():
                self.host_path(top).mkdir(parents=True, exist_ok=True)


def _normal(path: str) -> str:
    text = str(PurePosixPath("/") / path)
    return text.rstrip("/") or "/"
