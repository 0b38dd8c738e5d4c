// Host side of the sm_90a backward: which calls it runs (hopper_bwd_unsupported; with the build
// and the run-time switch, hopper_bwd_declines: the one routing decision), its plan (buffers),
// the tensor maps (tma_cache.h's cache, as the forward's), and the launch of the pre-pass and the
// kernel. No torch here.
//
// Wired (launch_impl.h): a build holding the sm_90a kernels (SSA_FLASH_HOPPER_FWD=1, launch_kernel.h:
// one flag for the forward and the backward) plans a backward hopper_bwd_declines takes with
// hopper_bwd_plan (BwdPlan::hopper set) and run_bwd then runs run_hopper_bwd; every other call, and
// every call of a build without the kernels, plans and runs today's kernels exactly as before.
// Switched off by default: SSA_FLASH_HOPPER_BWD=1 in the environment (read once) or
// set_hopper_bwd_enabled (the extension's hopper_bwd(on)) turns it on, apart from the forward's
// SSA_FLASH_HOPPER_FWD, so a GPU run can compare each kernel alone.
#pragma once

#ifndef SSA_FLASH_EMULATE
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#include <atomic>
#include <string>

#include "../launch.h"
#include "../launch_variant.h"
#include "bwd_kernel.h"
#include "fwd_launch.h"  // tma_spec_bhld
#include "tma_cache.h"

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
  if (p.heads_kv > 65535 || p.batch > 65535) return "grid";
  // (the operands TMA reads: fwd_launch.h, tma_operand_ok)
  const int64_t q_ext[3] = {p.len_q, p.heads, p.batch}, k_ext[3] = {p.len_k, p.heads_kv, p.batch};
  if (!tma_operand_ok(p.q, {p.q_sm, p.q_sh, p.q_sb}, q_ext) ||
      !tma_operand_ok(p.dout, {p.do_sm, p.do_sh, p.do_sb}, q_ext) ||
      !tma_operand_ok(p.k, {p.k_sm, p.k_sh, p.k_sb}, k_ext) || !tma_operand_ok(p.v, {p.v_sm, p.v_sh, p.v_sb}, k_ext))
    return "an operand's address or strides are not 16-byte aligned (TMA)";
  return nullptr;
}

// ---- run-time switch ---------------------------------------------------------------------
// Whether a build holding the kernel uses it: SSA_FLASH_HOPPER_BWD ("1" on, anything else or unset
// off), read once at the first backward (tma_cache.h, env_switch_on); set_hopper_bwd_enabled
// overrides it (the extension's hopper_bwd(on): the bench and the device tests compare both).
inline std::atomic<int>& hopper_bwd_state() {
  static std::atomic<int> state{-1};
  return state;
}
inline bool hopper_bwd_enabled() { return env_switch_on(hopper_bwd_state(), "SSA_FLASH_HOPPER_BWD"); }
inline void set_hopper_bwd_enabled(bool on) { hopper_bwd_state().store(on ? 1 : 0); }

// The dispatch's decision (launch_impl.h, plan_bwd_call): nullptr if the sm_90a backward runs this
// call on a device of architecture `arch`, else why not (then today's kernels do, as before).
inline const char* hopper_bwd_declines(const BwdParams& p, int score, bool deterministic, int arch) {
  if (!SSA_FLASH_HOPPER_FWD) return "not in this build (SSA_FLASH_HOPPER_FWD=0)";
  if (!hopper_bwd_enabled()) return "off at run time (SSA_FLASH_HOPPER_BWD unset or not 1; set_hopper_bwd)";
  if ((p.dim == 64 && !SSA_FLASH_HEAD_DIM_64) || (p.dim == 128 && !SSA_FLASH_HEAD_DIM_128))
    return "head dim not in this build";
  if (p.heads_kv > 65535 || p.batch > 65535) return "grid";
  return hopper_bwd_unsupported(p, score, deterministic, arch, true);
}

