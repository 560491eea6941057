"""precision="fp8" and "fp8_bwd" of backend="fused" (the blockwise-FP8 GEMMs of
csrc/kernels/sm90/mainloop_fp8.cuh): the forward and every gradient against the float64
layer of the unquantized inputs, on both presets and the bf16 tests' awkward shapes and
routings, both backward modes; bitwise reproducibility, the two modes' agreement, a CUDA
graph, torch.compile, and the weight cache. GPU only (the fused backend runs on sm_90a).

The bound is test_torch_fp8's: e4m3's 3 mantissa bits put the layer's outputs at ~6.6% of
the float64 ones (the format's floor; docs/fp8.md); a NaN fails."""

import pytest
import torch

import megamoe
from megamoe.weight_cache import shared_cache
from moe_testing import FUSED_CASES, make_problem, needs_cuda, rel_err, run_with_grads
from test_torch_fp8 import ARGS, PRESETS, _check_against_float64

pytestmark = [needs_cuda, pytest.mark.gpu]

PRECISIONS = ("fp8", "fp8_bwd")
MODES = ("recompute", "saved")


def _used_experts(p, E):
    used = torch.zeros(E, dtype=torch.bool, device=p["topk_ids"].device)
    used[p["topk_ids"][p["topk_ids"] >= 0].unique()] = True
    return used


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_match_float64_reference(preset, precision, mode):
    H, I, E, k = PRESETS[preset]
    p = make_problem(4096, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=4096,
                     invalid_fraction=0.02, skip_experts=(5,))
    print(preset, precision, mode)
    errors, grads = _check_against_float64(p, backend="fused", precision=precision,
                                           backward_mode=mode)
    if precision == "fp8_bwd":  # the forward is the bf16 one
        assert errors["y"] < 1e-2, errors
    assert torch.all(grads["w_gate_up"][5] == 0) and torch.all(grads["w_down"][5] == 0)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("T,H,I,E,k,extra", FUSED_CASES)
def test_awkward_shapes_and_routings(T, H, I, E, k, extra, precision):
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=T + 23, **extra)
    print((T, H, I, E, k), precision)
    _, grads = _check_against_float64(p, backend="fused", precision=precision,
                                      backward_mode="recompute")
    used = _used_experts(p, E)
    for name in ("w_gate_up", "w_down"):
        assert torch.all(grads[name][~used] == 0), name
    assert torch.all(grads["topk_weights"][p["topk_ids"] == -1] == 0)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_bitwise_reproducible_and_modes_agree(precision):
    """Two runs give the same bits; the saved mode's backward reads the forward's h, which
    the recompute mode recomputes with the same GEMM arithmetic: the same bits again."""
    p = make_problem(3000, 512, 256, 32, 4, dtype=torch.bfloat16, device="cuda", seed=7,
                     invalid_fraction=0.05)
    runs = [run_with_grads(megamoe.moe, p, backend="fused", precision=precision,
                           backward_mode=mode) for mode in ("recompute", "recompute", "saved")]
    (y0, g0), (y1, g1), (y2, g2) = runs
    assert torch.equal(y0, y1) and torch.equal(y0, y2)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
        assert torch.equal(g0[name], g2[name]), name


GATHER_A_CASES = [  # T, H, I, E, k, extra: a tail tile, dropped slots, empty experts, k = 1
    (3000, 512, 256, 32, 4, dict(invalid_fraction=0.05, skip_experts=(3,))),
    (7, 256, 128, 8, 2, dict(invalid_fraction=0.2)),
    (1000, 256, 384, 8, 1, dict(skip_experts=(0, 1, 2, 3, 4, 5))),
    (257, 128, 128, 512, 16, dict(invalid_fraction=0.1)),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("T,H,I,E,k,extra", GATHER_A_CASES)
def test_sorted_fp8_rows_match_the_gathered_path(T, H, I, E, k, extra, precision, mode,
                                                 monkeypatch):
    """x and dy quantized straight into the sorted rows (A by TMA, the default) and
    MEGAMOE_FP8_GATHER_A=1 (token matrices, A rows gathered by the GEMMs' producer; read by
    the library on every call): the same values and scales into the same GEMM arithmetic,
    so y and every gradient but d topk_weights have the same bits. The gathered GEMMs run
    128-wide tiles, the default 256-wide ones where I allows, and d topk_weights sums one
    fp32 partial per N-tile of the L2 dgrad: the same terms, grouped differently."""
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=T + 31, **extra)
    _check_switch_keeps_the_bits(p, "MEGAMOE_FP8_GATHER_A", precision, mode, monkeypatch,
                                 regrouped=("topk_weights",))


