"""PNG plot of a megamoe-bench results dict: one panel per (model, tokens per rank), bars
of fwd / bwd / full-layer ms for each backend. matplotlib is optional."""

from __future__ import annotations

import sys
from pathlib import Path

METRICS = (("fwd_ms", "fwd"), ("bwd_ms", "bwd"), ("full_layer_ms", "full layer (2 fwd + bwd)"))


def plot_results(results: dict, path: Path) -> Path | None:
    """Writes the plot to `path` and returns it; None (with a message) without matplotlib."""
    try:
        # Figure + savefig without pyplot: no global backend state, no display needed.
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plot written (pip install matplotlib)", file=sys.stderr)
        return None

    panels = _group_by_config(results["rows"])
    fig = Figure(figsize=(max(7.0, 4.5 * len(panels)), 5), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, ((model, tokens), rows) in zip(axes, panels.items()):
        _draw_panel(ax, rows)
        ax.set_title(f"{model}, {tokens} tokens/rank", fontsize=10)
    axes[0].set_ylabel("ms (median)")
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(results), fontsize=10)
    fig.savefig(path, dpi=120)
    return path


def _group_by_config(rows: list[dict]) -> dict:
    panels: dict = {}
    for row in rows:
        panels.setdefault((row["model"], row["tokens_per_rank"]), []).append(row)
    return panels


def _draw_panel(ax, rows: list[dict]) -> None:
    bar_width = 0.8 / len(METRICS)
    for slot, (key, label) in enumerate(METRICS):
        positions = [i + (slot - 1) * bar_width for i in range(len(rows))]
        heights = [row[key] or 0.0 for row in rows]
        bars = ax.bar(positions, heights, bar_width, label=label)
        ax.bar_label(bars, labels=[f"{h:.3g}" if h else "" for h in heights], fontsize=7)
    for i, row in enumerate(rows):
        if row["status"].startswith("skipped"):
            ax.text(i, 0, " skipped", ha="center", va="bottom", rotation=90, fontsize=8)
    ax.set_xticks(range(len(rows)), [_label(row) for row in rows])


def _label(row: dict) -> str:
    label = f"{row['backend']}\n{row['backward_mode']}" if row["backend"] == "fused" else row["backend"]
    return label if row.get("precision", "bf16") == "bf16" else f"{label}\n{row['precision']}"


def _title(results: dict) -> str:
    settings = results["settings"]
    peak = results["gemm_peak_tflops"]
    peak_text = f", bf16 GEMM peak {peak:.0f} TFLOP/s" if peak else ""
    where = (f"{results['num_gpus']} x {results['gpu']}" if results["num_gpus"]
             else "CPU (reference smoke run, not a GPU benchmark)")
    return (f"megamoe {results['megamoe_version']} on {where}{peak_text}\n"
            f"ep={settings['ep']}, routing={settings['routing']}, "
            f"precision={','.join(settings.get('precisions') or [settings.get('precision')])}, "
            f"commit {results['commit'][:12]}")
