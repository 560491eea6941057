// Per-(token, expert) pieces shared by the reference forward and backward.
#pragma once

#include <cmath>
#include <cstdint>

#include "reference/layer.h"

namespace megamoe::reference {

// Strided dot product in double. Four partial sums break the add-latency chain; their
// order is fixed, so the result is still deterministic.
template <class A>
double dot(const A* a, int64_t sa, const double* b, int64_t n) {
  double acc0 = 0, acc1 = 0, acc2 = 0, acc3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    acc0 += static_cast<double>(a[(i + 0) * sa]) * b[i + 0];
    acc1 += static_cast<double>(a[(i + 1) * sa]) * b[i + 1];
    acc2 += static_cast<double>(a[(i + 2) * sa]) * b[i + 2];
    acc3 += static_cast<double>(a[(i + 3) * sa]) * b[i + 3];
  }
  for (; i < n; ++i) acc0 += static_cast<double>(a[i * sa]) * b[i];
  return (acc0 + acc1) + (acc2 + acc3);
}

template <class S>
void load_row(View2<const S> v, int64_t t, int64_t n, double* out) {
  const S* row = v.row(t);
  for (int64_t c = 0; c < n; ++c) out[c] = static_cast<double>(row[c * v.s1]);
}

inline double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// h = w_gate_up[e] @ x_t (2I values) and a = silu(h[:I]) * h[I:] (I values).
template <class S>
void gate_up_swiglu(const Layer<S>& layer, int64_t e, const double* x_t, double* h,
                    double* a) {
  const LayerShape& s = layer.shape;
  const View3<const S>& w = layer.w_gate_up;
  for (int64_t r = 0; r < 2 * s.I; ++r) h[r] = dot(w.row(e, r), w.s2, x_t, s.H);
  for (int64_t i = 0; i < s.I; ++i) {
    const double g = h[i];
    a[i] = g * sigmoid(g) * h[s.I + i];
  }
}

// z = w_down[e]^T dy_t (I values).
template <class S>
void down_transposed(const Layer<S>& layer, int64_t e, const double* dy_t, double* z) {
  const LayerShape& s = layer.shape;
  const View3<const S>& w = layer.w_down;
  for (int64_t i = 0; i < s.I; ++i) z[i] = 0;
  for (int64_t c = 0; c < s.H; ++c) {
    const S* row = w.row(e, c);
    const double d = dy_t[c];
    for (int64_t i = 0; i < s.I; ++i) z[i] += static_cast<double>(row[i * w.s2]) * d;
  }
}

// dh = [dg, du] from da = p * z and the gate/up values h:
// dg = da * u * silu'(g), du = da * silu(g), silu'(g) = s(g) (1 + g (1 - s(g))).
inline void swiglu_backward(int64_t I, double p, const double* z, const double* h,
                            double* dh) {
  for (int64_t i = 0; i < I; ++i) {
    const double g = h[i], u = h[I + i], sg = sigmoid(g);
    const double da = p * z[i];
    dh[i] = da * u * sg * (1.0 + g * (1.0 - sg));
    dh[I + i] = da * g * sg;
  }
}

}  // namespace megamoe::reference
