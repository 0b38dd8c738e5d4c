// The adaptive temperature's first pass on sm_90a, warp-specialised as the forward (fwd_kernel.h,
// docs/design.md section 4.4): per query row the softmax entropy H and the LSE of the row's logits
// l = phi(z) (the temperature is what this pass decides, so beta = 1 here), written to p.entropy
// and p.lse as today's attn_row_entropy_kernel (csrc/fwd_kernel.h) does, with the same maths
// (csrc/row_entropy.h: base 2, the running max m, lam = sum 2^(l2 - m) and the centred
// kc = sum 2^(l2 - m) (l2 - m), per-thread partials summed over the quad at the end).
//
// CTA (384 threads): warpgroup 0 the producer (setmaxnreg 24; one elected thread loads Q once and K
// of every key block into a ring: no V, so the ring has one part per stage and more stages than the
// forward's), warpgroups 1 and 2 the consumers (setmaxnreg 240), 64 query rows each. Per key block,
// in the forward's order (fwd_mainloop.h FwdKeyBlocks: the masked blocks first):
//
//   wait K_{j+1} | turn | issue S_{j+1} = Q K_{j+1}^T | hand the turn over | wait for S_j
//   (wgmma.wait_group 1: S_{j+1} still running) | free stage j | the logits of S_j into m, lam, kc
//
// so one interior block's transform runs under the next block's GEMM, and the turn lets one
// warpgroup's transform run under the other's GEMM (ping-pong). Two S accumulators (the loop is
// unrolled by two so they swap roles without copies); the masked blocks, first in the order, one
// at a time. Takes what fwd_ws_declines takes (no masks, sinks or
// soft-capping: those keep today's kernel; dense or packed sequences, attn_row_entropy_ws_varlen_kernel);
// an empty row gets H = 0 and LSE = -inf.
#pragma once

#include "../fast_math.h"
#include "../frag.h"
#include "../gemm_wgmma.h"
#include "../logits.h"
#include "../pipeline.h"
#include "../row_entropy.h"
#include "../smem_layout.h"
#include "fwd_mainloop.h"
#include "fwd_params.h"
#include "fwd_traits.h"
#include "named_barriers.h"
#include "ring.h"
#include "tile_scheduler.h"

namespace ssa_flash {
namespace hopper {

template <int kHeadDim_, typename Elem_>
struct WsRowEntropyTraits : WsQueryTileTraits<kHeadDim_, Elem_> {
  // Q 32 KB + 4 x K 32 KB = 160 KB at D 128; Q 16 KB + 6 x K 16 KB = 112 KB at D 64 (the forward's
  // footprints, V's share given to more stages of K)
  static constexpr int kStages = kHeadDim_ <= 64 ? 6 : 4;
  using Ring = TmaRing<kStages, 1>;
};

template <typename Tr>
struct RowEntropySharedStorage {
  using T = typename Tr::T;
  T q[Tr::kQElems];
  T k[Tr::kStages][Tr::kKElems];
  typename Tr::Ring ring;
  OnceBarrier q_full;
};

template <typename Tr>
constexpr int ws_row_entropy_smem_bytes() {
  return static_cast<int>(sizeof(RowEntropySharedStorage<Tr>)) + 1024;
}

// The producer's elected thread: Q once, then K of every key block into the ring.
template <typename Tr, typename Seq>
SSA_DEVICE void row_entropy_produce(const HopperFwdParams& hp, RowEntropySharedStorage<Tr>& ss, const Tile& tile,
                                    const Seq& seq, int m0, const FwdKeyBlocks& kb) {
  constexpr int kD = Tr::kHeadDim, kBN = Tr::kBlockN;
  prefetch_tma_desc(&hp.tma_q);
  prefetch_tma_desc(&hp.tma_k);
  if (kb.n == 0) return;
  tma_load_tile<Tr::kBlockM, kD>(ss.q, &hp.tma_q, ss.q_full.arm(tma_tile_bytes<Tr::kBlockM, kD>()), seq.q_row() + m0,
                                 tile.head, seq.tma_batch());
  typename Tr::Ring::Pos pos;
  for (int it = 0; it < kb.n; ++it) {
    ss.ring.acquire(pos);
    tma_load_tile<kBN, kD>(ss.k[pos.stage], &hp.tma_k, ss.ring.arm(pos, 0, tma_tile_bytes<kBN, kD>()),
                           seq.k_row() + kb.block(it) * kBN, tile.head_kv, seq.tma_batch());
    pos.advance();
  }
}

// One consumer warpgroup's row statistics and steps (see above). Each thread holds two rows
// (row0, row0 + Frag::kHi) of the 64 x 128 score tile in wgmma's accumulator layout.
template <typename Tr, typename Score, bool kVarlen>
struct RowEntropyConsumer {
  using T = typename Tr::T;
  static constexpr int kD = Tr::kHeadDim, kBN = Tr::kBlockN;
  static constexpr int kNT = kBN / 8;
  using Pos = typename Tr::Ring::Pos;
  using Seq = QuerySeq<kVarlen>;

