// Compile-time helpers for the kernels: a bool as a type (for generic lambdas) and a type chosen
// by a bool (no <type_traits> under NVRTC).
#pragma once

namespace ssa_flash {

template <bool B>
struct Bool {
  static constexpr bool value = B;
};

template <bool B, typename A, typename C>
struct SelectType {
  using type = A;
};
template <typename A, typename C>
struct SelectType<false, A, C> {
  using type = C;
};
template <bool B, typename A, typename C>
using Select = typename SelectType<B, A, C>::type;

}  // namespace ssa_flash
