"""Step report: the run's per-iteration metrics as a table, a Markdown page and a reward/accuracy plot.

    python -m steps.report --run URI --out DIR [--status PHASE] [--workflow-name NAME --namespace NS]

Reads <run>/metrics/iter-*.json, prints the table, and writes report.md and report.png to DIR and to
<run>/report/. An iteration's accuracy is that of the policy that generated its samples (score measures it);
the report measures the final published version itself, so the run's result reads "v000000 (the SFT
checkpoint) -> vN". It is the workflow's exit handler, so it runs however the run ended: iterations that wrote no
metrics, and metrics that lack a field, show as '-'. Metrics files may nest their fields ({"update": {"kl":
...}}); a field is found by its name at any depth.

Then the run's experiment trackers (steps/tracking/trackers.py) get the Workflow's step wall times and retries, the
config, the report files and the Workflow's name and UI link, and any step points they missed.
"""

from __future__ import annotations

import argparse
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steps.errors import MoerlError, run_cli
from steps.run.checkpoint import read_latest
from steps.run.keys import (
    METRICS_KEY_PATTERN,
    METRICS_PREFIX,
    REPORT_MD,
    REPORT_MD_KEY,
    REPORT_PNG,
    REPORT_PNG_KEY,
    REPORT_PREFIX,
    RUN_CONFIG,
    parse_version,
    update_metrics_key,
)
from steps.store.object_store import Store
from steps.tracking import trackers as tracking

# Column -> field names that hold it, most specific first.
COLUMNS: dict[str, tuple[str, ...]] = {
    "reward": ("reward_mean", "mean_reward", "reward"),
    # held-out only: the samples' own accuracy (on training prompts) is never called held-out
    "accuracy": ("heldout_accuracy", "held_out_accuracy", "eval_accuracy"),
    "kl": ("kl_mean", "kl", "kl_ref"),
    "sample_accuracy": ("accuracy",),
    # the train-inference mismatch (steps/training/mismatch.py): k3 KL(behaviour || trainer), the ratio's 99th pct
    "mismatch_k3": ("mismatch.k3",),
    "mismatch_ratio_p99": ("mismatch.ratio.p99",),
    # the share of tokens whose trainer routers chose other experts than the engine's (routes recorded; under
    # routing replay the forward uses the engine's anyway)
    "route_disagreement": ("routing.router_disagreement",),
}
# Step times: any numeric field whose name says it is a duration.
_TIME_FIELD = re.compile(r"(seconds|_secs?|_s|_time|duration)$")


@dataclass
class Report:
    columns: list[str]
    rows: list[dict[str, float | None]]  # one per iteration, with "iteration"
    notes: list[str] = field(default_factory=list)
    latest: str | None = None
    status: str | None = None
    final_accuracy: float | None = None  # held-out accuracy of `latest`

    def accuracy_by_version(self) -> dict[int, float]:
        """Held-out accuracy of each policy version measured, the final one included."""
        out = {int(r["policy_version"]): float(r["accuracy"]) for r in self.rows
               if r.get("policy_version") is not None and r.get("accuracy") is not None}  # fmt: skip
        if self.latest is not None and self.final_accuracy is not None:
            out[parse_version(self.latest)] = self.final_accuracy
        return dict(sorted(out.items()))

    def outcome(self) -> str | None:
        """'held-out accuracy 50.4% (v000000) -> 68.0% (v000006), +17.6 points', when both ends are known."""
        by_version = self.accuracy_by_version()
        if self.latest is None or 0 not in by_version or parse_version(self.latest) not in by_version:
            return None
        start, end = by_version[0], by_version[parse_version(self.latest)]
        return (
            f"held-out accuracy {start:.1%} (v000000, the SFT checkpoint) -> {end:.1%} ({self.latest}), "
            f"{100 * (end - start):+.1f} points"
        )

    def series(self, column: str) -> tuple[list[int], list[float]]:
        points = [(int(r["iteration"]), r[column]) for r in self.rows if r.get(column) is not None]
        return [p[0] for p in points], [float(p[1]) for p in points]

    def table(self, markdown: bool = False) -> str:
        header = ["iteration", *self.columns]
        cells = [[_cell(row.get(c), c) for c in header] for row in self.rows]
        if markdown:
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
        widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
        lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
        return "\n".join(lines)


def _cell(value: float | None, column: str) -> str:
    if value is None:
        return "-"
    if column == "iteration":
        return str(int(value))
    return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    if not isinstance(obj, dict):
        return {prefix: obj} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def find_field(flat: dict[str, Any], names: tuple[str, ...]) -> float | None:
    """The first of `names` present as a whole key or as a key's last part, at any depth."""
    for name in names:
        for key, value in flat.items():
            if (key == name or key.endswith("." + name)) and _number(value) is not None:
                return _number(value)
    return None


def time_fields(flat: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in ((k, _number(v)) for k, v in flat.items()) if v is not None and _TIME_FIELD.search(k)}


