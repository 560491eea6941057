// Version, status names and dtype sizes: constant lookups with no failure path.
#include "megamoe/megamoe.h"

#define MEGAMOE_STR2(x) #x
#define MEGAMOE_STR(x) MEGAMOE_STR2(x)

extern "C" {

MEGAMOE_API const char* megamoe_version(void) {
  return MEGAMOE_STR(MEGAMOE_VERSION_MAJOR) "." MEGAMOE_STR(
      MEGAMOE_VERSION_MINOR) "." MEGAMOE_STR(MEGAMOE_VERSION_PATCH);
}

MEGAMOE_API int32_t megamoe_version_number(void) {
  return MEGAMOE_VERSION_MAJOR * 10000 + MEGAMOE_VERSION_MINOR * 100 + MEGAMOE_VERSION_PATCH;
}

MEGAMOE_API const char* megamoe_status_name(megamoe_status status) {
  switch (status) {
    case MEGAMOE_SUCCESS: return "MEGAMOE_SUCCESS";
    case MEGAMOE_ERROR_INVALID_ARGUMENT: return "MEGAMOE_ERROR_INVALID_ARGUMENT";
    case MEGAMOE_ERROR_UNSUPPORTED: return "MEGAMOE_ERROR_UNSUPPORTED";
    case MEGAMOE_ERROR_CUDA: return "MEGAMOE_ERROR_CUDA";
    case MEGAMOE_ERROR_OUT_OF_MEMORY: return "MEGAMOE_ERROR_OUT_OF_MEMORY";
    case MEGAMOE_ERROR_CAPACITY: return "MEGAMOE_ERROR_CAPACITY";
    case MEGAMOE_ERROR_TIMEOUT: return "MEGAMOE_ERROR_TIMEOUT";
    case MEGAMOE_ERROR_INTERNAL: return "MEGAMOE_ERROR_INTERNAL";
  }
  // Callers across the ABI can pass any integer.
  return "MEGAMOE_STATUS_UNKNOWN";
}

MEGAMOE_API size_t megamoe_dtype_size(megamoe_dtype dtype) {
  switch (dtype) {
    case MEGAMOE_DTYPE_FLOAT32: return 4;
    case MEGAMOE_DTYPE_FLOAT64: return 8;
    case MEGAMOE_DTYPE_BFLOAT16: return 2;
    case MEGAMOE_DTYPE_FLOAT16: return 2;
    case MEGAMOE_DTYPE_INT32: return 4;
    case MEGAMOE_DTYPE_INT64: return 8;
    case MEGAMOE_DTYPE_FLOAT8_E4M3: return 1;
  }
  return 0;
}

}  // extern "C"
