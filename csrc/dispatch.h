// Template dispatch: run-time flags and head dims to compile-time constants, in one place. Each
// helper calls f with std::integral_constant arguments (read them as decltype(x)::value), so the
// launch code names each kernel template once instead of repeating ladders of ternaries. No torch.
#pragma once

#include <string>
#include <type_traits>

#include "logits.h"
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

// The score functions the kernels are compiled for (logits.h), in any order: each is dispatched
// by its kId, the registry's id (ssa_flash/scores.py). A new score function is a policy type in
// logits.h and its name here.
template <typename... S>
struct ScoreList {};
using Scores = ScoreList<Softmax, Ssa, LogitScale>;

// Whether `id` names a score function of Scores (set_params.h checks each call's id).
template <typename... S>
constexpr bool known_score(int id, ScoreList<S...>) {
  return ((id == S::kId) || ...);
}
constexpr bool known_score(int id) { return known_score(id, Scores{}); }

// f(S) with S the policy type (a value of it) whose kId is `id`; an unknown id (which check_call
// refuses before any dispatch) gets the first type of the list.
template <typename F, typename S0, typename... S>
auto score_switch_in(int id, ScoreList<S0, S...>, F&& f) {
  if constexpr (sizeof...(S) > 0) {
    if (id != S0::kId) return score_switch_in(id, ScoreList<S...>{}, f);
  }
  return f(S0{});
}
template <typename F>
auto score_switch(int id, F&& f) {
  return score_switch_in(id, Scores{}, f);
}

// f(Score, Adaptive): the score function's policy and the temperature flag every kernel is
// templated on.
template <typename F>
auto feature_switch(int score, bool adaptive, F&& f) {
  return score_switch(score, [&](auto S) {
    if (adaptive) return f(S, True{});
    return f(S, False{});
  });
}

// f(Score, Adaptive, Cap, Sink): feature_switch with the two optional features every query-row
// kernel is also templated on, logit soft-capping and attention sinks (docs/maths.md section 6);
// calls without them get the <Score, Adaptive, False, False> instances, the kernels as they were
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
auto extras_switch(int score, bool adaptive, bool cap, bool sink, F&& f) {
  return bool_switch(cap, [&](auto C) {
    return bool_switch(sink, [&](auto K) {
      return feature_switch(score, adaptive, [&](auto S, auto A) {
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
