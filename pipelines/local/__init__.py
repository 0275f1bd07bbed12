"""A local executor for Argo Workflow manifests: `moerl local`.

Runs a Workflow on this machine with the semantics of Argo's controller (steps, DAGs, retries,
loops, exit handlers, deadlines, parallelism, `{{ }}` variables and `{{= }}` expressions), each
container's command as a process, and writes a status in the shape of Argo's. Four wings under this front
door (run.py: `run_workflow`; cli.py: `moerl local`; view.py: the live tree), each importing only those below it:

    lang/        Argo's expression and template languages: functions.py (sprig and expr-lang builtins),
                 exprlang.py (expr-lang), expressions.py ({{...}} substitution, `when`, durations)
    api/         Argo's objects: fields.py (the field table of every definition), manifest.py (load, resolve
                 workflowTemplateRef/templateRef), validation.py (what Argo's validator refuses), status.py
                 (nodes and the status JSON), depends.py (task dependencies)
    pods/        a step as a process: pod.py (planning and process life), sandbox.py, pytorchjob.py, warm.py +
                 warm_server.py (python -m pods forked from a Python with torch imported), chaos.py (--chaos)
    controller/  Argo's operator: workflow_controller.py (the loop, nodes, exit handlers), pod_nodes.py and
                 retries.py (its pod and retry nodes), steps_template.py and dag_template.py (the walkers, which
                 see the controller only through host.py's WalkerHost), loops.py, scope.py, memoize.py, sync.py,
                 calls.py

README.md says what runs as on Argo, what is refused, how paths are sandboxed and what --chaos does.
"""

from pipelines.local.pods.chaos import parse_chaos
from pipelines.local.run import RunResult, run_workflow

__all__ = ["RunResult", "parse_chaos", "run_workflow"]
