// Tile sizes, register budgets and the shared-storage layout of the sm_90a warp-specialised
// forward (docs/design.md section 4.4). One CTA: a producer warpgroup and two consumer warpgroups
// (384 threads), a 128-row query tile (64 rows per consumer, wgmma's M), key blocks of 128, a
// ring of kStages stages of K and V. Also the CTA's start shared with the row-entropy pass.
#pragma once

#include "../fast_math.h"
#include "../smem_layout.h"
#include "ring.h"

namespace ssa_flash {
namespace hopper {

// Deliberately broken variants, for the tests only (tests/cuda/test_hopper_fwd_emulated.py: the
// emulation must report each as an error or wrong results): a consumer that reads V without
// waiting for its full barrier, one that waits on K's full barrier with the wrong phase bit, one
// that frees a stage as soon as its V has landed, before its P V GEMM (which reads V) is issued,
// and an epilogue whose storing thread exits without waiting for its TMA store to read the O tile.
enum FwdFault : int {
  kFaultNone = 0,
  kFaultNoVWait,
  kFaultWrongKPhase,
  kFaultEarlyRelease,
  kFaultNoStoreWait,
  kFaults
};

// What the warp-specialised query-tile kernels (the forward, fwd_kernel.h; the row-entropy pass,
// fwd_row_entropy.h) share: a producer warpgroup and two consumer warpgroups (384 threads), a
// 128-row query tile (64 rows per consumer, wgmma's M), key blocks of 128, the register budgets.
template <int kHeadDim_, typename Elem_>
struct WsQueryTileTraits {
  using T = Elem_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim of the call (64 or 128)
  static_assert(kHeadDim_ == 64 || kHeadDim_ == 128, "the sm_90a kernels: head dims 64 and 128");
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kConsumers = 2;  // consumer warpgroups
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerThreads = 128 * kConsumers;
  // setmaxnreg budgets: 128 x 24 + 256 x 240 = 64512 of the SM's 65536 registers
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  using QTile = Sw128Tile<kBlockM>;
  using KTile = Sw128Tile<kBlockN>;
  static constexpr int kQElems = QTile::elems(kBlockM, kHeadDim_);
  static constexpr int kKElems = KTile::elems(kBlockN, kHeadDim_);
};

template <int kHeadDim_, typename Elem_, typename Mufu_ = MufuAll, int kFault_ = kFaultNone>
struct WsFwdTraits : WsQueryTileTraits<kHeadDim_, Elem_> {
  using Mufu = Mufu_;  // fast_math.h MufuBudget: the share of ex2 / lg2 on the FMA pipe
  static constexpr int kFault = kFault_;
  // Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB at D 128; D 64 takes 3 stages (Q 16 KB + 3 x 32 KB)
  static constexpr int kStages = kHeadDim_ <= 64 ? 3 : 2;
  enum Part : int { kPartK = 0, kPartV = 1 };
  using Ring = TmaRing<kStages, 2>;
};

// The CTA's shared memory (its start 1024-byte aligned: align_smem_1024; every tile a whole
// number of 1024-byte swizzle atoms, so each stays aligned).
template <typename Tr>
struct FwdSharedStorage {
  using T = typename Tr::T;
  T q[Tr::kQElems];
  T k[Tr::kStages][Tr::kKElems];
  T v[Tr::kStages][Tr::kKElems];
  typename Tr::Ring ring;
  OnceBarrier q_full;
};

// The CTA's start in the warp-specialised query-tile kernels: thread 0 initialises the storage's
// barriers (its q_full and ring), published to the block; then the producer warpgroup gives its
// registers back and its elected thread runs produce(), and the consumers take theirs. True in
// the consumer threads (which go on), false in the producer's (which return).
template <typename Tr, typename Storage, typename Produce>
SSA_DEVICE bool ws_start(Storage& ss, Produce&& produce) {
  if (threadIdx.x == 0) {
    ss.q_full.init();
    ss.ring.init(Tr::kConsumerThreads);
    fence_mbar_init();
  }
  __syncthreads();
  if (warpgroup_idx() == 0) {
    setmaxnreg_dec<Tr::kProducerRegs>();
    if (warp_idx_in_warpgroup() == 0 && elect_one()) produce();
    return false;
  }
  setmaxnreg_inc<Tr::kConsumerRegs>();
  return true;
}

// Dynamic shared memory to ask for: the storage plus the alignment slack.
template <typename Tr>
constexpr int ws_fwd_smem_bytes() {
  return static_cast<int>(sizeof(FwdSharedStorage<Tr>)) + 1024;
}

}  // namespace hopper
}  // namespace ssa_flash
