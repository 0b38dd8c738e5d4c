// The consumers' step of the sm_90a backward (bwd_tile.h): for one 64-row query block of one
// query head, against this warpgroup's 64 keys of the CTA's 128.
//
// Per step, consumer warpgroup c (keys n0 + 64 c ..), in the layout of the transposed scores
// (rows keys, columns queries: wgmma's m64 is the warpgroup's keys):
//   S^T = K_c Q^T, dP^T = V_c dO^T   (wgmma, both operands in shared memory)
//   P^T, dS^T = score_grad(S^T, dP^T, row statistics of the columns)   (bwd_kernel.h)
//   dS^T -> shared memory            (this warpgroup's 64 rows of the step's dS^T buffer)
//   dV += P^T dO                     (wgmma, P^T from registers)
//     (these four over all 64 queries at once or in two parts of 32, as bwd_tile.h's BwdSplit
//     says per instance: BwdConsumer::scores_and_dv)
//   barrier of both consumers        (dS^T complete)
//   dK += dS^T Q                     (wgmma, dS^T from shared memory, Q N-major: bwd_gemm.h)
//   dQ_part = dS K                   (wgmma, both operands MN-major: bwd_gemm.h)
//   wait for dV / dK: the stage (Q, dO, statistics) is released to the producer
//   wait for dQ: red.global.add into the float32 accumulator (dQ / scale)
// D = 128: dQ_part is the columns of panel c over all 128 keys; D = 64: every column over the
// warpgroup's own 64 keys (BwdTile::kDqSplitCols). The dS^T buffers alternate per step: the
// barrier of step i + 1 comes after both consumers' dQ GEMMs of step i, so the buffer of step i is
// free again at step i + 2.
#pragma once

#include "../bwd_kernel.h"  // RowStats, load_row_stats, score_grad
#include "../frag.h"
#include "../gemm_wgmma.h"
#include "../memory.h"
#include "bwd_gemm.h"
#include "named_barriers.h"
#include "bwd_tile.h"

namespace ssa_flash {
namespace hopper {

// Deliberately broken variants of the kernel, which the emulation must report (tests/cuda/
// test_hopper_bwd.py): a consumer that never waits for a stage to be full, a producer waiting on
// the empty barrier with the wrong parity, consumers that release a stage as soon as it is full
// (before their GEMMs read it), and consumers that never release it.
enum BwdBug : int { kBwdOk = 0, kBwdNoFullWait, kBwdWrongEmptyParity, kBwdEarlyRelease, kBwdNoRelease, kBwdBugs };

// One consumer warpgroup's state over the CTA's steps: its 64 keys' dK / dV accumulators (rows
// 16 w + g (+ 8) of warp w, the wgmma layout) and this thread's sums of the score function's
// parameter terms (logits.h, Score::grad; per query head, reset by the caller).
template <typename Tile, typename Score, bool kAdaptive, int kBug = kBwdOk>
struct BwdConsumer {
  using T = typename Tile::Elem;
  static constexpr int kD = Tile::kD, kM = Tile::kBlockM;
  static constexpr int kNStat = BwdStatLayout<Tile, kAdaptive>::kCount;
  // How a step's 64 queries are split (see step), per instance what ptxas compiled without spills
  // (bwd_tile.h, bwd_split)
  static constexpr BwdSplit kSplit = bwd_split<kD, Score::kParams, kAdaptive>();
  static constexpr int kParts = kSplit == kSplitWhole ? 1 : 2;
  static constexpr int kQ = kM / kParts;  // queries per part
  using QTile = typename Tile::QTile;
  using KTile = typename Tile::KTile;
  using DsTile = typename Tile::DsTile;

  float dk[kD / 8][4];
  float dv[kD / 8][4];
  float dpar0, dpar1;
  int c, warp, lane;  // consumer warpgroup, warp in it, lane

  SSA_DEVICE void init(int consumer) {
    c = consumer;
    warp = warp_idx_in_warpgroup();
    lane = static_cast<int>(threadIdx.x) % 32;
    zero(dk);
    zero(dv);
    dpar0 = dpar1 = 0.0f;
  }

