// Host side of the sm_90a warp-specialised forward (fwd_kernel.h) and of its row-entropy pass
// (fwd_row_entropy.h, the adaptive temperature's first pass): which calls they take
// (fwd_ws_declines / row_entropy_ws_declines, the one decision each; launch_impl.h run_fwd and
// run_row_entropy ask them), the TMA tensor maps of a call (fwd_tma_specs: what
// cuTensorMapEncodeTiled takes; in the CPU emulation TmaDesc is that spec itself), the grid,
// shared memory and launch (run_fwd_ws, run_row_entropy_ws). No torch here.
//
// SSA_FLASH_HOPPER_FWD (launch_kernel.h, default 0): whether builds hold the kernel and the
// dispatch may pick it; off until it has passed on a GPU (docs/cuda.md): the emulation and the
// sm_90a SASS are checked (tests/cuda/test_hopper_fwd_emulated.py), the driver-side encoding of
// its tensor maps (tma_cache.h) and the kernel on a device are not. A build holding it uses it only
// when switched on at run time (tma_cache.h, hopper_fwd_enabled: the environment variable
// SSA_FLASH_HOPPER_FWD=1, read once, or set_hopper_fwd).
#pragma once

#ifndef SSA_FLASH_EMULATE
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#include <array>
#include <cstdint>
#include <string>

#include "../dispatch.h"
#include "../launch_kernel.h"
#include "../params.h"
#include "fwd_kernel.h"
#include "fwd_params.h"
#include "fwd_row_entropy.h"
#include "fwd_traits.h"
#include "tma_cache.h"
#include "tile_scheduler.h"

