// The 16-bit element types (float16, bfloat16): what each needs (ElemInfo), which kernels an
// architecture never launches (kernel_unsupported), and two floats <-> one packed b32 register.
#pragma once

#include "arch.h"

namespace ssa_flash {

// ------------------------------------------------------------------------------------------
// Element types

template <typename T>
struct ElemInfo;

template <>
struct ElemInfo<__half> {
  static constexpr bool kIsBF16 = false;
  static constexpr int kMinArch = 700;
};

template <>
struct ElemInfo<__nv_bfloat16> {
  static constexpr bool kIsBF16 = true;
  static constexpr int kMinArch = 800;
};

// Kernels the host never launches on the architecture being compiled: bfloat16 below sm_80, and
// head dims above 128 on sm_75 (their tiles exceed its 64 KiB of shared memory; launch_impl.h
// refuses them). Their bodies become a trap: less code, and no register pressure (spills) from
// code that cannot run.
template <typename T, int kHeadDim>
SSA_DEVICE constexpr bool kernel_unsupported() {
#if defined(__CUDA_ARCH__)
  return ElemInfo<T>::kMinArch > __CUDA_ARCH__ || (kHeadDim > 128 && __CUDA_ARCH__ >= 750 && __CUDA_ARCH__ < 800);
#else
  return false;
#endif
}

// Two floats rounded to the 16-bit type, packed into one b32 register (first in the low half).
template <typename T>
SSA_DEVICE uint32_t pack2(float lo, float hi);

template <>
SSA_DEVICE uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
SSA_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
SSA_DEVICE float2 unpack2(uint32_t v);

template <>
SSA_DEVICE float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}

template <>
SSA_DEVICE float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}

}  // namespace ssa_flash
