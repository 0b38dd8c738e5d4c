// The main loop of the sm_90a warp-specialised forward (docs/design.md section 4.4): the
// producer's TMA loads (fwd_produce) and a consumer warpgroup's key-block loop (FwdConsumer).
//
// Key blocks: a query tile [m0, m0 + 128) visits blocks [0, n) (under causal, top-left aligned,
// up to its last row), last block first: the blocks that need masking (the ragged end of the
// keys, the causal diagonal) are the highest ones, so they run first, and the rest (the interior)
// run without a check of any kind. Both the producer and the consumers walk this order.
//
// A consumer warpgroup owns 64 query rows; each thread holds two rows (hi = 0, 1: rows
// 16 warp + lane / 4 + 8 hi of them) of the 64 x 128 score tile S and of the 64 x D output O in
// wgmma's accumulator layout (gemm_wgmma.h, frag.h Frag). Per key block j (it = 0, 1, ... in the
// order above):
//
//   wait K_j | turn | issue S_j = Q K_j^T | wait V_{j-1} | issue O += P_{j-1} V_{j-1} | hand the
//   turn over | wait for S_j (wgmma.wait_group 1: O += P V still running) | the score transform
//   and online softmax of S_j into P_j's weights | wait for O += P V (wait_group 0) | free stage
//   j-1 | O *= alpha_j | P_j to 16-bit A fragments
//
// so the transform of block j runs under the P V GEMM of block j - 1 (intra-warpgroup overlap),
// and the turn (named barriers kBarTurn0 / 1) lets one warpgroup's transform run under the other
// warpgroup's GEMMs (ping-pong). The first block has no P V before it, the last a P V after.
//
// Scores (logits.h policies): interior blocks keep x (softmax: s; SSA: sgn(s) log2(1 + c|s|)) and
// the row multiplier mult >= 0 (beta included), the row max taken on x and scaled once per row,
// each weight one FFMA and one ex2 (fwd_kernel.h's interior loop); checked blocks form the logit
// (Score::logit) and mask keys past the sequence's len_k (packed batches: the next sequence's rows,
// which the loads read) and, under causal, keys past the row (-inf). The
// running max is exact (rescaled every block). Mufu (fast_math.h MufuBudget) moves a share of the
// interior blocks' ex2 / lg2 to the FMA pipe (the checked blocks keep MUFU: their -inf must give
// exact zeros).
#pragma once

#include <type_traits>

#include "../fast_math.h"
#include "../frag.h"
#include "../gemm_wgmma.h"
#include "../logits.h"
#include "fwd_params.h"
#include "fwd_traits.h"
#include "named_barriers.h"
#include "tile_scheduler.h"

namespace ssa_flash {
namespace hopper {

// The key blocks of a query tile and their order (see above).
struct FwdKeyBlocks {
  int n;          // blocks [0, n) are visited
  int n_checked;  // the last n_checked of them need masking (they run first)
  SSA_DEVICE int block(int it) const { return n - 1 - it; }
};

// (seq: the tile's sequence; packed, keys past its len_k are the next sequence's rows, so the
// block holding its end is checked as a ragged end is.)
template <typename Seq>
SSA_DEVICE FwdKeyBlocks fwd_key_blocks(const Seq& seq, int m0, int block_m, int block_n) {
  FwdKeyBlocks kb;
  const int end = seq.causal() ? min(seq.len_k(), m0 + block_m) : seq.len_k();
  kb.n = end > 0 ? (end + block_n - 1) / block_n : 0;
  // block j is interior iff (j + 1) block_n <= len_k and, under causal, (j + 1) block_n - 1 <= m0
  int n_int = seq.len_k() / block_n;
  if (seq.causal()) n_int = min(n_int, (m0 + 1) / block_n);
  n_int = max(0, min(n_int, kb.n));
  kb.n_checked = kb.n - n_int;
  return kb;
}

// The producer's elected thread: Q once, then K and V of every key block into the ring.
template <typename Tr, typename Seq>
SSA_DEVICE void fwd_produce(const HopperFwdParams& hp, FwdSharedStorage<Tr>& ss, const Tile& tile,
                            const Seq& seq, int m0, const FwdKeyBlocks& kb) {
  constexpr int kD = Tr::kHeadDim, kBN = Tr::kBlockN;
  prefetch_tma_desc(&hp.tma_q);
  prefetch_tma_desc(&hp.tma_k);
  prefetch_tma_desc(&hp.tma_v);
  if (kb.n == 0) return;
  tma_load_tile<Tr::kBlockM, kD>(ss.q, &hp.tma_q, ss.q_full.arm(tma_tile_bytes<Tr::kBlockM, kD>()), seq.q_row() + m0,
                                 tile.head, seq.tma_batch());
  typename Tr::Ring::Pos pos;
  for (int it = 0; it < kb.n; ++it) {
    const int n0 = seq.k_row() + kb.block(it) * kBN;
    ss.ring.acquire(pos);
    tma_load_tile<kBN, kD>(ss.k[pos.stage], &hp.tma_k, ss.ring.arm(pos, Tr::kPartK, tma_tile_bytes<kBN, kD>()), n0,
                           tile.head_kv, seq.tma_batch());
    tma_load_tile<kBN, kD>(ss.v[pos.stage], &hp.tma_v, ss.ring.arm(pos, Tr::kPartV, tma_tile_bytes<kBN, kD>()), n0,
                           tile.head_kv, seq.tma_batch());
    pos.advance();
  }
}

// One consumer warpgroup's state and steps (see above).
// (kVarlen: the tile's sequence a QuerySeq<true>, packed sequences)
template <typename Tr, typename Score, bool kAdaptive, bool kVarlen>
struct FwdConsumer {
  using T = typename Tr::T;
  using Mufu = typename Tr::Mufu;
  static constexpr int kD = Tr::kHeadDim, kBN = Tr::kBlockN;
  static constexpr int kNT = kBN / 8;  // n8 tiles of a score row strip
  static constexpr int kDT = kD / 8;   // n8 tiles of an output row strip
  using Pos = typename Tr::Ring::Pos;
  using Seq = QuerySeq<kVarlen>;

