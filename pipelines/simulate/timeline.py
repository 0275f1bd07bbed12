"""`moerl simulate --plot`: a Gantt chart of the first simulated iterations, sync above async."""

from __future__ import annotations

from pathlib import Path

from pipelines.simulate.model import SimResult

STEP_COLORS = {
    "plan": "#9e9e9e",
    "import-sft": "#795548",
    "rollout": "#1f77b4",
    "score": "#ff7f0e",
    "update": "#2ca02c",
    "publish": "#9467bd",
    "report": "#e377c2",
    "next-segment": "#bdbdbd",
    "rollout-server": "#1f77b4",  # a rollout server generating: the rollout's colour, on the server's lane
    "trainer-server": "#2ca02c",  # the trainer server training: the update's
}
SYNC_COLOR = "#17becf"  # a server bringing its weights to a new version
READY_COLOR = "#e3e3e3"  # a server up with nothing to do


def plot_timeline(results: dict[int, SimResult], path: str | Path, first_iterations: int = 3) -> Path:
    """A Gantt chart of the first iterations, sync above async: one row per node (up to 16 rollout nodes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), squeeze=False)
    for ax, staleness in zip(axes[:, 0], (0, 1), strict=True):
        result = results[staleness]
        shown = min(first_iterations, len(result.publish_times))
        until = result.publish_times[shown - 1] if shown else result.makespan
        all_rollout_rows = sorted({s.node for s in result.segments if s.pool == "rollout"})
        rollout_rows = all_rollout_rows[:16]
        rows = [("rollout", n) for n in rollout_rows] + [("trainer", 0), ("cpu", 0)]
        y_of = {row: k for k, row in enumerate(rows)}
        for seg in result.segments:
            row = (seg.pool, seg.node)
            if row not in y_of or seg.start >= until:
                continue
            end = min(seg.end, until)
            y = y_of[row]
            if seg.phase == "down":
                ax.broken_barh(
                    [(seg.start, end - seg.start)], (y - 0.4, 0.8), facecolor="#f4f4f4", edgecolor="#b0b0b0", hatch="//"
                )
                continue
            if seg.phase == "ready":
                ax.broken_barh([(seg.start, end - seg.start)], (y - 0.25, 0.5), color=READY_COLOR)
                continue
            phase_colors = {"lost": "#d62728", "sync": SYNC_COLOR}
            color = phase_colors.get(seg.phase, STEP_COLORS.get(seg.step, "#333333"))
            alpha = 0.45 if seg.phase == "startup" else 0.95
            ax.broken_barh([(seg.start, end - seg.start)], (y - 0.4, 0.8), color=color, alpha=alpha)
        served = {(s.pool, s.node) for s in result.segments if s.step.endswith("-server")}
        labels = [f"rollout node {n}{' (server)' if ('rollout', n) in served else ''}" for _, n in rows[:-2]]
        labels += ["trainer (server)" if ("trainer", 0) in served else "trainer", "cpu (steps, clients)"]
        ax.set_yticks(range(len(rows)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, until)
        ax.set_xlabel("seconds")
        ax.set_title(
            f"staleness {staleness} ({'sync' if staleness == 0 else 'async'}): first {shown} iterations, "
            f"mean iteration {result.mean_iteration_s:.1f} s"
            + (
                f" ({len(rollout_rows)} of {len(all_rollout_rows)} rollout nodes shown)"
                if len(all_rollout_rows) > 16
                else ""
            )
        )
    handles = [Patch(color=c, label=k) for k, c in STEP_COLORS.items() if not k.endswith("-server")]
    handles += [
        Patch(color="#1f77b4", alpha=0.45, label="engine start-up"),
        Patch(color=SYNC_COLOR, label="server: weights to a new version"),
        Patch(color=READY_COLOR, label="server ready, idle"),
        Patch(color="#d62728", label="lost chunk"),
        Patch(facecolor="#f4f4f4", edgecolor="#b0b0b0", hatch="//", label="Spot node replaced"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
