// A ring of shared-memory stages filled by TMA (the producer warpgroup's elected thread) and
// consumed by the consumer warpgroups (docs/design.md section 4.4): each stage holds kParts tiles
// (the forward: K and V of one key block; a backward: Q and dO of one query block), each part
// with its own "full" mbarrier (so a consumer can start on the first part before the second has
// landed), and one "empty" mbarrier that the consumers arrive on when they are done with every
// part of the stage. RingPos (pipeline.h) walks the stages and phase bits; both sides walk the
// same sequence of positions.
//
//   producer: acquire(pos); for each part: bar = arm(pos, part, bytes); tma_load_*(..., bar, ...);
//             pos.advance()
//   consumer: wait(pos, part) before reading a part; release(pos) after its last read (every
//             consumer thread arrives: the empty barrier counts kConsumerThreads arrivals); pos.advance()
//
// Also the single-use "load once" barrier (e.g. the forward's Q tile): OnceBarrier.
#pragma once

#include "../pipeline.h"

namespace ssa_flash {
namespace hopper {

template <int kStages_, int kParts_>
struct TmaRing {
  static constexpr int kStages = kStages_;
  static constexpr int kParts = kParts_;
  using Pos = RingPos<kStages_>;
  uint64_t full[kParts_][kStages_];
  uint64_t empty[kStages_];

  // One thread, before the block's first barrier (then fence_mbar_init() and __syncthreads()).
  SSA_DEVICE void init(int consumer_threads) {
    for (int s = 0; s < kStages; ++s) {
      for (int part = 0; part < kParts; ++part) mbar_init(&full[part][s], 1);  // the producer's arrive.expect_tx
      mbar_init(&empty[s], consumer_threads);
    }
  }

  // Producer: waits until the consumers freed the stage of `pos` (the first round passes at once).
  SSA_DEVICE void acquire(const Pos& pos) { mbar_wait(&empty[pos.stage], pos.phase ^ 1); }
  // Producer: announces `bytes` for part `part` of the stage (arrive.expect_tx); the TMA loads of
  // that part complete on the returned barrier.
  SSA_DEVICE uint64_t* arm(const Pos& pos, int part, uint32_t bytes) {
    mbar_arrive_expect_tx(&full[part][pos.stage], bytes);
    return &full[part][pos.stage];
  }
  // Consumer: waits until part `part` of the stage of `pos` has landed.
  SSA_DEVICE void wait(const Pos& pos, int part) { mbar_wait(&full[part][pos.stage], pos.phase); }
  // Consumer (every consumer thread): done with the stage of `pos` (all its parts).
  SSA_DEVICE void release(const Pos& pos) { mbar_arrive(&empty[pos.stage]); }
};

// A tile loaded once per CTA (one phase): arm + load by the producer, wait by the consumers.
struct OnceBarrier {
  uint64_t bar;
  SSA_DEVICE void init() { mbar_init(&bar, 1); }
  SSA_DEVICE uint64_t* arm(uint32_t bytes) {
    mbar_arrive_expect_tx(&bar, bytes);
    return &bar;
  }
  SSA_DEVICE void wait() { mbar_wait(&bar, 0); }
};

// Loads a kRows x kD tile of a rank-4 (head dim, rows, head, batch) tensor map into a
// Sw128Tile<kRows> (smem_layout.h): one TMA load per 64-column panel, box 64 x kRows x 1 x 1, rows
// from `row`, completing on `bar`. The tile's bytes, for arm(): tile_bytes<kRows, kD>().
template <int kRows, int kD, typename T>
SSA_DEVICE void tma_load_tile(T* smem, const TmaDesc* desc, uint64_t* bar, int row, int head, int batch) {
#pragma unroll
  for (int panel = 0; panel < kD / 64; ++panel)
    tma_load_4d(smem + panel * kRows * 64, desc, bar, 64 * panel, row, head, batch);
}
template <int kRows, int kD>
constexpr uint32_t kTmaTileBytes = static_cast<uint32_t>(kRows * kD * 2);
template <int kRows, int kD>
SSA_DEVICE constexpr uint32_t tma_tile_bytes() {
  return kTmaTileBytes<kRows, kD>;
}

}  // namespace hopper
}  // namespace ssa_flash