  float o[kDT][4];       // O (unnormalised)
  float m[2], l[2];      // running max (base 2, beta included) and this thread's partial row sum
  float mult[2];         // the interior blocks' row multiplier (Score::mult, beta included)
  int row0;              // this thread's first row (hi = 0), in the sequence
  int lane;

  SSA_DEVICE void init(const FwdParams& p, const Seq& seq, const LogitCtx& ctx, int row_first) {
    lane = static_cast<int>(threadIdx.x) & 31;
    row0 = row_first;
    const int64_t stat0 = seq.stat0();
    zero(o);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int r = row0 + hi * Frag::kHi;
      const float beta = kAdaptive && r < seq.len_q() ? p.beta[stat0 + r] : 1.0f;
      mult[hi] = Score::mult(ctx, beta);
      m[hi] = neg_inf();
      l[hi] = 0.0f;
    }
  }

  // S = Q K^T issued and committed (one wgmma group)
  SSA_DEVICE static void issue_s(float (&s)[kNT][4], const T* sQ, const T* sK) {
    wgmma_fence_operand(s);
    wg_gemm_nt<T, kBN, kD, typename Tr::QTile, typename Tr::KTile>(s, sQ, sK);
    wgmma_commit();
  }
  // O += P V issued and committed
  SSA_DEVICE void issue_pv(uint32_t (&pa)[kBN / 16][4], const T* sV) {
    wgmma_fence_operand(pa);
    wg_gemm_rn<T, kD, kBN, typename Tr::KTile>(o, pa, sV);
    wgmma_commit();
  }

  // Element index of a thread's score tile (MufuBudget's static position)
  template <int kNt, int kI>
  static constexpr int idx() {
    return 4 * kNt + kI;
  }

  // s (scores of key block n0) -> weights 2^(logit - m) in place; m moves to the new row max,
  // alpha the factor the old O and l are scaled by (l already is).
  template <bool kCheck>
  SSA_DEVICE void softmax(float (&s)[kNT][4], float (&alpha)[2], const Seq& seq, const LogitCtx& ctx, int n0) {
    float mx[2] = {neg_inf(), neg_inf()};
    transform<kCheck>(s, mx, seq, ctx, n0, std::integral_constant<int, 0>());
    float ms[2];
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const float mq = kCheck ? quad_max(mx[hi]) : quad_max(mx[hi]) * mult[hi];
      const float mn = fmaxf(m[hi], mq);
      // checked blocks may leave a row with no admissible key yet (mn = -inf): exponentiate
      // against 0 there; interior blocks have finite values
      ms[hi] = kCheck ? safe_max(mn) : mn;
      alpha[hi] = ex2(m[hi] - ms[hi]);
      m[hi] = mn;
      l[hi] *= alpha[hi];
    }
    weights<kCheck>(s, ms, std::integral_constant<int, 0>());
  }

  // the per-element transform, unrolled at compile time (element indices are template arguments:
  // MufuBudget picks each element's lg2 / ex2 statically)
  template <bool kCheck, int kE>
  SSA_DEVICE void transform(float (&s)[kNT][4], float (&mx)[2], const Seq& seq, const LogitCtx& ctx, int n0,
                            std::integral_constant<int, kE>) {
    if constexpr (kE < 4 * kNT) {
      constexpr int nt = kE / 4, i = kE % 4, hi = i / 2;
      float x;
      if constexpr (kCheck) {
        typename Score::Elem el;
        x = Score::logit(ctx, s[nt][i], mult[hi], el);
        const int col = n0 + Frag::col(lane, nt) + (i & 1);
        const int row = row0 + hi * Frag::kHi;
        if (col >= seq.len_k() || (seq.causal() && col > row)) x = neg_inf();
      } else {
        x = Score::template x<Mufu::template kPolyLg2At<kE>>(ctx, s[nt][i]);
      }
      s[nt][i] = x;
      mx[hi] = fmaxf(mx[hi], x);
      transform<kCheck>(s, mx, seq, ctx, n0, std::integral_constant<int, kE + 1>());
    }
  }

