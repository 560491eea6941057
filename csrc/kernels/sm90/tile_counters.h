// Counters for grouped GEMMs whose tiles are handed out as the blocks ask for them
// (TileScheduler::Params::dynamic): a GEMM beside another kernel that holds some SMs (a
// row copy of the expert-parallel layer) then loses only the SM time the other kernel
// takes, where a round-robin grid waits for its late blocks. Experimental: on only with
// MEGAMOE_DYNAMIC_TILES set (not "" or "0", read once).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace megamoe::sm90 {

// The counter pair of launches on `stream` of the current device, zeros between launches
// (each launch leaves them so, and launches on one stream run one after another); null
// when the switch is off or the pool's 256 pairs per device are taken (the round-robin
// grid then). The first call for a device allocates the pool: not under stream capture.
int32_t* dynamic_tile_counters(cudaStream_t stream);

// Probe: MEGAMOE_N_GROUP (an integer, read once; 0 when unset), the M-grouped GEMMs'
// TileScheduler::Params::n_group.
int n_group_switch();

}  // namespace megamoe::sm90
