#!/usr/bin/env bash
# Builds libmegamoe and the C++ tests, then runs ctest and pytest against that build.
# GPU tests skip with a reason on a machine without a GPU. Usage: bash tools/run_tests.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
jobs=$(nproc 2>/dev/null || echo 2)

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure

MEGAMOE_LIBRARY="$repo/build/libmegamoe.so" PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}" \
  python3 -m pytest -rs tests/python
