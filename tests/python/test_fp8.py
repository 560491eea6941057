"""The FP8 recipe's reference quantizer (megamoe.fp8) on the CPU: the e4m3 rounding against
an independent nearest-value search, the edge cases of the recipe, the layouts, and the
error bounds of dequantize(quantize(x))."""

import math

import pytest
import torch

from megamoe import fp8
from moe_testing import BASE_SEED

E4M3 = torch.float8_e4m3fn


def _bits(q):
    return q.view(torch.uint8)


def _scale_bits(s):
    return s.contiguous().view(torch.int32)


def _all_codes():
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    return codes, codes.view(E4M3).double()


def _nearest_even_codes(v: torch.Tensor) -> list[int]:
    """Round-to-nearest-even e4m3 codes of float values, found by a search over every finite
    code (no use of torch's cast): saturation at +-448, NaN to 0x7F, the zero of v's sign."""
    v = v.double().reshape(-1)
    codes, values = _all_codes()
    finite = ~torch.isnan(values)
    codes, values = codes[finite].long(), values[finite]
    target = v.clamp(-448.0, 448.0)
    dist = (values[None, :] - target[:, None]).abs()
    sign_of = lambda t: torch.copysign(torch.ones_like(t), t)
    wrong_zero = (values[None, :] == 0) & (sign_of(values)[None, :] != sign_of(v)[:, None])
    dist[wrong_zero] = float("inf")
    best = dist.min(dim=1, keepdim=True).values
    # Among the nearest (at most two), the even code.
    key = torch.where(dist == best, (codes % 2)[None, :].double(), torch.tensor(9.0, dtype=torch.float64))
    out = codes[key.argmin(dim=1)]
    out[torch.isnan(v)] = 0x7F
    return out.tolist()


def _tie_values():
    """Every midpoint between neighbouring positive e4m3 values, and the values themselves."""
    _, values = _all_codes()
    pos = sorted({v for v in values.tolist() if v >= 0 and not math.isnan(v)})
    mids = [(a + b) / 2 for a, b in zip(pos, pos[1:])]
    return pos + mids


def test_round_to_e4m3_is_nearest_even_with_saturation():
    g = torch.Generator().manual_seed(BASE_SEED)
    special = _tie_values() + [449.0, 463.9, 464.0, 464.1, 480.0, 1e6, float("inf"), 3e38,
                               2 ** -10, 2 ** -11, 1e-30, 0.0]
    special += [-v for v in special] + [float("nan")]
    random = (torch.randn(2000, generator=g) * torch.exp2(torch.randint(-12, 10, (2000,), generator=g))).tolist()
    values = torch.tensor(special + random, dtype=torch.float32)
    got = _bits(fp8.round_to_e4m3(values)).tolist()
    for v, code, want in zip(values.tolist(), got, _nearest_even_codes(values)):
        assert code == want, (v, hex(code), hex(want))


def _one_block_row(values, K=128, dtype=torch.bfloat16):
    row = torch.zeros(1, K, dtype=torch.float32)
    row[0, :len(values)] = torch.tensor(values, dtype=torch.float32)
    return row.to(dtype)


def test_all_zero_block_gets_the_floor_scale_and_zeros():
    x = torch.zeros(3, 256, dtype=torch.bfloat16)
    x[1, 128:] = torch.randn(128).to(torch.bfloat16)  # one live block beside zero blocks
    x[2, :128] = -0.0
    q, s = fp8.quantize_1x128(x)
    floor = torch.tensor(fp8.AMAX_FLOOR, dtype=torch.float32) / torch.tensor(448.0)
    for r, c in ((0, 0), (0, 1), (1, 0), (2, 0), (2, 1)):
        assert s[r, c].item() == floor.item() and s[r, c].item() > 0
    assert torch.all(_bits(q[0]) == 0) and torch.all(_bits(q[1, :128]) == 0)
    assert torch.all(_bits(q[2, :128]) == 0x80)  # -0.0 keeps its sign
    assert torch.all(fp8.dequantize_1x128(q, s)[0] == 0)
    assert torch.isfinite(s).all()


