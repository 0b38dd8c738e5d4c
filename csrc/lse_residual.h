// The LSE's residual in the backward of calls with an additive mask (mask_kind == kMaskAdd).
//
// The backward forms its weights as P' = 2^(beta l2 - lse2) from the float32 LSE the forward
// stored. A finite mask can put a whole row at finfo.min-sized logits (a padding mask: mask.h
// saturates them at -2^100 beta in base 2); there lse2 = m + log2(sum) rounds to m (its ulp is
// 2^77), log2(sum) is lost, and the float LSE, converted to base 2, is off m by ulps of 2^77: every
// weight of such a row would be 0 or inf instead of 1 / n. So the dQ kernel (or the fused
// backward's pre-pass), for a query tile with a row whose |lse2| (or, adaptive, |lse_l2|) is at
// least kResidualFrom, recounts its rows before anything reads their statistics: one sweep of
// S = Q K^T over the tile's key blocks (recount_rows), with the backward's own logits (score_grad's:
// the forward's may differ in their last bit, which at 2^100 is 2^77), giving each row's maximum m
// and sum = sum_j 2^(x_j - m), of the tempered row x = beta l2 (rounded once: mul_rn) and, adaptive,
// of l2. The pair (hi, lo) = (m, log2 sum) then replaces (lse2, 0): hi in the row-statistics
// workspace's lse slot, lo in p.lse_lo, and every checked score of an additive-mask call forms
// its exponent as (x - hi) - lo (bwd_kernel.h, weight_exp2), x - hi small and exact for every
// weight that matters. A recount that differs from the given LSE by more than its rounding
// (kResidualTol, relative) means the keys seen are not the whole row (ring attention gives the
// kernels a shard of the keys and the whole row's LSE): that row keeps (lse2, 0). The same
// constants as ssa_flash/triton/lse_residual.py, the Triton backend's recount.
//
// Cost: calls without an additive mask never enter it (a run-time branch in the dQ kernel's
// prologue; their interior loops are unchanged); with one, a query tile without such rows pays one
// vote, and one with them an S-only sweep of its keys (no dP, no dQ) and a float2 load per query
// row of each step in the key-block kernels. With the recount in the backward, a captured CUDA graph
// replays it like any other kernel: no host read of the LSE, no device synchronisation.
#pragma once

#include "block_info.h"
#include "fast_math.h"
#include "frag.h"
#include "kernel_head.h"
#include "logits.h"
#include "mask.h"
#include "memory.h"
#include "params.h"
#include "row_state.h"
#include "score_gemm.h"
#include "tile_io.h"

