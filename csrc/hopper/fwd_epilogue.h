// The epilogue of the sm_90a forward (docs/design.md section 4.4): O / l through shared memory and
// a TMA store, and the row LSE.
//
// Each consumer warpgroup writes its 64 rows of O (16-bit, normalised) over its own 64 rows of
// the Q tile (the same 128-byte-swizzled Sw128Tile layout: Q and O have the padded head dim's
// columns, and once the warpgroup's last wgmma has completed nothing reads those rows again; the
// other warpgroup's rows are its own), makes the writes visible to the async proxy
// (fence.proxy.async), meets its own 128 threads at a named barrier, and one elected thread
// stores the 64 x 64 panels with TMA (box 64 columns x 64 rows of the (head dim, rows, head,
// batch) output map). TMA writes no element outside the tensor: rows past len_q and columns past
// dim_v are clipped, which is how ragged ends and padded head dims leave the kernel (no row
// check in the kernel). The storing thread waits until the stores have read shared memory before
// it exits. Packed sequences (kVarlen): rows past a sequence's end are the next sequence's, inside
// the tensor, so a tile that ends past its sequence's last row is copied out by the warpgroup's
// threads with generic stores clipped to the sequence instead (store_rows_clipped; the others,
// whole 64-row boxes inside the sequence, take the TMA store). The LSE is one float per row,
// stored directly by the row's first lane.
// A row with l = 0 (no admissible key) gets O = 0 and LSE = -inf.
#pragma once

#include "../elem.h"
#include "../fast_math.h"
#include "../frag.h"
#include "../gemm_wgmma.h"
#include "../params.h"
#include "../pipeline.h"
#include "fwd_params.h"
#include "fwd_traits.h"
#include "named_barriers.h"
#include "tile_scheduler.h"

namespace ssa_flash {
namespace hopper {

// The rows [row, row + kBoxRows) of a Sw128Tile whose panels are kPanelElems apart (sm: those
// rows' first element in panel 0), columns [0, kD), stored by one thread: one TMA store per
// 64-column panel, skipping the panels at or past `cols` (wholly outside the tensor), then the
// wait until the stores have read shared memory (kWaitRead false: only the tests' broken variant).
template <int kD, int kPanelElems, bool kWaitRead = true, typename T>
SSA_DEVICE void tma_store_rows(const T* sm, const TmaDesc* desc, int cols, int row, int head, int batch) {
#pragma unroll
  for (int panel = 0; panel < kD / 64; ++panel)
    if (64 * panel < cols) tma_store_4d(sm + panel * kPanelElems, desc, 64 * panel, row, head, batch);
  tma_store_commit();
  if constexpr (kWaitRead) tma_store_wait_read<0>();
}

// The rows [0, rows) (rows < 64) of a warpgroup's 64-row O tile sO (a Sw128Tile panel layout),
// columns [0, p.dim_v), to O's rows row .. row + rows - 1 of head `head` with 16-byte generic
// stores by the warpgroup's 128 threads (t: the thread's index in it): a packed sequence's ragged
// last tile, which a TMA store's whole 64-row box would write past, into the next sequence's rows.
// (sO's writes are visible to the generic proxy after the warpgroup's barrier.)
template <typename Tr, typename T>
SSA_DEVICE void store_rows_clipped(const T* sO, const FwdParams& p, int rows, int row, int head, int t) {
  using OTile = typename Tr::QTile;
  constexpr int kChunks = Tr::kHeadDim / 8;  // 16-byte chunks of a row
  T* const o = static_cast<T*>(p.o) + static_cast<int64_t>(head) * p.o_sh;
#pragma unroll 1
  for (int i = t; i < rows * kChunks; i += 128) {
    const int r = i / kChunks, col = 8 * (i % kChunks);
    if (col < p.dim_v)
      *reinterpret_cast<uint4*>(o + static_cast<int64_t>(row + r) * p.o_sm + col) =
          *reinterpret_cast<const uint4*>(sO + OTile::offset(r, col));
  }
}

// Consumer warpgroup c's epilogue. o: the thread's kDT n8 tiles of its two rows (row0, row0 +
// Frag::kHi), m and l as FwdConsumer's; sO: the warpgroup's 64 rows of the Q tile (their first
// element), m0c = the sequence row of sO's first row; seq the tile's sequence. kVarlen (packed
// sequences): a tile ending past the sequence's last row is stored by store_rows_clipped, the
// others by the TMA store as dense tiles are.
template <typename Tr, bool kVarlen, int kDT>
SSA_DEVICE void fwd_epilogue(const HopperFwdParams& hp, typename Tr::T* sO, const float (&o)[kDT][4],
                             const float (&m)[2], const float (&l)[2], int row0, int m0c, int c,
                             const QuerySeq<kVarlen>& seq, int head, int lane) {
  using T = typename Tr::T;
  using OTile = typename Tr::QTile;
  const FwdParams& p = hp.p;
  const int64_t stat0 = seq.stat0();
  const int r_local = row0 - m0c;  // this thread's first row within the warpgroup's 64
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const float sum = quad_sum(l[hi]);
    const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
    const int r = r_local + hi * Frag::kHi;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt)
      *reinterpret_cast<uint32_t*>(sO + OTile::offset(r, Frag::col(lane, dt))) =
          pack2<T>(o[dt][2 * hi] * inv, o[dt][2 * hi + 1] * inv);
    const int row = row0 + hi * Frag::kHi;
    if (Frag::rank(lane) == 0 && row < seq.len_q())
      p.lse[stat0 + row] = sum == 0.0f ? neg_inf() : (m[hi] + log2f(sum)) * kLn2;
  }
  if constexpr (kVarlen) {
    if (m0c + 64 > seq.len_q()) {  // the sequence's ragged end (the whole CTA has m0c < len_q + 64)
      named_bar_sync(warpgroup_barrier(c), 128);
      if (m0c < seq.len_q())
        store_rows_clipped<Tr>(sO, p, seq.len_q() - m0c, seq.q_row() + m0c, head, static_cast<int>(threadIdx.x) % 128);
      return;
    }
  }
  fence_proxy_async();  // (the generic-proxy writes above, read next by the TMA unit)
  named_bar_sync(warpgroup_barrier(c), 128);
  if (warp_idx_in_warpgroup() == 0 && elect_one() && m0c < seq.len_q())
    tma_store_rows<Tr::kHeadDim, OTile::kPanelElems, Tr::kFault != kFaultNoStoreWait>(
        sO, &hp.tma_o, p.dim_v, seq.q_row() + m0c, head, seq.tma_batch());
}

}  // namespace hopper
}  // namespace ssa_flash
