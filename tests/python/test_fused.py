"""backend="fused" (forward) on one GPU against the float64 reference: shapes that break
kernels, poisoned outputs, bitwise reproducibility, CUDA-graph replay."""

import ctypes

import pytest
import torch

import megamoe
from megamoe import _lib, reference
from megamoe._fused_op import workspace_bytes
from moe_testing import FUSED_CASES as CASES
from moe_testing import make_problem, needs_cuda, rel_err

pytestmark = [needs_cuda, pytest.mark.gpu]
ARGS = ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")


def _args(p):
    return [p[n] for n in ARGS]


def _fused_into(p, y, workspace):
    """Calls the C ABI directly so the test owns (and poisons) y and the workspace."""
    T, H = p["x"].shape
    k = p["topk_ids"].shape[1]
    E, two_I, _ = p["w_gate_up"].shape
    nbytes = workspace_bytes(T, k, H, two_I // 2, E)
    assert workspace.numel() >= nbytes
    d = [_lib.describe(t) for t in (*_args(p), y)] + [None]  # no saved h
    _lib.call("megamoe_fused_forward", *(_lib.ref(v) for v in d),
              ctypes.c_void_p(workspace.data_ptr()), nbytes,
              ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))


def _poisoned_run(p):
    T, H = p["x"].shape
    k = p["topk_ids"].shape[1]
    E, two_I, _ = p["w_gate_up"].shape
    y = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    workspace = torch.full((workspace_bytes(T, k, H, two_I // 2, E),), 0xFF, dtype=torch.uint8,
                           device="cuda")
    _fused_into(p, y, workspace)
    torch.cuda.synchronize()
    return y




@pytest.mark.parametrize("T,H,I,E,k,extra", CASES)
def test_fused_forward_matches_float64_reference(T, H, I, E, k, extra):
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=T + E, **extra)
    y = _poisoned_run(p)
    err = rel_err(y, reference.forward(*_args(p)))
    print(f"T={T} H={H} I={I} E={E} k={k} {extra}: rel err {err:.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("preset,T", [("qwen3-30b-a3b", 4096), ("qwen3-235b-a22b", 2048)])
def test_fused_forward_presets(preset, T):
    H, I, E, k = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-235b-a22b": (4096, 1536, 128, 8)}[preset]
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=T,
                     invalid_fraction=0.01)
    with torch.no_grad():
        y = megamoe.moe(*_args(p), backend="fused")
    err = rel_err(y, reference.forward(*_args(p)))
    print(f"{preset} T={T}: rel err {err:.2e}")
    assert err < 1e-2


def test_fused_forward_bitwise_reproducible_and_graph_capturable():
    p = make_problem(3000, 512, 256, 32, 4, dtype=torch.bfloat16, device="cuda", seed=77,
                     invalid_fraction=0.05)
    with torch.no_grad():
        first = megamoe.moe(*_args(p), backend="fused")
        second = megamoe.moe(*_args(p), backend="fused")
        assert torch.equal(first, second)
        static_out = None
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            megamoe.moe(*_args(p), backend="fused")  # warm-up outside capture
            with torch.cuda.graph(graph, stream=stream):
                static_out = megamoe.moe(*_args(p), backend="fused")
        torch.cuda.current_stream().wait_stream(stream)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, first)


def test_fused_limits():
    p = make_problem(8, 192, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=1)
    with pytest.raises(megamoe.MegaMoEError, match="multiples of 128"):
        megamoe.moe(*_args(p), backend="fused")
