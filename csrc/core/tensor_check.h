// Validation of megamoe_tensor descriptors. Each check throws megamoe::Error
// (INVALID_ARGUMENT) with a message that starts with the argument's name and says what
// was expected and what was given.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "megamoe/megamoe.h"

namespace megamoe {

const char* dtype_name(megamoe_dtype dtype) noexcept;
// "[8, 64, 31]"
std::string shape_str(const megamoe_tensor& t);
int64_t numel(const megamoe_tensor& t) noexcept;

// Non-null descriptor.
const megamoe_tensor& require_tensor(const megamoe_tensor* t, const char* name);

// Rank `ndim`, no negative size, element count representable. `dims` names the
// dimensions for the message, e.g. "[T, H]".
void require_rank(const megamoe_tensor& t, const char* name, int ndim, const char* dims);

// One expected dimension: a label and a value; a negative value accepts any size.
struct Dim {
  const char* label;
  int64_t value;
};
// Exact shape match. `origin` says where the expectation comes from, e.g.
// "from x [5, 64]"; it may be empty.
void require_shape(const megamoe_tensor& t, const char* name, std::initializer_list<Dim> dims,
                   const std::string& origin);

void require_dtype(const megamoe_tensor& t, const char* name,
                   std::initializer_list<megamoe_dtype> allowed);
// Same dtype as `ref`, which all floating tensors of a call must share.
void require_same_dtype(const megamoe_tensor& t, const char* name, const megamoe_tensor& ref,
                        const char* ref_name);

// Data pointer present unless the tensor is empty (frameworks hand out NULL for those).
void require_data(const megamoe_tensor& t, const char* name);

// Row-major dense; strides of size-1 dimensions are not constrained.
bool is_contiguous(const megamoe_tensor& t) noexcept;
void require_contiguous(const megamoe_tensor& t, const char* name);

// Outputs must not share memory with other tensors of the call. Compares the byte ranges
// the two views span, so interleaved views that never touch the same element are
// (conservatively) rejected too.
void require_disjoint(const megamoe_tensor& out, const char* out_name,
                      const megamoe_tensor& other, const char* other_name);

}  // namespace megamoe