  float m[2], lam[2], kc[2];  // base 2: running max, sum of 2^(l2 - m), sum of 2^(l2 - m) (l2 - m)
  float mult;                 // Score::mult at beta = 1
  int row0, lane;

  SSA_DEVICE void init(const LogitCtx& ctx, int row_first) {
    lane = static_cast<int>(threadIdx.x) & 31;
    row0 = row_first;
    mult = Score::mult(ctx, 1.0f);
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      m[hi] = neg_inf();
      lam[hi] = 0.0f;
      kc[hi] = 0.0f;
    }
  }

  // S of key block `it` of the order into s, issued in consumer c's turn; the turn handed over
  // after (except by the second warpgroup's last issue: the first has no turn left to take).
  SSA_DEVICE void issue(RowEntropySharedStorage<Tr>& ss, const T* sQ, const Pos& pos, int c, int it, int n,
                        float (&s)[kNT][4]) {
    ss.ring.wait(pos, 0);
    named_bar_sync(turn_barrier(c), Tr::kConsumerThreads);
    wgmma_fence_operand(s);
    wg_gemm_nt<T, kBN, kD, typename Tr::QTile, typename Tr::KTile>(s, sQ, ss.k[pos.stage]);
    wgmma_commit();
    if (c == 0 || it + 1 < n) named_bar_arrive(turn_barrier(1 - c), Tr::kConsumerThreads);
  }

  // The logits of key block n0's scores s into (m, lam, kc); kCheck: keys past len_k and, under
  // causal, keys past the row are left out. (The logits go to an array of their own: written over
  // s, ptxas sees non-wgmma instructions define wgmma accumulators inside the other S's pipeline
  // stage and serialises every wgmma, C7515.)
  template <bool kCheck>
  SSA_DEVICE void update(const float (&s)[kNT][4], const Seq& seq, const LogitCtx& ctx, int n0) {
    float x[kNT][4];
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int hi = i >> 1;
        typename Score::Elem el;
        float l2 = Score::logit(ctx, s[nt][i], mult, el);
        if (kCheck) {
          const int col = n0 + Frag::col(lane, nt) + (i & 1);
          if (col >= seq.len_k() || (seq.causal() && col > row0 + hi * Frag::kHi)) l2 = neg_inf();
        }
        x[nt][i] = l2;
      }
    }
    row_entropy_update<kCheck>(m, lam, kc, x);
  }

  // Block `it`'s S (in s, its GEMM completed) into the statistics; its stage freed (the GEMM was
  // the stage's one reader).
  template <bool kCheck>
  SSA_DEVICE void consume(RowEntropySharedStorage<Tr>& ss, const Seq& seq, const LogitCtx& ctx,
                          const FwdKeyBlocks& kb, int it, Pos& pos, float (&s)[kNT][4]) {
    wgmma_fence_operand(s);
    ss.ring.release(pos);
    pos.advance();
    update<kCheck>(s, seq, ctx, kb.block(it) * kBN);
  }

  // Every key block of kb (kb.n >= 1) for consumer warpgroup c; sQ its 64 rows of the Q tile. The
  // masked blocks (first in the order, usually one or two) one at a time; the interior ones with
  // the next block's S in flight while the current one is reduced, in s0 and s1 by turns. No
  // path through the branches below reads or reissues an S still in flight (the tail's two cases
  // are written out whole: with a shared middle, ptxas injects a wait, C7517), so ptxas keeps the
  // wgmma asynchronous (the SASS test checks wgmma.wait_group 1).
  SSA_DEVICE void run(RowEntropySharedStorage<Tr>& ss, const T* sQ, const Seq& seq, const LogitCtx& ctx,
                      const FwdKeyBlocks& kb, int c) {
    float s0[kNT][4], s1[kNT][4];
    Pos pos, ahead;  // the stage of the block to reduce next, of the block to issue next
    int it = 0;
#pragma unroll 1
    for (; it < kb.n_checked; ++it) {
      issue(ss, sQ, ahead, c, it, kb.n, s0);
      ahead.advance();
      wgmma_wait<0>();
      consume<true>(ss, seq, ctx, kb, it, pos, s0);
    }
    if (it == kb.n) return;
    issue(ss, sQ, ahead, c, it, kb.n, s0);
    ahead.advance();
#pragma unroll 1
    for (; it + 2 < kb.n; it += 2) {  // (S_it in s0 in flight)
      issue(ss, sQ, ahead, c, it + 1, kb.n, s1);
      ahead.advance();
      wgmma_wait<1>();
      consume<false>(ss, seq, ctx, kb, it, pos, s0);
      issue(ss, sQ, ahead, c, it + 2, kb.n, s0);
      ahead.advance();
      wgmma_wait<1>();
      consume<false>(ss, seq, ctx, kb, it + 1, pos, s1);
    }
    if (it + 1 < kb.n) {
      issue(ss, sQ, ahead, c, it + 1, kb.n, s1);
      wgmma_wait<1>();
      consume<false>(ss, seq, ctx, kb, it, pos, s0);
      wgmma_wait<0>();
      consume<false>(ss, seq, ctx, kb, it + 1, pos, s1);
    } else {
      wgmma_wait<0>();
      consume<false>(ss, seq, ctx, kb, it, pos, s0);
    }
  }

  // H (0 for a row with no admissible key) and the LSE (-inf there), by the row's first lane.
  SSA_DEVICE void finish(const FwdParams& p, const Seq& seq) const {
    const int64_t stat0 = seq.stat0();
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
      row_entropy_store(p, stat0, row0 + hi * Frag::kHi, seq.len_q(), m[hi], lam[hi], kc[hi], lane);
  }
};

