#include "core/layer_shape.h"

#include <string>

#include "core/error.h"
#include "core/tensor_check.h"

namespace megamoe {

LayerShape check_layer_shapes(const megamoe_tensor* x_, const megamoe_tensor* ids_,
                              const megamoe_tensor* weights_, const megamoe_tensor* wgu_,
                              const megamoe_tensor* wd_) {
  const megamoe_tensor& x = require_tensor(x_, "x");
  const megamoe_tensor& ids = require_tensor(ids_, "topk_ids");
  const megamoe_tensor& weights = require_tensor(weights_, "topk_weights");
  const megamoe_tensor& wgu = require_tensor(wgu_, "w_gate_up");
  const megamoe_tensor& wd = require_tensor(wd_, "w_down");

  LayerShape s{};
  require_rank(x, "x", 2, "[T, H]");
  s.T = x.shape[0];
  s.H = x.shape[1];
  if (s.H < 1) throw_invalid("x: expected hidden size H >= 1, got shape " + shape_str(x));
  const std::string from_x = "x " + shape_str(x);

  require_rank(ids, "topk_ids", 2, "[T, k]");
  require_shape(ids, "topk_ids", {{"T", s.T}, {"k", -1}}, "from " + from_x);
  s.k = ids.shape[1];
  if (s.k < 1) {
    throw_invalid("topk_ids: expected k >= 1 experts per token, got shape " + shape_str(ids));
  }

  require_rank(weights, "topk_weights", 2, "[T, k]");
  require_shape(weights, "topk_weights", {{"T", s.T}, {"k", s.k}},
                "from " + from_x + " and topk_ids " + shape_str(ids));

  require_rank(wgu, "w_gate_up", 3, "[E, 2I, H]");
  require_shape(wgu, "w_gate_up", {{"E", -1}, {"2I", -1}, {"H", s.H}}, "from " + from_x);
  s.E = wgu.shape[0];
  if (s.E < 1) {
    throw_invalid("w_gate_up: expected at least one expert (E >= 1), got shape " +
                  shape_str(wgu));
  }
  if (wgu.shape[1] < 2 || wgu.shape[1] % 2 != 0) {
    throw_invalid("w_gate_up: expected an even number 2I >= 2 of gate+up rows, got shape " +
                  shape_str(wgu));
  }
  s.I = wgu.shape[1] / 2;

  require_rank(wd, "w_down", 3, "[E, H, I]");
  require_shape(wd, "w_down", {{"E", s.E}, {"H", s.H}, {"I", s.I}},
                "from w_gate_up " + shape_str(wgu) + " and " + from_x);
  return s;
}

void check_token_rows(const megamoe_tensor* t_, const char* name, const LayerShape& s) {
  const megamoe_tensor& t = require_tensor(t_, name);
  require_rank(t, name, 2, "[T, H]");
  require_shape(t, name, {{"T", s.T}, {"H", s.H}}, "from x");
}

}  // namespace megamoe
