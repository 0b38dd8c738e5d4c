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
#include "params.h"
#include "traits.h"

namespace ssa_flash {
namespace detail {

inline std::string cuda_error(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// The current device's architecture (major * 100 + minor * 10) and opt-in shared memory per
// block; an error message, or an empty string.
inline std::string device_info(int& arch, int& max_optin) {
#ifdef SSA_FLASH_EMULATE
#if defined(SSA_FLASH_EMULATE_SM70)
  arch = 700;
#elif defined(SSA_FLASH_EMULATE_SM75)
  arch = 750;
#elif defined(SSA_FLASH_EMULATE_SM90)
  arch = 900;
#else
  arch = 800;
#endif
  max_optin = 256 * 1024;
  return std::string();
#else
  int dev = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return cuda_error("querying the device", err);
  arch = major * 100 + minor * 10;
  return std::string();
#endif
}

// Checks the device can run element type T and `smem` bytes of dynamic shared memory, raises the
// kernel's shared-memory limit when above the 48 KiB default, launches.
template <typename T, typename Params>
std::string launch(void (*kernel)(const Params), const char* name, dim3 grid, int threads,
                   int smem, cudaStream_t stream, const Params& p) {
#ifdef SSA_FLASH_EMULATE
  (void)stream;
  return ssa_emu::launch(kernel, name, grid, threads, smem, p);  // csrc/emu: CPU emulation
#else
  int arch = 0, max_optin = 0;
  std::string why = device_info(arch, max_optin);
  if (!why.empty()) return why;
  if (arch < ElemInfo<T>::kMinArch) {
    return std::string(ElemInfo<T>::kIsBF16 ? "bfloat16" : "float16") + " kernels need sm_" +
           std::to_string(ElemInfo<T>::kMinArch / 10) + " or newer, this device is sm_" +
           std::to_string(arch / 10);
  }
  if (grid.y > 65535 || grid.z > 65535) {
    return std::string(name) + ": heads and batch must each be at most 65535";
  }
  if (smem > max_optin) {
    return std::string(name) + ": the tile needs " + std::to_string(smem) +
           " bytes of shared memory per block, this device allows " + std::to_string(max_optin) +
           " (see docs/cuda.md, tile sizes)";
  }
  cudaError_t err;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cuda_error(name, err);
  }
  kernel<<<grid, threads, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error(name, err);
  return std::string();
#endif
}

// The code path of the current device (traits.h; shared memory depends on it).
inline int device_path() {
  int arch = 0, max_optin = 0;
  return device_info(arch, max_optin).empty() ? code_path(arch) : kPathSm80;
}

template <typename T, int D>
std::string fwd_hdim(const FwdParams& p, bool ssa, bool adaptive, cudaStream_t stream) {
  using Tr = FwdTraits<D, T>;
  const dim3 grid((p.len_q + Tr::kBlockM - 1) / Tr::kBlockM, p.heads, p.batch);
  const int smem = fwd_smem_bytes(D, sizeof(T), device_path());
  auto kernel = feature_switch(ssa, adaptive, [](auto S, auto A) {
    return &attn_fwd_kernel<Tr, decltype(S)::value, decltype(A)::value>;
  });
  return launch<T>(kernel, "attn_fwd_kernel", grid, Tr::kNThreads, smem, stream, p);
}

template <typename T, int D>
std::string row_entropy_hdim(const FwdParams& p, bool ssa, cudaStream_t stream) {
  using Tr = FwdTraits<D, T>;
  const dim3 grid((p.len_q + Tr::kBlockM - 1) / Tr::kBlockM, p.heads, p.batch);
  const int smem = row_entropy_smem_bytes(D, sizeof(T), device_path());
  auto kernel = bool_switch(ssa, [](auto S) { return &attn_row_entropy_kernel<Tr, decltype(S)::value>; });
  return launch<T>(kernel, "attn_row_entropy_kernel", grid, Tr::kNThreads, smem, stream, p);
}

template <typename T, int D>
std::string bwd_hdim(const BwdParams& p, bool ssa, bool adaptive, const BwdPlan& plan, cudaStream_t stream) {
  const int path = device_path();
  if constexpr (D <= 128) {
    if (plan.fused) {
      {
        // pre-pass: delta (and the adaptive g)
        using Tr = DqTraits<D, T>;
        const dim3 grid((p.len_q + Tr::kBlockM - 1) / Tr::kBlockM, p.heads, p.batch);
        const int smem = bwd_prep_smem_bytes(D, sizeof(T), adaptive, path);
        auto kernel = feature_switch(ssa, adaptive, [](auto S, auto A) {
          return &attn_bwd_dq_kernel<Tr, decltype(S)::value, decltype(A)::value, true>;
        });
        std::string err = launch<T>(kernel, "attn_bwd_dq_kernel (pre-pass)", grid, Tr::kNThreads, smem, stream, p);
        if (!err.empty()) return err;
      }
      using Tr = FusedTraits<D, T>;
      const dim3 grid((p.len_k + Tr::kBlockN - 1) / Tr::kBlockN, p.heads_kv, p.batch);
      const int smem = bwd_fused_smem_bytes(D, sizeof(T), adaptive, path);
      auto kernel = feature_switch(ssa, adaptive, [](auto S, auto A) {
        return &attn_bwd_fused_kernel<Tr, decltype(S)::value, decltype(A)::value>;
      });
      return launch<T>(kernel, "attn_bwd_fused_kernel", grid, Tr::kNThreads, smem, stream, p);
    }
  }
  {
    using Tr = DqTraits<D, T>;
    const dim3 grid((p.len_q + Tr::kBlockM - 1) / Tr::kBlockM, p.heads, p.batch);
    const int smem = dq_smem_bytes(D, sizeof(T), path);
    auto kernel = feature_switch(ssa, adaptive, [](auto S, auto A) {
      return &attn_bwd_dq_kernel<Tr, decltype(S)::value, decltype(A)::value>;
    });
    std::string err = launch<T>(kernel, "attn_bwd_dq_kernel", grid, Tr::kNThreads, smem, stream, p);
    if (!err.empty()) return err;
  }
  if constexpr (!ElemInfo<T>::kIsBF16 && (D == 96 || D == 128)) {
    int arch = 0, max_optin = 0;
    if (device_info(arch, max_optin).empty() && dkdv_split_for(D, false, arch) == 2) {
      using Tr = DkdvTraitsSm75<D, T>;  // see traits.h
      const dim3 grid((p.len_k + Tr::kBlockN - 1) / Tr::kBlockN, p.heads_kv, p.batch);
      const int smem = dkdv_smem_bytes(D, sizeof(T), adaptive, kPathSm75);
      auto kernel = feature_switch(ssa, adaptive, [](auto S, auto A) {
        return &attn_bwd_dkdv_kernel<Tr, decltype(S)::value, decltype(A)::value>;
      });
      return launch<T>(kernel, "attn_bwd_dkdv_kernel", grid, Tr::kNThreads, smem, stream, p);
    }
  }
  using Tr = DkdvTraits<D, T>;
  const dim3 grid((p.len_k + Tr::kBlockN - 1) / Tr::kBlockN, p.heads_kv, p.batch);
  const int smem = dkdv_smem_bytes(D, sizeof(T), adaptive, path);
  auto kernel = feature_switch(ssa, adaptive, [](auto S, auto A) {
    return &attn_bwd_dkdv_kernel<Tr, decltype(S)::value, decltype(A)::value>;
  });
  return launch<T>(kernel, "attn_bwd_dkdv_kernel", grid, Tr::kNThreads, smem, stream, p);
}

// The backward's plan on the current device (launch.h).
template <typename T>
BwdPlan plan_bwd(int dim, int dim_v, int len_q, int len_k, bool ssa, bool adaptive, bool deterministic,
                 bool unfused_features) {
  const int padded = padded_head_dim(dim > dim_v ? dim : dim_v);
  const int d = padded < 0 ? 256 : padded;
  int arch = 0, max_optin = 0;
  const bool known = device_info(arch, max_optin).empty();
  BwdPlan plan;
  // (dropout or a window: the two-kernel path; the fused kernel has no code for them, see
  // bwd_kernel.h)
  plan.fused = !deterministic && !unfused_features && known && bwd_fused_for(d, ssa, ElemInfo<T>::kIsBF16, arch);
  // SSA db / dn partials: per query block of the dQ kernel, or per (key block, warp) of the
  // fused kernel
  plan.num_partials = plan.fused ? (len_k + dkdv_block_n(d) - 1) / dkdv_block_n(d) * dkdv_warps(d)
                                 : (len_q + dq_block_m(d) - 1) / dq_block_m(d);
  plan.stat_rows = bwd_stat_rows(len_q);
  plan.stat_count = dkdv_stat_count(adaptive);
  plan.accum_cols = d;
  return plan;
}

template <typename T>
std::string run_fwd(const FwdParams& p, bool ssa, bool adaptive, cudaStream_t stream) {
  return head_dim_switch(p.dim, p.dim_v, [&](auto D) { return fwd_hdim<T, decltype(D)::value>(p, ssa, adaptive, stream); });
}

template <typename T>
std::string run_row_entropy(const FwdParams& p, bool ssa, cudaStream_t stream) {
  return head_dim_switch(p.dim, p.dim, [&](auto D) { return row_entropy_hdim<T, decltype(D)::value>(p, ssa, stream); });
}

template <typename T>
std::string run_bwd(const BwdParams& p, bool ssa, bool adaptive, const BwdPlan& plan, cudaStream_t stream) {
  return head_dim_switch(p.dim, p.dim_v, [&](auto D) {
    return bwd_hdim<T, decltype(D)::value>(p, ssa, adaptive, plan, stream);
  });
}

}  // namespace detail
}  // namespace ssa_flash
