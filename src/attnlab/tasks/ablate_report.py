"""The positional-encoding ablation's summary: results.json, results.md (a table) and results.png.

Perplexity is exp(held-out loss per predicted token). With several seeds each cell is the mean
of the seeds' perplexities and their sample standard deviation ("mean ± sd"); the lowest mean
of each column is in bold. A model that cannot score a length says why instead ("n/a (table)":
its learned table ends at the training length; "n/a (text)": too little held-out text).
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from attnlab.io import write_bytes_atomic, write_text_atomic


def _cell(values: list[float | str]) -> dict[str, Any]:
    """One (scheme, length) cell from its seeds' losses: perplexity mean and spread, or a note."""
    notes = [v for v in values if isinstance(v, str)]
    if notes:
        return {"note": notes[0]}
    losses = [float(v) for v in values]
    perplexities = [math.exp(min(loss, 700.0)) for loss in losses]
    return {
        "loss": statistics.fmean(losses),
        "perplexity": statistics.fmean(perplexities),
        "spread": statistics.stdev(perplexities) if len(perplexities) > 1 else None,
        "seeds": len(losses),
    }


def summarise(results: list[dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, Any]]:
    """{scheme: {"cells": {length: cell}, "steps", "train_seconds"}} over each scheme's seeds."""
    table: dict[str, dict[str, Any]] = {}
    for scheme in dict.fromkeys(r["scheme"] for r in results):
        runs = [r for r in results if r["scheme"] == scheme]
        table[scheme] = {
            "cells": {str(n): _cell([r["loss"][str(n)] for r in runs]) for n in lengths},
            "steps": runs[0]["steps"],
            "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),
        }
    return table


def _best(table: dict[str, dict[str, Any]], length: int) -> str | None:
    """The scheme with the lowest mean perplexity at length, if any scored it."""
    scored = {s: row["cells"][str(length)] for s, row in table.items()}
    scored = {s: c["perplexity"] for s, c in scored.items() if "perplexity" in c}
    return min(scored, key=scored.__getitem__) if scored else None


def markdown(summary: dict[str, Any]) -> str:
    """results.md: the settings, then perplexity by scheme (rows) and evaluation length (columns)."""
    table, lengths, train = summary["schemes"], summary["eval_lengths"], summary["train_length"]
    best = {n: _best(table, n) for n in lengths}
    header = [f"{n} ({n // train}x)" for n in lengths]
    rows = [
        "| scheme | " + " | ".join(header) + " | steps | training time |",
        "| --- | " + " | ".join("---:" for _ in lengths) + " | ---: | ---: |",
    ]
    for scheme, row in table.items():
        cells = []
        for n in lengths:
            cell = row["cells"][str(n)]
            if "note" in cell:
                cells.append(cell["note"])
                continue
            text = f"{cell['perplexity']:.3f}"
            if cell["spread"] is not None:
                text += f" ± {cell['spread']:.3f}"
            cells.append(f"**{text}**" if best[n] == scheme else text)
        seconds = row["train_seconds"]
        took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
        rows.append(f"| {scheme} | " + " | ".join(cells) + f" | {row['steps']} | {took} |")
    seeds = summary["seeds"]
    lines = [
        f"# Positional encodings: held-out perplexity ({summary['task']})",
        "",
        f"Preset {summary['preset']}, trained on windows of {train} tokens for "
        f"{summary['steps']} steps at lr {summary['lr']:g}, batch {summary['batch_size']}, "
        f"seed{'s' if seeds > 1 else ''} {summary['seed']}"
        + (f"..{summary['seed'] + seeds - 1} (mean ± sd)" if seeds > 1 else "")
        + "; perplexity = exp(held-out loss per predicted token), the best of each column "
        "in bold; columns: evaluation window in tokens (multiple of the training length).",
        "",
        *rows,
        "",
    ]
    return "\n".join(lines)


def plot_png(summary: dict[str, Any]) -> bytes:
    """results.png: perplexity against evaluation length (log-log), one line per scheme."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for scheme, row in summary["schemes"].items():
        points = [(int(n), c) for n, c in row["cells"].items() if "perplexity" in c]
        if not points:
            continue
        xs = [n for n, _ in points]
        ys = [c["perplexity"] for _, c in points]
        errors = [c["spread"] or 0.0 for _, c in points]
        ax.errorbar(xs, ys, yerr=errors if any(errors) else None, marker="o", label=scheme)
    ax.axvline(summary["train_length"], color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(summary["eval_lengths"], [str(n) for n in summary["eval_lengths"]])
    ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens); dotted: training length")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"Extrapolation by positional scheme ({summary['task']}, {summary['preset']})")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    return buffer.getvalue()


def write_report(opts: Any, state: dict[str, Any], results: list[dict[str, Any]]) -> dict:
    """Write results.json, results.md and results.png into opts.out (each atomically); the summary."""
    lengths = [m * opts.train_length for m in opts.eval_lengths]
    summary = {
        "task": opts.task,
        "preset": opts.model_preset,
        "train_length": opts.train_length,
        "eval_lengths": lengths,
        "steps": state["steps"],
        "lr": opts.peak_lr,
        "batch_size": opts.batch_size,
        "seed": opts.seed,
        "seeds": opts.seeds,
        "schemes": summarise(results, lengths),
        "runs": results,
    }
    write_text_atomic(opts.out / "results.json", json.dumps(summary, indent=2))
    write_text_atomic(opts.out / "results.md", markdown(summary))
    write_bytes_atomic(opts.out / "results.png", plot_png(summary))
    return summary
