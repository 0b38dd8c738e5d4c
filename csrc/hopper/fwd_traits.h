// Tile sizes, register budgets and the shared-storage layout of the sm_90a warp-specialised
// forward (docs/design.md section 4.4). One CTA: a producer warpgroup and two consumer warpgroups
// (384 threads), a 128-row query tile (64 rows per consumer, wgmma's M), key blocks of 128, a
// ring of kStages stages of K and V.
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

template <int kHeadDim_, typename Elem_, typename Mufu_ = MufuAll, int kFault_ = kFaultNone>
struct WsFwdTraits {
  using T = Elem_;
  using Mufu = Mufu_;  // fast_math.h MufuBudget: the share of ex2 / lg2 on the FMA pipe
  static constexpr int kFault = kFault_;
  static constexpr int kHeadDim = kHeadDim_;  // padded head dim of the call (64 or 128)
  static_assert(kHeadDim_ == 64 || kHeadDim_ == 128, "the sm_90a forward: head dims 64 and 128");
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  // Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB at D 128; D 64 takes 3 stages (Q 16 KB + 3 x 32 KB)
  static constexpr int kStages = kHeadDim_ <= 64 ? 3 : 2;
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

// Dynamic shared memory to ask for: the storage plus the alignment slack.
template <typename Tr>
constexpr int ws_fwd_smem_bytes() {
  return static_cast<int>(sizeof(FwdSharedStorage<Tr>)) + 1024;
}

}  // namespace hopper
}  // namespace ssa_flash
