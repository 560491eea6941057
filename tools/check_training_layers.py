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

    python3 tools/check_training_layers.py OUT_DIR --grads-at-step S [--grads-calls N] \
        [megamoe-train args...]

also checks the backward of step S. For each of the step's experts calls (the first N
layers; default all) it keeps, on the host, what the experts backend was given (x, top-k
ids, top-k weights, gate_up_proj, down_proj and the backend's options, from the forward;
under activation checkpointing the recompute's inputs are compared with them by checksum
and replace them if they differ, since the backward uses the recompute's), the gradient dy
that reaches the backend's output in the backward, and the gradients the run's backend
produced there (dx, d top-k weights, d gate_up_proj, d down_proj). The run stops after step
S. Then, with the run's memory freed, one call at a time on the run's device, the same
inputs and dy go through: the run's backend with its precision and backward_mode, the
torch backend in bf16, and float64 autograd through megamoe.reference.forward (plain
PyTorch math; its handwritten float64 backward is reported beside it as a cross-check).
One JSON line per call goes to OUT_DIR/grads.jsonl: per quantity (y, dx, d_topk_weights,
d_gate_up_proj, d_down_proj) and per backend, against float64: rel (||g - g64|| / ||g64||),
max_rel (max |g - g64| / max |g64|), cos, norm_ratio (||g|| / ||g64||) and proj
(<g, g64> / <g64, g64>, the scale along the float64 gradient: a systematic scale error
shows here and in norm_ratio, noise only in rel); and "replay": the run backend's
recomputed gradients against those the run produced (bitwise, rel). A per-layer table and
one verdict line per quantity (which backend is closer to float64, by how much) are
printed and written to OUT_DIR/grads-summary.txt. Host memory: about 2.7 GB per checked
call at 16384 tokens, H=2048, I=768, 128 experts (the weights and their gradients in bf16);
GPU memory during the checks, after the run's is freed: the float64 weights, gradients and
autograd graph of one call (a few tens of GB for such a call). Not under expert
parallelism or train.compile.
"Step" counts the forwards of the first MoE layer, i.e. micro-batches with grad_accum > 1.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

import megamoe
import megamoe.integrations.transformers as mt
from megamoe import reference
from megamoe.train import trainer
from transformers.integrations import moe as hf_moe

# The quantities compared against float64: the forward's output and the four gradients.
QUANTITIES = ("y", "dx", "d_topk_weights", "d_gate_up_proj", "d_down_proj")
INPUTS = ("x", "ids", "p", "w_gate_up", "w_down")
CHUNK = 1 << 25  # elements per chunk of a checksum or a float64 comparison (256 MB)


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


def bit_sum(t: torch.Tensor) -> int:
    """Sum of the bit patterns as integers, in chunks: sum(dtype=int64) casts its input
    first, and a whole weight's int64 copy (3.2 GB for gate_up_proj) may not fit."""
    flat = t.detach().contiguous().reshape(-1)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    flat = flat.view(bits)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        total += flat[start:start + CHUNK].sum(dtype=torch.int64)
    return int(total.item())


# -- the gradient check ------------------------------------------------------------------

class GradCapture:
    """What one step's experts calls were given and what their backward got and produced,
    kept on the host, one record per layer."""

    def __init__(self, step: int, calls: int | None):
        self.step, self.calls = step, calls
        self.records: dict[int, dict] = {}

    def wants(self, step: int, layer: int) -> bool:
        return step == self.step and (self.calls is None or layer < self.calls)

    def call(self, real_moe, where, x, ids, p, w1, w2, kwargs):
        _, layer, recompute = where
        if kwargs.get("group") is not None:
            raise SystemExit("--grads-at-step: the check replays each call on one device; "
                             "it does not run under expert parallelism")
        inputs = dict(zip(INPUTS, (x, ids, p, w1, w2)))
        sums = {name: bit_sum(t) for name, t in inputs.items()}
        record = self.records.get(layer)
        if record is None:
            record = self.records[layer] = {
                "opts": {name: kwargs.get(name) for name in ("backend", "precision",
                                                             "backward_mode")},
                "device": x.device, "inputs": _to_host(inputs), "sums": sums,
                "recompute_inputs_equal": None, "train": {}}
        elif recompute and record["recompute_inputs_equal"] is None:
            record["recompute_inputs_equal"] = sums == record["sums"]
            if sums != record["sums"]:
                record["inputs"] = _to_host(inputs)  # the backward uses the recompute's
        else:
            return real_moe(x, ids, p, w1, w2, **kwargs)
        # Each differentiable input goes in through a view of its own: a hook on the view
        # sees exactly the gradient this call's backward gives that input, whatever else
        # uses the tensor, and no hook stays on the parameters after the step. Only the
        # graph the backward runs fires its hooks: the forward's under non-reentrant
        # checkpointing (the recompute only refills that graph's saved tensors).
        names = ("dx", None, "d_topk_weights", "d_gate_up_proj", "d_down_proj")
        args = [self._hooked(t, record, name) if name else t
                for t, name in zip((x, ids, p, w1, w2), names)]
        y = real_moe(*args, **kwargs)
        self._hooked(y, record, "dy", view=False)
        if not recompute:
            record["train"]["y"] = _host_copy(y)
        return y

    @staticmethod
    def _hooked(t, record, name, view=True):
        if not t.requires_grad:
            return t
        if view:
            t = t.view_as(t)
        t.register_hook(functools.partial(_keep, record["train"], name))
        return t


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    # A copy also on CPU, where .cpu() would alias storage that the run overwrites or frees
    # (the optimizer's in-place step, the refresh of bf16 compute copies, FSDP's resharding).
    return t.detach().to("cpu", copy=True)


def _keep(store: dict, name: str, grad: torch.Tensor) -> None:
    if name not in store:
        store[name] = _host_copy(grad)


def _to_host(tensors: dict) -> dict:
    return {name: _host_copy(t) for name, t in tensors.items()}


def compare(g: torch.Tensor, ref: torch.Tensor) -> dict:
    """g against ref (float64 in chunks, on ref's device): rel, max_rel, cos, norm_ratio,
    proj (module docstring)."""
    g, ref = g.detach().reshape(-1), ref.detach().reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=ref.device)
    dot = gg = rr = dd = dmax = rmax = zero
    for start in range(0, ref.numel(), CHUNK):
        a = g[start:start + CHUNK].to(ref.device, torch.float64)
        b = ref[start:start + CHUNK].to(torch.float64)
        d = a - b
        dot, gg = dot + (a * b).sum(), gg + (a * a).sum()
        rr, dd = rr + (b * b).sum(), dd + (d * d).sum()
        dmax, rmax = torch.maximum(dmax, d.abs().max()), torch.maximum(rmax, b.abs().max())
    dot, gg, rr, dd, dmax, rmax = torch.stack([dot, gg, rr, dd, dmax, rmax]).tolist()
    tiny = 1e-300
    return {"rel": (dd / max(rr, tiny)) ** 0.5, "max_rel": dmax / max(rmax, tiny),
            "cos": dot / max((gg * rr) ** 0.5, tiny), "norm_ratio": (gg / max(rr, tiny)) ** 0.5,
            "proj": dot / max(rr, tiny)}


