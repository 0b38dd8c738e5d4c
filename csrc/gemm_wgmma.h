// Warpgroup GEMMs on sm_90a: the wgmma.mma_async wrappers, their matrix descriptors and
// ordering fences, and the two GEMM shapes (wg_gemm_nt, wg_gemm_rn) the kernels issue where
// traits.h says (fwd_wgmma, dq_wgmma, bwd_wgmma). Elsewhere the wrappers trap (never reached).
#pragma once

#include "elem.h"
#include "memory.h"

namespace ssa_flash {

// ------------------------------------------------------------------------------------------
// wgmma (sm_90a): D (64 x N, f32) = A (64 x 16) * B (16 x N) [+ D], issued by a warpgroup (4
// consecutive warps) and completed asynchronously: issue, commit the group, wait for it.
// Register layouts (PTX ISA, "Matrix fragments for wgmma.m64nNk16"): warp w of the group holds
// rows 16 w .. 16 w + 15, and inside them exactly the mma.m16n8k16 layouts above, so
// accumulators are float[N / 8][4] as struct Frag describes and an A operand in registers is
// the uint32_t[4] of one 16 x 16 block (acc_to_frag). Operands in shared memory are described by
// a 64-bit matrix descriptor; the tiles here use the 128-byte swizzle only (smem_layout.h, Sw128Tile):
//   bits 0-13 start address >> 4, 16-29 leading-dimension byte offset >> 4, 32-45 stride-
//   dimension byte offset >> 4, 49-51 base offset (0: every swizzle atom 1024-byte aligned),
//   62-63 swizzle mode (1: 128 B).
// K-major operand (k contiguous, 64 elements = 128 B per row of m or n): rows 8 apart are SBO
// bytes apart; a k step of 16 elements inside the 128-byte row is +32 bytes on the start address
// (the swizzle is a function of the address bits, 7-9 into 4-6). MN-major operand (n contiguous,
// 64 n per 128-byte row of one k): k rows 8 apart are SBO apart, the next 64 n LBO apart.
// Ordering: shared memory written through the generic proxy (st.shared, cp.async) must be fenced
// (fence_proxy_async) by the writing threads before the barrier after which wgmma reads it; the
// accumulators and the A registers must not be touched between issue and wait (the compiler is
// kept from moving code across with wgmma_fence_operand).

SSA_DEVICE uint64_t wgmma_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t addr = smem_u32(smem);
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

#ifdef SSA_FLASH_EMULATE
using ssa_emu::fence_proxy_async;
using ssa_emu::wgmma_commit;
using ssa_emu::wgmma_fence;
using ssa_emu::wgmma_fence_operand;
using ssa_emu::wgmma_rs_tb;
using ssa_emu::wgmma_ss;
using ssa_emu::wgmma_wait;
#else
SSA_DEVICE void fence_proxy_async() {
#if SSA_FLASH_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

SSA_DEVICE void wgmma_fence() {
#if SSA_FLASH_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

SSA_DEVICE void wgmma_commit() {
#if SSA_FLASH_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
SSA_DEVICE void wgmma_wait() {
#if SSA_FLASH_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// An empty asm that "modifies" each register: the compiler may not move reads or writes of
// them across it (placed after a wait and before an issue).
template <int N>
SSA_DEVICE void wgmma_fence_operand(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}

template <int N>
SSA_DEVICE void wgmma_fence_operand(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}

#define SSA_WG_D1(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define SSA_WG_D4(i) SSA_WG_D1(i), SSA_WG_D1(i + 1), SSA_WG_D1(i + 2), SSA_WG_D1(i + 3)
#define SSA_WG_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SSA_WG_R32                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SSA_WG_R64                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "  \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "   \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "   \
  "%62, %63}"
// "accumulate" is scale-d: 0 gives D = A B (the old D is not read)
#define SSA_WG_SS(N, REGS, TY, IA, IB, IS, ...)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", %" IA ", %" IB \
               ", p, 1, 1, 0, 0;\n}\n"                                                              \
               : __VA_ARGS__                                                                        \
               : "l"(da), "l"(db), "r"(accumulate))
// A from registers (operands A0..A3), B N-major ("transposed")
#define SSA_WG_RS_TB(N, REGS, TY, A0, A1, A2, A3, IB, IS, ...)                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", {%" A0 ", %" A1 \
               ", %" A2 ", %" A3 "}, %" IB ", p, 1, 1, 1;\n}\n"                                          \
               : __VA_ARGS__                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate))

// Both operands from shared memory, both K-major: d (64 x N) [+]= A (desc da) * B (desc db).
template <typename T, int N>
SSA_DEVICE void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma_ss: N = 32, 64 or 128");
#if SSA_FLASH_WGMMA
  if constexpr (N == 32) {
    if constexpr (ElemInfo<T>::kIsBF16) SSA_WG_SS(32, SSA_WG_R16, "bf16", "16", "17", "18", SSA_WG_D4(0));
    else SSA_WG_SS(32, SSA_WG_R16, "f16", "16", "17", "18", SSA_WG_D4(0));
  } else if constexpr (N == 128) {
    if constexpr (ElemInfo<T>::kIsBF16)
      SSA_WG_SS(128, SSA_WG_R64, "bf16", "64", "65", "66", SSA_WG_D4(0), SSA_WG_D4(4), SSA_WG_D4(8), SSA_WG_D4(12));
    else SSA_WG_SS(128, SSA_WG_R64, "f16", "64", "65", "66", SSA_WG_D4(0), SSA_WG_D4(4), SSA_WG_D4(8), SSA_WG_D4(12));
  } else {
    if constexpr (ElemInfo<T>::kIsBF16) SSA_WG_SS(64, SSA_WG_R32, "bf16", "32", "33", "34", SSA_WG_D4(0), SSA_WG_D4(4));
    else SSA_WG_SS(64, SSA_WG_R32, "f16", "32", "33", "34", SSA_WG_D4(0), SSA_WG_D4(4));
  }
#else
  (void)d; (void)da; (void)db; (void)accumulate;
  __trap();
#endif
}

// A from registers (one 16 x 16 block per warp, the mma.m16n8k16 A fragment), B from shared
// memory N-major: d (64 x N) [+]= A * B (desc db).
template <typename T, int N>
SSA_DEVICE void wgmma_rs_tb(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_rs_tb: N = 64 or 128");
#if SSA_FLASH_WGMMA
  if constexpr (N == 64) {
    if constexpr (ElemInfo<T>::kIsBF16)
      SSA_WG_RS_TB(64, SSA_WG_R32, "bf16", "32", "33", "34", "35", "36", "37", SSA_WG_D4(0), SSA_WG_D4(4));
    else SSA_WG_RS_TB(64, SSA_WG_R32, "f16", "32", "33", "34", "35", "36", "37", SSA_WG_D4(0), SSA_WG_D4(4));
  } else {
    if constexpr (ElemInfo<T>::kIsBF16)
      SSA_WG_RS_TB(128, SSA_WG_R64, "bf16", "64", "65", "66", "67", "68", "69", SSA_WG_D4(0), SSA_WG_D4(4),
                   SSA_WG_D4(8), SSA_WG_D4(12));
    else SSA_WG_RS_TB(128, SSA_WG_R64, "f16", "64", "65", "66", "67", "68", "69", SSA_WG_D4(0), SSA_WG_D4(4),
                      SSA_WG_D4(8), SSA_WG_D4(12));
  }
#else
  (void)d; (void)a; (void)db; (void)accumulate;
  __trap();
#endif
}
#undef SSA_WG_D1
#undef SSA_WG_D4
#undef SSA_WG_R16
#undef SSA_WG_R32
#undef SSA_WG_R64
#undef SSA_WG_SS
#undef SSA_WG_RS_TB
#endif  // !SSA_FLASH_EMULATE

// ------------------------------------------------------------------------------------------
// Warpgroup GEMMs (sm_90a, wgmma; above): the 4 warps of a CTA compute a 64-row product
// together, warp w's accumulators being rows 16 w .. 16 w + 15 in the layout of the warp GEMMs
// (kMS = 1), so the elementwise code after them is the same. Operands are Sw128Tile tiles read
// by the tensor cores through descriptors (no ldmatrix). These only issue: the caller commits the
// group and waits for it (wgmma_commit, wgmma_wait) before reading the accumulators.

// Descriptor `desc` moved by `bytes` (a multiple of 16; stays inside shared memory, so the start
// address field does not overflow).
SSA_DEVICE uint64_t desc_add(uint64_t desc, int bytes) { return desc + static_cast<uint64_t>(bytes >> 4); }

// acc (64 x kN) = A (64 x kK) B^T: A 64 rows of an LA tile (sA: the first of them), B kN rows of
// an LB tile (sB: the first of them, a multiple of 8 rows in; as gemm_nt: both with k along the
// columns, K-major). One wgmma per 16 columns of k (+32 bytes inside a panel).
template <typename T, int kN, int kK, typename LA, typename LB>
SSA_DEVICE void wg_gemm_nt(float (&acc)[kN / 8][4], const T* sA, const T* sB) {
  static_assert(LA::kRows % 64 == 0 && LB::kRows >= kN, "wg_gemm_nt: 64 rows of A, kN rows of a B tile");
  const uint64_t da = wgmma_desc(sA, 16, 1024), db = wgmma_desc(sB, 16, 1024);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    const int panel = kk / 4, within = (kk % 4) * 32;  // bytes
    wgmma_ss<T, kN>(acc, desc_add(da, panel * LA::kPanelBytes + within), desc_add(db, panel * LB::kPanelBytes + within),
                    kk > 0);
  }
}

