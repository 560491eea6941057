"""d topk_weights of problems with few slots against the float64 reference, over many draws.

Per backend it prints the bf16 noise of a slot (|dp - ref| / ||z * a||, the term scale of
tests/python/moe_testing.py), how often the former few-slot check (the largest of those
over the slots < 1e-2) and the current one (moe_testing.dp_error_and_bound) fail, and
whether d topk_weights repeats bitwise when the same call runs twice. --rounding-points
splits the torch baseline's noise by where it rounds to bf16 (h, silu(g), a, o), in a
float64 emulation that rounds at one point at a time, beside the first-order model of
moe_testing.DP_NOISE.

    python3 tools/dp_noise.py --device cpu --backends torch --draws 2000
    python3 tools/dp_noise.py --device cuda --backends torch,fused --draws 2000
    python3 tools/dp_noise.py --device cpu --rounding-points --draws 300

Defaults: test_gpu.py's awkward shapes (H 256, I 128, E 64, 10% of ids -1) at T, k = 7, 2
and 1, 1. The torch backend's bf16 math on the CPU rounds where CUDA does (fp32-accumulated
GEMMs rounded once to bf16, one rounding per elementwise op), so the CPU run measures the
same noise; "fused" needs the GPU.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
import megamoe  # noqa: E402
from megamoe import reference  # noqa: E402
from moe_testing import (dp_error_and_bound, dp_term_norms, make_problem,  # noqa: E402
                         run_with_grads)

ARGS = ("x", "topk_ids", "topk_weights", "w_gate_up", "w_down")


def _quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(backend, T, k, args, device):
    per_slot, old_fail, new_ratio, repeats_differ, draws = [], 0, [], 0, 0
    for s in range(args.draws):
        p = make_problem(T, args.hidden, args.intermediate, args.experts, k,
                         dtype=torch.bfloat16, device=device, seed=T + 100003 * s,
                         invalid_fraction=args.invalid)
        valid = p["topk_ids"] >= 0
        if not bool(valid.any()):
            continue
        draws += 1
        _, grads = run_with_grads(megamoe.moe, p, backend=backend)
        _, again = run_with_grads(megamoe.moe, p, backend=backend)
        dp = grads["topk_weights"]
        repeats_differ += not torch.equal(dp, again["topk_weights"])
        ref = reference.backward(p["dy"], *[p[n] for n in ARGS])[1]
        scaled = ((dp.double() - ref.double()).abs() / dp_term_norms(p).clamp_min(1e-30))[valid]
        per_slot += scaled.tolist()
        old_fail += scaled.max().item() >= 1e-2
        err, bound = dp_error_and_bound(dp, ref, p)
        new_ratio.append(err / bound)
    rms = math.sqrt(sum(v * v for v in per_slot) / len(per_slot))
    print(f"{backend} T={T} k={k}: {draws} draws with a valid slot, {len(per_slot)} slots")
    print(f"  per slot |dp - ref| / term scale: RMS {rms:.2e}, median "
          f"{_quantile(per_slot, 0.5):.2e}, 99th percentile {_quantile(per_slot, 0.99):.2e}, "
          f"max {max(per_slot):.2e}")
    print(f"  former check (max over slots < 1e-2) fails {old_fail} / {draws} "
          f"({old_fail / draws:.1%})")
    print(f"  current check: largest error / bound {max(new_ratio):.2f}, fails "
          f"{sum(r >= 1 for r in new_ratio)} / {draws}")
    print(f"  d topk_weights differs between two identical calls in {repeats_differ} / {draws}")


def _bf16(t):
    return t.float().bfloat16().double()


def rounding_points(T, k, args, device):
    """RMS of (dp - ref) / term scale with one bf16 rounding at a time, all of them, and the
    first-order model: variance BF16_RMS_ROUNDING^2 (||dy o||^2 + 3 ||z a||^2 +
    ||z u g silu'(g)||^2) / ||z a||^2 per slot."""
    from moe_testing import BF16_RMS_ROUNDING
    points = ("h", "silu", "a", "o")
    errors = {name: [] for name in points + ("all",)}
    model = []
    for s in range(args.draws):
        p = make_problem(T, args.hidden, args.intermediate, args.experts, k,
                         dtype=torch.bfloat16, device=device, seed=T + 100003 * s,
                         invalid_fraction=args.invalid)
        x, ids, w1, w2, dy = (p[n].double() if p[n].is_floating_point() else p[n]
                              for n in ("x", "topk_ids", "w_gate_up", "w_down", "dy"))
        I = args.intermediate
        for t, j in (ids >= 0).nonzero().tolist():
            e = int(ids[t, j])
            h = w1[e] @ x[t]
            z = dy[t] @ w2[e]

            def dp(rounded):
                hh = _bf16(h) if "h" in rounded else h
                g, u = hh[:I], hh[I:]
                sg = torch.nn.functional.silu(g)
                sg = _bf16(sg) if "silu" in rounded else sg
                a = _bf16(sg * u) if "a" in rounded else sg * u
                o = w2[e] @ a
                o = _bf16(o) if "o" in rounded else o
                return (dy[t] @ o).item()

            g, u = h[:I], h[I:]
            a = torch.nn.functional.silu(g) * u
            scale = (z * a).norm().item()
            exact = dp(())
            for name in points:
                errors[name].append((dp((name,)) - exact) / scale)
            errors["all"].append((dp(points) - exact) / scale)
            sig = torch.sigmoid(g)
            gate_term = z * u * g * sig * (1 + g * (1 - sig))
            var = (((dy[t] * (w2[e] @ a)) ** 2).sum() + 3 * scale ** 2 + (gate_term ** 2).sum())
            model.append(BF16_RMS_ROUNDING * math.sqrt(var.item()) / scale)
    rms = {name: math.sqrt(sum(v * v for v in e) / len(e)) for name, e in errors.items()}
    print(f"rounding points, T={T} k={k}, {len(model)} slots: RMS (dp - ref) / term scale with "
          "bf16 rounding at " + ", ".join(f"{n} {rms[n]:.2e}" for n in points) +
          f"; all {rms['all']:.2e}")
    print(f"  first-order model per slot: median {_quantile(model, 0.5):.2e}, 99th percentile "
          f"{_quantile(model, 0.99):.2e}, max {max(model):.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backends", default="torch", help="comma-separated, default torch")
    parser.add_argument("--draws", type=int, default=500)
    parser.add_argument("--shapes", default="7,2;1,1", help="T,k pairs, default 7,2;1,1")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--invalid", type=float, default=0.1, help="fraction of -1 ids")
    parser.add_argument("--rounding-points", action="store_true",
                        help="split the torch baseline's noise by rounding point instead")
    args = parser.parse_args()
    if args.draws < 1:
        parser.error(f"--draws must be >= 1, got {args.draws}")
    torch.set_num_threads(1)
    for shape in args.shapes.split(";"):
        T, k = (int(v) for v in shape.split(","))
        for backend in ["emulation"] if args.rounding_points else args.backends.split(","):
            t0 = time.time()
            if args.rounding_points:
                rounding_points(T, k, args, args.device)
            else:
                measure(backend, T, k, args, args.device)
            print(f"  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