def float64_grads(inputs: dict, dy: torch.Tensor) -> tuple[dict, dict]:
    """y and the gradients by autograd through the plain PyTorch layer in float64, and the
    relative differences of the handwritten float64 backward (reference.backward) from
    them."""
    x, p, w1, w2 = (inputs[n].detach().double().requires_grad_() for n in ("x", "p",
                                                                               "w_gate_up",
                                                                               "w_down"))
    ids, dy = inputs["ids"], dy.double()
    y = reference.forward(x, ids, p, w1, w2, torch.float64)
    y.backward(dy)
    out = {"y": y.detach(), "dx": x.grad, "d_topk_weights": p.grad, "d_gate_up_proj": w1.grad,
           "d_down_proj": w2.grad}
    del y
    with torch.no_grad():
        manual = reference.backward(dy, x, ids, p, w1, w2, torch.float64)
        cross = {name: compare(g, out[name])["rel"] for name, g in zip(QUANTITIES[1:], manual)}
    return out, cross


def backend_grads(inputs: dict, dy: torch.Tensor, **opts) -> dict:
    """y and the gradients of one megamoe backend on these inputs and dy."""
    x, p, w1, w2 = (inputs[n].detach().requires_grad_() for n in ("x", "p", "w_gate_up",
                                                                    "w_down"))
    y = megamoe.moe(x, inputs["ids"], p, w1, w2, **opts)
    y.backward(dy.to(y.dtype))
    return {"y": y.detach(), "dx": x.grad, "d_topk_weights": p.grad, "d_gate_up_proj": w1.grad,
            "d_down_proj": w2.grad}


