"""The CUDA FP8 quantizers (megamoe_quantize_fp8_*) against the reference quantizer
megamoe.fp8, bit for bit (values and scales), on random and edge-case inputs, awkward
shapes, strided and poisoned outputs, and under CUDA graph capture. Skipped without a GPU."""

import pytest
import torch

import megamoe
from megamoe import _fp8_kernels as kernels
from megamoe import fp8
from moe_testing import BASE_SEED, needs_cuda

pytestmark = [needs_cuda, pytest.mark.gpu]

POISON_BYTE = 0xA5
POISON_SCALE_BITS = 0x7F800001  # a signalling NaN: never a value the recipe writes


def _bits(q):
    return q.detach().cpu().contiguous().view(torch.uint8)


def _scale_bits(s):
    return s.detach().cpu().contiguous().view(torch.int32)


def _assert_bits_equal(what, got, expected):
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    if not torch.equal(got, expected):
        idx = tuple((got != expected).nonzero()[0].tolist())
        raise AssertionError(f"{what} differ at {list(idx)}: got {hex(got[idx])}, expected "
                             f"{hex(expected[idx])}; {(got != expected).sum().item()} differ")


def _assert_same(what, q, s, q_ref, s_ref):
    _assert_bits_equal(f"{what}: values", _bits(q), _bits(q_ref))
    _assert_bits_equal(f"{what}: scales", _scale_bits(s), _scale_bits(s_ref))


