// The logit transform, in base-2 units, mirroring ssa_flash/triton/logits.py: softmax or SSA
// (LogitCtx: what one (batch, query head) needs; row_mult: a row's multiplier, beta included;
// logit_raw: one score's logit before masks). Masks and the band are mask.h.
#pragma once

#include "fast_math.h"
#include "params.h"

namespace ssa_flash {

// ------------------------------------------------------------------------------------------
// Logits, in base-2 units: l2 = phi(z) log2(e) + mask log2(e), z = scale * s for the raw dot
// product s. Softmax: l2 = s * (scale log2 e). SSA: phi(z) log2(e) = n sgn(s) log2(1 + b scale |s|),
// computed as n * xor_sign(lg2(fma(b scale, |s|, 1)), s): one FFMA, one MUFU.LG2, one LOP3, one
// FMUL, no division. lg2.approx is accurate to an absolute 2^-22 or so on [1, inf), and softmax
// is shift-invariant, so only this absolute error (times n) matters, also where b|z| is tiny and
// 1 + b|z| rounds (log1p's usual concern is relative error, which the weights never see).

// What the logit transform needs for one (batch, query head). The mask fields are read from the
// kernel parameters where needed (apply_mask) rather than kept in registers: the forward at
// D = 128 has none to spare.
struct LogitCtx {
  float c;   // multiplies |s| or s: scale * b (SSA) or scale * log2(e) (softmax)
  float n;   // SSA exponent n (0 for softmax)
  float nb;  // d phi / dz at 0 (SSA: n b), for the backward
  int batch, head;
};

// kCap: the scores the kernel transforms are th = tanh(cap_in s) (softcap_raw), the capped score
// being s' = cap_out th; cap_out is folded into c here, so that th replaces s everywhere
// downstream at no cost per score (what SSA's db sums, w s', is then cap_out w th: the kernels
// apply cap_out once per partial, bwd_kernel.h).
template <bool kCap = false, typename P>
SSA_DEVICE LogitCtx make_logit_ctx(const P& p, int batch, int head, bool ssa) {
  LogitCtx c;
  const float cap = kCap ? p.cap_out : 1.0f;
  if (ssa) {
    const float b = p.ssa_b[head], n = p.ssa_n[head];
    c.c = p.scale * b * cap;
    c.n = n;
    c.nb = n * b;
  } else {
    c.c = p.scale * kLog2e * cap;
    c.n = c.nb = 0.0f;
  }
  c.batch = batch;
  c.head = head;
  return c;
}

// The multiplier of a row's logits (before masks): c (softmax) or n (SSA), times the row's
// adaptive temperature beta where there is one, so beta costs nothing per element.
template <bool kSSA>
SSA_DEVICE float row_mult(const LogitCtx& c, float beta) {
  return (kSSA ? c.n : c.c) * beta;
}

// Base-2 logit of raw dot product s, before masks, times the row multiplier `mult`
// (row_mult): softmax s * mult, SSA mult * t with t = sgn(s) log2(1 + c|s|), returned in `t`
// (the backward's dn needs it; u = 1 + c|s| too).
template <bool kSSA>
SSA_DEVICE float logit_raw(const LogitCtx& c, float s, float mult, float& t, float& u) {
  if (kSSA) {
    u = fmaf(c.c, fabsf(s), 1.0f);
    t = xor_sign(lg2(u), s);
    return mult * t;
  } else {
    t = u = 0.0f;
    return s * mult;
  }
}

// Logit soft-capping (docs/maths.md section 6.1), for the kernels instantiated with it
// (kCap): the raw dot product s becomes th = tanh(cap_in s), the capped score s' = cap_out th
// (params.h: z' = c tanh(z / c) in raw units) in units of cap_out, which make_logit_ctx<kCap>
// folds into the logit coefficient; logit_raw then transforms th as it would s, and the backward
// multiplies in 1 - th^2 = ds'/ds (softcap_grad). One FMUL and one MUFU.TANH per score.
// Without kCap: s itself, no instruction.
template <bool kCap, typename P>
SSA_DEVICE float softcap_raw(const P& p, float s) {
  return kCap ? tanh_approx(s * p.cap_in) : s;
}

// ds'/ds = 1 - th^2 of softcap_raw's th (1 without kCap).
template <bool kCap>
SSA_DEVICE float softcap_grad(float dl, float th) {
  return kCap ? dl * fmaf(-th, th, 1.0f) : dl;
}

// The sink logit of the (batch, query) head in base-2 units (log2(e) s_h), -inf without sinks
// (kSink false, or s_h = -inf: the same as no sink).
template <bool kSink, typename P>
SSA_DEVICE float sink_logit2(const P& p, int head) {
  return kSink ? p.sinks[head] * kLog2e : neg_inf();
}

}  // namespace ssa_flash
