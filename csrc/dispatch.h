// Template dispatch: run-time flags and head dims to compile-time constants, in one place. Each
// helper calls f with std::integral_constant arguments (read them as decltype(x)::value), so the
// launch code names each kernel template once instead of repeating ladders of ternaries. No torch.
#pragma once

#include <string>
#include <type_traits>

#include "traits.h"

namespace ssa_flash {

using True = std::true_type;
using False = std::false_type;

// f(B) with B = std::true_type or std::false_type as `flag`.
template <typename F>
auto bool_switch(bool flag, F&& f) {
  if (flag) return f(True{});
  return f(False{});
}

// f(Ssa, Adaptive): the two feature flags every kernel is templated on.
template <typename F>
auto feature_switch(bool ssa, bool adaptive, F&& f) {
  if (ssa) {
    if (adaptive) return f(True{}, True{});
    return f(True{}, False{});
  }
  if (adaptive) return f(False{}, True{});
  return f(False{}, False{});
}

// f(Ssa, Adaptive, Cap, Sink): feature_switch with the two optional features every query-row
// kernel is also templated on, logit soft-capping and attention sinks (docs/maths.md section 6);
// calls without them get the <Ssa, Adaptive, False, False> instances, the kernels as they were
// before these features.
// SSA_FLASH_EXTRAS: which of these instances a build holds. 1 (default): all. 0: only those
// without soft-capping and sinks (the kernels of a call that uses neither; a quicker build).
// 2: only those with one of them (the tests compile the new instances apart from the old ones:
// tests/csrc_objects.py). An instance a build leaves out is a null kernel, which launch() reports
// as an error, never a wrong result.
#ifndef SSA_FLASH_EXTRAS
#define SSA_FLASH_EXTRAS 1
#endif

template <typename F>
auto extras_switch(bool ssa, bool adaptive, bool cap, bool sink, F&& f) {
  return bool_switch(cap, [&](auto C) {
    return bool_switch(sink, [&](auto K) {
      return feature_switch(ssa, adaptive, [&](auto S, auto A) {
        constexpr bool kExtra = decltype(C)::value || decltype(K)::value;
        if constexpr (SSA_FLASH_EXTRAS == 1 || (SSA_FLASH_EXTRAS == 2) == kExtra) {
          return f(S, A, C, K);
        } else if constexpr (SSA_FLASH_EXTRAS == 2) {
          return decltype(f(S, A, True{}, True{}))(nullptr);
        } else {
          return decltype(f(S, A, False{}, False{}))(nullptr);
        }
      });
    });
  });
}


// SSA_FLASH_HEAD_DIM_<D> = 0 leaves head dim D out of the build (a build-time knob for quick
// experiments and the emulator's shorter builds); by default all five are compiled.
#ifndef SSA_FLASH_HEAD_DIM_32
#define SSA_FLASH_HEAD_DIM_32 1
#endif
#ifndef SSA_FLASH_HEAD_DIM_64
#define SSA_FLASH_HEAD_DIM_64 1
#endif
#ifndef SSA_FLASH_HEAD_DIM_96
#define SSA_FLASH_HEAD_DIM_96 1
#endif
#ifndef SSA_FLASH_HEAD_DIM_128
#define SSA_FLASH_HEAD_DIM_128 1
#endif
#ifndef SSA_FLASH_HEAD_DIM_256
#define SSA_FLASH_HEAD_DIM_256 1
#endif

inline std::string bad_head_dim(int dim, int dim_v) {
  return "head dims up to 256 are supported by the CUDA kernels, got " + std::to_string(dim) +
         " and " + std::to_string(dim_v);
}

// f(D) with D = std::integral_constant<int, padded head dim of max(dim, dim_v)> (traits.h,
// padded_head_dim); f returns an error message (empty: success). A head dim left out of the build,
// or above 256, is reported as an error.
template <typename F>
std::string head_dim_switch(int dim, int dim_v, F&& f) {
  switch (padded_head_dim(dim > dim_v ? dim : dim_v)) {
    case 32:
      if constexpr (SSA_FLASH_HEAD_DIM_32) return f(std::integral_constant<int, 32>{});
      break;
    case 64:
      if constexpr (SSA_FLASH_HEAD_DIM_64) return f(std::integral_constant<int, 64>{});
      break;
    case 96:
      if constexpr (SSA_FLASH_HEAD_DIM_96) return f(std::integral_constant<int, 96>{});
      break;
    case 128:
      if constexpr (SSA_FLASH_HEAD_DIM_128) return f(std::integral_constant<int, 128>{});
      break;
    case 256:
      if constexpr (SSA_FLASH_HEAD_DIM_256) return f(std::integral_constant<int, 256>{});
      break;
    default:
      break;
  }
  return bad_head_dim(dim, dim_v);
}

}  // namespace ssa_flash
