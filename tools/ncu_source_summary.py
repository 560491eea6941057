"""Where a kernel's warps stall, by instruction: a summary of Nsight Compute's source page.

    ncu --section SourceCounters --export rep ... python3 tools/profile_layer.py --ncu ...
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 tools/ncu_source_summary.py src.csv

Per kernel in the page (a kernel profiled twice appears once): the warp-stall samples by
opcode (all samples and not-issued ones, as % of the kernel's), the stall reasons summed over
its instructions, and for a grouped GEMM the samples between the marks of its mainloop, the
MMAs (HGMMA / QGMMA) and their waits (WARPGROUP.DEPBAR) executed at least once per k-block:
the region after a DEPBAR holds that group's promotion (FP8), the one before the first mark
the tile loop's head (and the producer's warp), the one after the loop the epilogue. The
samples cover every warp of the kernel, the producer's included.
"""

import argparse
import collections
import csv
import io
import re


def number(row, i):
    try:
        return float(row[i].replace(",", "")) if i is not None and i < len(row) and row[i] else 0.0
    except ValueError:
        return 0.0


def opcode(sass):
    s = re.sub(r"^@!?U?P\w+\s+", "", sass.strip())
    return s.split(" ")[0] if s else "?"


def kernels(text):
    for part in re.split(r'\n(?="Kernel Name")', text):
        lines = [l for l in part.splitlines() if l.strip()]
        if len(lines) < 2 or not lines[0].startswith('"Kernel Name"'):
            continue
        name = next(csv.reader([lines[0]]))[1]
        rows = list(csv.reader(io.StringIO("\n".join(lines[1:]))))
        yield name, rows[0], rows[1:]


def summarize(name, header, body, top):
    col = {h: i for i, h in enumerate(header)}
    src, stalls = col.get("Source"), col.get("Warp Stall Sampling (All Samples)")
    idle, executed = col.get("Warp Stall Sampling (Not-issued Samples)"), col.get("Instructions Executed")
    if src is None or stalls is None:
        print(f"== {name[:150]}\n   (no source or stall columns)")
        return
    total = sum(number(r, stalls) for r in body) or 1.0
    pct = lambda v: 100.0 * v / total  # noqa: E731
    print(f"== {name[:150]}\n   {len(body)} instructions, {total:.0f} stall samples")
    by_all, by_idle = collections.Counter(), collections.Counter()
    for r in body:
        op = opcode(r[src]) if src < len(r) else "?"
        by_all[op] += number(r, stalls)
        by_idle[op] += number(r, idle)
    print("   by opcode (% of samples: all, not issued)")
    for op, v in by_all.most_common(top):
        print(f"     {op:32s} {pct(v):6.2f} {pct(by_idle[op]):6.2f}")
    reasons = [(h, i) for h, i in col.items() if h.startswith("stall_") and "Not Issued" not in h]
    sums = sorted(((sum(number(r, i) for r in body), h) for h, i in reasons), reverse=True)
    print("   by reason: " + ", ".join(f"{h[6:]} {pct(v):.1f}" for v, h in sums[:8] if v > 0))
    # The mainloop: MMAs and their waits executed at least once per k-block (a tenth of the
    # most-executed MMA's count keeps the epilogue's and the prologue's out).
    mma = [i for i, r in enumerate(body) if re.search(r"[HQ]GMMA|WARPGROUP\.DEPBAR", r[src])]
    if not any(re.search(r"[HQ]GMMA", body[i][src]) for i in mma):
        return
    most = max(number(body[i], executed) for i in mma)
    marks = [i for i in mma if number(body[i], executed) >= 0.1 * most]
    print("   mainloop regions (% of samples), from each mark to the next:")
    for a, b in zip(marks, marks[1:]):
        print(f"     [{a:5d}, {b:5d}) {opcode(body[a][src]):34s} "
              f"{pct(sum(number(body[i], stalls) for i in range(a, b))):6.2f}")
    end = marks[-1]
    while end < len(body) and number(body[end], executed) >= 0.1 * most:
        end += 1
    print(f"     [{marks[-1]:5d}, {end:5d}) last mark to the loop's back edge      "
          f"{pct(sum(number(body[i], stalls) for i in range(marks[-1], end))):6.2f}")
    head = sum(number(body[i], stalls) for i in range(0, marks[0]))
    tail = sum(number(body[i], stalls) for i in range(end, len(body)))
    ffma = sum(number(body[i], stalls) for i in range(marks[0], end) if opcode(body[i][src]) == "FFMA")
    print(f"     before the first mark {pct(head):.2f}, after the loop {pct(tail):.2f}, "
          f"FFMA in the loop {pct(ffma):.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--top", type=int, default=12, help="opcodes listed per kernel")
    args = parser.parse_args()
    seen = set()
    for name, header, body in kernels(open(args.csv, errors="replace").read()):
        key = (name, len(body), tuple(tuple(r[:3]) for r in body[:50]))
        if key in seen:
            continue
        seen.add(key)
        summarize(name, header, body, args.top)


if __name__ == "__main__":
    main()
