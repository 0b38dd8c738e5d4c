// Tile-level pieces shared by every kernel: global -> shared tile loads, the two warp GEMM
// shapes, accumulator -> operand conversion, and the logit transform (softmax or SSA, masks,
// causality) in base-2 units, mirroring ssa_flash/triton/common.py.
#pragma once

#include "params.h"
#include "utils.h"

namespace ssa_flash {

// ------------------------------------------------------------------------------------------
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

// The wgmma code path's K-major layout with the 128-byte swizzle (utils.h, wgmma_desc), for a
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

// ------------------------------------------------------------------------------------------
// Global -> shared

// Rows [row0, row0 + kRows) and columns [0, kHeadDim) of a row-major global matrix with row
// stride `stride` (unit column stride), into shared memory laid out as L. Rows >= len
// and columns >= cols (a multiple of 8) are zero-filled. 16-byte cp.async per 8 elements.
// kInRange: the caller knows rows [row0, row0 + kRows) are all < len (interior key blocks), so no
// row predicate or fallback address is needed.
template <int kRows, int kHeadDim, typename L, int kNThreads, bool kInRange = false, typename T>
SSA_DEVICE void load_tile(T* smem, const T* gmem, int64_t stride, int row0, int len, int cols,
                          int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kTotal = kRows * kChunks;
  if constexpr (kNThreads % kChunks == 0 && kTotal % kNThreads == 0) {
    // Each thread copies the same column chunk of rows r0, r0 + kStep, ...: one shared and one
    // global base address plus constant offsets (few registers, which the forward at D = 128
    // needs: per-copy addresses were being spilled).
    constexpr int kStep = kNThreads / kChunks;
    static_assert(kStep % L::kLinearRows == 0, "load_tile: rows kStep apart must be a constant apart");
    const int r0 = tid / kChunks;
    const int col = (tid % kChunks) * 8;
    T* dst = smem + L::offset(r0, col);
    const T* src = gmem + static_cast<int64_t>(row0 + r0) * stride + col;
    const bool col_ok = col < cols;
#pragma unroll
    for (int it = 0; it < kTotal / kNThreads; ++it) {
      const bool ok = col_ok && (kInRange || row0 + r0 + it * kStep < len);
      cp_async_16(dst + it * kStep * L::kRowElems, ok ? src + it * kStep * stride : gmem, ok);
    }
  } else {
    constexpr int kIters = (kTotal + kNThreads - 1) / kNThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = it * kNThreads + tid;
      if (kTotal % kNThreads != 0 && c >= kTotal) break;
      const int r = c / kChunks;
      const int col = (c % kChunks) * 8;
      const int grow = row0 + r;
      const bool ok = grow < len && col < cols;
      const T* src = ok ? gmem + static_cast<int64_t>(grow) * stride + col : gmem;
      cp_async_16(smem + L::offset(r, col), src, ok);
    }
  }
}

// In-range tile copies with a running global pointer, for interior loops that load one tile
// after another (the forward's K and V blocks): each thread copies the same column chunk of rows
// r0, r0 + kStep, ... of every tile (the mapping of load_tile), from a pointer it advances by a
// tile per issue. Per 16-byte copy that is one 64-bit pointer increment instead of the row
// index * stride products and predicates of load_tile (which ptxas did not hoist out of the key
// loop: about 1.5 integer instructions per score element in the forward at D = 64). A thread
// whose chunk lies beyond the head dim (`cols`) zero-fills from a pointer that never moves.
template <int kRows, int kHeadDim, typename L, int kNThreads, typename T>
struct TileStream {
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kStep = kNThreads / kChunks;
  // Head dims whose chunks do not split evenly over the threads (D = 96 with 128 threads) use
  // load_tile's general mapping, with a running row index.
  static constexpr bool kEven = kNThreads % kChunks == 0 && kRows % (kNThreads / kChunks) == 0 &&
                                (kNThreads / kChunks) % L::kLinearRows == 0;
  const T* src;     // even: the thread's first chunk of the next tile; else the matrix
  int64_t row_step; // even: elements between the thread's rows r0 and r0 + kStep (0 when it only
                    // zero-fills); else the row stride
  int dst;          // even: the thread's first chunk in shared memory, elements; else next row
  int cols;         // else: the columns copied
  bool ok;          // even: chunk inside the head dim

  // Positions the stream at tile row `row0` of the matrix `gmem` (row stride `stride`).
  SSA_DEVICE void init(const T* gmem, int64_t stride, int row0, int cols_, int tid) {
    if constexpr (kEven) {
      const int r0 = tid / kChunks;
      const int col = (tid % kChunks) * 8;
      ok = col < cols_;
      row_step = ok ? kStep * stride : 0;
      src = ok ? gmem + static_cast<int64_t>(row0 + r0) * stride + col : gmem;
      dst = L::offset(r0, col);
    } else {
      src = gmem;
      row_step = stride;
      dst = row0;
      cols = cols_;
    }
  }

