"""tools/fp8_bar_budget.py without a GPU: a training call's kernels split into its forward's
and its backward's, GEMMs and passes apart; and from those times each bar's ratio, the ratio
with the FP8 side's passes at the bf16 side's cost, and the FP8 GEMM rate the bar needs (as
a share of the FP8 peak)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import fp8_bar_budget  # noqa: E402
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


class _Range:
    def __init__(self, start, us):
        self.start, self._us = start, us

    def elapsed_us(self):
        return self._us


class _Kernel:
    device_type = torch.autograd.DeviceType.CUDA

    def __init__(self, name, start, us):
        self.name, self.time_range, self.device_time_total = name, _Range(start, us), us


class _Recorder:
    """Stands in for torch.profiler.profile: the kernels the fake layer 'launches' while it
    is open, out of order (the split must sort them by start)."""
    launched = None

    def __init__(self, activities):
        pass

    def __enter__(self):
        _Recorder.launched = []
        return self

    def __exit__(self, *exc):
        return False

    def events(self):
        return list(reversed(_Recorder.launched))


GEMM = "void megamoe::sm90::grouped_gemm_kernel<megamoe::sm90::GroupedGemm<...>>(...)"


def _launch(name, us):
    _Recorder.launched.append(_Kernel(name, len(_Recorder.launched), us))


def test_a_calls_kernels_split_into_its_forward_and_backward(monkeypatch):
    monkeypatch.setattr(fp8_bar_budget, "profile", _Recorder)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def forward():  # 3 kernels: a pass, a GEMM, a pass
        _launch("plan_kernel", 10.0)
        _launch(GEMM, 100.0)
        _launch("combine_rows_kernel", 20.0)
        return "y"

    def backward(y):  # 2 kernels
        assert y == "y"
        _launch(GEMM, 300.0)
        _launch("quantize_fp8_kernel", 40.0)

    t = fp8_bar_budget.split_kernel_times(forward, backward, iters=4)
    assert t["fwd"]["gemm_us"] == pytest.approx(100.0)
    assert t["fwd"]["passes_us"] == pytest.approx(30.0)
    assert t["bwd"]["gemm_us"] == pytest.approx(300.0)
    assert t["bwd"]["passes_us"] == pytest.approx(40.0)
    assert t["fwd_bwd"]["total_us"] == pytest.approx(470.0)
    assert t["fwd"]["kernels"]["plan_kernel"] == pytest.approx(10.0)


def test_a_backward_that_launches_nothing_is_an_error(monkeypatch):
    monkeypatch.setattr(fp8_bar_budget, "profile", _Recorder)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    with pytest.raises(RuntimeError, match="not one forward and one backward"):
        fp8_bar_budget.split_kernel_times(lambda: _launch(GEMM, 1.0), lambda y: None, iters=2)


def test_forwards_alone_split_into_gemms_and_passes(monkeypatch):
    monkeypatch.setattr(fp8_bar_budget, "profile", _Recorder)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def forward():
        _launch("plan_kernel", 10.0)
        _launch(GEMM, 100.0)
        _launch(GEMM, 50.0)
        return "y"

    t = fp8_bar_budget.forward_alone_times(forward, iters=5)
    assert t["gemm_us"] == pytest.approx(150.0)
    assert t["passes_us"] == pytest.approx(10.0)
    assert t["total_us"] == pytest.approx(160.0)
