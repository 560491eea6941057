#!/usr/bin/env bash
# The GPU machine's work for one call, in stages, with every log packed into one archive
# (the device tool returns few files). Uses the library and tests already built in build/
# (tools/run_tests.sh builds them; carry build/ instead of compiling there).
#
#   bash tools/gpu_session.sh OUT_DIR STAGE [STAGE ...]
#
# Stages:
#   check          tools/gpu_check.sh: every C++ and Python GPU test, SASS, compute-sanitizer,
#                  a short benchmark
#   ab             a refactor's A/B against the library in build-base/ (BASE_LIB): outputs
#                  compared bit for bit (tools/ab_outputs.py), then megamoe-bench of the fused
#                  backend at both presets, 16384 tokens, both backward modes, base and new
#                  in alternation, AB_ROUNDS times (default 2; 0 for the bitwise part alone;
#                  AB_ARGS: extra megamoe-bench arguments;
#                  AB_DUMP_ARGS: extra tools/ab_outputs.py dump arguments, e.g.
#                  "--precisions bf16,fp8,fp8_bwd" for the FP8 kernels)
#   fp8            the FP8 GEMM and layer tests, and the FP8 benchmark (both presets, 16384
#                  tokens, bf16 / fp8 / fp8_bwd rows of torch and fused; FP8_BENCH_ARGS)
#   bench          the committed layer benchmarks (torch and fused, 16384 and 512 tokens;
#                  EP=2 too with two GPUs)
#   ep2            issue 16 on two GPUs: the EP tests (C++ and torchrun, graph replay, fp8,
#                  2000 back-to-back calls), then the layer benchmark at EP=1 and at EP=2,
#                  16384 tokens per rank, both presets, bf16 and fp8, the EP overlap switches
#                  off and then each set of EP2_SWITCHES on (space-separated sets of
#                  comma-separated NAME=1; default: the dispatch overlap, the epilogue combine,
#                  both, the backward overlap); EP2_SETS_ONLY=1 skips the tests and the EP=1
#                  and switches-off rows (a later call's sets)
#   ep2tests       the EP tests of ep2 alone, with the transformers integration's EP check,
#                  FP8 under the backward overlap, the epilogue combine's bitwise check (bf16
#                  and FP8) and a peer that dies (ep_dead_peer_check.py)
#   trainep:EP:B:S megamoe-train-bench's config on every GPU of the machine (torchrun), FSDP2,
#                  parallel.ep EP, backends B (comma-separated), S steps, record
#                  $TRAIN_NAME-epEP (TRAIN_ARGS: extra arguments)
#   profile        per-kernel times of both presets (saved mode)
#   smoke          megamoe-train's embedded GPU default for 10 steps
#   attn           PyTorch's attention backends on the trainer's attention (tools/attention_backends.py;
#                  ATTN_ARGS: extra arguments)
#   train:B[,B..]  megamoe-train-bench rows of backends B (mega_moe, torch, hf) for the record
#                  named by $TRAIN_NAME (TRAIN_ARGS: extra arguments, e.g. "--steps 20")
#   det            a second 50-step mega_moe run beside the saved first one (determinism)
#   detmode        two 50-step mega_moe runs with train.deterministic = true (record
#                  $TRAIN_NAME-deterministic)
#   fp8check       SASS of the library (HGMMA, QGMMA, no local memory) and compute-sanitizer
#                  (memcheck, racecheck, synccheck; FP8_SANITIZER_TOOLS; racecheck's GEMM tests
#                  on the racecheck build in build-rc/ where present) on small FP8 GEMM and
#                  layer tests: the M-grouped GEMMs with A gathered and with A by TMA, the
#                  weight gradients (FP8_SANITIZER_FILTER), the layer (FP8_SANITIZER_K)
#   skew           the fused layer's training-scale skewed-routing tests
#   checktrain     megamoe-train-bench's config with every experts call checked against the
#                  torch backend (tools/check_training_layers.py; CHECK_STEPS, default 70)
#   gradcheck      the same config's run to step GRADS_STEP (default 100), whose experts calls'
#                  backward is replayed by the run's backend, the torch backend and float64
#                  (tools/check_training_layers.py --grads-at-step; GRADS_ARGS: extra arguments,
#                  e.g. "--grads-calls 4" or trainer overrides)
#   ncu:P:MODEL    Nsight Compute (full set) of one fused forward of MODEL at precision P
#   ncustall:P:MODEL  Nsight Compute's warp-state, scheduler and source-counter sections of
#                  the same forward's GEMMs
#                  (both: NCU_LAYER_ARGS, extra tools/profile_layer.py arguments, e.g.
#                  "--backward --backward-mode saved" for the backward's kernels too;
#                  NCU_FILTER, ncu's kernel filter, default "-k regex:gemm", e.g.
#                  "--kernel-name-base demangled -k regex:WeightGradEpilogue" for the weight gradients)
#   profstep:B:P   megamoe-train-bench's config for 12 steps with backend B at precision P,
#                  step 10 profiled (log.profile_step: kernels and the allocator's counters);
#                  PROFSTEP_ARGS: extra trainer overrides, PROFSTEP_TAG: a suffix for its logs
# Set MEGAMOE_BENCH_COMMIT to the commit being measured when the tree has no .git, and
# STAGE_TIMEOUT (seconds, default 590) to bound each stage.
set -uo pipefail
out=${1:?usage: tools/gpu_session.sh OUT_DIR STAGE [STAGE ...]}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # the archive goes there, after a cd below
shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
work=$(mktemp -d)
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo/python" MEGAMOE_LIBRARY="$repo/build/libmegamoe.so"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MEGAMOE_CACHE_DIR=${MEGAMOE_CACHE_DIR:-$repo/.megamoe-cache}
base_lib=${BASE_LIB:-$repo/build-base/libmegamoe.so}
train_name=${TRAIN_NAME:-h200-qwen3-30b-a3b}
limit=${STAGE_TIMEOUT:-590}
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
status=0
run() {  # run LOG COMMAND...: a step with its log kept, bounded by the stage timeout
  local log=$1; shift
  local t0=$SECONDS
  echo "== $log: $*" >&2
  timeout "$limit" "$@" >"$work/$log" 2>&1
  local rc=$?
  echo "   rc $rc ($((SECONDS - t0)) s)" >&2
  tail -n 12 "$work/$log" >&2
  [ $rc -eq 0 ] || status=1
}
bench_ab() {  # bench_ab TAG LIB: the fused layer's benchmark with library LIB
  # shellcheck disable=SC2086
  run "ab-bench-$1.log" env MEGAMOE_LIBRARY="$2" python3 -m megamoe.bench --backends fused \
    --model qwen3-30b-a3b --model qwen3-235b-a22b --tokens 16384 --out-dir "$work/ab" \
    --name "ab-$1" --no-plot ${AB_ARGS:-}
}

