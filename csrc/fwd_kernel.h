// Forward kernel (FlashAttention-2 style, online rescaling in base-2 log units) and the
// row-entropy pass of the adaptive temperature (entropy and LSE of softmax(l), QK^T only).
// Mirrors ssa_flash/triton/forward.py and ssa_flash/triton/entropy.py.
//
// Grid (ceil(Lq / BM), H, B); CTA = 4 warps, each owning 16 query rows; the last (under causal
// the heaviest) query blocks are scheduled first.
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
#include "mask.h"
#include "memory.h"
#include "params.h"
#include "row_entropy.h"
#include "row_state.h"
#include "score_gemm.h"
#include "smem_layout.h"
#include "tile_io.h"
#include "traits.h"

namespace ssa_flash {

// Forward: per row, l2 = (phi(z) + mask) * log2(e), times beta (ADAPTIVE); m = a reference
// max, l = running sum of 2^(l2 - m) (partial per thread, reduced over the quad at the end),
// acc = running sum of 2^(l2 - m) v. Writes o = acc / l and lse = (m + log2 l) * ln 2 (natural
// log, -inf for rows with no admissible key, whose output is 0).
//
// Each warp owns kMS 16-row strips (two where registers allow: each K/V fragment then feeds two
// strips). Key blocks [0, n_int) need no bounds, causal or mask work and run loops of their own
// (the interior loops); the rest (the diagonal under causal, the ragged last block, every block
// of a masked call) run the checked loop.
//
// Interior blocks keep the raw per-element value x and a per-row multiplier c >= 0 (the score
// function's x and mult, logits.h): softmax x = s (the dot product), c = scale log2(e) beta; SSA
// x = t = sgn(s) log2(1 + b scale |s|), c = n beta. The row max is taken on x and scaled once per
// row (max(c x) = c max(x) for c >= 0), and each weight is one FFMA and one EX2, 2^(x c - m)
// (FlashAttention-2's trick, extended to SSA's t). c >= 0 needs scale >= 0 (the binding applies a
// negative scale to -q) and a head whose multiplier would be negative (SSA's n < 0: Score::nonneg)
// negates its Q tile once in shared memory, since n sgn(s) = |n| sgn(-s).
//
// Conditional rescaling (FlashAttention-4): m need not be the running max, only a value that
// the final normalisation shares (o = acc / l and lse = m + log2 l are exact for any m), as long
// as 2^(l2 - m) cannot overflow. Interior blocks keep m unless some row's max exceeds it by more
// than kRescaleSlack = 8 (weights stay below 2^8, well inside fp16 / bf16 and the fp32 sums);
// the block votes (__syncthreads_or at the barrier that follows the S GEMM anyway), and the
// steady-state loop breaks out to a copy of the second half of the step that moves m to the
// max and rescales acc and l. The first block always does; after it, only a row max growing by
// 8 (a factor 256 in weight) does. So the steady-state loop has no per-element rescale (D / BN
// FMULs per score before). Checked blocks rescale every time (exact running max, as before).
//
// Pipeline per key block j with cp.async (sm_80+; K and V single-buffered):
//   issue V_j | wait K_j | S = Q K_j^T, row max | wait V_j, vote | weights | issue K_{j+1} |
//   O += P V_j
// On sm_90a at the head dims of fwd_wgmma (traits.h) both GEMMs are wgmma (gemm_wgmma.h, wg_gemm_*):
// the 4 warps are one warpgroup, which computes the 128-row tile as two m64 halves (warp w owns
// rows 16 w.. and 64 + 16 w.. of it: its two strips), Q, K, V in 128-byte-swizzled shared
// memory, P from registers; each group is waited for at once, so the steps keep their structure.
// Without cp.async (sm_70 / sm_75) the copies are synchronous: V_j before S (no score live),
// K_{j+1} before O += P V_j (sm_75) or after it (sm_70), the orders ptxas compiles without
// spills; every block rescales there (no steady-state loop: its second copy of the step spilled
// on sm_75).
//
// Soft-capping and sinks (kCap, kSink; docs/maths.md section 6): the capped score replaces the dot
// product before anything else sees it (logits.h, softcap_raw: the interior loop's x is then
// th = tanh(z / c), or its SSA t, the cap c / scale folded into the logit coefficient); a sink
// starts its row at the sink logit (row_state.h, init_row_sink), which m = sink2 beta, l = 1 make
// part of the final o and lse with nothing per element. Without them the kernel compiles exactly as before.
template <typename Tr, typename Score, bool kAdaptive, bool kCap = false, bool kSink = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1) attn_fwd_kernel(const FwdParams p) {
  SSA_TILE_NAMES(Tr);
  constexpr int kMS = Tr::kMS;      // 16-row strips per warp
  constexpr int kNT = kBlockN / 8;  // n8 tiles of a score strip
  constexpr int kDT = kD / 8;       // n8 tiles of an output strip
  constexpr bool kAsync = SSA_FLASH_ASYNC_COPIES;
  constexpr float kRescaleSlack = 8.0f;
  constexpr bool kWg = SSA_FLASH_WGMMA && fwd_wgmma(kD);
  static_assert(!kWg || kBlockM == 64 * kMS, "wgmma: the query tile is kMS m64 halves of one warpgroup");
  using LQ = Select<kWg, Sw128Tile<kBlockM>, Pad>;
  using LK = Select<kWg, Sw128Tile<kBlockN>, Pad>;
  // rows between a warp's strips: consecutive (mma.sync), or the two m64 halves (wgmma)
  constexpr int kStripRows = kWg ? 64 : 16;

  if (never_launched(kernel_unsupported<T, kD>())) return;
  extern __shared__ uint4 smem_raw[];
  T* sQ = kWg ? align_smem_1024<T>(smem_raw) : reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + LQ::elems(kBlockM, kD);
  T* sV = sK + LK::elems(kBlockN, kD);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  T* scratch = sV + LK::elems(kBlockN, kD) + warp * gemm_rn_scratch_elems<kMS, kBlockN>();
  const BlockInfo blk = BlockInfo::query_tile(p, kBlockM);
  const int m0 = blk.row0;

  const T* q = blk.query_head<const T>(p.q, p.q_sb, p.q_sh);
  const T* k = blk.kv_head<const T>(p.k, p.k_sb, p.k_sh);
  const T* v = blk.kv_head<const T>(p.v, p.v_sb, p.v_sh);
  LogitCtx ctx = Score::template setup<kCap>(p, blk.batch, blk.head);
  const bool negate_q = Score::nonneg(ctx);
  // the (batch, head)'s first row of the per-row statistics, formed where used (kept from the
  // prologue to the epilogue, it spilled the D = 128 forward on sm_75)
  auto stat0 = [&]() { return (static_cast<int64_t>(blockIdx.z) * p.heads + blockIdx.y) * p.len_q; };

  // this thread's rows: row0 + kStripRows ms + Frag::kHi hi, for strip ms, hi = 0 / 1 (computed
  // where needed rather than kept: at D = 128 every register counts)
  const int row0 = m0 + warp * (kWg ? 16 : kMS * 16) + Frag::row(lane);
  // The adaptive temperature beta of a row (1 without), and the row multiplier c of the interior
  // loop (see above; beta included). Only c stays in registers: the checked loop reloads beta.
  auto row_beta = [&](int r) { return kAdaptive && r < p.len_q ? p.beta[stat0() + r] : 1.0f; };
  float mult[kMS][2];
#pragma unroll
  for (int ms = 0; ms < kMS; ++ms) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) mult[ms][hi] = Score::mult(ctx, row_beta(row0 + ms * kStripRows + hi * Frag::kHi));
  }

  // the key blocks and their order (block_info.h): interior ones first (streamed copies with cp.async)
  const auto kb = key_blocks(p, m0, kBlockM, kBlockN, kAsync);

  load_tile<kBlockM, kD, LQ, kNThreads>(sQ, q, p.q_sm, m0, p.len_q, p.dim, tid);
  load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, kb.first() * kBlockN, p.len_k, p.dim, tid);
  cp_async_commit();
  if (negate_q) {  // (block-uniform; visible to the other warps after the first barrier)
    cp_async_wait<0>();
    negate_tile<kBlockM, kD, LQ, kNThreads>(sQ, tid);
  }
  // (the interior blocks' V and next K; unused without interior blocks)
  TileStream<kBlockN, kD, LK, kNThreads, T> k_stream, v_stream;
  k_stream.init(k, p.k_sm, (kb.a + 1) * kBlockN, p.dim, tid);
  v_stream.init(v, p.v_sm, kb.a * kBlockN, p.dim_v, tid);

  float acc_o[kMS][kDT][4];
  zero(acc_o);
  float m_run[kMS][2], l_run[kMS][2];
  init_row_state(m_run, l_run);
  if (kSink) {
    const float sink2 = sink_logit2<kSink>(p, blk.head);
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) {
#pragma unroll
      for (int hi = 0; hi < 2; ++hi)
        init_row_sink(m_run[ms][hi], l_run[ms][hi], sink2 * row_beta(row0 + ms * kStripRows + hi * Frag::kHi),
                      Frag::rank(lane) == 0);
    }
  }
  const T* sQw = sQ + warp * kMS * 16 * kS;
  float s[kMS][kNT][4];   // scores, then logits (checked) or x (interior), then weights
  float mq[kMS][2];       // this block's row max of s (quad-reduced)
  // dropout flags of the block's weights (checked blocks), from step_a to step_b in a
  // shared-memory word per thread (in registers, they spilled the D = 128 forward on sm_75)
  static_assert(kMS * kNT <= 16, "DropFlags: 16 tiles");
  constexpr int kDropOff = LQ::elems(kBlockM, kD) + 2 * LK::elems(kBlockN, kD) +
                           Tr::kNWarps * gemm_rn_scratch_elems<kMS, kBlockN>();  // elements from sQ
  auto drop_slot = [&]() { return reinterpret_cast<volatile uint64_t*>(sQ + kDropOff) + threadIdx.x; };

  // First half of step j: copies, S = Q K_j^T, the logits (checked) or x (interior), the row
  // max. Returns the block's vote: does some row need its reference max moved?
  auto step_a = [&](int j, auto check) -> bool {
    constexpr bool kCheck = decltype(check)::value;
    const int n0 = j * kBlockN;
    if (kAsync) {
      if (kCheck) load_tile<kBlockN, kD, LK, kNThreads>(sV, v, p.v_sm, n0, p.len_k, p.dim_v, tid);
      else v_stream.issue(sV, tid);
      cp_async_commit();
      cp_async_wait<1>();  // Q and K_j have landed
      if (kWg) fence_proxy_async();  // (wgmma reads them through the async proxy)
    } else {
      // synchronous: V_j now, before the scores are live (sV is free since step j - 1's last
      // barrier)
      load_tile<kBlockN, kD, LK, kNThreads>(sV, v, p.v_sm, n0, p.len_k, p.dim_v, tid);
      cp_async_commit();
    }
    __syncthreads();

    // dropout flags of this block's weights (checked blocks), evaluated before the scores are live
    if (kCheck && p.drop_rng != nullptr) {
      const DropCtx dc = make_drop_ctx(p.drop_rng, p.drop_keep_below, blockIdx.z, blockIdx.y);
      DropFlags keep;
      keep.clear();
#pragma unroll 1
      for (int t = 0; t < kMS * kNT; ++t)
        keep.set(t, drop_tile_bits(dc, row0 + (t / kNT) * kStripRows, n0 + Frag::col(lane, t % kNT)));
      *drop_slot() = keep.w;
    }

    score_gemm<kWg, T, kMS, kBlockN, kD, LQ, LK, kS>(s, sQ, sQw, sK, lane);

    bool need = false;
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) {
      float mask_mult[2];  // checked: log2(e) beta multiplies an additive mask
      if (kCheck) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) mask_mult[hi] = kLog2e * row_beta(row0 + ms * kStripRows + hi * Frag::kHi);
      }
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int hi = i >> 1;
          float x;
          const float sc = softcap_raw<kCap>(p, s[ms][nt][i]);
          if (!kCheck) {
            x = Score::x(ctx, sc);
          } else {
            typename Score::Elem el;
            x = Score::logit(ctx, sc, mult[ms][hi], el);
            x = apply_mask(p, ctx, x, row0 + ms * kStripRows + hi * Frag::kHi, n0 + Frag::col(lane, nt) + (i & 1),
                           mask_mult[hi]);
          }
          s[ms][nt][i] = x;
          mx[hi] = fmaxf(mx[hi], x);
        }
      }
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        // checked: the logit max; interior: the max of x times the row multiplier
        mq[ms][hi] = kCheck ? quad_max(mx[hi]) : quad_max(mx[hi]) * mult[ms][hi];
        need |= mq[ms][hi] > m_run[ms][hi] + kRescaleSlack;
      }
    }
    if (kAsync) cp_async_wait<0>();  // V_j has landed
    if (kWg) fence_proxy_async();
    // V_j visible, every warp done with K_j, and the vote
    return __syncthreads_or(kCheck || need);
  };

  // Second half of step j: the weights (after moving the reference max and rescaling when
  // kRescale), issue the next block's K (kb.next(j), if has_next), O += P V_j.
  auto step_b = [&](int j, bool has_next, auto check, auto rescale) {
    constexpr bool kCheck = decltype(check)::value;
    constexpr bool kRescale = decltype(rescale)::value;
    uint32_t pa[kMS][kBlockN / 16][4];
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) {
      float ms_[2];
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        if (kRescale) {
          const float mn = fmaxf(m_run[ms][hi], mq[ms][hi]);
          // checked tiles may have rows with no admissible key yet (mn = -inf): exponentiate
          // against 0 there. Interior tiles have finite logits.
          ms_[hi] = kCheck ? safe_max(mn) : mn;
          const float alpha = ex2(m_run[ms][hi] - ms_[hi]);
          m_run[ms][hi] = mn;
          l_run[ms][hi] *= alpha;
#pragma unroll
          for (int dt = 0; dt < kDT; ++dt) {
            acc_o[ms][dt][2 * hi] *= alpha;
            acc_o[ms][dt][2 * hi + 1] *= alpha;
          }
        } else {
          ms_[hi] = m_run[ms][hi];
        }
      }
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int hi = i >> 1;
          s[ms][nt][i] = ex2(kCheck ? s[ms][nt][i] - ms_[hi]
                                    : fmaf(s[ms][nt][i], mult[ms][hi], -ms_[hi]));
          l_run[ms][hi] += s[ms][nt][i];
        }
      }
      // dropout (checked blocks only: a dropout call has no interior ones): the dropped weights
      // leave P V, not the row sum; the kept ones are scaled by 1 / (1 - p) at the end
      if (kCheck && p.drop_rng != nullptr) {
        DropFlags keep;
        keep.w = *drop_slot();
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) s[ms][nt][i] = keep.apply(ms * kNT + nt, i, s[ms][nt][i], 1.0f);
      }
      acc_to_frag<T, kBlockN>(pa[ms], s[ms]);
    }
    // K_{j+1}: cp.async, or synchronous (visible after step j + 1's first barrier) before the
    // P V GEMM on sm_75 and after it on sm_70 (where each order spills on the other path)
    constexpr bool kLateK = !kAsync && SSA_FLASH_SM70;
    if (!kLateK && has_next) {
      if (kCheck || !kAsync) load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, kb.next(j) * kBlockN, p.len_k, p.dim, tid);
      else k_stream.issue(sK, tid);
      cp_async_commit();
    }
    if constexpr (kWg) {
#pragma unroll
      for (int ms = 0; ms < kMS; ++ms) wg_gemm_rn<T, kD, kBlockN, LK>(acc_o[ms], pa[ms], sV);
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int ms = 0; ms < kMS; ++ms) wgmma_fence_operand(acc_o[ms]);
    } else {
      gemm_rn<T, kMS, kD, kBlockN, Pad>(acc_o, pa, sV, 0, lane, scratch);
    }
    __syncthreads();  // every warp is done with V_j
    if (kLateK && has_next) {
      load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, kb.next(j) * kBlockN, p.len_k, p.dim, tid);
      cp_async_commit();
    }
  };

  // interior blocks [a, n_int); an interior step j has a next block iff j + 1 < last
  const int n_int = kb.n_int, last = kb.a + kb.steps();
  int j = kb.a;
  if (kAsync) {
    while (j < n_int) {
      // the steady state: no rescaling (the audit's interior loop)
      for (; j < n_int; ++j) {
        if (step_a(j, Bool<false>())) break;
        step_b(j, j + 1 < last, Bool<false>(), Bool<false>());
      }
      if (j < n_int) {
        step_b(j, j + 1 < last, Bool<false>(), Bool<true>());
        ++j;
      }
    }
  } else {
    // sm_70 / sm_75 (synchronous copies): every interior block rescales. The second copy of the
    // step above costs registers these paths do not have (with it, ptxas spills the float16
    // forward at D = 64 (SSA, adaptive), 96 and 128 on sm_75).
    for (; j < n_int; ++j) {
      step_a(j, Bool<false>());
      step_b(j, j + 1 < last, Bool<false>(), Bool<true>());
    }
  }
  kb.each_checked([&](int jc, int it) {
    step_a(jc, Bool<true>());
    step_b(jc, it + 1 < kb.steps(), Bool<true>(), Bool<true>());
  });
  cp_async_wait<0>();  // (a window can leave a query block no keys: the prologue's K copy)

  T* o = static_cast<T*>(p.o) + blk.batch * p.o_sb + blk.head * p.o_sh;