// One CTA of the pass; kVarlen: packed sequences (tile_scheduler.h QuerySeq), a compile-time switch.
template <typename Tr, typename Score, bool kVarlen>
SSA_DEVICE void row_entropy_ws_cta(const HopperFwdParams& hp) {
#if defined(__CUDA_ARCH__) && !SSA_FLASH_WGMMA
  (void)hp;
  __trap();  // (another architecture of a multi-architecture build: never launched there)
#else
  using T = typename Tr::T;
  const FwdParams& p = hp.p;
#ifdef SSA_FLASH_EMULATE
  uint4* const smem_raw = ssa_flash::smem_raw;
#else
  extern __shared__ uint4 smem_raw[];
#endif
  RowEntropySharedStorage<Tr>& ss = *align_smem_1024<RowEntropySharedStorage<Tr>>(smem_raw);

  const Tile tile = SingleTileScheduler::query_tile(p);
  const int m0 = tile.block * Tr::kBlockM;
  const QuerySeq<kVarlen> seq(p, tile);
  if (kVarlen && m0 >= seq.len_q()) return;  // (the grid covers the longest sequence)
  const FwdKeyBlocks kb = fwd_key_blocks(seq, m0, Tr::kBlockM, Tr::kBlockN);

  if (!ws_start<Tr>(ss, [&] { row_entropy_produce<Tr>(hp, ss, tile, seq, m0, kb); })) return;
  const int c = warpgroup_idx() - 1;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const LogitCtx ctx = Score::template setup<false>(p, tile.batch, tile.head);
  RowEntropyConsumer<Tr, Score, kVarlen> cons;
  cons.init(ctx, m0 + 64 * c + 16 * warp_idx_in_warpgroup() + Frag::row(lane));
  if (kb.n > 0) {
    if (c == 1) named_bar_arrive(turn_barrier(0), Tr::kConsumerThreads);  // consumer 0 issues first
    ss.q_full.wait();
    cons.run(ss, ss.q + Tr::QTile::offset(64 * c, 0), seq, ctx, kb, c);
  }
  cons.finish(p, seq);
#endif
}

template <typename Tr, typename Score>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    attn_row_entropy_ws_kernel(const __grid_constant__ HopperFwdParams hp) {
  row_entropy_ws_cta<Tr, Score, false>(hp);
}

// packed sequences (FwdParams cu_seqlens_q / cu_seqlens_k)
template <typename Tr, typename Score>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    attn_row_entropy_ws_varlen_kernel(const __grid_constant__ HopperFwdParams hp) {
  row_entropy_ws_cta<Tr, Score, true>(hp);
}

}  // namespace hopper
}  // namespace ssa_flash
