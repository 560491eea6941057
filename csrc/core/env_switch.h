// The library's environment switches (MEGAMOE_*): on when the variable is set to anything
// but "" or "0". Each caller decides when to read it (on every call, or once).
#pragma once

#include <cstdlib>
#include <cstring>

namespace megamoe {

inline bool env_switch(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace megamoe
