// The pieces of a kernel launch that today's launchers (launch_impl.h) and the sm_90a backward's
// (hopper/bwd_launch.h, which runs today's pre-pass before its kernel) share: the device's code
// path, the grids, the launch of a (score, adaptive, softcap, sink) instance, the dQ kernel's
// instance. No torch here.
#pragma once

#ifndef SSA_FLASH_EMULATE
#include <cuda_runtime.h>
#endif

#include <string>

#include "bwd_kernel.h"
#include "dispatch.h"
#include "launch_kernel.h"
#include "params.h"
#include "traits.h"

namespace ssa_flash {
namespace detail {

// The code path of the current device (traits.h; shared memory depends on it).
inline int device_path() {
  int arch = 0, max_optin = 0;
  return device_info(arch, max_optin).empty() ? code_path(arch) : kPathSm80;
}

// Grids: one CTA per query block of a head (the query-row kernels: forward, row entropy, dQ), or
// per key block of a key/value head (the key-block kernels: dK/dV, fused backward).
template <typename Tr>
dim3 query_grid(const AttnShape& p) {
  return dim3((p.len_q + Tr::kBlockM - 1) / Tr::kBlockM, p.heads, p.batch);
}
template <typename Tr>
dim3 key_grid(const AttnShape& p) {
  return dim3((p.len_k + Tr::kBlockN - 1) / Tr::kBlockN, p.heads_kv, p.batch);
}

// Launches the (score, adaptive, softcap, sink) instance of a kernel template that
// pick(Score, Adaptive, Cap, Sink) returns (dispatch.h, extras_switch), with Tr's threads.
template <typename T, typename Tr, typename Params, typename Pick>
std::string launch_variant(const char* name, Pick&& pick, int score, bool adaptive, dim3 grid, int smem,
                           cudaStream_t stream, const Params& p) {
  return launch<T>(extras_switch(score, adaptive, p.softcap, p.sinks != nullptr, pick), name, grid, Tr::kNThreads,
                   smem, stream, p);
}

// The dQ kernel (or its pre-pass, kPrep) of a (Score, Adaptive, Cap, Sink) call: a sink matters
// there only with the adaptive temperature (its dbeta term), so a sink without it runs the
// sink-free instance. (The key-block kernels need no sink at all: the lse they read includes it.)
template <typename Dq, bool kPrep, typename S, typename A, typename C, typename K>
auto dq_kernel(S, A, C, K) {
  return &attn_bwd_dq_kernel<Dq, S, A::value, kPrep, C::value, K::value && A::value>;
}

}  // namespace detail
}  // namespace ssa_flash
