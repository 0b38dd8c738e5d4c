// Kernel launches, templated on the element type; instantiated by fwd_{fp16,bf16}.cu and
// bwd_{fp16,bf16}.cu. No torch here.
#pragma once

#ifndef SSA_FLASH_EMULATE
#include <cuda_runtime.h>
#endif

#include <string>

#include "bwd_kernel.h"
#include "dispatch.h"
#include "fwd_kernel.h"
#include "launch.h"
#include "launch_kernel.h"
#include "launch_variant.h"
#include "mask_grad.h"

#if SSA_FLASH_HOPPER_FWD  // (launch_kernel.h: the build holds the sm_90a kernels)
#include "hopper/bwd_launch.h"
#include "hopper/fwd_launch.h"
#endif
#include "params.h"
#include "traits.h"

namespace ssa_flash {
namespace detail {

template <typename T, int D>
std::string fwd_hdim(const FwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  using Tr = FwdTraits<D, T>;
  return launch_variant<T, Tr>(
      "attn_fwd_kernel", [](auto S, auto A, auto C, auto K) {
        return &attn_fwd_kernel<Tr, decltype(S), decltype(A)::value, decltype(C)::value, decltype(K)::value>;
      },
      score, adaptive, query_grid<Tr>(p), fwd_smem_bytes(D, sizeof(T), device_path()), stream, p);
}

template <typename T, int D>
std::string row_entropy_hdim(const FwdParams& p, int score, cudaStream_t stream) {
  using Tr = FwdTraits<D, T>;
  auto kernel = extras_switch(score, false, p.softcap, p.sinks != nullptr, [](auto S, auto, auto C, auto K) {
    return &attn_row_entropy_kernel<Tr, decltype(S), decltype(C)::value, decltype(K)::value>;
  });
  return launch<T>(kernel, "attn_row_entropy_kernel", query_grid<Tr>(p), Tr::kNThreads,
                   row_entropy_smem_bytes(D, sizeof(T), device_path()), stream, p);
}

// The key-block kernels' parameters: p, or for an additive mask p with dO the recount kernel's
// scaled copy (B, H, stat_rows, D) of type T in p.lse_lo (lse_residual.h).
template <typename T, int D>
BwdParams key_block_params(const BwdParams& p) {
  if (p.mask_kind != kMaskAdd) return p;
  BwdParams k = p;
  k.dout = reinterpret_cast<const T*>(p.lse_lo + scaled_do_offset(static_cast<int64_t>(p.batch) * p.heads, p.stat_rows));
  k.do_sm = D;
  k.do_sh = static_cast<int64_t>(p.stat_rows) * D;
  k.do_sb = p.heads * k.do_sh;
  return k;
}

template <typename T, int D>
std::string bwd_hdim(const BwdParams& p, int score, bool adaptive, const BwdPlan& plan, cudaStream_t stream) {
  const int path = device_path();
  using Dq = DqTraits<D, T>;
  if (p.mask_kind == kMaskAdd) {
    // additive masks: the rows whose LSE float32 cannot resolve, recounted (lse_residual.h)
    std::string err = launch_variant<T, Dq>(
        "attn_bwd_lse_recount_kernel",
        [](auto S, auto A, auto C, auto K) {
          return &attn_bwd_lse_recount_kernel<Dq, decltype(S), decltype(A)::value, decltype(C)::value,
                                              decltype(K)::value>;
        },
        score, adaptive, query_grid<Dq>(p), dq_smem_bytes(D, sizeof(T), path), stream, p);
    if (!err.empty()) return err;
  }
  if constexpr (D <= 128) {
    if (plan.fused) {
      // pre-pass: delta (and the adaptive g), then the fused kernel
      std::string err = launch_variant<T, Dq>(
          "attn_bwd_dq_kernel (pre-pass)",
          [](auto S, auto A, auto C, auto K) { return dq_kernel<Dq, true>(S, A, C, K); }, score,
          adaptive, query_grid<Dq>(p), bwd_prep_smem_bytes(D, sizeof(T), adaptive, path), stream, p);
      if (!err.empty()) return err;
      using Tr = FusedTraits<D, T>;
      return launch_variant<T, Tr>(
          "attn_bwd_fused_kernel",
          [](auto S, auto A, auto C, auto) {
            return &attn_bwd_fused_kernel<Tr, decltype(S), decltype(A)::value, decltype(C)::value>;
          },
          score,
          adaptive, key_grid<Tr>(p), bwd_fused_smem_bytes(D, sizeof(T), adaptive, path), stream,
          key_block_params<T, D>(p));
    }
  }
  std::string err = launch_variant<T, Dq>(
      "attn_bwd_dq_kernel", [](auto S, auto A, auto C, auto K) { return dq_kernel<Dq, false>(S, A, C, K); },
      score, adaptive, query_grid<Dq>(p), dq_smem_bytes(D, sizeof(T), path), stream, p);
  if (!err.empty()) return err;
  // dK/dV with the tile Tr (traits.h: DkdvTraits, or DkdvTraitsSm75 where dkdv_split_for says)
  auto dkdv = [&](auto traits, int smem) {
    using Tr = decltype(traits);
    return launch_variant<T, Tr>(
        "attn_bwd_dkdv_kernel",
        [](auto S, auto A, auto C, auto) {
          return &attn_bwd_dkdv_kernel<Tr, decltype(S), decltype(A)::value, decltype(C)::value>;
        },
        score,
        adaptive, key_grid<Tr>(p), smem, stream, key_block_params<T, D>(p));
  };
  if constexpr (!ElemInfo<T>::kIsBF16 && (D == 96 || D == 128)) {
    int arch = 0, max_optin = 0;
    if (device_info(arch, max_optin).empty() && dkdv_split_for(D, false, arch) == 2)
      return dkdv(DkdvTraitsSm75<D, T>{}, dkdv_smem_bytes(D, sizeof(T), adaptive, kPathSm75));
  }
  return dkdv(DkdvTraits<D, T>{}, dkdv_smem_bytes(D, sizeof(T), adaptive, path));
}

// The learned mask's gradient (mask_grad.h), after the backward's kernels: its workspace and, as
// the key-block kernels, dO the recount's scaled copy.
template <typename T, int D>
std::string mask_grad_hdim(const MaskGradParams& p, int score, bool adaptive, cudaStream_t stream) {
  using Dq = DqTraits<D, T>;
  const int64_t tiles = static_cast<int64_t>((p.len_q + Dq::kBlockM - 1) / Dq::kBlockM) *
                        ((p.len_k + Dq::kBlockN - 1) / Dq::kBlockN);
  if (tiles >= (int64_t(1) << 31) || p.dmask_heads > 65535 || p.dmask_batch > 65535)
    return "the learned mask's gradient: too many tiles for the grid";
  MaskGradParams m = p;
  static_cast<BwdParams&>(m) = key_block_params<T, D>(p);
  return launch_variant<T, Dq>(
      "attn_bwd_mask_grad_kernel",
      [](auto S, auto A, auto C, auto) {
        return &attn_bwd_mask_grad_kernel<Dq, decltype(S), decltype(A)::value, decltype(C)::value>;
      },
      score, adaptive, dim3(static_cast<unsigned>(tiles), p.dmask_heads, p.dmask_batch),
      mask_grad_smem_bytes(D, sizeof(T)), stream, m);
}

template <typename T>
std::string run_mask_grad(const MaskGradParams& p, int score, bool adaptive, cudaStream_t stream) {
  if (p.mask_kind != kMaskAdd || p.lse_lo == nullptr) return "the learned mask's gradient: an additive mask only";
  return head_dim_switch(p.dim, p.dim_v, [&](auto D) {
    return mask_grad_hdim<T, decltype(D)::value>(p, score, adaptive, stream);
  });
}

// Today's kernels' plan of a backward on the current device (launch.h; plan_bwd_call decides
// whether the sm_90a one runs instead).
template <typename T>
BwdPlan plan_bwd(int dim, int dim_v, int len_q, int len_k, int score, bool adaptive, bool deterministic,
                 bool unfused_features) {
  const int padded = padded_head_dim(dim > dim_v ? dim : dim_v);
  const int d = padded < 0 ? 256 : padded;
  int arch = 0, max_optin = 0;
  const bool known = device_info(arch, max_optin).empty();
  BwdPlan plan{};  // (hopper false)
  // (dropout or a window: the two-kernel path; the fused kernel has no code for them, see
  // bwd_kernel.h)
  const bool sm75_spills = score_switch(score, [](auto S) { return decltype(S)::kFusedSpillsSm75; });
  plan.fused = !deterministic && !unfused_features && known && bwd_fused_for(d, sm75_spills, ElemInfo<T>::kIsBF16, arch);
  // the parameters' partials: per query block of the dQ kernel, or per (key block, warp) of the
  // fused kernel
  plan.num_partials = plan.fused ? (len_k + dkdv_block_n(d) - 1) / dkdv_block_n(d) * dkdv_warps(d)
                                 : (len_q + dq_block_m(d) - 1) / dq_block_m(d);
  plan.stat_rows = bwd_stat_rows(len_q);
  plan.stat_count = dkdv_stat_count(adaptive);
  plan.accum_cols = d;
  return plan;
}

// A packed batch (FwdParams cu_seqlens_*) that the sm_90a kernels did not take (why: their
// reason): today's kernels index dense tensors only, so the call is refused.
inline std::string packed_declined(const char* why) {
  return std::string("packed sequences: only the sm_90a forward takes them, and it declines the call: ") + why;
}

// The forward: the sm_90a warp-specialised kernel where hopper::fwd_ws_declines (the one place
// that decides) takes the call, today's kernel otherwise.
template <typename T>
std::string run_fwd(const FwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  const char* why = "not in this build (SSA_FLASH_HOPPER_FWD=0)";
#if SSA_FLASH_HOPPER_FWD
  int arch = 0, max_optin = 0;
  why = device_info(arch, max_optin).empty() ? hopper::fwd_ws_declines(p, arch) : "no device";
  if (why == nullptr) return hopper::run_fwd_ws<T>(p, score, adaptive, stream);
#endif
  if (p.cu_seqlens_q != nullptr) return packed_declined(why);
  return head_dim_switch(p.dim, p.dim_v, [&](auto D) { return fwd_hdim<T, decltype(D)::value>(p, score, adaptive, stream); });
}

// The row-entropy pass likewise (hopper::row_entropy_ws_declines).
template <typename T>
std::string run_row_entropy(const FwdParams& p, int score, cudaStream_t stream) {
  const char* why = "not in this build (SSA_FLASH_HOPPER_FWD=0)";
#if SSA_FLASH_HOPPER_FWD
  int arch = 0, max_optin = 0;
  why = device_info(arch, max_optin).empty() ? hopper::row_entropy_ws_declines(p, arch) : "no device";
  if (why == nullptr) return hopper::run_row_entropy_ws<T>(p, score, stream);
#endif
  if (p.cu_seqlens_q != nullptr) return packed_declined(why);
  return head_dim_switch(p.dim, p.dim, [&](auto D) { return row_entropy_hdim<T, decltype(D)::value>(p, score, stream); });
}

// The backward's plan of a call (set_params.h, plan_backward; p's sizes and features): the sm_90a
// backward's where hopper::hopper_bwd_declines (the one place that decides) takes the call, today's
// otherwise. run_bwd follows the plan (BwdPlan::hopper).
template <typename T>
BwdPlan plan_bwd_call(const BwdParams& p, int score, bool adaptive, bool deterministic) {
#if SSA_FLASH_HOPPER_FWD
  int arch = 0, max_optin = 0;
  if (device_info(arch, max_optin).empty() && hopper::hopper_bwd_declines(p, score, deterministic, arch) == nullptr)
    return hopper::hopper_bwd_plan(p.dim, p.len_q, p.len_k, adaptive);
#endif
  return plan_bwd<T>(p.dim, p.dim_v, p.len_q, p.len_k, score, adaptive, deterministic,
                     p.drop_rng != nullptr || p.window);
}

template <typename T>
std::string run_bwd(const BwdParams& p, int score, bool adaptive, const BwdPlan& plan, cudaStream_t stream) {
  if (plan.hopper) {
#if SSA_FLASH_HOPPER_FWD
    return hopper::run_hopper_bwd<T>(p, score, adaptive, stream);
#else
    return "a plan of the sm_90a backward, which this build does not hold (SSA_FLASH_HOPPER_FWD=0)";
#endif
  }
  return head_dim_switch(p.dim, p.dim_v, [&](auto D) {
    return bwd_hdim<T, decltype(D)::value>(p, score, adaptive, plan, stream);
  });
}

}  // namespace detail
}  // namespace ssa_flash
