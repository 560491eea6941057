#include "core/tensor_check.h"

#include <algorithm>

#include "core/error.h"

namespace megamoe {

const char* dtype_name(megamoe_dtype dtype) noexcept {
  switch (dtype) {
    case MEGAMOE_DTYPE_FLOAT32: return "float32";
    case MEGAMOE_DTYPE_FLOAT64: return "float64";
    case MEGAMOE_DTYPE_BFLOAT16: return "bfloat16";
    case MEGAMOE_DTYPE_FLOAT16: return "float16";
    case MEGAMOE_DTYPE_INT32: return "int32";
    case MEGAMOE_DTYPE_INT64: return "int64";
    case MEGAMOE_DTYPE_FLOAT8_E4M3: return "float8_e4m3";
  }
  return "unknown dtype";
}

std::string shape_str(const megamoe_tensor& t) {
  std::string s = "[";
  const int n = std::clamp<int>(t.ndim, 0, MEGAMOE_MAX_DIMS);
  for (int d = 0; d < n; ++d) {
    if (d) s += ", ";
    s += std::to_string(t.shape[d]);
  }
  return s + "]";
}

int64_t numel(const megamoe_tensor& t) noexcept {
  int64_t n = 1;
  for (int d = 0; d < std::min<int>(t.ndim, MEGAMOE_MAX_DIMS); ++d) n *= t.shape[d];
  return n;
}

const megamoe_tensor& require_tensor(const megamoe_tensor* t, const char* name) {
  if (t == nullptr) throw_invalid(std::string(name) + ": tensor descriptor is NULL");
  return *t;
}

void require_rank(const megamoe_tensor& t, const char* name, int ndim, const char* dims) {
  // Checked before shape_str() so a garbage ndim never indexes past shape[].
  if (t.ndim != ndim) {
    throw_invalid(std::string(name) + ": expected " + std::to_string(ndim) +
                  " dimensions " + dims + ", got ndim=" + std::to_string(t.ndim));
  }
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) {
    if (t.shape[d] < 0) {
      throw_invalid(std::string(name) + ": shape " + shape_str(t) +
                    " has a negative size in dimension " + std::to_string(d));
    }
    if (__builtin_mul_overflow(n, t.shape[d], &n)) {
      throw_invalid(std::string(name) + ": shape " + shape_str(t) +
                    " has more elements than int64 can count");
    }
  }
}

void require_shape(const megamoe_tensor& t, const char* name, std::initializer_list<Dim> dims,
                   const std::string& origin) {
  bool ok = t.ndim == static_cast<int32_t>(dims.size());
  std::string expected = "[";
  int d = 0;
  for (const Dim& dim : dims) {
    if (d) expected += ", ";
    expected += dim.label;
    if (dim.value >= 0) {
      expected += '=';
      expected += std::to_string(dim.value);
      if (ok && t.shape[d] != dim.value) ok = false;
    }
    ++d;
  }
  expected += "]";
  if (ok) return;
  std::string msg = std::string(name) + ": expected shape " + expected;
  if (!origin.empty()) msg += " (" + origin + ")";
  if (t.ndim >= 0 && t.ndim <= MEGAMOE_MAX_DIMS) {
    msg += ", got " + shape_str(t);
  } else {
    msg += ", got ndim=" + std::to_string(t.ndim);
  }
  throw_invalid(msg);
}

void require_dtype(const megamoe_tensor& t, const char* name,
                   std::initializer_list<megamoe_dtype> allowed) {
  std::string expected;
  size_t i = 0;
  for (megamoe_dtype dt : allowed) {
    if (t.dtype == dt) return;
    if (i) expected += (i + 1 == allowed.size()) ? " or " : ", ";
    expected += dtype_name(dt);
    ++i;
  }
  throw_invalid(std::string(name) + ": expected dtype " + expected + ", got " +
                dtype_name(t.dtype) + " (" + std::to_string(static_cast<int>(t.dtype)) + ")");
}

void require_same_dtype(const megamoe_tensor& t, const char* name, const megamoe_tensor& ref,
                        const char* ref_name) {
  if (t.dtype == ref.dtype) return;
  throw_invalid(std::string(name) + ": expected dtype " + dtype_name(ref.dtype) + " like " +
                ref_name + " (all floating tensors of one call share one dtype), got " +
                dtype_name(t.dtype));
}

void require_data(const megamoe_tensor& t, const char* name) {
  if (t.data == nullptr && numel(t) > 0) {
    throw_invalid(std::string(name) + ": data pointer is NULL for a tensor of shape " +
                  shape_str(t));
  }
}

bool is_contiguous(const megamoe_tensor& t) noexcept {
  if (t.ndim < 0 || t.ndim > MEGAMOE_MAX_DIMS) return false;
  int64_t expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.strides[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

void require_contiguous(const megamoe_tensor& t, const char* name) {
  if (is_contiguous(t)) return;
  std::string strides = "[";
  for (int d = 0; d < t.ndim; ++d) {
    if (d) strides += ", ";
    strides += std::to_string(t.strides[d]);
  }
  throw_invalid(std::string(name) + ": expected a contiguous (row-major) tensor, got shape " +
                shape_str(t) + " with strides " + strides + "]");
}

namespace {

struct ByteRange {
  intptr_t lo, hi;  // [lo, hi)
};

ByteRange byte_range(const megamoe_tensor& t) {
  const auto elem = static_cast<intptr_t>(megamoe_dtype_size(t.dtype));
  intptr_t lo = 0, hi = 0;
  for (int d = 0; d < t.ndim; ++d) {
    const intptr_t span = static_cast<intptr_t>((t.shape[d] - 1) * t.strides[d]);
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<intptr_t>(t.data);
  return {base + lo * elem, base + (hi + 1) * elem};
}

}  // namespace

void require_disjoint(const megamoe_tensor& out, const char* out_name,
                      const megamoe_tensor& other, const char* other_name) {
  if (numel(out) == 0 || numel(other) == 0) return;
  const ByteRange a = byte_range(out), b = byte_range(other);
  if (a.lo < b.hi && b.lo < a.hi) {
    throw_invalid(std::string(out_name) + ": output memory overlaps " + other_name +
                  "; outputs must not alias other tensors of the call");
  }
}

}  // namespace megamoe