def _random(shape, seed, *, device="cuda"):
    """bf16 values whose magnitude changes from one 128-wide block to the next, over most of
    bf16's range, with some subnormals and exact zeros."""
    g = torch.Generator(device="cpu").manual_seed(BASE_SEED + seed)
    x = torch.randn(*shape, generator=g)
    blocks = torch.randint(-40, 40, (*shape[:-1], -(-shape[-1] // 128)), generator=g).float()
    x = x * torch.exp2(blocks).repeat_interleave(128, dim=-1)[..., :shape[-1]]
    x[torch.rand(*shape, generator=g) < 0.01] = 0.0
    x[torch.rand(*shape, generator=g) < 0.002] = 2.0 ** -130
    return x.to(torch.bfloat16).to(device)


def _edge_rows(K=384):
    """Rows of 128-wide blocks that hit every case of the recipe (the first K columns)."""
    rows = torch.zeros(8, 384)
    rows[1, 5], rows[1, 130], rows[1, 300] = 3.3e38, 1.0, 2.0 ** -120  # single values
    ties = [448.0, -448.0, 1.0625, 1.1875, -1.0625, 17.0, 19.0, 2 ** -9, 2 ** -10, 3 * 2 ** -10,
            15 * 2 ** -10, 2 ** -11, -(2 ** -11), 240.0, 232.0]
    rows[2, :len(ties)] = torch.tensor(ties)
    rows[2, 128:132] = torch.tensor([896.0, 2.125, 2.375, -2.125])
    rows[2, 256:260] = torch.tensor([-0.0, -1e-30, -2.0 ** -100, 2.0 ** -100])
    rows[3, 7], rows[3, 140], rows[3, 260] = -float("inf"), float("nan"), float("inf")
    rows[4, :3] = torch.tensor([2.0 ** -130, -(2.0 ** -133), 2.0 ** -126])  # below the floor
    rows[4, 128] = 2.0 ** -100  # exactly the floor
    rows[4, 256:260] = torch.tensor([2.0 ** -100 * 1.5, 2.0 ** -101, 7.0, -3.0])
    g = torch.Generator().manual_seed(BASE_SEED + 99)
    rows[5] = torch.exp2(torch.randint(-60, 60, (384,), generator=g).float()) * torch.sign(torch.randn(384, generator=g))
    rows[6] = torch.randn(384, generator=g) * 1e-38  # bf16 subnormals and tiny normals
    rows[7] = torch.randn(384, generator=g).to(torch.bfloat16).float().clamp(-1, 1) * 448
    return rows[:, :K].to(torch.bfloat16)


def _poisoned(shape, dtype, device="cuda"):
    if dtype == torch.float32:
        return torch.full(shape, POISON_SCALE_BITS, dtype=torch.int32, device=device).view(torch.float32)
    return torch.full(shape, POISON_BYTE, dtype=torch.uint8, device=device).view(dtype)


def test_reference_is_device_independent():
    x = torch.cat([_edge_rows(), _random((9, 384), 1, device="cpu")])
    _assert_same("1x128 reference cuda vs cpu", *fp8.quantize_1x128(x.cuda()), *fp8.quantize_1x128(x))
    w = torch.cat([x, x.flip(0)] * 4 + [x[:2]])[:128].reshape(1, 128, 384)
    _assert_same("128x128 reference cuda vs cpu", *fp8.quantize_128x128(w.cuda()),
                 *fp8.quantize_128x128(w))


@pytest.mark.parametrize("M,K", [(1, 128), (7, 384), (128, 256), (129, 128), (1000, 768),
                                 (4097, 2048)])
def test_1x128_random_matches_reference(M, K):
    x = _random((M, K), M + K)
    q = _poisoned((M, K), fp8.E4M3)
    s = _poisoned((M, K // 128), torch.float32)
    kernels.quantize_1x128(x, q, s)
    _assert_same(f"1x128 [{M}, {K}]", q, s, *fp8.quantize_1x128(x.cpu()))


def test_1x128_edge_cases_match_reference():
    x = _edge_rows().cuda()
    q, s = kernels.quantize_1x128(x)
    _assert_same("1x128 edge rows", q, s, *fp8.quantize_1x128(x.cpu()))
    # The cases the recipe promises, read off the kernel's own output.
    assert torch.all(_bits(q)[0] == 0) and torch.isfinite(s[0]).all() and (s[0] > 0).all()
    assert _bits(q)[1, 5] == 0x7E and _bits(q)[2, 0] == 0x7E and _bits(q)[2, 1] == 0xFE
    assert _bits(q)[2, 256] == 0x80 and s[2, 0].item() == 1.0 and s[2, 1].item() == 2.0
    assert torch.all(_bits(q)[3] == fp8.E4M3_NAN_BITS)
    assert torch.all(_scale_bits(s)[3] == fp8.SCALE_NAN_BITS)


def test_1x128_strided_input_and_outputs_touch_nothing_else():
    M, K = 300, 512
    x_wide = _random((M, K + 64), 5)
    x = x_wide[:, :K]
    q_wide = _poisoned((M, K + 128), fp8.E4M3)
    q = q_wide[:, :K]
    # Scales M-major (the layout a GEMM's TMA reads), with a padded leading dimension.
    s_store = _poisoned((K // 128, M + 4), torch.float32)
    s = s_store[:, :M].t()
    kernels.quantize_1x128(x, q, s)
    _assert_same("1x128 strided", q, s, *fp8.quantize_1x128(x.cpu()))
    assert torch.all(_bits(q_wide[:, K:]) == POISON_BYTE)
    assert torch.all(_scale_bits(s_store[:, M:]) == POISON_SCALE_BITS)


def test_empty_inputs_and_unused_strides():
    x = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    q, s = kernels.quantize_1x128(x)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    q_t, s = kernels.quantize_cols_128(x)
    assert q_t.shape == (256, 0) and s.shape == (256, 0)
    q, _, s = kernels.quantize_128x128(torch.empty(0, 128, 256, dtype=torch.bfloat16, device="cuda"))
    assert q.shape == (0, 128, 256) and s.shape == (0, 1, 2)
    # A size-1 dimension's stride is never used, so it need not be aligned.
    row = _random((1, 256), 8).as_strided((1, 256), (3, 1))
    _assert_same("1x128 one row, odd stride", *kernels.quantize_1x128(row),
                 *fp8.quantize_1x128(row.cpu()))
    one = _random((1, 128, 128), 9).as_strided((1, 128, 128), (5, 128, 1))
    q, q_t, s = kernels.quantize_128x128(one, transposed=True)
    ref_q, ref_s = fp8.quantize_128x128(one.cpu())
    _assert_same("128x128 one expert, odd batch stride", q, s, ref_q, ref_s)
    _assert_same("128x128 one expert, W^T", q_t, s, ref_q.transpose(-2, -1), ref_s)


@pytest.mark.parametrize("E,N,K", [(1, 128, 128), (3, 256, 384), (17, 128, 256), (4, 1536, 2048),
                                   (64, 256, 128)])
def test_128x128_random_matches_reference(E, N, K):
    w = _random((E, N, K), E * 7 + N + K)
    q = _poisoned((E, N, K), fp8.E4M3)
    q_t = _poisoned((E, K, N), fp8.E4M3)
    s = _poisoned((E, N // 128, K // 128), torch.float32)
    kernels.quantize_128x128(w, transposed=True, q=q, q_t=q_t, scales=s)
    ref_q, ref_s = fp8.quantize_128x128(w.cpu())
    _assert_same(f"128x128 [{E}, {N}, {K}]", q, s, ref_q, ref_s)
    _assert_same(f"128x128 transposed [{E}, {N}, {K}]", q_t, s, ref_q.transpose(-2, -1), ref_s)


def test_128x128_edge_tiles_and_one_output_at_a_time():
    rows = _edge_rows(256)
    w = _random((3, 256, 256), 77, device="cpu")
    w[0, :128, :128] = 0  # an all-zero tile
    w[0, 128:, :128] = 0
    w[0, 200, 17] = -3.0e38  # a single large value
    w[1, :8] = rows  # ties, subnormals, NaN, Inf in the tiles of rows 0..127
    w[2, 128:, 128:] = 2.0 ** -130
    w = w.cuda()
    ref_q, ref_s = fp8.quantize_128x128(w.cpu())
    q, none, s = kernels.quantize_128x128(w)
    assert none is None
    _assert_same("128x128 edge, direct only", q, s, ref_q, ref_s)
    none, q_t, s = kernels.quantize_128x128(w, direct=False, transposed=True)
    assert none is None
    _assert_same("128x128 edge, transposed only", q_t, s, ref_q.transpose(-2, -1), ref_s)
    assert torch.all(_scale_bits(s)[1, 0] == fp8.SCALE_NAN_BITS)
    assert torch.all(_bits(q_t)[1, :128, :128] == fp8.E4M3_NAN_BITS)


@pytest.mark.parametrize("R,C", [(1, 128), (7, 256), (128, 128), (300, 384), (4097, 768),
                                 (1000, 2048)])
def test_cols_128_random_matches_reference(R, C):
    x = _random((R, C), R * 3 + C)
    Rp = fp8.padded_rows(R)
    q_t = _poisoned((C, Rp), fp8.E4M3)
    s = _poisoned((C, Rp // 128), torch.float32)
    kernels.quantize_cols_128(x, q_t, s)
    _assert_same(f"cols_128 [{R}, {C}]", q_t, s, *fp8.quantize_cols_128(x.cpu()))
    assert torch.all(_bits(q_t)[:, R:] == 0)  # padding rows quantize to zeros


def test_cols_128_edge_columns_and_strides():
    edge = _edge_rows(256)  # [8, 256]: as columns of x, each column block meets a case
    x = _random((256, 256 + 64), 123, device="cpu")
    x[:, 128:136] = edge.t()
    x[:, 200] = 0.0
    x = x.cuda()[:, :256]
    q_wide = _poisoned((256, 256 + 16), fp8.E4M3)
    q_t = q_wide[:, :256]
    s_store = _poisoned((4, 256), torch.float32)
    s = s_store[:2].t()  # [C, Rp/128] stored block-major
    kernels.quantize_cols_128(x, q_t, s)
    _assert_same("cols_128 edge, strided", q_t, s, *fp8.quantize_cols_128(x.cpu()))
    assert torch.all(_bits(q_wide[:, 256:]) == POISON_BYTE)
    assert torch.all(_scale_bits(s_store[2:]) == POISON_SCALE_BITS)


def test_quantizers_capture_in_a_cuda_graph():
    x = _random((513, 256), 11)
    w = _random((2, 256, 128), 12)
    # Load the kernels outside the capture.
    kernels.quantize_1x128(x)
    kernels.quantize_128x128(w)
    kernels.quantize_cols_128(x)
    outs = [torch.empty(513, 256, dtype=fp8.E4M3, device="cuda"),
            torch.empty(513, 2, device="cuda"),
            torch.empty(2, 128, 256, dtype=fp8.E4M3, device="cuda"),
            torch.empty(2, 2, 1, device="cuda"),
            torch.empty(256, 640, dtype=fp8.E4M3, device="cuda"),
            torch.empty(256, 5, device="cuda")]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.quantize_1x128(x, outs[0], outs[1])
        kernels.quantize_128x128(w, direct=False, transposed=True, q_t=outs[2], scales=outs[3])
        kernels.quantize_cols_128(x, outs[4], outs[5])
    x.copy_(_random((513, 256), 13))
    w.copy_(_random((2, 256, 128), 14))
    graph.replay()
    torch.cuda.synchronize()
    _assert_same("graph 1x128", outs[0], outs[1], *fp8.quantize_1x128(x.cpu()))
    ref_q, ref_s = fp8.quantize_128x128(w.cpu())
    _assert_same("graph 128x128", outs[2], outs[3], ref_q.transpose(-2, -1), ref_s)
    _assert_same("graph cols_128", outs[4], outs[5], *fp8.quantize_cols_128(x.cpu()))


def test_bad_arguments_are_named():
    x = torch.zeros(4, 100, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(megamoe.LibraryError, match="x: K .* must be a positive multiple of 128"):
        kernels.quantize_1x128(x)
    with pytest.raises(megamoe.MegaMoEError, match="expected torch.bfloat16"):
        kernels.quantize_1x128(torch.zeros(4, 128, device="cuda"))
    with pytest.raises(megamoe.MegaMoEError, match="take CUDA tensors"):
        kernels.quantize_cols_128(torch.zeros(4, 128, dtype=torch.bfloat16))
    w = torch.zeros(2, 128, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(megamoe.LibraryError, match="q_t: expected shape"):
        kernels.quantize_128x128(w, transposed=True,
                                 q_t=torch.empty(2, 128, 256, dtype=fp8.E4M3, device="cuda"))
    x = torch.zeros(4, 128, dtype=torch.bfloat16, device="cuda")
    q = torch.empty(4, 128, dtype=fp8.E4M3, device="cuda")
    scales_inside_q = q.view(torch.uint8)[:, :4].view(torch.float32)  # [4, 1], aliasing q
    with pytest.raises(megamoe.LibraryError, match="overlaps"):
        kernels.quantize_1x128(x, q, scales_inside_q)


def test_weight_cache_uses_the_kernel_on_cuda():
    from megamoe.weight_cache import Fp8WeightCache
    cache = Fp8WeightCache()
    w = torch.nn.Parameter(_random((4, 256, 384), 21))
    copy = cache.get(w, transposed=True)
    ref_q, ref_s = fp8.quantize_128x128(w.detach().cpu())
    _assert_same("cache values", copy.values, copy.scales, ref_q, ref_s)
    _assert_same("cache W^T values", copy.values_t, copy.scales, ref_q.transpose(-2, -1), ref_s)
    assert cache.get(w, transposed=True) is copy
    with torch.no_grad():
        w.neg_()
    again = cache.get(w)
    assert again is not copy
    _assert_same("cache after an update", again.values, again.scales,
                 *fp8.quantize_128x128(w.detach().cpu()))
