// The sizes of one MoE layer call, derived from its inputs and checked for consistency.
#pragma once

#include <cstdint>

#include "megamoe/megamoe.h"

namespace megamoe {

struct LayerShape {
  int64_t T;  // tokens
  int64_t H;  // hidden size
  int64_t k;  // experts per token
  int64_t E;  // experts
  int64_t I;  // intermediate size (w_gate_up has 2I rows)
};

// Checks presence, rank and mutually consistent shapes of x [T, H], topk_ids [T, k],
// topk_weights [T, k], w_gate_up [E, 2I, H] and w_down [E, H, I]; T may be 0, every
// other size must be >= 1. Dtypes and data pointers are the caller's to check.
LayerShape check_layer_shapes(const megamoe_tensor* x, const megamoe_tensor* topk_ids,
                              const megamoe_tensor* topk_weights,
                              const megamoe_tensor* w_gate_up, const megamoe_tensor* w_down);

// Checks `t` is a non-null [T, H] tensor (y, dy, dx).
void check_token_rows(const megamoe_tensor* t, const char* name, const LayerShape& s);

}  // namespace megamoe