  // Copies the next tile (rows known to exist) into `smem`, then moves to the tile after it.
  SSA_DEVICE void issue(T* smem, int tid) {
    if constexpr (kEven) {
      const T* s = src;
#pragma unroll
      for (int it = 0; it < kRows / kStep; ++it) {
        cp_async_16(smem + dst + it * kStep * L::kRowElems, s, ok);
        s += row_step;
      }
      src = s;
    } else {
      load_tile<kRows, kHeadDim, L, kNThreads, true>(smem, src, row_step, dst, dst + kRows, cols, tid);
      dst += kRows;
    }
  }
};

// Tiles of kRows rows starting anywhere (the dK/dV kernel's Q and dO tiles: consecutive query
// blocks of one head, then the next head), rows past the end zero-filled. The thread's offset
// in a tile and its row step are computed once, in 32 bits (the binding keeps kRows row strides
// below 2^31 elements), so a copy costs one 64-bit add, a compare and a select (load_tile
// recomputes row * stride products per copy). The row mapping (TileMap) is shared by the
// tensors; each has its own strides (TileLoader). Head dims whose chunks do not split evenly
// over the threads use load_tile.
template <int kRows, int kHeadDim, typename L, int kNThreads>
struct TileMap {
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kStep = kNThreads / kChunks;
  static constexpr bool kEven = kNThreads % kChunks == 0 && kRows % (kNThreads / kChunks) == 0 &&
                                (kNThreads / kChunks) % L::kLinearRows == 0;
  int r0;   // the thread's first row
  int col;  // its column
  SSA_DEVICE void init(int tid) {
    r0 = kEven ? tid / kChunks : 0;
    col = kEven ? (tid % kChunks) * 8 : 0;
  }
};

template <int kRows, int kHeadDim, typename L, int kNThreads, typename T>
struct TileLoader {
  using Map = TileMap<kRows, kHeadDim, L, kNThreads>;
  // even: the thread's first chunk from the tile's first row, elements; else 0. The only
  // per-thread state: the row step and the column bound are passed to each issue (the kernel's
  // strides: uniform registers), which keeps the register count of the kernels at D >= 96 down.
  int off;

  SSA_DEVICE void init(const Map& m, int64_t stride) {
    off = Map::kEven ? m.r0 * static_cast<int>(stride) + m.col : 0;
  }

  // Copies rows [0, kRows) of the tile that starts at `tile` (row stride `stride`; columns >= cols
  // and rows >= rows_left, past the matrix's end, are zero-filled, "read" from `valid`, any valid
  // address).
  SSA_DEVICE void issue(const Map& m, T* smem, const T* tile, int64_t stride, int cols, const T* valid, int rows_left,
                        int tid) const {
    if constexpr (Map::kEven) {
      const bool col_ok = m.col < cols;
      const int row_step = Map::kStep * static_cast<int>(stride);
      const T* src = tile + off;
#pragma unroll
      for (int it = 0; it < kRows / Map::kStep; ++it) {
        const bool in = col_ok && m.r0 + it * Map::kStep < rows_left;
        cp_async_16(smem + L::offset(m.r0, m.col) + it * Map::kStep * L::kRowElems, in ? src : valid, in);
        src += row_step;
      }
    } else {
      (void)valid;
      load_tile<kRows, kHeadDim, L, kNThreads>(smem, tile, stride, 0, rows_left, cols, tid);
    }
  }
};

// Flips the sign of the 16-bit elements this thread copied with load_tile (same mapping); the
// caller has waited for its copies. Used on the Q tile of SSA heads with n < 0 (fwd_kernel.h).
template <int kRows, int kHeadDim, typename L, int kNThreads, typename T>
SSA_DEVICE void negate_tile(T* smem, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kTotal = kRows * kChunks;
  constexpr int kIters = (kTotal + kNThreads - 1) / kNThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int c = it * kNThreads + tid;
    if (kTotal % kNThreads != 0 && c >= kTotal) break;
    uint4* ptr = reinterpret_cast<uint4*>(smem + L::offset(c / kChunks, (c % kChunks) * 8));
    uint4 x = *ptr;
    x.x ^= 0x80008000u;
    x.y ^= 0x80008000u;
    x.z ^= 0x80008000u;
    x.w ^= 0x80008000u;
    *ptr = x;
  }
}

