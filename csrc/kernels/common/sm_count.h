// The SMs a launcher sizes its persistent grid by: the current device's multiprocessor
// count, read once per device (launchers ask on every call, and the attribute query is a
// driver round trip), or less under an SmLimit.
#pragma once

namespace megamoe {

// The current device's SMs, or the calling thread's innermost SmLimit when that is smaller.
// tiles_handed_out: for a grouped GEMM whose tiles go to blocks as they ask
// (TileScheduler, dynamic), which a limit of Scope::kRoundRobinGrids does not cap.
int sm_count(bool tiles_handed_out = false);

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
//
// Scope::kRoundRobinGrids caps every grid but a grouped GEMM's whose tiles are handed out
// as blocks ask for them: the expert-parallel layer's GEMMs beside a copy, where a
// round-robin grid's block kept waiting for a copy's SM delays the whole GEMM, while a
// handed-out grid's late blocks just take fewer tiles (so it needs no cap to leave the copy
// its SMs). The emulation's limits are kEveryGrid: a grid must never wait for SMs that a
// spinning rank holds.
class SmLimit {
 public:
  enum class Scope { kEveryGrid, kRoundRobinGrids };
  // sms >= 1 (throws INVALID_ARGUMENT otherwise); more than the device has is no cap.
  explicit SmLimit(int sms, Scope scope = Scope::kEveryGrid);
  ~SmLimit();
  SmLimit(const SmLimit&) = delete;
  SmLimit& operator=(const SmLimit&) = delete;

 private:
  Scope scope_;
  int previous_;
};

}  // namespace megamoe
