#!/usr/bin/env bash
# Every GPU test plus a short benchmark, in one go, on a machine with one or more GPUs.
# Uses the library and C++ tests already built in build/ (tools/run_tests.sh builds them;
# carry build/ to the GPU machine instead of compiling there).
#
#   bash tools/gpu_check.sh OUT_DIR            # tests + short benchmark
#   MEGAMOE_BENCH_ARGS="--tokens 16384" bash tools/gpu_check.sh OUT_DIR
#
# Writes to OUT_DIR: gpu.txt, ctest.log (+ gtest.xml), pytest.log, ep_check*.json (2+ GPUs),
# sass.txt/sass.log, sanitizer-*.log, fp8-quantize.log, bench-short.json and the benchmark
# log. Exits non-zero if any step failed.
set -uo pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

export PYTHONUNBUFFERED=1
export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}"
export MEGAMOE_LIBRARY=${MEGAMOE_LIBRARY:-$repo/build/libmegamoe.so}
# NVLink multicast stays off on shared machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
failed=()
step() {  # step NAME LOG COMMAND...: runs a step, keeps its log, remembers a failure
  local name=$1 log=$2; shift 2
  echo "== $name" >&2
  local t0=$SECONDS
  if "$@" >"$out/$log" 2>&1; then echo "   ok ($((SECONDS - t0)) s)" >&2
  else echo "   FAILED ($((SECONDS - t0)) s), see $log" >&2; tail -n 30 "$out/$log" >&2; failed+=("$name"); fi
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv >"$out/gpu.txt" 2>&1
nvidia-smi topo -m >>"$out/gpu.txt" 2>&1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $gpus" >&2

step "C++ tests" ctest.log build/tests/cpp/megamoe_tests --gtest_output="xml:$out/gtest.xml"
step "Python tests" pytest.log python3 -m pytest -v -rs tests/python --ignore=tests/python/test_ep.py
# The fused EP ops at every precision on a one-rank group, through Python.
step "EP one-rank check" ep_one_rank.log python3 -m torch.distributed.run --standalone \
  --nproc-per-node 1 tests/python/ep_one_rank_check.py
if [ "$gpus" -ge 2 ]; then
  step "EP=2 check" ep_check.log python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    tests/python/ep_check.py --json "$out/ep_check.json"
  step "EP=2 fused check" ep_check_fused.log timeout 300 python3 -m torch.distributed.run \
    --standalone --nproc-per-node 2 tests/python/ep_check.py --backend fused \
    --graph --json "$out/ep_check_fused.json"
  for precision in fp8 fp8_bwd; do
    step "EP=2 fused $precision check" "ep_check_fused_$precision.log" timeout 300 \
      python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/python/ep_check.py \
      --backend fused --precision "$precision" --graph --json "$out/ep_check_fused_$precision.json"
  done
fi
# The GEMM kernels must use the tensor cores (HGMMA) and never spill to local memory.
sass_check() {
  cuobjdump --dump-sass "$MEGAMOE_LIBRARY" >"$out/sass.txt" || return 1
  local hgmma spills
  hgmma=$(grep -c HGMMA "$out/sass.txt"); spills=$(grep -cE '\b(LDL|STL)\b' "$out/sass.txt")
  echo "HGMMA instructions: $hgmma, local loads/stores (LDL/STL): $spills"
  [ "$hgmma" -gt 0 ] && [ "$spills" -eq 0 ]
}
if command -v cuobjdump >/dev/null; then step "SASS check" sass.log sass_check; fi
# Memory errors and shared-memory races of the fused forward and backward on small problems.
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck synccheck; do
    step "compute-sanitizer $tool" "sanitizer-$tool.log" timeout 300 compute-sanitizer \
      --tool "$tool" --error-exitcode 1 python3 -m pytest -q -x tests/python/test_fused.py \
      tests/python/test_fused_backward.py -k "extra0 or extra1 or extra5"
  done
fi
# Shared-memory races of the GEMMs on few SMs (the ring's stages and the passed tile's slot
# reused across many tiles a block) and of the tile-passing ones. With the racecheck build in
# build-rc/ (README, "On the GPU machine") every few-SM case; without it, the gathering FP8
# GEMM's few-SM case is left out: its consumers' reads of a stage's A scales are ordered
# before the next fill through their warp's first lane, an order racecheck does not follow.
if command -v compute-sanitizer >/dev/null; then
  if [ -x build-rc/tests/cpp/megamoe_tests ]; then
    step "compute-sanitizer racecheck (GEMMs, racecheck build)" sanitizer-racecheck-gemm.log \
      timeout 300 env LD_LIBRARY_PATH="$repo/build-rc" compute-sanitizer --tool racecheck \
      --error-exitcode 1 build-rc/tests/cpp/megamoe_tests --gtest_filter='*FewSms*:*Asorted_Csorted*'
  else
    echo "   (no build-rc/: racecheck of the GEMMs on the normal build, few-SM gathering cases left out)" >&2
    step "compute-sanitizer racecheck (tile-passing GEMMs)" sanitizer-racecheck-gemm.log timeout 300 \
      compute-sanitizer --tool racecheck --error-exitcode 1 build/tests/cpp/megamoe_tests \
      --gtest_filter='*FewSms*Asorted*:*FewSms*Apadded*:*Asorted_Csorted*'
  fi
fi
# Memory errors and races of the FP8 quantizers (their shared-memory transpose included), and
# their speed against memory bandwidth beside the torch fp8 baseline's compiled casts.
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool (fp8)" "sanitizer-fp8-$tool.log" timeout 300 compute-sanitizer \
      --tool "$tool" --error-exitcode 1 python3 -m pytest -q -x tests/python/test_fp8_kernels.py \
      -k "not graph and not 4097 and not 1536"
  done
fi
step "fp8 quantizer speed" fp8-quantize.log python3 tools/bench_fp8_quantize.py --torch-casts
# shellcheck disable=SC2086
step "short benchmark" bench-short.log python3 -m megamoe.bench --backends torch,fused \
  --tokens 4096 --iters 10 --warmup 3 --out-dir "$out" --name bench-short --no-plot ${MEGAMOE_BENCH_ARGS:-}

tail -n 25 "$out/bench-short.log" >&2
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}" >&2; exit 1; fi
echo "all GPU checks passed" >&2