// ------------------------------------------------------------------------------------------
// Warp GEMMs on kMS 16-row strips (consecutive in shared memory) per warp: each B fragment read
// from shared memory is used by kMS strips, which is what 32 rows per warp buys (FlashAttention-2).
// Accumulators: float[kMS][kN / 8][4], element (ms, nt, i) at strip ms, the row and column that
// struct Frag (utils.h) gives.
//
// sm_70 tiles a strip with mma.m8n8k4: quad pair q computes rows 8 (q % 2) .. +8 of the n8 tiles
// 2p + q / 2, p = 0 .. kN / 16 - 1 (the accumulators of tiles 2p and 2p + 1 of a lane are the
// two halves of one m8n8 result); every operand is one 8-byte shared-memory load per lane.

// acc (16 x kN per strip) += A (16 x kK) * B^T, A: shared rows (row stride kStrideA), B: shared
// [kN][kK] (row stride kStrideB), i.e. both operands stored with k contiguous.
// Used for Q K^T, dO V^T, K Q^T, V dO^T.
template <typename T, int kMS, int kN, int kK, int kStrideA, int kStrideB>
SSA_DEVICE void gemm_nt(float (&acc)[kMS][kN / 8][4], const T* sA, const T* sB, int lane) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "gemm_nt: 16-multiples only");
#if SSA_FLASH_SM70
  const int q = (lane >> 2) & 3, tq = (lane & 3) + 4 * (lane >> 4);
  const T* a_ptr = sA + (8 * (q & 1) + tq) * kStrideA;
  const T* b_ptr = sB + (8 * (q >> 1) + tq) * kStrideB;
#pragma unroll
  for (int k0 = 0; k0 < kK; k0 += 4) {
    uint2 a[kMS];
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) a[ms] = *reinterpret_cast<const uint2*>(a_ptr + ms * 16 * kStrideA + k0);
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      const uint2 b = *reinterpret_cast<const uint2*>(b_ptr + nt * 8 * kStrideB + k0);
#pragma unroll
      for (int ms = 0; ms < kMS; ++ms) mma_884<false>(acc[ms][nt], acc[ms][nt + 1], a[ms].x, a[ms].y, b.x, b.y);
    }
  }
#else
  // A 16x16 block: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (8-15, 8-15)
  const T* a_ptr = sA + (lane & 15) * kStrideA + (lane >> 4) * 8;
  // B, two n8 tiles: matrices (n 0-7, k 0-7) = b0, (n 0-7, k 8-15) = b1 of the first tile,
  // (n 8-15, k 0-7), (n 8-15, k 8-15) of the second
  const T* b_ptr = sB + ((lane & 7) + ((lane >> 4) << 3)) * kStrideB + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int k0 = 0; k0 < kK; k0 += 16) {
    uint32_t a[kMS][4];
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) ldmatrix_x4(a[ms], a_ptr + ms * 16 * kStrideA + k0);
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, b_ptr + nt * 8 * kStrideB + k0);
#pragma unroll
      for (int ms = 0; ms < kMS; ++ms) {
        mma_16816<T>(acc[ms][nt], a[ms], b[0], b[1]);
        mma_16816<T>(acc[ms][nt + 1], a[ms], b[2], b[3]);
      }
    }
  }
#endif
}

// Shared memory the sm_70 path of gemm_rn needs per warp (elements): the A operand, re-laid out.
template <int kMS, int kK>
constexpr int gemm_rn_scratch_elems() {
  return SSA_FLASH_SM70 ? kMS * 16 * (kK + 8) : 0;
}

// acc (16 x kN per strip) += A (16 x kK, register fragments, see acc_to_frag) * B, B: columns
// [col0, col0 + kN) of the kK rows of an LB tile starting at sB (k along the rows, n contiguous).
// Used for P V, dS K, P^T dO, dS^T Q. On sm_75+ B is read transposed by ldmatrix.trans (from a
// padded tile, or a swizzled one: the fused backward's K on sm_90a); on sm_70 the m8n8k4 A
// fragment (one row, 4 consecutive k) is not what the accumulator layout gives a lane, so A goes
// through `scratch` (this warp's gemm_rn_scratch_elems() elements of shared memory; unused on
// sm_75+).
template <typename T, int kMS, int kN, int kK, typename LB>
SSA_DEVICE void gemm_rn(float (&acc)[kMS][kN / 8][4], const uint32_t (&a)[kMS][kK / 16][4], const T* sB,
                        int col0, int lane, T* scratch) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "gemm_rn: 16-multiples only");
#if SSA_FLASH_SM70
  constexpr int kSS = kK + 8;
