// The shared-memory stage count and footprint of every grouped-GEMM variant
// (gemm_variants.cuh), as the kernels are built: Gemm::kStages, Gemm::kSharedBytes and the
// mainloop's bytes per stage. Host-only (no GPU needed): it reads compile-time constants.
//
// Why: a kernel a few KB short of one more stage hides less load latency, and that is
// cheaper to see here than in a profile. Results: PERFLOG, fifth session of 2026-12-02.
//
// Build: nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc -Iinclude \
//          tools/gemm_stages.cu -o build/gemm_stages
// Run: build/gemm_stages   -> one line per variant
#include <cstdio>

#include "kernels/sm90/gemm_variants.cuh"

using namespace megamoe::sm90;

template <class Gemm>
void show(const char* name) {
  std::printf("%-48s stages %d  shared bytes %zu  bytes per stage %d\n", name, Gemm::kStages,
              Gemm::kSharedBytes, Gemm::Mainloop::kStageBytes);
}
#define SHOW(...) show<__VA_ARGS__>(#__VA_ARGS__)

int main() {
  SHOW(MGroupedGemmNt<128, false>);
  SHOW(MGroupedGemmNt<256, false>);
  SHOW(MGroupedGemmNt<128, true>);
  SHOW(MGroupedGemmNtToPeers<128>);
  SHOW(MGroupedGemmNtToPeers<256>);
  SHOW(MGroupedGemmNn<128, false>);
  SHOW(MGroupedGemmNn<256, false>);
  SHOW(MGroupedGemmNn<128, true>);
  SHOW(MGroupedGemmNtSwiGLU<128, false>);
  SHOW(MGroupedGemmNtSwiGLU<256, false>);
  SHOW(MGroupedGemmNtSwiGLU<128, true>);
  SHOW(MGroupedGemmNnSwiGLUBackward<128, false>);
  SHOW(MGroupedGemmNnSwiGLUBackward<256, false>);
  SHOW(MGroupedGemmNnSwiGLUBackward<128, true>);
  SHOW(KGroupedGemmTn<128>);
  SHOW(KGroupedGemmTn<256>);
  SHOW(MGroupedFp8GemmNt<128, false>);
  SHOW(MGroupedFp8GemmNt<256, false>);
  SHOW(MGroupedFp8GemmNt<128, true>);
  SHOW(MGroupedFp8GemmNtSwiGLU<128, false>);
  SHOW(MGroupedFp8GemmNtSwiGLU<256, false>);
  SHOW(MGroupedFp8GemmNtSwiGLU<256, false, true>);
  SHOW(MGroupedFp8GemmNtSwiGLU<128, true>);
  SHOW(MGroupedFp8GemmNtSwiGLUBackward<128, false>);
  SHOW(MGroupedFp8GemmNtSwiGLUBackward<256, false>);
  SHOW(MGroupedFp8GemmNtSwiGLUBackward<128, true>);
  SHOW(KGroupedFp8GemmTn<128>);
  SHOW(KGroupedFp8GemmTn<256>);
}
