// CK(call): the stand-alone GPU tools' check of a CUDA runtime call: on failure, print the
// error and the line, and exit 1 (the library's MEGAMOE_CUDA_CHECK throws instead, and
// needs the library's error type linked in).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                   \
  do {                                                                          \
    const cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                                     \
      std::printf("CUDA %s at line %d\n", cudaGetErrorString(e), __LINE__);    \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)
