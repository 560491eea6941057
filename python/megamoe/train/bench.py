"""`megamoe-train-bench CONFIG --backends mega_moe,torch,hf --name NAME`: the training-step
benchmark. Runs the same config once per MoE implementation (model.moe.dispatch.type), each
in a fresh `python -m megamoe.train` subprocess whose output is streamed, saves one row per
run under <out-dir>/<NAME>.rows/, then merges every saved row of NAME into
<out-dir>/<NAME>.json and <NAME>.png and prints a side-by-side table.

Runs can be split over invocations (one backend each, e.g. to fit a time limit per
command): each invocation adds or replaces its rows, and `--merge` alone rebuilds the record
from the rows already saved. Per row: the step time (median of steps 6-20), tokens/s/GPU,
MFU, peak memory, the loss curve, and the parts of the step (attention, experts, router,
LM head + loss timed in isolation in the same process at the same shapes; the optimizer
timed inside the steps). The record compares every backend with mega_moe: step-time ratio,
loss parity (mean loss over a window of steps, default 200-300, when the runs reach it) and,
with `--repeat 2`, whether two mega_moe runs gave bitwise-identical losses and, per backend,
the mean loss over its runs and their range. With `--seeds 0,1,2` each backend and precision
runs once per train.seed (initialisation and data order), and the parity is also taken seed by
seed, each run against mega_moe's run of the same seed: how far the curves of two backends
lie apart, next to how far one backend's seeds do.

Config overrides (--section.key VALUE) are passed to every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from . import config as config_mod
from . import metrics
from .parts import step_breakdown

BACKENDS = config_mod.DISPATCH_TYPES
REFERENCE = "mega_moe"
DEFAULT_OUT = "bench/results/train"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megamoe-train-bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="bench-qwen3-30b-a3b",
                        help="TOML file or embedded config (default: bench-qwen3-30b-a3b)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help=f"comma-separated model.moe.dispatch.type values (default: {','.join(BACKENDS)})")
    parser.add_argument("--precisions", default="bf16",
                        help="comma-separated model.moe.dispatch.precision values (default: bf16)")
    parser.add_argument("--name", help="record name (default: the config's name)")
    parser.add_argument("--steps", type=int, help="train.steps of every run (e.g. 20 for timing "
                        "only; the config's value otherwise)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each backend and precision in this invocation (mega_moe's "
                             "are compared bitwise; every group's runs give a mean loss and its "
                             "spread, compared between backends)")
    parser.add_argument("--repeat-start", type=int, default=1,
                        help="number of the first of those runs (2: add a second run to a saved "
                             "first one, e.g. a 50-step run for the determinism check)")
    parser.add_argument("--seeds",
                        help="comma-separated train.seed values: every backend and precision "
                             "runs once per seed (rows BACKEND-PRECISION-seedS), compared with "
                             "mega_moe's run of the same seed")
    parser.add_argument("--parity-window", default="200,300",
                        help="first,last step (inclusive) of the mean loss compared between "
                             "backends (default: 200,300)")
    parser.add_argument("--against", metavar="RECORD",
                        help="a saved record (.json) of the same config in another setting, "
                             "e.g. the EP=1 run of an EP=2 record: each row is also compared "
                             "with that record's row of the same backend, precision and seed "
                             "(step time, loss over the window, the largest gap between their "
                             "10-step mean losses)")
    parser.add_argument("--merge", action="store_true",
                        help="run nothing: rebuild the record from the rows saved for --name")
    parser.add_argument("--out-dir", default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--work-dir", help="where the runs' logs go (default: "
                        "outputs/train-bench/NAME)")
    parser.add_argument("--no-parts", action="store_true", help="skip the parts' timing")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="GPUs (processes) of every run: above 1 each run is launched with "
                             "torchrun --standalone --nproc-per-node N (set --parallel.ep for "
                             "expert parallelism; rows then hold rank 0's figures)")
    parser.add_argument("--no-plot", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    rest, overrides = config_mod.split_overrides(argv, parser.error)
    args = parser.parse_args(rest)
    backends = [b for b in args.backends.split(",") if b]
    precisions = [p for p in args.precisions.split(",") if p]
    for backend in backends:
        if backend not in BACKENDS:
            parser.error(f"--backends: {backend!r} is not one of {', '.join(BACKENDS)}")
    try:
        window = tuple(int(v) for v in args.parity_window.split(","))
        assert len(window) == 2 and 1 <= window[0] <= window[1]
    except (ValueError, AssertionError):
        parser.error(f"--parity-window: expected FIRST,LAST steps, got {args.parity_window!r}")
    if args.repeat < 1 or args.repeat_start < 1:
        parser.error("--repeat and --repeat-start must be >= 1")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node: must be >= 1, got {args.nproc_per_node}")
    seeds = [None]
    if args.seeds is not None:
        try:
            seeds = [int(v) for v in args.seeds.split(",") if v.strip()]
            assert seeds and all(v >= 0 for v in seeds) and len(set(seeds)) == len(seeds)
        except (ValueError, AssertionError):
            parser.error(f"--seeds: expected distinct integers >= 0 separated by commas, got "
                         f"{args.seeds!r}")
        if any(key == "train.seed" for key, _ in overrides):
            parser.error("--seeds and --train.seed: give the seeds in one of them")
    against = None
    if args.against:
        try:
            against = json.loads(Path(args.against).read_text())
            assert isinstance(against.get("rows"), list)
        except (OSError, ValueError, AssertionError, AttributeError):
            parser.error(f"--against: {args.against!r} is not a readable megamoe-train-bench record")
    name = args.name or Path(args.config).stem
    out_dir = Path(args.out_dir)
    rows_dir = out_dir / f"{name}.rows"
    command = "megamoe-train-bench " + shlex.join(argv)

    if not args.merge:
        # Every run's config is checked before the first one starts.
        try:
            base = config_mod.load(args.config, overrides)
            overrides = overrides + schedule_overrides(base, args.steps)
            for backend in backends:
                for precision in precisions:
                    config_mod.load(args.config, overrides + _run_overrides(backend, precision, args.steps))
        except config_mod.ConfigError as error:
            print(f"megamoe-train-bench: config error: {error}", file=sys.stderr)
            return 2
        work = Path(args.work_dir) if args.work_dir else Path("outputs/train-bench") / name
        failures = 0
        runs = [(b, p, seed, k) for b in backends for p in precisions for seed in seeds
                for k in range(args.repeat_start, args.repeat_start + args.repeat)]
        for index, (backend, precision, seed, repeat) in enumerate(runs, 1):
            _progress(f"run {index}/{len(runs)}: {backend}, {precision}"
                      + (f", seed {seed}" if seed is not None else "")
                      + (f", run {repeat}" if repeat > 1 else ""))
            row = run_one(args, overrides, backend, precision, repeat, work, command, seed)
            rows_dir.mkdir(parents=True, exist_ok=True)
            (rows_dir / f"{_row_key(row)}.json").write_text(json.dumps(row, indent=1) + "\n")
            failures += row["status"] != "ok"
            _progress(f"{backend}, {precision}: {row['status']}"
                      + (f", {row['step_ms']:.1f} ms/step" if row.get("step_ms") else ""))
    else:
        failures = 0
    record = merge(rows_dir, name, window, command, against)
    if record is None:
        print(f"megamoe-train-bench: no rows saved under {rows_dir}", file=sys.stderr)
        return 1
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    print(format_table(record))
    _progress(f"wrote {json_path}")
    if not args.no_plot:
        png = plot(record, out_dir / f"{name}.png")
        if png:
            _progress(f"wrote {png}")
    return 1 if failures else 0


def schedule_overrides(base, steps: int | None) -> list[tuple[str, str]]:
    """A run shortened by --steps follows the full run's LR schedule, so its losses are the
    full run's first steps (the determinism check compares them); a lengthened one gets
    its own schedule, not a decay that ends at the config's last step."""
    if steps and steps < base.train.steps and base.optim.decay_steps is None:
        return [("optim.decay_steps", str(base.train.steps))]
    return []


