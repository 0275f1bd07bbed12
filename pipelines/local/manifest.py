"""Load an Argo manifest and check, before anything runs, that this executor can run all of it.

Accepted documents: kind Workflow; kind WorkflowTemplate or ClusterWorkflowTemplate, submitted as a
workflow (as `argo submit --from workflowtemplate/NAME` would); kind CronWorkflow, run once now. A
Workflow's `workflowTemplateRef` and any step's `templateRef` are resolved from the other documents
of the same file and from the *.yaml / *.yml files beside it.

Every field of every object is checked against the tables below, which name each field of the
corresponding definition in Argo's JSON schema (v4.1 api/jsonschema/schema.json) with what this
executor does with it:

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
import random
import re
import shlex
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.durations import parse_duration
from pipelines.local import exprlang
from pipelines.local.depends import task_dependencies
from pipelines.local.functions import BUILTINS, SPRIG
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
SHAPES["WorkflowSpec"]["synchronization"] = SHAPES["Template"]["synchronization"] = "Synchronization"
SHAPES["Script"] = {**SHAPES["Container"], "source": RUN}
SHAPES["DAGTask"] = {**SHAPES["WorkflowStep"], "dependencies": RUN, "depends": RUN}
SHAPES["WorkflowTemplate"] = {k: v for k, v in SHAPES["Workflow"].items() if k != "status"}
SHAPES["ClusterWorkflowTemplate"] = SHAPES["WorkflowTemplate"]


# ----------------------------------------------------------------------------- the loaded workflow


@dataclass
class Workflow:
    """What the executor runs: the effective spec (workflowTemplateRef merged, -p applied)."""

    name: str
    namespace: str
    uid: str
    created_at: float
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict[str, Any]
    # Templates reachable through templateRef: (cluster scope?, WorkflowTemplate name) -> templates by name
    library: dict[tuple[bool, str], dict[str, dict]] = field(default_factory=dict)
    source: Path | None = None
    # image -> the host command its ENTRYPOINT stands for (`--entrypoint IMAGE=COMMAND`), for containers without one
    entrypoints: dict[str, list[str]] = field(default_factory=dict)
    configmaps: dict[str, dict[str, str]] = field(default_factory=dict)  # ConfigMap name -> data (synchronization)

    @property
    def templates(self) -> dict[str, dict]:
        return {t["name"]: t for t in self.spec.get("templates") or []}


def load_workflow(
    manifest: str | Path | dict,
    parameters: dict[str, str] | None = None,
    name: str | None = None,
    entrypoints: dict[str, list[str]] | None = None,
    configmap_files: list[Path] | None = None,
    strict: bool = True,
) -> Workflow:
    """Read, resolve and validate a manifest; raises MoerlError naming the first problem.

    entrypoints: image -> host command, run for a container of that image that gives no command (the
    image's ENTRYPOINT, which is not known here). configmap_files: YAML files of ConfigMaps (the semaphores'
    limits), read with those in the manifest's file and beside it. strict=False: fields that are not Argo's
    are dropped with a warning (`argo submit --strict=false`) instead of refused."""
    source = None
    if isinstance(manifest, dict):
        documents = [manifest]
        siblings: list[tuple[str, dict]] = []
    else:
        source = Path(manifest)
        documents = _read_documents(source)
        siblings = _sibling_templates(source)
    main = next((d for d in documents if d.get("kind") in WORKFLOW_KINDS), None)
    where = str(source) if source else "the manifest"
    if main is None:
        kinds = sorted({str(d.get("kind")) for d in documents})
        raise MoerlError(
            f"{where}: no Argo workflow in it (kinds found: {', '.join(kinds) or 'none'}); "
            f"give a manifest with kind Workflow, WorkflowTemplate or CronWorkflow"
        )
    others = [(where, d) for d in documents if d is not main]
    library_docs = {}
    for origin, doc in siblings + others:  # documents of the manifest's own file win over siblings
        if doc.get("kind") in ("WorkflowTemplate", "ClusterWorkflowTemplate"):
            key = (doc["kind"] == "ClusterWorkflowTemplate", str((doc.get("metadata") or {}).get("name")))
            library_docs[key] = (origin, doc)

    configmaps: dict[str, dict[str, str]] = {}
    given = [(str(f), d) for f in configmap_files or [] for d in _read_documents(f)]
    for _, doc in siblings + others + given:  # a file given with --configmap wins
        if doc.get("kind") == "ConfigMap":
            data = doc.get("data") or {}
            configmaps[str((doc.get("metadata") or {}).get("name"))] = {str(k): str(v) for k, v in data.items()}
    for origin, doc in given:
        if doc.get("kind") != "ConfigMap":
            raise MoerlError(f"--configmap {origin}: a {doc.get('kind')} in it; give a file of ConfigMap documents")

    check_fields(main, main["kind"], "", strict)
    if main.get("apiVersion") != API_VERSION:
        raise MoerlError(f"{where}: apiVersion is {main.get('apiVersion')!r}; Argo manifests use {API_VERSION}")

    metadata = submitted_metadata(main)
    spec = copy.deepcopy(main.get("spec") or {})
    if main["kind"] == "CronWorkflow":
        spec = spec.get("workflowSpec") or {}
    spec = _merge_workflow_template_ref(spec, library_docs, where, strict)
    library = _template_library(spec, library_docs)
    _apply_parameters(spec, parameters or {}, where)
    validate_spec(spec, library, where, entrypoints or {})
    _check_synchronization(spec, library, configmaps, where)

    if name is None:  # a Workflow keeps its name; a template or cron workflow gets a generated one
        name = metadata.get("name") or generate_name(metadata.get("generateName") or "workflow-")
    return Workflow(
        name=str(name),
        namespace=str(metadata.get("namespace") or "default"),
        uid=str(uuid.uuid4()),
        created_at=time.time(),
        labels={str(k): str(v) for k, v in (metadata.get("labels") or {}).items()},
        annotations={str(k): str(v) for k, v in (metadata.get("annotations") or {}).items()},
        spec=spec,
        library=library,
        source=source,
        entrypoints=dict(entrypoints or {}),
        configmaps=configmaps,
    )


def submitted_metadata(doc: dict) -> dict:
    """The metadata of the Workflow that runs: a Workflow's own; for a WorkflowTemplate or
    ClusterWorkflowTemplate, what `argo submit --from` creates (workflow/common/convert.go
    NewWorkflowFromWorkflowTemplate: generateName `<template>-`, the label naming the template, none of the
    template object's own labels); for a CronWorkflow, what ConvertCronWorkflowToWorkflow creates
    (generateName `<cron>-`, the cron-workflow label and scheduled-time annotation, then
    spec.workflowMetadata's labels and annotations). The spec's own workflowMetadata is the controller's to
    apply (executor.py apply_workflow_metadata)."""
    metadata = dict(doc.get("metadata") or {})
    kind, name = doc["kind"], str(metadata.get("name") or "workflow")
    if kind == "Workflow":
        return metadata
    out: dict[str, Any] = {"generateName": f"{name}-", "namespace": metadata.get("namespace"), "annotations": {}}
    if kind == "CronWorkflow":
        extra = (doc.get("spec") or {}).get("workflowMetadata") or {}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        out["labels"] = {"workflows.argoproj.io/cron-workflow": name, **(extra.get("labels") or {})}
        out["annotations"] = {"workflows.argoproj.io/scheduled-time": now, **(extra.get("annotations") or {})}
    else:
        scope = "cluster-workflow-template" if kind == "ClusterWorkflowTemplate" else "workflow-template"
        out["labels"] = {f"workflows.argoproj.io/{scope}": name}
    return out


def generate_name(prefix: str) -> str:
    """Kubernetes' generateName: the prefix plus five characters from its consonant-and-digit alphabet."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    return prefix + "".join(random.choice(alphabet) for _ in range(5))


def _read_documents(path: Path) -> list[dict]:
    if path.is_dir():
        raise MoerlError(f"manifest {path} is a directory; give the path of an Argo Workflow YAML file in it")
    if not path.is_file():
        raise MoerlError(f"manifest {path} does not exist; give the path of an Argo Workflow YAML file")
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as err:
        raise MoerlError(f"manifest {path} is not valid YAML: {err}") from err
    for doc in documents:
        if not isinstance(doc, dict):
            raise MoerlError(f"manifest {path}: every document must be a mapping, found {type(doc).__name__}")
    return documents


def _sibling_templates(path: Path) -> list[tuple[str, dict]]:
    """WorkflowTemplates (and ConfigMaps) in the files beside the manifest (unreadable files are skipped: they only
    matter if referenced, and then the missing reference is reported)."""
    found = []
    for sibling in sorted(path.parent.glob("*.y*ml")):
        if sibling.resolve() == path.resolve() or sibling.suffix not in (".yaml", ".yml"):
            continue
        try:
            docs = list(yaml.safe_load_all(sibling.read_text()))
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            continue
        found += [
            (str(sibling), d)
            for d in docs
            if isinstance(d, dict) and d.get("kind") in ("WorkflowTemplate", "ClusterWorkflowTemplate", "ConfigMap")
        ]
    return found


def _check_synchronization(spec: dict, library: dict, configmaps: dict[str, dict[str, str]], where: str) -> None:
    """Each semaphore's limit must be readable before the run starts: from a ConfigMap beside the manifest
    or given with --configmap (Argo reads it from the cluster); a database lock has no database here."""
    holders = [("spec", spec)] + [
        (f"spec.templates[{i}] ({t.get('name')!r})", t) for i, t in enumerate(spec.get("templates") or [])
    ]
    holders += [(f"WorkflowTemplate {key[1]}.templates.{n}", t) for key, ts in library.items() for n, t in ts.items()]
    for path, holder in holders:
        sync = holder.get("synchronization")
        if not sync:
            continue
        for i, mutex in enumerate(sync.get("mutexes") or []):
            if (mutex or {}).get("database"):
                raise MoerlError(
                    f"unsupported: synchronization.mutexes[{i}].database at {path}: there is no synchronization "
                    f"database here; drop database: true (the mutex is then kept by this machine)"
                )
            if not (mutex or {}).get("name"):
                raise MoerlError(f"{where}: {path}.synchronization.mutexes[{i}].name is required")
        for i, semaphore in enumerate(sync.get("semaphores") or []):
            semaphore = semaphore or {}
            if semaphore.get("database"):
                raise MoerlError(
                    f"unsupported: synchronization.semaphores[{i}].database at {path}: there is no synchronization "
                    f"database here; use configMapKeyRef and --configmap FILE"
                )
            ref = semaphore.get("configMapKeyRef") or {}
            name, key = ref.get("name"), ref.get("key")
            if not name or not key:
                raise MoerlError(
                    f"{where}: {path}.synchronization.semaphores[{i}]: configMapKeyRef with name and key is required"
                )
            if "{{" in f"{name}{key}":
                continue  # resolved when the template runs; a missing ConfigMap then errors its node
            limit = (configmaps.get(str(name)) or {}).get(str(key))
            if limit is None:
                raise MoerlError(
                    f"{where}: {path}.synchronization.semaphores[{i}] reads its limit from ConfigMap {name!r} key "
                    f"{key!r}, which is not given; pass --configmap FILE with that ConfigMap (data: {{{key}: \"1\"}}) "
                    f"or put it beside the manifest"
                )
            if not str(limit).strip().isdigit():
                raise MoerlError(
                    f"{where}: ConfigMap {name!r} key {key!r} is {limit!r}; a semaphore's limit is a whole number"
                )


def _merge_workflow_template_ref(spec: dict, library_docs: dict, where: str, strict: bool = True) -> dict:
    """Argo's execWf: the referenced template's spec, overridden field by field by the Workflow's,
    with arguments merged by parameter name."""
    ref = spec.get("workflowTemplateRef")
    if not ref:
        return spec
    key = (bool(ref.get("clusterScope")), str(ref.get("name")))
    if key not in library_docs:
        kind = "ClusterWorkflowTemplate" if key[0] else "WorkflowTemplate"
        raise MoerlError(
            f"{where}: spec.workflowTemplateRef names {kind} {key[1]!r}, which is in neither the "
            f"manifest nor a YAML file beside it; put its manifest next to this one"
        )
    origin, doc = library_docs[key]
    check_fields(doc, doc["kind"], "", strict)
    if spec.get("templates"):
        raise MoerlError(f"{where}: Templates is invalid field in spec if workflow referred WorkflowTemplate reference")
    merged = copy.deepcopy(doc.get("spec") or {})
    for name, value in spec.items():
        if name == "workflowTemplateRef":
            continue
        if name == "arguments":
            params = {p["name"]: p for p in (merged.get("arguments") or {}).get("parameters") or []}
            params.update({p["name"]: p for p in (value or {}).get("parameters") or []})
            merged["arguments"] = {"parameters": list(params.values())}
        elif name == "hooks" and isinstance(value, dict):  # MergeTo: the template's hooks the workflow lacks
            merged["hooks"] = {**(merged.get("hooks") or {}), **copy.deepcopy(value)}
        else:
            merged[name] = _strategic_merge(merged.get(name), copy.deepcopy(value), name)
    return merged


# WorkflowSpec's lists that a strategic merge merges item by item (patchMergeKey in workflow_types.go);
# any other list is replaced whole.
SPEC_MERGE_KEYS = {"volumes": "name", "tolerations": "key", "imagePullSecrets": "name", "hostAliases": "ip"}


def _strategic_merge(base: Any, override: Any, field: str = "") -> Any:
    """JoinWorkflowSpec's strategic merge of the Workflow's spec over its template's (workflow/util/merge.go
    MergeTo): maps merge key by key, the Workflow's value winning (so workflowMetadata's labels and
    annotations are both sets; a labelsFrom entry is the Workflow's whole, else the template's), lists with
    a merge key merge by it, anything else is the Workflow's."""
    if isinstance(base, dict) and isinstance(override, dict):
        if field == "labelsFrom":
            return {**base, **override}
        return {k: _strategic_merge(base.get(k), v, k) if k in base else v for k, v in override.items()} | {
            k: v for k, v in base.items() if k not in override
        }
    key = SPEC_MERGE_KEYS.get(field)
    if key and isinstance(base, list) and isinstance(override, list):
        items = {item.get(key): item for item in base if isinstance(item, dict)}
        items.update({item.get(key): item for item in override if isinstance(item, dict)})
        return list(items.values())
    return override


def _template_library(spec: dict, library_docs: dict) -> dict[tuple[bool, str], dict[str, dict]]:
    library = {}
    for key, (_, doc) in library_docs.items():
        library[key] = {t.get("name"): t for t in (doc.get("spec") or {}).get("templates") or []}
    return library


def _apply_parameters(spec: dict, parameters: dict[str, str], where: str) -> None:
    if not isinstance(spec.get("arguments"), dict):  # `arguments:` or `parameters:` left null is none
        spec["arguments"] = {}
    if spec["arguments"].get("parameters") is None:
        spec["arguments"]["parameters"] = []
    declared = spec["arguments"]["parameters"]
    names = [p.get("name") for p in declared]
    for name, value in parameters.items():
        if name not in names:
            raise MoerlError(
                f"-p {name}: the workflow declares no parameter {name!r} "
                f"(declared: {', '.join(map(str, names)) or 'none'}); check the spelling"
            )
        param = declared[names.index(name)]
        param["value"] = value
        param.pop("valueFrom", None)
    for param in declared:
        if "value" not in param:
            raise MoerlError(
                f"{where}: spec.arguments.{param.get('name')}.value is required; pass -p {param.get('name')}=VALUE"
            )
        if param.get("enum") and str(param["value"]) not in [str(e) for e in param["enum"]]:
            raise MoerlError(
                f"{where}: spec.arguments.{param['name']}.value should be present in "
                f"spec.arguments.{param['name']}.enum list {param['enum']}"
            )


# ----------------------------------------------------------------------------- field tables


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


# ----------------------------------------------------------------------------- semantic checks

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


def parse_entrypoint(item: str) -> tuple[str, list[str]]:
    """`IMAGE=COMMAND` of `moerl local --entrypoint`: the image as the manifest names it, the command as a
    shell would split it."""
    image, sep, command = item.partition("=")
    try:
        argv = shlex.split(command)
    except ValueError:
        argv = []
    if not sep or not image.strip() or not argv:
        raise MoerlError(
            f"--entrypoint {item!r}: expected IMAGE=COMMAND, e.g. --entrypoint 'busybox=sh -c'"
        )
    return image.strip(), argv


def validate_spec(spec: dict, library: dict, where: str, entrypoints: dict[str, list[str]] | None = None) -> None:
    """Argo's submit-time validation, for what can go wrong before anything runs."""
    templates = spec.get("templates") or []
    by_name: dict[str, dict] = {}
    for i, template in enumerate(templates):
        name = template.get("name")
        if not name:
            raise MoerlError(f"{where}: spec.templates[{i}].name is required")
        if name in by_name:
            raise MoerlError(f"{where}: spec.templates[{i}].name {name!r} is not unique")
        by_name[name] = template
    entrypoint = spec.get("entrypoint")
    if not entrypoint:
        raise MoerlError(f"{where}: spec.entrypoint is required; name the template to start with")
    check = _Checker(spec, by_name, library, where, entrypoints or {})
    check.reference({"template": entrypoint}, "spec.entrypoint", spec.get("arguments") or {})
    if spec.get("onExit"):
        check.reference({"template": spec["onExit"]}, "spec.onExit", {})
    for hook_name, hook in (spec.get("hooks") or {}).items():
        check.hook(hook_name, hook, "spec.hooks")
    if spec.get("parallelism") is not None:
        check.positive_int(spec["parallelism"], "spec.parallelism")
    if spec.get("activeDeadlineSeconds") is not None:
        check.positive_int(spec["activeDeadlineSeconds"], "spec.activeDeadlineSeconds")
    if spec.get("retryStrategy") is not None:
        check.retry_strategy(spec["retryStrategy"], "spec.retryStrategy")
    for i, template in enumerate(templates):
        check.template(template, f"spec.templates[{i}]")
    # Every WorkflowTemplate reached through templateRef, whole; its templates call each other by name
    # (templateresolution/context.go WithTemplateHolder: a referenced template resolves in its own holder).
    checked: set[tuple[bool, str]] = set()
    while pending := [key for key in check.referenced_library if key not in checked]:
        for key in pending:
            checked.add(key)
            check.by_name = library[key]
            kind = "ClusterWorkflowTemplate" if key[0] else "WorkflowTemplate"
            for name, template in library[key].items():
                check.template(template, f"{kind} {key[1]}.templates.{name}")


class _Checker:
    def __init__(self, spec: dict, by_name: dict, library: dict, where: str, entrypoints: dict[str, list[str]]):
        self.spec = spec
        self.entrypoints = entrypoints
        self.by_name = by_name
        self.library = library
        self.where = where
        self.referenced_library: dict[tuple[bool, str], set[str]] = {}

    def fail(self, message: str) -> None:
        raise MoerlError(f"{self.where}: {message}")

    def target(self, holder: dict, path: str, scope: dict | None = None) -> dict:
        scope = self.by_name if scope is None else scope
        if holder.get("templateRef"):
            ref = holder["templateRef"]
            key = (bool(ref.get("clusterScope")), str(ref.get("name")))
            templates = self.library.get(key)
            if templates is None or ref.get("template") not in templates:
                self.fail(
                    f"{path}: template reference {ref.get('name')}.{ref.get('template')} not found; put the "
                    f"WorkflowTemplate's manifest beside this one"
                )
            self.referenced_library.setdefault(key, set()).add(ref["template"])
            return templates[ref["template"]]
        name = holder.get("template")
        if not name:
            self.fail(f"{path}: template or templateRef is required")
        if name not in scope:
            self.fail(f"{path}: template name '{name}' undefined")
        return scope[name]

    def reference(self, holder: dict, path: str, arguments: dict) -> None:
        template = self.target(holder, path)
        supplied = {p.get("name") for p in (arguments or {}).get("parameters") or []}
        for param in (template.get("inputs") or {}).get("parameters") or []:
            has_value = "value" in param or "default" in param or "default" in (param.get("valueFrom") or {})
            if not has_value and param.get("name") not in supplied:
                self.fail(f"{path}: inputs.parameters.{param.get('name')} was not supplied")

    def hook(self, name: str, hook: dict, path: str) -> None:
        if name != "exit":
            raise MoerlError(
                f"unsupported: hooks.{name} at {path}: only the exit hook is run here; use onExit or hooks.exit"
            )
        self.reference(hook, f"{path}.exit", hook.get("arguments") or {})

    def positive_int(self, value: Any, path: str) -> None:
        if isinstance(value, str) and "{{" in value:
            return
        try:
            ok = int(value) >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            self.fail(f"{path} must be a non-negative integer, got {value!r}")

    def expression(self, source: str, path: str) -> None:
        """Syntax and function names of an expr-lang expression (tags still in it are placeholders)."""
        text = re.sub(r"\{\{[^}]*\}\}", "x", source)
        try:
            called = exprlang.called_functions(text)
        except exprlang.ExprError as err:
            self.fail(f"{path}: {err}")
        for function in called:
            if function.startswith("sprig.") and function[6:] not in SPRIG:
                raise MoerlError(f"unsupported: {function} at {path}: this sprig function is not implemented")
            if (
                not function.startswith("sprig.")
                and function not in BUILTINS
                and function not in ("all", "any", "none", "one", "filter", "map", "count", "find", "findIndex")
            ):
                raise MoerlError(f"unsupported: {function}() at {path}: this expr-lang function is not implemented")

    def tags(self, value: Any, path: str) -> None:
        """Every `{{= ...}}` tag in a template must parse."""
        if isinstance(value, str):
            for tag in re.findall(r"\{\{=(.*?)\}\}", value, re.DOTALL):
                self.expression(tag, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.tags(item, f"{path}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                self.tags(item, f"{path}[{i}]")

    def retry_strategy(self, retry: dict, path: str) -> None:
        policy = retry.get("retryPolicy")
        if policy and policy not in RETRY_POLICIES:
            self.fail(f"{path}.retryPolicy {policy!r} is not one of {', '.join(RETRY_POLICIES)}")
        if retry.get("limit") is not None and "{{" not in str(retry["limit"]):
            self.positive_int(retry["limit"], f"{path}.limit")
        if retry.get("expression"):
            self.expression(retry["expression"], f"{path}.expression")
        backoff = retry.get("backoff") or {}
        for key in ("duration", "maxDuration", "cap"):
            if backoff.get(key) is not None and "{{" not in str(backoff[key]):
                try:
                    parse_duration(backoff[key])
                except ValueError as err:
                    self.fail(f"{path}.backoff.{key}: {err}")
        if backoff and not backoff.get("duration"):
            self.fail(f"{path}.backoff.duration is required (no base duration specified for retryStrategy)")

    def template(self, template: dict, path: str) -> None:
        name = template.get("name")
        path = f"{path} ({name!r})"
        if self.spec.get("templateDefaults"):  # what runs is the template over the defaults (an image, a command)
            template = merge_defaults(self.spec["templateDefaults"], template)
        types = [t for t in TEMPLATE_TYPES if t in template]
        if len(types) != 1:
            how = "unspecified" if not types else "multiple template types specified"
            self.fail(
                f"templates.{name} template type {how}. choose one of: container, steps, script, resource, dag, suspend"
            )
        kind = types[0]
        if template.get("activeDeadlineSeconds") is not None:
            if kind not in LEAF_TYPES:
                self.fail(f"templates.{name}.activeDeadlineSeconds is only valid for leaf templates")
            self.positive_int(template["activeDeadlineSeconds"], f"{path}.activeDeadlineSeconds")
        for key in ("timeout", "pendingTimeout"):
            if template.get(key) and "{{" not in str(template[key]):
                try:
                    parse_duration(template[key])
                except ValueError as err:
                    self.fail(f"templates.{name}.{key}: {err}")
        if template.get("parallelism") is not None and kind not in ("steps", "dag"):
            self.fail(f"templates.{name}.parallelism is only valid for steps and dag templates")
        if template.get("retryStrategy") is not None:
            self.retry_strategy(template["retryStrategy"], f"{path}.retryStrategy")
        if kind in ("container", "script") and not (template[kind] or {}).get("image"):
            self.fail(f"templates.{name}.{kind}.image may not be empty")
        if kind in ("container", "script"):
            self.command(template[kind] or {}, f"{path}.{kind}")
        if kind == "suspend" and not (template["suspend"] or {}).get("duration"):
            raise MoerlError(
                f"unsupported: suspend without duration at {path}: it waits for `argo resume`; give suspend.duration"
            )
        if kind == "resource":
            self.resource(template["resource"] or {}, f"{path}.resource")
        for i, param in enumerate((template.get("outputs") or {}).get("parameters") or []):
            ref = f"templates.{name}.outputs.parameters.{param.get('name')}"
            if param.get("valueFrom") is not None and param.get("value") is not None:
                self.fail(f"{ref} has both valueFrom and value specified, choose one")
            if param.get("valueFrom") is None:  # a literal `value` is the output (validateOutputParameter)
                if param.get("value") is None:
                    self.fail(f"{ref} does not have valueFrom or value specified")
                continue
            source = param["valueFrom"]
            if kind in ("container", "script") and not source.get("path"):
                self.fail(f"{path}.outputs.parameters[{i}].valueFrom.path must be specified for {kind} templates")
            if kind in ("steps", "dag") and not (source.get("parameter") or source.get("expression")):
                self.fail(
                    f"{path}.outputs.parameters[{i}].valueFrom.parameter or expression must be specified "
                    f"for {kind} templates"
                )
        for i, volume in enumerate(template.get("volumes") or []):
            self.volume(volume, f"{path}.volumes[{i}]")
        self.tags(template, path)
        if kind == "steps":
            self.steps(template, path)
        if kind == "dag":
            self.dag(template, path)

    def command(self, container: dict, path: str) -> None:
        """A container without `command` runs its image's ENTRYPOINT, which only the image knows."""
        image = str(container.get("image") or "")
        if container.get("command") or image in self.entrypoints:
            return
        raise MoerlError(
            f"unsupported: container without command at {path}: image {image!r} would run its own ENTRYPOINT, "
            f"which is not known here; give command, or map the image to a host command with "
            f"`moerl local --entrypoint '{image}=COMMAND'`"
        )

    def volume(self, volume: dict, path: str) -> None:
        if not volume.get("name"):
            self.fail(f"{path}.name is required")

    def resource(self, resource: dict, path: str) -> None:
        if resource.get("action") != "create":
            raise MoerlError(
                f"unsupported: resource.action {resource.get('action')!r} at {path}: only `create` "
                f"of a kubeflow.org/v1 PyTorchJob is run here"
            )
        text = re.sub(r"\{\{[^}]*\}\}", "x", str(resource.get("manifest") or ""))
        try:
            body = yaml.safe_load(text)
        except yaml.YAMLError:
            self.fail(f"{path}.manifest must be a valid yaml")
        if (
            not isinstance(body, dict)
            or body.get("kind") != "PyTorchJob"
            or not str(body.get("apiVersion", "")).startswith("kubeflow.org/")
        ):
            kind = body.get("kind") if isinstance(body, dict) else None
            raise MoerlError(
                f"unsupported: resource kind {kind!r} at {path}.manifest: only a kubeflow.org/v1 "
                f"PyTorchJob is run here (as torchrun)"
            )
        if not resource.get("successCondition") and not resource.get("failureCondition"):
            raise MoerlError(
                f"unsupported: resource without successCondition at {path}: Argo would not wait for "
                f"the PyTorchJob; add successCondition: status.replicaStatuses.Master.succeeded > 0 "
                f"and failureCondition: status.replicaStatuses.Master.failed > 0"
            )
        specs = (body.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        if "Master" not in specs:
            self.fail(f"{path}.manifest: spec.pytorchReplicaSpecs.Master is required")
        for role, replica in specs.items():
            if role not in ("Master", "Worker"):
                raise MoerlError(f"unsupported: replica type {role} at {path}.manifest: only Master and Worker")
            containers = (((replica or {}).get("template") or {}).get("spec") or {}).get("containers") or []
            if len(containers) != 1:
                raise MoerlError(
                    f"unsupported: {len(containers)} containers in the {role} replica at "
                    f"{path}.manifest: exactly one (the trainer) is run"
                )
            check_fields(containers[0], "Container", f"{path}.manifest.{role}.containers[0]")
            self.command(containers[0], f"{path}.manifest.{role}.containers[0]")

    def call(self, step: dict, path: str) -> None:
        self.reference(step, path, step.get("arguments") or {})
        if step.get("onExit"):
            self.reference({"template": step["onExit"]}, f"{path}.onExit", {})
        for hook_name, hook in (step.get("hooks") or {}).items():
            self.hook(hook_name, hook, f"{path}.hooks")
        if step.get("withSequence"):
            sequence = step["withSequence"]
            if sequence.get("end") is None and sequence.get("count") is None:
                self.fail(f"{path}.withSequence: neither end nor count was specified")
        if sum(1 for k in ("withItems", "withParam", "withSequence") if step.get(k) not in (None, [], "")) > 1:
            self.fail(f"{path}: only one of withItems, withParam or withSequence can be specified")

    def steps(self, template: dict, path: str) -> None:
        for i, group in enumerate(template["steps"] or []):
            names = set()
            for j, step in enumerate(group or []):
                step_path = f"{path}.steps[{i}][{j}]"
                if not step.get("name"):
                    self.fail(f"{step_path}.name is required")
                if step["name"] in names:
                    self.fail(f"templates.{template['name']}.steps[{i}].name '{step['name']}' is not unique")
                names.add(step["name"])
                self.call(step, f"{step_path} ({step['name']!r})")

    def dag(self, template: dict, path: str) -> None:
        tasks = (template["dag"] or {}).get("tasks") or []
        if not tasks:
            self.fail(f"templates.{template['name']} must have at least one task")
        by_name: dict[str, dict] = {}
        for i, task in enumerate(tasks):
            if not task.get("name"):
                self.fail(f"{path}.dag.tasks[{i}].name is required")
            if task["name"] in by_name:
                self.fail(f"templates.{template['name']}.tasks[{i}].name '{task['name']}' is not unique")
            by_name[task["name"]] = task
        uses_depends = any(t.get("depends") for t in tasks)
        if uses_depends and any(t.get("dependencies") for t in tasks):
            self.fail(
                f"templates.{template['name']} cannot use both 'depends' and 'dependencies' in the same DAG template"
            )
        if uses_depends and any(t.get("continueOn") for t in tasks):
            self.fail(
                f"templates.{template['name']} cannot use 'continueOn' when using 'depends'. Instead use "
                f"'dep-task.Failed'/'dep-task.Errored'"
            )
        graph = {}
        for i, task in enumerate(tasks):
            task_path = f"{path}.dag.tasks[{i}] ({task['name']!r})"
            try:
                deps, logic = task_dependencies(task, by_name)
            except ValueError as err:
                self.fail(f"templates.{template['name']}.tasks.{task['name']} {err}")
            if logic:
                self.expression(logic.replace("-", "_"), f"{task_path}.depends")
            graph[task["name"]] = deps
            self.call(task, task_path)
        for target in str((template["dag"] or {}).get("target") or "").split():
            if target not in by_name and "{{" not in target:
                self.fail(f"templates.{template['name']}.targets: target '{target}' is not defined")
        _check_acyclic(graph, template["name"], self.fail)


def _check_acyclic(graph: dict[str, list[str]], template_name: str, fail: Any) -> None:
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            fail(f"templates.{template_name} sorting failed: dependency cycle {' -> '.join(trail + [name])}")
        state[name] = 1
        for dep in graph.get(name, []):
            visit(dep, trail + [name])
        state[name] = 2

    for name in graph:
        visit(name, [])
