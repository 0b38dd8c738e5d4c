// A probe of csrc/pipeline.h: the skeleton of a warp-specialised sm_90a kernel, small enough to
// check exactly. One CTA of 384 threads: warpgroup 0 is the producer (setmaxnreg.dec 24), whose
// elected thread loads a 128 x 128 bf16 Q tile once and 64 x 128 K tiles through a 2-stage ring
// by TMA (full / empty mbarriers, transaction bytes); warpgroups 1 and 2 are consumers
// (setmaxnreg.inc 240), each computing S = Q K^T for its 64 rows of Q against every K tile by
// wgmma (both operands in shared memory, gemm_wgmma.h's wg_gemm_nt), in turns: consumer c waits
// on named barrier 1 + c before issuing its GEMM and then lets the other one go. Outputs: S
// (128 x 64 n_tiles, float), the row sums of S (a quad shuffle reduction), and the order in
// which the consumers issued their GEMMs (0, 1, 0, 1, ... when the ping-pong works).
//
// kBug selects a deliberately broken variant the emulator must report (tests/cuda/
// test_pipeline_emulated.py): a consumer that never arrives on the empty barrier, a producer
// that waits on the empty barrier with the wrong parity (both deadlock), producer warps with
// different setmaxnreg counts, a shuffle reached by half a warp, consumers that free a stage as
// soon as it is full, before their wgmma read it (a race: wrong results when the next load lands
// first), and misuses: named-barrier counts that disagree, an mbarrier never initialised, a
// swizzled TMA destination not 1024-byte aligned.
#pragma once

#include "gemm_wgmma.h"
#include "pipeline.h"
#include "smem_layout.h"

namespace ssa_flash {

enum ProbeBug : int {
  kProbeOk = 0,
  kProbeNoEmptyArrive,
  kProbeWrongEmptyParity,
  kProbeSplitSetmaxnreg,
  kProbeDivergentShfl,
  kProbeEarlyRelease,  // frees the stage as soon as it is full: the producer may overwrite it before the wgmma
  kProbeBarrierCounts,      // the two sides of the ping-pong barrier give different counts
  kProbeUninitialisedMbar,  // the producer arrives on an mbarrier nobody initialised
  kProbeMisalignedTma,      // a swizzled TMA load into a destination that is not 1024-byte aligned
  kProbeBugs
};

constexpr int kProbeD = 128, kProbeBM = 128, kProbeBN = 64, kProbeStages = 2, kProbeThreads = 384;
using ProbeQTile = Sw128Tile<kProbeBM>;
using ProbeKTile = Sw128Tile<kProbeBN>;
constexpr int kProbeQElems = ProbeQTile::elems(kProbeBM, kProbeD);
constexpr int kProbeKElems = ProbeKTile::elems(kProbeBN, kProbeD);
// Q, the ring, 1 + 2 kStages mbarriers and the issue ticket, plus the 1024-byte alignment slack
constexpr int kProbeSmemBytes = 2 * (kProbeQElems + kProbeStages * kProbeKElems) + 8 * (1 + 2 * kProbeStages) + 16 + 1024;

struct ProbeParams {
  TmaDesc tma_q;  // Q (rows x 128 bf16, row-major): box 64 columns x 128 rows, 128-byte swizzle
  // K (rows x 128 bf16): box 64 x 64 (k_rank 2, one load per 64-column panel), or K viewed as
  // (64 columns, rows, 2 panels) with strides (row, 128 bytes) and box 64 x 64 x 2 (k_rank 3: one
  // load, box order = the tile's panels; checked by the emulation only: whether
  // cuTensorMapEncodeTiled takes a stride below the previous dimension's is for a GPU run to say)
  TmaDesc tma_k;
  int k_rank;
  float* s;       // [128][64 n_tiles]
  float* rowsum;  // [128]
  int* order;     // [2 n_tiles]: the consumer that issued each GEMM, in issue order
  int n_tiles;
};

template <int kBug>
__global__ void __launch_bounds__(kProbeThreads, 1) ws_probe_kernel(const __grid_constant__ ProbeParams p) {
  using T = __nv_bfloat16;
  extern __shared__ uint4 smem_raw[];
  T* const sQ = align_smem_1024<T>(smem_raw);
  T* const sK = sQ + kProbeQElems;
  uint64_t* const q_full = reinterpret_cast<uint64_t*>(sK + kProbeStages * kProbeKElems);
  uint64_t* const full = q_full + 1;
  uint64_t* const empty = full + kProbeStages;
  int* const ticket = reinterpret_cast<int*>(empty + kProbeStages);
  constexpr int kConsumerThreads = 256;

  if (threadIdx.x == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < kProbeStages; ++s) {
      mbar_init(&full[s], 1);                   // the producer's arrive.expect_tx
      mbar_init(&empty[s], kConsumerThreads);  // every consumer thread, once done with the stage
    }
    *ticket = 0;
    fence_mbar_init();
  }
  __syncthreads();

