"""`moerl render | submit | schedule`: a run config as Argo and KFP manifests, or straight onto an Argo server.

`moerl render CONFIG --out DIR` writes

    workflow-template.yaml        the WorkflowTemplate: one, whatever the run's length; each Workflow of it runs a
                                  segment of at most segment_size iterations from its parameter `first`
    workflow-from-template.yaml   a Workflow that references the template, first=1 (what `moerl submit` creates)
    workflow.yaml                 the whole run as one self-contained Workflow: `moerl local` and `moerl run`
                                  execute it on this machine; on a cluster it suits runs that fit one object
    cron-workflow.yaml            the CronWorkflow that continues the run from LATEST on a schedule
    kfp-pipeline.yaml             the same run as a Kubeflow Pipelines IR (see docs/kfp.md)

`moerl submit` and `moerl schedule` create or update the templates and then a Workflow or the CronWorkflow
through Hera's WorkflowsService. The server and token come from --argo-server / --argo-token or the Argo CLI's
variables ARGO_SERVER, ARGO_TOKEN, ARGO_SECURE, ARGO_INSECURE_SKIP_VERIFY and ARGO_NAMESPACE; the token goes
into the request header only and never into a manifest.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pipelines.config import load_config, parse_overrides
from pipelines.workflow import argo_objects, cron_workflow, workflow, workflow_from_template, workflow_templates
from pipelines.workflow.wait import wait_for_run
from steps.errors import MoerlError
from steps.run.config import RunConfig
from steps.run.config_checks import cron_problem

WORKFLOW_TEMPLATE = "workflow-template.yaml"
WORKFLOW = "workflow.yaml"
WORKFLOW_FROM_TEMPLATE = "workflow-from-template.yaml"
CRON_WORKFLOW = "cron-workflow.yaml"
KFP_PIPELINE = "kfp-pipeline.yaml"


def render(cfg: RunConfig, out_dir: str | Path, kfp: bool = True) -> dict[str, Path]:
    """Write every manifest of the run to out_dir (the KFP pipeline only with kfp); returns file name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = {
        WORKFLOW_TEMPLATE: "---\n".join(t.to_yaml() for t in workflow_templates(cfg)),
        WORKFLOW_FROM_TEMPLATE: workflow_from_template(cfg).to_yaml(),
        WORKFLOW: workflow(cfg).to_yaml(),
        CRON_WORKFLOW: cron_workflow(cfg).to_yaml(),
    }
    paths = {}
    for name, text in texts.items():
        paths[name] = out / name
        paths[name].write_text(text)
    if kfp:
        from pipelines.kfp_pipeline import compile_pipeline  # kfp is slow to import (~1 s); only this needs it

        paths[KFP_PIPELINE] = compile_pipeline(cfg, out / KFP_PIPELINE)
    return paths


def _server(args: argparse.Namespace) -> tuple[str, str | None, bool]:
    """(URL, token, verify_ssl) from the flags, else from the Argo CLI's environment variables."""
    host = args.argo_server or os.environ.get("ARGO_SERVER")
    if not host:
        raise MoerlError(
            "no Argo server given: pass --argo-server https://HOST:2746 or set ARGO_SERVER "
            "(for a cluster: kubectl -n argo port-forward svc/argo-server 2746)"
        )
    if "://" not in host:  # the Argo CLI's form, host:port
        secure = os.environ.get("ARGO_SECURE", "true").lower() != "false"
        host = f"{'https' if secure else 'http'}://{host}"
    token = args.argo_token or os.environ.get("ARGO_TOKEN") or None
    verify = not (args.insecure_skip_verify or os.environ.get("ARGO_INSECURE_SKIP_VERIFY", "").lower() == "true")
    return host, token, verify


def _talk(host: str, action: Any) -> Any:
    """Run a call to the Argo server; connection and API errors become one clear MoerlError."""
    import requests
    from hera.exceptions import HeraException, Unauthorized

    try:
        return action()
    except Unauthorized as err:
        raise MoerlError(
            f"{host}: the Argo server refused the token ({err}); set ARGO_TOKEN to a valid one (argo auth token)"
        ) from None
    except HeraException as err:
        raise MoerlError(f"{host}: the Argo server said {type(err).__name__}: {err}") from None
    except requests.exceptions.RequestException as err:
        raise MoerlError(
            f"cannot reach the Argo server at {host} ({type(err).__name__}); check "
            "--argo-server / ARGO_SERVER and that the server is up"
        ) from None


