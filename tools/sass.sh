#!/usr/bin/env bash
# The SASS of a library's kernels without a GPU: per kernel whose mangled name matches
# REGEX, its instruction, branch, HGMMA / QGMMA and local-memory (LDL / STL) counts; with
# --dump, the SASS itself. Uses cuobjdump from PATH or /usr/local/cuda/bin, else the one in
# the pip wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (cuobjdump runs nvdisasm),
# unpacked into .whl/cuobjdump on first use (needs the package registry; the CUDA 13.0
# toolkit of the development machine has neither).
#
#   bash tools/sass.sh build/libmegamoe.so 'combine_rows_kernel'
#   bash tools/sass.sh build/libmegamoe.so 'combine_rows_kernelILb0E' --dump > combine.sass
set -euo pipefail
lib=${1:?usage: tools/sass.sh LIB [REGEX] [--dump]}
regex=${2:-.}
dump=${3:-}
root=$(cd "$(dirname "$0")/.." && pwd)

tool=$(command -v cuobjdump || true)
[ -z "$tool" ] && [ -x /usr/local/cuda/bin/cuobjdump ] && tool=/usr/local/cuda/bin/cuobjdump
if [ -z "$tool" ]; then
  tool=$(find "$root/.whl/cuobjdump" -name cuobjdump -type f 2>/dev/null | head -1 || true)
  if [ -z "$tool" ]; then
    echo "sass.sh: no cuobjdump; fetching its wheels into .whl/cuobjdump" >&2
    mkdir -p "$root/.whl/cuobjdump"
    python3 -m pip download --no-deps -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm \
      -d "$root/.whl/cuobjdump"
    for wheel in "$root"/.whl/cuobjdump/*.whl; do
      python3 -m zipfile -e "$wheel" "$root/.whl/cuobjdump/unpacked"
    done
    chmod +x "$root"/.whl/cuobjdump/unpacked/nvidia/*/bin/*
    tool=$(find "$root/.whl/cuobjdump/unpacked" -name cuobjdump -type f | head -1)
  fi
  # The wheels' cuobjdump finds the wheels' nvdisasm beside it.
  export PATH="$(dirname "$tool"):$PATH"
fi

"$tool" --dump-sass "$lib" | awk -v re="$regex" -v dump="$dump" '
  function report() {
    if (name != "") printf "%6d instr %4d BRA %4d HGMMA %4d QGMMA %3d LDL/STL  %s\n",
                              n, bra, hg, qg, lm, name
  }
  /Function : / {
    report(); name = ""
    if ($0 ~ re) { name = $3; n = bra = hg = qg = lm = 0 }
    if (name != "" && dump == "--dump") print
    next
  }
  name != "" && /^ +\/\*[0-9a-f]+\*\// {
    n++
    if ($0 ~ /BRA/) bra++
    if ($0 ~ /HGMMA/) hg++
    if ($0 ~ /QGMMA/) qg++
    if ($0 ~ /[^A-Z](LDL|STL)[ .]/) lm++
    if (dump == "--dump") print
  }
  END { report() }'
