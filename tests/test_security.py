"""Security properties of moerl:

- nothing is ever unpickled: no torch.load without weights_only=True, no pickle/cPickle/dill/joblib/cloudpickle
  /shelve, no np.load(allow_pickle=True), no yaml.load without a safe loader, no from_pretrained with remote code
  or without use_safetensors in the code that runs in pods (an AST scan of every Python source of the project);
- object keys cannot escape the run prefix: every key-taking Store method refuses a key that would, on local disk
  and on S3, and keys planted by someone else in a bucket or a manifest are never followed out of it;
- no secret lands in rendered YAML or in logs: rendering, and a whole local run, with AWS_SECRET_ACCESS_KEY,
  AWS_SESSION_TOKEN and ARGO_TOKEN set to a marker, leave the marker in no file and no output;
- the pods run as non-root with a read-only root filesystem (the rendered workflow's securityContext).

The IAM policies in manifests/iam are checked for least privilege in tests/test_manifests.py
(test_run_policy_grants_read_write_on_the_run_prefix_only, test_argo_server_policy_is_read_only,
test_policy_check_rejects_broad_grants); not repeated here.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
import yaml
from faults_helpers import SECRET_ENV, SECRET_MARKER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipelines.cli
from pipelines.workflow import argo_objects, workflow
from pipelines.workflow.pytorchjob import manifest as pytorchjob_manifest
from pipelines.workflow.pytorchjob import trainer_server_manifest
from steps.errors import MoerlError
from steps.run import candidate, checkpoint
from steps.run.candidate import MARKER
from steps.run.config import validate_config
from steps.run.keys import candidate_prefix
from steps.store.object_store import Store

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("steps", "pipelines", "tests", "bench", "images")
POD_CODE = ("steps", "pipelines")  # what runs on users' inputs, in pods or the CLI

# --- nothing unpickled ------------------------------------------------------------------------------------

PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loads(source: str, pod_code: bool) -> list[tuple[int, str]]:
    """(line, what) for every way `source` could unpickle or run foreign code while loading data."""
    tree = ast.parse(source)
    # Module-level names bound to safe loaders only (LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)).
    safe_names = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and (names := set(re.findall(r"\b\w*Loader\b", ast.unparse(node.value))))
        and names <= SAFE_YAML_LOADERS
        for target in node.targets
        if isinstance(target, ast.Name)
    }  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names):
            found.append((node.lineno, "from torch import load"))
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            if name.endswith("torch.load") and not is_true(keyword(node, "weights_only")):
                found.append((node.lineno, "torch.load without weights_only=True"))
            elif name in ("np.load", "numpy.load") and is_true(keyword(node, "allow_pickle")):
                found.append((node.lineno, f"{name}(allow_pickle=True)"))
            elif name.endswith(("read_pickle", "yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all")):
                found.append((node.lineno, name))
            elif name in ("yaml.load", "yaml.load_all"):
                loader = keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                safe = SAFE_YAML_LOADERS | safe_names
                if loader is None or dotted(loader).rsplit(".", 1)[-1] not in safe:
                    found.append((node.lineno, f"{name} without a safe Loader"))
            elif name.endswith("from_pretrained") and is_true(keyword(node, "trust_remote_code")):
                found.append((node.lineno, "from_pretrained(trust_remote_code=True)"))
            elif pod_code and name.endswith("from_pretrained") and "Model" in name.split(".")[-2:][0]:
                if not is_true(keyword(node, "use_safetensors")):
                    found.append((node.lineno, f"{name} without use_safetensors=True (falls back to pickles)"))
    return found


def project_sources() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py") if ".venv" not in p.parts)


def test_nothing_is_unpickled_anywhere():
    sources = project_sources()
    assert len(sources) > 50 and REPO / "steps" / "models" / "qwen3_moe" / "model.py" in sources
    problems = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for path in sources
        for line, what in unsafe_loads(path.read_text(), path.relative_to(REPO).parts[0] in POD_CODE)
    ]
    assert problems == []


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import dill as d",
        "from joblib import load",
        "from torch import load",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import pandas as pd\npd.read_pickle(f)",
        "import yaml\nyaml.load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.Loader)",
        "import yaml\nyaml.unsafe_load(text)",
        "import yaml\nLOADER = yaml.Loader\nyaml.load(text, Loader=LOADER)",
        "from transformers import AutoModel\nAutoModel.from_pretrained(d, trust_remote_code=True)",
        "from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained(d)",
    ],
)
def test_the_scan_finds_each_way_of_unpickling(snippet):
    assert unsafe_loads(snippet, pod_code=True), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import numpy as np\nnp.load(f)",
        "import yaml\nyaml.safe_load(text)\nyaml.load(text, Loader=yaml.SafeLoader)",
        "import yaml\nLOADER = getattr(yaml, 'CSafeLoader', yaml.SafeLoader)\nyaml.load(text, Loader=LOADER)",
        "from transformers import AutoModel\nAutoModel.from_pretrained(d, use_safetensors=True)",
        "from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained(d)",
        "s = 'import pickle; torch.load(f)'",  # text, not code
    ],
)
def test_the_scan_passes_safe_loading(snippet):
    assert unsafe_loads(snippet, pod_code=True) == []


# --- keys cannot escape the run prefix --------------------------------------------------------------------

ESCAPING_KEYS = ["../x", "a/../../x", "/etc/passwd", "a/./b", "./a", "a//b", "a/", "a\\..\\x", "..", ".", "",
                 "a\x00b", ".moerl-sha256-x", "a/.moerl-tmp-1"]  # fmt: skip
PREFIX_OPERATIONS = ("child", "list", "delete_prefix", "upload_dir", "download_dir")  # these take 'a/' too


def key_operations(store: Store, key: str, tmp_path: Path) -> dict:
    local = tmp_path / "file"
    local.write_bytes(b"x")
    (tmp_path / "dir").mkdir(exist_ok=True)
    (tmp_path / "dir" / "f").write_bytes(b"x")
    return {
        "put_bytes": lambda: store.put_bytes(key, b"x"),
        "put_file": lambda: store.put_file(key, local),
        "put_json": lambda: store.put_json(key, {}),
        "get_bytes": lambda: store.get_bytes(key),
        "get_file": lambda: store.get_file(key, tmp_path / "out"),
        "exists": lambda: store.exists(key),
        "size": lambda: store.size(key),
        "sha256": lambda: store.sha256(key),
        "delete": lambda: store.delete(key),
        "url": lambda: store.url(key),
        "child": lambda: store.child(key),
        "list": lambda: store.list(key or "/"),
        "delete_prefix": lambda: store.delete_prefix(key or "/"),
        "upload_dir": lambda: store.upload_dir(tmp_path / "dir", key or "/"),
        "download_dir": lambda: store.download_dir(key or "/", tmp_path / "down"),
    }


@pytest.mark.parametrize("key", ESCAPING_KEYS)
def test_no_store_operation_takes_a_key_that_leaves_the_root(key, tmp_path):
    root, outside = tmp_path / "sandbox" / "run", tmp_path / "sandbox"
    root.mkdir(parents=True)
    store = Store.open(str(root))
    (tmp_path / "work").mkdir()
    for name, operation in key_operations(store, key, tmp_path / "work").items():
        if name in PREFIX_OPERATIONS and key == "a/":
            continue  # 'a/' is a valid directory prefix
        with pytest.raises(MoerlError, match="store (key|prefix|URI)|Store.child"):
            operation()
    assert [p.name for p in outside.iterdir()] == ["run"] and not any(root.iterdir())


@given(st.text(st.sampled_from("ab./\\\x00-_~%"), max_size=12))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_key_lands_inside_the_root_or_is_refused(tmp_path, key):
    root = tmp_path / "sandbox" / "run"
    root.mkdir(parents=True, exist_ok=True)
    store = Store.open(str(root))
    try:
        store.put_bytes(key, b"x")
    except MoerlError:
        return
    target = Path(os.path.realpath(root / key))
    assert target.is_relative_to(root.resolve()) and target != root.resolve(), key
    assert store.get_bytes(key) == b"x" and key in store.list()
    store.delete(key)


def test_s3_keys_stay_under_the_run_prefix(s3_env, tmp_path):
    bucket = s3_env.create_bucket()
    store = Store.open(f"s3://{bucket}/run")
    for i, key in enumerate(ESCAPING_KEYS):
        (tmp_path / str(i)).mkdir()
        for name, operation in key_operations(store, key, tmp_path / str(i)).items():
            if name in PREFIX_OPERATIONS and key == "a/":
                continue
            with pytest.raises(MoerlError):
                operation()
    store.child("a").put_bytes("b", b"x")
    assert [o["Key"] for o in s3_env.s3.list_objects_v2(Bucket=bucket)["Contents"]] == ["run/a/b"]


def test_keys_planted_in_the_bucket_are_never_followed_out_of_it(s3_env, tmp_path):
    """Someone else wrote keys with '..', '//' or reserved names under the prefix, or beside it: a store lists
    none of them and a download never writes outside its target directory."""
    bucket = s3_env.create_bucket()
    planted = ["run/../evil", "run/a/../../evil", "run//evil", "run/./evil", "run/.moerl-sha256-evil",
               "run2/evil", "runevil", "run", "run/ok"]  # fmt: skip
    for key in planted:
        s3_env.s3.put_object(Bucket=bucket, Key=key, Body=b"evil")
    store = Store.open(f"s3://{bucket}/run")
    assert store.list() == ["ok"]
    target = tmp_path / "sandbox" / "down"
    store.download_dir("", target)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "sandbox", "sandbox/down", "sandbox/down/ok"
    ]  # fmt: skip


def test_a_manifest_that_names_files_outside_its_version_is_refused(tmp_path):
    run = Store.open(str(tmp_path / "run"))
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "config.json").write_text("{}")
    checkpoint.publish_dir(run, tmp_path / "v1", version=1, parent=0, iteration=1)
    manifest = run.get_json("checkpoints/v000001/MANIFEST.json")
    for name in ("../../../evil", "/etc/passwd", "a/../../evil"):
        manifest["files"] = {name: {"size": 4, "sha256": "0" * 64}}
        run.put_json("checkpoints/v000001/MANIFEST.json", manifest)
        with pytest.raises(MoerlError, match="store key"):
            checkpoint.download(run, 1, tmp_path / "sandbox" / "v1")
    assert not (tmp_path / "evil").exists() and not list((tmp_path / "sandbox").rglob("evil"))


def test_a_candidate_marker_that_names_files_outside_the_candidate_is_refused(tmp_path):
    run = Store.open(str(tmp_path / "run"))
    marker = {"iteration": 1, "parent": 0, "files": {"../../evil": {"size": 4, "sha256": "0" * 64}}}
    run.put_json(f"{candidate_prefix(1)}/{MARKER}", marker)
    with pytest.raises(MoerlError, match="store key"):
        candidate.download(run, 1, marker, tmp_path / "sandbox")
    assert not list(tmp_path.rglob("evil"))


# --- no secret in rendered YAML or in logs ------------------------------------------------------------------


def files_holding(directory: Path, marker: str) -> list[str]:
    return [str(p) for p in Path(directory).rglob("*") if p.is_file() and marker.encode() in p.read_bytes()]


def test_rendering_never_writes_a_secret(tmp_path, monkeypatch, capsys):
    for name in (*SECRET_ENV, "AWS_ACCESS_KEY_ID"):
        monkeypatch.setenv(name, SECRET_MARKER)
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump({"sft_checkpoint": "s3://moerl-bucket/sft", "run_store": "s3://moerl-bucket/runs/r1"})
    )
    with pytest.raises(SystemExit) as exit_:
        pipelines.cli.main(["render", str(config), "--skip-checks", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 0
    out = capsys.readouterr()
    assert files_holding(tmp_path / "out", SECRET_MARKER) == []
    assert SECRET_MARKER not in out.out + out.err
    assert len(list((tmp_path / "out").iterdir())) == 5


def test_the_argo_token_goes_to_the_server_connection_only(tmp_path):
    cfg = validate_config({"sft_checkpoint": "s3://moerl-bucket/sft", "run_store": "s3://moerl-bucket/runs/r1"})
    objects = argo_objects(cfg, host="https://argo.example:2746", token=SECRET_MARKER)
    texts = [o.to_yaml() for o in (*objects.templates, objects.workflow, objects.cron)]
    assert all(SECRET_MARKER not in text for text in texts)


def test_a_local_run_never_logs_a_secret(fault_free_run):
    """The fault-free run ran with the secret variables set to the marker: no step log, pod record, status or
    object of the run store holds it."""
    assert fault_free_run.result.succeeded
    assert (fault_free_run.result.run_dir / "pods").is_dir()
    assert files_holding(fault_free_run.work_dir, SECRET_MARKER) == []
    assert files_holding(fault_free_run.run_dir, SECRET_MARKER) == []
    logs = list(fault_free_run.work_dir.rglob("*.log"))
    assert len(logs) >= 2 * 8  # stdout and stderr of each of the run's pods were looked at


# --- pods: non-root, read-only root filesystem -----------------------------------------------------------------

ROLES_OF_TEMPLATES = {"plan": "control", "import-sft": "control", "rollout": "rollout", "score": "score",
                      "update": "trainer", "publish": "control", "report": "control"}  # fmt: skip


def pod_specs(cfg) -> dict[str, tuple[dict, dict, dict]]:
    """template name -> (pod-level securityContext, container, the template) of every pod the run creates."""
    manifest = workflow(cfg).to_dict()
    workflow_context = manifest["spec"].get("securityContext") or {}
    out = {}
    for template in manifest["spec"]["templates"]:
        if "container" in template:
            context = {**workflow_context, **(template.get("securityContext") or {})}
            out[template["name"]] = (context, template["container"], template)
    two_nodes = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"nodes": 2})})
    jobs = {"pytorchjob": pytorchjob_manifest(two_nodes, "1"),
            "trainer-server-job": trainer_server_manifest(two_nodes, "wf", "uid")}  # fmt: skip
    for kind, job in jobs.items():
        for replica, spec in job["spec"]["pytorchReplicaSpecs"].items():
            pod = spec["template"]["spec"]
            out[f"{kind}-{replica}"] = (pod.get("securityContext") or {}, pod["containers"][0], pod)
    return out


def writable_tmp(container: dict, template: dict) -> bool:
    """/tmp is a volume (the steps write temp files, the checkpoint cache and their outputs there)."""
    return any(m.get("mountPath") == "/tmp" for m in container.get("volumeMounts") or [])


def test_pods_run_as_non_root_with_a_read_only_root_filesystem():
    cfg = validate_config({"sft_checkpoint": "s3://moerl-bucket/sft", "run_store": "s3://moerl-bucket/runs/r1"})
    specs = pod_specs(cfg)
    assert set(ROLES_OF_TEMPLATES) <= set(specs)
    problems = []
    for name, (pod_context, container, template) in specs.items():
        context = container.get("securityContext") or {}
        if not (pod_context.get("runAsNonRoot") or context.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot is not true")
        if not context.get("readOnlyRootFilesystem"):
            problems.append(f"{name}: readOnlyRootFilesystem is not true")
        elif not writable_tmp(container, template):
            problems.append(f"{name}: read-only root filesystem without a /tmp volume")
        if context.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if "ALL" not in ((context.get("capabilities") or {}).get("drop") or []):
            problems.append(f"{name}: capabilities are not dropped")
        user = context.get("runAsUser", pod_context.get("runAsUser"))
        if not isinstance(user, int) or user == 0:
            problems.append(f"{name}: runAsUser {user!r} is not a numeric non-root user")
        seccomp = context.get("seccompProfile") or pod_context.get("seccompProfile") or {}
        if seccomp.get("type") != "RuntimeDefault":
            problems.append(f"{name}: no RuntimeDefault seccomp profile")
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        if env.get("HOME") != "/tmp":
            problems.append(f"{name}: HOME is not in the /tmp volume (the image's home is read-only)")
    assert problems == []