namespace ssa_flash {

// rows with |lse2| below this need no residual (its ulp, 2^-15, is below float32 noise)
constexpr float kResidualFrom = 256.0f;
// the largest difference between a recount and the given LSE, relative to |lse2|, that is the
// float32 LSE's rounding (beyond it: not the whole row, see above)
constexpr float kResidualTol = 9.5367431640625e-07f;  // 2^-20

SSA_DEVICE bool needs_residual(float lse2) { return fabsf(lse2) >= kResidualFrom; }

// The running (max m, sum of 2^(x - m)) of this thread's share of a row after the values x
// (-inf: inadmissible).
template <int kN>
SSA_DEVICE void count_row(float& m, float& sum, const float (&x)[kN]) {
  float mx = m;
#pragma unroll
  for (int i = 0; i < kN; ++i) mx = fmaxf(mx, x[i]);
  const float ms = safe_max(mx);
  float t = sum * ex2(m - ms);  // (m = -inf: sum is 0, ex2 gives 0)
#pragma unroll
  for (int i = 0; i < kN; ++i) t += ex2(x[i] - ms);
  m = mx;
  sum = t;
}

// The row's (m, sum) from the shares of the quad's 4 lanes.
SSA_DEVICE void quad_count(float& m, float& sum) {
  const float mq = quad_max(m);
  sum = quad_sum(sum * ex2(m - safe_max(mq)));
  m = mq;
}

// (hi, lo) = (m, log2 sum) in place of (lse2, 0) where the recount is the given LSE's row (see
// above); an empty row (sum 0) keeps its lse2.
SSA_DEVICE void take_residual(float& lse2, float& lo, float m, float sum) {
  const float l = sum > 0.0f ? log2f(sum) : 0.0f;
  if (sum > 0.0f && fabsf((m - lse2) + l) <= fabsf(lse2) * kResidualTol) {
    lse2 = m;
    lo = l;
  }
}

// The recount of the dQ kernel's query tile: this thread's rows `row0` and row0 + Frag::kHi, whose
// statistics (lse2, beta and, adaptive, lse_l2; R: bwd_kernel.h RowStats) are st_lo, st_hi,
// recounted over the tile's key blocks kb with the logits of score_grad (checked: bounds, the band,
// the additive mask), and their lse2 / lse2_lo (adaptive: lse_l2 / lse_l2_lo too) replaced by the
// recounted pairs where take_residual accepts them. sQ the Q tile (landed and visible), sK a K
// buffer (free; reused, each block copied and waited for: this path is rare), k the key head, and
// the tile's layouts as in the dQ kernel. A sink (kSink: the dQ kernel has one only with the
// adaptive temperature) starts both rows, as in the forward. Every thread of the CTA calls it.
template <typename Tr, typename Score, bool kAdaptive, bool kCap, bool kSink, bool kWg, typename LQ, typename LK,
          typename KB, typename T, typename R>
SSA_DEVICE void recount_rows(const BwdParams& p, const LogitCtx& ctx, const KB& kb, const T* sQ, T* sK, const T* k,
                             int head, int row0, R& st_lo, R& st_hi, int tid) {
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kD = Tr::kHeadDim;
  constexpr int kS = Tr::kStride;
  constexpr int kNThreads = Tr::kNThreads;
  constexpr int kNT = kBlockN / 8;
  const int lane = tid & 31;
  const T* sQw = sQ + (tid >> 5) * 16 * kS;
  R* const st[2] = {&st_lo, &st_hi};
  // (m, sum) of the tempered row x = beta l2 (t) and of l2 (u, adaptive only), this thread's share
  float mt[1][2], tt[1][2], mu[1][2], tu[1][2];
  init_row_state(mt, tt);
  init_row_state(mu, tu);
  if (kSink) {
    const float sink2 = sink_logit2<kSink>(p, head);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      init_row_sink(mt[0][hi], tt[0][hi], kAdaptive ? mul_rn(sink2, st[hi]->beta) : sink2, Frag::rank(lane) == 0);
      init_row_sink(mu[0][hi], tu[0][hi], sink2, Frag::rank(lane) == 0);
    }
  }
  auto block = [&](int j) {
    const int n0 = j * kBlockN;
    load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, n0, p.len_k, p.dim, tid);
    cp_async_commit();
    cp_async_wait<0>();
    if (kWg) fence_proxy_async();
    __syncthreads();  // K_j visible to every warp
    float s[1][kNT][4];
    score_gemm<kWg, T, 1, kBlockN, kD, LQ, LK, kS>(s, sQ, sQw, sK, lane);
    __syncthreads();  // every warp is done with K_j
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float xt[2 * kNT], xu[2 * kNT];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          typename Score::Elem el;
          float l2 = Score::logit(ctx, softcap_raw<kCap>(p, s[0][nt][2 * hi + c]), Score::mult(ctx, 1.0f), el);
          l2 = apply_mask(p, ctx, l2, row0 + hi * Frag::kHi, n0 + Frag::col(lane, nt) + c, kLog2e);
          xu[2 * nt + c] = l2;
          xt[2 * nt + c] = kAdaptive ? mul_rn(l2, st[hi]->beta) : l2;
        }
      }
      count_row(mt[0][hi], tt[0][hi], xt);
      if (kAdaptive) count_row(mu[0][hi], tu[0][hi], xu);
    }
  };
  for (int j = kb.a; j < kb.n_int; ++j) block(j);  // (none: a mask makes every block checked)
  kb.each_checked([&](int j, int) { block(j); });
  cp_async_wait<0>();
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    quad_count(mt[0][hi], tt[0][hi]);
    take_residual(st[hi]->lse2, st[hi]->lse2_lo, mt[0][hi], tt[0][hi]);
    if (kAdaptive) {
      quad_count(mu[0][hi], tu[0][hi]);
      take_residual(st[hi]->lse_l2, st[hi]->lse_l2_lo, mu[0][hi], tu[0][hi]);
    }
  }
}

}  // namespace ssa_flash
