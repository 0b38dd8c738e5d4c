// The LSE's residual in the backward of calls with an additive mask (mask_kind == kMaskAdd).
//
// The backward forms its weights as P' = 2^(beta l2 - lse2) from the float32 LSE the forward
// stored. A finite mask can put a whole row at finfo.min-sized logits (a padding mask: mask.h
// saturates them at -2^100 beta in base 2); there lse2 = m + log2(sum) rounds to m (its ulp is
// 2^77), log2(sum) is lost, and the float LSE, converted to base 2, is off m by ulps of 2^77: every
// weight of such a row would be 0 or inf instead of 1 / n. So a call with an additive mask runs,
// before the dQ kernel (or the fused backward's pre-pass), attn_bwd_lse_recount_kernel: per query
// tile of the dQ kernel's shape, a vote on whether a row's |lse2| (or, adaptive, |lse_l2|) is at
// least kResidualFrom, and where one is, one sweep of S = Q K^T over the tile's key blocks
// (recount_rows) with the backward's own logits (score_grad's: the forward's may differ in their
// last bit, which at 2^100 is 2^77), giving each row's maximum m and sum = sum_j 2^(x_j - m), of
// the tempered row x = beta l2 (rounded once: mul_rn) and, adaptive, of l2. The pair
// (hi, lo) = (m, log2 sum) then replaces (lse2, 0), and every checked score of an additive-mask
// call forms its exponent as (x - hi) - lo (bwd_kernel.h, weight_exp2), x - hi small and exact for
// every weight that matters. The key-block kernels (dK, dV; the fused dQ) instead keep their
// plain exponent x - hi and take 2^-lo elsewhere (no value more, no code more, in their steps:
// with either, ptxas spilled them): P' = 2^(x - hi) f with f = 2^-lo a per-row factor, so
// dS' = P' (dO V^T - delta) = 2^(x - hi) ((f dO) V^T - f delta) and dV += P'^T dO = 2^(x - hi)^T (f dO):
// for an additive-mask call they read dO scaled by f, a copy the recount kernel writes
// (p.lse_lo's third section; the launcher points their p.dout at it, launch_impl.h), and f delta
// from the workspace, which the dQ kernel / pre-pass writes so for such calls; with the adaptive
// temperature P (of l) = 2^(l2 - hi_l) f_l and log2 P = (l2 - hi_l) - lo_l, so the entropy term
// g P (log P + H) is (g f_l) 2^(l2 - hi_l) ((l2 - hi_l) ln 2 + (H - lo_l ln 2)): g f_l and
// H - lo_l ln 2 in the workspace's g and entropy slots. f is 1 on every row not recounted (those
// rows' values exactly as without the copy); on a recounted one f dO is rounded to T once
// (float16: 2^-11 relative, bfloat16 2^-8, the size of dO's own rounding). A recount that differs from the given LSE by more than its rounding
// (kResidualTol, relative) means the keys seen are not the whole row (ring attention gives the
// kernels a shard of the keys and the whole row's LSE): that row keeps (lse2, 0). The same
// constants as ssa_flash/triton/lse_residual.py, the Triton backend's recount.
//
// A kernel of its own, launched for additive masks only (launch_impl.h, bwd_hdim): the dQ
// kernel, the pre-pass and the key-block kernels only read its pairs (p.lse_lo), in their
// prologue and checked steps, so the interior loops of every call are unchanged (inside the dQ
// kernel the recount moved its sm_90a interior loop off the uniform datapath, +44 instructions,
// and grew the plain pre-pass from 38 to 121 registers). Cost with a mask: one small launch, a
// vote per query tile without such rows, an S-only sweep of its keys per tile with one. On the
// device throughout: no host read of the LSE, and a captured CUDA graph replays it like any
// other kernel.
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
#include "smem_layout.h"
#include "tile_io.h"
#include "traits.h"