def check_call(step: int, layer: int, record: dict) -> dict:
    """One call's gradients three ways, one at a time on the run's device."""
    device, opts, train = record["device"], record["opts"], record["train"]
    inputs = {name: t.to(device) for name, t in record["inputs"].items()}
    dy = train["dy"].to(device)
    g64, cross = float64_grads(inputs, dy)
    row = {"step": step, "layer": layer, "tokens": inputs["x"].shape[0], **opts,
           "recompute_inputs_equal": record["recompute_inputs_equal"],
           "dy_norm": dy.double().norm().item(),
           "norm64": {name: g.norm().item() for name, g in g64.items()},
           "float64_crosscheck": cross, "vs_float64": {}, "replay": {}}
    # The torch backend in bf16 is the second column, unless it is the run's backend.
    run_label = opts["backend"]
    if opts["precision"] != "bf16" and opts["backend"] != "reference":
        run_label += f"-{opts['precision']}"
    elif opts["backend"] == "torch" and inputs["x"].dtype != torch.bfloat16:
        run_label += "-" + str(inputs["x"].dtype).removeprefix("torch.")
    runs = [(run_label, inputs, dict(opts))]
    if run_label != "torch":
        bf16 = {n: t.to(torch.bfloat16) if t.is_floating_point() and n != "p" else t
                for n, t in inputs.items()}
        runs.append(("torch", bf16, {"backend": "torch", "precision": "bf16"}))
    for label, these, kwargs in runs:
        grads = backend_grads(these, dy if label == run_label else dy.to(torch.bfloat16),
                              **kwargs)
        row["vs_float64"][label] = {name: compare(grads[name], g64[name]) for name in QUANTITIES}
        if label == run_label:
            for name in QUANTITIES:
                seen = train.get(name)
                if seen is None:
                    row["replay"][name] = None
                    continue
                seen = seen.to(device)
                row["replay"][name] = {"bitwise_equal": bool(torch.equal(grads[name], seen)),
                                       "rel": compare(grads[name], seen)["rel"]}
                del seen
        del grads
    return row


