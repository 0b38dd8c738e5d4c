// Warp-level GEMMs on tensor cores through mma.sync, the code paths below sm_90a (and the fused
// backward's dQ GEMM on sm_90a): the ldmatrix and mma wrappers (m16n8k16 on sm_80+, pairs of
// m16n8k8 on sm_75, m8n8k4 quad pairs on sm_70) and the two GEMM shapes the kernels use, gemm_nt
// (both operands from shared memory) and gemm_rn (A from registers), with load_frag / load_frag_t
// (A fragments from shared memory).
//
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// lane = threadIdx.x % 32, g = lane / 4 (group), t = lane % 4 (thread in group):
//   A (16x16, row-major), 4 x b32 (two 16-bit elements each, lower column in the low half):
//       a0: (g,   2t..2t+1)   a1: (g+8, 2t..2t+1)   a2: (g, 2t+8..2t+9)   a3: (g+8, 2t+8..2t+9)
//   B (16x8, k x n), 2 x b32: b0: (k = 2t..2t+1, n = g)   b1: (k = 2t+8..2t+9, n = g)
//   C/D (16x8, f32): c0, c1: (g, 2t..2t+1)   c2, c3: (g+8, 2t..2t+1)
// So the accumulators of two adjacent n8 tiles of a 16-row strip, rounded to 16 bits, are exactly
// the A fragment of a 16x16 block: the softmax P (and dS) never leave registers (FlashAttention-2).
//
// sm_70 (Volta) has only mma.m8n8k4, a quad-pair instruction (see gemm_nt for how a 16-row strip
// is tiled with it); its accumulators follow another layout (frag.h, struct Frag), and P / dS go
// through a small per-warp shared-memory buffer between the two GEMMs instead of registers.
#pragma once

#include "elem.h"
#include "frag.h"
#include "memory.h"

namespace ssa_flash {

#ifdef SSA_FLASH_EMULATE
using ssa_emu::ldmatrix_x4;
using ssa_emu::ldmatrix_x4_trans;
using ssa_emu::mma_1688_f16;
using ssa_emu::mma_884;
using ssa_emu::syncwarp;
#else
// ------------------------------------------------------------------------------------------
// ldmatrix: four 8x8 16-bit matrices; lanes 8i..8i+7 give the row addresses of matrix i.

SSA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(addr)));
}

SSA_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(addr)));
}

// ------------------------------------------------------------------------------------------
// mma.sync m16n8k8 (f16), the only f16 shape of sm_75 besides m8n8k4.

SSA_DEVICE void mma_1688_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// ------------------------------------------------------------------------------------------
// mma.sync m8n8k4 (sm_70), f16 inputs, f32 accumulators, in place. A warp computes four
// independent 8x8x4 products, one per quad pair (lanes 4q..4q+3 and 16+4q..16+4q+3). In each,
// lane (t = lane % 4, h = lane / 16) gives A row t + 4h, k = 0..3 (a0: k 0-1, a1: k 2-3) and B
// column t + 4h, k = 0..3 (".col" B, k contiguous: b0 k 0-1, b1 k 2-3) or B row k = t, columns
// 4h..4h+3 (".row" B, n contiguous: b0 n 4h..4h+1, b1 n 4h+2..4h+3); it receives the
// accumulators c[v], v = v0 + 2 v1 + 4 v2, at row t % 2 + 2 v1 + 4 h, column 2 (t / 2) + v0 + 4 v2
// (PTX ISA, "Matrix fragments for mma.m8n8k4"): c[0..3] in c_lo, c[4..7] in c_hi.
template <bool kRowB>
SSA_DEVICE void mma_884(float (&c_lo)[4], float (&c_hi)[4], uint32_t a0, uint32_t a1, uint32_t b0,
                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
  if constexpr (kRowB) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11}, {%0, %1, %2, %3, %4, %5, %6, %7};\n"
        : "+f"(c_lo[0]), "+f"(c_lo[1]), "+f"(c_lo[2]), "+f"(c_lo[3]), "+f"(c_hi[0]), "+f"(c_hi[1]),
          "+f"(c_hi[2]), "+f"(c_hi[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11}, {%0, %1, %2, %3, %4, %5, %6, %7};\n"
        : "+f"(c_lo[0]), "+f"(c_lo[1]), "+f"(c_lo[2]), "+f"(c_lo[3]), "+f"(c_hi[0]), "+f"(c_hi[1]),
          "+f"(c_hi[2]), "+f"(c_hi[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
  }
#else
  // only the sm_70 code path (gemm_nt, gemm_rn) calls this, and only in sm_70 device code
  (void)c_lo; (void)c_hi; (void)a0; (void)a1; (void)b0; (void)b1;
  __trap();
#endif
}

SSA_DEVICE void syncwarp() { __syncwarp(); }
#endif  // !SSA_FLASH_EMULATE

// sm_75 (Turing) has m16n8k8 only: the k16 product is two k8 products, (a0, a1) x b0 for
// k = 0..7 and (a2, a3) x b1 for k = 8..15 (the k8 A fragment is {(g, 2t..), (g+8, 2t..)} and
// its B fragment (k = 2t..2t+1, n = g)).
SSA_DEVICE void mma_16816_sm75(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_1688_f16(d, a[0], a[1], b0);
  mma_1688_f16(d, a[2], a[3], b1);
}

// ------------------------------------------------------------------------------------------
// mma.sync m16n8k16, f32 accumulators, in place: d += a * b.

#ifdef SSA_FLASH_EMULATE
template <typename T>
SSA_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef SSA_FLASH_EMULATE_SM75
  if constexpr (!ElemInfo<T>::kIsBF16) {
    mma_16816_sm75(d, a, b0, b1);
    return;
  }
#endif
  ssa_emu::mma_16816<T>(d, a, b0, b1);
}
#else
// The m16n8k16 instruction for element type TY ("f16" or "bf16")
#define SSA_MMA_16816(TY)                                                                               \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, " \
               "{%8, %9}, {%0, %1, %2, %3};\n"                                                           \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <typename T>