def test_single_large_value_maps_to_448():
    for v in (3.0e38, 1000.0, 1.0, 2.0 ** -120, -7.5):
        x = _one_block_row([0.0, 0.0, v, 0.0], dtype=torch.float32)
        q, s = fp8.quantize_1x128(x)
        a = max(abs(v), fp8.AMAX_FLOOR)
        expected = (torch.tensor(a, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)).item()
        assert s.item() == expected
        if abs(v) >= fp8.AMAX_FLOOR:
            assert _bits(q)[0, 2].item() == (0x7E if v > 0 else 0xFE), v
        assert torch.all(_bits(q)[0, [0, 1, 3]] == 0)


def test_limits_ties_and_subnormals_at_unit_scale():
    # amax = 448 gives scale = r = 1 exactly, so the e4m3 rounding shows through untouched.
    values = [448.0, -448.0, 1.0625, 1.1875, -1.0625, 17.0, 19.0, 2 ** -9, 2 ** -10,
              3 * 2 ** -10, 15 * 2 ** -10, 2 ** -11, -(2 ** -11), 240.0, 232.0]
    expected = [0x7E, 0xFE, 0x38, 0x3A, 0xB8, 0x58, 0x5A, 0x01, 0x00, 0x02, 0x08, 0x00, 0x80,
                0x77, 0x76]
    x = _one_block_row(values)
    assert x.float()[0, :len(values)].tolist() == values  # all exact in bf16
    q, s = fp8.quantize_1x128(x)
    assert s.item() == 1.0
    assert _bits(q)[0, :len(values)].tolist() == expected


