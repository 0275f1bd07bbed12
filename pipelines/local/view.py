"""What `moerl local` shows while a workflow runs.

On a terminal, `LiveView` redraws the node tree in place (rich): each node with its phase, its
duration and, for steps and DAGs, its progress N/M in finished pods. Elsewhere (CI logs, pipes),
`PlainView` prints one line per change of a pod's phase:

    12:00:01 rollout(0:1) Running
    12:00:05 rollout(0:1) Succeeded 4.2s

Both end with a summary: the phase, the message, where the logs are, and the last lines of the
output of every step that failed.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

from pipelines.local.api.status import (
    DAG,
    ERROR,
    FAILED,
    OMITTED,
    PENDING,
    POD,
    RETRY,
    RUNNING,
    SKIPPED_PHASE,
    STEP_GROUP,
    STEPS,
    SUCCEEDED,
    SUSPEND,
    TASK_GROUP,
    Node,
)
from pipelines.local.pods.pod import tail

if TYPE_CHECKING:
    from pipelines.local.controller.workflow_controller import Controller

ICONS = {
    SUCCEEDED: ("✔", "green"), FAILED: ("✖", "red"), ERROR: ("⚠", "red"), RUNNING: ("●", "yellow"),
    PENDING: ("◷", "yellow"), SKIPPED_PHASE: ("○", "dim"), OMITTED: ("○", "dim"),
}  # fmt: skip


def seconds(node: Node, now: float) -> str:
    end = node.finished_at if node.finished_at is not None else now
    return f"{max(0.0, end - node.started_at):.1f}s"


class PlainView:
    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout
        self.seen: dict[str, str] = {}

    def line(self, text: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {text}", file=self.stream, flush=True)

    def update(self, ctl: Controller) -> None:
        for node in ctl.nodes:
            if node.type not in (POD, SUSPEND) or self.seen.get(node.id) == node.phase:
                continue
            if node.phase == PENDING:
                continue
            self.seen[node.id] = node.phase
            text = f"{node.display_name} {node.phase}"
            if node.fulfilled:
                text += f" {seconds(node, time.time())}"
                if node.message:
                    text += f": {node.message}"
            self.line(text)

    def finish(self, ctl: Controller) -> None:
        self.update(ctl)
        print(summary(ctl), file=self.stream, flush=True)


class LiveView:
    """A node tree redrawn in place; needs a terminal."""

    def __init__(self, console=None) -> None:  # noqa: ANN001 - a rich Console (tests give one that records)
        from rich.console import Console
        from rich.live import Live

        self.console = console or Console()
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self.live.start()
        self.drawn_at = 0.0

    def update(self, ctl: Controller) -> None:
        if time.time() - self.drawn_at >= 0.25:  # the controller passes far more often than a screen needs
            self.drawn_at = time.time()
            self.live.update(self.tree(ctl))

    def finish(self, ctl: Controller) -> None:
        self.live.update(self.tree(ctl))
        self.live.stop()
        self.console.print(summary(ctl), markup=False, highlight=False)

    def tree(self, ctl: Controller):  # noqa: ANN201 - a rich renderable
        from rich.text import Text
        from rich.tree import Tree

        now = time.time()
        children: dict[str | None, list[Node]] = {}
        for node in ctl.nodes:
            children.setdefault(node.display_parent, []).append(node)
        status = ctl.status
        progress = ctl.nodes.progress()
        took = max(0.0, (status.finished_at or now) - (status.started_at or now))
        header = Text(f"{ctl.wf.name} ", style="bold")
        header.append(status.phase, style=ICONS.get(status.phase, ("", ""))[1])
        header.append(f"  {progress[None]} pods  {took:.0f}s")
        tree = Tree(header)

        def label(node: Node) -> Text:
            icon, style = ICONS.get(node.phase, ("?", ""))
            text = Text(f"{icon} ", style=style)
            text.append(node.display_name, style="dim" if node.type == STEP_GROUP else "")
            if node.type not in (STEP_GROUP,):
                text.append(f"  {node.phase} {seconds(node, now)}", style=style)
            if node.type in (STEPS, DAG, TASK_GROUP, RETRY):
                text.append(f"  {progress[node.id]}", style="cyan")
            if node.message and node.type != STEP_GROUP:
                text.append(f"  {node.message}", style="red" if node.failed_or_error else "dim")
            return text

        def add(branch: Tree, parent: str | None) -> None:
            for node in children.get(parent, []):
                add(branch.add(label(node)), node.id)

        add(tree, None)
        return tree


def summary(ctl: Controller) -> str:
    status = ctl.status
    took = (status.finished_at or time.time()) - (status.started_at or time.time())
    lines = [f"Workflow {ctl.wf.name} {status.phase} in {took:.1f}s ({ctl.nodes.progress()[None]} pods)"]
    if status.message:
        lines.append(f"message: {status.message}")
    for node in ctl.nodes:
        if node.type == POD and node.failed_or_error and node.id in ctl.pod_dirs:
            pod_dir = ctl.pod_dirs[node.id]
            lines.append(f"--- {node.display_name} {node.phase}: {node.message} ({pod_dir})")
            output = tail(pod_dir / "stderr.log") or tail(pod_dir / "stdout.log")
            lines += [f"    {line}" for line in output]
    lines.append(f"logs: {ctl.run_dir / 'pods'}")
    if ctl.status_out is not None:
        lines.append(f"status: {ctl.status_out}")
    if ctl.chaos is not None:
        lines.append(ctl.chaos.summary())
    return "\n".join(lines)
