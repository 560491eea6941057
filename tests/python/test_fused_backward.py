"""backend="fused" forward + backward on one GPU against the float64 reference: both backward
modes, poisoned outputs, awkward shapes, skewed routing, bitwise reproducibility, CUDA-graph
replay, torch.compile."""

import ctypes

import pytest
import torch

import megamoe
from megamoe import _lib, reference
from megamoe._fused_op import (backward_workspace_bytes, fused_moe_backward, fused_moe_forward,
                               workspace_bytes)
from moe_testing import FUSED_CASES as CASES
from moe_testing import dp_error_and_bound, make_problem, needs_cuda, rel_err, run_with_grads

pytestmark = [needs_cuda, pytest.mark.gpu]
ARGS = ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")
GRADS = ("x", "topk_weights", "w_gate_up", "w_down")
MODES = ("recompute", "saved")
PRESETS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen3-235b-a22b": (4096, 1536, 128, 8)}


def _args(p):
    return [p[n] for n in ARGS]


def _nan_like(t, dtype=None):
    return torch.full_like(t, float("nan"), dtype=dtype or t.dtype)


def _poisoned_backward(p, mode):
    """Calls the C ABI with NaN-filled gradients, saved h and workspaces, so an element the
    kernels fail to write shows up as NaN."""
    T, H = p["x"].shape
    k = p["topk_ids"].shape[1]
    E, two_I, _ = p["w_gate_up"].shape
    I = two_I // 2
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    weights = p["topk_weights"].float().contiguous()
    args = [p["x"], p["topk_ids"], weights, p["w_gate_up"], p["w_down"]]
    h = None
    if mode == "saved":
        y = _nan_like(p["x"])
        h = torch.full((T * k, two_I), float("nan"), dtype=torch.bfloat16, device="cuda")
        nbytes = workspace_bytes(T, k, H, I, E)
        ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")
        d = [_lib.describe(t) for t in (*args, y, h)]
        _lib.call("megamoe_fused_forward", *(_lib.ref(v) for v in d),
                  ctypes.c_void_p(ws.data_ptr()), nbytes, stream)
    grads = [_nan_like(p["x"]), _nan_like(weights), _nan_like(p["w_gate_up"]),
             _nan_like(p["w_down"])]
    nbytes = backward_workspace_bytes(T, k, H, I, E, h is not None)
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")
    d = [_lib.describe(t) for t in (p["dy"], *args)]
    d.append(_lib.describe(h) if h is not None else None)
    d += [_lib.describe(g) for g in grads]
    _lib.call("megamoe_fused_backward", *(_lib.ref(v) for v in d),
              ctypes.c_void_p(ws.data_ptr()), nbytes, stream)
    torch.cuda.synchronize()
    return grads


def _check_grads(label, grads, ref, p):
    """Relative Frobenius errors under 1e-2; d topk_weights by moe_testing.dp_error_and_bound
    (its bound grows with the bf16 noise of problems with few slots)."""
    errs = {name: (rel_err(g, r), 1e-2) for name, g, r in zip(GRADS, grads, ref)}
    errs["topk_weights"] = dp_error_and_bound(grads[1], ref[1], p)
    print(f"{label}: " + ", ".join(f"d{n} {e:.2e} (< {b:.1e})" for n, (e, b) in errs.items()))
    for name, (err, bound) in errs.items():
        assert err < bound, f"d{name}: error {err:.3e}, bound {bound:.1e}"




@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T,H,I,E,k,extra", CASES)
def test_fused_backward_matches_float64_reference(T, H, I, E, k, extra, mode):
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=T + E + 1, **extra)
    grads = _poisoned_backward(p, mode)
    ref = reference.backward(p["dy"], *_args(p))
    _check_grads(f"T={T} H={H} I={I} E={E} k={k} {extra} {mode}", grads, ref, p)
    # -1 slots get exactly zero gradient.
    assert torch.all(grads[1][p["topk_ids"] < 0] == 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset,T", [("qwen3-30b-a3b", 16384), ("qwen3-235b-a22b", 4096)])
def test_fused_autograd_presets(preset, T, mode):
    H, I, E, k = PRESETS[preset]
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=T + 2,
                     invalid_fraction=0.01)
    y, grads = run_with_grads(megamoe.moe, p, backend="fused", backward_mode=mode)
    ref_y = reference.forward(*_args(p))
    ref = reference.backward(p["dy"], *_args(p))
    assert rel_err(y, ref_y) < 1e-2
    _check_grads(f"{preset} T={T} {mode}", [grads[n] for n in GRADS], ref, p)
    assert grads["topk_weights"].dtype == p["topk_weights"].dtype


