"""Bad input gets a clear error that names the argument and the expectation."""

import pytest
import torch

import megamoe
from megamoe import MegaMoEError, NotBuiltError
from moe_testing import make_problem


def _args(**overrides):
    p = make_problem(6, 16, 8, 4, 2, seed=1)
    args = {n: p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")}
    args.update(overrides)
    return args


def _call(backend="reference", **overrides):
    return megamoe.moe(**_args(**overrides), backend=backend)


@pytest.mark.parametrize("override,pattern", [
    (dict(x=torch.randn(6, 16, 1)), r"x: expected 2 dimensions"),
    (dict(x=torch.randn(6, 15)), r"w_gate_up: expected shape \[E_local, 2\*I, H=15\]"),
    (dict(topk_ids=torch.zeros(5, 2, dtype=torch.int64)), r"topk_ids: expected shape \[T=6, k\]"),
    (dict(topk_ids=torch.zeros(6, 2, dtype=torch.float32)), r"topk_ids: expected dtype int32 or int64"),
    (dict(topk_weights=torch.rand(6, 3)), r"topk_weights: expected shape \[6, 2\]"),
    (dict(topk_weights=torch.rand(6, 2).to(torch.float16)), r"topk_weights: expected dtype"),
    (dict(w_gate_up=torch.randn(4, 15, 16)), r"w_gate_up: expected shape"),
    (dict(w_down=torch.randn(3, 16, 8)), r"w_down: expected shape \[4, 16, 8\]"),
    (dict(w_down=torch.randn(4, 16, 8, dtype=torch.float64)), r"w_down: expected dtype torch.float32"),
    (dict(x=[[1.0]]), r"x: expected a torch.Tensor"),
    (dict(x=torch.zeros(6, 16, dtype=torch.int32)), r"x: expected a floating dtype"),
    (dict(topk_ids=torch.full((6, 5), 0)), r"topk_weights: expected shape"),
])
def test_bad_arguments(override, pattern):
    with pytest.raises(MegaMoEError, match=pattern):
        _call(**override)


@pytest.mark.parametrize("bad", [-2, 4, 1000])
def test_expert_ids_out_of_range(bad):
    ids = torch.zeros(6, 2, dtype=torch.int64)
    ids[:, 1] = 1
    ids[4, 1] = bad
    for backend in ("reference", "torch"):
        with pytest.raises(MegaMoEError, match=rf"ids in \[-1, 4\).*got {bad} at token 4, slot 1"):
            _call(backend, topk_ids=ids)


def test_k_larger_than_experts():
    with pytest.raises(MegaMoEError, match="k=5 is larger than the number of experts E=4"):
        _call(topk_ids=torch.zeros(6, 5, dtype=torch.int64), topk_weights=torch.rand(6, 5))


def test_backend_and_precision_names():
    with pytest.raises(MegaMoEError, match="backend: expected one of"):
        _call("cutlass")
    with pytest.raises(MegaMoEError, match="precision: expected one of"):
        megamoe.moe(**_args(), precision="fp4", backend="torch")
    with pytest.raises(MegaMoEError, match="mxfp8.*Blackwell"):
        megamoe.moe(**_args(), precision="mxfp8", backend="torch")
    for precision in ("fp8", "fp8_bwd"):  # built for the fused backend, which needs CUDA
        with pytest.raises(MegaMoEError, match="backend='fused' runs on CUDA tensors"):
            megamoe.moe(**_args(), precision=precision, backend="fused")
    with pytest.raises(NotBuiltError, match="precision='fp8_bwd' is not built yet for backend='torch'"):
        megamoe.moe(**_args(), precision="fp8_bwd", backend="torch")


def test_torch_fp8_needs_a_hopper_gpu():
    p = make_problem(6, 16, 16, 4, 2, dtype=torch.bfloat16, seed=1)
    args = {n: p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")}
    with pytest.raises(MegaMoEError, match=r"precision='fp8' with backend='torch' runs "
                                           r"torch._scaled_grouped_mm, which needs a CUDA GPU.*got x on cpu"):
        megamoe.moe(**args, precision="fp8", backend="torch")


def test_torch_backend_on_cpu_takes_no_float64():
    p = make_problem(6, 16, 8, 4, 2, dtype=torch.float64, seed=3)
    args = {n: p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")}
    with pytest.raises(MegaMoEError, match=r"backend='torch' on cpu runs torch._grouped_mm.*"
                                           r"got x in torch.float64"):
        megamoe.moe(**args, backend="torch")


def test_fused_needs_cuda_tensors():
    p = make_problem(4, 128, 128, 4, 2, seed=2)
    args = {n: p[n] for n in ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")}
    with pytest.raises(MegaMoEError, match="backend='fused' runs on CUDA tensors"):
        megamoe.moe(**args, backend="fused")


def test_devices_must_match():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU to have two devices")
    with pytest.raises(MegaMoEError, match="w_down: expected device cpu"):
        _call(w_down=torch.randn(4, 16, 8, device="cuda"))


def test_buffer_only_with_fused_and_a_group():
    with pytest.raises(MegaMoEError, match="buffer= belongs to backend='fused' with an "
                                           "expert-parallel group"):
        megamoe.moe(**_args(), buffer=object(), backend="torch")


def test_fp8_precisions_with_a_group_and_buffer(one_rank_group):
    """Blockwise FP8 runs under expert parallelism: "fp8" and "fp8_bwd" with a group and a
    buffer pass the precision check and meet the fused backend's own (CUDA tensors here, on
    the CPU), not a NotBuiltError; "mxfp8" keeps its error."""
    for precision in ("fp8", "fp8_bwd"):
        with pytest.raises(MegaMoEError, match="backend='fused' runs on CUDA tensors") as info:
            megamoe.moe(**_args(), group=one_rank_group, buffer=object(), precision=precision,
                        backend="fused")
        assert not isinstance(info.value, NotBuiltError)
    with pytest.raises(MegaMoEError, match="precision='mxfp8'.*Blackwell"):
        megamoe.moe(**_args(), group=one_rank_group, buffer=object(), precision="mxfp8",
                    backend="fused")


def test_buffer_needs_a_group():
    with pytest.raises(MegaMoEError, match="Buffer: group is None"):
        megamoe.Buffer(None, 16, 128, 128, 8, 2)


def test_library_errors_name_the_argument():
    """The C ABI validates too: call the reference directly with an id out of range."""
    from megamoe import _lib
    from megamoe._reference_op import _descs
    a = _args()
    ids = a["topk_ids"].clone()
    ids[2, 0] = 9
    y = torch.empty_like(a["x"])
    d = _descs(a["x"], ids, a["topk_weights"], a["w_gate_up"], a["w_down"], y)
    with pytest.raises(megamoe.LibraryError, match="topk_ids") as info:
        _lib.call("megamoe_reference_forward", *(_lib.ref(v) for v in d))
    assert "INVALID_ARGUMENT" in str(info.value)


@pytest.mark.parametrize("accumulators,pattern", [
    ((torch.zeros(4, 16, 15), None), r"acc_gate_up must have the weight's shape \[4, 16, 16\]"),
    ((torch.zeros(4, 16, 16, dtype=torch.float64), None), r"acc_gate_up must be torch.float32"),
    ((None, torch.zeros(4, 8, 16)), r"acc_down must have the weight's shape \[4, 16, 8\]"),
    ((None, torch.zeros(4, 8, 16).transpose(1, 2)), r"acc_down must be contiguous"),
    ((None, [0.0]), r"acc_down must be a tensor or None"),
    (torch.zeros(3), r"expected a pair \(acc_gate_up, acc_down\)"),
])
def test_weight_grad_accumulators_are_checked(accumulators, pattern):
    with pytest.raises(MegaMoEError, match=pattern):
        megamoe.moe(**_args(), backend="fused", weight_grad_accumulators=accumulators)


def test_weight_grad_accumulators_need_the_fused_backend():
    acc = (torch.zeros(4, 16, 16), torch.zeros(4, 16, 8))
    with pytest.raises(MegaMoEError, match="only backend='fused'"):
        megamoe.moe(**_args(), backend="reference", weight_grad_accumulators=acc)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_comm_sms=0), "num_comm_sms must be a positive int or None"),
    (dict(num_comm_sms=2.5), "num_comm_sms must be a positive int or None"),
    (dict(timeout_s=0), "timeout_s must be > 0"),
    (dict(topk=0), "topk must be a positive int"),
])
def test_buffer_arguments_are_checked(one_rank_group, kwargs, message):
    args = dict(max_tokens_per_rank=16, hidden=128, intermediate=128, num_experts=8, topk=2)
    args.update(kwargs)
    with pytest.raises(MegaMoEError, match=message):
        megamoe.Buffer(one_rank_group, **args)
