"""What saving h = [gate | up] in e4m3 (1x128 blocks, as DeepSeek-V3 caches the SwiGLU input)
instead of bf16 would add to the backward's error, on the CPU: one expert's backward in
float64 from the exact h, from h rounded to bf16 (what saved mode keeps now) and from h
quantized by the library's recipe (megamoe.fp8.quantize_1x128 of the bf16 h), everything
else exact. Prints each gradient's relative error (Frobenius) against the exact one: the
error the e4m3 h alone adds, to be set against the FP8 layer's own (tests/python/test_torch_fp8.py:
6.6-6.8% on average, bound 8.5%).

    python tools/fp8_saved_h_error.py --model qwen3-30b-a3b,qwen3-235b-a22b --tokens 2048
"""

import argparse

import torch

from megamoe import fp8
from megamoe.presets import get_preset


def grads(h, x, w_gate_up, w_down, p, dy):
    """The backward of y = p * (silu(g) u) @ w_down^T for h = x @ w_gate_up^T = [g | u]."""
    inter = w_down.shape[1]
    g, u = h[:, :inter], h[:, inter:]
    sig = torch.sigmoid(g)
    silu = g * sig
    a = silu * u
    z = dy @ w_down
    da = p[:, None] * z
    dh = torch.cat([da * u * sig * (1 + g * (1 - sig)), da * silu], 1)
    return {"dx": dh @ w_gate_up, "dW_gate_up": dh.T @ x, "dW_down": (p[:, None] * dy).T @ a,
            "d topk_weights": (z * a).sum(1)}


def rel_err(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b,qwen3-235b-a22b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for model in args.model.split(","):
        shape = get_preset(model)
        gen = torch.Generator().manual_seed(args.seed)
        H, inter, T = shape.H, shape.I, args.tokens

        def normal(*size, scale=1.0):
            return torch.randn(*size, generator=gen, dtype=torch.float64) * scale

        # bf16 inputs, as the layer gets them; the backward itself in float64.
        x = normal(T, H).to(torch.bfloat16).double()
        w_gate_up = normal(2 * inter, H, scale=H ** -0.5).to(torch.bfloat16).double()
        w_down = normal(H, inter, scale=inter ** -0.5).to(torch.bfloat16).double()
        p = torch.rand(T, generator=gen, dtype=torch.float64)
        dy = normal(T, H)
        h = x @ w_gate_up.T
        h_bf16 = h.to(torch.bfloat16)
        h_e4m3 = fp8.dequantize_1x128(*fp8.quantize_1x128(h_bf16)).double()
        exact = grads(h, x, w_gate_up, w_down, p, dy)
        from_bf16 = grads(h_bf16.double(), x, w_gate_up, w_down, p, dy)
        from_e4m3 = grads(h_e4m3, x, w_gate_up, w_down, p, dy)
        print(f"{model}: T = {T}, H = {H}, I = {inter}; relative error against the exact h's")
        print(f"  {'gradient':<16} {'bf16 h':>9} {'e4m3 h':>9}")
        for name in exact:
            print(f"  {name:<16} {rel_err(from_bf16[name], exact[name]):>9.2e} "
                  f"{rel_err(from_e4m3[name], exact[name]):>9.2e}")


if __name__ == "__main__":
    main()