def test_ties_at_a_power_of_two_scale():
    # amax = 896: scale 2, r = 0.5, both exact; 2.125 * 0.5 = 1.0625 is a tie -> 1.0.
    x = _one_block_row([896.0, 2.125, 2.375, -2.125])
    q, s = fp8.quantize_1x128(x)
    assert s.item() == 2.0
    assert _bits(q)[0, :4].tolist() == [0x7E, 0x38, 0x3A, 0xB8]
    assert fp8.dequantize_1x128(q, s)[0, :4].tolist() == [896.0, 2.0, 2.5, -2.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_block_is_all_nan(bad):
    x = torch.randn(2, 384).to(torch.bfloat16)
    x[1, 130] = bad
    q, s = fp8.quantize_1x128(x)
    assert torch.all(_bits(q)[1, 128:256] == fp8.E4M3_NAN_BITS)
    assert _scale_bits(s)[1, 1].item() == fp8.SCALE_NAN_BITS
    clean_q, clean_s = fp8.quantize_1x128(x[:1])
    assert torch.equal(_bits(q[:1]), _bits(clean_q)) and torch.equal(s[:1], clean_s)
    assert torch.isfinite(s[1, [0, 2]]).all()
    assert not torch.isnan(q[1, :128].float()).any() and not torch.isnan(q[1, 256:].float()).any()


def _recipe_by_hand(block: torch.Tensor):
    """One block through the documented formulas (scalar fp32 steps, the search rounding)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)
    amax = max(abs(v) for v in block.float().tolist())
    a = f32(max(amax, fp8.AMAX_FLOOR))
    scale = a / f32(448.0)
    r = a.new_tensor(448.0) / a
    codes = _nearest_even_codes(block.float() * r)
    return codes, scale.item()


def test_random_blocks_follow_the_formulas():
    g = torch.Generator().manual_seed(BASE_SEED + 1)
    x = (torch.randn(3, 256, generator=g) * torch.exp2(torch.randint(-30, 30, (3, 1), generator=g))).to(torch.bfloat16)
    q, s = fp8.quantize_1x128(x)
    for r in range(3):
        for j in range(2):
            codes, scale = _recipe_by_hand(x[r, 128 * j:128 * (j + 1)])
            assert _bits(q)[r, 128 * j:128 * (j + 1)].tolist() == codes
            assert s[r, j].item() == scale


def _check_error_bound(x, deq, block_scale):
    """|q s - x| <= 2^-4 |x| (3 mantissa bits) + 2^-10 s (half the smallest e4m3 subnormal),
    plus fp32 rounding of the scale and of the product."""
    x = x.double()
    err = (deq.double() - x).abs()
    bound = 2.0 ** -4 * x.abs() * (1 + 1e-6) + 2.0 ** -10 * block_scale.double() + 1e-30
    assert torch.all(err <= bound), (err - bound).max().item()


def test_dequantize_error_bounds_1x128():
    g = torch.Generator().manual_seed(BASE_SEED + 2)
    x = (torch.randn(33, 512, generator=g) * torch.exp2(torch.randint(-20, 20, (33, 4), generator=g)).repeat_interleave(128, 1)).to(torch.bfloat16)
    q, s = fp8.quantize_1x128(x)
    deq = fp8.dequantize_1x128(q, s)
    _check_error_bound(x, deq, s.repeat_interleave(128, 1))
    rel = ((deq - x.float()).norm() / x.float().norm()).item()
    assert rel < 0.04, rel


def test_quantize_128x128_layout_and_transpose():
    g = torch.Generator().manual_seed(BASE_SEED + 3)
    w = torch.randn(3, 256, 384, generator=g).to(torch.bfloat16)
    w[1, 128:256, 0:128] = 0
    w[2, 5, 300] = 1e4
    q, s = fp8.quantize_128x128(w)
    assert q.shape == w.shape and q.dtype == E4M3 and s.shape == (3, 2, 3)
    for e in range(3):
        for i in range(2):
            for j in range(3):
                tile = w[e, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)]
                codes, scale = _recipe_by_hand(tile.reshape(-1)) if (e, i, j) in ((0, 0, 0), (2, 0, 2)) else (None, None)
                amax = tile.float().abs().max()
                expected = (torch.clamp_min(amax, fp8.AMAX_FLOOR) / torch.tensor(448.0)).item()
                assert s[e, i, j].item() == expected
                if codes is not None:
                    assert _bits(q)[e, 128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].reshape(-1).tolist() == codes
                    assert s[e, i, j].item() == scale
    # W^T: the same tiles, the same scales.
    qt, st = fp8.quantize_128x128(w.transpose(-2, -1).contiguous())
    assert torch.equal(_bits(qt), _bits(q).transpose(-2, -1))
    assert torch.equal(st, s.transpose(-2, -1))
    deq = fp8.dequantize_128x128(q, s)
    _check_error_bound(w, deq, s.repeat_interleave(128, 1).repeat_interleave(128, 2))


@pytest.mark.parametrize("R", [1, 7, 128, 300])
def test_quantize_cols_128_is_1x128_of_the_padded_transpose(R):
    g = torch.Generator().manual_seed(BASE_SEED + 4 + R)
    x = torch.randn(R, 256, generator=g).to(torch.bfloat16)
    q_t, s = fp8.quantize_cols_128(x)
    Rp = fp8.padded_rows(R)
    assert q_t.shape == (256, Rp) and s.shape == (256, Rp // 128) and q_t.is_contiguous()
    assert torch.all(_bits(q_t)[:, R:] == 0)
    padded = torch.zeros(Rp, 256, dtype=torch.bfloat16)
    padded[:R] = x
    ref_q, ref_s = fp8.quantize_1x128(padded.t().contiguous())
    assert torch.equal(_bits(q_t), _bits(ref_q)) and torch.equal(s, ref_s)
    # Column c, token block b: scale from the amax of x[128 b : 128 b + 128, c].
    amax = padded.float().abs().reshape(Rp // 128, 128, 256).amax(1).t()
    assert torch.equal(s, torch.clamp_min(amax, fp8.AMAX_FLOOR) / torch.full_like(amax, 448.0))
    deq = fp8.dequantize_cols_128(q_t, s, R)
    assert deq.shape == (R, 256)
    _check_error_bound(x, deq, s.repeat_interleave(128, 1).t()[:R])


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="x: K, the last dimension, .* multiple of 128, got 100"):
        fp8.quantize_1x128(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="w: N .* multiple of 128"):
        fp8.quantize_128x128(torch.zeros(2, 64, 128))
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        fp8.quantize_cols_128(torch.zeros(2, 2, 128))
    with pytest.raises(ValueError, match="expected a floating tensor"):
        fp8.quantize_1x128(torch.zeros(2, 128, dtype=torch.int32))


def test_bf16_and_float32_inputs_agree():
    x = torch.randn(4, 256).to(torch.bfloat16)
    a = fp8.quantize_1x128(x)
    b = fp8.quantize_1x128(x.float())
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(a[1], b[1])
