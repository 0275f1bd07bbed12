"""What the steps and DAG walkers (steps_template.py, dag_template.py) use of the controller that runs them.

The controller (executor.py) imports the walkers and passes itself in; the walkers know only this Protocol,
so the dependency runs one way: executor -> walkers -> host. Argo's controller has the same seam: its
executeSteps/executeDAG take the woc (workflow operation context) and call back into it for each child.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from pipelines.local.api.status import Node, Nodes
from pipelines.local.controller.calls import Call, Opts


@runtime_checkable
class WalkerHost(Protocol):
    """The controller as the walkers see it: its node table, and how a child template is run."""

    nodes: Nodes
    node_templates: dict[str, dict]  # steps/DAG node ID -> its processed template

    def globals(self) -> dict[str, Any]:
        """The workflow.* variables (Argo's globalParams)."""
        ...

    def add_global_outputs(self, outputs: dict | None) -> None:
        """Publish outputs that carry a globalName as workflow.outputs.parameters.*."""
        ...

    def resolve(self, call: Call) -> tuple[dict, tuple[bool, str] | None]:
        """The template a call names, and the scope of the WorkflowTemplate it came from."""
        ...

    def execute_template(self, node_name: str, call: Call, opts: Opts) -> Node | None:
        """Argo's executeTemplate: create or advance the node of one call."""
        ...

    def create_node(self, name: str, type_: str, template: dict, opts: Opts, phase: str, message: str = "") -> Node:
        ...

    def settled(self, node: Node) -> bool:
        """Whether a pass leaves the node alone (fulfilled, unless a lost daemon Argo retries)."""
        ...

    def outbound_nodes(self, id_: str) -> list[str]:
        """Argo's getOutboundNodes: the nodes the next step group or dependent task hangs from."""
        ...

    def run_exit_hook(
        self,
        hook: dict,
        parent: Node,
        boundary_id: str,
        scope: dict,
        prefix: str,
        name: str,
        call_scope: tuple[bool, str] | None,
    ) -> Node | None:
        """Argo's runOnExitNode: `<parent>.onExit`, run once the parent completed."""
        ...
