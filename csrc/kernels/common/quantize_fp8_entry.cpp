// The C ABI of the blockwise FP8 quantizers: descriptor checks, then quantize_fp8().
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor_check.h"
#include "kernels/common/device.h"
#include "kernels/common/quantize_fp8.h"

namespace megamoe {
namespace {

constexpr int64_t kBlock = 128;

std::string strides_str(const megamoe_tensor& t) {
  std::string s = "[";
  for (int d = 0; d < t.ndim; ++d) s += (d ? ", " : "") + std::to_string(t.strides[d]);
  return s + "]";
}

// Innermost stride 1; every other stride a non-negative multiple of 16 bytes; the data
// 16-byte aligned (the kernels move 16-byte vectors).
void require_aligned_rows(const megamoe_tensor& t, const char* name) {
  if (numel(t) == 0) return;  // nothing is read or written
  const int64_t elem = static_cast<int64_t>(megamoe_dtype_size(t.dtype));
  bool ok = t.shape[t.ndim - 1] <= 1 || t.strides[t.ndim - 1] == 1;
  for (int d = 0; d + 1 < t.ndim; ++d) {
    ok = ok && (t.shape[d] <= 1 || (t.strides[d] >= 0 && (t.strides[d] * elem) % 16 == 0));
  }
  if (!ok) {
    throw_invalid(std::string(name) + ": expected unit stride in the last dimension and other "
                  "strides that are multiples of 16 bytes, got strides " + strides_str(t) +
                  " for shape " + shape_str(t));
  }
  if (reinterpret_cast<uintptr_t>(t.data) % 16) {
    throw_invalid(std::string(name) + ": data pointer must be 16-byte aligned");
  }
}

// No two elements of an output share memory: with the dimensions of size > 1 ordered by
// stride, each stride covers the extent of the ones below it.
void require_no_self_overlap(const megamoe_tensor& t, const char* name) {
  if (numel(t) == 0) return;
  int order[MEGAMOE_MAX_DIMS];
  int n = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] > 1) order[n++] = d;
  }
  for (int i = 1; i < n; ++i) {  // insertion sort by stride
    for (int j = i; j > 0 && t.strides[order[j]] < t.strides[order[j - 1]]; --j) {
      std::swap(order[j], order[j - 1]);
    }
  }
  int64_t extent = 1;
  for (int i = 0; i < n; ++i) {
    const int64_t stride = t.strides[order[i]];
    if (stride < extent) {
      throw_invalid(std::string(name) + ": strides " + strides_str(t) + " for shape " +
                    shape_str(t) + " make elements overlap; outputs need distinct elements");
    }
    extent = stride * t.shape[order[i]];
  }
}

const megamoe_tensor& input(const megamoe_tensor* t, const char* name, int ndim, const char* dims) {
  const megamoe_tensor& x = require_tensor(t, name);
  require_rank(x, name, ndim, dims);
  require_dtype(x, name, {MEGAMOE_DTYPE_BFLOAT16});
  require_data(x, name);
  return x;
}

void output(const megamoe_tensor& t, const char* name, megamoe_dtype dtype) {
  require_dtype(t, name, {dtype});
  require_data(t, name);
  if (dtype != MEGAMOE_DTYPE_FLOAT32) require_aligned_rows(t, name);
  require_no_self_overlap(t, name);
}

void require_multiple(int64_t value, const char* what, const megamoe_tensor& t, const char* name) {
  if (value <= 0 || value % kBlock) {
    throw_invalid(std::string(name) + ": " + what + " must be a positive multiple of 128, got " +
                  shape_str(t));
  }
}

struct Named {
  const megamoe_tensor* t;
  const char* name;
};

// Outputs must not overlap the input or each other; then every tensor must be device memory
// (checked last: it is the one check that needs a CUDA device).
void finish_checks(const std::vector<Named>& outputs, Named in) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    require_disjoint(*outputs[i].t, outputs[i].name, *in.t, in.name);
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      require_disjoint(*outputs[i].t, outputs[i].name, *outputs[j].t, outputs[j].name);
    }
  }
  require_device_memory(*in.t, in.name);
  for (const Named& o : outputs) require_device_memory(*o.t, o.name);
}

void set_scales(Fp8QuantizeArgs& a, const megamoe_tensor& s, bool batched) {
  a.scales = static_cast<float*>(s.data);
  const int d = batched ? 1 : 0;
  a.s_batch = batched ? s.strides[0] : 0;
  a.s_0 = s.strides[d];
  a.s_1 = s.strides[d + 1];
}

