// Test helpers: host tensors with arbitrary element strides, random problems and an
// independent, deliberately naive forward written from the math in docs/design.md ("The layer").
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "megamoe/megamoe.h"

namespace megamoe_test {

// Owns its storage; values are read and written as double whatever the dtype.
class Tensor {
 public:
  Tensor() = default;

  // Row-major contiguous.
  Tensor(megamoe_dtype dtype, std::vector<int64_t> shape)
      : Tensor(dtype, shape, identity(shape.size()), 1) {}

  // Physical layout: dimensions nested in the order `perm` (perm.back() innermost), the
  // innermost one `step` elements apart. Unused elements hold NaN / a sentinel so reads of
  // the wrong element show up.
  Tensor(megamoe_dtype dtype, std::vector<int64_t> shape, std::vector<int> perm, int64_t step)
      : dtype_(dtype), shape_(std::move(shape)), strides_(shape_.size()) {
    int64_t running = step;
    for (int d = static_cast<int>(perm.size()) - 1; d >= 0; --d) {
      strides_[perm[d]] = running;
      running *= std::max<int64_t>(shape_[perm[d]], 1);
    }
    bytes_.resize(static_cast<size_t>(running) * megamoe_dtype_size(dtype));
    for (int64_t i = 0; i < running; ++i) write_raw(i, std::numeric_limits<double>::quiet_NaN());
  }

  megamoe_tensor desc() {
    megamoe_tensor t{};
    t.data = numel() > 0 ? bytes_.data() : nullptr;
    t.dtype = dtype_;
    t.ndim = static_cast<int32_t>(shape_.size());
    for (size_t d = 0; d < shape_.size(); ++d) {
      t.shape[d] = shape_[d];
      t.strides[d] = strides_[d];
    }
    return t;
  }

  megamoe_dtype dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const {
    return std::accumulate(shape_.begin(), shape_.end(), int64_t{1}, std::multiplies<>());
  }

  // Logical row-major flat index.
  double get(int64_t flat) const { return read_raw(offset(flat)); }
  void set(int64_t flat, double v) { write_raw(offset(flat), v); }

  std::vector<double> values() const {
    std::vector<double> v(numel());
    for (int64_t i = 0; i < numel(); ++i) v[i] = get(i);
    return v;
  }
  void assign(const std::vector<double>& v) {
    for (int64_t i = 0; i < numel(); ++i) set(i, v[i]);
  }
  void fill(double v) {
    for (int64_t i = 0; i < numel(); ++i) set(i, v);
  }
  // Same values, another layout / dtype.
  Tensor relayout(megamoe_dtype dtype, std::vector<int> perm, int64_t step) const {
    Tensor t(dtype, shape_, std::move(perm), step);
    t.assign(values());
    return t;
  }

 private:
  static std::vector<int> identity(size_t n) {
    std::vector<int> p(n);
    std::iota(p.begin(), p.end(), 0);
    return p;
  }
  int64_t offset(int64_t flat) const {
    int64_t off = 0;
    for (int d = static_cast<int>(shape_.size()) - 1; d >= 0; --d) {
      off += (flat % shape_[d]) * strides_[d];
      flat /= shape_[d];
    }
    return off;
  }
  template <class T>
  T* at(int64_t i) const {
    return reinterpret_cast<T*>(const_cast<unsigned char*>(bytes_.data())) + i;
  }
  double read_raw(int64_t i) const {
    switch (dtype_) {
      case MEGAMOE_DTYPE_FLOAT32:
        return *at<float>(i);
      case MEGAMOE_DTYPE_FLOAT64:
        return *at<double>(i);
      case MEGAMOE_DTYPE_INT32:
        return *at<int32_t>(i);
      case MEGAMOE_DTYPE_INT64:
        return static_cast<double>(*at<int64_t>(i));
      default:
        return std::numeric_limits<double>::quiet_NaN();
    }
  }
  void write_raw(int64_t i, double v) {
    // Integer padding gets a sentinel instead of NaN.
    const bool nan = std::isnan(v);
    switch (dtype_) {
      case MEGAMOE_DTYPE_FLOAT32:
        *at<float>(i) = static_cast<float>(v);
        break;
      case MEGAMOE_DTYPE_FLOAT64:
        *at<double>(i) = v;
        break;
      case MEGAMOE_DTYPE_INT32:
        *at<int32_t>(i) = nan ? -12345 : static_cast<int32_t>(v);
        break;
      case MEGAMOE_DTYPE_INT64:
        *at<int64_t>(i) = nan ? -12345 : static_cast<int64_t>(v);
        break;
      default:
        break;
    }
  }

