// Fast math in base-2 units: ex2 / lg2 / rcp (MUFU), sign and -inf helpers, the constants that
// convert between natural and base-2 logarithms.
#pragma once

#include "arch.h"

namespace ssa_flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

#ifdef SSA_FLASH_EMULATE
using ssa_emu::ex2;
using ssa_emu::lg2;
using ssa_emu::rcp;
using ssa_emu::tanh_approx;
#else
// ------------------------------------------------------------------------------------------
// Fast math: base-2 exponential and logarithm (MUFU). ex2(-inf) = +0, lg2(0) = -inf.

SSA_DEVICE float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

SSA_DEVICE float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

SSA_DEVICE float rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// tanh (logit soft-capping): tanh.approx.f32 (MUFU.TANH, sm_75+; absolute error about 2^-11,
// below the float16 / bfloat16 rounding of the inputs the scores come from); sm_70 has no such
// instruction and uses tanh x = 1 - 2 / (2^(2x log2 e) + 1) (one MUFU.EX2, one MUFU.RCP), which
// saturates to +-1 for large |x| (ex2 -> inf or 0).
SSA_DEVICE float tanh_approx(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
  return 1.0f - 2.0f * rcp(ex2(x * (2.0f * kLog2e)) + 1.0f);
#else
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}
#endif  // SSA_FLASH_EMULATE

// x with its sign flipped where s is negative: sgn(s) * x in one LOP3 (also for s = -0, whose
// x is 0 in every use here).
SSA_DEVICE float xor_sign(float x, float s) {
  return __int_as_float(__float_as_int(x) ^ (__float_as_int(s) & 0x80000000));
}

// a * b rounded on its own: never contracted with a following add into an FMA (the backward's
// recounted LSE, lse_residual.h, needs beta l2 rounded as its recount rounded it)
SSA_DEVICE float mul_rn(float a, float b) {
#ifdef SSA_FLASH_EMULATE
  return a * b;
#else
  return __fmul_rn(a, b);
#endif
}

SSA_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// A running row max with -inf (nothing admissible yet) replaced by 0, so that ex2(l - m) is 0
// instead of NaN for -inf logits.
SSA_DEVICE float safe_max(float m) { return m == neg_inf() ? 0.0f : m; }

}  // namespace ssa_flash
