// The gradient of a learned additive mask (a float mask that requires grad): a third backward
// kernel, after the dQ and dK/dV kernels (or the fused path), launched only for such calls
// (launch_impl.h, run_mask_grad). As ssa_flash/triton/mask_grad.py, the Triton backend's.
//
// The logit row is l = phi(z) + mask (docs/design.md sections 1.2-1.4), so the gradient of mask
// element (b, h, i, j) is the logit gradient dl_ij of that (batch, head)'s tile (bwd_kernel.h,
// logit_grad: P' (dO V^T - delta), times beta minus g P (log P + H) with the adaptive
// temperature; with dropout dO V^T times the weight's dropout factor). A mask of shape (L, S),
// (H, L, S), (1, H, L, S) or (B, 1, L, S) broadcasts over the batch and / or the heads; its
// gradient is dl summed over them.
//
// Design. The dQ and dK/dV kernels form dl per tile already, but neither can reduce over the
// broadcast dims deterministically: a dK/dV CTA owns one key block of one (batch, key head), so
// the sum over batch elements (and over heads of other key heads) would span CTAs and need fp32
// atomics or a (B, H, L, S) buffer of partials. Here one CTA owns one (BM, BN) tile of the
// gradient, of the mask's own un-broadcast shape (Bm, Hm, L, S) (Bm in {1, B}, Hm in {1, H}), and
// loops over the (batch, head) pairs that broadcast onto it in a fixed order (batch outer, head
// inner), recomputing S = Q K^T and dP = dO V^T for the tile and dl from the row statistics the
// backward already wrote, exactly as the dK/dV kernel reads them: the workspace p.rowstat (lse2,
// f delta and, adaptive, beta, lse_l2, H - lo_l ln 2, g f_l) and dO scaled by each row's recount
// factor f (lse_residual.h: the key-block kernels' dO, launch_impl.h key_block_params), so that
// 2^(beta l2 - lse2) (f dO V^T - f delta) is P' (dO V^T - delta) on recounted rows too. So: no
// atomics and no (B, H, L, S) buffer; each element written once, in a fixed summation order,
// hence bitwise equal across runs; and the dQ and dK/dV kernels are unchanged (no new switch, no
// new parameter), so every call without a learned mask runs exactly the kernels it did.
//
// Tile: the dQ kernel's (DqTraits: BM query rows, a 16-row strip per warp, BN keys), mma.sync on
// every architecture (sm_90 too: the kernel is paid by learned-bias training only), one
// (batch, head) pair at a time: Q, dO, K, V tiles copied, waited for, both GEMMs, the elementwise
// step. Every tile is checked (bounds, the band, the mask's own values); a tile outside the band
// (above the causal diagonal, beyond a window) is written as zeros without visiting any pair.
// Dense layout only (packed batches take no mask). A mask broadcast over rows or keys gets the
// gradient of the (Bm, Hm, L, S) mask it expands to, summed over those dims by the caller.
#pragma once

#include "bwd_kernel.h"
#include "score_gemm.h"

