// ABI entry points of the CPU reference: validate everything (shapes, dtypes, pointers,
// aliasing, expert ids) before the first write, then dispatch on the storage type.
#include <string>
#include <vector>

#include "core/error.h"
#include "core/layer_shape.h"
#include "core/tensor_check.h"
#include "reference/layer.h"

namespace megamoe::reference {
namespace {

struct Named {
  const megamoe_tensor* t;
  const char* name;
};

template <class Id>
void read_ids_as(const megamoe_tensor& ids, const LayerShape& s, std::vector<int64_t>& out) {
  const View2<const Id> v = view2<const Id>(ids);
  for (int64_t t = 0; t < s.T; ++t) {
    for (int64_t j = 0; j < s.k; ++j) {
      const auto e = static_cast<int64_t>(v(t, j));
      if (e < -1 || e >= s.E) {
        throw_invalid("topk_ids[" + std::to_string(t) + ", " + std::to_string(j) + "] = " +
                      std::to_string(e) +
                      " is out of range: expected -1 (no expert) or an expert id in [0, " +
                      std::to_string(s.E) + ") (E from w_gate_up)");
      }
      out[t * s.k + j] = e;
    }
  }
}

std::vector<int64_t> read_expert_ids(const megamoe_tensor& ids, const LayerShape& s) {
  std::vector<int64_t> out(s.T * s.k);
  if (ids.dtype == MEGAMOE_DTYPE_INT32) {
    read_ids_as<int32_t>(ids, s, out);
  } else {
    read_ids_as<int64_t>(ids, s, out);
  }
  return out;
}

// Everything about the five layer inputs except the ids' values.
LayerShape check_inputs(const megamoe_tensor* x, const megamoe_tensor* ids,
                        const megamoe_tensor* weights, const megamoe_tensor* wgu,
                        const megamoe_tensor* wd) {
  const LayerShape s = check_layer_shapes(x, ids, weights, wgu, wd);
  require_dtype(*x, "x", {MEGAMOE_DTYPE_FLOAT32, MEGAMOE_DTYPE_FLOAT64});
  require_same_dtype(*weights, "topk_weights", *x, "x");
  require_same_dtype(*wgu, "w_gate_up", *x, "x");
  require_same_dtype(*wd, "w_down", *x, "x");
  require_dtype(*ids, "topk_ids", {MEGAMOE_DTYPE_INT32, MEGAMOE_DTYPE_INT64});
  for (const Named& n : {Named{x, "x"}, Named{ids, "topk_ids"}, Named{weights, "topk_weights"},
                         Named{wgu, "w_gate_up"}, Named{wd, "w_down"}}) {
    require_data(*n.t, n.name);
  }
  return s;
}

// Each output against every input and every other output.
void check_disjoint(const std::vector<Named>& outputs, const std::vector<Named>& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (const Named& in : inputs) {
      require_disjoint(*outputs[i].t, outputs[i].name, *in.t, in.name);
    }
    for (size_t j = 0; j < i; ++j) {
      require_disjoint(*outputs[i].t, outputs[i].name, *outputs[j].t, outputs[j].name);
    }
  }
}

template <class S>
Layer<S> make_layer(const LayerShape& s, const megamoe_tensor& x, const megamoe_tensor& ids,
                    const megamoe_tensor& weights, const megamoe_tensor& wgu,
                    const megamoe_tensor& wd) {
  return Layer<S>{s,
                  read_expert_ids(ids, s),
                  view2<const S>(x),
                  view2<const S>(weights),
                  view3<const S>(wgu),
                  view3<const S>(wd)};
}

template <class S>
void run_forward(const LayerShape& s, const megamoe_tensor& x, const megamoe_tensor& ids,
                 const megamoe_tensor& weights, const megamoe_tensor& wgu,
                 const megamoe_tensor& wd, const megamoe_tensor& y) {
  const Layer<S> layer = make_layer<S>(s, x, ids, weights, wgu, wd);
  forward<S>(layer, view2<S>(y));
}

template <class S>
void run_backward(const LayerShape& s, const megamoe_tensor& dy, const megamoe_tensor& x,
                  const megamoe_tensor& ids, const megamoe_tensor& weights,
                  const megamoe_tensor& wgu, const megamoe_tensor& wd,
                  const megamoe_tensor* dx, const megamoe_tensor* dw,
                  const megamoe_tensor* dwgu, const megamoe_tensor* dwd) {
  const Layer<S> layer = make_layer<S>(s, x, ids, weights, wgu, wd);
  View2<S> dx_v{}, dw_v{};
  View3<S> dwgu_v{}, dwd_v{};
  if (dx) dx_v = view2<S>(*dx);
  if (dw) dw_v = view2<S>(*dw);
  if (dwgu) dwgu_v = view3<S>(*dwgu);
  if (dwd) dwd_v = view3<S>(*dwd);
  backward<S>(layer, view2<const S>(dy), dx ? &dx_v : nullptr, dw ? &dw_v : nullptr,
              dwgu ? &dwgu_v : nullptr, dwd ? &dwd_v : nullptr);
}

}  // namespace
}  // namespace megamoe::reference

