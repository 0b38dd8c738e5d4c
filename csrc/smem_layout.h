// Shared-memory tile layouts: where element (r, col) of a tile lives. PaddedTile (rows padded by
// 16 bytes: the mma.sync code paths' ldmatrix reads) and Sw128Tile (the 128-byte swizzle of the
// wgmma code path's descriptors), and the 1024-byte alignment the swizzled tiles need.
#pragma once

#include "arch.h"
#include "memory.h"

namespace ssa_flash {

// Shared-memory tile layouts: where element (r, col) of a tile lives, in elements from the tile's
// start (col a multiple of 8 for the 16-byte chunks copies move). A layout L gives
//   L::offset(r, col); L::kLinearRows, L::kRowElems: rows r and r + j kLinearRows are
//   j kLinearRows kRowElems elements apart (so copies of rows kStep apart, kStep a multiple of
//   kLinearRows, advance by a constant); L::elems(rows, d): the tile's size in elements.

// Rows of kStride = D + 8 elements (the mma.sync code paths: the 16-byte pad puts the 8 row
// addresses of each ldmatrix in distinct bank groups).
template <int kStride_>
struct PaddedTile {
  static constexpr bool kSwizzled = false;
  static constexpr int kStride = kStride_;
  static constexpr int kLinearRows = 1;
  static constexpr int kRowElems = kStride_;
  static constexpr int elems(int rows, int) { return rows * kStride_; }
  static SSA_DEVICE int offset(int r, int col) { return r * kStride_ + col; }
};

// The wgmma code path's K-major layout with the 128-byte swizzle (gemm_wgmma.h, wgmma_desc), for a
// tile of kRows rows (a multiple of 8): the head dim in panels of 64 columns (128 bytes), panel
// p a [kRows][64] block at p kRows 64, row r of it at r 64, and the 16-byte chunk c of the row
// at position c ^ (r % 8). Copies of 8 consecutive chunks of a row hit 8 distinct bank groups, and
// with the tile 1024-byte aligned every swizzle atom (8 rows of a panel) is: a 16-column slice of
// a panel is then a K-major wgmma operand (SBO 1024 bytes), a 16-row slice an MN-major one
// (k along the rows: SBO 1024 bytes; LBO: the next panel, kRows 128 bytes).
template <int kRows_>
struct Sw128Tile {
  static_assert(kRows_ % 8 == 0, "Sw128Tile: whole swizzle atoms");
  static constexpr bool kSwizzled = true;
  static constexpr int kRows = kRows_;
  static constexpr int kLinearRows = 8;
  static constexpr int kRowElems = 64;
  static constexpr int kPanelElems = kRows_ * 64;
  static constexpr int kPanelBytes = kRows_ * 128;
  static constexpr int elems(int, int d) { return (d + 63) / 64 * kPanelElems; }
  static SSA_DEVICE int offset(int r, int col) {
    return (col >> 6) * kPanelElems + r * 64 + ((((col >> 3) ^ r) & 7) << 3) + (col & 7);
  }
};

// The first 1024-byte aligned address at or after `p` (shared memory; the kernel asks for 1024
// bytes more than its tiles need).
template <typename T>
SSA_DEVICE T* align_smem_1024(void* p) {
  return reinterpret_cast<T*>(static_cast<char*>(p) + ((1024 - (smem_u32(p) & 1023)) & 1023));
}

}  // namespace ssa_flash