#pragma unroll
  for (int ms = 0; ms < kMS; ++ms) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const float l = quad_sum(l_run[ms][hi]);
      const float inv = l == 0.0f ? 0.0f : (p.drop_rng != nullptr ? p.drop_scale : 1.0f) / l;
      const int r = row0 + ms * kStripRows + hi * Frag::kHi;
      if (r < p.len_q) {
#pragma unroll
        for (int dt = 0; dt < kDT; ++dt) {
          const int col = Frag::col(lane, dt);
          if (col < p.dim_v)
            *reinterpret_cast<uint32_t*>(o + r * p.o_sm + col) =
                pack2<T>(acc_o[ms][dt][2 * hi] * inv, acc_o[ms][dt][2 * hi + 1] * inv);
        }
        if (Frag::rank(lane) == 0) p.lse[stat0() + r] = l == 0.0f ? neg_inf() : (m_run[ms][hi] + log2f(l)) * kLn2;
      }
    }
  }
}

// Row-entropy pass (attn_row_entropy_kernel): per row the softmax entropy H and the LSE of the logits
// (beta = 1), from the running max m, lam and the centred kc (base 2; the maths in row_entropy.h).
// Writes p.entropy (0 for empty rows) and p.lse (-inf for empty rows).
// kCap, kSink as in the forward: the sink is an entry of the row (temperature-free, so m = sink2,
// lam = 1, kc = 0 at the start) and counts in both H and the LSE.
template <typename Tr, typename Score, bool kCap = false, bool kSink = false>
__global__ void __launch_bounds__(Tr::kNThreads, 1) attn_row_entropy_kernel(const FwdParams p) {
  SSA_TILE_NAMES(Tr);
  constexpr int kMS = Tr::kMS;
  constexpr int kNT = kBlockN / 8;
  // sm_90a: S as wgmma, as in the forward
  constexpr bool kWg = SSA_FLASH_WGMMA && fwd_wgmma(kD);
  static_assert(!kWg || kBlockM == 64 * kMS, "wgmma: the query tile is kMS m64 halves of one warpgroup");
  using LQ = Select<kWg, Sw128Tile<kBlockM>, Pad>;
  using LK = Select<kWg, Sw128Tile<kBlockN>, Pad>;
  constexpr int kTileK = LK::elems(kBlockN, kD);

  if (never_launched(kernel_unsupported<T, kD>())) return;
  extern __shared__ uint4 smem_raw[];
  T* sQ = kWg ? align_smem_1024<T>(smem_raw) : reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + LQ::elems(kBlockM, kD);  // two buffers

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const BlockInfo blk = BlockInfo::query_tile(p, kBlockM);
  const int m0 = blk.row0;

  const T* q = blk.query_head<const T>(p.q, p.q_sb, p.q_sh);
  const T* k = blk.kv_head<const T>(p.k, p.k_sb, p.k_sh);
  const LogitCtx ctx = Score::template setup<kCap>(p, blk.batch, blk.head);
  const float mult = Score::mult(ctx, 1.0f);
  const int64_t stat0 = blk.batch_head(p) * p.len_q;
  int row[kMS][2];
#pragma unroll
  for (int ms = 0; ms < kMS; ++ms)
    for (int hi = 0; hi < 2; ++hi)
      row[ms][hi] = m0 + (kWg ? 64 * ms + 16 * warp : (warp * kMS + ms) * 16) + Frag::row(lane) + hi * Frag::kHi;

  // the key blocks and their order (block_info.h); every copy through load_tile
  const auto kb = key_blocks(p, m0, kBlockM, kBlockN, false);

  load_tile<kBlockM, kD, LQ, kNThreads>(sQ, q, p.q_sm, m0, p.len_q, p.dim, tid);
  load_tile<kBlockN, kD, LK, kNThreads>(sK, k, p.k_sm, kb.first() * kBlockN, p.len_k, p.dim, tid);
  cp_async_commit();

  float m_run[kMS][2], lam[kMS][2], kc[kMS][2];
  init_row_state(m_run, lam, kc);
  if (kSink) {
    const float sink2 = sink_logit2<kSink>(p, blk.head);
#pragma unroll
    for (int ms = 0; ms < kMS; ++ms)
      for (int hi = 0; hi < 2; ++hi) init_row_sink(m_run[ms][hi], lam[ms][hi], sink2, Frag::rank(lane) == 0);
  }
  const T* sQw = sQ + warp * kMS * 16 * kS;

  // step `it` of the order runs key block j from K buffer it & 1 (the prologue filled buffer 0)
  auto step = [&](int j, int it, auto check) {
    constexpr bool kCheck = decltype(check)::value;
    const int n0 = j * kBlockN;
    const int buf = it & 1;
    if (it + 1 < kb.steps()) {
      load_tile<kBlockN, kD, LK, kNThreads>(sK + (buf ^ 1) * kTileK, k, p.k_sm, kb.next(j) * kBlockN, p.len_k,
                                           p.dim, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    if (kWg) fence_proxy_async();
    __syncthreads();

    float s[kMS][kNT][4];
    score_gemm<kWg, T, kMS, kBlockN, kD, LQ, LK, kS>(s, sQ, sQw, sK + buf * kTileK, lane);

#pragma unroll
    for (int ms = 0; ms < kMS; ++ms) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          typename Score::Elem el;
          float l2 = Score::logit(ctx, softcap_raw<kCap>(p, s[ms][nt][i]), mult, el);
          if (kCheck) l2 = apply_mask(p, ctx, l2, row[ms][i >> 1], n0 + Frag::col(lane, nt) + (i & 1), kLog2e);
          s[ms][nt][i] = l2;
        }
      }
      row_entropy_update<kCheck>(m_run[ms], lam[ms], kc[ms], s[ms]);
    }
    __syncthreads();  // every warp is done with this K buffer before it is refilled
  };
  for (int j = kb.a; j < kb.n_int; ++j) step(j, j - kb.a, Bool<false>());
  kb.each_checked([&](int j, int it) { step(j, it, Bool<true>()); });
  cp_async_wait<0>();  // (a window can leave a query block no keys: the prologue's K copy)

#pragma unroll
  for (int ms = 0; ms < kMS; ++ms)
    for (int hi = 0; hi < 2; ++hi) row_entropy_store(p, stat0, row[ms][hi], p.len_q, m_run[ms][hi], lam[ms][hi], kc[ms][hi], lane);
}

}  // namespace ssa_flash
