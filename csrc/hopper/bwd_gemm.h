// The GEMM of the sm_90a backward that gemm_wgmma.h does not have: dQ = dS K with both operands
// in shared memory and both MN-major (the PTX ISA's imm-trans-a = imm-trans-b = 1), so that dS^T,
// stored [key][query] as the consumers hold it, is read as the A operand dS (64 queries x keys)
// without a transposing copy, and K [key][d] as the N-major B operand (as wg_gemm_rn reads it).
// Elsewhere than sm_90a the wrapper traps (never reached); in the CPU emulation it is csrc/emu's.
#pragma once

#include "../gemm_wgmma.h"

namespace ssa_flash {
namespace hopper {

#ifdef SSA_FLASH_EMULATE
using ssa_emu::wgmma_ss_tb;
using ssa_emu::wgmma_ss_tt;
#else
// d (64 x 64) [+]= A (desc da, MN-major) * B (desc db, MN-major)
template <typename T, int N>
SSA_DEVICE void wgmma_ss_tt(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
  static_assert(N == 64, "wgmma_ss_tt: N = 64");
#if SSA_FLASH_WGMMA
#define SSA_TT_D1(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define SSA_TT_D4(i) SSA_TT_D1(i), SSA_TT_D1(i + 1), SSA_TT_D1(i + 2), SSA_TT_D1(i + 3)
#define SSA_TT(TY)                                                                                                 \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                       \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY                                            \
               " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 1, 1;\n}\n"            \
               : SSA_TT_D4(0), SSA_TT_D4(4)                                                                       \
               : "l"(da), "l"(db), "r"(accumulate))
  if constexpr (ElemInfo<T>::kIsBF16) SSA_TT("bf16");
  else SSA_TT("f16");
#else
  (void)d; (void)da; (void)db; (void)accumulate;
  __trap();
#endif
}

// d (64 x N) [+]= A (desc da, K-major) * B (desc db, MN-major); N = 64 or 128
template <typename T, int N>
SSA_DEVICE void wgmma_ss_tb(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_ss_tb: N = 64 or 128");
#if SSA_FLASH_WGMMA
#define SSA_TB(TY, NN, REGS, IA, IB, IS, ...)                                                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                                            \
               "wgmma.mma_async.sync.aligned.m64n" #NN "k16.f32." TY "." TY " " REGS ", %" IA ", %" IB    \
               ", p, 1, 1, 0, 1;\n}\n"                                                                     \
               : __VA_ARGS__                                                                              \
               : "l"(da), "l"(db), "r"(accumulate))
#define SSA_R32                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SSA_R64                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "  \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
  "%62, %63}"
  if constexpr (N == 64) {
    if constexpr (ElemInfo<T>::kIsBF16) SSA_TB("bf16", 64, SSA_R32, "32", "33", "34", SSA_TT_D4(0), SSA_TT_D4(4));
    else SSA_TB("f16", 64, SSA_R32, "32", "33", "34", SSA_TT_D4(0), SSA_TT_D4(4));
  } else {
    if constexpr (ElemInfo<T>::kIsBF16)
      SSA_TB("bf16", 128, SSA_R64, "64", "65", "66", SSA_TT_D4(0), SSA_TT_D4(4), SSA_TT_D4(8), SSA_TT_D4(12));
    else SSA_TB("f16", 128, SSA_R64, "64", "65", "66", SSA_TT_D4(0), SSA_TT_D4(4), SSA_TT_D4(8), SSA_TT_D4(12));
  }
#undef SSA_R64
#undef SSA_R32
#undef SSA_TB
#else
  (void)d; (void)da; (void)db; (void)accumulate;
  __trap();
#endif
}
#undef SSA_TT
#undef SSA_TT_D4
#undef SSA_TT_D1
#endif

// acc (64 x 64, f32) = dS (64 queries x kKeys) B (kKeys x 64): sDsT the dS^T rows of the first key
// (a [key][query] Sw128Tile, one 64-query panel: k steps of 16 keys are 16 rows, 2048 bytes on),
// sB the same key's row in the first column's panel of a [key][d] Sw128Tile (N-major, the 64
// columns of one panel). Only issues: the caller commits and waits.
// acc (64 x kN, f32) += A (64 x kK) B: A the 64 rows of a K-major tile LA from sA (k along its
// columns: 16 k per step, +32 bytes inside a panel), B a kK-row tile LB read N-major (as
// wg_gemm_rn's B: 16 rows per step, 2048 bytes on; the next 64 columns a panel on). Only issues.
template <typename T, int kN, int kK, typename LA, typename LB>
SSA_DEVICE void wg_gemm_sn(float (&acc)[kN / 8][4], const T* sA, const T* sB) {
  static_assert(LB::kRows == kK && kN % 64 == 0 && kN <= 128, "wg_gemm_sn: a kK-row B tile, N 64 or 128");
  const uint64_t da = wgmma_desc(sA, 16, 1024), db = wgmma_desc(sB, LB::kPanelBytes, 1024);
  wgmma_fence_operand(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk)
    wgmma_ss_tb<T, kN>(acc, desc_add(da, (kk / 4) * LA::kPanelBytes + (kk % 4) * 32), desc_add(db, kk * 2048), 1);
}

// (LBO, the next 64-column panel, is not used by a 64-wide operand; given as the tiles' anyway.)
template <typename T, int kKeys, typename LA, typename LB>
SSA_DEVICE void wg_gemm_tt(float (&acc)[8][4], const T* sDsT, const T* sB) {
  static_assert(kKeys % 16 == 0, "wg_gemm_tt: whole k steps");
  const uint64_t da = wgmma_desc(sDsT, LA::kPanelBytes, 1024), db = wgmma_desc(sB, LB::kPanelBytes, 1024);
  wgmma_fence_operand(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk)
    wgmma_ss_tt<T, 64>(acc, desc_add(da, kk * 2048), desc_add(db, kk * 2048), kk > 0);
}

}  // namespace hopper
}  // namespace ssa_flash
