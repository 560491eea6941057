// The current device's multiprocessor count, read once per device: launchers size their
// persistent grids by it on every call, and the attribute query is a driver round trip.
#pragma once

namespace megamoe {

int sm_count();

}  // namespace megamoe
