// Backward kernels (docs/design.md sections 1.2 and 1.3). Two paths, chosen per call by the host (launch.h,
// BwdPlan):
//
// Two kernels, no atomics (bitwise reproducible; deterministic=True, D = 256, and where the fused
// kernel spills: traits.h, bwd_fused_for):
// 1. attn_bwd_dq_kernel, grid (ceil(Lq / BM), H, B), one CTA per query block: delta =
//    rowsum(dO * O) - dlse and the adaptive-temperature row gradient g (into the row-statistics
//    workspace), dQ, and per-block partial sums of the score function's parameter gradients
//    (reduced in a fixed order on the host side: deterministic).
// 2. attn_bwd_dkdv_kernel, grid (ceil(Lk / BN), Hkv, B), one CTA per key block of a key/value
//    head: dK, dV, looping over the query heads of its GQA group and their query blocks.
// Seven GEMMs per tile (S, dP, dQ; S^T, dP^T, dV, dK), nine with the adaptive temperature.
//
// Fused (deterministic=False, D <= 128; traits.h, bwd_fused_for): the dQ kernel as a pre-pass
// (kPrep: the row statistics, and with the adaptive temperature g, whose dbeta needs whole rows),
// then attn_bwd_fused_kernel: FlashAttention-2's five GEMMs per tile, dQ added with fp32
// atomics, the parameter gradients (SSA's db / dn) as per-(key block, warp) partial sums.
//
// Per tile, with S' = beta * l and P' = softmax(S') the output weights (base-2 units inside):
//     dS'  = P' * (dO V^T - delta)
//     dl   = beta * dS' - g * P * (log P + H)          (g = 0, beta = 1 without ADAPTIVE)
//     dz   = dl * phi'(z)   (logits.h, Score::grad: SSA n b / (1 + b|z|), softmax 1)
//     dQ   = scale dz K,  dK = scale dz^T Q,  dV = P'^T dO
//     dtheta = sum dl dphi/dtheta for each parameter theta of phi (SSA: db, dn), as partial sums
// g_i = dbeta_i * dbeta/dH_i needs dbeta_i = sum_j dS'_ij l_ij over the whole row before any dl:
// with ADAPTIVE the dQ kernel makes a first pass over the keys (S and dP only) for dbeta, then
// the main pass with g known. (The Triton kernel instead keeps a second dQ accumulator; in CUDA
// registers are the scarce resource, so the extra pass is the cheaper choice.) dbeta is summed
// centred, sum_j dS'_ij (l_ij - c_i) + c_i dlse_i (equal, as sum_j dS'_ij = dlse_i): the plain
// sum's terms are the size of the logits and cancel, turning rounding in P' into an error of the
// logits' size times it (docs/maths.md). Here c_i = lse'_i / beta_i (the LSE of S' in l's units,
// a few units from lse^l, the Triton kernel's choice), so that each term is dS' times the
// exponent P' is formed from, beta l - lse', over beta: no instruction more per score.
#pragma once

#include "block_info.h"
#include "compile_time.h"
#include "dropout.h"
#include "elem.h"
#include "fast_math.h"
#include "frag.h"
#include "gemm_mma.h"
#include "gemm_wgmma.h"
#include "kernel_head.h"
#include "logits.h"
#include "lse_residual.h"
#include "mask.h"
#include "memory.h"
#include "params.h"
#include "smem_layout.h"
#include "tile_io.h"
#include "traits.h"

