// Host-side checks of device tensors shared by the CUDA entry points.
#pragma once

#include "megamoe/megamoe.h"

namespace megamoe {

// `t.data` must be device (or managed) memory of the current CUDA device. Empty tensors
// are accepted with any pointer.
void require_device_memory(const megamoe_tensor& t, const char* name);

}  // namespace megamoe
