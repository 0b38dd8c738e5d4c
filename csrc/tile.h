// Tile-level pieces shared by every kernel: global -> shared tile loads, the two warp GEMM
// shapes, accumulator -> operand conversion, and the logit transform (softmax or SSA, masks,
// causality) in base-2 units, mirroring ssa_flash/triton/common.py.
#pragma once

#include "params.h"
#include "utils.h"

namespace ssa_flash {

// ------------------------------------------------------------------------------------------
// Global -> shared

// Rows [row0, row0 + kRows) and columns [0, kHeadDim) of a row-major global matrix with row
// stride `stride` (unit column stride), into shared memory with row stride kStride. Rows >= len
// and columns >= cols (a multiple of 8) are zero-filled. 16-byte cp.async per 8 elements.
template <int kRows, int kHeadDim, int kStride, int kNThreads, typename T>
SSA_DEVICE void load_tile(T* smem, const T* gmem, int64_t stride, int row0, int len, int cols,
                          int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kTotal = kRows * kChunks;
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
    cp_async_16(smem + r * kStride + col, src, ok);
  }
}

// ------------------------------------------------------------------------------------------
// Warp GEMMs on 16-row strips. Accumulator element (nt, i) of a strip is at
//   row = 16-row strip base + lane / 4 + 8 * (i / 2),   col = 8 * nt + 2 * (lane % 4) + (i % 2).

// acc (16 x kN) += A (16 x kK) * B^T, A: shared rows (the warp's strip, row stride kStrideA),
// B: shared [kN][kK] (row stride kStrideB), i.e. both operands stored with k contiguous.
// Used for Q K^T, dO V^T, K Q^T, V dO^T.
template <typename T, int kN, int kK, int kStrideA, int kStrideB>
SSA_DEVICE void gemm_nt(float (&acc)[kN / 8][4], const T* sA, const T* sB, int lane) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "gemm_nt: 16-multiples only");
  // A 16x16 block: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (8-15, 8-15)
  const T* a_ptr = sA + (lane & 15) * kStrideA + (lane >> 4) * 8;
  // B, two n8 tiles: matrices (n 0-7, k 0-7) = b0, (n 0-7, k 8-15) = b1 of the first tile,
  // (n 8-15, k 0-7), (n 8-15, k 8-15) of the second
  const T* b_ptr = sB + ((lane & 7) + ((lane >> 4) << 3)) * kStrideB + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int k0 = 0; k0 < kK; k0 += 16) {
    uint32_t a[4];
    ldmatrix_x4(a, a_ptr + k0);
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, b_ptr + nt * 8 * kStrideB + k0);
      mma_16816<T>(acc[nt], a, b[0], b[1]);
      mma_16816<T>(acc[nt + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x kN) += A (16 x kK, register fragments) * B, B: shared [kK][kN] (row stride kStrideB),
// n contiguous, read transposed by ldmatrix.trans. Used for P V, dS K, P^T dO, dS^T Q.
template <typename T, int kN, int kK, int kStrideB>
SSA_DEVICE void gemm_rn(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4], const T* sB,
                        int lane) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "gemm_rn: 16-multiples only");
  // matrices (k 0-7, n 0-7) = b0, (k 8-15, n 0-7) = b1 of the first n8 tile, then the second
  const T* b_ptr = sB + (lane & 15) * kStrideB + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_ptr + kk * 16 * kStrideB + nt * 8);
      mma_16816<T>(acc[nt], a[kk], b[0], b[1]);
      mma_16816<T>(acc[nt + 1], a[kk], b[2], b[3]);
    }
  }
}

// The accumulators of a 16 x kN strip, rounded to T, as the A fragments of kN / 16 blocks.
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

// ------------------------------------------------------------------------------------------
// Logits

// What the logit transform needs for one (batch, query head).
struct LogitCtx {
  float scale, b, n;
  int len_q, len_k;
  bool causal;
  int mask_kind;
  const void* mask;  // already offset to (batch, head)
  int64_t mask_sm, mask_sn;
};

SSA_DEVICE LogitCtx make_logit_ctx(const AttnShape& p, int batch, int head, bool ssa) {
  LogitCtx c;
  c.scale = p.scale;
  c.b = ssa ? p.ssa_b[head] : 0.0f;
  c.n = ssa ? p.ssa_n[head] : 0.0f;
  c.len_q = p.len_q;
  c.len_k = p.len_k;
  c.causal = p.causal;
  c.mask_kind = p.mask_kind;
  c.mask_sm = p.mask_sm;
  c.mask_sn = p.mask_sn;
  const int64_t off = batch * p.mask_sb + head * p.mask_sh;
  c.mask = p.mask_kind == kMaskBool  ? static_cast<const void*>(static_cast<const uint8_t*>(p.mask) + off)
           : p.mask_kind == kMaskAdd ? static_cast<const void*>(static_cast<const float*>(p.mask) + off)
                                     : nullptr;
  return c;
}

// One logit from the raw dot product s = q.k of query `row`, key `col`:
//   z = scale * s;  phi2 = phi(z) * log2(e) (finite, no mask), phi(z) = n sgn(z) log1p(b|z|) for SSA;
//   returns l2 = (phi(z) + mask) * log2(e), or -inf where the key is not admissible (out of
//   range, after the query under causal, masked out).
template <bool kSSA>
SSA_DEVICE float logit2(const LogitCtx& c, float s, int row, int col, float& z, float& phi2) {
  z = s * c.scale;
  if (kSSA) {
    const float t = log2_1p(c.b * fabsf(z));
    phi2 = c.n * (z >= 0.0f ? t : -t);
  } else {
    phi2 = z * kLog2e;
  }
  bool ok = row < c.len_q && col < c.len_k && (!c.causal || col <= row);
  float l2 = phi2;
  if (c.mask_kind != kMaskNone && ok) {
    const int64_t off = static_cast<int64_t>(row) * c.mask_sm + static_cast<int64_t>(col) * c.mask_sn;
    if (c.mask_kind == kMaskBool) {
      ok = static_cast<const uint8_t*>(c.mask)[off] != 0;
    } else {
      l2 += static_cast<const float*>(c.mask)[off] * kLog2e;
    }
  }
  return ok ? l2 : neg_inf();
}

}  // namespace ssa_flash