# Rows saved by an earlier call (carried in .train-rows/) join this call's: the determinism
# run compares itself with the saved first mega_moe run.
if [ -d "$repo/.train-rows" ]; then
  mkdir -p "$work/train/$train_name.rows" && cp "$repo"/.train-rows/*.json "$work/train/$train_name.rows/"
fi
tr2=(python3 -m torch.distributed.run --nproc-per-node 2)
ep2_tests() {  # the EP tests on two GPUs
  run ep2-cpp.log build/tests/cpp/megamoe_tests --gtest_filter='PeerExchange*:*EpLayerGpu*'
  run ep2-check.log "${tr2[@]}" tests/python/ep_check.py --backend fused --graph
  run ep2-check-fp8.log "${tr2[@]}" tests/python/ep_check.py --backend fused --precision fp8
  run ep2-check-fp8-overlap.log env MEGAMOE_EP_OVERLAP_BACKWARD=1 "${tr2[@]}" \
    tests/python/ep_check.py --backend fused --precision fp8
  run ep2-check-overlap.log env MEGAMOE_EP_OVERLAP_DISPATCH=1 MEGAMOE_EP_OVERLAP_BACKWARD=1 \
    "${tr2[@]}" tests/python/ep_check.py --backend fused
  # The epilogue combine: y and dx must be the one-GPU layer's bits (ep_check.py asks for
  # them when the switch is on), bf16 with graph replay and FP8.
  run ep2-check-exact.log env MEGAMOE_EP_EPILOGUE_COMBINE=1 "${tr2[@]}" \
    tests/python/ep_check.py --backend fused --graph
  run ep2-check-exact-fp8.log env MEGAMOE_EP_EPILOGUE_COMBINE=1 "${tr2[@]}" \
    tests/python/ep_check.py --backend fused --precision fp8
  run ep2-hf-check.log "${tr2[@]}" tests/python/hf_ep_check.py --backend fused
  run ep2-dead-peer.log "${tr2[@]}" tests/python/ep_dead_peer_check.py
}
for stage in "$@"; do
  case $stage in
    check)
      run check.log bash tools/gpu_check.sh "$work/check" ;;
    ab)
      mkdir -p "$work/ab"
      run ab-dump-base.log env MEGAMOE_LIBRARY="$base_lib" python3 tools/ab_outputs.py dump \
        "$work/ab/base.pt" ${AB_DUMP_ARGS:-}
      run ab-dump-new.log python3 tools/ab_outputs.py dump "$work/ab/new.pt" ${AB_DUMP_ARGS:-}
      run ab-compare.log python3 tools/ab_outputs.py compare "$work/ab/base.pt" "$work/ab/new.pt"
      rm -f "$work"/ab/*.pt
      # Repeats of one problem with NaN-filled free memory between them, both libraries.
      run ab-repeat-new.log python3 tools/repeat_check.py
      run ab-repeat-base.log env MEGAMOE_LIBRARY="$base_lib" python3 tools/repeat_check.py
      for ((round = 1; round <= ${AB_ROUNDS:-2}; round++)); do
        bench_ab "base-$round" "$base_lib"
        bench_ab "new-$round" "$MEGAMOE_LIBRARY"
      done ;;
    fp8)
      run fp8-cpp.log build/tests/cpp/megamoe_tests --gtest_filter='*Fp8*:*Workspace*'
      run fp8-py.log python3 -m pytest -q -rs tests/python/test_fused_fp8.py \
        tests/python/test_fp8_kernels.py tests/python/test_torch_fp8.py tests/python/test_weight_cache.py
      mkdir -p "$work/results"
      run fp8-bench.log python3 -m megamoe.bench --backends torch,fused --model qwen3-30b-a3b \
        --model qwen3-235b-a22b --tokens 16384 --precision bf16,fp8,fp8_bwd \
        --out-dir "$work/results" --name h200-fp8-t16384 ${FP8_BENCH_ARGS:-} ;;
    bench)
      mkdir -p "$work/results"
      run bench-ep1.log python3 -m megamoe.bench --backends torch,fused --tokens 16384,512 \
        --out-dir "$work/results" --name h200-ep1-t16384
      if [ "$gpus" -ge 2 ]; then
        run bench-ep2.log python3 -m torch.distributed.run --nproc-per-node 2 -m megamoe.bench \
          --ep 2 --backends torch,fused --tokens 16384 --out-dir "$work/results" --name h200x2-ep2-t16384
      fi ;;
    ep2)
      if [ "$gpus" -lt 2 ]; then
        echo "ep2: needs two GPUs, $gpus here" >&2; status=1
      else
        mkdir -p "$work/results"
        ep2_bench=(-m megamoe.bench --ep 2 --model qwen3-30b-a3b --model qwen3-235b-a22b
                   --tokens 16384 --precision bf16,fp8 --out-dir "$work/results" --no-plot)
        if [ "${EP2_SETS_ONLY:-0}" != 1 ]; then
          ep2_tests
          run ep2-repeats.log "${tr2[@]}" tests/python/ep_check.py --backend fused --repeats 2000
          run ep2-bench-ep1.log python3 -m megamoe.bench --backends torch,fused \
            --model qwen3-30b-a3b --model qwen3-235b-a22b --tokens 16384 --precision bf16,fp8 \
            --out-dir "$work/results" --name h200x2-ep1-t16384 --no-plot
          run ep2-bench-off.log "${tr2[@]}" "${ep2_bench[@]}" --backends torch,fused \
            --name h200x2-ep2-t16384
        fi
        for set in ${EP2_SWITCHES:-MEGAMOE_EP_OVERLAP_DISPATCH=1 MEGAMOE_EP_EPILOGUE_COMBINE=1 \
            MEGAMOE_EP_OVERLAP_DISPATCH=1,MEGAMOE_EP_EPILOGUE_COMBINE=1 MEGAMOE_EP_OVERLAP_BACKWARD=1 \
            MEGAMOE_EP_OVERLAP_DISPATCH=1,MEGAMOE_EP_OVERLAP_BACKWARD=1}; do
          IFS=, read -ra switches <<<"$set"
          tag=$(echo "$set" | sed -e 's/MEGAMOE_EP_//g' -e 's/=1//g' -e 's/,/-and-/g' | tr 'A-Z_' 'a-z-')
          run "ep2-bench-$tag.log" env "${switches[@]}" "${tr2[@]}" "${ep2_bench[@]}" \
            --backends fused --name "h200x2-ep2-t16384-$tag"
        done
      fi ;;
    ep2tests)
      if [ "$gpus" -lt 2 ]; then
        echo "ep2tests: needs two GPUs, $gpus here" >&2; status=1
      else
        ep2_tests
      fi ;;
    trainep:*)
      IFS=: read -r _ ep backends steps <<<"$stage"
      # shellcheck disable=SC2086
      run "train-ep$ep-${backends//,/-}.log" python3 -m megamoe.train.bench bench-qwen3-30b-a3b \
        --nproc-per-node "$gpus" --backends "$backends" --steps "$steps" --no-parts \
        --name "$train_name-ep$ep" --out-dir "$work/train" --work-dir "$work/train-runs" \
        --no-plot --parallel.ep "$ep" ${TRAIN_ARGS:-} ;;
    profile)
      for model in qwen3-30b-a3b qwen3-235b-a22b; do
        run "profile-$model.log" python3 tools/profile_layer.py --model "$model" --backward \
          --backward-mode saved
      done ;;
    attn)
      # shellcheck disable=SC2086
      run attention.log python3 tools/attention_backends.py ${ATTN_ARGS:-} ;;
    detmode)
      run detmode.log python3 -m megamoe.train.bench bench-qwen3-30b-a3b --backends mega_moe \
        --steps 50 --repeat 2 --no-parts --name "$train_name-deterministic" --out-dir "$work/train" \
        --work-dir "$work/train-runs" --no-plot --train.deterministic true ;;
    fp8check)
      cuobjdump --dump-sass "$MEGAMOE_LIBRARY" >"$work/sass.txt"
      echo "HGMMA $(grep -c HGMMA "$work/sass.txt"), QGMMA $(grep -c QGMMA "$work/sass.txt"), LDL/STL $(grep -cE '\b(LDL|STL)\b' "$work/sass.txt")" | tee "$work/sass-counts.txt" >&2
      rm -f "$work/sass.txt"
      for tool in ${FP8_SANITIZER_TOOLS:-memcheck racecheck synccheck}; do
        # racecheck on the racecheck build where present (README, "On the GPU machine"): the
        # normal build's gathering FP8 GEMM on few SMs shows its warp-leader stage releases,
        # which racecheck does not follow, as races.
        tests=build
        if [ "$tool" = racecheck ] && [ -x build-rc/tests/cpp/megamoe_tests ]; then tests=build-rc; fi
        run "sanitizer-fp8-gemm-$tool.log" env LD_LIBRARY_PATH="$repo/$tests" compute-sanitizer \
          --tool "$tool" --error-exitcode 1 "$tests/tests/cpp/megamoe_tests" \
          --gtest_filter="${FP8_SANITIZER_FILTER:-*Fp8*Gpu*Agathered_Cpadded*:*Fp8*Gpu*Asorted_Csorted*:*Fp8WeightGradGpu*}"
        run "sanitizer-fp8-layer-$tool.log" compute-sanitizer --tool "$tool" --error-exitcode 1 \
          python3 -m pytest -q -x tests/python/test_fused_fp8.py -k "${FP8_SANITIZER_K:-awkward and (extra0 or extra1)}"
      done ;;
    smoke)
      run smoke.log python3 -m megamoe.train --train.steps 10 --log.dir "$work/smoke" ;;
    train:*)
      backends=${stage#train:}
      # shellcheck disable=SC2086
      run "train-${backends//,/-}.log" python3 -m megamoe.train.bench bench-qwen3-30b-a3b \
        --backends "$backends" --name "$train_name" --out-dir "$work/train" \
        --work-dir "$work/train-runs" --no-plot ${TRAIN_ARGS:-} ;;
    det)
      run det.log python3 -m megamoe.train.bench bench-qwen3-30b-a3b --backends mega_moe \
        --steps 50 --repeat-start 2 --no-parts --name "$train_name" --out-dir "$work/train" \
        --work-dir "$work/train-runs" --no-plot ;;
    skew)
      run skew.log python3 -m pytest -q -s -rs tests/python/test_fused_backward.py -k training_scale ;;
    checktrain)
      run checktrain.log python3 tools/check_training_layers.py "$work/checktrain" \
        --stop-after "${CHECK_STEPS:-70}" bench-qwen3-30b-a3b --log.dir "$work/checktrain-run" ;;
    gradcheck)
      # shellcheck disable=SC2086
      run gradcheck.log python3 tools/check_training_layers.py "$work/gradcheck" \
        --grads-at-step "${GRADS_STEP:-100}" bench-qwen3-30b-a3b \
        --log.dir "$work/gradcheck-run" ${GRADS_ARGS:-} ;;
    ncu:*)
      spec=${stage#ncu:}; precision=${spec%%:*}; model=${spec#*:}
      # shellcheck disable=SC2086
      run "ncu-$precision-$model.log" ncu --clock-control none --profile-from-start off --set full \
        ${NCU_FILTER:--k regex:gemm} python3 tools/profile_layer.py --ncu --precision "$precision" \
        --model "$model" ${NCU_LAYER_ARGS:-} ;;
    ncustall:*)
      spec=${stage#ncustall:}; precision=${spec%%:*}; model=${spec#*:}
      run "ncustall-$precision-$model.log" ncu --clock-control none --profile-from-start off \
        --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --section SpeedOfLight ${NCU_FILTER:--k regex:gemm} \
        python3 tools/profile_layer.py --ncu --precision "$precision" --model "$model" ${NCU_LAYER_ARGS:-} ;;
    profstep:*)
      spec=${stage#profstep:}; backend=${spec%%:*}; precision=${spec#*:}
      tag=$backend-$precision${PROFSTEP_TAG:-}
      # shellcheck disable=SC2086
      run "profstep-$tag.log" python3 -m megamoe.train bench-qwen3-30b-a3b \
        --train.steps 12 --log.profile_step 10 --log.interval 1 \
        --model.moe.dispatch.type "\"$backend\"" --model.moe.dispatch.precision "\"$precision\"" \
        --log.dir "$work/profstep-$tag" ${PROFSTEP_ARGS:-} ;;
    *)
      echo "unknown stage $stage" >&2; status=1 ;;
  esac
done
# The BPE tokenizer the trainer learned on this machine's corpus comes back too: a later
# call carries it in .megamoe-cache and skips the training.
[ -d "$MEGAMOE_CACHE_DIR/tokenizers" ] && cp -r "$MEGAMOE_CACHE_DIR/tokenizers" "$work/"
find "$work" -name '*.pt' -delete
tar -C "$work" -czf "$out/gpu_session.tar.gz" .
ls -la "$out" >&2
exit $status
