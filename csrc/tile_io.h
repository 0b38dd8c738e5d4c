// Global -> shared tile copies: load_tile (any rows, bounds-checked), TileStream (one interior
// tile after another through a running pointer), TileMap / TileLoader (tiles starting anywhere,
// per-thread offsets computed once), negate_tile. Each thread copies 16-byte chunks with
// cp_async_16 (memory.h) into a layout of smem_layout.h.
#pragma once

#include "memory.h"
#include "smem_layout.h"

namespace ssa_flash {

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

}  // namespace ssa_flash
