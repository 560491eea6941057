// Internal interface of the CPU reference: typed strided views of one validated call.
// S is the storage type (float or double); every sum is accumulated in double.
#pragma once

#include <cstdint>
#include <vector>

#include "core/layer_shape.h"
#include "megamoe/megamoe.h"

namespace megamoe::reference {

template <class T>
struct View2 {
  T* p;
  int64_t s0, s1;
  T* row(int64_t i) const { return p + i * s0; }
  T& operator()(int64_t i, int64_t j) const { return p[i * s0 + j * s1]; }
};

template <class T>
struct View3 {
  T* p;
  int64_t s0, s1, s2;
  T* row(int64_t e, int64_t r) const { return p + e * s0 + r * s1; }
  T& operator()(int64_t e, int64_t r, int64_t c) const { return p[e * s0 + r * s1 + c * s2]; }
};

template <class T>
View2<T> view2(const megamoe_tensor& t) {
  return {static_cast<T*>(t.data), t.strides[0], t.strides[1]};
}

template <class T>
View3<T> view3(const megamoe_tensor& t) {
  return {static_cast<T*>(t.data), t.strides[0], t.strides[1], t.strides[2]};
}

// The inputs of one call, already validated.
template <class S>
struct Layer {
  LayerShape shape;
  std::vector<int64_t> ids;  // [T * k], row-major, each in [-1, E)
  View2<const S> x;          // [T, H]
  View2<const S> weights;    // [T, k]
  View3<const S> w_gate_up;  // [E, 2I, H]
  View3<const S> w_down;     // [E, H, I]
};

template <class S>
void forward(const Layer<S>& layer, View2<S> y);

// A null output pointer skips that gradient.
template <class S>
void backward(const Layer<S>& layer, View2<const S> dy, const View2<S>* dx,
              const View2<S>* d_weights, const View3<S>* d_w_gate_up,
              const View3<S>* d_w_down);

}  // namespace megamoe::reference