// The buffers of a call (launch.h, BwdPlan; as the fused backward's: a zeroed float32 dQ
// accumulator, the row-statistics workspace) with num_partials = key blocks x consumer warps
// (bwd_epilogue.h, store_dparams: every CTA writes its slots of every query head of its group,
// so the caller's sum over the buffer's last dim is over the same fixed set of slots each call).
inline BwdPlan hopper_bwd_plan(int dim, int len_q, int len_k, bool adaptive) {
  using Tile = BwdTile<64, __half>;  // (key block and warps do not depend on D or the element type)
  static_assert(BwdTile<128, __nv_bfloat16>::kBlockN == Tile::kBlockN &&
                    BwdTile<128, __nv_bfloat16>::kConsumerWarps == Tile::kConsumerWarps,
                "one plan for every instance");
  BwdPlan plan{};
  plan.fused = true;
  plan.num_partials = (len_k + Tile::kBlockN - 1) / Tile::kBlockN * Tile::kConsumerWarps;
  plan.stat_rows = bwd_stat_rows(len_q);
  plan.stat_count = dkdv_stat_count(adaptive);
  plan.accum_cols = dim;
  plan.hopper = true;
  return plan;
}

// The backward's operands in the tensor-map cache (tma_cache.h: the forward's are 0..2).
enum BwdMapRole { kMapBwdQ = 8, kMapBwdDo, kMapBwdK, kMapBwdV, kMapBwdStat };

// The kernel's parameters: p and the tensor maps of bwd_tile.h's HopperBwdParams (q, dO, k, v:
// fwd_launch.h's rank-4 (head dim, rows, head, batch) views, any batch / head strides; the row
// statistics a rank-2 float32 (n rows of a head, B H) view), from tma_cache.h's cache: encoded
// once per shape, the address patched per call, no host-device synchronisation.
template <typename T, typename Tile>
std::string hopper_bwd_params(const BwdParams& p, bool adaptive, HopperBwdParams& hp) {
  hp.p = p;
  constexpr bool kBf16 = ElemInfo<T>::kIsBF16;
  const int64_t bh = static_cast<int64_t>(p.batch) * p.heads;
  const int n = dkdv_stat_count(adaptive);
  const int box = adaptive ? BwdStatLayout<Tile, true>::kBox : BwdStatLayout<Tile, false>::kBox;
  const TmaTileSpec stat{p.rowstat, 2, 4, 0, {static_cast<int64_t>(n) * p.stat_rows, bh},
                         {0, 4 * static_cast<int64_t>(n) * p.stat_rows}, {box, 1}};
  TmaMapCache& cache = tma_cache();
  std::string err = cache.get(
      kMapBwdQ, tma_spec_bhld(p.q, p.dim, p.len_q, p.heads, p.batch, p.q_sm, p.q_sh, p.q_sb, Tile::kBlockM), kBf16,
      &hp.tma_q);
  if (err.empty())
    err = cache.get(kMapBwdDo,
                    tma_spec_bhld(p.dout, p.dim_v, p.len_q, p.heads, p.batch, p.do_sm, p.do_sh, p.do_sb, Tile::kBlockM),
                    kBf16, &hp.tma_do);
  if (err.empty())
    err = cache.get(kMapBwdK,
                    tma_spec_bhld(p.k, p.dim, p.len_k, p.heads_kv, p.batch, p.k_sm, p.k_sh, p.k_sb, Tile::kBlockN),
                    kBf16, &hp.tma_k);
  if (err.empty())
    err = cache.get(kMapBwdV,
                    tma_spec_bhld(p.v, p.dim_v, p.len_k, p.heads_kv, p.batch, p.v_sm, p.v_sh, p.v_sb, Tile::kBlockN),
                    kBf16, &hp.tma_v);
  if (err.empty()) err = cache.get(kMapBwdStat, stat, kBf16, &hp.tma_stat);
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
  err = hopper_bwd_params<T, Tile>(p, adaptive, hp);
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