#pragma unroll
  for (int ms = 0; ms < kMS; ++ms) {
    T* lo = scratch + (ms * 16 + Frag::row(lane)) * kSS;
    T* hi = lo + Frag::kHi * kSS;
#pragma unroll
    for (int kk = 0; kk < kK / 16; ++kk) {
      const int c0 = Frag::col(lane, 2 * kk), c1 = Frag::col(lane, 2 * kk + 1);
      *reinterpret_cast<uint32_t*>(lo + c0) = a[ms][kk][0];
      *reinterpret_cast<uint32_t*>(hi + c0) = a[ms][kk][1];
      *reinterpret_cast<uint32_t*>(lo + c1) = a[ms][kk][2];
      *reinterpret_cast<uint32_t*>(hi + c1) = a[ms][kk][3];
    }
  }
  syncwarp();
  const int q = (lane >> 2) & 3;
  const T* a_ptr = scratch + (8 * (q & 1) + (lane & 3) + 4 * (lane >> 4)) * kSS;
  // ".row" B: lane holds k = lane % 4 of the k4 step, columns 4 (lane / 16) .. +4 of its n8 tile
  static_assert(!LB::kSwizzled, "gemm_rn: padded B tiles on sm_70");
  constexpr int kStrideB = LB::kRowElems;
  const T* b_ptr = sB + (lane & 3) * kStrideB + col0 + 8 * (q >> 1) + 4 * (lane >> 4);
#pragma unroll
  for (int k0 = 0; k0 < kK; k0 += 4) {
    uint2 av[kMS];
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) av[ms] = *reinterpret_cast<const uint2*>(a_ptr + ms * 16 * kSS + k0);
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      const uint2 b = *reinterpret_cast<const uint2*>(b_ptr + k0 * kStrideB + nt * 8);
#pragma unroll
      for (int ms = 0; ms < kMS; ++ms) mma_884<true>(acc[ms][nt], acc[ms][nt + 1], av[ms].x, av[ms].y, b.x, b.y);
    }
  }
  syncwarp();  // every lane has read the scratch before it is written again
#else
  (void)scratch;
  // matrices (k 0-7, n 0-7) = b0, (k 8-15, n 0-7) = b1 of the first n8 tile, then the second.
  // Padded: a per-lane pointer plus constants. Swizzled (Sw128Tile; the columns must lie in one
  // 64-column panel, rows start at a multiple of 8): lane's row r has r % 8 = lane % 8, so the
  // chunk of column c is at ((c >> 3) ^ lane) % 8; per n8 pair one add, xor and shift per lane.
  const T* b_ptr;
  if constexpr (LB::kSwizzled) b_ptr = sB + (col0 >> 6) * LB::kPanelElems + (lane & 15) * 64;
  else b_ptr = sB + (lane & 15) * LB::kRowElems + col0 + (lane >> 4) * 8;
  const int b_chunk = (col0 >> 3) + (lane >> 4);  // swizzled: the lane's first chunk, unswizzled
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      uint32_t b[4];
      if constexpr (LB::kSwizzled) ldmatrix_x4_trans(b, b_ptr + kk * 16 * 64 + ((((b_chunk + nt) ^ lane) & 7) << 3));
      else ldmatrix_x4_trans(b, b_ptr + kk * 16 * LB::kRowElems + nt * 8);
#pragma unroll
      for (int ms = 0; ms < kMS; ++ms) {
        mma_16816<T>(acc[ms][nt], a[ms][kk], b[0], b[1]);
        mma_16816<T>(acc[ms][nt + 1], a[ms][kk], b[2], b[3]);
      }
    }
  }
#endif
}

// ------------------------------------------------------------------------------------------
// Warpgroup GEMMs (sm_90a, wgmma; utils.h): the 4 warps of a CTA compute a 64-row product
// together, warp w's accumulators being rows 16 w .. 16 w + 15 in the layout of the warp GEMMs
// (kMS = 1), so the elementwise code after them is the same. Operands are Sw128Tile tiles read
// by the tensor cores through descriptors (no ldmatrix). These only issue: the caller commits the
// group and waits for it (wgmma_commit, wgmma_wait) before reading the accumulators.

// Descriptor `desc` moved by `bytes` (a multiple of 16; stays inside shared memory, so the start
// address field does not overflow).
SSA_DEVICE uint64_t desc_add(uint64_t desc, int bytes) { return desc + static_cast<uint64_t>(bytes >> 4); }

