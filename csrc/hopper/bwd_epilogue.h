// The consumers' epilogue of the sm_90a backward: dK (times the softmax scale) and dV of the
// warpgroup's 64 keys from registers, and the per-(query head, key block, consumer warp) partial
// sums of the score function's parameter gradients (SSA: db, dn), each slot written once, so the
// caller's fixed-order sum over the last dim is deterministic.
#pragma once

#include "../elem.h"
#include "../frag.h"
#include "../logits.h"
#include "../params.h"

namespace ssa_flash {
namespace hopper {

// dK, dV of consumer thread `tid` (128 .. 383): rows of keys n0 + 16 (tid / 32 - 4) + g (+ 8)
// (consumer c's warps are 4 c + 4 .. 4 c + 7: rows 64 c + 16 w), within len_k; columns within
// dim / dim_v.
template <typename T, int kD>
SSA_DEVICE void store_dk_dv(const BwdParams& p, const float (&dk)[kD / 8][4], const float (&dv)[kD / 8][4], int bb,
                            int hk, int n0, int tid) {
  T* const dk_head = static_cast<T*>(p.dk) + bb * p.dk_sb + hk * p.dk_sh;
  T* const dv_head = static_cast<T*>(p.dv) + bb * p.dv_sb + hk * p.dv_sh;
  const int lane = tid % 32, t = lane % 4;
  const int key_lo = n0 + 16 * (tid / 32 - 4) + lane / 4;
#pragma unroll
  for (int dt = 0; dt < kD / 8; ++dt) {
    const int col = 8 * dt + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = key_lo + 8 * h;
      if (key >= p.len_k) continue;
      if (col < p.dim)
        *reinterpret_cast<uint32_t*>(dk_head + key * p.dk_sm + col) =
            pack2<T>(dk[dt][2 * h] * p.scale, dk[dt][2 * h + 1] * p.scale);
      if (col < p.dim_v)
        *reinterpret_cast<uint32_t*>(dv_head + key * p.dv_sm + col) = pack2<T>(dv[dt][2 * h], dv[dt][2 * h + 1]);
    }
  }
}

// The parameters' partials of query head `head` (batch bb): the sums of consumer thread tid's
// warp (consumer warp tid / 32 - 4) into slot ((bb H + head) n_key_blocks + key_block)
// kConsumerWarps + consumer warp of each (B, H, n_key_blocks kConsumerWarps) buffer, times the
// per-head factor (Score::dparam_factor).
template <typename Score, int kConsumerWarps>
SSA_DEVICE void store_dparams(const BwdParams& p, float dpar0, float dpar1, int bb, int head, int key_block,
                              int n_key_blocks, int tid) {
  constexpr int kNPar = Score::kParams;
  if constexpr (kNPar > 0) {
    const int lane = tid % 32, consumer_warp = tid / 32 - 4;
    const float sum0 = warp_sum(dpar0), sum1 = kNPar > 1 ? warp_sum(dpar1) : 0.0f;
    if (lane == 0) {
      const LogitCtx ctx = Score::template setup<false>(p, bb, head);
      const int64_t idx =
          ((static_cast<int64_t>(bb) * p.heads + head) * n_key_blocks + key_block) * kConsumerWarps + consumer_warp;
      p.dparam_part0[idx] = sum0 * Score::template dparam_factor<false>(p, ctx, 0);
      if (kNPar > 1) p.dparam_part1[idx] = sum1 * Score::template dparam_factor<false>(p, ctx, 1);
    }
  }
}

}  // namespace hopper
}  // namespace ssa_flash
