"""One training step (forward + backward) of the fused layer and nothing else, to run under a
kernel profiler:

    ncu --kernel-name regex:grouped_gemm_kernel --launch-count 4 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats python tools/one_step.py --model qwen3-30b-a3b

The grouped GEMMs launch in this order: L1, L2, then (saved mode) the dgrad of L2 with the
SwiGLU backward, the dgrad of L1 and the two weight-gradient GEMMs.
"""

import argparse

import torch

import megamoe
from megamoe.presets import get_preset

from layer_inputs import layer_inputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--backward-mode", default="saved", choices=("saved", "recompute"))
    args = parser.parse_args()
    x, ids, weights, w_gate_up, w_down, dy = layer_inputs(get_preset(args.model), args.tokens)
    y = megamoe.moe(x, ids, weights, w_gate_up, w_down, backend="fused", check_ids=False,
                    backward_mode=args.backward_mode)
    y.backward(dy)
    torch.cuda.synchronize()
    print(f"one {args.backward_mode}-mode step of {args.model}, T={args.tokens}: done")


if __name__ == "__main__":
    main()