def _skewed_ids(T, E, k, kind, seed):
    """Routings a learned router produces on repetitive text, at training scale."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, generator=g, device="cuda")
    if kind == "one_set":      # every token picks the same k experts: k of 16384 rows each
        logits[:, :k] += 100.0
    elif kind == "hot_bias":   # a few experts take most tokens, many get none
        logits += torch.linspace(8.0, -8.0, E, device="cuda") ** 3 / 64.0
    elif kind == "runs":       # long runs of identical tokens route identically
        logits = logits[torch.arange(T, device="cuda") // 1024]
    return torch.topk(logits, k, dim=1).indices


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["one_set", "hot_bias", "runs"])
def test_fused_training_scale_skewed_routing(kind, mode):
    H, I, E, k = PRESETS["qwen3-30b-a3b"]
    T = 16384
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=13)
    p["topk_ids"] = _skewed_ids(T, E, k, kind, 1000 + len(kind))
    counts = torch.bincount(p["topk_ids"].flatten(), minlength=E)
    with torch.no_grad():
        y = megamoe.moe(*_args(p), backend="fused")
    err = rel_err(y, reference.forward(*_args(p)))
    print(f"{kind}: largest expert {int(counts.max())} rows, {int((counts == 0).sum())} "
          f"experts empty, y rel err {err:.2e}")
    assert err < 1e-2
    grads = _poisoned_backward(p, mode)
    ref = reference.backward(p["dy"], *_args(p))
    _check_grads(f"{kind} {mode}", grads, ref, p)


def test_fused_modes_agree_bitwise_and_repeat():
    p = make_problem(3000, 512, 256, 32, 4, dtype=torch.bfloat16, device="cuda", seed=5,
                     invalid_fraction=0.05)
    runs = [run_with_grads(megamoe.moe, p, backend="fused", backward_mode=m)
            for m in ("recompute", "recompute", "saved")]
    for y, grads in runs[1:]:
        assert torch.equal(y, runs[0][0])
        for n in GRADS:
            assert torch.equal(grads[n], runs[0][1][n]), n


def test_fused_bf16_router_weights_and_partial_grads():
    p = make_problem(200, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=9)
    p["topk_weights"] = p["topk_weights"].to(torch.bfloat16)
    _, grads = run_with_grads(megamoe.moe, p, backend="fused")
    assert grads["topk_weights"].dtype == torch.bfloat16
    ref = reference.backward(p["dy"], *_args(p))
    _check_grads("bf16 router weights", [grads[n] for n in GRADS], ref, p)
    # Only x requires grad: the weight gradients are not computed.
    x = p["x"].clone().requires_grad_(True)
    megamoe.moe(x, *_args(p)[1:], backend="fused").backward(p["dy"])
    assert rel_err(x.grad, ref[0]) < 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_fused_forward_backward_graph_replay_matches_eager(mode):
    p = make_problem(1500, 512, 256, 16, 4, dtype=torch.bfloat16, device="cuda", seed=11,
                     invalid_fraction=0.05)
    needs = [True] * 4
    save = mode == "saved"

    def step():
        y, h = fused_moe_forward(*_args(p), save, None, None)
        grads = fused_moe_backward(p["dy"], p["x"], p["topk_ids"], p["topk_weights"],
                                   p["w_gate_up"], p["w_down"], h, needs, None, None)
        return (y, *grads)

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static = step()
    for t in static:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(static, eager):
        assert torch.equal(got, want)


def test_fused_under_torch_compile():
    p = make_problem(256, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=13)

    def layer(x, ids, w, w1, w2):
        return megamoe.moe(x, ids, w, w1, w2, backend="fused", backward_mode="saved")

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y, grads = run_with_grads(compiled, p)
    y_eager, grads_eager = run_with_grads(layer, p)
    assert torch.equal(y, y_eager)
    for n in GRADS:
        assert torch.equal(grads[n], grads_eager[n]), n


def test_fused_backward_mode_is_checked():
    p = make_problem(8, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=1)
    with pytest.raises(megamoe.MegaMoEError, match="backward_mode"):
        megamoe.moe(*_args(p), backend="fused", backward_mode="keep")


@pytest.mark.parametrize("mode", MODES)
def test_fused_weight_grads_accumulate_into_fp32_buffers(mode):
    p = make_problem(700, 256, 128, 16, 4, dtype=torch.bfloat16, device="cuda", seed=17,
                     invalid_fraction=0.05)
    ref = reference.backward(p["dy"], *_args(p))
    acc = (torch.full(p["w_gate_up"].shape, 0.5, device="cuda"),
           torch.full(p["w_down"].shape, 0.5, device="cuda"))
    leaves = {n: p[n].detach().clone().requires_grad_(True) for n in GRADS}
    for step in range(2):  # two micro-batches into the same buffers
        y = megamoe.moe(leaves["x"], p["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"],
                        leaves["w_down"], backend="fused", backward_mode=mode,
                        weight_grad_accumulators=acc)
        y.backward(p["dy"])
    assert leaves["w_gate_up"].grad is None and leaves["w_down"].grad is None
    assert rel_err(leaves["x"].grad, 2 * ref[0]) < 1e-2  # x still gets its (summed) gradient
    for got, want, name in ((acc[0], ref[2], "d w_gate_up"), (acc[1], ref[3], "d w_down")):
        err = rel_err((got.double() - 0.5) / 2, want)
        print(f"{mode}: {name} accumulated over 2 steps in fp32: rel err {err:.2e}")
        assert err < 1e-2
