"""Load an Argo manifest and check, before anything runs, that this executor can run all of it.

Accepted documents: kind Workflow; kind WorkflowTemplate or ClusterWorkflowTemplate, submitted as a
workflow (as `argo submit --from workflowtemplate/NAME` would); kind CronWorkflow, run once now. A
Workflow's `workflowTemplateRef` and any step's `templateRef` are resolved from the other documents
of the same file and from the *.yaml / *.yml files beside it.

Every field of every object is checked against the field table (fields.py: each field of Argo's JSON schema
with what this executor does with it, or `unknown field` for a typo), and the resolved spec against what
Argo's validator refuses (validation.py).
"""

from __future__ import annotations

import copy
import random
import shlex
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipelines.local.api.fields import (
    API_VERSION,
    RUN,
    SHAPES,
    WORKFLOW_KINDS,
    check_fields,
)
from pipelines.local.api.validation import validate_spec
from steps.errors import MoerlError

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


# ----------------------------------------------------------------------------- semantic checks


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


