// The logit transform, in base-2 units, mirroring ssa_flash/triton/logits.py: one policy type per
// score function (Softmax, Ssa, LogitScale; LogitCtx: what one (batch, query head) needs).
// Soft-capping and the sink logit are here too; masks and the band are mask.h.
#pragma once

#include "fast_math.h"
#include "params.h"

namespace ssa_flash {

// ------------------------------------------------------------------------------------------
// Logits, in base-2 units: l2 = phi(z) log2(e) + mask log2(e), z = scale * s for the raw dot
// product s (z' = c tanh(z / c) with soft-capping: see softcap_raw below).
//
// The score function phi is a policy type, one per entry of the registry ssa_flash/scores.py,
// named as the registry's name in CamelCase (logit_scale: LogitScale; tools read the name back)
// (kId its id, kParams its per-head parameters, in the registry's order; dispatch.h's list maps
// the id to the type). The kernels are templated on it (typename Score) and ask it for:
//   setup<kCap>(p, batch, head)   the LogitCtx of a (batch, query head), from p.score_param0 / 1
//   nonneg(ctx)                   makes the row multiplier >= 0 (the forward's interior loop takes
//                                 the row max of x, below); true: the caller negates Q instead
//   mult(ctx, beta)               a row's multiplier, the adaptive temperature beta included
//   x<kPolyLg2>(ctx, s)           the interior value of a score: logit = x * mult (before masks);
//                                 kPolyLg2 (default false): a logarithm in it on the FMA pipe
//   logit(ctx, s, mult, e)        the same logit, keeping in e (Score::Elem) what grad needs
//   grad(ctx, dl, s, e, dpar0, dpar1)  d logit / d s times dl (dl: the gradient of the natural-log
//                                 logit phi), adding parameter i's per-element term to dpar<i>
//   dparam_factor<kCap>(p, ctx, i)  the per-head factor of parameter i's summed terms
//   kFusedSpillsSm75              the fused backward spills on sm_75 above D = 32 (traits.h)
// s is the raw dot product, or th (soft-capped, in units of cap_out, which setup folds into the
// coefficients). All of it inlines: a policy is a set of per-element formulas, no state.

// What the logit transform needs for one (batch, query head). The mask fields are read from the
// kernel parameters where needed (apply_mask) rather than kept in registers: the forward at
// D = 128 has none to spare.
struct LogitCtx {
  float c;   // multiplies |s| or s: scale * b (SSA), scale * log2(e) (softmax), times s_h (logit scale)
  float n;   // SSA exponent n (0 for softmax; s_h for the logit scale)
  float nb;  // d phi / dz at 0 (SSA: n b; logit scale: s_h), for the backward
  int batch, head;
};

// kCap: the scores the kernel transforms are th = tanh(cap_in s) (softcap_raw), the capped score
// being s' = cap_out th; cap_out is folded into c here, so that th replaces s everywhere
// downstream at no cost per score (what a parameter's gradient sums, e.g. SSA's db = w s', is
// then cap_out times the sum over th: the kernels apply cap_out once per partial, dparam_factor).

// Softmax: l2 = s * (scale log2 e).
struct Softmax {
  static constexpr int kId = 0;
  static constexpr int kParams = 0;
  static constexpr bool kFusedSpillsSm75 = false;
  struct Elem {};

  template <bool kCap, typename P>
  static SSA_DEVICE LogitCtx setup(const P& p, int batch, int head) {
    LogitCtx c;
    const float cap = kCap ? p.cap_out : 1.0f;
    c.c = p.scale * kLog2e * cap;
    c.n = c.nb = 0.0f;
    c.batch = batch;
    c.head = head;
    return c;
  }
  static SSA_DEVICE bool nonneg(LogitCtx&) { return false; }
  static SSA_DEVICE float mult(const LogitCtx& c, float beta) { return c.c * beta; }
  template <bool kPolyLg2 = false>
  static SSA_DEVICE float x(const LogitCtx&, float s) { return s; }
  static SSA_DEVICE float logit(const LogitCtx&, float s, float mult, Elem&) { return s * mult; }
  static SSA_DEVICE float grad(const LogitCtx&, float dl, float, const Elem&, float&, float&) { return dl; }
  template <bool kCap, typename P>
  static SSA_DEVICE float dparam_factor(const P&, const LogitCtx&, int) { return 0.0f; }
};

// SSA, phi(z) = n sgn(z) log1p(b|z|): phi(z) log2(e) = n sgn(s) log2(1 + b scale |s|), computed as
// n * xor_sign(lg2(fma(b scale, |s|, 1)), s): one FFMA, one MUFU.LG2, one LOP3, one FMUL, no
// division. lg2.approx is accurate to an absolute 2^-22 or so on [1, inf), and softmax is
// shift-invariant, so only this absolute error (times n) matters, also where b|z| is tiny and
// 1 + b|z| rounds (log1p's usual concern is relative error, which the weights never see).
// x = t = sgn(s) log2(1 + c|s|), mult = n beta; parameters b, n.
// Backward: dz = dl n b / (1 + b|z|); db = sum dl n z / (1 + b|z|), dn = sum dl sgn(z) log1p(b|z|),
// summed as w s (w = dl / u) and dl t, the factors n scale (cap_out) and ln 2 once per partial (no
// division by n: n = 0 gives finite gradients).
struct Ssa {
  static constexpr int kId = 1;
  static constexpr int kParams = 2;
  static constexpr bool kFusedSpillsSm75 = true;
  struct Elem {
    float t, u;  // t = sgn(s) log2(u), u = 1 + c|s|
  };