  const int wg = warpgroup_idx();
  if (wg == 0) {
    // producer
    if (kBug == kProbeSplitSetmaxnreg && warp_idx_in_warpgroup() == 1) setmaxnreg_dec<32>();
    else setmaxnreg_dec<24>();
    if (warp_idx_in_warpgroup() == 0 && elect_one()) {
      prefetch_tma_desc(&p.tma_q);
      prefetch_tma_desc(&p.tma_k);
      mbar_arrive_expect_tx(kBug == kProbeUninitialisedMbar ? q_full + 1 + 2 * kProbeStages : q_full, kProbeQElems * 2);
      for (int panel = 0; panel < kProbeD / 64; ++panel)
        tma_load_2d(sQ + panel * ProbeQTile::kPanelElems + (kBug == kProbeMisalignedTma ? 64 : 0), &p.tma_q, q_full,
                    64 * panel, 0);
      RingPos<kProbeStages> pos;
      for (int j = 0; j < p.n_tiles; ++j) {
        mbar_wait(&empty[pos.stage], kBug == kProbeWrongEmptyParity ? pos.phase : pos.phase ^ 1);
        T* const stage = sK + pos.stage * kProbeKElems;
        mbar_arrive_expect_tx(&full[pos.stage], kProbeKElems * 2);
        if (p.k_rank == 3) {
          tma_load_3d(stage, &p.tma_k, &full[pos.stage], 0, kProbeBN * j, 0);
        } else {
          for (int panel = 0; panel < kProbeD / 64; ++panel)
            tma_load_2d(stage + panel * ProbeKTile::kPanelElems, &p.tma_k, &full[pos.stage], 64 * panel, kProbeBN * j);
        }
        pos.advance();
      }
    }
    return;
  }

  // consumers: c = 0, 1 owns rows 64 c .. 64 c + 63
  setmaxnreg_inc<240>();
  const int c = wg - 1;
  const int warp = warp_idx_in_warpgroup(), lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  if (c == 1)  // consumer 0 issues first
    named_bar_arrive(kFirstNamedBarrier + 0, kBug == kProbeBarrierCounts ? kConsumerThreads + 128 : kConsumerThreads);
  float rowsum[2] = {0.0f, 0.0f};
  mbar_wait(q_full, 0);
  RingPos<kProbeStages> pos;
  for (int j = 0; j < p.n_tiles; ++j) {
    mbar_wait(&full[pos.stage], pos.phase);
    if (kBug == kProbeEarlyRelease) mbar_arrive(&empty[pos.stage]);
    float acc[kProbeBN / 8][4];
    named_bar_sync(kFirstNamedBarrier + c, kConsumerThreads);
    if (threadIdx.x % 128 == 0) p.order[(*ticket)++] = c;
    wg_gemm_nt<T, kProbeBN, kProbeD, ProbeQTile, ProbeKTile>(acc, sQ + ProbeQTile::offset(64 * c, 0),
                                                               sK + pos.stage * kProbeKElems);
    wgmma_commit();
    // the other consumer may issue now (consumer 1's last turn has no one to hand over to)
    if (!(c == 1 && j == p.n_tiles - 1)) named_bar_arrive(kFirstNamedBarrier + (1 - c), kConsumerThreads);
    wgmma_wait<0>();
    wgmma_fence_operand(acc);
    if (kBug != kProbeNoEmptyArrive && kBug != kProbeEarlyRelease) mbar_arrive(&empty[pos.stage]);
    pos.advance();
#pragma unroll
    for (int nt = 0; nt < kProbeBN / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = 64 * c + 16 * warp + g + 8 * (i / 2);
        p.s[row * (kProbeBN * p.n_tiles) + kProbeBN * j + 8 * nt + 2 * t + (i % 2)] = acc[nt][i];
        rowsum[i / 2] += acc[nt][i];
      }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (kBug != kProbeDivergentShfl || lane < 16) {
      rowsum[h] += __shfl_xor_sync(0xffffffffu, rowsum[h], 1);
      rowsum[h] += __shfl_xor_sync(0xffffffffu, rowsum[h], 2);
    }
    if (t == 0) p.rowsum[64 * c + 16 * warp + g + 8 * h] = rowsum[h];
  }
}

}  // namespace ssa_flash
