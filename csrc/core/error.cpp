#include "core/error.h"

#include <new>

namespace megamoe {
namespace {

// One message per thread: callers on different threads never see each other's errors.
thread_local std::string t_last_error;

void record(const char* message) noexcept {
  try {
    t_last_error = message;
  } catch (...) {
    // No memory even for the message: an empty message beats terminating the process.
    t_last_error.clear();
  }
}

}  // namespace

megamoe_status set_error(megamoe_status status, const std::string& message) noexcept {
  record(message.c_str());
  return status;
}

megamoe_status status_from_current_exception(const char* function) noexcept {
  try {
    try {
      throw;
    } catch (const Error& e) {
      return set_error(e.status(), e.what());
    } catch (const std::bad_alloc&) {
      return set_error(MEGAMOE_ERROR_OUT_OF_MEMORY,
                       std::string(function) + ": out of host memory");
    } catch (const std::exception& e) {
      return set_error(MEGAMOE_ERROR_INTERNAL,
                       std::string(function) + ": internal error: " + e.what());
    }
  } catch (...) {
    // Unknown exception type, or building the message above threw.
    record("megamoe: internal error (unknown exception or out of memory)");
    return MEGAMOE_ERROR_INTERNAL;
  }
}

}  // namespace megamoe

extern "C" {

MEGAMOE_API const char* megamoe_last_error(void) { return megamoe::t_last_error.c_str(); }

MEGAMOE_API void megamoe_clear_error(void) { megamoe::t_last_error.clear(); }

}  // extern "C"
