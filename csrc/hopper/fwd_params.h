// The one parameter struct of the sm_90a warp-specialised forward (fwd_kernel.h): today's
// FwdParams (csrc/params.h, unchanged) and the Hopper-only fields, the TMA tensor maps of Q, K
// and V (the loads) and O (the epilogue's store). Passed as `const __grid_constant__
// HopperFwdParams` (the maps must live in parameter space for TMA to read them).
#pragma once

#include "../params.h"
#include "../pipeline.h"

namespace ssa_flash {
namespace hopper {

// Tensor maps, each the rank-4 view (head dim, rows, head, batch) of a (B, H, L, D) tensor with
// its strides in bytes (fwd_launch.h, fwd_tma_specs), 128-byte swizzle, box 64 x (block rows) x 1 x 1:
// one load (store) per 64-column panel of a Sw128Tile. Rows past L and columns past the head dim
// read as zeros (TMA's fill) and are not written by a store, which is how ragged ends and padded
// head dims reach and leave the kernel. A packed batch (FwdParams cu_seqlens_*): the view (head
// dim, total rows, head, 1), a sequence's tiles at its first row; rows past its end are the next
// sequence's, which the consumers mask as keys (a checked block) and the epilogue never stores
// (fwd_epilogue.h).
struct HopperFwdParams {
  TmaDesc tma_q;  // box rows: the query tile (128)
  TmaDesc tma_k;  // box rows: the key block
  TmaDesc tma_v;
  TmaDesc tma_o;  // box rows: a consumer warpgroup's 64; the store writes no element outside O
  FwdParams p;
};

}  // namespace hopper
}  // namespace ssa_flash