def _progress(message: str) -> None:
    print(f"[megamoe-train-bench] {message}", file=sys.stderr, flush=True)


def _row_id(backend: str, precision: str, repeat: int, seed: int | None = None) -> str:
    return (f"{backend}-{precision}" + (f"-seed{seed}" if seed is not None else "")
            + (f"-run{repeat}" if repeat > 1 else ""))


def _row_key(row: dict) -> str:
    # "seed" is in a row only when the bench chose it (--seeds); older rows have none.
    return _row_id(row["backend"], row["precision"], row["repeat"], row.get("seed"))


def _run_overrides(backend, precision, steps) -> list[tuple[str, str]]:
    extra = [("model.moe.dispatch.type", f'"{backend}"'),
             ("model.moe.dispatch.precision", f'"{precision}"')]
    if steps:
        extra.append(("train.steps", str(steps)))
    return extra


def run_one(args, overrides, backend: str, precision: str, repeat: int, work: Path,
            bench_command: str, seed: int | None = None) -> dict:
    """One training run in a fresh process (with train.seed = seed unless None); returns
    its row."""
    log_dir = work / _row_id(backend, precision, repeat, seed)
    summary_path = log_dir / "summary.json"
    if summary_path.exists():
        summary_path.unlink()
    seeded = [("train.seed", str(seed))] if seed is not None else []
    settings = overrides + seeded + _run_overrides(backend, precision, args.steps) + [
        ("log.dir", json.dumps(str(log_dir))), ("checkpoint.interval", "0"),
        ("checkpoint.resume", '"none"')]
    cmd = [sys.executable, "-m", "megamoe.train", args.config]
    if args.nproc_per_node > 1:
        # --standalone: a fresh rendezvous on a free port for every run.
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={args.nproc_per_node}", "-m", "megamoe.train"]
    for key, value in settings:
        cmd += [f"--{key}", value]
    cmd += ["--summary-json", str(summary_path)]
    if not args.no_parts:
        cmd.append("--time-parts")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    prefix = f"[{_row_id(backend, precision, repeat, seed)}] "
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, bufsize=1) as process:
        for line in process.stdout:
            print(prefix + line, end="", flush=True)
        code = process.wait()
    row = {"backend": backend, "precision": precision, "repeat": repeat,
           **({"seed": seed} if seed is not None else {}),
           "command": shlex.join(cmd), "bench_command": bench_command}
    if code != 0 or not summary_path.exists():
        return {**row, "status": f"failed (exit {code})"}
    summary = json.loads(summary_path.read_text())
    return {**row, **row_from_summary(summary)}


