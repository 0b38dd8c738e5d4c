// Host side of the sm_90a backward: which calls it runs (hopper_bwd_unsupported, the one routing
// decision), its plan (buffers), the tensor maps, and the launch of the pre-pass and the kernel.
// No torch here. The binding is not wired yet: today's launch code (launch_impl.h, bwd_hdim) runs
// every backward; a binding that calls run_hopper_bwd where hopper_bwd_unsupported says nothing
// gets this kernel instead of the fused one (same buffers, other num_partials: hopper_bwd_plan).
#pragma once

#ifndef SSA_FLASH_EMULATE
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#include <string>

#include "../launch_impl.h"
#include "../set_params.h"
#include "bwd_kernel.h"
#include "fwd_launch.h"  // tma_spec_bhld

namespace ssa_flash {
namespace hopper {

// Why the sm_90a backward does not run this call (nullptr: it does). `arch`: the device's
// (100 major + 10 minor); `wgmma_build`: whether the build holds sm_90a code.
inline const char* hopper_bwd_unsupported(const BwdParams& p, int score, bool deterministic, int arch,
                                          bool wgmma_build) {
  if (arch != 900 || !wgmma_build) return "not an sm_90a device and build";
  if (deterministic) return "deterministic: the two-kernel path (dQ by atomics here)";
  if (score != Softmax::kId && score != Ssa::kId) return "score function: softmax and SSA only";
  if (p.dim != p.dim_v || (p.dim != 64 && p.dim != 128)) return "head dims: D = Dv = 64 or 128";
  if (p.mask_kind != kMaskNone || p.drop_rng != nullptr || p.window) return "masks, dropout and windows";
  if (p.sinks != nullptr || p.softcap) return "sinks and soft-capping";
  return nullptr;
}

// The buffers of a call (launch.h, BwdPlan; as the fused backward's: a zeroed float32 dQ
// accumulator, the row-statistics workspace) with num_partials = key blocks x 8 consumer warps.
inline BwdPlan hopper_bwd_plan(int dim, int len_q, int len_k, bool adaptive) {
  BwdPlan plan;
  plan.fused = true;
  plan.num_partials = (len_k + 127) / 128 * 8;
  plan.stat_rows = bwd_stat_rows(len_q);
  plan.stat_count = dkdv_stat_count(adaptive);
  plan.accum_cols = dim;
  return plan;
}

// A tensor map from its description (pipeline.h, TmaTileSpec); an error message or "".
inline std::string make_tma(const TmaTileSpec& spec, TmaDesc& out) {
#ifdef SSA_FLASH_EMULATE
  out = spec;
  return std::string();
#else
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  static Encode encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr)
      return "cuTensorMapEncodeTiled not found in the driver";
    encode = reinterpret_cast<Encode>(fn);
  }
  cuuint64_t dims[kTmaMaxRank], strides[kTmaMaxRank];
  cuuint32_t box[kTmaMaxRank], elem_strides[kTmaMaxRank] = {1, 1, 1, 1};
  for (int i = 0; i < spec.rank; ++i) {
    dims[i] = static_cast<cuuint64_t>(spec.dims[i]);
    box[i] = static_cast<cuuint32_t>(spec.box[i]);
    if (i > 0) strides[i - 1] = static_cast<cuuint64_t>(spec.strides[i]);
  }
  const CUresult r = encode(&out, spec.elem_bytes == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_UINT16,
                            spec.rank, const_cast<void*>(spec.base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            spec.swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? std::string() : "cuTensorMapEncodeTiled failed (" + std::to_string(static_cast<int>(r)) + ")";
#endif
}

// The kernel's parameters: p and the tensor maps of bwd_tile.h's HopperBwdParams (q, dO, k, v:
// fwd_launch.h's rank-4 (head dim, rows, head, batch) views, any batch / head strides).
// (make_tma, not fwd_launch.h's encode_tma: that one encodes 16-bit elements only, the
// statistics are float32.)
template <typename Tile>
std::string hopper_bwd_params(const BwdParams& p, bool adaptive, HopperBwdParams& hp) {
  hp.p = p;
  const int64_t bh = static_cast<int64_t>(p.batch) * p.heads;
  const int n = dkdv_stat_count(adaptive);
  const int box = adaptive ? BwdStatLayout<Tile, true>::kBox : BwdStatLayout<Tile, false>::kBox;
  const TmaTileSpec stat{p.rowstat, 2, 4, 0, {static_cast<int64_t>(n) * p.stat_rows, bh},
                         {0, 4 * static_cast<int64_t>(n) * p.stat_rows}, {box, 1}};
  std::string err = make_tma(
      tma_spec_bhld(p.q, p.dim, p.len_q, p.heads, p.batch, p.q_sm, p.q_sh, p.q_sb, Tile::kBlockM), hp.tma_q);
  if (err.empty())
    err = make_tma(tma_spec_bhld(p.dout, p.dim_v, p.len_q, p.heads, p.batch, p.do_sm, p.do_sh, p.do_sb, Tile::kBlockM),
                   hp.tma_do);
  if (err.empty())
    err = make_tma(tma_spec_bhld(p.k, p.dim, p.len_k, p.heads_kv, p.batch, p.k_sm, p.k_sh, p.k_sb, Tile::kBlockN),
                   hp.tma_k);
  if (err.empty())
    err = make_tma(tma_spec_bhld(p.v, p.dim_v, p.len_k, p.heads_kv, p.batch, p.v_sm, p.v_sh, p.v_sb, Tile::kBlockN),
                   hp.tma_v);
  if (err.empty()) err = make_tma(stat, hp.tma_stat);
  return err;
}

// f(Score) for the score functions this kernel is built for (softmax, SSA).
template <typename F>
auto hopper_score_switch(int score, F&& f) {
  if (score == Ssa::kId) return f(Ssa{});
  return f(Softmax{});
}

// The pre-pass (row statistics into p.rowstat), then the kernel<kBug> (dQ / scale into the zeroed
// p.dq_accum, dK, dV, the parameters' partials as hopper_bwd_plan sizes them). A call that
// hopper_bwd_unsupported refuses must not come here.
template <typename T, int kD, int kBug = hopper::kBwdOk>
std::string run_hopper_bwd_hdim(const BwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  using Dq = DqTraits<kD, T>;
  std::string err = detail::launch_variant<T, Dq>(
      "attn_bwd_dq_kernel (pre-pass)",
      [](auto S, auto A, auto C, auto K) { return detail::dq_kernel<Dq, true>(S, A, C, K); }, score, adaptive,
      detail::query_grid<Dq>(p), bwd_prep_smem_bytes(kD, sizeof(T), adaptive, kPathSm90), stream, p);
  if (!err.empty()) return err;
  using Tile = BwdTile<kD, T>;
  HopperBwdParams hp;
  err = hopper_bwd_params<Tile>(p, adaptive, hp);
  if (!err.empty()) return err;
  const dim3 grid((p.len_k + Tile::kBlockN - 1) / Tile::kBlockN, p.heads_kv, p.batch);
  return hopper_score_switch(score, [&](auto S) {
    using Score = decltype(S);
    if (adaptive)
      return detail::launch<T>(&hopper_bwd_kernel<Tile, Score, true, kBug>, "hopper_bwd_kernel", grid, Tile::kThreads,
                               BwdSmem<Tile, true>::kLaunchBytes, stream, hp);
    return detail::launch<T>(&hopper_bwd_kernel<Tile, Score, false, kBug>, "hopper_bwd_kernel", grid, Tile::kThreads,
                             BwdSmem<Tile, false>::kLaunchBytes, stream, hp);
  });
}

template <typename T>
std::string run_hopper_bwd(const BwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  if (p.dim == 64) return run_hopper_bwd_hdim<T, 64>(p, score, adaptive, stream);
  if (p.dim == 128) return run_hopper_bwd_hdim<T, 128>(p, score, adaptive, stream);
  return "hopper backward: D = 64 or 128";
}

}  // namespace hopper
}  // namespace ssa_flash
