"""precision="fp8" of backend="torch": the FP8 baseline, as TorchTitan runs MoE experts in
FP8 on Hopper (torchao's float8 rowwise grouped GEMMs); the "TorchTitan (FP8)" of the seeds.

Every expert GEMM, forward and backward, is one `torch._scaled_grouped_mm` over all experts:
e4m3 operands, fp32 scales, bf16 output. For one linear out = A W^T (A [rows, K] sorted by
expert, W [E, N, K]):

    forward   out  = A W^T       A scaled per row (over K), W per (expert, row n) over K
    dgrad     dA   = dout W      dout per row (over N), W per (expert, column k) over N
    wgrad     dW_e = dout_e^T A_e  dout and A per (expert, column) over the expert's rows

The quantization is dynamic (weights too, on every call: no FP8 copy is kept), with scales
rounded down to powers of two (scale = 2^floor(log2(448 / amax))) and the fast-accumulation
GEMMs, as torchao does. Its cast functions are compiled with torch.compile: eager casts cost
several times the GEMMs. Each expert's rows are padded to a multiple of 16 (an expert
without rows gets 16 zero rows): `_scaled_grouped_mm` needs 16-byte aligned groups along
the contracted dimension and no empty group in the wgrad. Its capacity is static (rows +
16 E, rounded to 16), so there is no host sync; output rows past the last group are never
written by the GEMMs and never read.

This is not megamoe's own FP8 recipe (megamoe.fp8: 1x128 / 128x128 blocks, exact scales).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import MegaMoEError
from .fp8 import AMAX_FLOOR, E4M3, E4M3_MAX

ALIGN = 16
# torchao's float8 grouped GEMMs run with use_fast_accum=True.
FAST_ACCUM = True
MAX_GROUPS = 1023  # _scaled_grouped_mm takes fewer than 1024 groups


def check_supported(x: torch.Tensor, w_gate_up: torch.Tensor) -> None:
    """What `torch._scaled_grouped_mm` can run; raises MegaMoEError naming the problem."""
    if not x.is_cuda:
        raise MegaMoEError(
            "precision='fp8' with backend='torch' runs torch._scaled_grouped_mm, which needs a "
            f"CUDA GPU with FP8 tensor cores (compute capability 9.0 or 10.0); got x on {x.device}. "
            "Use precision='bf16' on this device")
    # Not while torch.compile traces (a host query it cannot hold): the GEMM refuses other GPUs.
    capability = (9, 0) if torch.compiler.is_compiling() else torch.cuda.get_device_capability(x.device)
    if capability not in ((9, 0), (10, 0)):
        raise MegaMoEError(
            "precision='fp8' with backend='torch': torch._scaled_grouped_mm runs on compute "
            f"capability 9.0 or 10.0 only, {x.device} has {capability[0]}.{capability[1]}")
    E, two_I, H = w_gate_up.shape
    if H % ALIGN or (two_I // 2) % ALIGN:
        raise MegaMoEError(f"precision='fp8' with backend='torch' needs H and I to be multiples "
                           f"of {ALIGN}, got H={H}, I={two_I // 2}")
    if E > MAX_GROUPS:
        raise MegaMoEError(f"precision='fp8' with backend='torch' takes at most {MAX_GROUPS} "
                           f"experts per rank (torch._scaled_grouped_mm's limit), got {E}")


def _pow2_multiplier(amax: torch.Tensor) -> torch.Tensor:
    """The power of two m with amax * m in (224, 448]: q = e4m3(x * m), x = q / m. Taken
    from the exponent bits of 448 / amax (exact; a log2 could round across a power of two)."""
    m = E4M3_MAX / torch.clamp_min(amax, AMAX_FLOOR)
    return (m.view(torch.int32) & 0x7F800000).view(torch.float32)


def _cast(values: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    return torch.clamp(values * multiplier, -E4M3_MAX, E4M3_MAX).to(E4M3)


def _rowwise_eager(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] e4m3 contiguous, dequantization scales [...] fp32)."""
    values = x.float()
    m = _pow2_multiplier(values.abs().amax(dim=-1, keepdim=True))
    return _cast(values, m).contiguous(), (1.0 / m).squeeze(-1).contiguous()