  // The gradients of queries [kQ part, kQ part + kQ) of a step: P^T (packed into pw, the A
  // fragments of that part's dV += P^T dO) and dS^T (before the final scale; into this
  // warpgroup's rows of the step's dS^T buffer, pairs of adjacent queries per 32-bit store).
  // Element (nt, i) of s / dp is key n0 + 64 c + 16 warp + g + 8 (i / 2), query
  // m + kQ part + 8 nt + 2 t + i % 2. Checks (kCheck): bounds and causality only (no window or
  // mask: bwd_launch.h routes them away).
  template <bool kCheck>
  SSA_DEVICE void grad_part(const BwdParams& p, const LogitCtx& ctx, int n0, int m, int part, float (&s)[kQ / 8][4],
                            float (&dp)[kQ / 8][4], const float* sStat, T* sDsT, uint32_t (&pw)[kQ / 16][4]) {
    // (lane and warp from a fresh read of the thread index: what derives from them stays inside
    // the step instead of being hoisted out of the loops and kept in registers across them)
    const int tid = thread_idx_again(), lane = tid % 32, warp = tid / 32 % 4;
    const int g = lane / 4, t = lane % 4;
    const int key_lo = n0 + 64 * c + 16 * warp + g;
    const int q0 = kQ * part;
#pragma unroll
    for (int nt = 0; nt < kQ / 8; ++nt) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int lq = q0 + 8 * nt + 2 * t + cc;
        const RowStats r = load_row_stats<kAdaptive>(sStat + lq * kNStat);  // (bwd_kernel.h)
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
          const int i = cc + 2 * hi;
          float pp;
          dp[nt][i] = score_grad<Score, kAdaptive, kCheck, true, false, false>(p, ctx, s[nt][i], dp[nt][i], m + lq,
                                                                             key_lo + 8 * hi, r, pp, dpar0, dpar1);
          s[nt][i] = pp;
        }
      }
    }
    acc_to_frag<T, kQ>(pw, s);
    uint32_t da[kQ / 16][4];
    acc_to_frag<T, kQ>(da, dp);
    // The stores' offsets from one: in the 128-byte swizzle (smem_layout.h, Sw128Tile) column
    // q0 + 8 k + 2 t of row r lies in 16-byte chunk ((q0 / 8 + k) ^ r) % 8 of the row, and
    // q0 / 8 + k = (q0 / 8) ^ k (q0 / 8 a multiple of 4 and k < 4, or q0 = 0), so its offset is
    // that of column q0 + 2 t with 8 k xored in; row r + 8 is 8 rows further (the same r % 8).
    // (Each offset through Sw128Tile::offset, as before, cost integer instructions per score and
    // the registers of their terms at the gradients' peak.)
    static_assert(DsTile::kRowElems == 64 && kM == 64 && kQ % 32 == 0,
                  "dS^T stores: one 64-column panel, parts of 32 or 64 queries");
    const int row_lo = 64 * c + 16 * warp + g;
    const int at0 = DsTile::offset(row_lo, q0 + 2 * t);
#pragma unroll
    for (int kk = 0; kk < kQ / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // (acc_to_frag: rows g, g + 8, g, g + 8; columns 2 t, 2 t, 2 t + 8, 2 t + 8)
        const int k = 2 * kk + (j >> 1);
        *reinterpret_cast<uint32_t*>(sDsT + ((at0 ^ (8 * k)) + 8 * DsTile::kRowElems * (j & 1))) = da[kk][j];
      }
    }
  }

  // Part h's S^T = K_c Q_h^T and dP^T = V_c dO_h^T (queries [kQ h, kQ h + kQ) of the step), one
  // wgmma group
  SSA_DEVICE void score_gemms(float (&s)[kQ / 8][4], float (&dp)[kQ / 8][4], int h, const T* sK, const T* sV,
                              const T* sQ, const T* sdO) {
    wg_gemm_nt<T, kQ, kD, KTile, QTile>(s, sK + KTile::offset(64 * c, 0), sQ + QTile::offset(h * kQ, 0));
    wg_gemm_nt<T, kQ, kD, KTile, QTile>(dp, sV + KTile::offset(64 * c, 0), sdO + QTile::offset(h * kQ, 0));
    wgmma_commit();
  }

  // Part h's dV += P_h^T dO_h (pw: P^T's A fragments of the part's queries), one wgmma group
  SSA_DEVICE void dv_gemm(const uint32_t (&pw)[kQ / 16][4], int h, const T* sdO) {
    wg_gemm_rn<T, kD, kQ, RowSlice<QTile, kQ>>(dv, pw, sdO + QTile::offset(h * kQ, 0));
    wgmma_commit();
  }

  // The parts' score GEMMs, gradients (dS^T into sDsT) and dV GEMMs, as kSplit says; on return
  // the last dV GEMM is the one wgmma group in flight.
  template <bool kCheck>
  SSA_DEVICE void scores_and_dv(const BwdParams& p, const LogitCtx& ctx, int n0, int m, const T* sK, const T* sV,
                                const T* sQ, const T* sdO, const float* sStat, T* sDsT) {
    if constexpr (kSplit == kSplitLooped) {
      // a loop, not unrolled: ptxas cannot move one part's gradient work into the other's
#pragma unroll 1
      for (int h = 0; h < kParts; ++h) {
        float s[kQ / 8][4], dp[kQ / 8][4];
        uint32_t pw[kQ / 16][4];
        score_gemms(s, dp, h, sK, sV, sQ, sdO);
        wgmma_wait<0>();  // (and the previous part's dV: pw is free again)
        wgmma_fence_operand(s);
        wgmma_fence_operand(dp);
        grad_part<kCheck>(p, ctx, n0, m, h, s, dp, sStat, sDsT, pw);
        dv_gemm(pw, h, sdO);
      }
      fence_proxy_async();  // (dS^T, for the dK and dQ GEMMs)
    } else {
      // every part's GEMMs at once, a later part's running while an earlier part's gradients
      // are computed
      float s[kParts][kQ / 8][4], dp[kParts][kQ / 8][4];
      uint32_t pw[kParts][kQ / 16][4];
#pragma unroll
      for (int h = 0; h < kParts; ++h) score_gemms(s[h], dp[h], h, sK, sV, sQ, sdO);
      wgmma_wait<kParts - 1>();
      wgmma_fence_operand(s[0]);
      wgmma_fence_operand(dp[0]);
      grad_part<kCheck>(p, ctx, n0, m, 0, s[0], dp[0], sStat, sDsT, pw[0]);
      if constexpr (kParts == 2) {
        wgmma_wait<0>();
        wgmma_fence_operand(s[1]);
        wgmma_fence_operand(dp[1]);
        grad_part<kCheck>(p, ctx, n0, m, 1, s[1], dp[1], sStat, sDsT, pw[1]);
      }
      fence_proxy_async();
      // dV += P^T dO over all the step's queries
      wg_gemm_rn<T, kD, kM, QTile>(dv, *reinterpret_cast<uint32_t(*)[kM / 16][4]>(&pw[0][0][0]), sdO);
      wgmma_commit();
    }
  }

  // One step: query rows [m, m + 64) of the query head whose (batch, head) row index is bh and
  // logit context ctx; sK, sV the CTA's tiles, sQ, sdO, sStat the stage's, sDsT the step's dS^T
  // buffer, full / empty the stage's mbarriers (parity: the stage's phase), dq_rows the float32
  // accumulator's row m of this head. kCheck: bounds and the causal diagonal (mask.h).
  template <bool kCheck>
  SSA_DEVICE void step(const BwdParams& p, const LogitCtx& ctx, int n0, int m, const T* sK, const T* sV,
                       const T* sQ, const T* sdO, const float* sStat, T* sDsT, uint64_t* full, uint64_t* empty,
                       uint32_t parity, float* dq_rows) {
    if (kBug != kBwdNoFullWait) mbar_wait(full, parity);
    if (kBug == kBwdEarlyRelease) mbar_arrive(empty);

    scores_and_dv<kCheck>(p, ctx, n0, m, sK, sV, sQ, sdO, sStat, sDsT);

    // once both consumers' dS^T are in place: dK += dS^T Q (A from shared memory: dS^T's registers
    // are free by now) and dQ (part) = dS K
    named_bar_sync(kBarConsumers, Tile::kConsumerThreads);  // (named_barriers.h)
    wg_gemm_sn<T, kD, kM, DsTile, QTile>(dk, sDsT + DsTile::offset(64 * c, 0), sQ);
    wgmma_commit();
    constexpr int kDqKeys = Tile::kDqSplitCols ? Tile::kBlockN : 64;
    const int key0 = Tile::kDqSplitCols ? 0 : 64 * c, col0 = Tile::kDqSplitCols ? 64 * c : 0;
    float dq[8][4];
    wg_gemm_tt<T, kDqKeys, DsTile, KTile>(dq, sDsT + DsTile::offset(key0, 0), sK + KTile::offset(key0, col0));
    wgmma_commit();
    wgmma_wait<1>();  // dV, dK: Q, dO and the statistics are no longer read
    wgmma_fence_operand(dv);
    wgmma_fence_operand(dk);
    if (kBug != kBwdEarlyRelease && kBug != kBwdNoRelease) mbar_arrive(empty);
    wgmma_wait<0>();
    wgmma_fence_operand(dq);
    // element (nt, i): query row 16 warp + g + 8 (i / 2), column col0 + 8 nt + 2 t + i % 2
    float* at = dq_rows + (16 * warp + lane / 4) * kD + col0 + 2 * (lane % 4);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      red_add2(at + 8 * nt, dq[nt][0], dq[nt][1]);
      red_add2(at + 8 * kD + 8 * nt, dq[nt][2], dq[nt][3]);
    }
  }
};

}  // namespace hopper
}  // namespace ssa_flash