def collect(run: Store) -> Report:
    rows: list[dict[str, float | None]] = []
    notes: list[str] = []
    time_columns: list[str] = []
    keys = run.list(METRICS_PREFIX)
    for key in keys:
        match = METRICS_KEY_PATTERN.match(key)
        if match is None:
            continue
        try:
            flat = flatten(run.get_json(key))
        except MoerlError as err:
            notes.append(f"{key}: left out ({err})")
            continue
        # the update's metrics of the iteration (the mismatch, its KL) fill the columns the score's lack
        update_key = update_metrics_key(int(match.group(1)))
        update_flat: dict[str, Any] = {}
        if update_key in keys:
            try:
                update_flat = flatten(run.get_json(update_key))
            except MoerlError as err:
                notes.append(f"{update_key}: left out ({err})")
        row: dict[str, float | None] = {"iteration": float(int(match.group(1)))}
        row["policy_version"] = find_field(flat, ("policy_version",))
        for column, names in COLUMNS.items():
            value = find_field(flat, names)
            row[column] = value if value is not None else find_field(update_flat, names)
        for name, seconds in time_fields(flat).items():
            row[name] = seconds
            if name not in time_columns:
                time_columns.append(name)
        rows.append(row)
    rows.sort(key=lambda r: r["iteration"] or 0)
    # LATEST is read after the listing: an unreadable store fails there first.
    return Report(columns=[*COLUMNS, *time_columns], rows=rows, notes=notes, latest=read_latest(run))


def plot_png(report: Report) -> bytes:
    """Held-out accuracy and mean reward by iteration, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    accuracy = report.accuracy_by_version()
    panels = (
        (axes[0], (list(accuracy), list(accuracy.values())), "held-out accuracy", "policy version"),
        (axes[1], report.series("reward"), "mean reward", "iteration"),
    )
    for ax, (xs, ys), title, xlabel in panels:
        if xs:
            ax.plot(xs, ys, marker="o")
        else:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def markdown(report: Report, run_uri: str) -> str:
    lines = [f"# moerl run report: {run_uri}", ""]
    if report.status:
        lines.append(f"Workflow status: **{report.status}**  ")
    lines.append(
        f"Latest checkpoint: `{run_uri}/checkpoints/{report.latest}`"
        if report.latest
        else "No checkpoint published yet."
    )
    outcome = report.outcome()
    if outcome:
        lines.append(f"Result: {outcome}  ")
    lines += ["", report.table(markdown=True) if report.rows else "No iteration has written metrics yet.", ""]
    if report.rows:
        lines.append("accuracy: held-out greedy accuracy (the run's verifier) of the policy that generated the "
                     "iteration's samples; sample_accuracy: share of those samples, on training prompts, it accepted")
    lines += [f"- {note}" for note in report.notes]
    lines += ["", "![held-out accuracy and mean reward by iteration](report.png)", ""]
    return "\n".join(lines)


def measure_final_accuracy(run: Store, report: Report) -> None:
    """Held-out accuracy of the latest version, unless a score step measured it already; a failure is a note,
    not an error (the report is the exit handler and still reports a run whose evaluation cannot run)."""
    if report.latest is None:
        return
    version = parse_version(report.latest)
    measured = report.accuracy_by_version().get(version)
    if measured is not None:
        report.final_accuracy = measured
        return
    # Imported here: torch and the engine are needed only now, not to print a table of metrics.
    from steps.run.config import load_run_config
    from steps.scoring.evaluation import heldout_accuracy

    try:
        report.final_accuracy = heldout_accuracy(run, load_run_config(run), version, log=report.notes.append)
    except MoerlError as err:
        report.notes.append(f"held-out accuracy of {report.latest} not measured: {err}")


def write_report(
    run_uri: str,
    out_dir: str | Path,
    status: str | None = None,
    workflow_name: str | None = None,
    namespace: str | None = None,
) -> Report:
    """Collect the run's metrics and write report.md and report.png to out_dir and <run>/report/; then hand
    the trackers the workflow's step times and retries, the report files and the Argo workflow's name."""
    run = Store.open(run_uri)
    report = collect(run)
    report.status = status
    measure_final_accuracy(run, report)
    png, md = plot_png(report), markdown(report, run.uri).encode()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_PNG).write_bytes(png)
    (out / REPORT_MD).write_bytes(md)
    run.put_bytes(REPORT_PNG_KEY, png)
    run.put_bytes(REPORT_MD_KEY, md)
    track_run_end(run, out, workflow_name, namespace, report.notes.append)
    return report


def track_run_end(run: Store, out: Path, workflow_name: str | None, namespace: str | None, note: Any) -> None:
    """The trackers' part of the report; a run whose run.json cannot be read tracks nothing (a note says so)."""
    from steps.run.config import validate_config

    try:
        cfg = validate_config(run.get_json(RUN_CONFIG), run.url(RUN_CONFIG))
    except MoerlError as err:
        note(f"tracking skipped: {err}")
        return
    files = {REPORT_MD: out / REPORT_MD, REPORT_PNG: out / REPORT_PNG}
    tracking.log_run_end(run, cfg, tracking.stored_step_metrics(run), workflow_name, namespace, files,
                         lambda line: print(line, flush=True))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m steps.report", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run store URI")
    parser.add_argument("--out", required=True, type=Path, help="directory for report.md and report.png")
    parser.add_argument("--status", help="the workflow's phase, shown in the report")
    parser.add_argument("--workflow-name", help="the Argo Workflow's name: a tag in the trackers, its step times")
    parser.add_argument("--namespace", help="the Argo Workflow's namespace")
    args = parser.parse_args()
    report = write_report(args.run, args.out, args.status, args.workflow_name, args.namespace)
    print(report.table() if report.rows else "no iteration has written metrics yet")
    outcome = report.outcome()
    if outcome:
        print(outcome)
    for note in report.notes:
        print(note)
    where = f"{args.out}/report.png and {Store.open(args.run).url(REPORT_PREFIX)}/"
    print(f"latest checkpoint: {report.latest or 'none'}; report written to {where}")
    return 0


if __name__ == "__main__":
    run_cli(main)
