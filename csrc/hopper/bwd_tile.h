// The sm_90a warp-specialised backward (docs/design.md §4.4, "CUDA C++, sm_90a backward"): its
// tile, parameters, shared-memory plan and the order of its steps. No torch here.
//
// One CTA of 384 threads per (128-key block, key/value head, batch). Warpgroup 0 is the producer:
// its elected thread loads the CTA's K and V once and, per step (a 64-row query block of one query
// head of the GQA group), Q, dO and the row statistics (bwd_kernel.h's RowStat workspace, written
// by the pre-pass) into a ring of kStages stages by TMA. Warpgroups 1 and 2 are consumers, each
// owning 64 of the 128 keys (the m64 of wgmma): per step S^T = K Q^T, dP^T = V dO^T, the
// elementwise gradient (bwd_kernel.h, score_grad), dV += P^T dO and dK += dS^T Q in registers,
// dS^T into shared memory, then dQ = dS K added to the float32 accumulator with red.global.add.
#pragma once

#include "../params.h"
#include "../pipeline.h"
#include "../smem_layout.h"
#include "../traits.h"

namespace ssa_flash {
namespace hopper {

// threadIdx.x and blockIdx.x, read again (a fresh S2R the compiler cannot merge with the
// prologue's, nor hoist out of a loop: what derives from it is recomputed where it is used instead
// of being kept live, or spilled, across the main loop)
SSA_DEVICE int thread_idx_again() {
#ifdef SSA_FLASH_EMULATE
  return static_cast<int>(threadIdx.x);
#else
  int t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
#endif
}

SSA_DEVICE int block_idx_x_again() {
#ifdef SSA_FLASH_EMULATE
  return static_cast<int>(blockIdx.x);
#else
  int b;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(b));
  return b;
#endif
}

// Rows [0, kRows) of a tile L (from a row of the caller's choosing) as a GEMM operand tile: L's
// panels, fewer rows (wg_gemm_rn's B over one part of the queries)
template <typename L, int kRows_>
struct RowSlice {
  static_assert(kRows_ <= L::kRows && kRows_ % 16 == 0, "RowSlice: whole k steps of the tile's rows");
  static constexpr int kRows = kRows_;
  static constexpr int kPanelBytes = L::kPanelBytes;
};

// The tile of the backward at head dim kD (64 or 128), element type T.
template <int kD_, typename T_>
struct BwdTile {
  using Elem = T_;
  static constexpr int kD = kD_;
  static_assert(kD == 64 || kD == 128, "hopper backward: D = 64 or 128");
  static constexpr int kBlockN = 128;  // keys per CTA: 64 per consumer warpgroup
  static constexpr int kBlockM = 64;   // query rows per step
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kConsumerWarps = 8;
  // the dQ GEMM of a step, per consumer warpgroup c: at D = 128 the 64 columns of panel c over
  // all 128 keys (both halves of dS^T: a barrier between the consumers); at D = 64 every column
  // over its own 64 keys (the two warpgroups' products both added to dQ)
  static constexpr bool kDqSplitCols = kD == 128;
  using KTile = Sw128Tile<kBlockN>;   // K, V: [key][d]
  using QTile = Sw128Tile<kBlockM>;   // Q, dO: [query][d]
  using DsTile = Sw128Tile<kBlockN>;  // dS^T: [key][query], one 64-column panel
  static constexpr int kKElems = KTile::elems(kBlockN, kD);
  static constexpr int kQElems = QTile::elems(kBlockM, kD);
  static constexpr int kDsElems = DsTile::elems(kBlockN, kBlockM);
};

// How a consumer splits a step's 64 queries (bwd_mainloop.h, BwdConsumer::scores_and_dv):
//   kSplitWhole:      S^T, dP^T of all 64 queries in one wgmma group, then their gradients, then dV;
//   kSplitOverlapped: two parts of 32 queries, both parts' GEMMs issued at once (two accumulator
//                     pairs), part 1's running while part 0's gradients are computed;
//   kSplitLooped:     two parts of 32 queries in a loop (one accumulator pair): part h's GEMMs,
//                     gradients, then its dV GEMM, which runs under part h + 1's score GEMMs.
enum BwdSplit : int { kSplitWhole, kSplitOverlapped, kSplitLooped };

template <int kD, int kScoreParams, bool kAdaptive>
constexpr BwdSplit bwd_split() {
#ifdef SSA_FLASH_HOPPER_BWD_SPLIT
  return static_cast<BwdSplit>(SSA_FLASH_HOPPER_BWD_SPLIT);  // (a build that tries another)
#else
  // (spill-store bytes whole / overlapped / looped, bf16, nvcc 13.0, sm_90a, ptxas -v: D 64
  // softmax 0 / 0 / 0, adaptive 0 / 0 / 0; SSA 80 / 0 / 0, adaptive 92 / 124 / 0; D 128 softmax
  // 0 / 0 / 0, adaptive 0 / 0 / 0; SSA 0 / 56 / 0, adaptive 24 / 112 / 0. Whole or overlapped
  // where that compiles clean: a warpgroup's own tensor work then runs under its gradients, and
  // the loop costs instructions per score (D 128 SSA looped 29.3, whole 24.0: tools/hopper_bwd_model.py))
  if (kD == 64) return kAdaptive && kScoreParams > 0 ? kSplitLooped : kSplitOverlapped;
  return kAdaptive && kScoreParams > 0 ? kSplitLooped : kSplitWhole;
#endif
}

// The row statistics of a step in shared memory: kCount floats per query row (lse, delta and,
// adaptive, beta, lse_l, entropy, g: bwd_kernel.h's RowStat), [query][kCount], delivered by kLoads
// TMA loads of kBox floats (a box dimension is at most 256).
template <typename Tile, bool kAdaptive>
struct BwdStatLayout {
  static constexpr int kCount = dkdv_stat_count(kAdaptive);
  static constexpr int kLoads = (kCount * Tile::kBlockM + 255) / 256;
  static constexpr int kBox = kCount * Tile::kBlockM / kLoads;
  static_assert(kBox * kLoads == kCount * Tile::kBlockM && kBox * 4 % 16 == 0, "whole 16-byte boxes");
};

// Byte offsets of the CTA's shared memory (from its 1024-byte aligned start): K, V, the ring's
// stages (Q, dO, statistics), two dS^T buffers, the mbarriers.
template <typename Tile, bool kAdaptive>
struct BwdSmem {
  using T = typename Tile::Elem;
  static constexpr int kK = 0;
  static constexpr int kV = kK + Tile::kKElems * 2;
  static constexpr int kStatBytes = BwdStatLayout<Tile, kAdaptive>::kCount * Tile::kBlockM * 4;
  static constexpr int kStageBytes = 2 * Tile::kQElems * 2 + (kStatBytes + 1023) / 1024 * 1024;
  static constexpr int kStage0 = kV + Tile::kKElems * 2;
  // within a stage
  static constexpr int kQ = 0, kDo = Tile::kQElems * 2, kStat = 2 * Tile::kQElems * 2;
  static constexpr int kDs = kStage0 + Tile::kStages * kStageBytes;
  static constexpr int kBars = kDs + 2 * Tile::kDsElems * 2;
  // kv_full, full[kStages], empty[kStages]
  static constexpr int kBytes = kBars + 8 * (1 + 2 * Tile::kStages);
  // what the launch asks for: plus the alignment slack
  static constexpr int kLaunchBytes = kBytes + 1024;
  // the bytes a step's loads deliver (the full barrier's transaction count)
  static constexpr int kStepTxBytes = 2 * Tile::kQElems * 2 + kStatBytes;
  static constexpr int kKvTxBytes = 2 * Tile::kKElems * 2;
};

// The kernel's parameters: today's BwdParams (every pointer, stride and size the kernels read)
// and the tensor maps of the TMA loads (pipeline.h: a CUtensorMap on the device, a TmaTileSpec in
// the emulation), in the views bwd_launch.h, hopper_bwd_params, builds:
//   q, dout: (D, Lq, H, B) boxes 64 x 64 x 1 x 1, 128-byte swizzle (one load per 64-column panel);
//   k, v:    (D, Lk, Hkv, B) boxes 64 x 128 x 1 x 1, 128-byte swizzle;
//   stat:    the workspace (B, H, stat_rows, n) as (n stat_rows, B H) floats, box BwdStatLayout::kBox x 1.
// Rows past Lq / Lk are outside the maps: TMA fills them with zeros.
struct HopperBwdParams {
  BwdParams p;
  TmaDesc tma_q, tma_do, tma_k, tma_v, tma_stat;
};

// The query blocks of the steps of a CTA's key block [n0, n0 + 128): per query head of the GQA
// group, blocks [first, first + tiles) of 64 rows (under causal from the block holding query n0);
// the first n_checked of each head's blocks, or all of them when the key block is ragged, need the
// checks (bounds, the causal diagonal; mask.h apply_mask). Producer and consumers walk the same
// list: step s is head s / tiles, block s % tiles.
struct BwdSteps {
  int first, tiles, n_checked, group;
  SSA_DEVICE int count() const { return tiles * group; }
};

template <typename Tile>
SSA_DEVICE BwdSteps bwd_steps(const AttnShape& p, int n0) {
  BwdSteps s;
  constexpr int kM = Tile::kBlockM, kN = Tile::kBlockN;
  s.first = p.causal ? n0 / kM * kM : 0;
  s.tiles = s.first < p.len_q ? (p.len_q - s.first + kM - 1) / kM : 0;
  s.group = p.group;
  if (n0 + kN > p.len_k) {
    s.n_checked = s.tiles;
  } else if (p.causal) {
    // query block [m, m + 64) is cut by the diagonal iff m < n0 + 127 (its first row does not see
    // the block's last key)
    const int cut = n0 + kN - 1 - s.first;
    s.n_checked = min(s.tiles, cut > 0 ? (cut + kM - 1) / kM : 0);
  } else {
    s.n_checked = 0;
  }
  return s;
}

}  // namespace hopper
}  // namespace ssa_flash
