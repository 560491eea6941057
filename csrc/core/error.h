// Error reporting across the C ABI: internal code throws megamoe::Error, and every
// exported function runs its body through abi_call(), which turns any exception into a
// status plus this thread's last-error message. Nothing may unwind through extern "C".
#pragma once

#include <exception>
#include <string>
#include <utility>

#include "megamoe/megamoe.h"

namespace megamoe {

class Error : public std::exception {
 public:
  Error(megamoe_status status, std::string message)
      : status_(status), message_(std::move(message)) {}
  megamoe_status status() const noexcept { return status_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  megamoe_status status_;
  std::string message_;
};

[[noreturn]] inline void throw_invalid(std::string message) {
  throw Error(MEGAMOE_ERROR_INVALID_ARGUMENT, std::move(message));
}

// Records `message` as this thread's last error and returns `status`, so a failing path
// can be written as `return set_error(...)`.
megamoe_status set_error(megamoe_status status, const std::string& message) noexcept;

// Converts the exception in flight into a status and a last-error message.
megamoe_status status_from_current_exception(const char* function) noexcept;

// Runs `body` (returning megamoe_status) so that nothing escapes; `function` names the
// ABI entry point in messages about unexpected failures.
template <class Body>
megamoe_status abi_call(const char* function, Body&& body) noexcept {
  try {
    return body();
  } catch (...) {
    return status_from_current_exception(function);
  }
}

}  // namespace megamoe