def checked_config(args: argparse.Namespace, for_cluster: bool = True) -> RunConfig:
    """The config, and (unless --skip-checks) every input it names checked before anything is written."""
    from pipelines.preflight import preflight_or_exit

    cfg = load_config(args.config, parse_overrides(args.set))
    if not getattr(args, "skip_checks", False):
        preflight_or_exit(cfg, for_cluster=for_cluster, source=str(args.config))
    return cfg


def cmd_check(args: argparse.Namespace) -> int:
    cfg = checked_config(args, for_cluster=False)
    print(f"{args.config}: the config, the SFT checkpoint's config and tokenizer, the prompts and the rewards of "
          f"run {cfg.name!r} check out")  # fmt: skip
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    cfg = checked_config(args)
    for path in render(cfg, args.out).values():
        print(f"wrote {path}")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    cfg = checked_config(args)
    host, token, verify = _server(args)
    namespace = args.namespace or os.environ.get("ARGO_NAMESPACE") or None
    objects = argo_objects(cfg, host=host, token=token, namespace=namespace, verify_ssl=verify)
    submitted = _talk(host, objects.create)
    name = submitted.metadata.name
    print(f"submitted Workflow {objects.workflow.namespace}/{name} from template {objects.templates[0].name}")
    if args.wait:  # Pending on the mutex or the semaphore included, and every segment after this one
        service, ns = objects.workflow.workflows_service, objects.workflow.namespace
        phase = _talk(host, lambda: wait_for_run(service, ns, name, log=lambda line: print(line, flush=True)))
        print(f"run {cfg.name} ended {phase}")
        return 0 if phase == "Succeeded" else 1
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    overrides = parse_overrides(args.set)
    if args.timezone:
        overrides["schedule.timezone"] = args.timezone
    for expr in args.cron or []:
        problem = cron_problem(expr)
        if problem:
            raise MoerlError(f"--cron {expr!r}: {problem}")
    cfg = load_config(args.config, overrides)
    host, token, verify = _server(args)
    namespace = args.namespace or os.environ.get("ARGO_NAMESPACE") or None
    objects = argo_objects(cfg, host=host, token=token, namespace=namespace, verify_ssl=verify, schedules=args.cron)
    cron = _talk(host, objects.schedule)
    print(
        f"scheduled CronWorkflow {objects.cron.namespace}/{cron.metadata.name}: "
        f"{', '.join(objects.cron.schedules or [])} ({objects.cron.timezone}), continuing from LATEST"
    )
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="run config YAML (e.g. configs/demo.yaml)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a config field, e.g. --set iterations=3 (repeatable)",
    )


def _skip_checks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-checks",
        action="store_true",
        help="do not read the SFT checkpoint, prompt files and rewards first (moerl check does that)",
    )


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--argo-server", metavar="URL", help="Argo server URL (default: $ARGO_SERVER)")
    parser.add_argument(
        "--argo-token",
        metavar="TOKEN",
        help="bearer token (default: $ARGO_TOKEN, preferred: a flag shows in the process list)",
    )
    parser.add_argument("--namespace", metavar="NS", help="namespace (default: $ARGO_NAMESPACE, else the config's)")
    parser.add_argument("--insecure-skip-verify", action="store_true", help="do not verify the server's TLS cert")


def register(subparsers: argparse._SubParsersAction) -> None:
    files = __doc__[__doc__.index("`moerl render CONFIG") : __doc__.index("`moerl submit` and")].strip()
    p = subparsers.add_parser(
        "render",
        help="write the run's Argo and KFP manifests",
        description=files,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    _skip_checks(p)
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="directory for the manifests")
    p.set_defaults(func=cmd_render)

    p = subparsers.add_parser(
        "check",
        help="check a run config and every input it names, reporting every problem at once",
        description=__import__("pipelines.preflight").preflight.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    p.set_defaults(func=cmd_check)

    p = subparsers.add_parser("submit", help="create/update the WorkflowTemplate and submit a Workflow")
    _common(p)
    _skip_checks(p)
    _server_flags(p)
    p.add_argument(
        "--wait", action="store_true",
        help="wait for the run to end, queued (Pending) time and every later segment included; exit 0 iff it "
        "Succeeded",
    )  # fmt: skip
    p.set_defaults(func=cmd_submit)

    p = subparsers.add_parser("schedule", help="create/update the CronWorkflow that continues the run from LATEST")
    _common(p)
    _server_flags(p)
    p.add_argument(
        "--cron",
        action="append",
        metavar="EXPR",
        help="cron schedule, e.g. '0 */6 * * *' (repeatable; default: the config's schedule)",
    )
    p.add_argument("--timezone", help="IANA timezone of the schedule (default: the config's)")
    p.set_defaults(func=cmd_schedule)
