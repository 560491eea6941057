"""Checks every experts call of a real training run against the torch backend.

    python3 tools/check_training_layers.py OUT_DIR [--stop-after STEP] [megamoe-train args...]

Runs `megamoe-train` in this process (same config handling, e.g. `bench-qwen3-30b-a3b`)
with the experts implementation "megamoe" wrapped: each call's output is compared with the
torch backend's on the same inputs (bf16 both; a few 1e-3 apart when both are right), and a
checksum of the forward's output is compared with the recompute's (activation
checkpointing runs each layer twice; they must be bitwise equal). One JSON line per call
goes to OUT_DIR/calls.jsonl. A call more than --bad apart from the torch backend is
diagnosed on the spot: the same inputs again (does it repeat?), the rows that are wrong
and the experts they route to, and the same routing with fresh random activations and
weights (is it the routing?); its ids and router weights are saved to OUT_DIR.

The run stops after --stop-after steps (the config's train.steps keeps the schedule of a
full run, so the first steps are those of the full run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import megamoe
import megamoe.integrations.transformers as mt
from megamoe.train import trainer
from transformers.integrations import moe as hf_moe


class Stop(Exception):
    pass


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def checksum(y: torch.Tensor) -> int:
    bits = y.contiguous().view(torch.int16).to(torch.int64)
    weights = torch.arange(1, bits.shape[-1] + 1, device=y.device, dtype=torch.int64)
    return int((bits * weights).sum().item())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-after", type=int, default=70)
    parser.add_argument("--bad", type=float, default=2e-2)
    args, rest = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "calls.jsonl").open("w")
    inner = mt.experts_forward
    layer_of: dict[int, int] = {}
    state = {"step": 0, "forward_sums": {}, "saved": 0}

    def checked(self, hidden_states, top_k_index, top_k_weights):
        y = inner(self, hidden_states, top_k_index, top_k_weights)
        layer = layer_of.setdefault(id(self), len(layer_of))
        recompute = torch._C._current_graph_task_id() != -1
        if layer == 0 and not recompute:
            state["step"] += 1
            if state["step"] > args.stop_after:
                raise Stop()
        step = state["step"]
        with torch.no_grad():
            x = hidden_states.reshape(-1, hidden_states.shape[-1]).detach()
            ids = top_k_index.reshape(x.shape[0], -1).detach()
            p = top_k_weights.reshape(x.shape[0], -1).detach().float()
            w1 = self.gate_up_proj.detach().to(x.dtype)
            w2 = self.down_proj.detach().to(x.dtype)
            yd = y.reshape(x.shape).detach()
            ref = megamoe.moe(x, ids, p, w1, w2, backend="torch")
            err = rel(yd, ref)
            counts = torch.bincount(ids.flatten().clamp_min(0), minlength=w1.shape[0])
            key = (step, layer)
            s = checksum(yd)
            same = None
            if recompute:
                same = state["forward_sums"].pop(key, None) == s
            else:
                state["forward_sums"][key] = s
            row = {"step": step, "layer": layer, "recompute": recompute, "rel_err": err,
                   "recompute_bitwise_equal": same, "max_count": int(counts.max()),
                   "zero_experts": int((counts == 0).sum()), "x_absmax": x.abs().max().item(),
                   "y_norm": yd.double().norm().item(), "ref_norm": ref.double().norm().item()}
            if err > args.bad:
                row["diagnosis"] = diagnose(x, ids, p, w1, w2, yd, ref, counts)
                if state["saved"] < 4:
                    state["saved"] += 1
                    torch.save({"ids": ids.cpu(), "p": p.cpu(), "row": row},
                               args.out / f"bad-step{step}-layer{layer}.ids")
            log.write(json.dumps(row) + "\n")
            log.flush()
            if err > args.bad or same is False:
                print(f"[check] BAD {json.dumps(row)}", flush=True)
            elif layer == 0 and not recompute:
                print(f"[check] step {step} layer 0 rel_err {err:.2e} max_count {row['max_count']}",
                      flush=True)
        return y

    def diagnose(x, ids, p, w1, w2, y, ref, counts) -> dict:
        out = {}
        again = [megamoe.moe(x, ids, p, w1, w2, backend="fused") for _ in range(3)]
        out["again_rel_err"] = [rel(a, ref) for a in again]
        out["again_bitwise_equal_first"] = [bool(torch.equal(a, y)) for a in again]
        row_err = (y.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1).clamp_min(1e-30)
        bad_rows = (row_err > 0.1).nonzero().flatten()
        out["bad_rows"] = int(bad_rows.numel())
        out["bad_rows_first"] = bad_rows[:16].tolist()
        if bad_rows.numel():
            bad_ids = ids[bad_rows].flatten()
            hist = torch.bincount(bad_ids.clamp_min(0), minlength=w1.shape[0])
            top = torch.argsort(hist, descending=True)[:10]
            out["bad_rows_experts"] = [[int(e), int(hist[e]), int(counts[e])] for e in top]
        order = torch.argsort(counts, descending=True)[:10]
        out["top_counts"] = [[int(e), int(counts[e])] for e in order]
        gen = torch.Generator(device=x.device).manual_seed(0)
        xr = torch.randn(x.shape, device=x.device, generator=gen).to(x.dtype)
        w1r = (torch.randn(w1.shape, device=x.device, generator=gen) * w1.shape[2] ** -0.5).to(x.dtype)
        w2r = (torch.randn(w2.shape, device=x.device, generator=gen) * w2.shape[2] ** -0.5).to(x.dtype)
        out["same_ids_random_data_rel_err"] = rel(megamoe.moe(xr, ids, p, w1r, w2r, backend="fused"),
                                                  megamoe.moe(xr, ids, p, w1r, w2r, backend="torch"))
        ids_r = torch.stack([torch.randperm(w1.shape[0], device=x.device, generator=gen)[:ids.shape[1]]
                             for _ in range(x.shape[0])])
        out["same_data_random_ids_rel_err"] = rel(megamoe.moe(x, ids_r, p, w1, w2, backend="fused"),
                                                  megamoe.moe(x, ids_r, p, w1, w2, backend="torch"))
        return out

    hf_moe.ALL_EXPERTS_FUNCTIONS.register("megamoe", checked)
    try:
        # Without early stop, the recompute runs each layer to its end, so the checks after
        # the experts call run there too (by default the recompute stops inside that call,
        # once the layer's last saved tensor is back).
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            trainer.main(rest)
    except Stop:
        print(f"[check] stopped after step {args.stop_after}", flush=True)
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