def _colwise_by_group_eager(x: torch.Tensor, group: torch.Tensor, groups: int):
    """x [R, C] with group[r] in [0, groups] (groups: rows past the last expert) ->
    (q_t [C, R] e4m3 contiguous, scales [groups * C] fp32, group-major): one scale per
    (expert, column) over that expert's rows, the copy written token-contiguous."""
    values = x.float()
    index = group[:, None].expand(-1, x.shape[1])
    amax = values.new_zeros(groups + 1, x.shape[1]).scatter_reduce_(
        0, index, values.abs(), "amax", include_self=True)
    m = _pow2_multiplier(amax)
    q = _cast(values, m[group])
    return q.t().contiguous(), (1.0 / m[:groups]).reshape(-1).contiguous()


_rowwise = torch.compile(_rowwise_eager)
_colwise_by_group = torch.compile(_colwise_by_group_eager)


def _scaled_mm(a, b, scale_a, scale_b, offs):
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=FAST_ACCUM)


class _Fp8GroupedLinear(torch.autograd.Function):
    """out [cap, N] = a [cap, K] @ w[e]^T per expert group (offs), in FP8 both ways."""

    @staticmethod
    def forward(ctx, a, w, offs, group):
        qa, sa = _rowwise(a)
        qw, sw = _rowwise(w)  # per (expert, row n), over K
        ctx.save_for_backward(a, w, offs, group)
        return _scaled_mm(qa, qw.transpose(-2, -1), sa, sw, offs)

    @staticmethod
    def backward(ctx, dout):
        a, w, offs, group = ctx.saved_tensors
        dout = dout.contiguous()
        qd, sd = _rowwise(dout)
        qwt, swt = _rowwise(w.transpose(-2, -1))  # W^T [E, K, N] per (expert, column k)
        da = _scaled_mm(qd, qwt.transpose(-2, -1), sd, swt, offs)
        experts = w.shape[0]
        qdt, sdt = _colwise_by_group(dout, group, experts)  # dout^T [N, cap]
        qat, sat = _colwise_by_group(a, group, experts)     # a^T [K, cap]
        dw = _scaled_mm(qdt, qat.t(), sdt, sat, offs)       # [E, N, K]
        return da, dw, None, None


def _padded_layout(counts: torch.Tensor, rows: int):
    """Where the expert-sorted rows go in the padded layout, with static shapes.

    Returns (offs [E] int32 group ends, position [rows] of each sorted row, group [cap] of
    each padded row (E past the last group), cap)."""
    E = counts.numel()
    device = counts.device
    padded = torch.clamp_min((counts + ALIGN - 1) // ALIGN * ALIGN, ALIGN)
    ends = torch.cumsum(padded, 0)
    cap = -(-(rows + ALIGN * E) // ALIGN) * ALIGN
    expert_of_row = torch.repeat_interleave(torch.arange(E, device=device), counts,
                                            output_size=rows)
    first = torch.cumsum(counts, 0) - counts
    index = torch.arange(rows, device=device)
    position = (ends - padded)[expert_of_row] + index - first[expert_of_row]
    group = torch.searchsorted(ends, torch.arange(cap, device=device), right=True)
    return ends.to(torch.int32), position, group, cap


def _pad(rows: torch.Tensor, position: torch.Tensor, cap: int) -> torch.Tensor:
    """rows scattered into `cap` zero rows. A scatter, not a gather from rows plus a zero
    row: its backward is a plain gather, where the gather's would add every pad row's
    gradient into the one zero row."""
    return rows.new_zeros(cap, rows.shape[1]).index_put((position,), rows)


def grouped_experts(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """L1, SwiGLU, L2 in FP8 over rows [R, H] sorted by local expert (counts [E] int64,
    summing to R); returns [R, H] bf16, as torch_backend._grouped_experts does in bf16."""
    offs, position, group, cap = _padded_layout(counts, rows.shape[0])
    h = _Fp8GroupedLinear.apply(_pad(rows, position, cap), w_gate_up, offs, group)
    gate, up = h.chunk(2, dim=-1)
    out = _Fp8GroupedLinear.apply(F.silu(gate) * up, w_down, offs, group)
    return out[position]
