#!/usr/bin/env bash
# One GPU-machine session: every GPU check, then the committed benchmarks and per-kernel
# profiles, packed into one archive (the device tool returns few files).
# Usage: bash tools/gpu_session.sh OUT_DIR
# Set MEGAMOE_BENCH_COMMIT to the commit being measured when the tree has no .git.
set -uo pipefail
out=${1:?usage: tools/gpu_session.sh OUT_DIR}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
work=$(mktemp -d)
mkdir -p "$work/check" "$work/results"
export PYTHONUNBUFFERED=1 PYTHONPATH="$repo/python" MEGAMOE_LIBRARY="$repo/build/libmegamoe.so"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
bash tools/gpu_check.sh "$work/check" || status=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
python3 -m megamoe.bench --backends ${BACKENDS:-torch,fused} --tokens 16384,512 \
  --out-dir "$work/results" --name h200-ep1-t16384 2>&1 | tee "$work/results/h200-ep1-t16384.log" || status=1
if [ "$gpus" -ge 2 ]; then
  python3 -m torch.distributed.run --nproc-per-node 2 -m megamoe.bench --ep 2 \
    --backends ${BACKENDS:-torch,fused} --tokens 16384 --out-dir "$work/results" \
    --name h200x2-ep2-t16384 2>&1 | tee "$work/results/h200x2-ep2-t16384.log" || status=1
fi
# Per-kernel times behind the figures (saved mode; rank 0 of EP=2).
for model in qwen3-30b-a3b qwen3-235b-a22b; do
  python3 tools/profile_layer.py --model "$model" --backward --backward-mode saved \
    >"$work/results/profile-$model.txt" 2>&1 || status=1
  if [ "$gpus" -ge 2 ]; then
    python3 -m torch.distributed.run --nproc-per-node 2 tools/profile_layer.py --ep 2 \
      --model "$model" --backward --backward-mode saved \
      >"$work/results/profile-ep2-$model.txt" 2>&1 || status=1
  fi
done
tar -C "$work" -czf "$out/gpu_session.tar.gz" check results
exit $status