// The two quantizers of one matrix x: [M, K] -> q [M, K] and scales [M, K/128] (1x128
// blocks), or [R, C] -> q_t [C, Rp] and scales [C, Rp/128] (128-token blocks, transposed).
megamoe_status quantize_matrix(const char* function, Fp8Blocks blocks, const megamoe_tensor* x,
                               megamoe_tensor* out, megamoe_tensor* scales, void* cuda_stream) {
  const bool by_columns = blocks == Fp8Blocks::kColumns128;
  const char* out_name = by_columns ? "q_t" : "q";
  return abi_call(function, [&] {
    const megamoe_tensor& xt = input(x, "x", 2, by_columns ? "[R, C]" : "[M, K]");
    const int64_t rows = xt.shape[0], width = xt.shape[1];
    require_multiple(width, by_columns ? "C (the last dimension)" : "K (the last dimension)", xt,
                     "x");
    require_aligned_rows(xt, "x");
    const int64_t Rp = (rows + kBlock - 1) / kBlock * kBlock;
    const std::string origin =
        "from x " + shape_str(xt) + (by_columns ? ", Rp = R rounded up to 128" : "");
    const megamoe_tensor& ot = require_tensor(out, out_name);
    const megamoe_tensor& st = require_tensor(scales, "scales");
    if (by_columns) {
      require_shape(ot, out_name, {{"C", width}, {"Rp", Rp}}, origin);
      output(ot, out_name, MEGAMOE_DTYPE_FLOAT8_E4M3);
      require_shape(st, "scales", {{"C", width}, {"Rp/128", Rp / kBlock}}, origin);
    } else {
      require_shape(ot, out_name, {{"M", rows}, {"K", width}}, origin);
      output(ot, out_name, MEGAMOE_DTYPE_FLOAT8_E4M3);
      require_shape(st, "scales", {{"M", rows}, {"K/128", width / kBlock}}, origin);
    }
    output(st, "scales", MEGAMOE_DTYPE_FLOAT32);
    finish_checks({{out, out_name}, {scales, "scales"}}, {x, "x"});

    Fp8QuantizeArgs a;
    a.x = static_cast<const __nv_bfloat16*>(xt.data);
    a.x_row = xt.strides[0];
    a.rows = rows;
    a.cols = width;
    (by_columns ? a.q_t : a.q) = static_cast<uint8_t*>(ot.data);
    (by_columns ? a.t_row : a.q_row) = ot.strides[0];
    set_scales(a, st, false);
    quantize_fp8(blocks, a, static_cast<cudaStream_t>(cuda_stream));
    return MEGAMOE_SUCCESS;
  });
}

}  // namespace
}  // namespace megamoe

using namespace megamoe;

extern "C" {

MEGAMOE_API megamoe_status megamoe_quantize_fp8_1x128(const megamoe_tensor* x, megamoe_tensor* q,
                                                      megamoe_tensor* scales, void* cuda_stream) {
  return quantize_matrix("megamoe_quantize_fp8_1x128", Fp8Blocks::kRows1x128, x, q, scales,
                         cuda_stream);
}

MEGAMOE_API megamoe_status megamoe_quantize_fp8_128x128(const megamoe_tensor* w, megamoe_tensor* q,
                                                        megamoe_tensor* q_t,
                                                        megamoe_tensor* scales,
                                                        void* cuda_stream) {
  return abi_call("megamoe_quantize_fp8_128x128", [&] {
    const megamoe_tensor& wt = input(w, "w", 3, "[E, N, K]");
    const int64_t E = wt.shape[0], N = wt.shape[1], K = wt.shape[2];
    require_multiple(N, "N (dimension 1)", wt, "w");
    require_multiple(K, "K (dimension 2)", wt, "w");
    require_aligned_rows(wt, "w");
    if (q == nullptr && q_t == nullptr) throw_invalid("q, q_t: both are NULL; pass at least one");
    const std::string origin = "from w " + shape_str(wt);
    if (q) {
      require_shape(*q, "q", {{"E", E}, {"N", N}, {"K", K}}, origin);
      output(*q, "q", MEGAMOE_DTYPE_FLOAT8_E4M3);
    }
    if (q_t) {
      require_shape(*q_t, "q_t", {{"E", E}, {"K", K}, {"N", N}}, origin);
      output(*q_t, "q_t", MEGAMOE_DTYPE_FLOAT8_E4M3);
    }
    const megamoe_tensor& st = require_tensor(scales, "scales");
    require_shape(st, "scales", {{"E", E}, {"N/128", N / kBlock}, {"K/128", K / kBlock}}, origin);
    output(st, "scales", MEGAMOE_DTYPE_FLOAT32);
    std::vector<Named> outputs{{scales, "scales"}};
    if (q) outputs.push_back({q, "q"});
    if (q_t) outputs.push_back({q_t, "q_t"});
    finish_checks(outputs, {w, "w"});

    Fp8QuantizeArgs a;
    a.x = static_cast<const __nv_bfloat16*>(wt.data);
    a.x_batch = wt.strides[0];
    a.x_row = wt.strides[1];
    a.batches = E;
    a.rows = N;
    a.cols = K;
    if (q) {
      a.q = static_cast<uint8_t*>(q->data);
      a.q_batch = q->strides[0];
      a.q_row = q->strides[1];
    }
    if (q_t) {
      a.q_t = static_cast<uint8_t*>(q_t->data);
      a.t_batch = q_t->strides[0];
      a.t_row = q_t->strides[1];
    }
    set_scales(a, st, true);
    quantize_fp8(Fp8Blocks::kTiles128, a, static_cast<cudaStream_t>(cuda_stream));
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_quantize_fp8_cols_128(const megamoe_tensor* x,
                                                         megamoe_tensor* q_t,
                                                         megamoe_tensor* scales,
                                                         void* cuda_stream) {
  return quantize_matrix("megamoe_quantize_fp8_cols_128", Fp8Blocks::kColumns128, x, q_t, scales,
                         cuda_stream);
}

}  // extern "C"