// acc (64 x kN) = A (64 x kK) B^T: A 64 rows of an LA tile (sA: the first of them), B a kN-row
// LB tile (as gemm_nt: both with k along the columns, K-major). One wgmma per 16 columns of k
// (+32 bytes inside a panel).
template <typename T, int kN, int kK, typename LA, typename LB>
SSA_DEVICE void wg_gemm_nt(float (&acc)[kN / 8][4], const T* sA, const T* sB) {
  static_assert(LA::kRows % 64 == 0 && LB::kRows == kN, "wg_gemm_nt: 64 rows of A, a kN-row B tile");
  const uint64_t da = wgmma_desc(sA, 16, 1024), db = wgmma_desc(sB, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const int panel = kk / 4, within = (kk % 4) * 32;  // bytes
    wgmma_ss<T, kN>(acc, desc_add(da, panel * LA::kPanelBytes + within), desc_add(db, panel * LB::kPanelBytes + within),
                    kk > 0);
  }
}

// acc (64 x kN) += A (64 x kK, per warp the A fragments of its 16 rows, as acc_to_frag makes
// them) B, B a kK-row tile read with n along its columns (N-major): whole 64-column panels, the
// next panel LBO = kPanelBytes on (one wgmma per 16 rows of k up to kN = 128).
template <typename T, int kN, int kK, typename LB>
SSA_DEVICE void wg_gemm_rn(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4], const T* sB) {
  static_assert(LB::kRows == kK && kN % 64 == 0, "wg_gemm_rn: a kK-row B tile, whole 64-column panels");
  constexpr int kNI = kN <= 128 ? kN : 128;  // columns per wgmma
  const uint64_t db = wgmma_desc(sB, LB::kPanelBytes, 1024);
  wgmma_fence_operand(acc);
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < kK / 16; ++kb) {
#pragma unroll
    for (int c = 0; c < kN / kNI; ++c)
      wgmma_rs_tb<T, kNI>(*reinterpret_cast<float(*)[kNI / 8][4]>(&acc[c * kNI / 8]), a[kb],
                          desc_add(db, c * (kNI / 64) * LB::kPanelBytes + kb * 16 * 128), 1);
  }
}

// The A fragments (as acc_to_frag makes them) of a 16 x kK block stored row-major in shared
// memory (k contiguous): ldmatrix as in gemm_nt on sm_75+, 32-bit loads at the positions struct
// Frag gives on sm_70.
template <typename T, int kK, int kStrideA>
SSA_DEVICE void load_frag(uint32_t (&a)[kK / 16][4], const T* sA, int lane) {
#if SSA_FLASH_SM70
  const T* lo = sA + Frag::row(lane) * kStrideA;
  const T* hi = lo + Frag::kHi * kStrideA;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const int c0 = Frag::col(lane, 2 * kk), c1 = Frag::col(lane, 2 * kk + 1);
    a[kk][0] = *reinterpret_cast<const uint32_t*>(lo + c0);
    a[kk][1] = *reinterpret_cast<const uint32_t*>(hi + c0);
    a[kk][2] = *reinterpret_cast<const uint32_t*>(lo + c1);
    a[kk][3] = *reinterpret_cast<const uint32_t*>(hi + c1);
  }
#else
  const T* ptr = sA + (lane & 15) * kStrideA + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) ldmatrix_x4(a[kk], ptr + kk * 16);
#endif
}

// The A fragments (as acc_to_frag makes them) of a 16 x kK block stored transposed in shared
// memory: element (m, k) at sT[k * kStrideT + m], m contiguous. The fused backward keeps dS^T
// (keys x queries, as its GEMMs produce it) and needs dS as the A operand of dQ = dS K. On
// sm_75+ ldmatrix.trans reads each 8 x 8 block transposed: matrix i of the x4 is block
// (m 0-7 / 8-15, k 0-7 / 8-15) = a_i, whose 8 stored rows (k) lanes 8i..8i+7 address. On sm_70
// (no ldmatrix) each register is two 16-bit loads at the positions struct Frag gives, which is
// the layout gemm_rn's sm_70 path expects from acc_to_frag.
template <typename T, int kK, int kStrideT>
SSA_DEVICE void load_frag_t(uint32_t (&a)[kK / 16][4], const T* sT, int lane) {
#if SSA_FLASH_SM70
  const int r = Frag::row(lane);
  auto pair = [&](int m, int k) {
    const uint16_t lo = *reinterpret_cast<const uint16_t*>(sT + k * kStrideT + m);
    const uint16_t hi = *reinterpret_cast<const uint16_t*>(sT + (k + 1) * kStrideT + m);
    return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  };
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const int c0 = Frag::col(lane, 2 * kk), c1 = Frag::col(lane, 2 * kk + 1);
    a[kk][0] = pair(r, c0);
    a[kk][1] = pair(r + Frag::kHi, c0);
    a[kk][2] = pair(r, c1);
    a[kk][3] = pair(r + Frag::kHi, c1);
  }
