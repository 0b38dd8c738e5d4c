// The score GEMM of a key block, s = Q K^T: the forward, the row-entropy pass and the backward's
// LSE recount (lse_residual.h).
#pragma once

#include "elem.h"
#include "gemm_mma.h"
#include "gemm_wgmma.h"

namespace ssa_flash {

// s = Q K^T over kN keys and a kD reduction: wgmma over each of the warpgroup's kMS m64 halves
// (sQ the whole query tile; one group, waited for at once) or mma.sync over this warp's kMS
// 16-row strips (sQw its first row; kS the padded row stride).
template <bool kWg, typename T, int kMS, int kN, int kD, typename LQ, typename LK, int kS>
SSA_DEVICE void score_gemm(float (&s)[kMS][kN / 8][4], const T* sQ, const T* sQw, const T* sK, int lane) {
  if constexpr (kWg) {
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) wg_gemm_nt<T, kN, kD, LQ, LK>(s[ms], sQ + ms * 64 * LQ::kRowElems, sK);
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) wgmma_fence_operand(s[ms]);
  } else {
    zero(s);
    gemm_nt<T, kMS, kN, kD, kS, kS>(s, sQw, sK, lane);
  }
}

}  // namespace ssa_flash