using namespace megamoe;
using megamoe::reference::Named;

extern "C" {

MEGAMOE_API megamoe_status megamoe_reference_forward(const megamoe_tensor* x,
                                                     const megamoe_tensor* topk_ids,
                                                     const megamoe_tensor* topk_weights,
                                                     const megamoe_tensor* w_gate_up,
                                                     const megamoe_tensor* w_down,
                                                     megamoe_tensor* y) {
  return abi_call("megamoe_reference_forward", [&] {
    const LayerShape s = reference::check_inputs(x, topk_ids, topk_weights, w_gate_up, w_down);
    check_token_rows(y, "y", s);
    require_same_dtype(*y, "y", *x, "x");
    require_data(*y, "y");
    reference::check_disjoint({{y, "y"}}, {{x, "x"},
                                           {topk_ids, "topk_ids"},
                                           {topk_weights, "topk_weights"},
                                           {w_gate_up, "w_gate_up"},
                                           {w_down, "w_down"}});
    if (x->dtype == MEGAMOE_DTYPE_FLOAT32) {
      reference::run_forward<float>(s, *x, *topk_ids, *topk_weights, *w_gate_up, *w_down, *y);
    } else {
      reference::run_forward<double>(s, *x, *topk_ids, *topk_weights, *w_gate_up, *w_down, *y);
    }
    return MEGAMOE_SUCCESS;
  });
}

MEGAMOE_API megamoe_status megamoe_reference_backward(
    const megamoe_tensor* dy, const megamoe_tensor* x, const megamoe_tensor* topk_ids,
    const megamoe_tensor* topk_weights, const megamoe_tensor* w_gate_up,
    const megamoe_tensor* w_down, megamoe_tensor* dx, megamoe_tensor* d_topk_weights,
    megamoe_tensor* d_w_gate_up, megamoe_tensor* d_w_down) {
  return abi_call("megamoe_reference_backward", [&] {
    const LayerShape s = reference::check_inputs(x, topk_ids, topk_weights, w_gate_up, w_down);
    check_token_rows(dy, "dy", s);
    require_same_dtype(*dy, "dy", *x, "x");
    require_data(*dy, "dy");

    std::vector<Named> outputs;
    if (dx) {
      check_token_rows(dx, "dx", s);
      outputs.push_back({dx, "dx"});
    }
    if (d_topk_weights) {
      require_rank(*d_topk_weights, "d_topk_weights", 2, "[T, k]");
      require_shape(*d_topk_weights, "d_topk_weights", {{"T", s.T}, {"k", s.k}},
                    "from topk_ids");
      outputs.push_back({d_topk_weights, "d_topk_weights"});
    }
    if (d_w_gate_up) {
      require_rank(*d_w_gate_up, "d_w_gate_up", 3, "[E, 2I, H]");
      require_shape(*d_w_gate_up, "d_w_gate_up", {{"E", s.E}, {"2I", 2 * s.I}, {"H", s.H}},
                    "from w_gate_up");
      outputs.push_back({d_w_gate_up, "d_w_gate_up"});
    }
    if (d_w_down) {
      require_rank(*d_w_down, "d_w_down", 3, "[E, H, I]");
      require_shape(*d_w_down, "d_w_down", {{"E", s.E}, {"H", s.H}, {"I", s.I}}, "from w_down");
      outputs.push_back({d_w_down, "d_w_down"});
    }
    for (const Named& out : outputs) {
      require_same_dtype(*out.t, out.name, *x, "x");
      require_data(*out.t, out.name);
    }
    reference::check_disjoint(outputs, {{dy, "dy"},
                                         {x, "x"},
                                         {topk_ids, "topk_ids"},
                                         {topk_weights, "topk_weights"},
                                         {w_gate_up, "w_gate_up"},
                                         {w_down, "w_down"}});
    if (x->dtype == MEGAMOE_DTYPE_FLOAT32) {
      reference::run_backward<float>(s, *dy, *x, *topk_ids, *topk_weights, *w_gate_up, *w_down,
                                     dx, d_topk_weights, d_w_gate_up, d_w_down);
    } else {
      reference::run_backward<double>(s, *dy, *x, *topk_ids, *topk_weights, *w_gate_up,
                                      *w_down, dx, d_topk_weights, d_w_gate_up, d_w_down);
    }
    return MEGAMOE_SUCCESS;
  });
}

}  // extern "C"