def _check_switch_keeps_the_bits(p, variable, precision, mode, monkeypatch, regrouped=()):
    """y and every gradient of problem p, without the library's diagnostic switch `variable`
    and with it set to 1, are bitwise equal (and y finite); those in `regrouped` (fp32 sums
    of the same terms in another grouping) to fp32 rounding."""
    monkeypatch.delenv(variable, raising=False)
    y_default, g_default = run_with_grads(megamoe.moe, p, backend="fused", precision=precision,
                                          backward_mode=mode)
    monkeypatch.setenv(variable, "1")
    y_switched, g_switched = run_with_grads(megamoe.moe, p, backend="fused",
                                            precision=precision, backward_mode=mode)
    assert torch.isfinite(y_default).all()
    assert torch.equal(y_default, y_switched)
    for name in g_default:
        if name in regrouped:
            # fp32 regrouping moves a sum by a few ulps of its largest terms: measured up to
            # 9e-6 on entries of magnitude ~20, against 1e-5 of the largest entry here.
            scale = g_default[name].abs().max().item()
            torch.testing.assert_close(g_switched[name], g_default[name], rtol=1e-5,
                                       atol=1e-5 * scale)
        else:
            assert torch.equal(g_default[name], g_switched[name]), name


UNFUSED_CASES = GATHER_A_CASES + [
    (600, 256, 128, 4, 1, dict(skip_experts=(0, 1, 2))),  # every row on one expert, k = 1
    (333, 128, 128, 16, 4, dict(one_expert=5)),  # one expert, the other slots dropped
]