namespace ssa_flash {

// The per-row statistics of the backward, in the workspace p.rowstat (B, H, stat_rows, n) the
// dQ kernel (or the pre-pass) writes and the dK/dV kernel copies per query tile: n = 2 (lse in
// base 2, delta) or 6 with the adaptive temperature (beta, lse of l in base 2, entropy, g). Rows
// from len_q up to the end of the dQ kernel's last tile hold zeros (beta 1): their scores then
// give zero gradients without any bounds check (Q and dO are zero-filled there too).
enum RowStat : int { kLse = 0, kDelta = 1, kBeta = 2, kLseL = 3, kEnt = 4, kG = 5 };

// Statistics of one query row, as the gradient of a score needs them.
struct RowStats {
  float lse2;    // LSE of S' in base 2, 0 for empty rows
  float delta;
  float beta;    // adaptive only
  float lse_l2;  // LSE of l in base 2, 0 for empty rows (adaptive only)
  float ent;     // entropy of softmax(l) (adaptive only)
  float g;       // dbeta * dbeta/dH (adaptive only, main pass)
  // additive masks: the residuals of lse2 and lse_l2 (lse_residual.h; 0 where not recounted),
  // read by the checked scores of such calls only (weight_exp2)
  float lse2_lo;
  float lse_l2_lo;
};

// The base-2 exponent of P'_ij, beta l2 - lse2 (beta = 1 without kAdaptive), for a row's
// statistics r. Checked scores of an additive-mask call (kResidual: in the dQ kernel / pre-pass;
// the key-block kernels take 2^-lo as a factor instead, lse_residual.h): (beta l2 - hi) - lo, the
// recounted pair with beta l2 rounded as the recount rounded it (lse_residual.h; hi = lse2,
// lo = 0 where the float LSE serves); every other score as before.
template <bool kAdaptive, bool kResidual, typename P>
SSA_DEVICE float weight_exp2(const P& p, float l2, const RowStats& r) {
  if (kResidual && p.mask_kind == kMaskAdd) return ((kAdaptive ? mul_rn(l2, r.beta) : l2) - r.lse2) - r.lse2_lo;
  return kAdaptive ? fmaf(l2, r.beta, -r.lse2) : l2 - r.lse2;
}

// The statistics of one query row from a step's copy of the workspace (its kNStat floats, RowStat
// order; 8-byte aligned): the key-block kernels' (and the sm_90a backward's) per-query read.
template <bool kAdaptive>
SSA_DEVICE RowStats load_row_stats(const float* st) {
  RowStats r;
  const float2 ld = *reinterpret_cast<const float2*>(st);
  r.lse2 = ld.x;
  r.delta = ld.y;
  if (kAdaptive) {
    const float2 bl = *reinterpret_cast<const float2*>(st + kBeta);
    const float2 eg = *reinterpret_cast<const float2*>(st + kEnt);
    r.beta = bl.x;
    r.lse_l2 = bl.y;
    r.ent = eg.x;
    r.g = eg.y;
  } else {
    r.beta = 1.0f;
    r.lse_l2 = r.ent = r.g = 0.0f;
  }
  return r;
}

// The logit gradient dl of one score (the gradient with respect to l = phi(z) + mask, natural
// units: what a learned additive mask's element receives, mask_grad.h) from its checked base-2
// logit l2; sets p_out = P'_ij. kCheck: l2 may be -inf (an inadmissible key: the entropy term is
// 0 there); kMaskable, kResidual as in score_grad below.
template <bool kAdaptive, bool kCheck, bool kMaskable, bool kResidual, typename P>
SSA_DEVICE float logit_grad(const P& p, float l2, float dp, const RowStats& r, float& p_out) {
  const float pp = ex2(weight_exp2<kAdaptive, kCheck && kMaskable && kResidual>(p, l2, r));
  p_out = pp;
  float dl = pp * (dp - r.delta);
  if (kAdaptive) {
    float ent_term;
    if (kCheck) {
      const bool adm = l2 != neg_inf();
      // (additive masks: log2 P of l from the recounted pair, as weight_exp2)
      const float lp2 =
          adm ? (kResidual && p.mask_kind == kMaskAdd ? (l2 - r.lse_l2) - r.lse_l2_lo : l2 - r.lse_l2) : 0.0f;
      ent_term = adm ? ex2(lp2) * fmaf(lp2, kLn2, r.ent) : 0.0f;
    } else {
      const float lp2 = l2 - r.lse_l2;
      ent_term = ex2(lp2) * fmaf(lp2, kLn2, r.ent);
    }
    dl = dl * r.beta - r.g * ent_term;
  }
  return dl;
}

// Main-pass gradient of one score: sets p_out = P'_ij and returns dz (the gradient with
// respect to z / scale's dot product, before the final scale), accumulating the score
// function's parameter terms in dpar0, dpar1 (logits.h, Score::grad; per-head factors applied once
// at the end, Score::dparam_factor). kCheck: bounds, causality, windows and masks (see apply_mask;
// kBand false: no window).
// Dropout: the caller passes dp already multiplied by the weight's dropout factor z (1 / (1 - p)
// kept, 0 dropped): the forward used z P' V, so dP' = z dO V^T (and dV takes z P'; delta =
// rowsum(dO O) already is the dropped output's).
// kCap: s is the raw dot product, soft-capped here (logits.h, softcap_raw: th, the capped score in
// units of cap_out, which ctx holds) before the transform; the parameter terms sum over th
// (cap_out applied with the partial) and dz takes the extra factor 1 - th^2 (docs/maths.md
// section 6.1). kMaskable = false: the call has no mask (apply_mask). kResidual = false: an
// additive mask's recounted residuals are not in the exponents (the key-block kernels, whose
// statistics and dO carry them: lse_residual.h).
template <typename Score, bool kAdaptive, bool kCheck, bool kBand = true, bool kCap = false, bool kMaskable = true,
          bool kResidual = true, typename P>
SSA_DEVICE float score_grad(const P& p, const LogitCtx& ctx, float s_raw, float dp, int row, int col,
                            const RowStats& r, float& p_out, float& dpar0, float& dpar1) {
  typename Score::Elem el;
  const float s = softcap_raw<kCap>(p, s_raw);  // (th with kCap)
  float l2 = Score::logit(ctx, s, Score::mult(ctx, 1.0f), el);
  if (kCheck) l2 = apply_mask<kBand, kMaskable>(p, ctx, l2, row, col, kLog2e);
  float dl = logit_grad<kAdaptive, kCheck, kMaskable, kResidual>(p, l2, dp, r, p_out);
  dl = Score::grad(ctx, dl, s, el, dpar0, dpar1);
  return softcap_grad<kCap>(dl, s);
}

// dbeta pass: dS'_ij * (beta l_ij - lse'_i) (base-2 units; the caller divides the row's sum by
// beta and multiplies by ln 2: the centred sum, see the top of this file), 0 where the key is not
// admissible; dp as in score_grad.
template <typename Score, bool kCheck, bool kBand = true, bool kCap = false, typename P>
SSA_DEVICE float dbeta_term(const P& p, const LogitCtx& ctx, float s, float dp, int row, int col,
                            const RowStats& r) {
  typename Score::Elem el;
  float l2 = Score::logit(ctx, softcap_raw<kCap>(p, s), Score::mult(ctx, 1.0f), el);
  if (kCheck) {
    l2 = apply_mask<kBand>(p, ctx, l2, row, col, kLog2e);
    if (l2 == neg_inf()) return 0.0f;
  }
  const float e = weight_exp2<true, kCheck>(p, l2, r);
  return ex2(e) * (dp - r.delta) * e;
}

// The two score GEMMs of a step, s = A_s B_s^T and dp = A_p B_p^T (S and dP in the dQ kernel,
// S^T and dP^T in the key-block kernels), kN columns over a kD reduction: wgmma over the
// warpgroup's 64 rows (A: the whole tiles; one group, waited for at once) or mma.sync over this
// warp's 16-row strip (A: the strip's rows; kS the padded row stride).
template <bool kWg, typename T, int kN, int kD, typename LA, typename LB, int kS>
SSA_DEVICE void score_gemms(float (&s)[1][kN / 8][4], float (&dp)[1][kN / 8][4], const T* sAs, const T* sBs,
                            const T* sAp, const T* sBp, int lane) {
  if constexpr (kWg) {
    wg_gemm_nt<T, kN, kD, LA, LB>(s[0], sAs, sBs);
    wg_gemm_nt<T, kN, kD, LA, LB>(dp[0], sAp, sBp);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s[0]);
    wgmma_fence_operand(dp[0]);
  } else {
    zero(s);
    zero(dp);
    gemm_nt<T, 1, kN, kD, kS, kS>(s, sAs, sBs, lane);
    gemm_nt<T, 1, kN, kD, kS, kS>(dp, sAp, sBp, lane);
  }
}

