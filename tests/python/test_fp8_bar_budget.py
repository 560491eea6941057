"""tools/fp8_bar_budget.py's arithmetic: from per-kernel times split into GEMMs and passes,
each bar's ratio, the ratio with the FP8 side's passes at the bf16 side's cost, and the FP8
GEMM rate the bar needs (as a share of the FP8 peak)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from fp8_bar_budget import budget  # noqa: E402


def _times(gemm: float, passes: float) -> dict:
    return {"gemm_us": gemm, "passes_us": passes, "total_us": gemm + passes}


def _preset():
    # T k H I = 1000 * 1 * 1000 * 500: forward GEMMs 3 GFLOP, backward 6.
    kernels = {}
    for precision, fwd, bwd in (("bf16", (1800, 200), (3600, 400)),
                                ("fp8", (1200, 300), (2400, 900)),
                                ("fp8_bwd", (1800, 200), (2500, 800))):
        f, b = _times(*fwd), _times(*bwd)
        kernels[precision] = {"fwd": f, "bwd": b,
                              "fwd_bwd": {key: f[key] + b[key] for key in f}}
    return {"shape": {"H": 1000, "I": 500, "E": 8, "k": 1}, "tokens": 1000, "kernels": kernels}


def test_each_bar_from_the_kernel_split():
    rows = {r["bar"]: r for r in budget(_preset(), peak_bf16=2.0, peak_fp8=4.0)}
    fwd = rows["fp8 forward"]
    assert fwd["ratio"] == pytest.approx(2000 / 1500)
    assert fwd["ratio_fp8_passes_at_bf16_cost"] == pytest.approx(2000 / 1400)
    # 3 GFLOP in 1800 us is 1.667 TFLOP/s: 83.3% of a 2 TFLOP/s peak.
    assert fwd["bf16_gemm_share_of_bf16_peak"] == pytest.approx(3e9 / 1800e-6 / 1e12 / 2.0)
    assert fwd["fp8_gemm_share_of_fp8_peak"] == pytest.approx(3e9 / 1200e-6 / 1e12 / 4.0)
    # 1.5x allows 1333.3 us; less the 300 us of FP8 passes, 1033.3 us of GEMMs.
    assert fwd["fp8_gemm_share_needed"] == pytest.approx(3e9 / (2000 / 1.5 - 300) / 1e6 / 4.0)
    assert fwd["fp8_gemm_share_needed_bf16_passes"] == pytest.approx(
        3e9 / (2000 / 1.5 - 200) / 1e6 / 4.0)
    both = rows["fp8 forward + backward"]
    assert both["ratio"] == pytest.approx(6000 / 4800)
    assert both["fp8_gemm_share_needed"] == pytest.approx(9e9 / (6000 / 1.35 - 1200) / 1e6 / 4.0)
    bwd = rows["fp8_bwd backward"]  # the backward alone: fwd_bwd less fwd
    assert bwd["ratio"] == pytest.approx(4000 / 3300)
    assert bwd["fp8_gemm_share_of_fp8_peak"] == pytest.approx(6e9 / 2500e-6 / 1e12 / 4.0)
    peak = rows["fp8 forward, share of the FP8 peak"]
    assert peak["ratio"] == pytest.approx(3e9 / 1500e-6 / 1e12 / 4.0)
    # 65% of 4 TFLOP/s allows 1153.8 us; less 300 us of passes.
    assert peak["fp8_gemm_share_needed"] == pytest.approx(3e9 / (3e9 / 2.6e12 * 1e6 - 300) / 1e6 / 4.0)


def test_a_bar_the_passes_alone_exceed_needs_no_rate():
    preset = _preset()
    preset["kernels"]["fp8"]["fwd"] = _times(1200, 1400)  # passes past the 1333 us allowed
    rows = {r["bar"]: r for r in budget(preset, peak_bf16=2.0, peak_fp8=4.0)}
    assert rows["fp8 forward"]["fp8_gemm_share_needed"] is None
    assert rows["fp8 forward"]["fp8_gemm_share_needed_bf16_passes"] is not None