namespace ssa_flash {

// Whether a (rows [m0, m0 + bm), keys [n0, n0 + bn)) tile meets the band -win_left <= j - i <=
// win_right (params.h, set_band; causality folded in). Outside it, every dl is 0.
SSA_DEVICE bool tile_meets_band(const AttnShape& p, int m0, int bm, int n0, int bn) {
  return n0 - (m0 + bm - 1) <= p.win_right && (n0 + bn - 1) - m0 >= -p.win_left;
}

// grid (ceil(Lq / BM) * ceil(Lk / BN), dmask_heads, dmask_batch), Tr = DqTraits; shared memory
// mask_grad_smem_bytes (traits.h).
template <typename Tr, typename Score, bool kAdaptive, bool kCap = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1) attn_bwd_mask_grad_kernel(const MaskGradParams p) {
  SSA_TILE_NAMES(Tr);
  constexpr int kNT = kBlockN / 8;
  constexpr int kNStat = dkdv_stat_count(kAdaptive);
  if (never_launched(kernel_unsupported<T, kD>())) return;
  extern __shared__ uint4 smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kBlockM * kS;
  T* sK = sdO + kBlockM * kS;
  T* sV = sK + kBlockN * kS;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int num_n = (p.len_k + kBlockN - 1) / kBlockN;
  const int m0 = static_cast<int>(blockIdx.x / num_n) * kBlockM;
  const int n0 = static_cast<int>(blockIdx.x % num_n) * kBlockN;
  const int gh = blockIdx.y, gb = blockIdx.z;  // the gradient's (batch, head)
  const int r_lo = m0 + warp * 16 + Frag::row(lane);
  const int r_hi = r_lo + Frag::kHi;
  // the (batch, head) pairs folding onto (gb, gh): all batch elements / heads where broadcast
  const int nb = tile_meets_band(p, m0, kBlockM, n0, kBlockN) ? (p.dmask_batch == 1 ? p.batch : 1) : 0;
  const int nh = p.dmask_heads == 1 ? p.heads : 1;

  float acc[kNT][4];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;

#pragma unroll 1
  for (int ib = 0; ib < nb; ++ib) {  // fixed order: batch outer, head inner (deterministic)
    const int b = gb + ib;
#pragma unroll 1
    for (int ih = 0; ih < nh; ++ih) {
      const int h = gh + ih;
      const int hk = h / p.group;
      load_tile<kBlockM, kD, Pad, kNThreads>(sQ, static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh, p.q_sm, m0,
                                             p.len_q, p.dim, tid);
      load_tile<kBlockM, kD, Pad, kNThreads>(sdO, static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh, p.do_sm,
                                             m0, p.len_q, p.dim_v, tid);
      load_tile<kBlockN, kD, Pad, kNThreads>(sK, static_cast<const T*>(p.k) + b * p.k_sb + hk * p.k_sh, p.k_sm, n0,
                                             p.len_k, p.dim, tid);
      load_tile<kBlockN, kD, Pad, kNThreads>(sV, static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh, p.v_sm, n0,
                                             p.len_k, p.dim_v, tid);
      cp_async_commit();
      // the dropout flags of this thread's scores (dropout.h, as the dQ kernel), before the GEMMs
      const bool drop = p.drop_rng != nullptr;
      DropFlags keep;
      static_assert(kNT <= 16, "DropFlags: 16 tiles");
      if (drop) {
        const DropCtx dc = make_drop_ctx(p.drop_rng, p.drop_keep_below, b, h);
        keep.clear();
#pragma unroll 1
        for (int nt = 0; nt < kNT; ++nt) keep.set(nt, drop_tile_bits(dc, r_lo, n0 + Frag::col(lane, nt)));
      }
      cp_async_wait<0>();
      __syncthreads();  // the four tiles visible to every warp
      float s[1][kNT][4], dp[1][kNT][4];
      const LogitCtx ctx = Score::template setup<kCap>(p, b, h);
      // S = Q K^T, its checked base-2 logits l2 in place, dP = dO V^T. Up to D = 128 the logits
      // come before dP (one score tile live through each GEMM: with both GEMMs first the D = 128
      // instances spilled); at D = 256 after both (the other order spilled there).
      auto logits = [&]() {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            typename Score::Elem el;
            const float l2 = Score::logit(ctx, softcap_raw<kCap>(p, s[0][nt][i]), Score::mult(ctx, 1.0f), el);
            s[0][nt][i] = apply_mask(p, ctx, l2, i < 2 ? r_lo : r_hi, n0 + Frag::col(lane, nt) + (i & 1), kLog2e);
          }
        }
      };
      score_gemm<false, T, 1, kBlockN, kD, Pad, Pad, kS>(s, sQ, sQ + warp * 16 * kS, sK, lane);
      if constexpr (kD <= 128) logits();
      zero(dp);
      gemm_nt<T, 1, kBlockN, kD, kS, kS>(dp, sdO + warp * 16 * kS, sV, lane);
      if constexpr (kD > 128) logits();
      __syncthreads();  // every warp is done with the tiles (the next pair overwrites them)

      // (rows past len_q: the workspace's zeros, their logits -inf: dl = 0)
      const float* ws = p.rowstat + (static_cast<int64_t>(b) * p.heads + h) * p.stat_rows * kNStat;
      const RowStats st_lo = load_row_stats<kAdaptive>(ws + static_cast<int64_t>(r_lo) * kNStat);
      const RowStats st_hi = load_row_stats<kAdaptive>(ws + static_cast<int64_t>(r_hi) * kNStat);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float dpv = drop ? keep.apply(nt, i, dp[0][nt][i], p.drop_scale) : dp[0][nt][i];
          float pp;
          // (kResidual false: the residuals are in the workspace and the scaled dO, see above)
          acc[nt][i] += logit_grad<kAdaptive, true, true, false>(p, s[0][nt][i], dpv, i < 2 ? st_lo : st_hi, pp);
        }
      }
    }
  }

  float* out = p.dmask + (static_cast<int64_t>(gb) * p.dmask_heads + gh) * p.len_q * p.len_k;
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? r_lo : r_hi;
      const int col = n0 + Frag::col(lane, nt) + (i & 1);
      if (row < p.len_q && col < p.len_k) out[static_cast<int64_t>(row) * p.len_k + col] = acc[nt][i];
    }
  }
}

}  // namespace ssa_flash