def run_checks(capture: GradCapture, out: Path) -> int:
    """Checks every captured call, one at a time, and prints the table and verdicts."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        print(f"[grads] GPU memory in use before the checks: "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
    if not capture.records:
        print(f"[grads] step {capture.step} was not reached: nothing checked", flush=True)
        return 1
    rows = []
    with (out / "grads.jsonl").open("w") as log:
        for layer in sorted(capture.records):
            record = capture.records.pop(layer)
            row = None
            if "dy" not in record["train"]:
                print(f"[grads] layer {layer}: no gradient reached its output; skipped",
                      flush=True)
            else:
                try:
                    row = check_call(capture.step, layer, record)
                except torch.OutOfMemoryError as error:
                    print(f"[grads] layer {layer}: out of memory in the check; skipped "
                          f"({error})", flush=True)
            # One call's copies at a time: its host copies and device tensors go here.
            del record
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if row is None:
                continue
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"[grads] {call_line(row)}", flush=True)
    text = summary(rows)
    print(text, flush=True)
    (out / "grads-summary.txt").write_text(text + "\n")
    return 0


def _labels(rows: list[dict]) -> list[str]:
    return list(rows[0]["vs_float64"]) if rows else []


def call_line(row: dict) -> str:
    labels = _labels([row])
    parts = [f"{name} " + "/".join(f"{row['vs_float64'][label][name]['rel']:.2e}"
                                    for label in labels) for name in QUANTITIES]
    replay = row["replay"]
    differ = [n for n, r in replay.items() if r is not None and not r["bitwise_equal"]]
    said = ("bitwise equal" if not differ else
            "differs in " + ", ".join(f"{n} ({replay[n]['rel']:.1e})" for n in differ))
    return (f"step {row['step']} layer {row['layer']}: rel err vs float64 "
            f"({'/'.join(labels)}): {', '.join(parts)}; the run's backward replayed: {said}")


def summary(rows: list[dict]) -> str:
    labels = _labels(rows)
    if not rows:
        return "[grads] no call checked"
    lines = [f"[grads] step {rows[0]['step']}, {len(rows)} experts calls against float64 "
             "(rel: ||g - g64|| / ||g64||; max: max|g - g64| / max|g64|; ratio: ||g|| / "
             "||g64||; proj: <g, g64> / <g64, g64>)"]
    head = f"{'layer':>5} {'quantity':<15}"
    for label in labels:
        head += f" | {label + ' rel':>14} {'max':>8} {'ratio':>9} {'proj':>9}"
    lines.append(head + " | replay")
    for row in rows:
        for name in QUANTITIES:
            line = f"{row['layer']:>5} {name:<15}"
            for label in labels:
                m = row["vs_float64"][label][name]
                line += (f" | {m['rel']:>14.2e} {m['max_rel']:>8.1e} {m['norm_ratio']:>9.5f}"
                         f" {m['proj']:>9.5f}")
            replay = row["replay"].get(name)
            line += " | " + ("-" if replay is None else "equal" if replay["bitwise_equal"]
                             else f"{replay['rel']:.1e}")
            lines.append(line)
    lines.append(f"[grads] verdict over {len(rows)} calls (medians over the calls):")
    for name in QUANTITIES:
        lines.append("  " + verdict(rows, labels, name))
    worst = max(max(row["float64_crosscheck"].values()) for row in rows)
    lines.append(f"[grads] float64 autograd against the handwritten float64 backward: largest "
                 f"rel difference {worst:.1e}")
    unequal = [row["layer"] for row in rows if row["recompute_inputs_equal"] is False]
    if unequal:
        lines.append(f"[grads] the recompute's inputs differ from the forward's in layers "
                     f"{unequal} (the recompute's were checked)")
    return "\n".join(lines)


def verdict(rows: list[dict], labels: list[str], name: str) -> str:
    def median(label, key):
        return statistics.median(row["vs_float64"][label][name][key] for row in rows)

    scale = ", ".join(f"{label} ratio {median(label, 'norm_ratio'):.5f} proj "
                      f"{median(label, 'proj'):.5f}" for label in labels)
    if len(labels) < 2:
        return (f"{name:<15} {labels[0]} rel err {median(labels[0], 'rel'):.2e}; {scale} "
                "(the run's backend is the torch backend in bf16: no second one)")
    a, b = labels[:2]
    ra, rb = median(a, "rel"), median(b, "rel")
    closer, other = (a, b) if ra <= rb else (b, a)
    near, far = min(ra, rb), max(ra, rb)
    wins = sum(row["vs_float64"][closer][name]["rel"] <= row["vs_float64"][other][name]["rel"]
               for row in rows)
    factor = far / near if near > 0 else float("inf")
    how = "about as close as" if factor < 1.1 else f"{factor:.3g}x closer than"
    return (f"{name:<15} {closer} {how} {other} (rel err {closer} {near:.2e}, {other} "
            f"{far:.2e}; closer in {wins}/{len(rows)} calls); {scale}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this step (default 70; --grads-at-step S: S)")
    parser.add_argument("--bad", type=float, default=2e-2)
    parser.add_argument("--grads-at-step", type=int, default=None,
                        help="check the backward of every experts call of this step")
    parser.add_argument("--grads-calls", type=int, default=None,
                        help="with --grads-at-step: only the first N layers' calls")
    args, rest = parser.parse_known_args(argv)
    if args.grads_at_step is not None:
        if args.grads_at_step < 1:
            parser.error("--grads-at-step: steps count from 1")
        if args.stop_after not in (None, args.grads_at_step):
            print(f"[check] --grads-at-step {args.grads_at_step}: the run stops after step "
                  f"{args.grads_at_step}, not {args.stop_after}", flush=True)
        args.stop_after = args.grads_at_step
    elif args.grads_calls is not None:
        parser.error("--grads-calls needs --grads-at-step")
    if args.stop_after is None:
        args.stop_after = 70
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "calls.jsonl").open("w")
    inner = mt.experts_forward
    real_moe = mt.moe
    layer_of: dict[int, int] = {}
    state = {"step": 0, "forward_sums": {}, "saved": 0, "call": None}
    capture = (GradCapture(args.grads_at_step, args.grads_calls)
               if args.grads_at_step is not None else None)

    def capturing_moe(x, ids, p, w1, w2, **kwargs):
        where = state["call"]
        if where is None or not capture.wants(where[0], where[1]):
            return real_moe(x, ids, p, w1, w2, **kwargs)
        return capture.call(real_moe, where, x, ids, p, w1, w2, kwargs)

    def checked(self, hidden_states, top_k_index, top_k_weights):
        layer = layer_of.setdefault(id(self), len(layer_of))
        recompute = torch._C._current_graph_task_id() != -1
        if layer == 0 and not recompute:
            state["step"] += 1
            if state["step"] > args.stop_after:
                raise Stop()
        step = state["step"]
        state["call"] = (step, layer, recompute)
        try:
            y = inner(self, hidden_states, top_k_index, top_k_weights)
        finally:
            state["call"] = None
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
    if capture is not None:
        mt.moe = capturing_moe
    try:
        # Without early stop, the recompute runs each layer to its end, so the checks after
        # the experts call run there too (by default the recompute stops inside that call,
        # once the layer's last saved tensor is back).
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            trainer.main(rest)
    except Stop:
        print(f"[check] stopped after step {args.stop_after}", flush=True)
    finally:
        hf_moe.ALL_EXPERTS_FUNCTIONS.register("megamoe", inner)
        mt.moe = real_moe
        log.close()
    if capture is None:
        return 0
    # The run's model, optimizer and graph are gone with the trainer's frames; the checks
    # get the device to themselves.
    return run_checks(capture, args.out)


if __name__ == "__main__":
    sys.exit(main())
