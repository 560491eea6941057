"""megamoe-bench end to end on the CPU reference (tiny preset), its errors, its JSON
record, and (with a GPU) a short GPU run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megamoe
from megamoe import _clocks, bench
from megamoe.presets import PRESETS, get_preset

TOP_LEVEL_KEYS = {
    "gpu", "num_gpus", "world_size", "commit", "command", "argv", "launcher", "date",
    "torch_version", "cuda_version", "megamoe_version", "python_version", "gemm_peak_tflops",
    "gemm_peak_sustained_tflops",
    "device", "cpu_smoke_run", "settings", "method", "rows",
}
ROW_KEYS = {
    "model", "H", "I", "E", "k", "tokens_per_rank", "ep", "backend", "precision", "dtype",
    "routing", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "full_layer_ms", "fwd_tflops", "pct_of_peak",
    "pct_of_sustained_peak", "speedup_fwd_vs_torch", "speedup_full_vs_torch", "backward_mode", "status",
    "sm_mhz", "power_w",
}
QUICK = ["--iters", "3", "--warmup", "1", "--input-sets", "2", "--tokens", "64"]


def run_bench(tmp_path, *extra):
    assert bench.main(["--cpu", "--out-dir", str(tmp_path), *QUICK, *extra]) == 0
    json_files = sorted(tmp_path.glob("*.json"))
    assert len(json_files) == 1
    return json_files[0], json.loads(json_files[0].read_text())


def test_presets():
    assert (PRESETS["qwen3-30b-a3b"].H, PRESETS["qwen3-30b-a3b"].I) == (2048, 768)
    assert (PRESETS["qwen3-235b-a22b"].H, PRESETS["qwen3-235b-a22b"].I) == (4096, 1536)
    assert all((s.E, s.k) == (128, 8) for n, s in PRESETS.items() if n.startswith("qwen3"))
    assert get_preset("tiny").forward_flops(10) == 6 * 10 * 2 * 64 * 32
    with pytest.raises(ValueError, match="unknown model preset 'llama'; valid presets: .*qwen3-30b-a3b"):
        get_preset("llama")


def test_cpu_run_writes_a_complete_record(tmp_path, capsys):
    path, record = run_bench(tmp_path, "--no-plot", "--routing", "balanced")
    out = capsys.readouterr().out

    assert path.name == "cpu-tiny_t64_ep1_balanced.json"
    assert "CPU run of the C++ reference" in out and "NOT a GPU benchmark" in out
    assert "full layer ms" in out and "reference" in out  # the table
    assert not list(tmp_path.glob("*.png"))

    assert TOP_LEVEL_KEYS <= record.keys()
    assert record["gpu"] == "cpu" and record["num_gpus"] == 0 and record["cpu_smoke_run"]
    assert record["gemm_peak_tflops"] is None and record["gemm_peak_sustained_tflops"] is None
    assert record["megamoe_version"] == megamoe.__version__
    assert record["torch_version"] == torch.__version__
    if os.environ.get("MEGAMOE_BENCH_COMMIT"):  # the override for a tree without .git
        assert record["commit"] == os.environ["MEGAMOE_BENCH_COMMIT"]
    else:
        assert record["commit"] == "unknown" or len(record["commit"].removesuffix("-dirty")) == 40
    assert record["command"].startswith("megamoe-bench --cpu --out-dir")
    assert record["date"].endswith("+00:00")

    [row] = record["rows"]
    assert ROW_KEYS <= row.keys()
    assert (row["model"], row["H"], row["I"], row["E"], row["k"]) == ("tiny", 64, 32, 8, 2)
    assert (row["tokens_per_rank"], row["ep"], row["backend"]) == (64, 1, "reference")
    assert (row["routing"], row["backward_mode"], row["status"]) == ("balanced", "recompute", "ok")
    assert row["fwd_ms"] > 0 and row["bwd_ms"] > 0
    assert row["fwd_bwd_ms"] == pytest.approx(row["fwd_ms"] + row["bwd_ms"])
    assert row["full_layer_ms"] == pytest.approx(2 * row["fwd_ms"] + row["bwd_ms"])
    flops = 6 * 64 * 2 * 64 * 32
    assert row["fwd_tflops"] == pytest.approx(flops / (row["fwd_ms"] * 1e-3) / 1e12)
    assert row["pct_of_peak"] is None and row["speedup_fwd_vs_torch"] is None
    assert row["sm_mhz"] is None and row["power_w"] is None  # no GPU clock to sample
    assert record["settings"]["settle_seconds"] == 0  # the CPU default: nothing to settle
    assert "SM MHz" in out


def test_rows_settle_before_they_are_timed(tmp_path, monkeypatch):
    calls = []
    timer = bench.time_forward_backward

    def counting_timer(call, weights, input_sets, iterations, clock):
        calls.append(iterations)
        return timer(call, weights, input_sets, iterations, clock)

    monkeypatch.setattr(bench, "time_forward_backward", counting_timer)
    _, record = run_bench(tmp_path, "--no-plot", "--settle-seconds", "0.05")
    assert record["settings"]["settle_seconds"] == 0.05
    # The warm-up, then chunks of untimed calls until 0.05 s have passed, then the timed ones.
    assert calls[0] == 1 and calls[-1] == 3
    assert len(calls) >= 3 and set(calls[1:-1]) == {bench.SETTLE_CHUNK}


def test_settling_under_ep_follows_the_slowest_rank(monkeypatch):
    # Every rank must run the same chunks (the layer's collectives pair them up): the
    # decision to stop is taken on the largest elapsed time over the ranks.
    chunks, agreed = [], []

    def max_over_ranks(values, run):
        agreed.append(values[0])
        return [values[0] + (10.0 if len(agreed) == 2 else 0.0)]  # the 2nd: a slow peer

    monkeypatch.setattr(bench, "_max_over_ranks", max_over_ranks)
    run = bench.RunContext(device=torch.device("cpu"), is_cuda=False, world_size=2, group=object())
    bench.settle(lambda: chunks.append(1), 5.0, run)
    assert len(chunks) == 2 and len(agreed) == 2


def test_gpu_backends_are_skipped_on_cpu_and_speedups_need_torch(tmp_path):
    _, record = run_bench(tmp_path, "--no-plot", "--backends", "torch,fused,reference",
                          "--model", "tiny", "--name", "mixed")
    status = {row["backend"]: row["status"] for row in record["rows"]}
    assert status["reference"] == "ok"
    assert status["torch"].startswith("skipped: backend 'torch' needs a CUDA GPU")
    assert status["fused"].startswith("skipped:")
    # One fused row per backward mode, each saying which.
    assert [(r["backend"], r["backward_mode"]) for r in record["rows"]] == [
        ("torch", "autograd"), ("fused", "recompute"), ("fused", "saved"),
        ("reference", "recompute")]
    assert record["settings"]["fused_backward_modes"] == ["recompute", "saved"]
    assert all(row["speedup_full_vs_torch"] is None for row in record["rows"])
    assert (tmp_path / "mixed.json").exists()


def test_not_implemented_is_reported_as_skipped(tmp_path, monkeypatch):
    def not_built(*args, **kwargs):
        raise megamoe.NotBuiltError("fused kernels are not built yet")

    monkeypatch.setattr(megamoe, "moe", not_built)
    _, record = run_bench(tmp_path, "--no-plot")
    [row] = record["rows"]
    assert row["status"] == "skipped: NotBuiltError: fused kernels are not built yet"
    assert row["fwd_ms"] is None and row["full_layer_ms"] is None


def test_other_errors_propagate(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel fault")

    monkeypatch.setattr(megamoe, "moe", broken)
    with pytest.raises(RuntimeError, match="kernel fault"):
        bench.main(["--cpu", "--out-dir", str(tmp_path), *QUICK, "--no-plot"])


def test_speedups_compare_with_the_torch_row_of_the_same_config():
    def row(backend, model, fwd, full, status="ok"):
        return {"model": model, "tokens_per_rank": 8, "ep": 1, "routing": "random",
                "precision": "bf16", "backend": backend, "fwd_ms": fwd, "full_layer_ms": full,
                "status": status, "speedup_fwd_vs_torch": None, "speedup_full_vs_torch": None}

    rows = [row("torch", "a", 4.0, 12.0), row("fused", "a", 1.0, 4.0),
            row("fused", "b", 1.0, 4.0), row("torch", "c", None, None, "skipped: x"),
            row("fused", "c", 1.0, 3.0)]
    bench.add_speedups(rows)
    assert (rows[0]["speedup_fwd_vs_torch"], rows[0]["speedup_full_vs_torch"]) == (1.0, 1.0)
    assert (rows[1]["speedup_fwd_vs_torch"], rows[1]["speedup_full_vs_torch"]) == (4.0, 3.0)
    assert rows[2]["speedup_fwd_vs_torch"] is None  # no torch row for model b
    assert rows[4]["speedup_fwd_vs_torch"] is None  # torch was skipped for model c


def test_speedups_over_bf16_compare_the_same_backend_and_mode():
    def row(backend, precision, mode, fwd, bwd):
        return {"model": "a", "tokens_per_rank": 8, "ep": 1, "routing": "random",
                "precision": precision, "backend": backend, "backward_mode": mode, "fwd_ms": fwd,
                "bwd_ms": bwd, "fwd_bwd_ms": fwd + bwd, "full_layer_ms": 2 * fwd + bwd,
                "status": "ok"}

    rows = [row("fused", "bf16", "saved", 2.0, 4.0), row("fused", "fp8", "saved", 1.0, 2.0),
            row("fused", "bf16", "recompute", 3.0, 6.0), row("fused", "fp8_bwd", "recompute", 3.0, 3.0),
            row("torch", "fp8", "recompute", 4.0, 4.0)]
    bench.add_speedups(rows)
    assert (rows[1]["speedup_fwd_vs_bf16"], rows[1]["speedup_bwd_vs_bf16"],
            rows[1]["speedup_fwd_bwd_vs_bf16"]) == (2.0, 2.0, 2.0)
    assert (rows[3]["speedup_fwd_vs_bf16"], rows[3]["speedup_bwd_vs_bf16"]) == (1.0, 2.0)
    assert rows[4].get("speedup_fwd_vs_bf16") is None  # no torch bf16 row
    assert rows[0].get("speedup_fwd_vs_bf16") is None


@pytest.mark.parametrize("args,message", [
    (["--model", "llama"], "unknown model preset 'llama'; valid presets:"),
    (["--backends", "torch,cutlass"], "unknown backend(s) cutlass; valid backends: torch, fused, reference"),
    (["--tokens", "1k"], "--tokens takes integers"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--num-comm-sms", "0"], "--num-comm-sms must be >= 1, got 0"),
    (["--sustained-peak-seconds", "-1"], "--sustained-peak-seconds must be >= 0, got -1.0"),
    (["--settle-seconds", "-0.5"], "--settle-seconds must be >= 0, got -0.5"),
    (["--ep", "3"], "--ep 3: model tiny has E=8 experts, not divisible by 3"),
    (["--ep", "2"], "--ep 2 needs 2 CUDA GPUs under torchrun, but --cpu was given"),
    (["--routing", "zipf"], "invalid choice: 'zipf'"),
    (["--fused-backward-modes", "recompute,keep"], "--fused-backward-modes: unknown mode(s) keep"),
])
def test_argument_errors_are_clear(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--cpu", "--out-dir", str(tmp_path), *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_plot_is_written_next_to_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    path, _ = run_bench(tmp_path, "--backends", "torch,reference")
    png = path.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_python_dash_m_entry_point(tmp_path):
    package_parent = str(Path(megamoe.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "megamoe.bench", "--cpu", "--out-dir", str(tmp_path), *QUICK,
         "--no-plot", "--name", "cli"],
        capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "cli.json").read_text())
    assert record["command"].startswith("python -m megamoe.bench --cpu")
    assert "[megamoe-bench] tiny T=64/rank ep=1 reference: fwd" in done.stderr


def test_clock_samples_are_read_and_averaged_over_a_window(tmp_path):
    path = tmp_path / "clocks.csv"
    path.write_text(
        "2026/12/06 11:00:00.000, 1500, 690.5, 60, Active, Not Active\n"
        "2026/12/06 11:00:00.500, 1600, 700.5, 61, Not Active, Not Active\n"
        "[N/A], [N/A], [N/A], 61, Active, Not Active\n"  # a line nvidia-smi could not fill
        "2026/12/06 11:00:01.000, 1700, 699.0\n"  # cut short when nvidia-smi was stopped
        "2026/12/06 11:00:02.000, 1000, 100.0, 40, Not Active, Not Active\n")
    samples = _clocks.read_samples(str(path))
    assert [s[1] for s in samples] == [1500, 1600, 1000]
    assert samples[1][0] - samples[0][0] == pytest.approx(0.5)
    start = samples[0][0]
    mhz, watts, capped = _clocks.window_means(samples, start, start + 0.6)
    assert (mhz, watts, capped) == (pytest.approx(1550), pytest.approx(695.5), 0.5)
    assert _clocks.window_means(samples, start + 0.7, start + 0.9) is None


def test_clock_sampler_without_nvidia_smi_samples_nothing(monkeypatch):
    monkeypatch.setattr(_clocks.shutil, "which", lambda name: None)
    sampler = _clocks.ClockSampler("0")
    assert not sampler.available and os.path.exists(sampler.path)
    assert sampler.close() == [] and not os.path.exists(sampler.path)
    assert sampler.close() == []  # a second close is harmless


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_clock_sampler_samples_this_gpu(tmp_path):
    import shutil
    import time

    if shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi")
    sampler = _clocks.ClockSampler(_clocks.gpu_selector(torch.device("cuda")), 20,
                                   str(tmp_path / "clocks.csv"))
    began = time.time()
    time.sleep(0.5)
    samples = sampler.close()
    assert samples, (tmp_path / "clocks.csv").read_text()[:500]
    mhz, watts, _ = _clocks.window_means(samples, began - 1, time.time() + 1)
    assert mhz > 0 and watts > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_short_gpu_run(tmp_path, capsys):
    assert bench.main(["--out-dir", str(tmp_path), "--model", "tiny", "--tokens", "256",
                       "--backends", "torch,fused,reference", "--iters", "3", "--warmup", "1",
                       "--no-plot", "--name", "gpu", "--sustained-peak-seconds", "0.5",
                       "--settle-seconds", "0.2"]) == 0
    record = json.loads((tmp_path / "gpu.json").read_text())
    assert record["gpu"] == torch.cuda.get_device_name() and record["num_gpus"] == 1
    assert record["gemm_peak_tflops"] > 10
    # The sustained peak is the same matmul held longer: never above the short one by more
    # than timing noise.
    assert 10 < record["gemm_peak_sustained_tflops"] < 1.05 * record["gemm_peak_tflops"]
    rows = {row["backend"]: row for row in record["rows"]}
    assert rows["torch"]["status"] == "ok" and rows["torch"]["dtype"] == "bfloat16"
    assert rows["torch"]["speedup_fwd_vs_torch"] == 1.0
    assert rows["torch"]["pct_of_peak"] > 0
    assert rows["torch"]["pct_of_sustained_peak"] >= 0.95 * rows["torch"]["pct_of_peak"]
    assert rows["reference"]["status"] == "ok"
    # The tiny preset (H=64, I=32) is below the fused kernels' multiples of 128.
    assert rows["fused"]["status"].startswith("skipped:") and "multiples of 128" in rows["fused"]["status"]
