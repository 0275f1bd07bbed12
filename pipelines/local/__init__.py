"""A local executor for Argo Workflow manifests: `moerl local`.

Runs a Workflow on this machine with the semantics of Argo's controller (steps, DAGs, retries,
loops, exit handlers, deadlines, parallelism, `{{ }}` variables and `{{= }}` expressions), each
container's command as a process, and writes a status in the shape of Argo's. The modules, in the
order a run meets them:

    manifest.py        load, resolve workflowTemplateRef/templateRef, validate every field
    expressions.py     {{...}} substitution, `when` conditions, durations (exprlang.py, functions.py)
    executor.py        the controller loop, retries, pods, exit handlers (calls.py: how templates are called)
    steps_template.py  steps templates        dag_template.py   DAG templates (depends.py)
    loops.py           withItems / withParam / withSequence      scope.py   steps.X.* / tasks.X.*
    pods.py            a step as a process (sandbox.py for paths, pytorchjob.py for PyTorchJobs,
                       warm.py + warm_server.py: python -m pods forked from a Python with torch imported)
    chaos.py           --chaos: Spot preemptions and kills        status.py  nodes and status JSON
    view.py            live tree / log lines                      cli.py     `moerl local`

README.md says what runs as on Argo, what is refused, how paths are sandboxed and what --chaos does.
"""

from pipelines.local.chaos import parse_chaos
from pipelines.local.run import RunResult, run_workflow

__all__ = ["RunResult", "parse_chaos", "run_workflow"]
