"""The field table of Argo's objects: every field of each definition in Argo's JSON schema (v4.1
api/jsonschema/schema.json) with what this executor does with it, and the check of a manifest against it.

    RUN        executed with Argo's semantics
    RECORDED   scheduling or bookkeeping with no meaning on one machine: accepted, written to the
               node's pod.json, otherwise ignored (nodeSelector, tolerations, affinity, podGC, ...)
    <Shape>    an object checked against that table, or ("list", Shape) / ("map", Shape)
    Unsupported(why)  stops the run with `unsupported: FIELD at PATH: why`

A field that is in no table is not an Argo field at all (a typo such as `limt:`) and stops the run
with `unknown field`. tests/test_local_manifest_validation.py keeps the tables equal to the schema.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

from steps.errors import MoerlError

RUN = "run"


RECORDED = "recorded"


API_VERSION = "argoproj.io/v1alpha1"


WORKFLOW_KINDS = ("Workflow", "WorkflowTemplate", "ClusterWorkflowTemplate", "CronWorkflow")


@dataclass(frozen=True)
class Unsupported:
    why: str


NO_ARTIFACTS = Unsupported("artifacts need an artifact repository; pass data through the run store URI")


NO_CONFIGMAPS = Unsupported("there is no Kubernetes API to read ConfigMaps or Secrets from")


ONE_PROCESS = Unsupported("the local executor runs one process per step")


SCHEDULING = [
    "nodeSelector", "affinity", "tolerations", "schedulerName", "priorityClassName", "serviceAccountName",
    "automountServiceAccountToken", "securityContext", "podSpecPatch", "hostAliases", "executor",
    "metrics", "synchronization", "resourceClaims", "podResources",
]  # fmt: skip


SHAPES: dict[str, dict[str, Any]] = {
    "Workflow": {
        "apiVersion": RUN, "kind": RUN, "metadata": "ObjectMeta", "spec": "WorkflowSpec", "status": RECORDED,
    },
    "CronWorkflow": {
        "apiVersion": RUN, "kind": RUN, "metadata": "ObjectMeta", "spec": "CronWorkflowSpec", "status": RECORDED,
    },
    "CronWorkflowSpec": {
        "workflowSpec": "WorkflowSpec", "workflowMetadata": "ObjectMeta",
        **{name: RECORDED for name in (
            "concurrencyPolicy", "failedJobsHistoryLimit", "schedules", "startingDeadlineSeconds",
            "stopStrategy", "successfulJobsHistoryLimit", "suspend", "timezone", "when")},
    },
    "ObjectMeta": {
        name: RECORDED for name in (
            "annotations", "creationTimestamp", "deletionGracePeriodSeconds", "deletionTimestamp", "finalizers",
            "generateName", "generation", "labels", "managedFields", "name", "namespace", "ownerReferences",
            "resourceVersion", "selfLink", "uid")
    },
    "WorkflowSpec": {
        "entrypoint": RUN, "arguments": "Arguments", "templates": ("list", "Template"), "onExit": RUN,
        "hooks": ("map", "LifecycleHook"), "parallelism": RUN, "activeDeadlineSeconds": RUN,
        "retryStrategy": "RetryStrategy", "templateDefaults": "Template", "volumes": ("list", "Volume"),
        "volumeClaimTemplates": ("list", "PersistentVolumeClaim"), "workflowTemplateRef": "WorkflowTemplateRef",
        "suspend": Unsupported("a suspended workflow waits for `argo resume`"),
        "shutdown": Unsupported("a workflow cannot be submitted already stopped"),
        "executorPlugins": Unsupported("executor plugins run inside Argo's agent pod"),
        **{name: RECORDED for name in [n for n in SCHEDULING if n != "priorityClassName"] + [
            "podGC", "ttlStrategy", "podMetadata", "podPriorityClassName", "priority", "imagePullSecrets",
            "dnsConfig", "dnsPolicy", "hostNetwork", "podDisruptionBudget", "archiveLogs", "artifactRepositoryRef",
            "artifactGC", "volumeClaimGC", "workflowMetadata"]},
    },
    "WorkflowTemplateRef": {"name": RUN, "clusterScope": RUN},
    "TemplateRef": {"name": RUN, "template": RUN, "clusterScope": RUN},
    "Template": {
        "name": RUN, "inputs": "Inputs", "outputs": "Outputs", "container": "Container", "script": "Script",
        "resource": "ResourceTemplate", "steps": ("steps", "WorkflowStep"), "dag": "DAGTemplate",
        "suspend": "SuspendTemplate", "retryStrategy": "RetryStrategy", "activeDeadlineSeconds": RUN,
        "parallelism": RUN, "volumes": ("list", "Volume"),
        "initContainers": ONE_PROCESS, "sidecars": ONE_PROCESS,
        "daemon": RUN,
        "containerSet": ONE_PROCESS,
        "data": Unsupported("data templates read artifacts"),
        "http": Unsupported("http templates run in Argo's agent pod"),
        "plugin": Unsupported("plugin templates run in Argo's agent pod"),
        "failFast": Unsupported("template-level failFast is not implemented; use dag.failFast"),
        **{name: RECORDED for name in SCHEDULING + [
            "metadata", "archiveLocation", "annotations"]},
        "timeout": RUN, "pendingTimeout": RUN, "memoize": "Memoize",
    },
    "WorkflowStep": {
        "name": RUN, "template": RUN, "templateRef": "TemplateRef", "arguments": "Arguments", "when": RUN,
        "withItems": RUN, "withParam": RUN, "withSequence": "Sequence", "continueOn": "ContinueOn",
        "onExit": RUN, "hooks": ("map", "LifecycleHook"),
        "inline": Unsupported("inline templates are not implemented; name the template instead"),
    },
    "DAGTemplate": {"tasks": ("list", "DAGTask"), "target": RUN, "failFast": RUN},
    "LifecycleHook": {"template": RUN, "templateRef": "TemplateRef", "arguments": "Arguments", "expression": RUN},
    "Sequence": {"count": RUN, "start": RUN, "end": RUN, "format": RUN},
    "ContinueOn": {"error": RUN, "failed": RUN},
    "RetryStrategy": {
        "limit": RUN, "retryPolicy": RUN, "expression": RUN, "backoff": "Backoff",
        "affinity": RECORDED,  # nodeAntiAffinity between attempts: there is one node here
    },
    "Backoff": {"duration": RUN, "factor": RUN, "maxDuration": RUN, "cap": RUN},
    "Arguments": {"parameters": ("list", "Parameter"), "artifacts": NO_ARTIFACTS},
    "Inputs": {"parameters": ("list", "Parameter"), "artifacts": NO_ARTIFACTS},
    "Outputs": {"parameters": ("list", "Parameter"), "artifacts": NO_ARTIFACTS, "result": RUN, "exitCode": RUN},
    "Parameter": {
        "name": RUN, "value": RUN, "default": RUN, "description": RECORDED, "enum": RUN, "globalName": RUN,
        "valueFrom": "ValueFrom",
    },
    "ValueFrom": {
        "path": RUN, "default": RUN, "parameter": RUN, "expression": RUN, "jsonPath": RUN,
        "configMapKeyRef": NO_CONFIGMAPS,
        "event": Unsupported("valueFrom.event needs Argo's event API"),
        "jqFilter": Unsupported("jqFilter is not implemented; use jsonPath"),
        "supplied": Unsupported("supplied values come from `argo resume`"),
    },
    "Container": {
        "name": RUN, "image": RUN, "command": RUN, "args": RUN, "env": ("list", "EnvVar"), "workingDir": RUN,
        "volumeMounts": ("list", "VolumeMount"),
        "envFrom": NO_CONFIGMAPS,
        "lifecycle": Unsupported("container lifecycle hooks are not implemented"),
        "restartPolicy": ONE_PROCESS, "restartPolicyRules": ONE_PROCESS,
        "volumeDevices": Unsupported("raw block devices cannot be attached here"),
        **{name: RECORDED for name in (
            "imagePullPolicy", "resources", "securityContext", "ports", "livenessProbe", "readinessProbe",
            "startupProbe", "terminationMessagePath", "terminationMessagePolicy", "stdin", "stdinOnce", "tty",
            "resizePolicy")},
    },
    "EnvVar": {"name": RUN, "value": RUN, "valueFrom": "EnvVarSource"},
    "EnvVarSource": {
        "fieldRef": RUN, "configMapKeyRef": NO_CONFIGMAPS, "secretKeyRef": NO_CONFIGMAPS,
        "resourceFieldRef": Unsupported("container resources have no local value"),
        "fileKeyRef": Unsupported("fileKeyRef is not implemented"),
    },
    "VolumeMount": {
        "name": RUN, "mountPath": RUN, "subPath": RUN, "readOnly": RECORDED, "mountPropagation": RECORDED,
        "recursiveReadOnly": RECORDED, "subPathExpr": Unsupported("subPathExpr is not implemented; use subPath"),
    },
    "Volume": {
        "name": RUN, "emptyDir": RUN, "hostPath": RUN, "persistentVolumeClaim": RUN,
        **{name: Unsupported("only emptyDir, hostPath and persistentVolumeClaim volumes exist here") for name in (
            "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi", "downwardAPI",
            "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs", "image",
            "iscsi", "nfs", "photonPersistentDisk", "portworxVolume", "projected", "quobyte", "rbd", "scaleIO",
            "secret", "storageos", "vsphereVolume")},
    },
    "PersistentVolumeClaim": {"apiVersion": RECORDED, "kind": RECORDED, "metadata": "ObjectMeta",
                              "spec": RECORDED, "status": RECORDED},
    "ResourceTemplate": {
        "action": RUN, "manifest": RUN, "successCondition": RUN, "failureCondition": RUN,
        "setOwnerReference": RECORDED,
        "flags": Unsupported("kubectl flags have no local meaning"),
        "mergeStrategy": Unsupported("only action: create is run here"),
        "manifestFrom": NO_ARTIFACTS,
    },
    "SuspendTemplate": {"duration": RUN},
    "Synchronization": {"mutexes": ("list", "Mutex"), "semaphores": ("list", "SemaphoreRef")},
    "Mutex": {"name": RUN, "namespace": RUN, "database": RUN},
    "SemaphoreRef": {"configMapKeyRef": RUN, "namespace": RUN, "database": RUN},
    "Memoize": {"key": RUN, "maxAge": RUN, "cache": "Cache"},
    "Cache": {"configMap": RUN},  # the ConfigMap's name names the cache file under <workdir>/.memoize/
}  # fmt: skip


# Fields Argo had once: its v4 decoder drops them (so the lock, say, silently does not exist there).
REMOVED = {
    ("Synchronization", "mutex"): "Argo v3.6 replaced it with a list, mutexes: [{name: ...}]",
    ("Synchronization", "semaphore"): "Argo v3.6 replaced it with a list, semaphores: [{configMapKeyRef: ...}]",
}


def check_fields(value: Any, shape: str | tuple, path: str, strict: bool = True) -> None:
    """Walk `value` against SHAPES. An unsupported field raises at once; an unknown one (not Argo's) raises
    after the whole walk, so that the message names a real blocker first. strict=False drops the unknown
    ones instead, with a warning, as Argo's controller decodes what kubectl created (`argo submit` refuses
    them: --strict is its default)."""
    unknown: list[tuple[dict, str, str]] = []
    _walk_fields(value, shape, path, unknown)
    if not unknown:
        return
    if strict:
        raise MoerlError(unknown[0][2] + "; --no-strict drops unknown fields, as Argo's controller does")
    for parent, name, message in unknown:
        parent.pop(name, None)
        print(f"warning: {message}: dropped (--no-strict)", file=sys.stderr)


def _walk_fields(value: Any, shape: str | tuple, path: str, unknown: list[tuple[dict, str, str]]) -> None:
    if isinstance(shape, tuple):
        kind, inner = shape
        if kind == "list":
            _expect(value, list, path)
            for i, item in enumerate(value):
                _walk_fields(item, inner, f"{path}[{i}]", unknown)
        elif kind == "map":
            _expect(value, dict, path)
            for key, item in value.items():
                _walk_fields(item, inner, f"{path}.{key}", unknown)
        elif kind == "steps":  # a list of parallel groups, each a list of steps
            _expect(value, list, path)
            for i, group in enumerate(value):
                _expect(group, list, f"{path}[{i}]")
                for j, step in enumerate(group):
                    _walk_fields(step, inner, f"{path}[{i}][{j}]", unknown)
        return
    table = SHAPES[shape]
    _expect(value, dict, path)
    for name, item in value.items():
        rule = table.get(name)
        here = _describe(path, value)
        if rule is None:
            why = REMOVED.get((shape, name), "a typo?")
            unknown.append((value, name, f"unknown field: {name} at {here} (not a field of Argo's {shape}; {why})"))
            continue
        if isinstance(rule, Unsupported):
            raise MoerlError(f"unsupported: {name} at {here}: {rule.why}")
        if rule in (RUN, RECORDED) or item is None:
            continue
        _walk_fields(item, rule, f"{path}.{name}" if path else name, unknown)


def _describe(path: str, value: dict) -> str:
    where = path or "the top level"
    return f"{where} ({value['name']!r})" if isinstance(value.get("name"), str) and path else where


def _expect(value: Any, kind: type, path: str) -> None:
    if not isinstance(value, kind):
        want = "a list" if kind is list else "a mapping"
        raise MoerlError(f"invalid: {path or 'the manifest'} must be {want}, found {type(value).__name__}")


TEMPLATE_TYPES = ("container", "script", "resource", "steps", "dag", "suspend")


LEAF_TYPES = ("container", "script", "resource")


RETRY_POLICIES = ("Always", "OnFailure", "OnError", "OnTransientError")


def template_type(template: dict) -> str:
    return next((t for t in TEMPLATE_TYPES if t in template), "")


def merge_defaults(defaults: dict, template: dict) -> dict:
    """spec.templateDefaults under a template (a strategic merge, approximated as a deep merge in
    which the template wins); defaults for another template type are dropped."""
    kind = template_type(template)
    merged = copy.deepcopy(
        {k: v for k, v in defaults.items() if k not in LEAF_TYPES + ("steps", "dag", "suspend") or k == kind}
    )
    return _deep_merge(merged, template)


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
