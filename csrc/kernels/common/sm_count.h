// The SMs a launcher sizes its persistent grid by: the current device's multiprocessor
// count, read once per device (launchers ask on every call, and the attribute query is a
// driver round trip), or less under an SmLimit.
#pragma once

namespace megamoe {

// The current device's SMs, or the calling thread's innermost SmLimit when that is smaller.
int sm_count();

// Caps sm_count() on the calling thread while it lives, for running several callers'
// kernels side by side on one device: the emulated ranks of the expert-parallel tests
// (docs/expert-parallel.md, "Several ranks on one GPU"), each of which may spin until
// another's kernels have run.
//
// Contract:
// - It caps every grid that is sized by sm_count(): the grouped GEMMs' persistent grids, the
//   row and count kernels' (gather, combine, routing counts: a few blocks per SM) and the
//   expert-parallel ones' (copy blocks: 2 per SM).
//   Grids sized by the problem (routing plan passes, quantizers, slot reduction) are not
//   capped: their blocks run to the end without waiting on anything, so they can delay a
//   co-running caller but not starve it.
// - It changes no result: every kernel sized by sm_count() gives each tile or row whole to
//   one block (no split reductions; the counts are integer sums), so outputs are bitwise
//   the same under any limit, and the run-to-run reproducibility megamoe.h promises holds.
// - It is read on the host when a kernel is launched: launches from other threads are not
//   capped, and a CUDA graph captured under a limit replays with that limit's grids.
class SmLimit {
 public:
  // sms >= 1 (throws INVALID_ARGUMENT otherwise); more than the device has is no cap.
  explicit SmLimit(int sms);
  ~SmLimit();
  SmLimit(const SmLimit&) = delete;
  SmLimit& operator=(const SmLimit&) = delete;

 private:
  int previous_;
};

}  // namespace megamoe