def row_from_summary(summary: dict) -> dict:
    steps = summary.pop("steps", [])
    median = summary["step_time_median_s"]
    row = {
        "status": "ok",
        "steps_run": len(steps),
        "step_ms": median * 1e3 if median else None,
        "tokens_per_s_per_gpu": summary["tokens_per_s_per_gpu"],
        "mfu": summary["mfu"],
        "peak_memory_gib": summary["peak_memory_gib"],
        "optimizer_ms": summary["optimizer_ms_median"],
        "loss": [r["loss"] for r in steps],
        "step_time_s": [r["step_time_s"] for r in steps],
        "parts": summary.get("parts"),
        "summary": summary,
    }
    config = summary["config"]
    if row["parts"] and median:
        row["breakdown"] = step_breakdown(
            row["parts"], summary["model"]["num_layers"], median * 1e3, row["optimizer_ms"],
            config["train"]["activation_checkpointing"], config["train"]["grad_accum"],
            config["train"].get("checkpoint_save_attention", False))
    return row


def merge(rows_dir: Path, name: str, window: tuple[int, int], command: str,
          against: dict | None = None) -> dict | None:
    if not rows_dir.is_dir():
        return None
    rows = [json.loads(p.read_text()) for p in sorted(rows_dir.glob("*.json"))]
    if not rows:
        return None
    order = {b: i for i, b in enumerate(BACKENDS)}
    rows.sort(key=lambda r: (order.get(r["backend"], 99), r["precision"],
                             -1 if r.get("seed") is None else r["seed"], r["repeat"]))
    done = [r for r in rows if r["status"] == "ok"]
    first = done[0]["summary"] if done else {}
    record = {
        "name": name,
        "gpu": first.get("gpu"),
        "world_size": first.get("world_size", 1),
        "commit": first.get("commit"),
        "command": command,
        "config": first.get("config"),
        "config_note": "model.moe.dispatch.type / precision differ per row",
        "torch": first.get("torch"), "transformers": first.get("transformers"),
        "model": first.get("model"), "flops_per_token": first.get("flops_per_token"),
        "peak_tflops": first.get("peak_tflops"),
        "step_time": "median of steps 6-20",
        "parity_window": list(window),
        "rows": [_public(r) for r in rows],
    }
    mixed = {(r["summary"].get("gpu"), r["summary"].get("commit")) for r in done}
    if len(mixed) > 1:
        record["warning"] = f"rows come from different GPUs or commits: {sorted(mixed)}"
    record["comparison"] = compare(done, window)
    record["parity_over_runs"] = parity_over_runs(done, window)
    if against is not None:
        record["against"] = compare_records(done, against, window)
    return record


