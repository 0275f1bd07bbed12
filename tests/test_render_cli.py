"""`moerl render | submit | schedule`: the files render writes, and what submit and schedule send to an Argo
server (a fake one on loopback that records each request): the token only ever in the header."""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from pipelines import render as render_module
from steps.errors import MoerlError

# Hera 7.1 serialises requests with pydantic's deprecated .json(); not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated")
REPO = Path(__file__).resolve().parents[1]
TOKEN = "s3cr3t-token-value"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moerl")
    render_module.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"name": "smoke", "sft_checkpoint": "s3://models-bkt/sft",
                                    "run_store": "s3://runs-bkt/smoke", "iterations": 3}))  # fmt: skip
    return path


class FakeArgo:
    """Just enough of Argo Server's REST API for Hera's create/update calls; 401 when refuse_token."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.refuse_token = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length).decode() if length else ""
                entry = {"method": self.command, "path": self.path, "auth": self.headers.get("Authorization"),
                         "raw": raw, "body": json.loads(raw) if raw else None}  # fmt: skip
                outer.requests.append(entry)
                return entry

            def do_GET(self) -> None:  # noqa: N802
                self._record()
                self._reply(404, {"code": 5, "message": "not found"})

            def do_POST(self) -> None:  # noqa: N802
                entry = self._record()
                if outer.refuse_token:
                    self._reply(401, {"code": 16, "message": "token not valid"})
                    return
                body = entry["body"]
                obj = body.get("template") or body.get("workflow") or body.get("cronWorkflow")
                meta = obj.setdefault("metadata", {})
                meta.setdefault("name", (meta.get("generateName") or "x-") + "abcde")
                self._reply(200, obj)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def posts(self, kind: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == "POST" and f"/api/v1/{kind}/" in r["path"]]


@pytest.fixture
def argo(monkeypatch):
    for name in ("ARGO_SERVER", "ARGO_TOKEN", "ARGO_NAMESPACE", "ARGO_SECURE", "ARGO_INSECURE_SKIP_VERIFY",
                 "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    fake = FakeArgo()
    fake.thread.start()
    yield fake
    fake.server.shutdown()


def test_render_writes_the_argo_and_kfp_files(config, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(["render", str(config), "--skip-checks", "--out", str(out), "--set", "iterations=2",
                "--set", "staleness=1", "--set", "checkpoint.keep_last=2"]) == 0  # fmt: skip
    names = {p.name for p in out.iterdir()}
    assert names == {"workflow-template.yaml", "workflow.yaml", "workflow-from-template.yaml",
                     "cron-workflow.yaml", "kfp-pipeline.yaml"}  # fmt: skip
    assert yaml.safe_load((out / "workflow.yaml").read_text())["kind"] == "Workflow"
    tasks = yaml.safe_load((out / "workflow.yaml").read_text())["spec"]["templates"][0]["dag"]["tasks"]
    assert {t["name"] for t in tasks} >= {"rollout-2", "publish-2"} and "rollout-3" not in {t["name"] for t in tasks}
    assert "wrote" in capsys.readouterr().out


def test_render_refuses_a_bad_config_with_its_message(config, tmp_path):
    with pytest.raises(MoerlError, match=r"rollout\.num_shards: Input should be greater than or equal to 1"):
        run(["render", str(config), "--out", str(tmp_path / "o"), "--set", "rollout.num_shards=0"])
    with pytest.raises(MoerlError, match="write FIELD=VALUE"):
        run(["render", str(config), "--out", str(tmp_path / "o"), "--set", "iterations"])


def test_submit_creates_the_template_then_a_workflow_with_the_token_in_the_header_only(config, argo, capsys):
    assert run(["submit", str(config), "--skip-checks", "--argo-server", argo.url, "--argo-token", TOKEN,
                "--namespace", "ml"]) == 0  # fmt: skip
    templates, workflows = argo.posts("workflow-templates"), argo.posts("workflows")
    assert [t["path"] for t in templates] == ["/api/v1/workflow-templates/ml"]
    assert templates[0]["body"]["template"]["metadata"]["name"] == "smoke"
    (workflow,) = workflows
    assert workflow["path"] == "/api/v1/workflows/ml"
    assert workflow["body"]["workflow"]["spec"]["workflowTemplateRef"] == {"name": "smoke"}
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in argo.requests)
    assert not any(TOKEN in r["raw"] for r in argo.requests)
    assert "submitted Workflow ml/smoke-abcde from template smoke" in capsys.readouterr().out


def test_submit_reads_the_argo_cli_environment(config, argo, monkeypatch):
    monkeypatch.setenv("ARGO_SERVER", argo.url.removeprefix("http://"))  # the CLI's host:port form
    monkeypatch.setenv("ARGO_SECURE", "false")
    monkeypatch.setenv("ARGO_TOKEN", f"Bearer {TOKEN}")
    monkeypatch.setenv("ARGO_NAMESPACE", "team-a")
    assert run(["submit", str(config), "--skip-checks"]) == 0
    assert argo.posts("workflows")[0]["path"] == "/api/v1/workflows/team-a"
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in argo.requests)


def test_schedule_creates_a_forbid_cron_workflow_from_the_cron_flag(config, argo, capsys):
    assert run(["schedule", str(config), "--cron", "15 3 * * *", "--timezone", "Europe/Berlin",
                "--argo-server", argo.url]) == 0  # fmt: skip
    (cron,) = argo.posts("cron-workflows")
    spec = cron["body"]["cronWorkflow"]["spec"]
    assert spec["schedules"] == ["15 3 * * *"] and spec["timezone"] == "Europe/Berlin"
    assert spec["concurrencyPolicy"] == "Forbid"
    assert spec["workflowSpec"]["workflowTemplateRef"] == {"name": "smoke"}
    assert "continuing from LATEST" in capsys.readouterr().out


def test_schedule_refuses_a_bad_cron_before_calling_the_server(config, argo):
    with pytest.raises(MoerlError, match="--cron '0 3 \\* \\*': has 4 fields"):
        run(["schedule", str(config), "--cron", "0 3 * *", "--argo-server", argo.url])
    assert argo.requests == []


def test_server_problems_are_one_clear_message(config, argo):
    with pytest.raises(MoerlError, match="no Argo server given: pass --argo-server"):
        run(["submit", str(config), "--skip-checks"])
    argo.refuse_token = True
    with pytest.raises(MoerlError, match="the Argo server refused the token"):
        run(["submit", str(config), "--skip-checks", "--argo-server", argo.url, "--argo-token", "wrong"])
    with pytest.raises(MoerlError, match="cannot reach the Argo server at http://127.0.0.1:9"):
        run(["submit", str(config), "--skip-checks", "--argo-server", "http://127.0.0.1:9"])


def test_the_python_api_returns_hera_objects_ready_to_create(config):
    from pipelines.config import load_config
    from pipelines.workflow import argo_objects

    objects = argo_objects(load_config(config), host="https://argo.example:2746", token=TOKEN)
    assert [t.name for t in objects.templates] == ["smoke"]
    assert objects.workflow.workflows_service is objects.cron.workflows_service
    assert objects.workflow.workflows_service.host == "https://argo.example:2746"
    rendered = "".join(o.to_yaml() for o in (*objects.templates, objects.workflow, objects.cron))
    assert TOKEN not in rendered