# A switch that unfuses a quantization (or takes its earlier path), with the precisions it
# changes anything in: the activation is quantized only by fp8's forward (fp8_bwd's forward
# is the bf16 one).
UNFUSED_SWITCHES = [(variable, precision)
                    for variable in ("MEGAMOE_FP8_UNFUSED_COLS", "MEGAMOE_FP8_UNFUSED_QUANT",
                                     "MEGAMOE_FP8_ROW_SCALES_SCATTERED")
                    for precision in PRECISIONS] + [("MEGAMOE_FP8_UNFUSED_ACT", "fp8")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variable,precision", UNFUSED_SWITCHES)
@pytest.mark.parametrize("T,H,I,E,k,extra", UNFUSED_CASES)
def test_fused_fp8_quantization_matches_the_unfused_path(T, H, I, E, k, extra, variable,
                                                         precision, mode, monkeypatch):
    """A quantization fused into what feeds it (the default) and its unfused path, set by
    the switch (read by the library on every call), give the same values and scales to the
    same GEMMs, so y and every gradient have the same bits.
    MEGAMOE_FP8_UNFUSED_COLS=1: the weight gradients' p dy and x gathered into padded bf16
    rows first, then column-quantized, instead of column-quantized straight from the token
    matrices. MEGAMOE_FP8_UNFUSED_ACT=1: the forward L1 writes the activation in bf16 and
    it is then quantized into L2's rows, instead of L1's epilogue writing those rows (in
    the saved mode alongside h). MEGAMOE_FP8_UNFUSED_QUANT=1: dh quantized into its 1x128
    rows (the L1 dgrad's A) and into its token-contiguous copy (dW_gate_up's) in two passes
    instead of one. MEGAMOE_FP8_ROW_SCALES_SCATTERED=1: x's and dy's quantizer writes each
    scale to every sorted row its token goes to, instead of once per token and then to the
    rows in order."""
    p = make_problem(T, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=T + 37, **extra)
    _check_switch_keeps_the_bits(p, variable, precision, mode, monkeypatch)


@pytest.mark.parametrize("frozen", [("x",), ("w_gate_up",), ("x", "w_gate_up"), ("w_down",),
                                    ("x", "topk_weights", "w_down")])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp8_gradients_of_a_subset_have_the_full_runs_bits(frozen, precision):
    """Which gradients a backward computes decides which copies of dh it quantizes: its
    rows for dx, its token-contiguous copy for dW_gate_up, one pass for both when both are
    wanted and a pass for the one otherwise. Every gradient computed has the bits of the
    run that computes them all, and the frozen leaves get none."""
    p = make_problem(1000, 256, 384, 8, 2, dtype=torch.bfloat16, device="cuda", seed=41,
                     invalid_fraction=0.05, skip_experts=(3,))
    _, full = run_with_grads(megamoe.moe, p, backend="fused", precision=precision)
    leaves = {name: p[name].detach().clone().requires_grad_(name not in frozen)
              for name in ("x", "topk_weights", "w_gate_up", "w_down")}
    y = megamoe.moe(leaves["x"], p["topk_ids"], leaves["topk_weights"], leaves["w_gate_up"],
                    leaves["w_down"], backend="fused", precision=precision)
    y.backward(p["dy"])
    for name, leaf in leaves.items():
        if name in frozen:
            assert leaf.grad is None, name
        else:
            assert torch.equal(leaf.grad, full[name]), name


def _zero_accumulators(p):
    """fp32 weight-gradient accumulators of problem p's weights, zero-filled."""
    return tuple(torch.zeros(p[n].shape, device="cuda") for n in ("w_gate_up", "w_down"))


def test_weight_gradient_accumulators_add_the_same_gradients():
    p = make_problem(600, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=3)
    _, grads = run_with_grads(megamoe.moe, p, backend="fused", precision="fp8")
    acc = _zero_accumulators(p)
    w_gate_up = p["w_gate_up"].detach().clone().requires_grad_(True)
    w_down = p["w_down"].detach().clone().requires_grad_(True)
    y = megamoe.moe(p["x"], p["topk_ids"], p["topk_weights"], w_gate_up, w_down,
                    backend="fused", precision="fp8", weight_grad_accumulators=acc)
    y.backward(p["dy"])
    assert w_gate_up.grad is None and w_down.grad is None
    # bf16 gradients are the fp32 sums rounded once: the fp32 ones (added to zeros) round
    # to them.
    assert torch.equal(acc[0].to(torch.bfloat16), grads["w_gate_up"])
    assert torch.equal(acc[1].to(torch.bfloat16), grads["w_down"])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_weight_gradient_accumulators_at_a_preset_shape(precision):
    """The same at the 30b preset's shape (256-wide tiles, 8 k-blocks per expert, many
    tiles per block), in several runs: there a warp's last loads of its stage's B scales
    could still be in flight when it handed the stage back, which put wrong 16 x 8 blocks
    (one warp's rows, a tile's last columns) into some of the fp32 runs' gradients."""
    p = make_problem(16384, 2048, 768, 128, 8, dtype=torch.bfloat16, device="cuda", seed=11,
                     invalid_fraction=0.01)
    _, grads = run_with_grads(megamoe.moe, p, backend="fused", precision=precision,
                              backward_mode="saved")
    for run in range(4):
        acc = _zero_accumulators(p)
        run_with_grads(megamoe.moe, p, backend="fused", precision=precision,
                       backward_mode="saved", weight_grad_accumulators=acc)
        for a, name in zip(acc, ("w_gate_up", "w_down")):
            wrong = (a.to(torch.bfloat16) != grads[name]).sum().item()
            assert wrong == 0, f"run {run}: {wrong} entries of d{name} differ"


def test_cuda_graph_replays_the_eager_results():
    p = make_problem(512, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=11)
    args = [p[n] for n in ARGS]
    eager = megamoe.moe(*args, backend="fused", precision="fp8", check_ids=False)
    static_w = args[3].clone()
    megamoe.moe(args[0], args[1], args[2], static_w, args[4], backend="fused", precision="fp8",
                check_ids=False)  # warm-up outside the capture (workspace, kernel loading)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = megamoe.moe(args[0], args[1], args[2], static_w, args[4], backend="fused",
                          precision="fp8", check_ids=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    # The captured graph quantizes the weights it reads at every replay: new weights, new y.
    static_w.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    fresh = megamoe.moe(args[0], args[1], args[2], static_w, args[4], backend="fused",
                        precision="fp8", check_ids=False)
    assert torch.equal(out, fresh) and not torch.equal(out, eager)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_compile_matches_eager(precision):
    p = make_problem(700, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=13)
    eager_y, eager_grads = run_with_grads(megamoe.moe, p, backend="fused", precision=precision)
    compiled = torch.compile(megamoe.moe, fullgraph=True)
    y, grads = run_with_grads(compiled, p, backend="fused", precision=precision,
                              check_ids=False)
    assert torch.equal(y, eager_y)
    for name in grads:
        assert torch.equal(grads[name], eager_grads[name]), name


def test_weight_copies_are_made_once_per_weight_version():
    p = make_problem(256, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=5)
    w_gate_up = torch.nn.Parameter(p["w_gate_up"].clone())
    w_down = torch.nn.Parameter(p["w_down"].clone())
    cache = shared_cache()
    cache.invalidate()
    assert not cache.release_after_backward
    misses = cache.misses
    for _ in range(3):
        megamoe.moe(p["x"], p["topk_ids"], p["topk_weights"], w_gate_up, w_down,
                    backend="fused", precision="fp8").sum().backward()
    assert cache.misses - misses == 2  # one copy of each weight for the three calls
    torch.optim.SGD([w_gate_up, w_down], lr=0.1).step()  # the step hook drops the copies
    megamoe.moe(p["x"], p["topk_ids"], p["topk_weights"], w_gate_up, w_down, backend="fused",
                precision="fp8")
    assert cache.misses - misses == 4


def test_release_after_backward_drops_the_copies_a_backward_used():
    p = make_problem(256, 256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", seed=6)
    w_gate_up = torch.nn.Parameter(p["w_gate_up"].clone())
    w_down = torch.nn.Parameter(p["w_down"].clone())
    other = torch.nn.Parameter(p["w_gate_up"].clone())
    cache = shared_cache()
    cache.invalidate()
    cache.get(other)
    reference = megamoe.moe(p["x"], p["topk_ids"], p["topk_weights"], w_gate_up, w_down,
                            backend="fused", precision="fp8")
    cache.release_after_backward = True
    try:
        misses = cache.misses
        y = megamoe.moe(p["x"], p["topk_ids"], p["topk_weights"], w_gate_up, w_down,
                        backend="fused", precision="fp8")
        assert cache.misses == misses and len(cache) == 3  # the forward reuses the copies
        y.sum().backward()
        assert len(cache) == 1 and cache.nbytes() > 0  # only the unused weight's copy stays
        again = megamoe.moe(p["x"], p["topk_ids"], p["topk_weights"], w_gate_up, w_down,
                            backend="fused", precision="fp8")
        assert cache.misses - misses == 2  # quantized again, to the same bits
        assert torch.equal(again, reference) and torch.equal(y, reference)
    finally:
        cache.release_after_backward = False
        cache.invalidate()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_wgrad_tiles_change_only_the_weight_gradients(preset, precision, monkeypatch):
    """MEGAMOE_FP8_WGRAD_TILES=1 (opt-in, read on every call; docs/fp8.md): the weight
    gradients' activation operands (x, a) quantized in 128 x 128 tiles instead of per
    channel and 128 tokens. Every output within the bound against float64; y, dx and
    d topk_weights bitwise the default's (only the weight gradients' GEMMs change)."""
    H, I, E, k = PRESETS[preset]
    p = make_problem(4096, H, I, E, k, dtype=torch.bfloat16, device="cuda", seed=4099,
                     invalid_fraction=0.02, skip_experts=(5,))
    monkeypatch.delenv("MEGAMOE_FP8_WGRAD_TILES", raising=False)
    y0, g0 = run_with_grads(megamoe.moe, p, backend="fused", precision=precision,
                            backward_mode="saved")
    monkeypatch.setenv("MEGAMOE_FP8_WGRAD_TILES", "1")
    print(preset, precision)
    _, g1 = _check_against_float64(p, backend="fused", precision=precision,
                                   backward_mode="saved")
    y1, _ = run_with_grads(megamoe.moe, p, backend="fused", precision=precision,
                           backward_mode="saved")
    assert torch.equal(y0, y1)
    for name in ("x", "topk_weights"):
        assert torch.equal(g0[name], g1[name]), name
    for name in ("w_gate_up", "w_down"):
        assert not torch.equal(g0[name], g1[name]), name  # the switch took effect
        assert torch.all(g1[name][5] == 0), name
