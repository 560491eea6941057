// Reference backward of L = <dy, y> (docs/design.md, "The layer"). Two passes, each recomputing
// the forward pieces it needs so no [T, k, I]-sized activations are stored:
//   token pass  (parallel over tokens):  dx_t and dp_j, summed over the token's slots;
//   expert pass (parallel over experts): dw_down[e] and dw_gate_up[e], summed over the
//                                        expert's (token, slot) pairs in token order.
// Every output element is summed by one thread in a fixed order: deterministic.
#include <algorithm>
#include <vector>

#include "reference/expert_math.h"
#include "reference/layer.h"
#include "reference/parallel.h"

namespace megamoe::reference {
namespace {

template <class S>
void token_pass(const Layer<S>& layer, View2<const S> dy, const View2<S>* dx,
                const View2<S>* d_weights) {
  const LayerShape& s = layer.shape;
  const double work_per_token = static_cast<double>(s.k) * 4.0 * s.H * s.I;
  parallel_for(s.T, work_per_token, [&](int64_t begin, int64_t end) {
    std::vector<double> x_t(s.H), dy_t(s.H), h(2 * s.I), a(s.I), z(s.I), dh(2 * s.I), dx_t(s.H);
    const View3<const S>& w1 = layer.w_gate_up;
    for (int64_t t = begin; t < end; ++t) {
      load_row(layer.x, t, s.H, x_t.data());
      load_row(dy, t, s.H, dy_t.data());
      std::fill(dx_t.begin(), dx_t.end(), 0.0);
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t e = layer.ids[t * s.k + j];
        if (e < 0) {
          if (d_weights) (*d_weights)(t, j) = S(0);
          continue;
        }
        const double p = static_cast<double>(layer.weights(t, j));
        gate_up_swiglu(layer, e, x_t.data(), h.data(), a.data());
        down_transposed(layer, e, dy_t.data(), z.data());
        if (d_weights) {
          double dp = 0;
          for (int64_t i = 0; i < s.I; ++i) dp += z[i] * a[i];
          (*d_weights)(t, j) = static_cast<S>(dp);
        }
        if (dx) {
          swiglu_backward(s.I, p, z.data(), h.data(), dh.data());
          for (int64_t r = 0; r < 2 * s.I; ++r) {
            const S* row = w1.row(e, r);
            const double d = dh[r];
            for (int64_t c = 0; c < s.H; ++c) dx_t[c] += static_cast<double>(row[c * w1.s2]) * d;
          }
        }
      }
      if (dx) {
        S* out = dx->row(t);
        for (int64_t c = 0; c < s.H; ++c) out[c * dx->s1] = static_cast<S>(dx_t[c]);
      }
    }
  });
}

template <class S>
void expert_pass(const Layer<S>& layer, View2<const S> dy, const View3<S>* d_w_gate_up,
                 const View3<S>* d_w_down) {
  const LayerShape& s = layer.shape;
  // (token, slot) pairs of each expert, in token order: CSR offsets into `pairs`.
  std::vector<int64_t> offsets(s.E + 1, 0);
  for (int64_t e : layer.ids) {
    if (e >= 0) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < s.E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> pairs(offsets[s.E]);
  {
    std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
    for (int64_t q = 0; q < s.T * s.k; ++q) {
      const int64_t e = layer.ids[q];
      if (e >= 0) pairs[fill[e]++] = q;
    }
  }

  const double avg_pairs = static_cast<double>(pairs.size()) / static_cast<double>(s.E);
  const double work_per_expert = (avg_pairs + 1.0) * 7.0 * s.H * s.I;
  parallel_for(s.E, work_per_expert, [&](int64_t begin, int64_t end) {
    std::vector<double> x_t(s.H), dy_t(s.H), h(2 * s.I), a(s.I), z(s.I), dh(2 * s.I);
    std::vector<double> g1(d_w_gate_up ? 2 * s.I * s.H : 0), g2(d_w_down ? s.H * s.I : 0);
    for (int64_t e = begin; e < end; ++e) {
      std::fill(g1.begin(), g1.end(), 0.0);
      std::fill(g2.begin(), g2.end(), 0.0);
      for (int64_t n = offsets[e]; n < offsets[e + 1]; ++n) {
        const int64_t t = pairs[n] / s.k, j = pairs[n] % s.k;
        const double p = static_cast<double>(layer.weights(t, j));
        load_row(layer.x, t, s.H, x_t.data());
        load_row(dy, t, s.H, dy_t.data());
        gate_up_swiglu(layer, e, x_t.data(), h.data(), a.data());
        if (d_w_down) {  // += (p dy_t) a^T
          for (int64_t c = 0; c < s.H; ++c) {
            const double pd = p * dy_t[c];
            double* g = &g2[c * s.I];
            for (int64_t i = 0; i < s.I; ++i) g[i] += pd * a[i];
          }
        }
        if (d_w_gate_up) {  // += dh x_t^T
          down_transposed(layer, e, dy_t.data(), z.data());
          swiglu_backward(s.I, p, z.data(), h.data(), dh.data());
          for (int64_t r = 0; r < 2 * s.I; ++r) {
            const double d = dh[r];
            double* g = &g1[r * s.H];
            for (int64_t c = 0; c < s.H; ++c) g[c] += d * x_t[c];
          }
        }
      }
      if (d_w_gate_up) {
        for (int64_t r = 0; r < 2 * s.I; ++r) {
          S* out = d_w_gate_up->row(e, r);
          for (int64_t c = 0; c < s.H; ++c)
            out[c * d_w_gate_up->s2] = static_cast<S>(g1[r * s.H + c]);
        }
      }
      if (d_w_down) {
        for (int64_t c = 0; c < s.H; ++c) {
          S* out = d_w_down->row(e, c);
          for (int64_t i = 0; i < s.I; ++i) out[i * d_w_down->s2] = static_cast<S>(g2[c * s.I + i]);
        }
      }
    }
  });
}

}  // namespace

template <class S>
void backward(const Layer<S>& layer, View2<const S> dy, const View2<S>* dx,
              const View2<S>* d_weights, const View3<S>* d_w_gate_up, const View3<S>* d_w_down) {
  if (dx || d_weights) token_pass(layer, dy, dx, d_weights);
  if (d_w_gate_up || d_w_down) expert_pass(layer, dy, d_w_gate_up, d_w_down);
}

template void backward<float>(const Layer<float>&, View2<const float>, const View2<float>*,
                              const View2<float>*, const View3<float>*, const View3<float>*);
template void backward<double>(const Layer<double>&, View2<const double>, const View2<double>*,
                               const View2<double>*, const View3<double>*, const View3<double>*);

}  // namespace megamoe::reference
