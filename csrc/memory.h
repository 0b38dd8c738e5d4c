// Memory primitives below the tiles: shared-memory addresses, asynchronous global -> shared
// copies (cp.async on sm_80+, plain 16-byte loads and stores below) and the fused backward's
// atomic float adds to global memory.
#pragma once

#include "arch.h"

namespace ssa_flash {

#ifdef SSA_FLASH_EMULATE
using ssa_emu::cp_async_16;
using ssa_emu::cp_async_commit;
using ssa_emu::cp_async_wait;
using ssa_emu::smem_u32;
#else
// ------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+; plain 16-byte loads and stores on sm_75).

SSA_DEVICE uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or writes 16 zero bytes when !pred (gmem must still be a valid address).
SSA_DEVICE void cp_async_16(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
#else
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (pred) v = __ldg(reinterpret_cast<const uint4*>(gmem));
  *reinterpret_cast<uint4*>(smem) = v;
#endif
}

SSA_DEVICE void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
SSA_DEVICE void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}
#endif  // !SSA_FLASH_EMULATE

// Adds (a, b) to two adjacent floats of global memory (8-byte aligned) atomically, without a
// return value: one vector reduction (red.global.add.v2.f32) on sm_90, two scalar ones below.
// Inline PTX because atomicAdd on a generic pointer checks the address space first (a branch
// around every add in the SASS).
#ifdef SSA_FLASH_EMULATE
SSA_DEVICE void red_add2(float* addr, float a, float b) {
  atomicAdd(addr, a);
  atomicAdd(addr + 1, b);
}
#else
SSA_DEVICE void red_add2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(addr), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(addr + 1), "f"(b) : "memory");
#endif
}
#endif

}  // namespace ssa_flash