  megamoe_dtype dtype_ = MEGAMOE_DTYPE_FLOAT64;
  std::vector<int64_t> shape_, strides_;
  std::vector<unsigned char> bytes_;
};

struct Dims {
  int64_t T, H, I, E, k;
};

// Inputs of one layer call.
struct Problem {
  Dims d;
  Tensor x, ids, weights, w_gate_up, w_down, dy;
};

inline std::vector<double> uniform(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

// Random problem in float64 storage. Each token gets k distinct experts drawn from the
// first `used_experts` (the rest receive no tokens); each slot is -1 with probability
// `p_none`.
inline Problem random_problem(std::mt19937_64& rng, Dims d, int64_t used_experts, double p_none) {
  Problem p{d,
            Tensor(MEGAMOE_DTYPE_FLOAT64, {d.T, d.H}),
            Tensor(MEGAMOE_DTYPE_INT64, {d.T, d.k}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {d.T, d.k}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {d.E, 2 * d.I, d.H}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {d.E, d.H, d.I}),
            Tensor(MEGAMOE_DTYPE_FLOAT64, {d.T, d.H})};
  p.x.assign(uniform(rng, d.T * d.H, -1, 1));
  p.weights.assign(uniform(rng, d.T * d.k, 0.1, 1.0));
  // Scaled so that gate values are O(1) and SiLU is well inside its nonlinear range.
  p.w_gate_up.assign(
      uniform(rng, d.E * 2 * d.I * d.H, -2.0 / std::sqrt(d.H), 2.0 / std::sqrt(d.H)));
  p.w_down.assign(uniform(rng, d.E * d.H * d.I, -2.0 / std::sqrt(d.I), 2.0 / std::sqrt(d.I)));
  p.dy.assign(uniform(rng, d.T * d.H, -1, 1));
  std::bernoulli_distribution none(p_none);
  std::vector<int64_t> experts(used_experts);
  for (int64_t t = 0; t < d.T; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int64_t j = 0; j < d.k; ++j) {
      p.ids.set(t * d.k + j, none(rng) ? -1.0 : static_cast<double>(experts[j % used_experts]));
    }
  }
  return p;
}

// Same values with floating tensors in another storage dtype (ids keep theirs).
inline Problem as_dtype(const Problem& p, megamoe_dtype dt) {
  Problem q = p;
  for (Tensor* t : {&q.x, &q.weights, &q.w_gate_up, &q.w_down, &q.dy}) {
    std::vector<int> perm(t->shape().size());
    std::iota(perm.begin(), perm.end(), 0);
    *t = t->relayout(dt, perm, 1);
  }
  return q;
}

inline double silu(double g) { return g / (1.0 + std::exp(-g)); }

// y straight from the formulas, on logical row-major values.
inline std::vector<double> naive_forward(const Problem& p) {
  const Dims d = p.d;
  const std::vector<double> x = p.x.values(), ids = p.ids.values(), w = p.weights.values(),
                            w1 = p.w_gate_up.values(), w2 = p.w_down.values();
  std::vector<double> y(d.T * d.H, 0.0);
  for (int64_t t = 0; t < d.T; ++t) {
    for (int64_t j = 0; j < d.k; ++j) {
      const auto e = static_cast<int64_t>(ids[t * d.k + j]);
      if (e == -1) continue;
      std::vector<double> a(d.I);
      for (int64_t i = 0; i < d.I; ++i) {
        double g = 0, u = 0;
        for (int64_t c = 0; c < d.H; ++c) {
          g += w1[(e * 2 * d.I + i) * d.H + c] * x[t * d.H + c];
          u += w1[(e * 2 * d.I + d.I + i) * d.H + c] * x[t * d.H + c];
        }
        a[i] = silu(g) * u;
      }
      for (int64_t c = 0; c < d.H; ++c) {
        double o = 0;
        for (int64_t i = 0; i < d.I; ++i) o += w2[(e * d.H + c) * d.I + i] * a[i];
        y[t * d.H + c] += w[t * d.k + j] * o;
      }
    }
  }
  return y;
}

// ||a - b|| / ||b||
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline bool all_finite(const std::vector<double>& v) {
  for (double x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

// Calls on a problem's tensors (descriptors taken fresh each time).
inline megamoe_status forward(Problem& p, Tensor& y) {
  megamoe_tensor x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(), w1 = p.w_gate_up.desc(),
                 w2 = p.w_down.desc(), yd = y.desc();
  return megamoe_reference_forward(&x, &ids, &w, &w1, &w2, &yd);
}

struct Grads {
  Tensor dx, dw, dw1, dw2;
};

// NaN-poisoned gradient outputs of the problem's dtype and shapes.
inline Grads make_grads(const Problem& p, megamoe_dtype dt) {
  const Dims d = p.d;
  return {Tensor(dt, {d.T, d.H}), Tensor(dt, {d.T, d.k}), Tensor(dt, {d.E, 2 * d.I, d.H}),
          Tensor(dt, {d.E, d.H, d.I})};
}

inline megamoe_status backward(Problem& p, Grads& g) {
  megamoe_tensor dy = p.dy.desc(), x = p.x.desc(), ids = p.ids.desc(), w = p.weights.desc(),
                 w1 = p.w_gate_up.desc(), w2 = p.w_down.desc(), dx = g.dx.desc(), dw = g.dw.desc(),
                 dw1 = g.dw1.desc(), dw2 = g.dw2.desc();
  return megamoe_reference_backward(&dy, &x, &ids, &w, &w1, &w2, &dx, &dw, &dw1, &dw2);
}

}  // namespace megamoe_test