def compare_records(rows: list[dict], other: dict, window: tuple[int, int]) -> dict:
    """Each row against the other record's row of the same backend, precision, seed and
    repeat: step-time ratio (this row's over the other's), the window's mean losses, the mean
    over the steps both ran, and the largest relative gap between their 10-step means."""
    theirs = {_row_key(r): r for r in other["rows"] if r.get("status") == "ok"}
    result = {"record": other.get("name"), "commit": other.get("commit"),
              "world_size": other.get("world_size", 1),
              "ep": ((other.get("config") or {}).get("parallel") or {}).get("ep"), "rows": {}}
    for row in rows:
        key = _row_key(row)
        base = theirs.get(key)
        if base is None:
            continue
        entry = {}
        if row["step_ms"] and base.get("step_ms"):
            entry["step_time_ratio"] = row["step_ms"] / base["step_ms"]
        mine, ref = _window_mean(row, window), _window_mean(base, window)
        if mine is not None and ref is not None:
            entry["loss_mean_window"], entry["other_loss_mean_window"] = mine, ref
            entry["loss_rel_diff_window"] = (mine - ref) / ref
        n = min(len(row["loss"]), len(base.get("loss") or []))
        if n:
            a, b = row["loss"][:n], base["loss"][:n]
            entry["steps_compared"] = n
            entry["loss_rel_diff_all_steps"] = (sum(a) - sum(b)) / sum(b)
            gaps = [(sum(a[i:i + 10]) - sum(b[i:i + 10])) / sum(b[i:i + 10])
                    for i in range(0, n - 9, 10)]
            if gaps:
                worst = max(range(len(gaps)), key=lambda i: abs(gaps[i]))
                entry["max_rel_gap_10_step_means"] = gaps[worst]
                entry["max_gap_steps"] = [10 * worst + 1, 10 * worst + 10]
            entry["bitwise_identical_steps"] = _identical_prefix(a, b)
        result["rows"][key] = entry
    return result


# A saved row carries its run's whole summary; the record keeps of it these fields per row
# (_public) and, from the first row, those the merge puts in the record itself.
_ROW_SUMMARY_KEYS = ("gpu", "commit", "dispatch", "wall_time_s", "flops_per_token")
_RECORD_SUMMARY_KEYS = ("config", "torch", "transformers", "model", "peak_tflops")


def _public(row: dict) -> dict:
    summary = row.get("summary") or {}
    out = {k: v for k, v in row.items() if k != "summary"}
    for key in _ROW_SUMMARY_KEYS:
        if key in summary:
            out[key] = summary[key]
    return out


def saved_row(record: dict, row: dict) -> dict:
    """The inverse of _public for one of a record's rows: a row file that merges back into
    the same record (its summary holds only what the record kept)."""
    saved = {k: v for k, v in row.items() if k not in _ROW_SUMMARY_KEYS}
    saved["summary"] = {**{key: record.get(key) for key in _RECORD_SUMMARY_KEYS},
                        **{key: row[key] for key in _ROW_SUMMARY_KEYS if key in row}}
    return saved


