"""Throughput, MFU, the step log line, the JSON log and the PNG of the curves.

FLOPs per token (model FLOPs: what the model needs, not what the step runs, so activation
checkpointing's recompute is not counted) = 6 * N_active + causal attention, where N_active
is the matmul parameters one token passes through (attention projections, router, its k
experts, the LM head) and the attention term is, per layer, 6 * seq_len * heads * head_dim
(QK^T and PV, 2 FLOPs per multiply-add, 2 matmuls, half of the seq_len x seq_len products
under the causal mask, times 3 for forward + backward). MFU = achieved FLOP/s per GPU / the
GPU's dense bf16 peak (the datasheet's: 989 TFLOP/s for H100 and H200 SXM; log.peak_tflops
overrides it).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0}


def flops_per_token(counts: dict, seq_len: int) -> float:
    attention = 6 * seq_len * counts["attention_heads_x_dim"] * counts["num_layers"]
    return 6.0 * counts["active_matmul"] + attention


def peak_tflops(gpu_name: str | None, override: float) -> float | None:
    """The bf16 dense peak for MFU; None when unknown (MFU is then not reported)."""
    if override > 0:
        return override
    if not gpu_name:
        return None
    if "PCIe" in gpu_name or "NVL" in gpu_name:
        return None  # other clocks and power; ask the user for log.peak_tflops
    for key, value in DATASHEET_BF16_TFLOPS.items():
        if key in gpu_name.split():
            return value
    return None


def format_line(record: dict, total_steps: int, per: str = "GPU") -> str:
    parts = [f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {record['loss']:.4f}", f"aux {record['aux_loss']:.4f}",
             f"grad_norm {record['grad_norm']:.3f}", f"lr {record['lr']:.2e}",
             f"{record['step_time_s'] * 1e3:.0f} ms",
             f"{_thousands(record['tokens_per_s_per_gpu'])} tok/s/{per}"]
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("peak_memory_gib") is not None:
        parts.append(f"mem {record['peak_memory_gib']:.1f} GiB")
    if record.get("alloc_retries"):
        parts.append(f"allocator retries {record['alloc_retries']}")
    return " | ".join(parts)


def count(value: float) -> str:
    """12.3M, 7.48B: parameter counts for the log."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.0f}"


def _thousands(value: float) -> str:
    return f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.0f}"


def median_step_time(steps: list[dict], first: int = 6, last: int = 20) -> float | None:
    """Median step time over steps first..last (1-based, inclusive) that were run; the
    first steps carry warm-up (allocator, autotuning, compilation)."""
    times = [r["step_time_s"] for r in steps if first <= r["step"] <= last]
    return statistics.median(times) if times else None


def mean_loss(steps: list[dict], first: int, last: int) -> float | None:
    losses = [r["loss"] for r in steps if first <= r["step"] <= last]
    return sum(losses) / len(losses) if losses else None


def write_json(path: Path, summary: dict, steps: list[dict]) -> None:
    path.write_text(json.dumps({"summary": summary, "steps": steps}, indent=1) + "\n")


def plot_curves(path: Path, steps: list[dict], title: str) -> Path | None:
    """Loss and tokens/s/GPU against the step; None (with a message) without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    fig = Figure(figsize=(11, 4), layout="constrained")
    loss_ax, speed_ax = fig.subplots(1, 2)
    x = [r["step"] for r in steps]
    loss_ax.plot(x, [r["loss"] for r in steps], label="LM loss")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("cross-entropy (nats/token)")
    loss_ax.grid(alpha=0.3)
    speed_ax.plot(x, [r["tokens_per_s_per_gpu"] for r in steps], color="tab:green")
    speed_ax.set_xlabel("step")
    speed_ax.set_ylabel("tokens / s / GPU")
    speed_ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)
    return path
