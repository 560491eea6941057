#!/usr/bin/env bash
# CUDA compiler launcher (CMakeLists.txt): runs one nvcc command and fails it when ptxas
# reports serialized wgmma ("Potential Performance Loss: wgmma.mma_async instructions are
# serialized", whatever its reason code: C7520 for a wgmma under a runtime condition, C7514
# for accumulators read while their wgmma may be in flight, C7518 for a wait ptxas had to
# insert in a divergent path, and others). ptxas prints that as information and the build goes on,
# yet every wgmma of the kernel then waits for the previous one, which no test notices and
# which costs a GEMM far more than the note's wording suggests (PERFLOG, second session of
# 2026-11-30, has the measured case).
set -uo pipefail
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$@" 2>"$log"
status=$?
cat "$log" >&2
if grep -q "wgmma.mma_async instructions are serialized" "$log"; then
  # Remove the object too: make would otherwise take it as up to date on the next build.
  out=""
  prev=""
  for arg in "$@"; do
    if [ "$prev" = "-o" ]; then out=$arg; fi
    prev=$arg
  done
  if [ -n "$out" ]; then rm -f "$out"; fi
  echo "error: ptxas serialized wgmma.mma_async (above): a wgmma under a runtime" \
       "condition, or accumulators touched between wgmma and wgmma.wait, makes ptxas do" \
       "that; fix the kernel" >&2
  exit 1
fi
exit "$status"