def compare(rows: list[dict], window: tuple[int, int]) -> dict:
    """Against the first mega_moe row of the same precision and seed: speed-up (its step
    time over theirs, inverted: how many times faster mega_moe is), loss parity over the
    window, and bitwise determinism between repeated mega_moe runs."""
    result = {}
    for row in rows:
        base = next((r for r in rows if r["backend"] == REFERENCE and r["precision"] == row["precision"]
                     and r.get("seed") == row.get("seed")), None)
        if base is None or row is base:
            continue
        key = _row_key(row)
        entry = {}
        if row["step_ms"] and base["step_ms"]:
            entry["mega_moe_speedup"] = row["step_ms"] / base["step_ms"]
        mine, theirs = _window_mean(row, window), _window_mean(base, window)
        if mine is not None and theirs is not None:
            entry["loss_mean_window"] = mine
            entry["mega_moe_loss_mean_window"] = theirs
            entry["loss_rel_diff_vs_mega_moe"] = (mine - theirs) / theirs
        else:
            entry["loss_parity"] = f"needs both runs to reach step {window[1]}"
        if row["backend"] == REFERENCE:
            same = _identical_prefix(base["loss"], row["loss"])
            entry["bitwise_identical_steps"] = same
            entry["bitwise_identical"] = same == min(len(base["loss"]), len(row["loss"]))
        result[key] = entry
    # A low-precision mega_moe row against the bf16 rows: loss against mega_moe's bf16 curve,
    # speed against the torch backend in bf16 (the FP8 issue's training bars).
    for row in rows:
        if row["backend"] != REFERENCE or row["precision"] == "bf16" or row["repeat"] != 1:
            continue
        bf16 = {r["backend"]: r for r in rows if r["precision"] == "bf16" and r["repeat"] == 1
                and r.get("seed") == row.get("seed")}
        entry = result.setdefault(_row_key(row), {})
        if "torch" in bf16 and row["step_ms"] and bf16["torch"]["step_ms"]:
            entry["speedup_vs_torch_bf16"] = bf16["torch"]["step_ms"] / row["step_ms"]
        if REFERENCE in bf16:
            mine, theirs = _window_mean(row, window), _window_mean(bf16[REFERENCE], window)
            if mine is not None and theirs is not None:
                entry["loss_rel_diff_vs_mega_moe_bf16"] = (mine - theirs) / theirs
    return result


def parity_over_runs(rows: list[dict], window: tuple[int, int]) -> dict:
    """Per backend and precision, the window's mean loss over every run that reached it
    (runs of one config take different trajectories where a kernel is nondeterministic),
    its spread, and the difference of the means against mega_moe's of the same precision."""
    groups: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        mean = _window_mean(row, window)
        if mean is not None:
            groups.setdefault((row["backend"], row["precision"]), []).append(mean)
    result = {}
    for (backend, precision), means in groups.items():
        entry = {"runs": len(means), "mean": sum(means) / len(means), "min": min(means),
                 "max": max(means)}
        base = groups.get((REFERENCE, precision))
        if base and backend != REFERENCE:
            base_mean = sum(base) / len(base)
            entry["rel_diff_vs_mega_moe"] = (entry["mean"] - base_mean) / base_mean
        result[f"{backend}-{precision}"] = entry
    for (backend, precision), entry in _paired_by_seed(rows, window).items():
        result[f"{backend}-{precision}"].update(entry)
    return result


def _paired_by_seed(rows: list[dict], window: tuple[int, int]) -> dict:
    """Per backend and precision run with --seeds: the window's relative loss difference
    against mega_moe's run of the same seed and precision (first runs), seed by seed, with
    their mean and range; for mega_moe itself, the spread of its seeds' means around theirs."""
    firsts = {(r["backend"], r["precision"], r["seed"]): _window_mean(r, window)
              for r in rows if r.get("seed") is not None and r["repeat"] == 1}
    firsts = {key: mean for key, mean in firsts.items() if mean is not None}
    result = {}
    for (backend, precision, seed), mean in sorted(firsts.items(), key=lambda kv: kv[0][2]):
        if backend == REFERENCE:
            continue
        base = firsts.get((REFERENCE, precision, seed))
        if base is not None:
            entry = result.setdefault((backend, precision), {"rel_diff_by_seed": {}})
            entry["rel_diff_by_seed"][str(seed)] = (mean - base) / base
    for entry in result.values():
        diffs = list(entry["rel_diff_by_seed"].values())
        entry.update(rel_diff_by_seed_mean=sum(diffs) / len(diffs),
                     rel_diff_by_seed_min=min(diffs), rel_diff_by_seed_max=max(diffs))
    for precision in {p for (_, p, _) in firsts}:
        means = [m for (b, p, _), m in firsts.items() if b == REFERENCE and p == precision]
        if len(means) > 1:
            center = sum(means) / len(means)
            result[(REFERENCE, precision)] = {
                "seed_spread": (max(means) - min(means)) / center}
    return result


