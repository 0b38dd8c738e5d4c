// The sm_90a warp-specialised forward (docs/design.md section 4.4), built from the parts beside it:
// fwd_traits.h (tiles, register budgets, shared storage), tile_scheduler.h, fwd_mainloop.h (the
// producer's loads, a consumer's key-block loop), fwd_epilogue.h (O through shared memory and a
// TMA store), named_barriers.h, ring.h.
// Templated on the score policy (logits.h) and the adaptive temperature (beta per row, given).
//
// CTA (384 threads): warpgroup 0 the producer (setmaxnreg down to 24; one elected thread issues
// every TMA load), warpgroups 1 and 2 the consumers (setmaxnreg up to 240), rows 64 (wg - 1) ..
// of the 128-row query tile each. Takes: any score function, adaptive or not, causal (top-left) or
// not, GQA, any Lq, Lk (ragged ends), dense or packed variable-length sequences
// (attn_fwd_ws_varlen_kernel), head dims up to 64 / 128 padded; no masks, dropout, windows, sinks
// or soft-capping (fwd_launch.h routes those to csrc/fwd_kernel.h).
#pragma once

#include "../logits.h"
#include "../pipeline.h"
#include "../smem_layout.h"
#include "fwd_epilogue.h"
#include "fwd_mainloop.h"
#include "fwd_params.h"
#include "fwd_traits.h"
#include "named_barriers.h"
#include "tile_scheduler.h"

namespace ssa_flash {
namespace hopper {

// One CTA of the forward (the kernels below); kVarlen: packed sequences (FwdParams cu_seqlens_*,
// tile_scheduler.h QuerySeq), a compile-time switch: the dense kernel's code is as without it.
template <typename Tr, typename Score, bool kAdaptive, bool kVarlen>
SSA_DEVICE void fwd_ws_cta(const HopperFwdParams& hp) {
#if defined(__CUDA_ARCH__) && !SSA_FLASH_WGMMA
  // compiled for another architecture in a multi-architecture build: never launched there
  // (fwd_ws_declines takes sm_90 only), so no code
  (void)hp;
  __trap();
#else
  using T = typename Tr::T;
  const FwdParams& p = hp.p;
#ifdef SSA_FLASH_EMULATE
  uint4* const smem_raw = ssa_flash::smem_raw;  // (the emulation's; a block-scope extern would name hopper::smem_raw)
#else
  extern __shared__ uint4 smem_raw[];
#endif
  FwdSharedStorage<Tr>& ss = *align_smem_1024<FwdSharedStorage<Tr>>(smem_raw);

  const Tile tile = SingleTileScheduler::query_tile(p);
  const int m0 = tile.block * Tr::kBlockM;
  const QuerySeq<kVarlen> seq(p, tile);
  if (kVarlen && m0 >= seq.len_q()) return;  // (the grid covers the longest sequence)
  const FwdKeyBlocks kb = fwd_key_blocks(seq, m0, Tr::kBlockM, Tr::kBlockN);

  if (!ws_start<Tr>(ss, [&] { fwd_produce<Tr>(hp, ss, tile, seq, m0, kb); })) return;
  const int c = warpgroup_idx() - 1;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  LogitCtx ctx = Score::template setup<false>(p, tile.batch, tile.head);
  const bool negate_q = Score::nonneg(ctx);
  FwdConsumer<Tr, Score, kAdaptive, kVarlen> cons;
  cons.init(p, seq, ctx, m0 + 64 * c + 16 * warp_idx_in_warpgroup() + Frag::row(lane));
  T* const sQ = ss.q + Tr::QTile::offset(64 * c, 0);  // this warpgroup's 64 rows (then its O's)
  if (kb.n > 0) {
    if (c == 1) named_bar_arrive(turn_barrier(0), Tr::kConsumerThreads);  // consumer 0 issues first
    ss.q_full.wait();
    if (negate_q) {
      // n sgn(s) = |n| sgn(-s): this warpgroup's 64 rows of Q negated once (sign bits; each panel's
      // rows 64 c .. 64 c + 63 are contiguous), visible to its wgmma after the proxy fence
      const int t = static_cast<int>(threadIdx.x) % 128;
#pragma unroll 1
      for (int panel = 0; panel < Tr::kHeadDim / 64; ++panel) {
        uint4* rows = reinterpret_cast<uint4*>(sQ + panel * Tr::QTile::kPanelElems);
        for (int i = t; i < 64 * 64 / 8; i += 128) {
          uint4 w = rows[i];
          w.x ^= 0x80008000u;
          w.y ^= 0x80008000u;
          w.z ^= 0x80008000u;
          w.w ^= 0x80008000u;
          rows[i] = w;
        }
      }
      fence_proxy_async();
      named_bar_sync(warpgroup_barrier(c), 128);
    }
    cons.run(ss, sQ, seq, ctx, kb, c);
  }
  fwd_epilogue<Tr, kVarlen>(hp, sQ, cons.o, cons.m, cons.l, cons.row0, m0 + 64 * c, c, seq, tile.head, lane);
#endif
}

// dense (B, H, L, D) tensors
template <typename Tr, typename Score, bool kAdaptive>
__global__ void __launch_bounds__(Tr::kThreads, 1) attn_fwd_ws_kernel(const __grid_constant__ HopperFwdParams hp) {
  fwd_ws_cta<Tr, Score, kAdaptive, false>(hp);
}

// packed sequences (FwdParams cu_seqlens_q / cu_seqlens_k; grid: the longest sequence's tiles)
template <typename Tr, typename Score, bool kAdaptive>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    attn_fwd_ws_varlen_kernel(const __grid_constant__ HopperFwdParams hp) {
  fwd_ws_cta<Tr, Score, kAdaptive, true>(hp);
}

}  // namespace hopper
}  // namespace ssa_flash
