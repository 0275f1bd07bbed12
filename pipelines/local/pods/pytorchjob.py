"""A resource template that creates a kubeflow.org/v1 PyTorchJob, run here as the equivalent torchrun.

The job's Master and Worker replicas become the processes of one `torchrun --standalone --nnodes 1
--nproc-per-node P` on this machine, where P = (Master replicas + Worker replicas) x nprocPerNode
(an integer, or 1 for "auto"/"cpu"/"gpu"), so the training program sees the same WORLD_SIZE and ranks
as in the cluster. The Master container's command+args is the program: if it already starts with
torchrun (or `python -m torch.distributed.run`), its launcher options are replaced by ours; otherwise
it is launched with `torchrun --no-python`.

When torchrun exits, the job gets the status the training operator would give it (conditions and
replicaStatuses), and the resource template's successCondition / failureCondition are evaluated on it
the way Argo's executor does: Kubernetes label-selector syntax over gjson paths, failure first.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from pipelines.local.api.manifest import generate_name

# torchrun options that take a value; everything else that starts with '-' is a flag.
TORCHRUN_VALUE_OPTIONS = {
    "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
    "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf", "--max-restarts",
    "--max_restarts", "--monitor-interval", "--monitor_interval", "--start-method", "--start_method",
    "--role", "--log-dir", "--log_dir", "-r", "--redirects", "-t", "--tee", "--node-rank", "--node_rank",
    "--master-addr", "--master_addr", "--master-port", "--master_port", "--local-addr", "--local_addr",
    "--logs-specs", "--logs_specs", "--local-ranks-filter", "--local_ranks_filter",
}  # fmt: skip


@dataclass
class PyTorchJob:
    name: str
    manifest: dict
    container: dict  # the Master replica's container
    volumes: list[dict]  # the Master replica's pod volumes, which its container mounts
    world_size: int
    success_condition: str
    failure_condition: str
    replicas: dict[str, int]
    launched: bool = False  # created by a launcher pod (steps/pytorchjob_launcher.py), not a resource template


# The program of a launcher pod: it creates the PyTorchJob of its --manifest-json through the Kubernetes API.
LAUNCHER_MODULE = "steps.pytorchjob_launcher"


def launched_job(command: list[str]) -> PyTorchJob | None:
    """The job a container's command+args creates when it is the launcher (`python -m LAUNCHER_MODULE
    --manifest-json JOB ...`), else None. This machine has no Kubernetes API for it to call, so the pod runs
    the job itself, as a resource template's job runs here, and ends as the launcher would (launcher_exit)."""
    words = [str(w) for w in command]
    if LAUNCHER_MODULE not in words or words[words.index(LAUNCHER_MODULE) - 1] != "-m":
        return None
    args = words[words.index(LAUNCHER_MODULE) + 1 :]
    manifest = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--manifest-json"), None)
    if manifest is None:
        return None
    job = parse_job(manifest, "", "")
    job.launched = True
    return job


def launcher_exit(job_object: dict) -> int:
    """The launcher's exit code once its job ended: 0 iff it succeeded (its own job_outcome rule)."""
    from steps.pytorchjob_launcher import job_outcome  # the program this pod stands in for

    return 0 if job_outcome(job_object) == "Succeeded" else 1


def parse_job(manifest_text: str, success: str, failure: str) -> PyTorchJob:
    manifest = yaml.safe_load(manifest_text)
    metadata = manifest.setdefault("metadata", {})
    if not metadata.get("name"):
        metadata["name"] = generate_name(metadata.get("generateName") or "pytorchjob-")
    spec = manifest.get("spec") or {}
    specs = spec.get("pytorchReplicaSpecs") or {}
    replicas = {role: int((specs[role] or {}).get("replicas", 1)) for role in ("Master", "Worker") if role in specs}
    per_node = spec.get("nprocPerNode") or (spec.get("elasticPolicy") or {}).get("nProcPerNode") or 1
    per_node = int(per_node) if str(per_node).isdigit() else 1
    pod_spec = specs["Master"]["template"]["spec"]
    return PyTorchJob(
        name=metadata["name"],
        manifest=manifest,
        container=pod_spec["containers"][0],
        volumes=pod_spec.get("volumes") or [],
        world_size=sum(replicas.values()) * per_node,
        success_condition=success or "",
        failure_condition=failure or "",
        replicas=replicas,
    )


def torchrun_argv(argv: list[str], world_size: int) -> list[str]:
    """The container command (already mapped to this host) run under a single-node torchrun."""
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world_size),
    ]
    program = _strip_launcher(argv)
    if program is None:
        return launcher + ["--no-python"] + argv
    return launcher + program


def _strip_launcher(argv: list[str]) -> list[str] | None:
    """If argv is already a torchrun command, its program part (`-m mod args` or `script args`)."""
    rest: list[str]
    if argv and argv[0].rsplit("/", 1)[-1] == "torchrun":
        rest = argv[1:]
    elif len(argv) >= 3 and argv[1] == "-m" and argv[2] in ("torch.distributed.run", "torch.distributed.launch"):
        rest = argv[3:]
    else:
        return None
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        option = rest[i].split("=", 1)[0]
        if option in ("-m", "--module"):
            return ["-m"] + rest[i + 1 :]
        if option in ("--no-python", "--no_python"):
            return ["--no-python"] + rest[i + 1 :]
        i += 2 if option in TORCHRUN_VALUE_OPTIONS and "=" not in rest[i] else 1
    return rest[i:]


def job_status(job: PyTorchJob, exit_code: int, started: str, finished: str) -> dict:
    """The PyTorchJob object with the status the training operator writes when it ends."""
    succeeded = exit_code == 0
    outcome = "succeeded" if succeeded else "failed"
    return {
        **job.manifest,
        "status": {
            "conditions": [
                {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
                {"type": "Running", "status": "False", "reason": "PyTorchJobRunning"},
                {
                    "type": "Succeeded" if succeeded else "Failed",
                    "status": "True",
                    "reason": "PyTorchJobSucceeded" if succeeded else "PyTorchJobFailed",
                },
            ],
            "replicaStatuses": {role: {outcome: count} for role, count in job.replicas.items()},
            "startTime": started,
            "completionTime": finished,
        },
    }


def match_conditions(job_object: dict, success: str, failure: str) -> tuple[bool | None, str]:
    """Argo's matchConditions: (True, "") on success, (False, message) on a failure condition,
    (None, message) when neither matched."""
    for requirement in parse_selector(failure):
        if requirement.matches(job_object):
            return False, f"failure condition '{requirement}' evaluated true"
    success_requirements = parse_selector(success)
    if all(r.matches(job_object) for r in success_requirements) and success_requirements:
        return True, ""
    if not success_requirements and not failure:
        return True, ""
    return None, "Neither success condition nor the failure condition has been matched."


@dataclass
class Requirement:
    key: str
    op: str
    values: list[str]

    def __str__(self) -> str:
        if self.op in ("in", "notin"):
            return f"{self.key} {self.op} ({','.join(self.values)})"
        if self.op == "exists":
            return self.key
        if self.op == "!":
            return f"!{self.key}"
        return f"{self.key}{self.op}{self.values[0]}"

    def matches(self, obj: dict) -> bool:
        found, value = gjson_get(obj, self.key)
        if self.op == "exists":
            return found
        if self.op == "!":
            return not found
        if self.op in ("=", "=="):
            return found and value == self.values[0]
        if self.op == "!=":
            return not found or value != self.values[0]
        if self.op == "in":
            return found and value in self.values
        if self.op == "notin":
            return not found or value not in self.values
        if not found:
            return False
        try:  # > and < compare integers, as Kubernetes' selector does
            return int(value) > int(self.values[0]) if self.op == ">" else int(value) < int(self.values[0])
        except ValueError:
            return False


SELECTOR_RE = re.compile(
    r"\s*(?:(?P<not>!)\s*(?P<nkey>[^\s,!=<>()]+)"
    r"|(?P<key>[^\s,!=<>()]+)\s*(?:(?P<op>==|=|!=|>|<)\s*(?P<value>[^\s,()]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<set>[^)]*)\))?)\s*(?:,|$)"
)


def parse_selector(text: str) -> list[Requirement]:
    requirements = []
    text = (text or "").strip()
    pos = 0
    while pos < len(text):
        match = SELECTOR_RE.match(text, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"condition '{text}' failed to parse near {text[pos:]!r}")
        pos = match.end()
        if match.group("not"):
            requirements.append(Requirement(match.group("nkey"), "!", []))
        elif match.group("op"):
            requirements.append(Requirement(match.group("key"), match.group("op"), [match.group("value")]))
        elif match.group("setop"):
            values = [v.strip() for v in match.group("set").split(",") if v.strip()]
            requirements.append(Requirement(match.group("key"), match.group("setop"), values))
        else:
            requirements.append(Requirement(match.group("key"), "exists", []))
    return requirements


def gjson_get(obj: Any, path: str) -> tuple[bool, str]:
    """gjson's dotted paths (`status.replicaStatuses.Master.succeeded`, `items.0`, `items.#`),
    returning the value as gjson's String() would (JSON for objects, "true" for booleans)."""
    current = obj
    for part in path.split("."):
        if isinstance(current, dict) and part in current:
            current = current[part]
        elif isinstance(current, list) and part == "#":
            current = len(current)
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            return False, ""
    if isinstance(current, bool):
        return True, "true" if current else "false"
    if isinstance(current, dict | list):
        return True, json.dumps(current, separators=(",", ":"))
    return True, "" if current is None else str(current)