def _window_mean(row: dict, window: tuple[int, int]) -> float | None:
    if len(row["loss"]) < window[1]:
        return None
    steps = [{"step": i + 1, "loss": v} for i, v in enumerate(row["loss"])]
    return metrics.mean_loss(steps, *window)


def _identical_prefix(a: list[float], b: list[float]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


COLUMNS = (("backend", "backend", str), ("prec", "precision", str), ("seed", "seed", str),
           ("run", "repeat", str),
           ("steps", "steps_run", str), ("step ms", "step_ms", "{:.1f}"),
           ("tok/s/GPU", "tokens_per_s_per_gpu", "{:,.0f}"), ("MFU %", "mfu_pct", "{:.1f}"),
           ("peak GiB", "peak_memory_gib", "{:.1f}"), ("mega_moe x", "speedup", "{:.3f}"),
           ("loss mean", "loss_mean", "{:.4f}"), ("dloss %", "loss_diff_pct", "{:+.2f}"),
           ("attn", "attention_ms", "{:.0f}"), ("experts", "experts_ms", "{:.0f}"),
           ("router", "router_ms", "{:.0f}"), ("head+loss", "lm_head_loss_ms", "{:.0f}"),
           ("optim", "optimizer_ms", "{:.0f}"), ("other", "other_ms", "{:.0f}"),
           ("status", "status", str))


def format_table(record: dict) -> str:
    window = record["parity_window"]
    lines = []
    cells = []
    for row in record["rows"]:
        key = _row_key(row)
        comparison = record["comparison"].get(key, {})
        flat = dict(row, mfu_pct=100 * row["mfu"] if row.get("mfu") else None,
                    speedup=comparison.get("mega_moe_speedup"),
                    loss_mean=_window_mean(row, tuple(window)) if row.get("loss") else None,
                    loss_diff_pct=100 * comparison["loss_rel_diff_vs_mega_moe"]
                    if "loss_rel_diff_vs_mega_moe" in comparison else None,
                    **(row.get("breakdown") or {}))
        flat["optimizer_ms"] = row.get("optimizer_ms")
        cells.append([_cell(flat.get(key_), fmt) for _, key_, fmt in COLUMNS])
    header = [title for title, _, _ in COLUMNS]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    for r in [header, *cells]:
        lines.append("  ".join(c.rjust(w) if i > 3 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))))
    lines.insert(1, "-" * len(lines[0]))
    world = record.get("world_size", 1)
    gpus = f"{world} x {record.get('gpu')}" if world > 1 else record.get("gpu")
    notes = [f"{gpus}, commit {str(record.get('commit'))[:12]}; step ms = median of "
             f"steps 6-20; 'mega_moe x' = this row's step time / mega_moe's; loss mean over "
             f"steps {window[0]}-{window[1]}; parts in ms per step (attn/experts/router x layers, "
             "with the recompute's forward under activation checkpointing)"]
    for key, entry in record["comparison"].items():
        if "speedup_vs_torch_bf16" in entry or "loss_rel_diff_vs_mega_moe_bf16" in entry:
            parts = []
            if "speedup_vs_torch_bf16" in entry:
                parts.append(f"{entry['speedup_vs_torch_bf16']:.3f}x the torch bf16 step")
            if "loss_rel_diff_vs_mega_moe_bf16" in entry:
                parts.append(f"loss {100 * entry['loss_rel_diff_vs_mega_moe_bf16']:+.2f}% "
                             "of mega_moe bf16's")
            notes.append(f"{key}: " + ", ".join(parts))
        if "bitwise_identical" in entry:
            notes.append(f"{key}: {'bitwise identical' if entry['bitwise_identical'] else 'NOT identical'} "
                         f"losses to mega_moe run 1 over {entry['bitwise_identical_steps']} steps")
    parity = record.get("parity_over_runs", {})
    # With one run each, the table's loss columns already say it all.
    if any(entry["runs"] > 1 for entry in parity.values()):
        for key, entry in parity.items():
            versus = (f", {100 * entry['rel_diff_vs_mega_moe']:+.2f}% of mega_moe's mean"
                      if "rel_diff_vs_mega_moe" in entry else "")
            notes.append(f"{key}: mean loss {entry['mean']:.4f} over {entry['runs']} run(s) "
                         f"(range {entry['min']:.4f}-{entry['max']:.4f}){versus}")
    for key, entry in parity.items():
        if "rel_diff_by_seed" in entry:
            by_seed = ", ".join(f"seed {s} {100 * d:+.2f}%" for s, d in entry["rel_diff_by_seed"].items())
            notes.append(f"{key} against mega_moe seed by seed: {by_seed} (mean "
                         f"{100 * entry['rel_diff_by_seed_mean']:+.2f}%)")
        if "seed_spread" in entry:
            notes.append(f"{key}: its seeds' mean losses span {100 * entry['seed_spread']:.2f}%")
    against = record.get("against")
    for key, entry in (against or {}).get("rows", {}).items():
        parts = []
        if "step_time_ratio" in entry:
            parts.append(f"step time {entry['step_time_ratio']:.3f}x")
        if "loss_rel_diff_window" in entry:
            parts.append(f"loss {100 * entry['loss_rel_diff_window']:+.2f}% over steps "
                         f"{window[0]}-{window[1]}")
        if "loss_rel_diff_all_steps" in entry:
            parts.append(f"{100 * entry['loss_rel_diff_all_steps']:+.2f}% over steps "
                         f"1-{entry['steps_compared']}")
        if "max_rel_gap_10_step_means" in entry:
            first, last = entry["max_gap_steps"]
            parts.append(f"largest gap of 10-step means {100 * entry['max_rel_gap_10_step_means']:+.2f}% "
                         f"(steps {first}-{last})")
        notes.append(f"{key} against {against['record']}: " + (", ".join(parts) or "nothing in common"))
    return "\n".join(lines + notes)


