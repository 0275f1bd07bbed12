"""The EKS manifests under manifests/: every file parses, core kinds validate against the Kubernetes
schemas (kubernetes-validate, offline), Karpenter kinds carry the fields their CRDs require, the Argo
artifact repository validates against Argo's types made strict (tests/argo_strict_schema.py), every
kustomization resolves, the IAM
policies grant nothing beyond the run prefix, and the Spot-related controller settings are in place.

Remote resources (Argo's release install.yaml, the Kubeflow training operator) cannot be fetched offline:
they are checked to be pinned to a release tag and, for a kustomize build, replaced by stubs that hold only
the objects our patches and replacements touch (REMOTE_PROVIDES below). Nothing from them is vendored.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import string
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from argo_reference import reference_path
from argo_strict_schema import validator as argo_validator

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
OVERLAY = MANIFESTS / "overlays" / "example"
# The oldest Kubernetes the docs support (EKS 1.31 or newer).
K8S_VERSION = "1.31"
CRD_GROUPS = {"karpenter.sh", "karpenter.k8s.aws", "argoproj.io", "kubeflow.org"}
KUSTOMIZE_API = "kustomize.config.k8s.io/v1beta1"

# What each remote resource provides that our patches and replacements rely on (read from the pinned
# releases: argo-workflows v4.1.2 manifests/cluster-install, kubeflow trainer v1.9.4 overlays/standalone).
ARGO_INSTALL = "https://github.com/argoproj/argo-workflows/releases/download/v4.1.2/install.yaml"
TRAINING_OPERATOR = "https://github.com/kubeflow/trainer.git//manifests/overlays/standalone?ref=v1.9.4"
REMOTE_PROVIDES = {
    ARGO_INSTALL: [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "workflow-controller-configmap"}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "workflow-controller"},
            "spec": {
                "selector": {"matchLabels": {"app": "workflow-controller"}},
                "template": {
                    "metadata": {"labels": {"app": "workflow-controller"}},
                    "spec": {"containers": [{"name": "workflow-controller",
                                             "image": "quay.io/argoproj/workflow-controller:v4.1.2"}]},
                },
            },
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "argo-server"}},
    ],
    TRAINING_OPERATOR: [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kubeflow"}}],
}


# --- loading ---------------------------------------------------------------------------------------------


def yaml_files() -> list[Path]:
    return sorted(p for p in MANIFESTS.rglob("*.yaml") if "rendered" not in p.relative_to(MANIFESTS).parts)


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def is_remote(ref: str) -> bool:
    return ref.startswith(("http://", "https://", "github.com/", "git@", "ssh://"))


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in MANIFESTS.rglob("kustomization.yaml") if "rendered" not in p.parts)


def selected(docs: list[dict], select: dict) -> list[dict]:
    return [
        d for d in docs
        if all(d["kind"] == v if k == "kind" else d["metadata"]["name"] == v if k == "name" else True
               for k, v in select.items())
    ]


def merge_patch(target: object, patch: object) -> object:
    """Enough of a strategic merge for our patches: maps merge key by key, lists of named items by name."""
    if isinstance(target, dict) and isinstance(patch, dict):
        for key, value in patch.items():
            target[key] = merge_patch(target[key], value) if key in target else copy.deepcopy(value)
        return target
    if isinstance(target, list) and isinstance(patch, list) and all(
        isinstance(item, dict) and "name" in item for item in target + patch
    ):
        by_name = {item["name"]: item for item in target}
        for item in patch:
            if item["name"] in by_name:
                merge_patch(by_name[item["name"]], item)
            else:
                target.append(copy.deepcopy(item))
        return target
    return copy.deepcopy(patch)


def resources_of(directory: Path) -> list[dict]:
    """Every object a kustomization pulls in, recursively, with its patches applied: local files as they
    are, remote ones as the stubs above."""
    spec = kustomization(directory)
    docs: list[dict] = []
    for ref in spec.get("resources", []):
        if is_remote(ref):
            docs += copy.deepcopy(REMOTE_PROVIDES[ref])
        elif (directory / ref).is_dir():
            docs += resources_of(directory / ref)
        else:
            docs += load_docs(directory / ref)
    for patch in spec.get("patches", []):
        for change in load_docs(directory / patch["path"]):
            for doc in selected(docs, {"kind": change["kind"], "name": change["metadata"]["name"]}):
                merge_patch(doc, change)
    return docs


def cluster_env() -> dict[str, str]:
    values = {}
    for line in (OVERLAY / "cluster.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    return values


def api_group(doc: dict) -> str:
    return doc["apiVersion"].rpartition("/")[0]


def docs_of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


ALL_LOCAL = resources_of(OVERLAY)


# --- a kustomize fieldPath resolver (a.b.0.[key=value].[dotted/key]) -------------------------------------


def field_path_parts(path: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]|[^.\[\]]+", path)


def resolve(node: object, path: str) -> object:
    """The value a kustomize replacement fieldPath names; KeyError if any step does not exist."""
    for part in field_path_parts(path):
        if part.startswith("["):
            inner = part[1:-1]
            if "=" in inner and isinstance(node, list):
                key, _, value = inner.partition("=")
                matches = [item for item in node if isinstance(item, dict) and str(item.get(key)) == value]
                if not matches:
                    raise KeyError(f"{path}: no element with {key}={value}")
                node = matches[0]
                continue
            part = inner
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise KeyError(f"{path}: bad index {part}")
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(f"{path}: no field {part}")
    return node


# --- every file parses -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_every_manifest_parses(path):
    docs = load_docs(path)
    if path.name == "artifact-repository.yaml":
        assert set(docs[0]) >= {"s3"}  # Argo's ArtifactRepository, not a Kubernetes object
        return
    assert docs, f"{path} is empty"
    for doc in docs:
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), f"{path}: {doc}"
        if doc["apiVersion"] != KUSTOMIZE_API:
            assert doc.get("metadata", {}).get("name"), f"{path}: a {doc['kind']} without a name"


# --- kustomizations resolve ------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", kustomization_dirs(), ids=lambda p: str(p.relative_to(MANIFESTS)))
def test_kustomization_local_paths_exist_and_remote_refs_are_pinned(directory):
    spec = kustomization(directory)
    assert spec["apiVersion"] == KUSTOMIZE_API and spec["kind"] == "Kustomization"
    for ref in spec.get("resources", []):
        if is_remote(ref):
            assert ref in REMOTE_PROVIDES, f"{directory.name}: unknown remote resource {ref}"
            assert re.search(r"/download/v\d+\.\d+\.\d+/|[?&]ref=v\d+\.\d+\.\d+$", ref), (
                f"{directory.name}: remote resource not pinned to a release tag: {ref}"
            )
        else:
            target = directory / ref
            assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{directory}: {ref}"
    local = resources_of(directory)  # patches apply only to objects that exist, so check they do
    for patch in spec.get("patches", []):
        patch_docs = load_docs(directory / patch["path"])
        for doc in patch_docs:
            assert selected(local, {"kind": doc["kind"], "name": doc["metadata"]["name"]}), (
                f"{directory.name}: patch {patch['path']} targets {doc['kind']}/{doc['metadata']['name']}, "
                f"which none of the kustomization's resources provide"
            )
    for generator in spec.get("configMapGenerator", []):
        for entry in generator.get("files", []) + generator.get("envs", []):
            assert (directory / entry.rpartition("=")[2]).is_file(), f"{directory.name}: {entry}"


def test_argo_install_is_the_release_the_rendered_manifests_are_validated_against():
    """The controller installed is the release of Argo's reference schema (where the reference folder is
    there), and no older than the types Hera's models were generated from (always)."""
    hera_models = Path(importlib.import_module("hera.workflows.models").__file__).read_text()
    hera_tag = re.search(r"argo-workflows/(v\d+\.\d+\.\d+)/api", hera_models).group(1)
    install_tag = re.search(r"/download/(v\d+\.\d+\.\d+)/install.yaml", ARGO_INSTALL).group(1)
    assert version_tuple(hera_tag)[0] == version_tuple(install_tag)[0], (hera_tag, install_tag)
    assert version_tuple(hera_tag) <= version_tuple(install_tag), (hera_tag, install_tag)
    assert ARGO_INSTALL in kustomization(MANIFESTS / "argo")["resources"]
    readme = reference_path("README.md").read_text()
    assert re.search(r"at tag (v\d+\.\d+\.\d+)", readme).group(1) == install_tag


