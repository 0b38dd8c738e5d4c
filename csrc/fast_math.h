// Fast math in base-2 units: ex2 / lg2 / rcp (MUFU), their FMA-pipe polynomial forms (ex2_poly,
// lg2_poly) and the compile-time MUFU budget that mixes them, sign and -inf helpers, the constants
// that convert between natural and base-2 logarithms.
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

// ------------------------------------------------------------------------------------------
// The same exponential and logarithm on the FMA pipe (plain float arithmetic, so the CPU
// emulation runs exactly what the GPU runs), for kernels that move a share of their MUFU work off
// the MUFU unit (16 operations per clock and SM on sm_80 / sm_90, against 128 FMA-pipe ones:
// docs/design.md section 4.3). Compile-time shares: MufuBudget below.

// 2^x for x <= 0 (finite or -inf: 2^-126 then, ~1e-38; callers use it where no -inf occurs): x
// = j + f, |f| <= 1/2, by adding 1.5 2^23 (the round-to-nearest trick: j lands in the low mantissa
// bits), 2^f by a degree-4 minimax polynomial (relative error 2.6e-6, 5.3e-6 evaluated in float32;
// as ssa_flash/triton/fast_math.py exp2_poly), times 2^j. 10 instructions: FMNMX, 3 FADD, 4 FFMA, an integer
// add-shift, an FMUL.
SSA_DEVICE float ex2_poly(float x) {
  x = fmaxf(x, -126.0f);
  const float t = x + 12582912.0f;
  const float f = x - (t - 12582912.0f);
  float p = fmaf(f, 0.009570100784094435f, 0.055917865312126704f);
  p = fmaf(p, f, 0.24024744899936581f);
  p = fmaf(p, f, 0.6931218141369884f);
  p = fmaf(p, f, 0.9999992614102138f);
  // 2^j as a float (t's low bits hold j: (bits + 127) << 23 is j + 127 in the exponent field), then
  // one FMUL: the result comes from the float pipe (written by an integer add, it made ptxas
  // serialise the forward's wgmma when it lands in an accumulator register)
  return p * __int_as_float((__float_as_int(t) + 127) << 23);
}

// log2(u) for finite u >= 1 (SSA's u = 1 + b scale |s|): the exponent field e and the mantissa
// m = 1 + y in [1, 2), log2 u = e + y q(y), q a degree-6 polynomial fitted to log2(1 + y) / y on
// [0, 1] (absolute error 4.3e-7 evaluated in float32, against lg2.approx's ~2^-22 = 2.4e-7; the
// fit: tests/cuda/test_hopper_fwd_emulated.py test_fast_math_poly). The exponent becomes a float
// without a conversion instruction (I2F runs at MUFU's rate): 2^23 + e as bits, minus 2^23 + 127.
// 12 instructions: 2 LOP3, a shift, 2 FADD, 7 FFMA.
SSA_DEVICE float lg2_poly(float u) {
  const int bits = __float_as_int(u);
  const float e = __int_as_float(0x4B000000 | (bits >> 23)) - 8388735.0f;
  const float y = __int_as_float((bits & 0x007FFFFF) | 0x3F800000) - 1.0f;
  float q = fmaf(y, 0.015529895201325417f, -0.07955765724182129f);
  q = fmaf(q, y, 0.19429421424865723f);
  q = fmaf(q, y, -0.32590189576148987f);
  q = fmaf(q, y, 0.4735533893108368f);
  q = fmaf(q, y, -0.7205854654312134f);
  q = fmaf(q, y, 1.442667841911316f);
  return fmaf(y, q, e);
}

// A compile-time MUFU budget: of every 8 consecutive elements of a thread's score tile (its
// registers, in order), the first kEx2Poly take ex2_poly instead of ex2 and the first kLg2Poly
// take lg2_poly instead of lg2 (0..8 each; 0, 0: all on the MUFU unit). Static indices, so the
// choice costs nothing at run time.
template <int kEx2Poly_ = 0, int kLg2Poly_ = 0>
struct MufuBudget {
  static_assert(kEx2Poly_ >= 0 && kEx2Poly_ <= 8 && kLg2Poly_ >= 0 && kLg2Poly_ <= 8, "MufuBudget: shares in eighths");
  static constexpr int kEx2Poly = kEx2Poly_;
  static constexpr int kLg2Poly = kLg2Poly_;
  template <int kIdx>
  static SSA_DEVICE float exp2(float x) {
    if constexpr (kIdx % 8 < kEx2Poly_) return ex2_poly(x);
    else return ex2(x);
  }
  template <int kIdx>
  static constexpr bool kPolyLg2At = kIdx % 8 < kLg2Poly_;
};
using MufuAll = MufuBudget<0, 0>;

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