#else
  const T* ptr = sT + ((lane & 7) + ((lane >> 4) << 3)) * kStrideT + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) ldmatrix_x4_trans(a[kk], ptr + kk * 16 * kStrideT);
#endif
}

// The accumulators of a 16 x kN strip, rounded to T, as the A fragments of kN / 16 blocks
// (m16n8k16 layout; on sm_70 gemm_rn places them by struct Frag).
template <typename T, int kN>
SSA_DEVICE void acc_to_frag(uint32_t (&a)[kN / 16][4], const float (&acc)[kN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    a[kk][0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
    a[kk][1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
    a[kk][2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[kk][3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
}

template <int kN>
SSA_DEVICE void zero(float (&acc)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

template <int kMS, int kN>
SSA_DEVICE void zero(float (&acc)[kMS][kN][4]) {
#pragma unroll
  for (int ms = 0; ms < kMS; ++ms) zero(acc[ms]);
}

// A compile-time bool for generic lambdas, and a type chosen by one (no <type_traits> under
// NVRTC).
template <bool B>
struct Bool {
  static constexpr bool value = B;
};

template <bool B, typename A, typename C>
struct SelectType {
  using type = A;
};
template <typename A, typename C>
struct SelectType<false, A, C> {
  using type = C;
};
template <bool B, typename A, typename C>
using Select = typename SelectType<B, A, C>::type;

// ------------------------------------------------------------------------------------------
// Logits, in base-2 units: l2 = phi(z) log2(e) + mask log2(e), z = scale * s for the raw dot
// product s. Softmax: l2 = s * (scale log2 e). SSA: phi(z) log2(e) = n sgn(s) log2(1 + b scale |s|),
// computed as n * xor_sign(lg2(fma(b scale, |s|, 1)), s): one FFMA, one MUFU.LG2, one LOP3, one
// FMUL, no division. lg2.approx is accurate to an absolute 2^-22 or so on [1, inf), and softmax
// is shift-invariant, so only this absolute error (times n) matters, also where b|z| is tiny and
// 1 + b|z| rounds (log1p's usual concern is relative error, which the weights never see).

// What the logit transform needs for one (batch, query head). The mask fields are read from the
// kernel parameters where needed (apply_mask) rather than kept in registers: the forward at
// D = 128 has none to spare.
struct LogitCtx {
  float c;   // multiplies |s| or s: scale * b (SSA) or scale * log2(e) (softmax)
  float n;   // SSA exponent n (0 for softmax)
  float nb;  // d phi / dz at 0 (SSA: n b), for the backward
  int batch, head;
};

SSA_DEVICE LogitCtx make_logit_ctx(const AttnShape& p, int batch, int head, bool ssa) {
  LogitCtx c;
  if (ssa) {
    const float b = p.ssa_b[head], n = p.ssa_n[head];
    c.c = p.scale * b;
    c.n = n;
    c.nb = n * b;
  } else {
    c.c = p.scale * kLog2e;
    c.n = c.nb = 0.0f;
  }
  c.batch = batch;
  c.head = head;
  return c;
}

// The multiplier of a row's logits (before masks): c (softmax) or n (SSA), times the row's
// adaptive temperature beta where there is one, so beta costs nothing per element.
template <bool kSSA>
SSA_DEVICE float row_mult(const LogitCtx& c, float beta) {
  return (kSSA ? c.n : c.c) * beta;
}

// Base-2 logit of raw dot product s, before masks, times the row multiplier `mult`
// (row_mult): softmax s * mult, SSA mult * t with t = sgn(s) log2(1 + c|s|), returned in `t`
// (the backward's dn needs it; u = 1 + c|s| too).
template <bool kSSA>
SSA_DEVICE float logit_raw(const LogitCtx& c, float s, float mult, float& t, float& u) {
  if (kSSA) {
    u = fmaf(c.c, fabsf(s), 1.0f);
    t = xor_sign(lg2(u), s);
    return mult * t;
  } else {
    t = u = 0.0f;
    return s * mult;
  }
}

// l2 where key `col` is admissible for query `row`, else -inf: out of range (rows past the
// queries are -inf too: the mask is not read there), outside the band (a window, or after the
// query under causal), masked out; additive masks are added (times `mask_mult`, log2(e) times
// the row's beta). Only the tiles on the diagonal, the ragged last tile, and every tile of a
// masked or windowed call need this (the kernels skip it elsewhere). kBand = false: causality
// only, for a kernel that never runs a window (the fused backward: the band's two bounds spilled
// it at D = 96).
template <bool kBand = true>
SSA_DEVICE float apply_mask(const AttnShape& p, const LogitCtx& c, float l2, int row, int col,
                            float mask_mult) {
  // the band -win_left <= col - row <= win_right (causality folded in, params.h) as one unsigned
  // compare: fewer live values than two bounds per row (they spilled the D = 128 forward)
  const bool in_band = kBand ? static_cast<unsigned>(col - row + p.win_left) <= static_cast<unsigned>(p.win_width)
                             : !p.causal || col <= row;
  bool ok = row < p.len_q && col < p.len_k && in_band;
  if (p.mask_kind != kMaskNone && ok) {
    const int64_t off = c.batch * p.mask_sb + c.head * p.mask_sh + static_cast<int64_t>(row) * p.mask_sm +
                        static_cast<int64_t>(col) * p.mask_sn;
    if (p.mask_kind == kMaskBool) {
      ok = static_cast<const uint8_t*>(p.mask)[off] != 0;
    } else {
      l2 += static_cast<const float*>(p.mask)[off] * mask_mult;
    }
  }
  return ok ? l2 : neg_inf();
}

// Dropout flags of one n8 tile of a strip, bit e for this thread's accumulator e (rows `row` and
// row + Frag::kHi, columns `col` and col + 1, col even; struct Frag's element order). One Philox
// evaluation on the m16n8 layouts (rows 8 apart), two on sm_70's. Kernels evaluate the flags of
// a step before its GEMMs, when the score registers are not live (with the scores live, the
// evaluation's registers spilled the D = 128 forward), and apply them after (drop_apply).
SSA_DEVICE uint32_t drop_tile_bits(const DropCtx& d, int row, int col) {
  const uint32_t lo = drop_bits(d, row, col);
  const uint32_t hi = Frag::kHi == 8 ? lo : drop_bits(d, row + Frag::kHi, col);
  uint32_t out = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    out |= static_cast<uint32_t>(drop_kept(e >> 1 ? hi : lo, row + (e >> 1) * Frag::kHi, col + (e & 1))) << e;
  return out;
}

// Packed dropout flags of up to 16 n8 tiles, 4 per tile (bit 4 tile + e). Kernels fill them in a
// rolled loop, one Philox evaluation at a time (unrolled, ptxas interleaved the independent
// evaluations and the kernels at 255 registers spilled), and read them with constant shifts.
struct DropFlags {
  uint64_t w;
  SSA_DEVICE void clear() { w = 0; }
  SSA_DEVICE void set(int tile, uint32_t bits4) { w |= static_cast<uint64_t>(bits4) << (4 * tile); }
  // x times the dropout factor of element e of `tile`: `scale` (1 / (1 - p)) kept, 0 dropped
  SSA_DEVICE float apply(int tile, int e, float x, float scale) const {
    return (w >> (4 * tile + e)) & 1u ? x * scale : 0.0f;
  }
};

// Dropout flags of the key-block kernels' transposed scores (rows: keys, columns: queries) for
// one 16-query block: bit c + 2 hi + 4 u for this thread's element (key key0 + Frag::row(lane) +
// Frag::kHi hi, query q0 + Frag::col(lane, u) + c), key0 the warp strip's first key and q0 the
// block's first query (multiples of 16). Here one Philox evaluation's words {i, i + 8} x {j, j + 1}
// belong to different threads; on the m16n8 layouts (keys g, g + 8, queries 2t, 2t + 1, 8 + ...)
// lane (g, t) evaluates the two counters of key pair (g / 2) + 4 (g % 2), queries 2t, 2t + 1, and
// swaps with lane ^ 4 (g ^ 1, the other key of each pair) the half the partner needs: two
// evaluations and one shuffle per 16 x 16 block, as the forward. sm_70: one evaluation per score.
SSA_DEVICE uint32_t drop_bits_keys(const DropCtx& d, int key0, int q0, int lane) {
  uint32_t out = 0;
  if constexpr (Frag::kHi == 8) {
    const int g = lane >> 2, t = lane & 3, par = g & 1;
    const int kp = (g >> 1) + 4 * par;  // this lane's key pair: keys key0 + 2 kp, + 1
    uint32_t mine = 0, send = 0;        // bit c + 2 u: query q0 + 8 u + 2 t + c
#pragma unroll 1
    for (int c = 0; c < 2; ++c) {
      const uint32_t b = drop_bits(d, q0 + 2 * t + c, key0 + 2 * kp);  // bit u + 2 s
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        mine |= ((b >> (u + 2 * par)) & 1u) << (c + 2 * u);
        send |= ((b >> (u + 2 * (par ^ 1))) & 1u) << (c + 2 * u);
      }
    }
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, 4);
    const uint32_t lo = par ? recv : mine, hi = par ? mine : recv;  // keys g, g + 8
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        out |= ((lo >> (c + 2 * u)) & 1u) << (c + 4 * u);
        out |= ((hi >> (c + 2 * u)) & 1u) << (c + 2 + 4 * u);
      }
    }
  } else {
#pragma unroll 1
    for (int b = 0; b < 8; ++b) {  // (one chain at a time: sm_70's kernels have no registers to spare)
      const int u = b >> 2, e = b & 3;
      const int q = q0 + Frag::col(lane, u) + (e & 1), key = key0 + Frag::row(lane) + (e >> 1) * Frag::kHi;
      out |= static_cast<uint32_t>(drop_kept(drop_bits(d, q, key), q, key)) << b;
    }
  }
  return out;
}

// The key blocks (of block_n keys) that query rows [m0, m0 + rows) visit, and the order the
// row-streaming kernels (forward, statistics, dQ) run them in. Visited: [lo, end), the blocks
// meeting the rows' band (causality and the window folded in, params.h set_band; every key
// without either). Interior: [a, n_int), the blocks that need no checks (inside the keys, every
// pair of a query tile row and a key inside the band, no mask, no dropout). The order is
// [lo, end) rotated to start at `a`: the interior blocks, then the checked ones, [n_int, end)
// (the causal diagonal or the window's right edge, the ragged last block), then [lo, a) (cut by
// the window's left edge); next(j) is the block after j (`a` after the last), steps() the number
// of blocks. Interior first keeps the interior loop as it is without a window: a windowed call
// pays the checks only on the band's edges. Streamed (cp.async kernels): an interior step
// prefetches the next block through TileStream, which copies only the next contiguous, full
// block, so when the block after the interior is not that (ragged, or the left edge's first),
// the last interior block runs checked. kWindowInterior = false (sm_70 / sm_75, whose registers
// are spent: the rotation spilled their D = 128 forward): a windowed call has no interior
// blocks, and the order is plain [lo, end).
template <bool kWindowInterior>
struct KeyBlocks {
  int lo, a, n_int, end;
  SSA_DEVICE int next(int j) const { return kWindowInterior && j + 1 == end ? lo : j + 1; }
  SSA_DEVICE int first() const { return n_int > a ? a : first_checked(); }
  SSA_DEVICE int first_checked() const { return !kWindowInterior || n_int < end ? n_int : lo; }
  SSA_DEVICE int steps() const { return end - lo; }
  // f(j, it) for each checked block j, `it` its step in the order (after the interior blocks)
  template <class F>
  SSA_DEVICE void each_checked(F&& f) const {
    int j = first_checked();
    for (int it = n_int - a; it < steps(); ++it, j = next(j)) f(j, it);
  }
};

template <bool kWindowInterior = SSA_FLASH_ASYNC_COPIES>
SSA_DEVICE KeyBlocks<kWindowInterior> key_blocks(const AttnShape& p, int m0, int rows, int block_n, bool streamed) {
  KeyBlocks<kWindowInterior> kb;
  kb.lo = m0 > p.win_left ? (m0 - p.win_left) / block_n : 0;
  kb.end = (min(p.len_k, m0 + rows + p.win_right) + block_n - 1) / block_n;
  int a = kb.lo, i_end = kb.lo;
  if (p.mask_kind == kMaskNone && p.drop_rng == nullptr && (kWindowInterior || !p.window)) {
    // block [n0, n0 + block_n) is interior iff n0 >= last row - win_left and
    // n0 + block_n <= min(len_k, m0 + win_right + 1). (The tile's last row, even past len_q:
    // min(m0 + rows, len_q) here moved the sm_90a dQ kernel's loop counter off the uniform
    // datapath, +20% instructions in its interior loop; rows past len_q are no loss without a
    // left bound, set_band.)
    const int left = m0 + rows - 1 - p.win_left;
    a = max(kb.lo, left > 0 ? (left + block_n - 1) / block_n : 0);
    i_end = min(kb.end, min(p.len_k, m0 + p.win_right + 1) / block_n);
    if (streamed && i_end > a && !(i_end < kb.end ? (i_end + 1) * block_n <= p.len_k : kb.lo == a)) --i_end;
    if (i_end <= a) a = i_end = kb.lo;
  }
  kb.a = a;
  kb.n_int = i_end;
  return kb;
}

// Query rows visited by the key block [n0, n0 + block_n) (the key-block kernels): from
// query_block_lo (a multiple of block_m) up to query_end (exclusive).
SSA_DEVICE int query_block_lo(const AttnShape& p, int n0, int block_m) {
  return n0 - p.win_right > 0 ? (n0 - p.win_right) / block_m * block_m : 0;
}
SSA_DEVICE int query_end(const AttnShape& p, int n0, int block_n) { return min(p.len_q, n0 + block_n + p.win_left); }

}  // namespace ssa_flash