namespace ssa_flash {

// rows with |lse2| below this need no residual (its ulp, 2^-15, is below float32 noise)
constexpr float kResidualFrom = 256.0f;
// the largest difference between a recount and the given LSE, relative to |lse2|, that is the
// float32 LSE's rounding (beyond it: not the whole row, see above)
constexpr float kResidualTol = 9.5367431640625e-07f;  // 2^-20

SSA_DEVICE bool needs_residual(float lse2) { return fabsf(lse2) >= kResidualFrom; }

// A natural-log LSE in base 2; -inf (an empty row) becomes 0, so that 2^(-inf - lse2) is 0.
SSA_DEVICE float lse_to_base2(float lse) { return safe_max(lse * kLog2e); }

// One query row of the recount: its given LSEs in base 2 (lse2 of the tempered row, lse_l2 of l,
// adaptive only) and beta (1 without the adaptive temperature); recount_rows replaces (lse2, 0)
// by (hi, lo) in (lse2, lse2_lo), and (lse_l2, 0) in (lse_l2, lse_l2_lo).
struct RecountRow {
  float lse2, lse2_lo, beta, lse_l2, lse_l2_lo;
};

// p.lse_lo, three sections (params.h): at lse_pair_offset, row `row` (of all batch_head *
// stat_rows rows) as (hi, hi of l, lo, lo of l), four floats (a float4), read by the dQ kernel /
// pre-pass; at lse_scale_offset its dO factor f = 2^-lo; from scaled_do, dO times f as T,
// (B, H, stat_rows, kD) (rows up to len_q and columns up to dim_v written), read by the key-block
// kernels in place of dO (launch_impl.h, scaled_do_operand).
SSA_DEVICE int64_t lse_pair_offset(int64_t row) { return row * 4; }
template <typename P>
SSA_DEVICE int64_t lse_scale_offset(const P& p, int64_t row) {
  return static_cast<int64_t>(p.batch) * p.heads * p.stat_rows * 4 + row;
}
// (floats from p.lse_lo; host and device: the launcher points the key-block kernels at it)
constexpr int64_t scaled_do_offset(int64_t batch_heads, int64_t stat_rows) { return batch_heads * stat_rows * 5; }
template <typename T>
SSA_DEVICE T* scaled_do(const BwdParams& p) {
  return reinterpret_cast<T*>(p.lse_lo + scaled_do_offset(static_cast<int64_t>(p.batch) * p.heads, p.stat_rows));
}

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

// The recount of a query tile of the dQ kernel's shape: this thread's rows `row0` and
// row0 + Frag::kHi (st[0], st[1]), recounted over the tile's key blocks kb with the logits of
// score_grad (checked: bounds, the band, the additive mask), their pairs replaced where
// take_residual accepts them. sQ the Q tile (its copy committed), sK a K buffer, k the key head,
// the layouts LQ, LK as in the dQ kernel; each block copied and waited for (this path is rare). A
// sink (kSink) starts both rows, as in the forward. Every thread of the CTA calls it.
template <typename Tr, typename Score, bool kAdaptive, bool kCap, bool kSink, bool kWg, typename LQ, typename LK,
          typename KB, typename T>
SSA_DEVICE void recount_rows(const BwdParams& p, const LogitCtx& ctx, const KB& kb, const T* sQ, T* sK, const T* k,
                             int head, int row0, RecountRow (&st)[2], int tid) {
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kD = Tr::kHeadDim;
  constexpr int kS = Tr::kStride;
  constexpr int kNThreads = Tr::kNThreads;
  constexpr int kNT = kBlockN / 8;
  const int lane = tid & 31;
  const T* sQw = sQ + (tid >> 5) * 16 * kS;
  // (m, sum) of the tempered row x = beta l2 (t) and of l2 (u, adaptive only), this thread's share
  float mt[1][2], tt[1][2], mu[1][2], tu[1][2];
  init_row_state(mt, tt);
  init_row_state(mu, tu);
  if (kSink) {
    const float sink2 = sink_logit2<kSink>(p, head);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      init_row_sink(mt[0][hi], tt[0][hi], kAdaptive ? mul_rn(sink2, st[hi].beta) : sink2, Frag::rank(lane) == 0);
      init_row_sink(mu[0][hi], tu[0][hi], sink2, Frag::rank(lane) == 0);
    }
  }
  auto block = [&](int j) {
    const int n0 = j * kBlockN;
    load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, n0, p.len_k, p.dim, tid);
    cp_async_commit();
    cp_async_wait<0>();  // (and the Q tile, before the first block)
    if (kWg) fence_proxy_async();
    __syncthreads();  // K_j (and Q) visible to every warp
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
          xt[2 * nt + c] = kAdaptive ? mul_rn(l2, st[hi].beta) : l2;
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
    take_residual(st[hi].lse2, st[hi].lse2_lo, mt[0][hi], tt[0][hi]);
    if (kAdaptive) {
      quad_count(mu[0][hi], tu[0][hi]);
      take_residual(st[hi].lse_l2, st[hi].lse_l2_lo, mu[0][hi], tu[0][hi]);
    }
  }
}

