// Reference forward: y_t = sum_j p_j * w_down[e_j] @ swiglu(w_gate_up[e_j] @ x_t).
#include <vector>

#include "reference/expert_math.h"
#include "reference/layer.h"
#include "reference/parallel.h"

namespace megamoe::reference {

template <class S>
void forward(const Layer<S>& layer, View2<S> y) {
  const LayerShape& s = layer.shape;
  const double work_per_token = static_cast<double>(s.k) * 3.0 * s.H * s.I;
  // Tokens are independent: each one's sum over its k slots stays on one thread.
  parallel_for(s.T, work_per_token, [&](int64_t begin, int64_t end) {
    std::vector<double> x_t(s.H), h(2 * s.I), a(s.I), y_t(s.H);
    for (int64_t t = begin; t < end; ++t) {
      load_row(layer.x, t, s.H, x_t.data());
      for (double& v : y_t) v = 0;
      for (int64_t j = 0; j < s.k; ++j) {
        const int64_t e = layer.ids[t * s.k + j];
        if (e < 0) continue;
        const double p = static_cast<double>(layer.weights(t, j));
        gate_up_swiglu(layer, e, x_t.data(), h.data(), a.data());
        const View3<const S>& w = layer.w_down;
        for (int64_t c = 0; c < s.H; ++c) y_t[c] += p * dot(w.row(e, c), w.s2, a.data(), s.I);
      }
      S* out = y.row(t);
      for (int64_t c = 0; c < s.H; ++c) out[c * y.s1] = static_cast<S>(y_t[c]);
    }
  });
}

template void forward<float>(const Layer<float>&, View2<float>);
template void forward<double>(const Layer<double>&, View2<double>);

}  // namespace megamoe::reference
