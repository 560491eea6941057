"""tools/check_training_layers.py --grads-at-step on the tiny CPU model (reference backend):
the gradients of every experts call of step 2, replayed outside the run, match float64 and
the run's own backward; a backend whose down_proj gradient is 1.1x too large shows 1.1."""

import gc
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import check_training_layers as ctl  # noqa: E402

import megamoe.integrations.transformers as mt  # noqa: E402
from megamoe import torch_backend  # noqa: E402
from megamoe.train import trainer  # noqa: E402
from transformers.integrations import moe as hf_moe  # noqa: E402

GRADS = ("dx", "d_topk_weights", "d_gate_up_proj", "d_down_proj")


def _check(out: Path, *extra: str) -> list[dict]:
    argv = [str(out), "--grads-at-step", "2", *extra, "default-cpu", "--train.steps", "4",
            "--log.dir", str(out / "log"), "--log.plot", "false"]
    assert ctl.main(argv) == 0
    return [json.loads(line) for line in (out / "grads.jsonl").read_text().splitlines()]


# The reference backend's tolerance per run dtype: an fp32 run is float64 to fp32 rounding;
# a bf16 run (bf16 compute copies of fp32 masters, refreshed in place after each step, as on
# a GPU) rounds y and the gradients to bf16.
@pytest.mark.parametrize("dtype, ref_tol", [("fp32", 1e-6), ("bf16", 5e-3)])
def test_step_gradients_match_float64_and_the_run(tmp_path, monkeypatch, dtype, ref_tol):
    moe, experts = mt.moe, hf_moe.ALL_EXPERTS_FUNCTIONS["megamoe"]
    # The checks run once the run's model and optimizer are gone (on a GPU, their memory).
    setup, run_checks, alive = trainer._setup_training, ctl.run_checks, {}

    def kept_setup(*args, **kwargs):
        made = setup(*args, **kwargs)
        alive["refs"] = [weakref.ref(made.model), weakref.ref(made.optimizer)]
        return made

    def checks(*args):
        gc.collect()
        alive["at_checks"] = [ref() is not None for ref in alive["refs"]]
        return run_checks(*args)

    monkeypatch.setattr(trainer, "_setup_training", kept_setup)
    monkeypatch.setattr(ctl, "run_checks", checks)
    rows = _check(tmp_path, "--train.dtype", f'"{dtype}"')
    assert alive["at_checks"] == [False, False]
    # The tool leaves the integration as it found it.
    assert mt.moe is moe and hf_moe.ALL_EXPERTS_FUNCTIONS["megamoe"] is experts
    assert [(r["step"], r["layer"]) for r in rows] == [(2, 0), (2, 1)]
    # The run stopped after step 2.
    logged = (tmp_path / "log" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in logged] == [1, 2]
    for row in rows:
        assert row["backend"] == "reference" and row["tokens"] == 512
        assert row["recompute_inputs_equal"] is True  # activation checkpointing's recompute
        assert max(row["float64_crosscheck"].values()) < 1e-12
        assert all(row["norm64"][name] > 0 for name in ctl.QUANTITIES)
        # The torch backend in bf16 (on bf16 inputs) is a few 1e-3 from float64.
        for label, rel, scale in (("reference", ref_tol, ref_tol), ("torch", 2e-2, 5e-3)):
            for name in ctl.QUANTITIES:
                m = row["vs_float64"][label][name]
                assert m["rel"] < rel and m["max_rel"] < 2 * rel, (label, name, m)
                assert abs(m["norm_ratio"] - 1) < scale and abs(m["proj"] - 1) < scale
                assert m["cos"] > 1 - rel
        # The replayed backward is the run's own, bit for bit: the captured inputs and dy
        # are those of the call's backward, and dx is the experts' share of x's gradient
        # (the router's is not in it).
        assert all(row["replay"][name]["bitwise_equal"] for name in ctl.QUANTITIES), row["replay"]
    summary = (tmp_path / "grads-summary.txt").read_text()
    for name in ctl.QUANTITIES:
        assert any(line.strip().startswith(f"{name} ") and "reference" in line
                   and "closer than torch" in line for line in summary.splitlines())


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, scale):
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def test_a_scaled_weight_gradient_shows_in_the_ratio(tmp_path, monkeypatch):
    inner = torch_backend.moe

    def scaled(x, ids, p, w_gate_up, w_down, group=None, precision="bf16"):
        return inner(x, ids, p, w_gate_up, _ScaleGrad.apply(w_down, 1.1), group, precision)

    monkeypatch.setattr(torch_backend, "moe", scaled)
    rows = _check(tmp_path, "--grads-calls", "1")
    assert [r["layer"] for r in rows] == [0]
    torch_row, ref_row = rows[0]["vs_float64"]["torch"], rows[0]["vs_float64"]["reference"]
    down = torch_row["d_down_proj"]
    assert down["norm_ratio"] == pytest.approx(1.1, abs=5e-3)
    assert down["proj"] == pytest.approx(1.1, abs=5e-3)
    assert down["rel"] == pytest.approx(0.1, abs=1e-2) and down["cos"] > 0.999
    for name in ("y", "dx", "d_topk_weights", "d_gate_up_proj"):
        assert torch_row[name]["norm_ratio"] == pytest.approx(1, abs=5e-3)
    assert all(ref_row[name]["norm_ratio"] == pytest.approx(1, abs=1e-6) for name in GRADS)
    verdict = next(line for line in (tmp_path / "grads-summary.txt").read_text().splitlines()
                   if line.strip().startswith("d_down_proj "))
    assert "torch ratio 1.09" in verdict or "torch ratio 1.10" in verdict
