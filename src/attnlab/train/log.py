"""The run's record: ``metrics.jsonl`` (one JSON object per logged step) and ``loss.png``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from attnlab.io import json_safe, write_text_atomic, write_with_atomic

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; a line cut short by a kill is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # a line cut short by a kill
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


class MetricsLog:
    """Appends rows to metrics.jsonl, each written at once so a killed run keeps what it logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows = read_rows(path)

    def truncate_after(self, step: int) -> None:
        """Keep only rows with step <= step: what a run resumed from that step has not redone."""
        self.rows = [row for row in self.rows if row["step"] <= step]
        if self.rows or self.path.exists():
            write_text_atomic(self.path, "".join(json.dumps(row) + "\n" for row in self.rows))

    def append(self, row: dict[str, Any]) -> None:
        """Add one row to the file and to self.rows."""
        # Opened per row (rows are rare): no handle to leak. One write per row, so a kill
        # can cut only the last line, which read_rows skips.
        row = json_safe(row)  # strict JSON: a diverged loss (NaN) is null
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, allow_nan=False) + "\n")
        self.rows.append(row)


def plot_loss_curve(rows: list[dict[str, Any]], path: Path) -> bool:
    """Draw train loss (and eval losses, eval metrics) against step to path; False without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed: no loss plot", stacklevel=2)
        return False
    train = [row for row in rows if not row.get("eval") and "loss" in row]
    evals = [row for row in rows if row.get("eval")]
    # "best": true marks a row, it is no score (drawn, it read as a dev score of 1.0)
    eval_keys = sorted({k for row in evals for k in row if k not in ("step", "eval", "best")})
    loss_keys = [k for k in eval_keys if "loss" in k]
    other_keys = [k for k in eval_keys if "loss" not in k]

    # Figure + Agg canvas, not pyplot: no global backend switch, safe in any thread.
    fig = Figure(figsize=(10 if other_keys else 6, 4))
    FigureCanvasAgg(fig)
    # Fixed margins, not constrained/tight layout: measuring every tick label costs a second.
    axes = fig.subplots(1, 2 if other_keys else 1, squeeze=False)[0]
    fig.subplots_adjust(left=0.1, right=0.97, bottom=0.13, top=0.9, wspace=0.25)
    ax = axes[0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    for key in loss_keys:
        points = [(r["step"], r[key]) for r in evals if key in r]
        ax.plot(*zip(*points, strict=True), marker="o", label=f"eval {key}")
    ax.set(xlabel="step", ylabel="loss", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    if other_keys:
        for key in other_keys:
            points = [(r["step"], r[key]) for r in evals if key in r]
            axes[1].plot(*zip(*points, strict=True), marker="o", label=key)
        axes[1].set(xlabel="step", title="evaluation")
        axes[1].grid(alpha=0.3)
        axes[1].legend()
    write_with_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    return True