  template <bool kCap, typename P>
  static SSA_DEVICE LogitCtx setup(const P& p, int batch, int head) {
    LogitCtx c;
    const float cap = kCap ? p.cap_out : 1.0f;
    const float b = p.score_param0[head], n = p.score_param1[head];
    c.c = p.scale * b * cap;
    c.n = n;
    c.nb = n * b;
    c.batch = batch;
    c.head = head;
    return c;
  }
  // n sgn(s) = |n| sgn(-s): a head with n < 0 runs on -Q with |n|
  static SSA_DEVICE bool nonneg(LogitCtx& c) {
    const bool neg = c.n < 0.0f;
    c.n = fabsf(c.n);
    return neg;
  }
  static SSA_DEVICE float mult(const LogitCtx& c, float beta) { return c.n * beta; }
  // kPolyLg2: the logarithm on the FMA pipe (fast_math.h, lg2_poly; a MufuBudget's share)
  template <bool kPolyLg2 = false>
  static SSA_DEVICE float x(const LogitCtx& c, float s) {
    const float u = fmaf(c.c, fabsf(s), 1.0f);
    return xor_sign(kPolyLg2 ? lg2_poly(u) : lg2(u), s);
  }
  static SSA_DEVICE float logit(const LogitCtx& c, float s, float mult, Elem& e) {
    e.u = fmaf(c.c, fabsf(s), 1.0f);
    e.t = xor_sign(lg2(e.u), s);
    return mult * e.t;
  }
  static SSA_DEVICE float grad(const LogitCtx& c, float dl, float s, const Elem& e, float& db, float& dn) {
    const float w = dl * rcp(e.u);
    db = fmaf(w, s, db);
    dn = fmaf(dl, e.t, dn);
    return w * c.nb;
  }
  template <bool kCap, typename P>
  static SSA_DEVICE float dparam_factor(const P& p, const LogitCtx& c, int i) {
    return i == 0 ? (kCap ? c.n * p.scale * p.cap_out : c.n * p.scale) : kLn2;
  }
};

// The logit scale, phi(z) = s_h z (s_h >= 0; s_h = 0: uniform weights): softmax with s_h folded
// into the coefficient, x = s, mult = scale log2(e) s_h beta. Backward: dz = dl s_h;
// ds_h = sum dl z' = scale (cap_out) sum dl s.
struct LogitScale {
  static constexpr int kId = 2;
  static constexpr int kParams = 1;
  static constexpr bool kFusedSpillsSm75 = true;  // (not measured: as SSA, the two-kernel path there)
  struct Elem {};

  template <bool kCap, typename P>
  static SSA_DEVICE LogitCtx setup(const P& p, int batch, int head) {
    LogitCtx c;
    const float cap = kCap ? p.cap_out : 1.0f;
    const float sh = p.score_param0[head];
    c.c = p.scale * kLog2e * cap * sh;
    c.n = c.nb = sh;
    c.batch = batch;
    c.head = head;
    return c;
  }
  // s_h z = |s_h| (-z): a head with s_h < 0 (outside the registry's domain) runs on -Q
  static SSA_DEVICE bool nonneg(LogitCtx& c) {
    const bool neg = c.c < 0.0f;
    c.c = fabsf(c.c);
    return neg;
  }
  static SSA_DEVICE float mult(const LogitCtx& c, float beta) { return c.c * beta; }
  template <bool kPolyLg2 = false>
  static SSA_DEVICE float x(const LogitCtx&, float s) { return s; }
  static SSA_DEVICE float logit(const LogitCtx&, float s, float mult, Elem&) { return s * mult; }
  static SSA_DEVICE float grad(const LogitCtx& c, float dl, float s, const Elem&, float& ds, float&) {
    ds = fmaf(dl, s, ds);
    return dl * c.nb;
  }
  template <bool kCap, typename P>
  static SSA_DEVICE float dparam_factor(const P& p, const LogitCtx&, int) {
    return kCap ? p.scale * p.cap_out : p.scale;
  }
};

// Logit soft-capping (docs/maths.md section 6.1), for the kernels instantiated with it
// (kCap): the raw dot product s becomes th = tanh(cap_in s), the capped score s' = cap_out th
// (params.h: z' = c tanh(z / c) in raw units) in units of cap_out, which Score::setup<kCap>
// folds into the logit coefficient; the score function then transforms th as it would s, and the backward
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