SSA_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (ElemInfo<T>::kIsBF16) SSA_MMA_16816("bf16");
  else SSA_MMA_16816("f16");
#else
  if constexpr (ElemInfo<T>::kIsBF16) {
    // bf16 tensor cores need sm_80; the host never launches bf16 kernels on older devices.
    __trap();
  } else {
    mma_16816_sm75(d, a, b0, b1);
  }
#endif
}
#undef SSA_MMA_16816
#endif  // !SSA_FLASH_EMULATE

// ------------------------------------------------------------------------------------------
// Warp GEMMs on kMS 16-row strips (consecutive in shared memory) per warp: each B fragment read
// from shared memory is used by kMS strips, which is what 32 rows per warp buys (FlashAttention-2).
// Accumulators: float[kMS][kN / 8][4], element (ms, nt, i) at strip ms, the row and column that
// struct Frag (frag.h) gives.
//
// sm_70 tiles a strip with mma.m8n8k4: quad pair q computes rows 8 (q % 2) .. +8 of the n8 tiles
// 2p + q / 2, p = 0 .. kN / 16 - 1 (the accumulators of tiles 2p and 2p + 1 of a lane are the
// two halves of one m8n8 result); every operand is one 8-byte shared-memory load per lane.

#if SSA_FLASH_SM70
// The sm_70 k loop of both GEMM shapes: per k4 step, the A operand of each strip (one 8-byte
// load per lane at a_ptr + 16 ms kStrideA + k0) times the B operand of each pair of n8 tiles
// (one 8-byte load at b_ptr + k0 kBK + 8 nt kBN; kRowB: B stored n-contiguous, ".row" B).
template <bool kRowB, int kMS, int kN, int kK, int kStrideA, int kBK, int kBN, typename T>
SSA_DEVICE void mma884_k_loop(float (&acc)[kMS][kN / 8][4], const T* a_ptr, const T* b_ptr) {
#pragma unroll
  for (int k0 = 0; k0 < kK; k0 += 4) {
    uint2 a[kMS];
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) a[ms] = *reinterpret_cast<const uint2*>(a_ptr + ms * 16 * kStrideA + k0);
#pragma unroll
    for (int nt = 0; nt < kN / 8; nt += 2) {
      const uint2 b = *reinterpret_cast<const uint2*>(b_ptr + k0 * kBK + nt * 8 * kBN);
#pragma unroll
      for (int ms = 0; ms < kMS; ++ms) mma_884<kRowB>(acc[ms][nt], acc[ms][nt + 1], a[ms].x, a[ms].y, b.x, b.y);
    }
  }
}
#endif

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
  mma884_k_loop<false, kMS, kN, kK, kStrideA, 1, kStrideB>(acc, a_ptr, b_ptr);
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
  mma884_k_loop<true, kMS, kN, kK, kSS, kStrideB, 1>(acc, a_ptr, b_ptr);
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

}  // namespace ssa_flash