def version_tuple(tag: str) -> tuple[int, ...]:
    return tuple(int(part) for part in tag.removeprefix("v").split("."))


def test_overlay_replacements_resolve_offline():
    """Our own resolver: each replacement's source value exists in cluster.env, every target it selects
    exists, and every fieldPath names a field that is there in each selected object."""
    spec = kustomization(OVERLAY)
    settings = cluster_env()
    generated = {g["name"] for g in spec["configMapGenerator"]}
    targets_hit = 0
    for replacement in spec["replacements"]:
        source = replacement["source"]
        assert source["kind"] == "ConfigMap" and source["name"] in generated
        key = source["fieldPath"].removeprefix("data.")
        assert key in settings, f"cluster.env has no {key}"
        for target in replacement["targets"]:
            objects = selected(ALL_LOCAL, target["select"])
            assert objects, f"replacement of {key}: nothing matches {target['select']}"
            for obj in objects:
                for path in target["fieldPaths"]:
                    placeholder = resolve(obj, path)
                    assert placeholder == key, f"{obj['kind']}/{obj['metadata']['name']} {path}: {placeholder}"
                    targets_hit += 1
    # Every placeholder left in the local manifests is one that a replacement fills in.
    placeholders = set(settings) & set(re.findall(r"\b[A-Z][A-Z0-9_]{3,}\b", json.dumps(ALL_LOCAL)))
    replaced = {r["source"]["fieldPath"].removeprefix("data.") for r in spec["replacements"]}
    assert placeholders <= replaced, f"placeholders never replaced: {sorted(placeholders - replaced)}"
    assert targets_hit >= 15


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def built_overlay(tmp_path_factory) -> list[dict]:
    """`kustomize build` of the example overlay with the remote resources replaced by stubs (offline)."""
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed; test_overlay_replacements_resolve_offline "
                    "checked the kustomizations with this file's own resolver")
    tree = tmp_path_factory.mktemp("manifests") / "manifests"
    shutil.copytree(MANIFESTS, tree, ignore=shutil.ignore_patterns("rendered"))
    for number, (ref, objects) in enumerate(REMOTE_PROVIDES.items()):
        for kfile in tree.rglob("kustomization.yaml"):
            text = kfile.read_text()
            if ref in text:
                stub = f"remote-stub-{number}.yaml"
                (kfile.parent / stub).write_text(yaml.safe_dump_all(objects))
                kfile.write_text(text.replace(ref, stub))
    result = subprocess.run([*command, str(tree / "overlays" / "example")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def test_overlay_builds_with_every_cluster_value_in_place(built_overlay):
    settings = cluster_env()
    text = json.dumps(built_overlay)
    for name in settings:
        assert not re.search(rf"\b{name}\b", text), f"placeholder {name} survived the build"
    assert not [d for d in built_overlay if d["metadata"]["name"] == "moerl-cluster-settings"]
    workflow_sa = one(built_overlay, "ServiceAccount", "moerl-workflow")
    assert workflow_sa["metadata"]["namespace"] == "moerl"
    assert workflow_sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == settings["WORKFLOW_ROLE_ARN"]
    server_sa = one(built_overlay, "ServiceAccount", "argo-server")
    assert server_sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == settings["ARGO_SERVER_ROLE_ARN"]
    for pool in docs_of_kind(built_overlay, "NodePool"):
        zone = resolve(pool, "spec.template.spec.requirements.[key=topology.kubernetes.io/zone].values")
        assert zone == [settings["ZONE"]]
    trainer = one(built_overlay, "NodePool", "moerl-trainer")
    types = resolve(trainer, "spec.template.spec.requirements.[key=node.kubernetes.io/instance-type].values")
    assert types == [settings["TRAINER_INSTANCE_TYPE"]]
    for node_class in docs_of_kind(built_overlay, "EC2NodeClass"):
        assert node_class["spec"]["role"] == settings["NODE_ROLE"]
        assert node_class["spec"]["amiSelectorTerms"] == [{"alias": settings["AMI_ALIAS"]}]
        for term in node_class["spec"]["subnetSelectorTerms"] + node_class["spec"]["securityGroupSelectorTerms"]:
            assert term["tags"]["karpenter.sh/discovery"] == settings["CLUSTER_NAME"]
    repo_map = one(built_overlay, "ConfigMap", "artifact-repositories")
    assert repo_map["metadata"]["namespace"] == "moerl"
    default_key = repo_map["metadata"]["annotations"]["workflows.argoproj.io/default-artifact-repository"]
    assert yaml.safe_load(repo_map["data"][default_key])["s3"]["bucket"] == settings["RUN_BUCKET"]
    controller = one(built_overlay, "Deployment", "workflow-controller")
    env = {e["name"] for e in controller["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {"ARGO_POD_STATUS_CAPTURE_FINALIZER", "TRANSIENT_ERROR_PATTERN"} <= env
    namespaced = [d for d in built_overlay if d["kind"] not in
                  {"Namespace", "PriorityClass", "NodePool", "EC2NodeClass"}]
    assert all(d["metadata"].get("namespace") for d in namespaced)


def test_built_overlay_validates(built_overlay):
    for doc in built_overlay:
        validate_object(doc)


# --- schemas ---------------------------------------------------------------------------------------------


def karpenter_problems(doc: dict, node_classes: set[str]) -> list[str]:
    """The fields karpenter.sh/v1 and karpenter.k8s.aws/v1 CRDs (Karpenter 1.14) require."""
    problems = []
    spec = doc.get("spec") or {}
    if doc["kind"] == "NodePool":
        if doc["apiVersion"] != "karpenter.sh/v1":
            problems.append(f"apiVersion {doc['apiVersion']}")
        template_spec = (spec.get("template") or {}).get("spec") or {}
        ref = template_spec.get("nodeClassRef") or {}
        if set(ref) != {"group", "kind", "name"}:
            problems.append(f"nodeClassRef needs group, kind and name: {ref}")
        elif (ref["group"], ref["kind"]) != ("karpenter.k8s.aws", "EC2NodeClass") or ref["name"] not in node_classes:
            problems.append(f"nodeClassRef to an EC2NodeClass that is not defined: {ref}")
        requirements = template_spec.get("requirements")
        if not requirements:
            problems.append("no requirements")
        for requirement in requirements or []:
            if not {"key", "operator"} <= set(requirement):
                problems.append(f"requirement without key/operator: {requirement}")
            if requirement.get("operator") in {"In", "NotIn", "Gt", "Lt"} and not requirement.get("values"):
                problems.append(f"requirement without values: {requirement}")
        for taint in template_spec.get("taints", []):
            if not {"key", "effect"} <= set(taint) or taint["effect"] not in {"NoSchedule", "PreferNoSchedule",
                                                                               "NoExecute"}:
                problems.append(f"bad taint {taint}")
        disruption = spec.get("disruption") or {}
        if disruption and "consolidateAfter" not in disruption:
            problems.append("disruption without consolidateAfter")
        if disruption.get("consolidationPolicy") not in {None, "WhenEmpty", "WhenEmptyOrUnderutilized"}:
            problems.append(f"consolidationPolicy {disruption.get('consolidationPolicy')}")
        for duration in [template_spec.get("expireAfter"), disruption.get("consolidateAfter")]:
            if duration is not None and not re.fullmatch(r"(([0-9]+(s|m|h))+|Never)", duration):
                problems.append(f"duration {duration}")
    elif doc["kind"] == "EC2NodeClass":
        if doc["apiVersion"] != "karpenter.k8s.aws/v1":
            problems.append(f"apiVersion {doc['apiVersion']}")
        for required in ["amiSelectorTerms", "subnetSelectorTerms", "securityGroupSelectorTerms"]:
            if not spec.get(required):
                problems.append(f"{required} missing or empty")
        if ("role" in spec) == ("instanceProfile" in spec):
            problems.append("exactly one of role and instanceProfile")
        for term in spec.get("amiSelectorTerms", []):
            if "alias" in term and not re.fullmatch(r"[a-z0-9]+@(latest|v\d{8})|AMI_ALIAS", term["alias"]):
                problems.append(f"alias {term['alias']}")
        root = [b for b in spec.get("blockDeviceMappings", []) if b.get("rootVolume")]
        if len(root) > 1:
            problems.append("more than one root volume")
    else:
        problems.append(f"unexpected Karpenter kind {doc['kind']}")
    return problems


def validate_object(doc: dict) -> None:
    group = api_group(doc)
    if doc["apiVersion"] == KUSTOMIZE_API:
        return
    if group in {"karpenter.sh", "karpenter.k8s.aws"}:
        names = {d["metadata"]["name"] for d in ALL_LOCAL if d["kind"] == "EC2NodeClass"}
        problems = karpenter_problems(doc, names)
        assert not problems, f"{doc['kind']}/{doc['metadata']['name']}: {problems}"
    elif group in CRD_GROUPS:
        raise AssertionError(f"{doc['kind']} of {group}: no check for it in this file")
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    "doc", ALL_LOCAL, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_each_object_validates(doc):
    validate_object(doc)


def test_validation_is_not_vacuous():
    broken_daemonset = copy.deepcopy(one(ALL_LOCAL, "DaemonSet", "nvidia-device-plugin"))
    broken_daemonset["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        validate_object(broken_daemonset)
    broken_pool = copy.deepcopy(one(ALL_LOCAL, "NodePool", "moerl-rollout"))
    del broken_pool["spec"]["template"]["spec"]["nodeClassRef"]["group"]
    with pytest.raises(AssertionError, match="nodeClassRef"):
        validate_object(broken_pool)


def test_artifact_repository_is_an_argo_s3_repository_on_the_run_prefix_with_irsa():
    repository = load_docs(OVERLAY / "artifact-repository.yaml")[0]
    errors = list(argo_validator("ArtifactRepository").iter_errors(repository))
    assert not errors, [e.message for e in errors]
    typo = copy.deepcopy(repository)
    typo["s3"]["bukcet"] = typo["s3"].pop("bucket")
    assert list(argo_validator("ArtifactRepository").iter_errors(typo))
    settings = cluster_env()
    s3 = repository["s3"]
    assert s3["bucket"] == settings["RUN_BUCKET"] and s3["region"] == settings["AWS_REGION"]
    assert s3["keyFormat"].startswith(settings["RUN_PREFIX"] + "/"), "artifacts must stay under the run prefix"
    assert s3["useSDKCreds"] is True and s3["insecure"] is False
    assert not {"accessKeySecret", "secretKeySecret", "sessionTokenSecret"} & set(s3), "no static keys"
    generator = [g for g in kustomization(OVERLAY)["configMapGenerator"] if g["name"] == "artifact-repositories"][0]
    assert generator["namespace"] == "moerl"
    default_key = generator["options"]["annotations"]["workflows.argoproj.io/default-artifact-repository"]
    assert generator["files"] == [f"{default_key}=artifact-repository.yaml"]


# --- what matters on Spot --------------------------------------------------------------------------------


def test_controller_restarts_failed_pods_and_captures_pod_status():
    configmap = load_docs(MANIFESTS / "argo" / "workflow-controller-configmap.yaml")[0]
    restart = yaml.safe_load(configmap["data"]["failedPodRestart"])
    assert restart["enabled"] is True and 1 <= restart["maxRestarts"] <= 10
    deployment = load_docs(MANIFESTS / "argo" / "workflow-controller-deployment.yaml")[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "workflow-controller"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ARGO_POD_STATUS_CAPTURE_FINALIZER"] == "true"
    pattern = re.compile(env["TRANSIENT_ERROR_PATTERN"])
    # The messages a reclaimed Spot node leaves on a node (docs/contracts.md), and what they must not swallow.
    for message in ["pod deleted", "Pod was terminated in response to imminent node shutdown.",
                    "The node was low on resource: memory.", "Pod The node had condition: [DiskPressure]. Evicted"]:
        assert pattern.search(message), message
    for message in ["Error (exit code 1)", "Error (exit code 2)", "OOMKilled (exit code 137)"]:
        assert not pattern.search(message), message


def test_node_pools_place_each_role_where_it_belongs():
    pools = {p["metadata"]["name"]: p for p in docs_of_kind(ALL_LOCAL, "NodePool")}
    assert set(pools) == {"moerl-trainer", "moerl-rollout", "moerl-cpu", "moerl-memory"}

    def requirement(pool: str, key: str) -> list[str]:
        return resolve(pools[pool], f"spec.template.spec.requirements.[key={key}].values")

    # Karpenter labels nodes launched into a capacity reservation (ODCR, Capacity Block) `reserved`
    assert requirement("moerl-trainer", "karpenter.sh/capacity-type") == ["reserved", "on-demand"]
    assert requirement("moerl-rollout", "karpenter.sh/capacity-type") == ["spot"]
    assert requirement("moerl-memory", "karpenter.sh/capacity-type") == ["on-demand"]
    assert requirement("moerl-memory", "karpenter.k8s.aws/instance-family") == ["r7i"]
    assert set(requirement("moerl-rollout", "node.kubernetes.io/instance-type")) >= {"p5en.48xlarge",
                                                                                      "p6-b200.48xlarge"}
    node_classes = {c["metadata"]["name"]: c for c in docs_of_kind(ALL_LOCAL, "EC2NodeClass")}
    trainer_class = node_classes[pools["moerl-trainer"]["spec"]["template"]["spec"]["nodeClassRef"]["name"]]
    assert "vm.nr_hugepages" in trainer_class["spec"]["userData"], "EFA's huge pages are reserved at boot"
    assert "PeerMappingOverride=1" in trainer_class["spec"]["userData"], "EFA GPUDirect (NCCL GIN) needs it"
    assert trainer_class["spec"]["capacityReservationSelectorTerms"], "ODCRs and Capacity Blocks are selected"
    assert trainer_class["spec"]["associatePublicIPAddress"] is False, "multi-EFA launches refuse public IPs"
    for name, pool in pools.items():
        zone = requirement(name, "topology.kubernetes.io/zone")
        assert zone == ["ZONE"], f"{name}: one Availability Zone, the overlay's"
        template = pool["spec"]["template"]
        role = template["metadata"]["labels"]["moerl.io/pool"]
        assert name == f"moerl-{role}"
        taints = {(t["key"], t.get("value")) for t in template["spec"].get("taints", [])}
        assert (("moerl.io/pool", role) in taints) == (name != "moerl-cpu"), f"{name}: {taints}"
        gpu = name in {"moerl-trainer", "moerl-rollout"}
        assert (("nvidia.com/gpu", None) in taints) == gpu
        assert ("nvidia.com/gpu" in pool["spec"]["limits"]) == gpu
    assert pools["moerl-trainer"]["spec"]["template"]["spec"]["expireAfter"] == "Never"
    assert pools["moerl-trainer"]["spec"]["disruption"]["consolidationPolicy"] == "WhenEmpty"


def test_trainer_instance_type_choices_are_the_efa_gpu_instances():
    text = (OVERLAY / "cluster.env").read_text()
    assert cluster_env()["TRAINER_INSTANCE_TYPE"] in {"p5en.48xlarge", "p6-b200.48xlarge"}
    assert "p6-b200.48xlarge" in text
    efa_plugin = one(ALL_LOCAL, "DaemonSet", "aws-efa-k8s-device-plugin")
    types = resolve(efa_plugin, "spec.template.spec.affinity.nodeAffinity."
                                "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0."
                                "matchExpressions.[key=node.kubernetes.io/instance-type].values")
    rollout = one(ALL_LOCAL, "NodePool", "moerl-rollout")
    rollout_types = resolve(rollout, "spec.template.spec.requirements.[key=node.kubernetes.io/instance-type].values")
    assert set(rollout_types) | {"p5en.48xlarge", "p6-b200.48xlarge"} <= set(types)


def test_priority_classes_put_the_trainer_first_and_spot_steps_last():
    classes = {c["metadata"]["name"]: c for c in docs_of_kind(ALL_LOCAL, "PriorityClass")}
    assert set(classes) == {"moerl-trainer", "moerl-control", "moerl-spot"}
    values = {name: c["value"] for name, c in classes.items()}
    assert values["moerl-trainer"] > values["moerl-control"] > values["moerl-spot"]
    assert classes["moerl-spot"]["preemptionPolicy"] == "Never"
    assert not any(c.get("globalDefault") for c in classes.values())


def test_semaphore_bounds_concurrent_runs():
    semaphores = one(ALL_LOCAL, "ConfigMap", "moerl-semaphores")
    assert int(semaphores["data"]["runs"]) >= 1


def test_rbac_gives_the_executor_exactly_what_argo_documents():
    roles = {r["metadata"]["name"]: r for r in docs_of_kind(ALL_LOCAL, "Role")}
    assert roles["moerl-executor"]["rules"] == [
        {"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"], "verbs": ["create", "patch"]}
    ]
    for role in roles.values():
        for rule in role["rules"]:
            for field_name in ["apiGroups", "resources", "verbs"]:
                assert "*" not in rule[field_name], f"{role['metadata']['name']}: wildcard {field_name}"
    bindings = {b["metadata"]["name"]: b for b in docs_of_kind(ALL_LOCAL, "RoleBinding")}
    bound = {(b["roleRef"]["name"], s["name"]) for b in bindings.values() for s in b["subjects"]}
    assert {("moerl-executor", "moerl-workflow"), ("moerl-pytorchjobs", "moerl-workflow"),
            ("moerl-submitter", "moerl-submitter")} <= bound
    accounts = {a["metadata"]["name"] for a in docs_of_kind(ALL_LOCAL, "ServiceAccount")}
    assert all(s["name"] in accounts for b in bindings.values() for s in b["subjects"])
    assert one(ALL_LOCAL, "ServiceAccount", "moerl-workflow")["metadata"]["annotations"][
        "eks.amazonaws.com/role-arn"] == "WORKFLOW_ROLE_ARN"


def test_every_container_image_is_pinned():
    for doc in ALL_LOCAL:
        containers = (((doc.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers", [])
        for container in containers:
            if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "workflow-controller":
                continue  # a stub of the remote install: its real image is pinned by the release
            image = container["image"]
            tag = image.rpartition(":")[2]
            assert "/" not in tag and tag not in {"", "latest"}, f"{doc['metadata']['name']}: {image}"


def test_rendered_manifests_stay_out_of_git():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    result = subprocess.run(["git", "check-ignore", "-q", "manifests/rendered/workflow-template.yaml"],
                            cwd=REPO, timeout=30)
    assert result.returncode == 0, "manifests/rendered/ (moerl render output) must be git-ignored"


# --- IAM -------------------------------------------------------------------------------------------------

RUN_OBJECT_ACTIONS = {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"}


def filled_policy(name: str) -> dict:
    """The policy as docs/eks.md fills it: envsubst of RUN_BUCKET and RUN_PREFIX from cluster.env."""
    template = string.Template((MANIFESTS / "iam" / name).read_text())
    settings = cluster_env()
    return json.loads(template.substitute(RUN_BUCKET=settings["RUN_BUCKET"], RUN_PREFIX=settings["RUN_PREFIX"]))


def policy_problems(policy: dict, allowed_object_actions: set[str]) -> list[str]:
    settings = cluster_env()
    bucket_arn = f"arn:aws:s3:::{settings['RUN_BUCKET']}"
    prefix_arn = f"{bucket_arn}/{settings['RUN_PREFIX']}/*"
    problems = []
    for statement in policy["Statement"]:
        if statement.get("Effect") != "Allow" or {"NotAction", "NotResource", "NotPrincipal"} & set(statement):
            problems.append(f"unexpected statement form {statement}")
            continue
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        for action in actions:
            if "*" in action:
                problems.append(f"wildcard action {action}")
        for resource in resources:
            if "*" in resource.removesuffix("/*") or not resource.startswith(bucket_arn):
                problems.append(f"wildcard or foreign resource {resource}")
        if set(actions) <= allowed_object_actions:
            if resources != [prefix_arn]:
                problems.append(f"object actions on {resources}, not on {prefix_arn}")
        elif actions == ["s3:ListBucket"]:
            condition = statement.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
            prefixes = condition if isinstance(condition, list) else [condition]
            if resources != [bucket_arn] or not condition or not all(
                p in {settings["RUN_PREFIX"], settings["RUN_PREFIX"] + "/*"} for p in prefixes
            ):
                problems.append(f"ListBucket not limited to the run prefix: {statement}")
        else:
            problems.append(f"actions beyond the run store: {actions}")
    return problems


def test_run_policy_grants_read_write_on_the_run_prefix_only():
    policy = filled_policy("moerl-run-policy.json")
    assert policy_problems(policy, RUN_OBJECT_ACTIONS) == []
    granted = {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert granted == RUN_OBJECT_ACTIONS | {"s3:ListBucket"}


def test_argo_server_policy_is_read_only():
    policy = filled_policy("moerl-argo-server-policy.json")
    assert policy_problems(policy, {"s3:GetObject"}) == []


@pytest.mark.parametrize("mutation", ["s3:*", "wildcard-resource", "unconditioned-list", "iam"])
def test_policy_check_rejects_broad_grants(mutation):
    policy = filled_policy("moerl-run-policy.json")
    statement = policy["Statement"][0]
    if mutation == "s3:*":
        statement["Action"] = ["s3:*"]
    elif mutation == "wildcard-resource":
        statement["Resource"] = "arn:aws:s3:::*"
    elif mutation == "unconditioned-list":
        del policy["Statement"][1]["Condition"]
    else:
        statement["Action"] = ["iam:PassRole"]
    assert policy_problems(policy, RUN_OBJECT_ACTIONS)


# --- the run config and the rendered workflow against these manifests -----------------------------------

EKS_CONFIG = REPO / "configs" / "eks-p5en.yaml"


def tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for toleration in tolerations:
        if toleration.get("key") != taint["key"] or toleration.get("effect", taint["effect"]) != taint["effect"]:
            continue
        if toleration.get("operator", "Equal") == "Exists" or toleration.get("value") == taint.get("value"):
            return True
    return False


def test_eks_reference_config_fits_these_manifests():
    """configs/eks-p5en.yaml places each role on a pool, priority class, service account and semaphore
    that these manifests create, tolerates that pool's taints, and asks for no more huge pages than the
    trainer nodes reserve."""
    if not EKS_CONFIG.exists():
        pytest.skip("configs/eks-p5en.yaml does not exist yet")
    config = yaml.safe_load(EKS_CONFIG.read_text())
    settings = cluster_env()
    assert config["namespace"] == "moerl"
    accounts = {a["metadata"]["name"] for a in docs_of_kind(ALL_LOCAL, "ServiceAccount")}
    assert config["service_account"] in accounts
    semaphore = config["argo"]["semaphore"]
    semaphores = one(ALL_LOCAL, "ConfigMap", "moerl-semaphores")
    assert (semaphore["config_map"], semaphore["key"]) == ("moerl-semaphores", "runs"), (
        f"the config's semaphore {semaphore} is not manifests/moerl/semaphores.yaml (moerl-semaphores/runs)"
    )
    assert semaphore["key"] in semaphores["data"]
    classes = {c["metadata"]["name"] for c in docs_of_kind(ALL_LOCAL, "PriorityClass")}
    pools = {p["metadata"]["name"]: p for p in docs_of_kind(ALL_LOCAL, "NodePool")}
    for role, placement in config["placement"].items():
        assert placement["priority_class"] in classes, f"{role}: priority class {placement['priority_class']}"
        selector = placement["node_selector"]
        pool = pools[selector["karpenter.sh/nodepool"]]
        requirements = {r["key"]: r.get("values", []) for r in pool["spec"]["template"]["spec"]["requirements"]}
        for key, value in selector.items():
            if key == "topology.kubernetes.io/zone":
                assert value == settings["ZONE"], f"{role}: zone {value}, cluster.env says {settings['ZONE']}"
            elif key == "node.kubernetes.io/instance-type" and requirements.get(key) == ["TRAINER_INSTANCE_TYPE"]:
                assert value in {"p5en.48xlarge", "p6-b200.48xlarge"}
            elif key in requirements:
                assert value in requirements[key], f"{role}: {key}={value} never matches {pool['metadata']['name']}"
        for taint in pool["spec"]["template"]["spec"].get("taints", []):
            assert tolerated(taint, placement.get("tolerations", [])), f"{role}: does not tolerate {taint}"
        limits = placement.get("resources", {}).get("limits", {})
        if "vpc.amazonaws.com/efa" in limits:
            assert pool["metadata"]["name"] == "moerl-trainer", f"{role}: EFA outside the trainer pool"
        if "hugepages-2Mi" in limits:
            node_class = one(ALL_LOCAL, "EC2NodeClass", pool["spec"]["template"]["spec"]["nodeClassRef"]["name"])
            pages = int(re.search(r"vm.nr_hugepages = (\d+)", node_class["spec"].get("userData", "")).group(1))
            asked = limits["hugepages-2Mi"]
            asked_mib = int(asked.removesuffix("Mi")) if asked.endswith("Mi") else int(asked.removesuffix("Gi")) * 1024
            assert asked_mib <= pages * 2, f"{role}: asks {asked} of huge pages, nodes reserve {pages * 2}Mi"
    for role, image in config["images"].items():
        assert image.rpartition("/")[2].startswith(f"moerl-{role}:"), f"{role}: {image} (make images names)"


@pytest.mark.parametrize("config", ["eks-p5en.yaml", "eks-p5en-235b.yaml"])
def test_rendered_eks_workflow_fits_these_manifests(tmp_path, config):
    """When `moerl render` exists, the WorkflowTemplate and CronWorkflow it renders from each EKS reference
    config validate against Argo's schema and refer only to what these manifests create."""
    path = REPO / "configs" / config
    if not path.exists():
        pytest.skip(f"configs/{config} does not exist yet")
    result = subprocess.run(
        [sys.executable, "-c", "from pipelines.cli import main; main()", "render", str(path),
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )
    if result.returncode != 0 and "invalid choice: 'render'" in result.stderr:
        pytest.skip("`moerl render` is not available yet")
    assert result.returncode == 0, result.stderr
    rendered = [d for p in sorted(tmp_path.glob("*.yaml")) if p.name != "kfp-pipeline.yaml" for d in load_docs(p)]
    argo = [d for d in rendered if api_group(d) == "argoproj.io"]
    assert {d["kind"] for d in argo} >= {"WorkflowTemplate", "CronWorkflow"}
    for doc in argo:
        errors = list(argo_validator(doc["kind"]).iter_errors(doc))
        assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors][:5]
    text = json.dumps(argo)
    accounts = {a["metadata"]["name"] for a in docs_of_kind(ALL_LOCAL, "ServiceAccount")}
    for account in set(re.findall(r'"serviceAccountName": "([^"]+)"', text)):
        assert account in accounts, f"service account {account} is not in manifests/moerl"
    classes = {c["metadata"]["name"] for c in docs_of_kind(ALL_LOCAL, "PriorityClass")}
    for priority_class in set(re.findall(r'"priorityClassName": "([^"]+)"', text)):
        assert priority_class in classes, f"priority class {priority_class} is not in manifests/moerl"
    pools = {p["metadata"]["name"] for p in docs_of_kind(ALL_LOCAL, "NodePool")}
    for pool in set(re.findall(r'"karpenter.sh/nodepool": "([^"]+)"', text)):
        assert pool in pools, f"node selector karpenter.sh/nodepool={pool} matches no NodePool"
    for name, key in re.findall(r'"configMapKeyRef": \{"name": "([^"]+)", "key": "([^"]+)"\}', text):
        assert key in one(ALL_LOCAL, "ConfigMap", name)["data"], f"semaphore {name}/{key}"
    for namespace in set(re.findall(r'"namespace": "([^"]+)"', text)):
        assert namespace == "moerl"


def test_docs_name_the_versions_the_manifests_pin():
    docs = (REPO / "docs" / "eks.md").read_text()
    assert "Argo Workflows v4.1.2" in docs and "/download/v4.1.2/" in ARGO_INSTALL
    assert "training operator v1.9.4" in docs and TRAINING_OPERATOR.endswith("ref=v1.9.4")
    plugin_images = {c["image"].rpartition(":")[2] for d in docs_of_kind(ALL_LOCAL, "DaemonSet")
                     for c in d["spec"]["template"]["spec"]["containers"]}
    assert plugin_images == {"v0.20.0", "v0.5.20"}
    assert "NVIDIA device plugin v0.20.0" in docs and "EFA device plugin v0.5.20" in docs
    assert "KARPENTER_VERSION=1.14.1" in docs and "Karpenter 1.14" in (MANIFESTS / "karpenter" /
                                                                       "kustomization.yaml").read_text()
    for step in ["kubectl apply --server-side -k manifests/overlays/", "moerl render",
                 "--out manifests/rendered", "port-forward svc/argo-server", "create-capacity-reservation",
                 "--role-only"]:
        assert step in docs, step


def _verbs_the_workflows_need() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every API call the workflow's service account makes, read off the
    rendered manifests of the EKS config: Argo's executor reports through WorkflowTaskResults
    (workflow-rbac.md); a resource template runs `kubectl <action>` (resource.go; delete adds --wait, which
    gets and watches the object) and, with success/failure conditions, GETs the object until one holds;
    KFP's update launcher creates, gets and deletes the PyTorchJob."""
    from pipelines.config import load_config
    from pipelines.workflow.build import workflow_templates

    plural = {"PyTorchJob": ("kubeflow.org", "pytorchjobs"), "Workflow": ("argoproj.io", "workflows"),
              "CronWorkflow": ("argoproj.io", "cronworkflows")}  # fmt: skip
    needed = {("argoproj.io", "workflowtaskresults", "create"), ("argoproj.io", "workflowtaskresults", "patch")}
    cfg = load_config(REPO / "configs" / "eks-p5en.yaml").model_copy(update={"iterations": 45})
    for template in workflow_templates(cfg):
        for t in template.to_dict()["spec"]["templates"]:
            resource = t.get("resource")
            if resource is None:
                continue
            group, resources = plural[yaml.safe_load(re.sub(r"\{\{[^}]*\}\}", "x", resource["manifest"]))["kind"]]
            needed.add((group, resources, resource["action"]))
            if resource["action"] == "delete" and "--wait=true" in resource.get("flags", []):
                needed |= {(group, resources, "get"), (group, resources, "watch")}
            if resource.get("successCondition") or resource.get("failureCondition") or t.get("outputs"):
                needed.add((group, resources, "get"))  # the wait polls it; output parameters kubectl-get it
    needed |= {("kubeflow.org", "pytorchjobs", v) for v in ("create", "get", "delete")}  # KFP's launcher
    return needed


def test_rbac_grants_the_workflow_every_verb_its_templates_need():
    roles = {r["metadata"]["name"]: r for r in docs_of_kind(ALL_LOCAL, "Role")}
    bound = [b["roleRef"]["name"] for b in docs_of_kind(ALL_LOCAL, "RoleBinding")
             if any(s["name"] == "moerl-workflow" for s in b["subjects"])]  # fmt: skip
    granted = {(g, r, v) for name in bound for rule in roles[name]["rules"]
               for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip
    needed = _verbs_the_workflows_need()
    assert ("argoproj.io", "workflows", "create") in needed  # next-segment: a run longer than a segment
    assert ("argoproj.io", "cronworkflows", "get") in needed  # next-segment: is there a cron to belong to
    assert needed - granted == set()


def test_gdrcopy_reaches_the_trainer_without_a_host_path():
    """NCCL GIN (DeepEP across nodes) opens /dev/gdrdrv; Pod Security baseline forbids hostPath volumes, so
    the NVIDIA container toolkit injects the device: the device plugin asks for it for every GPU container,
    and the trainer image asks for it too."""
    plugin = one(ALL_LOCAL, "DaemonSet", "nvidia-device-plugin")
    env = {e["name"]: e["value"] for e in plugin["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    assert env.get("GDRCOPY_ENABLED") == "true"
    assert "NVIDIA_GDRCOPY=enabled" in (REPO / "images" / "trainer" / "Dockerfile").read_text()
    namespace = one(ALL_LOCAL, "Namespace", "moerl")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    from pipelines.config import load_config
    from pipelines.workflow import pytorchjob

    job = pytorchjob.manifest(load_config(REPO / "configs" / "eks-p5en.yaml"), "1")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        assert not any("hostPath" in v for v in replica["template"]["spec"].get("volumes", []))