def _cell(value, fmt) -> str:
    if value is None:
        return "-"
    return fmt(value) if callable(fmt) else fmt.format(value)


def plot(record: dict, path: Path) -> Path | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    rows = [r for r in record["rows"] if r["status"] == "ok"]
    if not rows:
        return None
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    loss_ax, time_ax = fig.subplots(1, 2)
    for row in rows:
        label = _row_key(row)
        loss_ax.plot(range(1, len(row["loss"]) + 1), row["loss"], label=label, linewidth=1)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("LM loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=8)
    parts = ("attention_ms", "experts_ms", "router_ms", "lm_head_loss_ms", "optimizer_ms", "other_ms")
    labels = [_row_key(r) for r in rows]
    bottoms = [0.0] * len(rows)
    if all(r.get("breakdown") for r in rows):
        for part in parts:
            heights = [max(0.0, r["breakdown"][part]) for r in rows]
            time_ax.bar(labels, heights, bottom=bottoms, label=part[:-3])
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        time_ax.legend(fontsize=8)
    else:
        time_ax.bar(labels, [r["step_ms"] or 0 for r in rows])
    for i, row in enumerate(rows):
        if row["step_ms"]:
            time_ax.text(i, row["step_ms"], f"{row['step_ms']:.0f} ms", ha="center", va="bottom",
                         fontsize=8)
    time_ax.set_ylabel("ms per step (median of steps 6-20)")
    if len(rows) > 3:  # the row names would overlap
        for tick in time_ax.get_xticklabels():
            tick.set_rotation(30)
            tick.set_horizontalalignment("right")
            tick.set_fontsize(8)
    commits = sorted({str(r.get("commit"))[:12] for r in rows if r.get("commit")})
    where = (f"commit {commits[0]}" if len(commits) == 1
             else f"commits {', '.join(commits)} (see the rows)")
    fig.suptitle(f"megamoe-train-bench {record['name']}: {record.get('gpu')}, {where}", fontsize=9)
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    sys.exit(main())
