// The named barriers between the two consumer warpgroups of the `ws128q` FMHA backward (fmha_backward.cu,
// fmha_bwd_wsq_kernel): which barrier a consumer signals on and which it waits at, per tile. Plain C++ usable on host
// and device (NOPAD_HOST_DEVICE): tests/test_fmha_wsq_barriers.cpp explores every interleaving of two consumers
// following this protocol and checks that no barrier phase ever holds two arrivals of one consumer (which would
// complete the phase early and deadlock the CTA) and that both consumers always finish; it does the same for the
// whole CTA's synchronisation (the producer warps' mbarriers and the shared-memory buffers they guard as well), as
// transcribed there from fmha_bwd_wsq_kernel: a change to the kernel's barriers belongs in that model too.
//
// Per tile (the CTA's running tile count `tile`), consumer c (0 or 1) first arrives at ds_done_barrier(tile, c)
// (`bar.arrive`: its dS^T rows of the tile are written), then, after some work of its own, waits at
// ds_done_barrier(tile, 1 - c) (`bar.sync`: the other consumer's rows are written). A barrier's phase completes when
// both consumers have arrived at it (one arriving, one waiting: 256 threads). Nothing else orders a consumer's next
// arrival after the other consumer's wait, so one barrier per consumer is not enough: alternating by tile parity makes
// a consumer's arrival at tile n + 2 follow its own wait at tile n + 1, which needs the other's arrival there, which
// the other makes only after its wait at tile n.
#pragma once

#include "core/philox.h"  // NOPAD_HOST_DEVICE

namespace nopad::cuda::fmha_wsq {

// Named barrier ids: 0 is __syncthreads; kBarStage + c, consumer c's dQ stage written (its 128 threads, in
// finish_dq); kBarDsDone .. + 3, the dS^T barriers below.
inline constexpr int kBarStage = 1;
inline constexpr int kBarDsDone = 3;
inline constexpr int kNumDsDoneBarriers = 4;
static_assert(kBarStage + 2 <= kBarDsDone, "the dQ stage barriers and the dS^T barriers are distinct");

// The barrier on which `consumer` signals its dS^T rows of tile `tile` (and at which the other consumer waits).
NOPAD_HOST_DEVICE constexpr int ds_done_barrier(int tile, int consumer) {
  return kBarDsDone + 2 * (tile & 1) + consumer;
}

}  // namespace nopad::cuda::fmha_wsq