// ------------------------------------------------------------------------------------------
// dQ kernel. Pipeline per key block j (K double-buffered, V single):
//   issue K_{j+1} | wait K_j, V_j | S = Q K_j^T, dP = dO V_j^T | elementwise | issue V_{j+1} |
//   dQ += dS K_j
// On sm_90a at the head dims of dq_wgmma (traits.h) the three GEMMs are wgmma: the CTA's 4 warps
// are one warpgroup and its 64 query rows one m64 tile; Q, dO, K, V sit in shared memory in the
// 128-byte swizzled layout (Sw128Tile) and feed the tensor cores through descriptors (K also as
// the N-major B operand of dQ = dS K), dS from registers. Each group is waited for at once, so
// the step's structure (and every barrier) is the mma.sync one's.
//
// kPrep: the pre-pass of the fused backward instead (attn_bwd_fused_kernel): the row statistics
// (delta), and with ADAPTIVE the dbeta pass and g; no dQ, no parameter gradients.
// kCap: soft-capping (score_grad); kSink (adaptive only): the sink's term of dbeta,
// dS'_sink (s_h - c) = -P'_sink delta (s_h - c) (docs/maths.md section 6.2; c the centre of the
// sum, see the top of this file), added once per row after the dbeta pass. Without an adaptive
// temperature a sink needs nothing here: the forward's lse includes it.
template <typename Tr, typename Score, bool kAdaptive, bool kPrep = false, bool kCap = false, bool kSink = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1) attn_bwd_dq_kernel(const BwdParams p) {
  SSA_TILE_NAMES(Tr);
  constexpr int kNWarps = Tr::kNWarps;
  constexpr int kNT = kBlockN / 8;
  constexpr int kDT = kD / 8;
  constexpr bool kWg = SSA_FLASH_WGMMA && dq_wgmma(kD);
  static_assert(!kWg || (kBlockM == 64 && kNWarps == 4), "wgmma: the query tile is one warpgroup's m64");
  using LQ = Select<kWg, Sw128Tile<kBlockM>, Pad>;  // Q, dO tiles
  using LK = Select<kWg, Sw128Tile<kBlockN>, Pad>;  // K, V tiles
  constexpr int kTileQ = LQ::elems(kBlockM, kD), kTileK = LK::elems(kBlockN, kD);

  if (never_launched(kernel_unsupported<T, kD>())) return;
  extern __shared__ uint4 smem_raw[];
  T* sQ = kWg ? align_smem_1024<T>(smem_raw) : reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + kTileQ;
  T* sK = sdO + kTileQ;  // two buffers
  T* sV = sK + 2 * kTileK;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  T* scratch = sV + kTileK + warp * gemm_rn_scratch_elems<1, kBlockN>();
  const BlockInfo blk = BlockInfo::query_tile(p, kBlockM);
  const int m0 = blk.row0;

  // (inline, not BlockInfo::query_head / kv_head: through the calls these five reached ptxas in
  // another order)
  const T* q = static_cast<const T*>(p.q) + blk.batch * p.q_sb + blk.head * p.q_sh;
  const T* k = static_cast<const T*>(p.k) + blk.batch * p.k_sb + blk.head_kv * p.k_sh;
  const T* v = static_cast<const T*>(p.v) + blk.batch * p.v_sb + blk.head_kv * p.v_sh;
  const T* o = static_cast<const T*>(p.o) + blk.batch * p.o_sb + blk.head * p.o_sh;
  const T* dout = static_cast<const T*>(p.dout) + blk.batch * p.do_sb + blk.head * p.do_sh;
  const LogitCtx ctx = Score::template setup<kCap>(p, blk.batch, blk.head);
  const int64_t stat0 = blk.batch_head(p) * p.len_q;
  const int r_lo = m0 + warp * 16 + Frag::row(lane);
  const int r_hi = r_lo + Frag::kHi;
  const bool ok_lo = r_lo < p.len_q, ok_hi = r_hi < p.len_q;

  if (!kPrep || kAdaptive) load_tile<kBlockM, kD, LQ, kNThreads>(sQ, q, p.q_sm, m0, p.len_q, p.dim, tid);
  load_tile<kBlockM, kD, LQ, kNThreads>(sdO, dout, p.do_sm, m0, p.len_q, p.dim_v, tid);
  cp_async_commit();

  // Row statistics of this thread's two rows.
  RowStats st_lo{}, st_hi{};
  st_lo.beta = st_hi.beta = 1.0f;
  st_lo.lse2 = ok_lo ? lse_to_base2(p.lse[stat0 + r_lo]) : 0.0f;
  st_hi.lse2 = ok_hi ? lse_to_base2(p.lse[stat0 + r_hi]) : 0.0f;
  float dbdh_lo = 0.0f, dbdh_hi = 0.0f;
  if (kAdaptive) {
    if (ok_lo) {
      st_lo.beta = p.beta[stat0 + r_lo];
      st_lo.lse_l2 = lse_to_base2(p.lse_l[stat0 + r_lo]);
      st_lo.ent = p.entropy[stat0 + r_lo];
      dbdh_lo = p.dbeta_dh[stat0 + r_lo] * kLn2 / st_lo.beta;  // (the dbeta pass: beta dbeta / ln 2)
    }
    if (ok_hi) {
      st_hi.beta = p.beta[stat0 + r_hi];
      st_hi.lse_l2 = lse_to_base2(p.lse_l[stat0 + r_hi]);
      st_hi.ent = p.entropy[stat0 + r_hi];
      dbdh_hi = p.dbeta_dh[stat0 + r_hi] * kLn2 / st_hi.beta;
    }
  }

  cp_async_wait<0>();
  if (kWg) fence_proxy_async();  // (wgmma reads the tiles through the async proxy)
  __syncthreads();

  // delta = rowsum(dO * O) - dlse: the 4 lanes of a row split its columns in chunks of 8.
  float dlse_lo = 0.0f, dlse_hi = 0.0f;
  {
    const int lr = warp * 16 + Frag::row(lane);
    float d_lo = 0.0f, d_hi = 0.0f;
    for (int c = Frag::rank(lane) * 8; c < p.dim_v; c += 32) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = half ? r_hi : r_lo;
        if (row >= p.len_q) continue;
        const uint4 ov = *reinterpret_cast<const uint4*>(o + row * p.o_sm + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(sdO + LQ::offset(lr + Frag::kHi * half, c));
        const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w};
        const uint32_t dw[4] = {dv.x, dv.y, dv.z, dv.w};
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float2 a = unpack2<T>(ow[w]);
          const float2 b = unpack2<T>(dw[w]);
          acc += a.x * b.x + a.y * b.y;
        }
        if (half) d_hi += acc;
        else d_lo += acc;
      }
    }
    d_lo = quad_sum(d_lo);
    d_hi = quad_sum(d_hi);
    if (p.dlse != nullptr) {
      if (ok_lo) dlse_lo = p.dlse[stat0 + r_lo];
      if (ok_hi) dlse_hi = p.dlse[stat0 + r_hi];
      d_lo -= dlse_lo;
      d_hi -= dlse_hi;
    }
    st_lo.delta = d_lo;
    st_hi.delta = d_hi;
  }
  // Additive masks: the pairs of the recount kernel (lse_residual.h), in place of the LSEs
  if (p.mask_kind == kMaskAdd && r_lo < p.stat_rows) {  // (stat_rows: a multiple of 16)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      RowStats& st = half ? st_hi : st_lo;
      const float4 v = *reinterpret_cast<const float4*>(
          p.lse_lo + lse_pair_offset(blk.batch_head(p) * p.stat_rows + r_lo + half * Frag::kHi));
      st.lse2 = v.x;
      st.lse_l2 = v.y;
      st.lse2_lo = v.z;
      st.lse_l2_lo = v.w;
    }
  }
  // this thread's rows in the workspace (written by the rank-0 lane of each row; rows past len_q
  // get their zeros too). g is written after the dbeta pass.
  constexpr int kNStat = dkdv_stat_count(kAdaptive);
  float* ws_lo = p.rowstat + (blk.batch_head(p) * p.stat_rows + r_lo) * kNStat;
  float* ws_hi = ws_lo + Frag::kHi * kNStat;
  const bool write_ws = Frag::rank(lane) == 0 && r_lo < p.stat_rows;  // (stat_rows is a multiple of 16)
  if (write_ws) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const RowStats& st = half ? st_hi : st_lo;
      float* ws = half ? ws_hi : ws_lo;
      // (additive masks: the key-block kernels' delta and entropy take the recounted residuals,
      // lse_residual.h: f delta with f = 2^-lo, H - lo_l ln 2)
      const bool add = p.mask_kind == kMaskAdd;
      ws[kLse] = st.lse2;
      ws[kDelta] = add ? st.delta * ex2(-st.lse2_lo) : st.delta;
      if (kAdaptive) {
        ws[kBeta] = st.beta;
        ws[kLseL] = st.lse_l2;
        ws[kEnt] = add ? fmaf(-st.lse_l2_lo, kLn2, st.ent) : st.ent;
        // the offset of dbeta's centred sum (the dbeta pass adds it and overwrites it with g;
        // kept here, not in registers through the pass: the SSA kernel at D = 64 has none to
        // spare on sm_90a)
        ws[kG] = (st.lse2 + st.lse2_lo) * (half ? dlse_hi : dlse_lo);
      }
    }
  }

  if (kPrep && !kAdaptive) return;  // (the pre-pass needs delta only)

  // The key blocks and their order (block_info.h, key_blocks). Interior steps copy the next K / V
  // block through running pointers (TileStream: one pointer add per 16-byte copy, where
  // load_tile recomputed row * stride products and predicates: about 4 integer instructions per
  // score element at D = 64). Not at D = 256 (two streams' registers spilled the SSA+adaptive
  // kernel on sm_90a; with 16-key blocks the copies are a small part of the step there).
  constexpr bool kAsync = SSA_FLASH_ASYNC_COPIES && kD <= 128;
  const auto kb = key_blocks(p, m0, kBlockM, kBlockN, kAsync);
  const T* sQw = sQ + warp * 16 * kS;
  const T* sdOw = sdO + warp * 16 * kS;

  float dq_acc[1][kDT][4];
  zero(dq_acc);
  // the parameters' partial sums (Score::grad; two scalars, not an array: as scalars the SSA
  // kernels compile to the PTX they had with db / dn, an array reordered it)
  static_assert(kMaxScoreParams == 2, "dpar0, dpar1");
  float dpar0 = 0.0f, dpar1 = 0.0f;

  // pass 0 (ADAPTIVE only): dbeta and g; pass 1: dQ and the parameter sums (not in the pre-pass)
  for (int pass = kAdaptive ? 0 : 1; pass < (kPrep ? 1 : 2); ++pass) {
    float dbeta_lo = 0.0f, dbeta_hi = 0.0f;
    const int first = kb.first();
    load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, first * kBlockN, p.len_k, p.dim, tid);
    load_tile<kBlockN, kD, LK, kNThreads>(sV, v, p.v_sm, first * kBlockN, p.len_k, p.dim_v, tid);
    cp_async_commit();
    // the interior blocks' next K / V (unused without interior blocks)
    TileStream<kBlockN, kD, LK, kNThreads, T> k_stream, v_stream;
    k_stream.init(k, p.k_sm, (kb.a + 1) * kBlockN, p.dim, tid);
    v_stream.init(v, p.v_sm, (kb.a + 1) * kBlockN, p.dim_v, tid);
    // Step `it` of the order (block_info.h KeyBlocks) runs key block j from K buffer it & 1 (the
    // prologue filled buffer 0). (A buffer flag toggled per step instead moved the sm_90a
    // descriptors' arithmetic off the uniform datapath: +44 instructions per interior step.)
    auto step = [&](int j, int it, auto check) {
      constexpr bool kCheck = decltype(check)::value;
      const int n0 = j * kBlockN;
      const bool has_next = it + 1 < kb.steps();
      const int buf = it & 1;
      const T* sKj = sK + buf * kTileK;
      if (has_next) {
        T* dst = sK + (buf ^ 1) * kTileK;
        if (kCheck || !kAsync) load_tile<kBlockN, kD, LK, kNThreads>(dst, k, p.k_sm, kb.next(j) * kBlockN, p.len_k, p.dim, tid);
        else k_stream.issue(dst, tid);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      if (kWg) fence_proxy_async();
      __syncthreads();  // K_j, V_j visible to every warp

      // dropout flags (checked steps: a dropout call has no interior ones), evaluated before the
      // scores are live (dropout.h, drop_tile_bits)
      const bool drop = kCheck && p.drop_rng != nullptr;
      DropFlags keep;
      static_assert(kNT <= 16, "DropFlags: 16 tiles");
      if (drop) {
        const DropCtx dc = make_drop_ctx(p.drop_rng, p.drop_keep_below, blk.batch, blk.head);
        keep.clear();
#pragma unroll 1
        for (int nt = 0; nt < kNT; ++nt) keep.set(nt, drop_tile_bits(dc, r_lo, n0 + Frag::col(lane, nt)));
      }

      float s[1][kNT][4], dp[1][kNT][4];
      score_gemms<kWg, T, kBlockN, kD, LQ, LK, kS>(s, dp, kWg ? sQ : sQw, sKj, kWg ? sdO : sdOw, sV, lane);

      // dropout: dP' = z dO V^T (z = 1 / (1 - p) kept, 0 dropped)
      if (drop) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) dp[0][nt][i] = keep.apply(nt, i, dp[0][nt][i], p.drop_scale);
      }
      if (kAdaptive && pass == 0) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int col = n0 + Frag::col(lane, nt) + (i & 1);
            if (i < 2) dbeta_lo += dbeta_term<Score, kCheck, true, kCap>(p, ctx, s[0][nt][i], dp[0][nt][i], r_lo, col, st_lo);
            else dbeta_hi += dbeta_term<Score, kCheck, true, kCap>(p, ctx, s[0][nt][i], dp[0][nt][i], r_hi, col, st_hi);
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int col = n0 + Frag::col(lane, nt) + (i & 1);
            float pp;
            s[0][nt][i] = score_grad<Score, kAdaptive, kCheck, true, kCap>(p, ctx, s[0][nt][i], dp[0][nt][i], i < 2 ? r_lo : r_hi,
                                                               col, i < 2 ? st_lo : st_hi, pp, dpar0, dpar1);
          }
        }
      }

      __syncthreads();  // every warp is done with V_j
      if (has_next) {
        if (kCheck || !kAsync) load_tile<kBlockN, kD, LK, kNThreads>(sV, v, p.v_sm, kb.next(j) * kBlockN, p.len_k, p.dim_v, tid);
        else v_stream.issue(sV, tid);
        cp_async_commit();
      }
      if (!kAdaptive || pass == 1) {
        uint32_t da[1][kBlockN / 16][4];
        acc_to_frag<T, kBlockN>(da[0], s[0]);
        if constexpr (kWg) {
          wg_gemm_rn<T, kD, kBlockN, LK>(dq_acc[0], da[0], sKj);
          wgmma_commit();
          wgmma_wait<0>();
          wgmma_fence_operand(dq_acc[0]);
        } else {
          gemm_rn<T, 1, kD, kBlockN, Pad>(dq_acc, da, sKj, 0, lane, scratch);
        }
      }
      __syncthreads();  // every warp is done with K_j
    };
    for (int j = kb.a; j < kb.n_int; ++j) step(j, j - kb.a, Bool<false>());
    kb.each_checked([&](int j, int it) { step(j, it, Bool<true>()); });
    cp_async_wait<0>();  // (a window can leave a query block no keys: the prologue's copies)

    if (kAdaptive && pass == 0) {
      // In the exponents' units, beta dbeta / ln 2 = sum_j dS'_ij (beta l2_ij - lse2_i) +
      // dS'_sink (beta s2 - lse2_i) + lse2_i dlse_i (top of this file: c = lse' / beta); dbdh
      // carries the ln 2 / beta. The offset, from the workspace, before the quad sum: once per row.
      if (write_ws) {
        dbeta_lo += ws_lo[kG];
        dbeta_hi += ws_hi[kG];
      }
      dbeta_lo = quad_sum(dbeta_lo);
      dbeta_hi = quad_sum(dbeta_hi);
      if (kSink) {  // (rows past len_q have delta 0)
        const float sink2 = p.sinks[blk.head] * kLog2e;
        if (sink2 != neg_inf()) {
          const float e_lo = weight_exp2<true, true>(p, sink2, st_lo);
          const float e_hi = weight_exp2<true, true>(p, sink2, st_hi);
          dbeta_lo -= ex2(e_lo) * st_lo.delta * e_lo;
          dbeta_hi -= ex2(e_hi) * st_hi.delta * e_hi;
        }
      }
      st_lo.g = dbeta_lo * dbdh_lo;
      st_hi.g = dbeta_hi * dbdh_hi;
      if (write_ws) {  // (additive masks: g f_l for the key-block kernels, lse_residual.h)
        const bool add = p.mask_kind == kMaskAdd;
        ws_lo[kG] = add ? st_lo.g * ex2(-st_lo.lse_l2_lo) : st_lo.g;
        ws_hi[kG] = add ? st_hi.g * ex2(-st_hi.lse_l2_lo) : st_hi.g;
      }
    }
  }

  if (kPrep) return;

  // dQ
  T* dq = static_cast<T*>(p.dq) + blk.batch * p.dq_sb + blk.head * p.dq_sh;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    const int col = Frag::col(lane, dt);
    if (col < p.dim) {
      if (ok_lo)
        *reinterpret_cast<uint32_t*>(dq + r_lo * p.dq_sm + col) =
            pack2<T>(dq_acc[0][dt][0] * p.scale, dq_acc[0][dt][1] * p.scale);
      if (ok_hi)
        *reinterpret_cast<uint32_t*>(dq + r_hi * p.dq_sm + col) =
            pack2<T>(dq_acc[0][dt][2] * p.scale, dq_acc[0][dt][3] * p.scale);
    }
  }

  // the parameters' partials of this block: warp sums, then warps in order (deterministic). The
  // sums go through the (no longer used) Q tile: the last loop iteration ended with a barrier.
  constexpr int kNPar = Score::kParams;
  if (kNPar > 0) {
    float* s_red = reinterpret_cast<float*>(sQ);  // [kNPar][kNWarps]
    dpar0 = warp_sum(dpar0);
    if (kNPar > 1) dpar1 = warp_sum(dpar1);
    if (lane == 0) {
      s_red[warp] = dpar0;
      if (kNPar > 1) s_red[kNWarps + warp] = dpar1;
    }
    __syncthreads();
    if (tid == 0) {
      float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
      for (int w = 0; w < kNWarps; ++w) {
        sum0 += s_red[w];
        if (kNPar > 1) sum1 += s_red[kNWarps + w];
      }
      const int64_t idx = blk.batch_head(p) * gridDim.x + blk.block;
      p.dparam_part0[idx] = sum0 * Score::template dparam_factor<kCap>(p, ctx, 0);
      if (kNPar > 1) p.dparam_part1[idx] = sum1 * Score::template dparam_factor<kCap>(p, ctx, 1);
    }
  }
}

