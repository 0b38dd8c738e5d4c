// The named-barrier ids of the warp-specialised sm_90a kernels (csrc/hopper/), in one place so that
// no two roles of a kernel pick the same id. 0 is __syncthreads'; pipeline.h's named_bar_sync /
// named_bar_arrive take these ids (bar.sync / bar.arrive id, count: count threads, whole warps).
#pragma once

#include "../pipeline.h"

namespace ssa_flash {
namespace hopper {

enum NamedBarrier : int {
  // Ping-pong of two consumer warpgroups: consumer c waits on kBarTurn0 + c before issuing its
  // GEMMs and, once they are issued, arrives on the other's (2 x 128 threads per phase).
  kBarTurn0 = kFirstNamedBarrier,
  kBarTurn1,
  // A consumer warpgroup's own 128 threads (kBarWarpgroup0 + c), e.g. after they rewrote their
  // part of a shared-memory tile that their wgmma reads next.
  kBarWarpgroup0,
  kBarWarpgroup1,
  // Every consumer thread (256).
  kBarConsumers,
  // The first id free for a kernel's own use (up to 15).
  kBarFirstFree
};
static_assert(kBarFirstFree <= 16, "bar.sync ids are 0..15");

// The turn barrier of consumer warpgroup c (0 or 1) and of the other one.
SSA_DEVICE constexpr int turn_barrier(int c) { return kBarTurn0 + c; }
SSA_DEVICE constexpr int warpgroup_barrier(int c) { return kBarWarpgroup0 + c; }

}  // namespace hopper
}  // namespace ssa_flash
