// Where the accumulators of a warp's 16-row strip live (struct Frag, per code path), reductions
// over the lanes that hold a row, and accumulators -> A operand fragments.
#pragma once

#include "elem.h"

namespace ssa_flash {

// ------------------------------------------------------------------------------------------
// Where the accumulators of a 16-row strip live. A strip of N columns is held as float[N / 8][4];
// element (nt, i) of lane `lane` is at
//     row = Frag::row(lane) + Frag::kHi * (i / 2),   col = Frag::col(lane, nt) + (i % 2),
// so every thread holds two rows, in pairs of adjacent columns (one packed b32 operand each).
// The four lanes holding the same rows differ in the bits kRowLanes0 and kRowLanes1;
// Frag::rank(lane) numbers them 0..3.
struct Frag {
#if SSA_FLASH_SM70
  // mma.m8n8k4: quad pair q = (lane / 4) % 4 owns rows 8 (q % 2) .. +8 and the n8 tiles of
  // parity q / 2 (gemm_mma.h, gemm_nt); inside its 8x8 tile lane (t = lane % 4, h = lane / 16) holds
  // rows t % 2 + 2 v1 + 4 h, columns 2 (t / 2) + v0 + 4 v2 (PTX ISA, m8n8k4 f32 accumulators)
  // as element (tile 2p + v2, i = v0 + 2 v1).
  static constexpr int kHi = 2;
  static constexpr int kRowLanes0 = 2, kRowLanes1 = 8;
  static SSA_DEVICE int row(int lane) { return (lane & 1) + 4 * (lane >> 4) + 8 * ((lane >> 2) & 1); }
  static SSA_DEVICE int col(int lane, int nt) {
    return 8 * (nt & ~1) + 8 * ((lane >> 3) & 1) + 4 * (nt & 1) + 2 * ((lane >> 1) & 1);
  }
  static SSA_DEVICE int rank(int lane) { return ((lane >> 1) & 1) | (((lane >> 3) & 1) << 1); }
#else
  static constexpr int kHi = 8;
  static constexpr int kRowLanes0 = 1, kRowLanes1 = 2;
  static SSA_DEVICE int row(int lane) { return lane >> 2; }
  static SSA_DEVICE int col(int lane, int nt) { return 8 * nt + 2 * (lane & 3); }
  static SSA_DEVICE int rank(int lane) { return lane & 3; }
#endif
};

// Reductions over the 4 lanes that hold the same accumulator rows.
SSA_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes0);
  x += __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes1);
  return x;
}

SSA_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes0));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes1));
  return x;
}

SSA_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
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

}  // namespace ssa_flash