// ------------------------------------------------------------------------------------------
// The key-block kernels: the dK/dV kernel of the two-kernel backward, and the fused backward
// (FlashAttention-2's five GEMMs per tile: S, dP, dV, dK, dQ) after the pre-pass of the dQ kernel
// (kPrep: the row statistics, and the adaptive g). One body, kFusedDq the difference.
// One CTA per key block of a key/value head, each warp owning 16 keys (at D = 256 two warps
// share them, each accumulating half of the dK/dV columns, see traits.h); scores computed
// transposed (S^T = K Q^T, keys x queries) so that P^T and dS^T are A operands from registers;
// steps over (group head, query block), each step's Q and dO tiles and rows of the statistics
// workspace copied through precomputed per-thread offsets (TileLoader, 16-byte cp.async).
// kFusedDq: each step also stores dS^T to shared memory, and after the barrier that follows the
// dV GEMMs every warp computes a 16-query x (D / column groups) part of dQ_t = dS K_j (dS read
// transposed by load_frag_t, K from the tile this CTA holds), added with fp32 atomics to
// p.dq_accum (padded to whole tiles, so without bounds checks; the binding scales and converts
// it); dK += dS^T Q reads dS^T back from shared memory too (fewer live registers). The order of
// the atomic adds across key blocks is the hardware's, so the fused path is not bitwise
// reproducible: deterministic backwards run the two-kernel path. Where the fused kernel runs
// (traits.h, bwd_fused_for: D <= 128, 64 on sm_70) is set by register spills. A score function
// with parameters (SSA: db / dn) has each warp sum their terms over a head's steps and write one
// partial per (head, key block, warp).
//
// Pipeline per step (Q and the statistics double-buffered, dO single):
//   issue Q_{t+1}, stats_{t+1} | wait Q_t, dO_t | S^T, dP^T, dV += P^T dO_t (kFusedDq: dS^T to
//   shared) | issue dO_{t+1} | dK += dS^T Q_t (kFusedDq: dQ_t = dS K, atomics)
template <typename Tr, typename Score, bool kAdaptive, bool kFusedDq, bool kCap = false>
SSA_DEVICE void bwd_key_block(const BwdParams& p) {
  SSA_TILE_NAMES(Tr);  // kBlockM queries per step, kBlockN keys of this CTA
  constexpr int kNWarps = Tr::kNWarps;
  constexpr int kSplit = Tr::kColSplit;  // warps per 16-key strip, each owning kDC columns
  // sm_90a at the head dims of bwd_wgmma (traits.h): S^T, dP^T, dV and dK as wgmma, the CTA's 4
  // warps (one 16-key strip each) one warpgroup and its 64 keys one m64 tile; K, V, Q, dO
  // 128-byte swizzled (smem_layout.h, Sw128Tile). The fused dQ (16 queries per warp: below m64) stays
  // mma.sync, reading K from the swizzled tile.
  constexpr bool kWg = SSA_FLASH_WGMMA && bwd_wgmma(kD) && kSplit == 1;
  static_assert(!kWg || (kBlockN == 64 && Tr::kNWarps == 4), "wgmma: the key block is one warpgroup's m64");
  using LK = Select<kWg, Sw128Tile<kBlockN>, Pad>;  // K, V
  using LQ = Select<kWg, Sw128Tile<kBlockM>, Pad>;  // Q (two buffers), dO
  constexpr int kTileK = LK::elems(kBlockN, kD), kTileQ = LQ::elems(kBlockM, kD);
  // queries per score GEMM (see the step): 16 in the fused kernel (its dQ registers), else all
  // (wgmma: all, as one n = 32 product)
  constexpr int kQC = kFusedDq && !kWg ? 16 : kBlockM;
  constexpr int kDC = kD / kSplit;
  constexpr int kDT = kDC / 8;
  constexpr int kNStat = dkdv_stat_count(kAdaptive);
  constexpr int kStatChunks = kBlockM * kNStat / 4;  // 16-byte copies of a tile's statistics
  static_assert(kBlockN == 16 * Tr::kNWarps / kSplit, "one 16-key strip per kSplit warps");
  static_assert(kStatChunks <= kNThreads, "statistics: one copy per thread");
  static_assert(kNThreads * 4 <= key_block_drop_bytes(kD), "drop_slot: a word per thread");
  // dQ: warp w takes query strip w % kQS and column group w / kQS (kDQ columns), in chunks
  // of kDQC columns (the accumulators of one chunk live at a time)
  constexpr int kQS = kBlockM / 16;
  constexpr int kDQ = kD / (kNWarps / kQS);
  // (32-column chunks where they divide kDQ; 48 at D = 96 spilled)
  constexpr int kDQC = kDQ % 32 == 0 ? 32 : 16;
  // Above D = 64 the chunks are a rolled loop: unrolled, ptxas hoisted every chunk's K fragments
  // and spilled at D = 96 / 128 (the audit, ssa_flash/audit/cuda.py, counts its kDQ / kDQC trips)
  constexpr bool kDQRolled = kD > 64;
  // sm_70 / sm_75 (copies through registers) at D <= 128: see load_q_stats
  constexpr bool kSyncCopies = !SSA_FLASH_ASYNC_COPIES && kD <= 128;
  constexpr int kSdS = kBlockM + 8;  // row stride of dS^T in shared memory
  // dS^T through shared memory to the dK GEMM (and the fused dQ GEMM; wgmma takes dK's from
  // registers)
  constexpr bool kStoreDs = kFusedDq || (!kWg && dkdv_stores_ds(kD, SSA_FLASH_ASYNC_COPIES ? kPathSm80 : kPathSm75));
  static_assert(!kFusedDq || (kNWarps % kQS == 0 && kDQ % 16 == 0 && kDQ % kDQC == 0), "fused dQ split");
  // the fused kernel sums the parameters' terms per warp: each score must belong to one warp
  static_assert(Score::kParams == 0 || !kFusedDq || kSplit == 1, "fused backward with parameters: one warp per key strip");

#if defined(__CUDA_ARCH__)
  // (each architecture runs one strip split per variant, traits.h dkdv_split_for, and this
  // kernel only where bwd_fused_for says)
  if (never_launched(kernel_unsupported<T, kD>() || kSplit != dkdv_split_for(kD, ElemInfo<T>::kIsBF16, __CUDA_ARCH__) ||
                     (kFusedDq && !bwd_fused_for(kD, Score::kFusedSpillsSm75, ElemInfo<T>::kIsBF16, __CUDA_ARCH__))))
    return;
#endif
  // (the host plans dropout and windows on the two-kernel path)
  if (kFusedDq && (p.drop_rng != nullptr || p.window)) __trap();
  extern __shared__ uint4 smem_raw[];
  T* sK = kWg ? align_smem_1024<T>(smem_raw) : reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kTileK;
  T* sQ = sV + kTileK;  // two buffers
  T* sdO = sQ + 2 * kTileQ;
  float* sStat = reinterpret_cast<float*>(sdO + kTileQ);  // [2][kBlockM][kNStat]
  // kStoreDs: dS^T [kBlockN][kSdS]; then (sm_70) the gemm_rn scratch
  T* sdS = reinterpret_cast<T*>(sStat + 2 * kNStat * kBlockM);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const BlockInfo blk = BlockInfo::key_tile(kBlockN);
  const int hk = blk.head_kv;
  const int bb = blk.batch;
  const int n0 = blk.row0;

  const T* k = blk.kv_head<const T>(p.k, p.k_sb, p.k_sh);
  const T* v = blk.kv_head<const T>(p.v, p.v_sb, p.v_sh);
  const int64_t head0 = static_cast<int64_t>(bb) * p.heads;  // (batch, head) index of head 0

  // Query blocks from m_first see this key block (block_info.h, query_blocks): under causal,
  // none before it; with a window (not in the fused kernel), those meeting its band.
  const QueryBlocks qblocks = query_blocks<!kFusedDq>(p, n0, kBlockM, kBlockN);
  const int m_first = qblocks.first;
  const int tiles_per_head = qblocks.tiles;
  const int num_t = tiles_per_head * p.group;

  TileMap<kBlockM, kD, LQ, kNThreads> tmap;
  tmap.init(tid);
  TileLoader<kBlockM, kD, LQ, kNThreads, T> q_ld, do_ld;
  q_ld.init(tmap, p.q_sm);
  do_ld.init(tmap, p.do_sm);
  // Where the copies of a step come from: its head and first query; the addresses of its Q and dO
  // tiles and of its rows of the statistics workspace (whole rows, always inside the workspace)
  // are formed where they are issued (the same for every thread: ptxas computes them on the
  // uniform datapath; the threads add their offsets when they copy). Keeping the next step's
  // three pointers live through a step spilled the dK/dV kernel at D = 128.
  struct Src {
    int hh;
    int mm;
  };
  auto load_q_stats = [&](const Src& src, int buf) {
    const T* q = static_cast<const T*>(p.q) + bb * p.q_sb + src.hh * p.q_sh + static_cast<int64_t>(src.mm) * p.q_sm;
    const float* ws = p.rowstat + ((head0 + src.hh) * p.stat_rows + src.mm) * kNStat;
    float* stat = sStat + buf * kNStat * kBlockM;
    if (kSyncCopies) {
      // sm_70 / sm_75: copies go through registers, issued where few are free: no per-thread
      // loader state, statistics one float at a time (with either, ptxas spilled the dK/dV
      // kernels at D = 96 and 128 there)
      load_tile<kBlockM, kD, LQ, kNThreads>(sQ + buf * kTileQ, q, p.q_sm, 0, p.len_q - src.mm, p.dim, tid);
#pragma unroll 1
      for (int i = tid; i < kBlockM * kNStat; i += kNThreads) stat[i] = ws[i];
    } else {
      // (p.q: a valid address for the zero-filled rows)
      q_ld.issue(tmap, sQ + buf * kTileQ, q, p.q_sm, p.dim, static_cast<const T*>(p.q), p.len_q - src.mm, tid);
      if (tid < kStatChunks) cp_async_16(stat + 4 * tid, ws + 4 * tid, true);
    }
  };
  auto load_do = [&](const Src& src) {
    const T* dout = static_cast<const T*>(p.dout) + bb * p.do_sb + src.hh * p.do_sh + static_cast<int64_t>(src.mm) * p.do_sm;
    if (kSyncCopies) load_tile<kBlockM, kD, LQ, kNThreads>(sdO, dout, p.do_sm, 0, p.len_q - src.mm, p.dim_v, tid);
    else do_ld.issue(tmap, sdO, dout, p.do_sm, p.dim_v, static_cast<const T*>(p.dout), p.len_q - src.mm, tid);
  };

  load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, n0, p.len_k, p.dim, tid);
  load_tile<kBlockN, kD, LK, kNThreads>(sV, v, p.v_sm, n0, p.len_k, p.dim_v, tid);
  if (num_t > 0) {
    const Src first{hk * p.group, m_first};
    load_q_stats(first, 0);
    load_do(first);
  }
  cp_async_commit();

  float dk_acc[1][kDT][4], dv_acc[1][kDT][4];
  zero(dk_acc);
  zero(dv_acc);
  const int strip = warp / kSplit;
  const int col0 = (warp % kSplit) * kDC;  // first dK/dV column of this warp
  const T* sKw = sK + strip * 16 * kS;
  const T* sVw = sV + strip * 16 * kS;
  // the sm_70 gemm_rn scratch (per warp), then a word per thread where the step's dropout flags
  // wait for their uses (volatile: in a register through the step, they spilled the fused SSA
  // kernels at D = 96 / 128; the address too is formed at each use, from sK)
  T* scratch0 = kStoreDs ? sdS + kBlockN * kSdS : sdS;
  constexpr int kScratch = kStoreDs ? gemm_rn_scratch_elems<1, (kBlockN > kBlockM ? kBlockN : kBlockM)>()
                                    : gemm_rn_scratch_elems<1, kBlockM>();
  T* scratch = scratch0 + warp * kScratch;
  constexpr int kDropOff = 2 * kTileK + 3 * kTileQ + 2 * kNStat * kBlockM * 4 / static_cast<int>(sizeof(T)) +
                           (kStoreDs ? kBlockN * kSdS : 0) + kNWarps * kScratch;  // elements from sK
  auto drop_slot = [&]() { return reinterpret_cast<volatile uint32_t*>(sK + kDropOff) + threadIdx.x; };
  // this thread's two key rows (recomputed where used: kept live, they spilled at D = 128)
  auto key_lo = [&]() { return n0 + strip * 16 + Frag::row(lane); };
  const int dq_strip = warp % kQS, dq_col0 = (warp / kQS) * kDQ;  // this warp's part of dQ
  // this thread's first dQ accumulator element of a step, from the step's first row
  const int dq_off = (dq_strip * 16 + Frag::row(lane)) * kD + dq_col0 + Frag::col(lane, 0);

  // this warp's sums of the parameters' terms (SSA: db / dn) over the current head's steps (the
  // fused kernel writes them per head, see below; in the dK/dV kernel the dQ kernel sums them and
  // these are dead)
  float dpar0 = 0.0f, dpar1 = 0.0f;

  // One step: query rows [mm, mm + kBlockM) of head hh, whose logit context is ctx, from buffer
  // buf; `next` the next step's sources, if has_next.
  auto step = [&](auto check, const LogitCtx& ctx, int mm, int buf, bool has_next, const Src& next, int hh) {
    constexpr bool kCheck = decltype(check)::value;
    if (SSA_FLASH_ASYNC_COPIES && has_next) {
      load_q_stats(next, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if (kWg) fence_proxy_async();  // (wgmma reads the tiles through the async proxy)
    __syncthreads();  // Q_t, dO_t and stats_t visible to every warp

    const T* sQt = sQ + buf * kTileQ;
    const float* stat = sStat + buf * kNStat * kBlockM;

    // dropout flags of the step (checked steps: a dropout call has no interior ones), evaluated
    // before the scores are live: bit e + 4 u of 16-query block kk (byte kk) for element e of its
    // tile u, parked in shared memory (drop_slot) until used. Not in the fused kernel: its
    // registers are spent (the SSA variants at D = 96 / 128 spilled with this code on sm_80), and
    // a dropout backward runs the two-kernel path (launch_impl.h, plan_bwd).
    const bool drop = !kFusedDq && kCheck && p.drop_rng != nullptr;
    if (drop) {
      const DropCtx dc = make_drop_ctx(p.drop_rng, p.drop_keep_below, bb, hh);
      uint32_t bits = 0;
#pragma unroll 1
      for (int kk = 0; kk < kBlockM / 16; ++kk) bits |= drop_bits_keys(dc, n0 + strip * 16, mm + 16 * kk, lane) << (8 * kk);
      *drop_slot() = bits;
    }
    // x times the dropout factor of element e of tile u of a block's flags `b` (its byte)
    auto drop_apply = [&](uint32_t b, int e, float x) { return (b >> e) & 1u ? x * p.drop_scale : 0.0f; };

    // S^T = K Q^T and dP^T = V dO^T per chunk of kQC queries, then per 16-query block kk of the
    // chunk the elementwise work and dV += P^T dO: each block's scores die before the next
    // block's are processed (with all of them live, ptxas interleaved the elementwise code with
    // the dV GEMM and the adaptive variants spilled on sm_70 / sm_75). Above D = 64 the chunks
    // are 16 queries (the K and V fragments are read once per chunk, 16 more ldmatrix per step,
    // but 16 fewer score registers: the fused kernel spilled at D = 128 otherwise). wgmma: one
    // chunk, and dV += P^T dO once for the step (P^T of both blocks kept in pw).
    uint32_t da[1][kBlockM / 16][4];
    uint32_t pw[1][kWg ? kBlockM / 16 : 1][4];
#pragma unroll
    for (int q0 = 0; q0 < kBlockM; q0 += kQC) {
      float s[1][kQC / 8][4], dp[1][kQC / 8][4];
      // S^T = K Q^T, dP^T = V dO^T
      score_gemms<kWg, T, kQC, kD, LK, LQ, kS>(s, dp, kWg ? sK : sKw, kWg ? sQt : sQt + q0 * kS, kWg ? sV : sVw,
                                               kWg ? sdO : sdO + q0 * kS, lane);
#pragma unroll
      for (int kc = 0; kc < kQC / 16; ++kc) {
        const int kk = q0 / 16 + kc;  // 16-query block of the step
        // dropout: dP'^T = z (V dO^T) now, P'^T z for dV below
        if (drop) {
          const uint32_t b = *drop_slot() >> (8 * kk);
#pragma unroll
          for (int e = 0; e < 8; ++e) dp[0][2 * kc + e / 4][e % 4] = drop_apply(b, e, dp[0][2 * kc + e / 4][e % 4]);
        }
#pragma unroll
        for (int mt = 2 * kc; mt < 2 * kc + 2; ++mt) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int lq = q0 + Frag::col(lane, mt) + c;  // query within the step (both rows of the thread)
            // (an additive mask's residuals: in the statistics and in p.dout, lse_residual.h)
            const RowStats r = load_row_stats<kAdaptive>(stat + lq * kNStat);
#pragma unroll
            for (int hi = 0; hi < 2; ++hi) {
              const int i = c + 2 * hi;
              float pp;
              dp[0][mt][i] = score_grad<Score, kAdaptive, kCheck, !kFusedDq, kCap, true, false>(
                  p, ctx, s[0][mt][i], dp[0][mt][i], mm + lq, key_lo() + hi * Frag::kHi, r, pp, dpar0, dpar1);
              s[0][mt][i] = pp;
            }
          }
        }
        if (drop) {
          const uint32_t b = *drop_slot() >> (8 * kk);
#pragma unroll
          for (int e = 0; e < 8; ++e) s[0][2 * kc + e / 4][e % 4] = drop_apply(b, e, s[0][2 * kc + e / 4][e % 4]);
        }
        uint32_t pa[1][1][4];
        uint32_t (&pk)[4] = kWg ? pw[0][kWg ? kk : 0] : pa[0][0];  // P^T of block kk
        pk[0] = pack2<T>(s[0][2 * kc][0], s[0][2 * kc][1]);
        pk[1] = pack2<T>(s[0][2 * kc][2], s[0][2 * kc][3]);
        pk[2] = pack2<T>(s[0][2 * kc + 1][0], s[0][2 * kc + 1][1]);
        pk[3] = pack2<T>(s[0][2 * kc + 1][2], s[0][2 * kc + 1][3]);
        da[0][kk][0] = pack2<T>(dp[0][2 * kc][0], dp[0][2 * kc][1]);
        da[0][kk][1] = pack2<T>(dp[0][2 * kc][2], dp[0][2 * kc][3]);
        da[0][kk][2] = pack2<T>(dp[0][2 * kc + 1][0], dp[0][2 * kc + 1][1]);
        da[0][kk][3] = pack2<T>(dp[0][2 * kc + 1][2], dp[0][2 * kc + 1][3]);
        if (kStoreDs && warp % kSplit == 0) {
          // dS^T for the dQ GEMM: rows = keys of this strip, columns = queries (pairs of adjacent
          // queries per register, the accumulator layout)
          T* row_lo = sdS + (strip * 16 + Frag::row(lane)) * kSdS;
          T* row_hi = row_lo + Frag::kHi * kSdS;
          *reinterpret_cast<uint32_t*>(row_lo + Frag::col(lane, 2 * kk)) = da[0][kk][0];
          *reinterpret_cast<uint32_t*>(row_hi + Frag::col(lane, 2 * kk)) = da[0][kk][1];
          *reinterpret_cast<uint32_t*>(row_lo + Frag::col(lane, 2 * kk + 1)) = da[0][kk][2];
          *reinterpret_cast<uint32_t*>(row_hi + Frag::col(lane, 2 * kk + 1)) = da[0][kk][3];
        }
        if constexpr (!kWg) gemm_rn<T, 1, kDC, 16, Pad>(dv_acc, pa, sdO + kk * 16 * kS, col0, lane, scratch);  // dV += P^T dO
      }
    }
    if constexpr (kWg) {
      wg_gemm_rn<T, kD, kBlockM, LQ>(dv_acc[0], pw[0], sdO);  // dV += P^T dO
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(dv_acc[0]);
    }

    __syncthreads();  // every warp is done with dO_t, and dS^T is complete
    if (SSA_FLASH_ASYNC_COPIES && has_next) {
      load_do(next);
      cp_async_commit();
    }
    // kStoreDs: dS^T is in shared memory anyway: read it back rather than keep its registers
    // live through the elementwise work
    if constexpr (kWg) {
      wg_gemm_rn<T, kD, kBlockM, LQ>(dk_acc[0], da[0], sQt);  // dK += dS^T Q
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(dk_acc[0]);
    } else {
      if (kStoreDs) load_frag<T, kBlockM, kSdS>(da[0], sdS + strip * 16 * kSdS, lane);
      gemm_rn<T, 1, kDC, kBlockM, Pad>(dk_acc, da, sQt, col0, lane, scratch);  // dK += dS^T Q
    }
    if (kFusedDq) {
      // dQ_t (this warp's strip and columns) += dS K_j, added to the fp32 accumulator
      uint32_t dsa[1][kBlockN / 16][4];
      load_frag_t<T, kBlockN, kSdS>(dsa[0], sdS + dq_strip * 16, lane);
      float* dq_thr = p.dq_accum + ((head0 + hh) * p.stat_rows + mm) * kD + dq_off;
#pragma unroll(kDQRolled ? 1 : kDQ / kDQC)
      for (int c0 = 0; c0 < kDQ; c0 += kDQC) {
        float dq_acc[1][kDQC / 8][4];
        zero(dq_acc);
        gemm_rn<T, 1, kDQC, kBlockN, LK>(dq_acc, dsa, sK, dq_col0 + c0, lane, scratch);
#pragma unroll
        for (int dt = 0; dt < kDQC / 8; ++dt) {
          float* at = dq_thr + c0 + (Frag::col(lane, dt) - Frag::col(lane, 0));
          red_add2(at, dq_acc[0][dt][0], dq_acc[0][dt][1]);
          red_add2(at + Frag::kHi * kD, dq_acc[0][dt][2], dq_acc[0][dt][3]);
        }
      }
    }
    __syncthreads();  // every warp is done with Q_t, stats_t (and dS^T)
    if (!SSA_FLASH_ASYNC_COPIES && has_next) {
      // synchronous copies (memory.h) between two barriers, where they overlap no GEMM
      load_q_stats(next, buf ^ 1);
      load_do(next);
      cp_async_commit();  // (a no-op without cp.async; keeps the emulation's bookkeeping)
    }
  };

  // Per head, the first n_diag query blocks are cut by the band's right edge (the causal
  // diagonal, or the window's right bound: query mm sees key n0 + kBlockN - 1 only if
  // n0 + kBlockN - 1 - mm <= win_right); with a mask, dropout or a ragged key block every step
  // needs the checks, and with a window on sm_70 / sm_75 (as block_info.h key_blocks: the window's
  // interior steps spilled their D = 128 adaptive dK/dV kernels). Steps alternate buffers across
  // heads too.
  const bool all_checked = p.mask_kind != kMaskNone || p.drop_rng != nullptr || n0 + kBlockN > p.len_k ||
                           (!SSA_FLASH_ASYNC_COPIES && p.window);
  const int diag_rows = n0 + kBlockN - 1 - p.win_right - m_first;  // rows before the first uncut one
  const int n_diag = all_checked ? tiles_per_head
                                 : diag_rows > 0 ? min(tiles_per_head, (diag_rows + kBlockM - 1) / kBlockM) : 0;
  // Steps of a head in order: checked ones (cut by the right edge, or all with a mask, dropout
  // or a ragged key block), interior ones, then checked ones again: those cut by the window's
  // left edge (query rows past n0 + win_left) and always the head's last query block. Interior
  // steps then always prefetch the same head's next block, and only a checked step switches to
  // the next head's sources.
  const int m_last = m_first + (tiles_per_head - 1) * kBlockM;
  int buf = 0;
  // The heads of this key/value head, [hh0, hh0 + group). The fused kernel counts them by
  // head index, the dK/dV kernel from 0: the same loop, but not to ptxas, which (fused, counting
  // from 0) spilled the SSA variants at D = 96 / 128, and (dK/dV, by index) recomputed each
  // step's head offset in the loop (6 integer instructions per step, sm_90a) and spilled 4 more
  // bytes on sm_70.
  const int hh0 = hk * p.group;
  const int head_first = kFusedDq ? hh0 : 0;
  for (int head = head_first; head < head_first + p.group; ++head) {
    const int hh = kFusedDq ? head : hh0 + head;
    const int m_diag = m_first + n_diag * kBlockM;  // (here: live across the loop, it spilled)
    // the first query block cut by the window's left edge (row mm + kBlockM - 1 sees key n0 only
    // if it is at most n0 + win_left), or the last block (no window in the fused kernel, nor
    // windowed interior steps on sm_70 / sm_75)
    const int tail_rows = n0 + p.win_left - kBlockM + 1 - m_first;  // rows before the first cut block
    const int m_tail = kFusedDq || !SSA_FLASH_ASYNC_COPIES
                           ? m_last
                           : min(m_last, m_first + (tail_rows >= 0 ? tail_rows / kBlockM + 1 : 0) * kBlockM);
    const bool last_head = hh + 1 == hh0 + p.group;
    const LogitCtx ctx = Score::template setup<kCap>(p, bb, hh);
    auto run = [&](auto check, int mm) {
      constexpr bool kCheck = decltype(check)::value;
      const bool head_end = kCheck && mm == m_last;
      const Src next = head_end ? Src{last_head ? hh : hh + 1, m_first}  // (unused after the last head)
                                : Src{hh, mm + kBlockM};
      step(check, ctx, mm, buf, !(head_end && last_head), next, hh);
      buf ^= 1;
    };
    int mm = m_first;
    for (int pass = 0; pass < 2; ++pass) {
      const int checked_end = pass == 0 ? min(m_diag, m_last) : m_last + kBlockM;
      for (; mm < checked_end; mm += kBlockM) run(Bool<true>(), mm);
      if (pass == 0)
        for (; mm < m_tail; mm += kBlockM) run(Bool<false>(), mm);
    }
    constexpr int kNPar = Score::kParams;
    if (kNPar > 0 && kFusedDq) {
      // the parameters' partials of this head: one per (key block, warp), summed by the binding
      // (every entry written, zero when the head had no step here)
      // (indices from the special registers again: kept live from the prologue, they spilled)
      const float sum0 = warp_sum(dpar0), sum1 = kNPar > 1 ? warp_sum(dpar1) : 0.0f;
      const int t = threadIdx.x;
      if ((t & 31) == 0) {
        const int64_t bh = static_cast<int64_t>(blockIdx.z) * p.heads + hh;
        const int64_t idx = (bh * gridDim.x + blockIdx.x) * kNWarps + (t >> 5);
        p.dparam_part0[idx] = sum0 * Score::template dparam_factor<kCap>(p, ctx, 0);
        if (kNPar > 1) p.dparam_part1[idx] = sum1 * Score::template dparam_factor<kCap>(p, ctx, 1);
      }
      dpar0 = dpar1 = 0.0f;
    }
  }
  cp_async_wait<0>();  // (nothing in flight unless num_t == 0: K, V were loaded for nothing)

  const int c_lo = key_lo(), c_hi = c_lo + Frag::kHi;
  T* dk = static_cast<T*>(p.dk) + bb * p.dk_sb + hk * p.dk_sh;
  T* dv = static_cast<T*>(p.dv) + bb * p.dv_sb + hk * p.dv_sh;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    const int col = col0 + Frag::col(lane, dt);
    if (col < p.dim) {
      if (c_lo < p.len_k)
        *reinterpret_cast<uint32_t*>(dk + c_lo * p.dk_sm + col) =
            pack2<T>(dk_acc[0][dt][0] * p.scale, dk_acc[0][dt][1] * p.scale);
      if (c_hi < p.len_k)
        *reinterpret_cast<uint32_t*>(dk + c_hi * p.dk_sm + col) =
            pack2<T>(dk_acc[0][dt][2] * p.scale, dk_acc[0][dt][3] * p.scale);
    }
    if (col < p.dim_v) {
      if (c_lo < p.len_k)
        *reinterpret_cast<uint32_t*>(dv + c_lo * p.dv_sm + col) = pack2<T>(dv_acc[0][dt][0], dv_acc[0][dt][1]);
      if (c_hi < p.len_k)
        *reinterpret_cast<uint32_t*>(dv + c_hi * p.dv_sm + col) = pack2<T>(dv_acc[0][dt][2], dv_acc[0][dt][3]);
    }
  }
}

// dK/dV of the two-kernel backward (after attn_bwd_dq_kernel)
template <typename Tr, typename Score, bool kAdaptive, bool kCap = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1) attn_bwd_dkdv_kernel(const BwdParams p) {
  bwd_key_block<Tr, Score, kAdaptive, false, kCap>(p);
}

// dK, dV and dQ (fp32 atomics) of the fused backward (after attn_bwd_dq_kernel's pre-pass)
template <typename Tr, typename Score, bool kAdaptive, bool kCap = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1) attn_bwd_fused_kernel(const BwdParams p) {
  bwd_key_block<Tr, Score, kAdaptive, true, kCap>(p);
}

}  // namespace ssa_flash