// The recount kernel (see the top of this file): grid (ceil(Lq / BM), H, B) with the dQ kernel's
// tile Tr (DqTraits), shared memory for a Q and a K tile (dq_smem_bytes covers them). Writes every
// row of p.lse_lo up to stat_rows (lse_pair_offset, lse_scale_offset): the given LSEs in base 2
// with zero residuals (f = 1) where not recounted, zeros (f = 1) past len_q. kSink: the sink
// starts each recounted row.
template <typename Tr, typename Score, bool kAdaptive, bool kCap = false, bool kSink = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1) attn_bwd_lse_recount_kernel(const BwdParams p) {
  SSA_TILE_NAMES(Tr);
  constexpr bool kWg = SSA_FLASH_WGMMA && dq_wgmma(kD);
  using LQ = Select<kWg, Sw128Tile<kBlockM>, Pad>;
  using LK = Select<kWg, Sw128Tile<kBlockN>, Pad>;

  if (never_launched(kernel_unsupported<T, kD>())) return;
  extern __shared__ uint4 smem_raw[];
  T* sQ = kWg ? align_smem_1024<T>(smem_raw) : reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + LQ::elems(kBlockM, kD);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const BlockInfo blk = BlockInfo::query_tile(p, kBlockM);
  const int m0 = blk.row0;
  const int row0 = m0 + (tid >> 5) * 16 + Frag::row(lane);
  const int64_t stat0 = blk.batch_head(p) * p.len_q;
  RecountRow st[2];
  bool huge = false;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int r = row0 + hi * Frag::kHi;
    const bool ok = r < p.len_q;
    st[hi].lse2 = ok ? lse_to_base2(p.lse[stat0 + r]) : 0.0f;
    st[hi].beta = kAdaptive && ok ? p.beta[stat0 + r] : 1.0f;
    st[hi].lse_l2 = kAdaptive && ok ? lse_to_base2(p.lse_l[stat0 + r]) : 0.0f;
    st[hi].lse2_lo = st[hi].lse_l2_lo = 0.0f;
    huge = huge || needs_residual(st[hi].lse2) || (kAdaptive && needs_residual(st[hi].lse_l2));
  }
  if (__syncthreads_or(huge)) {  // (the CTA's branch)
    load_tile<kBlockM, kD, LQ, kNThreads>(sQ, blk.query_head<const T>(p.q, p.q_sb, p.q_sh), p.q_sm, m0, p.len_q,
                                          p.dim, tid);
    recount_rows<Tr, Score, kAdaptive, kCap, kSink, kWg, LQ, LK>(
        p, Score::template setup<kCap>(p, blk.batch, blk.head), key_blocks(p, m0, kBlockM, kBlockN, false), sQ, sK,
        blk.kv_head<const T>(p.k, p.k_sb, p.k_sh), blk.head, row0, st, tid);
  }
  if (Frag::rank(lane) == 0 && row0 < p.stat_rows) {  // (stat_rows is a multiple of 16)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float4 v;
      v.x = st[hi].lse2;
      v.y = st[hi].lse_l2;
      v.z = st[hi].lse2_lo;
      v.w = st[hi].lse_l2_lo;
      const int64_t row = blk.batch_head(p) * p.stat_rows + row0 + hi * Frag::kHi;
      *reinterpret_cast<float4*>(p.lse_lo + lse_pair_offset(row)) = v;
      p.lse_lo[lse_scale_offset(p, row)] = ex2(-v.z);
    }
  }
  // the scaled copy of the tile's dO rows (each factor written above, visible after the barrier)
  __syncthreads();
  constexpr int kChunks = kD / 8;  // 16-byte chunks of a row
  const int64_t srow0 = blk.batch_head(p) * p.stat_rows + m0;
  const T* dout = blk.query_head<const T>(p.dout, p.do_sb, p.do_sh);
  T* out = scaled_do<T>(p) + srow0 * kD;
#pragma unroll 1
  for (int i = tid; i < kBlockM * kChunks; i += kNThreads) {
    const int r = i / kChunks, col = (i % kChunks) * 8;
    if (m0 + r < p.len_q && col < p.dim_v) {
      const float f = p.lse_lo[lse_scale_offset(p, srow0 + r)];
      uint4 v = *reinterpret_cast<const uint4*>(dout + static_cast<int64_t>(m0 + r) * p.do_sm + col);
      if (f != 1.0f) {
        uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 x = unpack2<T>(w[e]);
          w[e] = pack2<T>(x.x * f, x.y * f);
        }
      }
      *reinterpret_cast<uint4*>(out + r * kD + col) = v;
    }
  }
}

}  // namespace ssa_flash