namespace ssa_flash {
namespace hopper {

// 16-bit elements at `base` with element strides (rows, heads, batch) of extents (rows, heads,
// batch): each stride of an extent above 1 a multiple of 8 (16 bytes), the address 16-byte aligned.
// (Extents: int64_t[3] or std::array<int64_t, 3>.)
template <typename Extents>
bool tma_operand_ok(const void* base, const int64_t (&strides)[3], const Extents& extents) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (extents[i] > 1 && strides[i] % 8 != 0) return false;
  return true;
}

// The (rows, heads, batch) extents of the tensor maps of Q and O, K and V: (B, H, L) dense, (1, H,
// total rows) for packed sequences (FwdParams cu_seqlens_*).
inline bool packed(const FwdParams& p) { return p.cu_seqlens_q != nullptr; }
inline std::array<int64_t, 3> q_extents(const FwdParams& p) {
  return packed(p) ? std::array<int64_t, 3>{p.total_q, p.heads, 1} : std::array<int64_t, 3>{p.len_q, p.heads, p.batch};
}
inline std::array<int64_t, 3> k_extents(const FwdParams& p) {
  return packed(p) ? std::array<int64_t, 3>{p.total_k, p.heads_kv, 1}
                   : std::array<int64_t, 3>{p.len_k, p.heads_kv, p.batch};
}

// What the warp-specialised forward and row-entropy pass both decline (the call then runs
// csrc/fwd_kernel.h): padded head dim d not 64 / 128 (40..64, 104..128 pad to them), masks,
// dropout, windows, sinks, soft-capping (compile-time features of today's kernels only), a grid
// too large, and a Q or K that TMA cannot read (16-byte aligned address and strides).
inline const char* ws_declines_common(const FwdParams& p, int arch, int d) {
  if (!SSA_FLASH_HOPPER_FWD) return "not in this build (SSA_FLASH_HOPPER_FWD=0)";
  if (!hopper_fwd_enabled()) return "off at run time (SSA_FLASH_HOPPER_FWD unset or not 1; set_hopper_fwd)";
  if (arch != 900) return "not sm_90";
  if (d != 64 && d != 128) return "head dim: 64 and 128 (padded) only";
  if ((d == 64 && !SSA_FLASH_HEAD_DIM_64) || (d == 128 && !SSA_FLASH_HEAD_DIM_128)) return "head dim not in this build";
  if (p.mask_kind != kMaskNone) return "masks";
  if (p.drop_rng != nullptr) return "dropout";
  if (p.window) return "local windows";
  if (p.sinks != nullptr) return "attention sinks";
  if (p.softcap) return "soft-capping";
  if (p.heads > 65535 || p.batch > 65535 || p.len_q == 0) return "grid";
  if (!tma_operand_ok(p.q, {p.q_sm, p.q_sh, p.q_sb}, q_extents(p)) ||
      !tma_operand_ok(p.k, {p.k_sm, p.k_sh, p.k_sb}, k_extents(p)))
    return "an operand's address or strides are not 16-byte aligned (TMA)";
  return nullptr;
}

// nullptr if the warp-specialised forward takes the call on a device of architecture `arch`
// (100 major + 10 minor), else why not (ws_declines_common, and V and O as Q and K).
inline const char* fwd_ws_declines(const FwdParams& p, int arch) {
  const char* why = ws_declines_common(p, arch, padded_head_dim(p.dim > p.dim_v ? p.dim : p.dim_v));
  if (why != nullptr) return why;
  if (!tma_operand_ok(p.v, {p.v_sm, p.v_sh, p.v_sb}, k_extents(p)) ||
      !tma_operand_ok(p.o, {p.o_sm, p.o_sh, p.o_sb}, q_extents(p)))
    return "an operand's address or strides are not 16-byte aligned (TMA)";
  return nullptr;
}

// nullptr if the warp-specialised row-entropy pass (fwd_row_entropy.h) takes the adaptive
// temperature's first pass (p as set_params.h row_entropy_params: Q and K only), else why not.
inline const char* row_entropy_ws_declines(const FwdParams& p, int arch) {
  return ws_declines_common(p, arch, padded_head_dim(p.dim));
}

// The rank-4 (head dim, rows, head, batch) view of a (B, H, L, D) tensor of 16-bit elements with
// element strides (s_row, s_head, s_batch), 128-byte swizzle, box 64 x box_rows x 1 x 1 (rows and
// head dim past the tensor read as zeros). Empty extents become 1 (the kernel then loads nothing).
inline TmaTileSpec tma_spec_bhld(const void* base, int64_t dim, int64_t rows, int64_t heads, int64_t batch,
                                 int64_t s_row, int64_t s_head, int64_t s_batch, int box_rows) {
  auto at_least_1 = [](int64_t x) { return x > 0 ? x : int64_t(1); };
  TmaTileSpec t{};
  t.base = base;
  t.rank = 4;
  t.elem_bytes = 2;
  t.swizzle_bytes = 128;
  const int64_t dims[4] = {at_least_1(dim), at_least_1(rows), at_least_1(heads), at_least_1(batch)};
  const int64_t strides[4] = {0, 2 * s_row, 2 * s_head, 2 * s_batch};
  const int box[4] = {64, box_rows, 1, 1};
  for (int i = 0; i < 4; ++i) {
    t.dims[i] = dims[i];
    // (a stride of an extent-1 dimension is never used; some callers pass 0 there)
    t.strides[i] = dims[i] == 1 && i > 0 ? 16 : strides[i];
    t.box[i] = box[i];
  }
  return t;
}

struct FwdTmaSpecs {
  TmaTileSpec q, k, v, o;
};

// Q's (or O's: dim p.dim_v) map, K's or V's (packed sequences: the (1, H, total rows) view)
inline TmaTileSpec tma_spec_q(const FwdParams& p, const void* base, int64_t dim, int64_t s_row, int64_t s_head,
                              int64_t s_batch, int box_rows) {
  const auto e = q_extents(p);
  return tma_spec_bhld(base, dim, e[0], e[1], e[2], s_row, s_head, s_batch, box_rows);
}
inline TmaTileSpec tma_spec_k(const FwdParams& p, const void* base, int64_t dim, int64_t s_row, int64_t s_head,
                              int64_t s_batch, int box_rows) {
  const auto e = k_extents(p);
  return tma_spec_bhld(base, dim, e[0], e[1], e[2], s_row, s_head, s_batch, box_rows);
}

template <typename Tr>
FwdTmaSpecs fwd_tma_specs(const FwdParams& p) {
  FwdTmaSpecs s;
  s.q = tma_spec_q(p, p.q, p.dim, p.q_sm, p.q_sh, p.q_sb, Tr::kBlockM);
  s.k = tma_spec_k(p, p.k, p.dim, p.k_sm, p.k_sh, p.k_sb, Tr::kBlockN);
  s.v = tma_spec_k(p, p.v, p.dim_v, p.v_sm, p.v_sh, p.v_sb, Tr::kBlockN);
  // the epilogue's store: each consumer warpgroup its 64 rows
  s.o = tma_spec_q(p, p.o, p.dim_v, p.o_sm, p.o_sh, p.o_sb, Tr::kBlockM / Tr::kConsumers);
  return s;
}

// The kernel's parameters for a call: p and its four tensor maps (tma_cache.h: encoded once per
// shape, the address patched per call).
template <typename T, typename Tr>
std::string make_fwd_ws_params(const FwdParams& p, HopperFwdParams& hp) {
  const FwdTmaSpecs specs = fwd_tma_specs<Tr>(p);
  hp.p = p;
  constexpr bool kBf16 = ElemInfo<T>::kIsBF16;
  TmaMapCache& cache = tma_cache();
  std::string err = cache.get(0, specs.q, kBf16, &hp.tma_q);
  if (err.empty()) err = cache.get(1, specs.k, kBf16, &hp.tma_k);
  if (err.empty()) err = cache.get(2, specs.v, kBf16, &hp.tma_v);
  if (err.empty()) err = cache.get(3, specs.o, kBf16, &hp.tma_o);
  return err;
}

template <typename Tr>
dim3 fwd_ws_grid(const AttnShape& p) {
  return SingleTileScheduler::grid((p.len_q + Tr::kBlockM - 1) / Tr::kBlockM, p.heads, p.batch);
}

// Launches the (Score, kAdaptive) instance at padded head dim kD with MUFU budget Mufu.
template <typename T, int kD, typename Mufu = MufuAll>
std::string run_fwd_ws_hdim(const FwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  using Tr = WsFwdTraits<kD, T, Mufu>;
  HopperFwdParams hp;
  const std::string err = make_fwd_ws_params<T, Tr>(p, hp);
  if (!err.empty()) return err;
  if (packed(p)) {
    auto kernel = feature_switch(score, adaptive, [](auto S, auto A) {
      return &attn_fwd_ws_varlen_kernel<Tr, decltype(S), decltype(A)::value>;
    });
    return detail::launch<T>(kernel, "attn_fwd_ws_varlen_kernel", fwd_ws_grid<Tr>(p), Tr::kThreads,
                             ws_fwd_smem_bytes<Tr>(), stream, hp);
  }
  auto kernel = feature_switch(score, adaptive, [](auto S, auto A) {
    return &attn_fwd_ws_kernel<Tr, decltype(S), decltype(A)::value>;
  });
  return detail::launch<T>(kernel, "attn_fwd_ws_kernel", fwd_ws_grid<Tr>(p), Tr::kThreads, ws_fwd_smem_bytes<Tr>(), stream,
                           hp);
}

// SSA_FLASH_HOPPER_MUFU_SWEEP (default 0; with SSA_FLASH_HOPPER_FWD): the build also holds the
// MUFU budgets of bench/run_gpu.sh's sweep, bfloat16 SSA with a fixed temperature only (those
// csrc/hopper/fwd_instances.cu's static model compares): D 64 with 2/8, 3/8 of ex2 and 2/8 + 2/8 of
// ex2 + lg2 on the FMA pipe, D 128 with 1/8 and 2/8 of ex2. A call runs one when the run-time budget
// (tma_cache.h, hopper_mufu_budget) names it; other calls, and other budgets, the all-MUFU instances.
#ifndef SSA_FLASH_HOPPER_MUFU_SWEEP
#define SSA_FLASH_HOPPER_MUFU_SWEEP 0
#endif

// The sweep's instance for budget 8 * ex2 + lg2 (eighths), or "" with *taken false.
template <typename T, int kD>
std::string run_fwd_ws_budget(const FwdParams& p, int budget, cudaStream_t stream, bool* taken) {
  *taken = false;
  if constexpr (SSA_FLASH_HOPPER_MUFU_SWEEP && ElemInfo<T>::kIsBF16) {
    auto launch = [&](auto mufu) {
      using Tr = WsFwdTraits<kD, T, decltype(mufu)>;
      HopperFwdParams hp;
      std::string err = make_fwd_ws_params<T, Tr>(p, hp);
      if (!err.empty()) return err;
      return detail::launch<T>(&attn_fwd_ws_kernel<Tr, Ssa, false>, "attn_fwd_ws_kernel", fwd_ws_grid<Tr>(p),
                               Tr::kThreads, ws_fwd_smem_bytes<Tr>(), stream, hp);
    };
    *taken = true;
    if constexpr (kD == 64) {
      if (budget == 8 * 2) return launch(MufuBudget<2, 0>{});
      if (budget == 8 * 3) return launch(MufuBudget<3, 0>{});
      if (budget == 8 * 2 + 2) return launch(MufuBudget<2, 2>{});
    } else {
      if (budget == 8 * 1) return launch(MufuBudget<1, 0>{});
      if (budget == 8 * 2) return launch(MufuBudget<2, 0>{});
    }
    *taken = false;
  }
  (void)p; (void)budget; (void)stream;
  return std::string();
}

// The row-entropy pass at padded head dim kD: Q's and K's maps (the forward's: the same cache
// entries), the (Score) instance.
template <typename T, int kD>
std::string run_row_entropy_ws_hdim(const FwdParams& p, int score, cudaStream_t stream) {
  using Tr = WsRowEntropyTraits<kD, T>;
  HopperFwdParams hp{};
  hp.p = p;
  constexpr bool kBf16 = ElemInfo<T>::kIsBF16;
  TmaMapCache& cache = tma_cache();
  std::string err = cache.get(0, tma_spec_q(p, p.q, p.dim, p.q_sm, p.q_sh, p.q_sb, Tr::kBlockM), kBf16, &hp.tma_q);
  if (err.empty()) err = cache.get(1, tma_spec_k(p, p.k, p.dim, p.k_sm, p.k_sh, p.k_sb, Tr::kBlockN), kBf16, &hp.tma_k);
  if (!err.empty()) return err;
  if (packed(p)) {
    auto kernel = score_switch(score, [](auto S) { return &attn_row_entropy_ws_varlen_kernel<Tr, decltype(S)>; });
    return detail::launch<T>(kernel, "attn_row_entropy_ws_varlen_kernel", fwd_ws_grid<Tr>(p), Tr::kThreads,
                             ws_row_entropy_smem_bytes<Tr>(), stream, hp);
  }
  auto kernel = score_switch(score, [](auto S) { return &attn_row_entropy_ws_kernel<Tr, decltype(S)>; });
  return detail::launch<T>(kernel, "attn_row_entropy_ws_kernel", fwd_ws_grid<Tr>(p), Tr::kThreads,
                           ws_row_entropy_smem_bytes<Tr>(), stream, hp);
}

// The call row_entropy_ws_declines took.
template <typename T>
std::string run_row_entropy_ws(const FwdParams& p, int score, cudaStream_t stream) {
  if constexpr (SSA_FLASH_HOPPER_FWD) {
    const int d = padded_head_dim(p.dim);
    if constexpr (SSA_FLASH_HEAD_DIM_64)
      if (d == 64) return run_row_entropy_ws_hdim<T, 64>(p, score, stream);
    if constexpr (SSA_FLASH_HEAD_DIM_128)
      if (d == 128) return run_row_entropy_ws_hdim<T, 128>(p, score, stream);
    return "attn_row_entropy_ws_kernel: head dim " + std::to_string(d) + " not taken";
  } else {
    (void)p; (void)score; (void)stream;
    return "attn_row_entropy_ws_kernel: not in this build (SSA_FLASH_HOPPER_FWD=0)";
  }
}

// The call fwd_ws_declines took (padded head dim 64 or 128).
template <typename T>
std::string run_fwd_ws(const FwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  if constexpr (SSA_FLASH_HOPPER_FWD) {
    const int d = padded_head_dim(p.dim > p.dim_v ? p.dim : p.dim_v);
    const int budget = hopper_mufu_budget().load(std::memory_order_relaxed);
    if (budget != 0 && score == Ssa::kId && !adaptive && !packed(p)) {
      bool taken = false;
      std::string err = d == 64 ? run_fwd_ws_budget<T, 64>(p, budget, stream, &taken)
                                : run_fwd_ws_budget<T, 128>(p, budget, stream, &taken);
      if (taken) return err;
    }
    if constexpr (SSA_FLASH_HEAD_DIM_64)
      if (d == 64) return run_fwd_ws_hdim<T, 64>(p, score, adaptive, stream);
    if constexpr (SSA_FLASH_HEAD_DIM_128)
      if (d == 128) return run_fwd_ws_hdim<T, 128>(p, score, adaptive, stream);
    return "attn_fwd_ws_kernel: head dim " + std::to_string(d) + " not taken";
  } else {
    (void)p; (void)score; (void)adaptive; (void)stream;
    return "attn_fwd_ws_kernel: not in this build (SSA_FLASH_HOPPER_FWD=0)";
  }
}

}  // namespace hopper
}  // namespace ssa_flash
