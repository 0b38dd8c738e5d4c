// The sm_90a warp-specialised backward kernel (bwd_tile.h for the roles, tile and shared memory;
// bwd_mainloop.h for the consumers' step; bwd_epilogue.h for the stores). Grid (ceil(Lk / 128),
// Hkv, B), 384 threads. Before it, the pre-pass (bwd_kernel.h, attn_bwd_dq_kernel with kPrep)
// writes the row statistics the producer loads (lse, delta and, adaptive, beta, lse_l, entropy,
// g); dQ / scale is added to p.dq_accum (zero on entry; the caller scales and converts it, as
// for today's fused backward). Without masks, dropout, windows, sinks and soft-capping (the
// dispatch, bwd_launch.h hopper_bwd_unsupported, routes those to today's kernels).
#pragma once

#include "../pipeline.h"
#include "bwd_epilogue.h"
#include "bwd_mainloop.h"
#include "bwd_tile.h"
#include "ring.h"  // tma_load_tile

namespace ssa_flash {

// (in ssa_flash, not ssa_flash::hopper: the dynamic shared memory is ssa_flash::smem_raw in the
// emulation, csrc/emu)
template <typename Tile, typename Score, bool kAdaptive, int kBug = hopper::kBwdOk>
__global__ void __launch_bounds__(Tile::kThreads, 1) hopper_bwd_kernel(const __grid_constant__ hopper::HopperBwdParams hp) {
  using namespace hopper;
  using T = typename Tile::Elem;
  using Smem = BwdSmem<Tile, kAdaptive>;
  constexpr int kStages = Tile::kStages, kM = Tile::kBlockM, kN = Tile::kBlockN, kD = Tile::kD;
  using Stats = BwdStatLayout<Tile, kAdaptive>;
  constexpr int kNStat = Stats::kCount;
  const BwdParams& p = hp.p;

  extern __shared__ uint4 smem_raw[];
  char* const smem = align_smem_1024<char>(smem_raw);
  T* const sK = reinterpret_cast<T*>(smem + Smem::kK);
  T* const sV = reinterpret_cast<T*>(smem + Smem::kV);
  auto stage = [&](int s) { return smem + Smem::kStage0 + s * Smem::kStageBytes; };
  T* const sDs = reinterpret_cast<T*>(smem + Smem::kDs);
  uint64_t* const kv_full = reinterpret_cast<uint64_t*>(smem + Smem::kBars);
  uint64_t* const full = kv_full + 1;
  uint64_t* const empty = full + kStages;

  const int key_block = blockIdx.x, hk = blockIdx.y, bb = blockIdx.z;
  const int n0 = key_block * kN;
  const BwdSteps steps = bwd_steps<Tile>(p, n0);

  if (threadIdx.x == 0) {
    mbar_init(kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);                         // the producer's arrive.expect_tx
      mbar_init(&empty[s], Tile::kConsumerThreads);  // every consumer thread, done with the stage
    }
    fence_mbar_init();
  }
  __syncthreads();

  const int wg = warpgroup_idx();
  if (wg == 0) {
    // producer: K, V once, then per step Q, dO (a load per 64-column panel) and the statistics
    setmaxnreg_dec<24>();
    if (warp_idx_in_warpgroup() == 0 && elect_one()) {
      prefetch_tma_desc(&hp.tma_q);
      prefetch_tma_desc(&hp.tma_do);
      prefetch_tma_desc(&hp.tma_k);
      prefetch_tma_desc(&hp.tma_v);
      prefetch_tma_desc(&hp.tma_stat);
      mbar_arrive_expect_tx(kv_full, Smem::kKvTxBytes);
      tma_load_tile<kN, kD>(sK, &hp.tma_k, kv_full, n0, hk, bb);
      tma_load_tile<kN, kD>(sV, &hp.tma_v, kv_full, n0, hk, bb);
      RingPos<kStages> pos;
      for (int head = 0; head < steps.group; ++head) {
        const int hh = hk * p.group + head, bh = bb * p.heads + hh;
        for (int tile = 0; tile < steps.tiles; ++tile) {
          const int m = steps.first + tile * kM;
          mbar_wait(&empty[pos.stage], kBug == kBwdWrongEmptyParity ? pos.phase : pos.phase ^ 1);
          char* const st = stage(pos.stage);
          uint64_t* const bar = &full[pos.stage];
          mbar_arrive_expect_tx(bar, Smem::kStepTxBytes);
          tma_load_tile<kM, kD>(reinterpret_cast<T*>(st + Smem::kQ), &hp.tma_q, bar, m, hh, bb);
          tma_load_tile<kM, kD>(reinterpret_cast<T*>(st + Smem::kDo), &hp.tma_do, bar, m, hh, bb);
          constexpr int kBox = Stats::kBox;
          for (int i = 0; i < Stats::kLoads; ++i)
            tma_load_2d(reinterpret_cast<float*>(st + Smem::kStat) + i * kBox, &hp.tma_stat, bar, kNStat * m + i * kBox,
                        bh);
          pos.advance();
        }
      }
    }
    return;
  }

  // consumers
  setmaxnreg_inc<240>();
  BwdConsumer<Tile, Score, kAdaptive, kBug> cons;
  cons.init(wg - 1);
  mbar_wait(kv_full, 0);
  // the ring position and the dS^T buffer of a step from its index `it` over the CTA's steps
  // (head * tiles + tile, counted): stage it % kStages, phase (it / kStages) % 2 (RingPos's),
  // dS^T buffer it % 2. Across the steps the consumers carry it and the step's first query row m
  // only: the list's first row and checked-step count are recomputed per head, and a head's steps
  // end where m reaches len_q (first + tiles kM is the first row from first in steps of kM at or
  // past len_q), so no step count is held across the step loop (held, it spilled D 128 SSA +
  // adaptive)
  static_assert(kStages == 2, "the consumers' ring position below: two stages");
  int it = 0;
  for (int head = 0; head < steps.group; ++head) {
    const int hh = hk * p.group + head;
    const LogitCtx ctx = Score::template setup<false>(p, bb, hh);
    float* const dq_head = p.dq_accum + (static_cast<int64_t>(bb) * p.heads + hh) * p.stat_rows * kD;
    auto run = [&](auto check, int m) {
      const int st_i = it & 1;
      char* const st = stage(st_i);
      cons.template step<decltype(check)::value>(
          p, ctx, n0, m, sK, sV, reinterpret_cast<const T*>(st + Smem::kQ), reinterpret_cast<const T*>(st + Smem::kDo),
          reinterpret_cast<const float*>(st + Smem::kStat), sDs + st_i * Tile::kDsElems, &full[st_i], &empty[st_i],
          static_cast<uint32_t>(it >> 1) & 1u, dq_head + static_cast<int64_t>(m) * kD);
      ++it;
    };
    const BwdSteps again = bwd_steps<Tile>(p, block_idx_x_again() * kN);
    int m = again.first;
    for (int tile = 0; tile < again.n_checked; ++tile, m += kM) run(Bool<true>(), m);
    for (; m < p.len_q; m += kM) run(Bool<false>(), m);
    store_dparams<Score, Tile::kConsumerWarps>(p, cons.dpar0, cons.dpar1, bb, hh, key_block, gridDim.x,
                                               thread_idx_again());
    cons.dpar0 = cons.dpar1 = 0.0f;
  }
  store_dk_dv<T, kD>(p, cons.dk, cons.dv, bb, hk, n0, thread_idx_again());
}

}  // namespace ssa_flash