  template <bool kCheck, int kE>
  SSA_DEVICE void weights(float (&s)[kNT][4], const float (&ms)[2], std::integral_constant<int, kE>) {
    if constexpr (kE < 4 * kNT) {
      constexpr int nt = kE / 4, i = kE % 4, hi = i / 2;
      const float w = kCheck ? ex2(s[nt][i] - ms[hi]) : Mufu::template exp2<kE>(fmaf(s[nt][i], mult[hi], -ms[hi]));
      s[nt][i] = w;
      l[hi] += w;
      weights<kCheck>(s, ms, std::integral_constant<int, kE + 1>());
    }
  }

  SSA_DEVICE void rescale_o(const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      o[dt][0] *= alpha[0];
      o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1];
      o[dt][3] *= alpha[1];
    }
  }

  SSA_DEVICE void softmax_at(bool check, float (&s)[kNT][4], float (&alpha)[2], const Seq& seq,
                             const LogitCtx& ctx, int n0) {
    if (check) softmax<true>(s, alpha, seq, ctx, n0);
    else softmax<false>(s, alpha, seq, ctx, n0);
  }

  // Key block `it` >= 1 of the order (see the file comment); pos moves on to its stage.
  template <bool kCheck>
  SSA_DEVICE void step(FwdSharedStorage<Tr>& ss, const T* sQ, const Seq& seq, const LogitCtx& ctx,
                       const FwdKeyBlocks& kb, int c, int it, Pos& pos, float (&s)[kNT][4], uint32_t (&pa)[kBN / 16][4],
                       float (&alpha)[2]) {
    constexpr int kTurnThreads = Tr::kConsumerThreads;
    const Pos prev = pos;
    pos.advance();
    if (Tr::kFault == kFaultWrongKPhase) mbar_wait(&ss.ring.full[Tr::kPartK][pos.stage], pos.phase ^ 1);
    else ss.ring.wait(pos, Tr::kPartK);
    named_bar_sync(turn_barrier(c), kTurnThreads);
    issue_s(s, sQ, ss.k[pos.stage]);
    if (Tr::kFault != kFaultNoVWait) ss.ring.wait(prev, Tr::kPartV);
    if (Tr::kFault == kFaultEarlyRelease) ss.ring.release(prev);
    issue_pv(pa, ss.v[prev.stage]);
    named_bar_arrive(turn_barrier(1 - c), kTurnThreads);
    wgmma_wait<1>();  // S_j; O += P V still in flight
    wgmma_fence_operand(s);
    softmax<kCheck>(s, alpha, seq, ctx, kb.block(it) * kBN);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    wgmma_fence_operand(pa);  // (P_{j-1}'s registers stay untouched until its GEMM is done)
    if (Tr::kFault != kFaultEarlyRelease) ss.ring.release(prev);
    rescale_o(alpha);
    acc_to_frag<T, kBN>(pa, s);
  }

  // The whole key-block loop of consumer warpgroup c (0 / 1) over kb (kb.n >= 1). sQ: this
  // warpgroup's 64 rows of the Q tile.
  SSA_DEVICE void run(FwdSharedStorage<Tr>& ss, const T* sQ, const Seq& seq, const LogitCtx& ctx,
                      const FwdKeyBlocks& kb, int c) {
    constexpr int kTurnThreads = Tr::kConsumerThreads;
    float s[kNT][4];
    uint32_t pa[kBN / 16][4];
    float alpha[2];
    Pos pos;

    // first block: S, its weights (no O yet)
    ss.ring.wait(pos, Tr::kPartK);
    named_bar_sync(turn_barrier(c), kTurnThreads);
    issue_s(s, sQ, ss.k[pos.stage]);
    named_bar_arrive(turn_barrier(1 - c), kTurnThreads);
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    softmax_at(kb.n_checked > 0, s, alpha, seq, ctx, kb.block(0) * kBN);
    acc_to_frag<T, kBN>(pa, s);

    // the other checked blocks, then the interior ones (loops of their own: the interior loop
    // holds no check, and the static audit counts it alone)
    int it = 1;
    for (; it < kb.n_checked; ++it) step<true>(ss, sQ, seq, ctx, kb, c, it, pos, s, pa, alpha);
    for (; it < kb.n; ++it) step<false>(ss, sQ, seq, ctx, kb, c, it, pos, s, pa, alpha);

    // the last block's P V
    ss.ring.wait(pos, Tr::kPartV);
    named_bar_sync(turn_barrier(c), kTurnThreads);
    issue_pv(pa, ss.v[pos.stage]);
    // (the second warpgroup's last turn has no one to hand over to: the first has none left)
    if (c == 0) named_bar_arrive(turn_barrier(1), kTurnThreads);
    wgmma_wait<0>();
    wgmma_fence_operand(o);
    ss.ring.release(pos);
  }
};

}  // namespace hopper
}  // namespace ssa_flash