// acc (64 x kN) += A (64 x kK, per warp the A fragments of its 16 rows, as acc_to_frag makes
// them) B, B a kK-row tile read with n along its columns (N-major): whole 64-column panels, the
// next panel LBO = kPanelBytes on (one wgmma per 16 rows of k up to kN = 128).
template <typename T, int kN, int kK, typename LB>
SSA_DEVICE void wg_gemm_rn(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4], const T* sB) {
  static_assert(LB::kRows == kK && kN % 64 == 0, "wg_gemm_rn: a kK-row B tile, whole 64-column panels");
  constexpr int kNI = kN <= 128 ? kN : 128;  // columns per wgmma
  const uint64_t db = wgmma_desc(sB, LB::kPanelBytes, 1024);
  wgmma_fence_operand(acc);
  wgmma_fence();
#pragma unroll
  for (int kb = 0; kb < kK / 16; ++kb) {
#pragma unroll
    for (int c = 0; c < kN / kNI; ++c)
      wgmma_rs_tb<T, kNI>(*reinterpret_cast<float(*)[kNI / 8][4]>(&acc[c * kNI / 8]), a[kb],
                          desc_add(db, c * (kNI / 64) * LB::kPanelBytes + kb * 16 * 128), 1);
  }
}

}  // namespace ssa_flash
