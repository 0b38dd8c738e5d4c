// The adaptive temperature's row-entropy maths, written once for both row-entropy passes
// (fwd_kernel.h attn_row_entropy_kernel, hopper/fwd_row_entropy.h attn_row_entropy_ws_kernel).
// Per query row, in base 2: the running max m, lam = sum 2^(l2 - m) and the centred
// kc = sum 2^(l2 - m) (l2 - m), so that H = (log2 lam - kc / lam) ln 2 and
// lse = (m + log2 lam) ln 2 without cancellation between m and K / Lam. When m grows to m', with
// a = 2^(m - m'): lam' = a lam, kc' = a (kc + lam (m - m')); both are linear in (lam, kc), so each
// thread keeps partials over its columns, rescaled the same way and summed over the quad at the end.
// A row starts as row_state.h's init_row_state / init_row_sink leave it.
#pragma once

#include "fast_math.h"
#include "frag.h"
#include "params.h"

namespace ssa_flash {

// One key block into the state (m, lam, kc) of this thread's two rows (hi = i / 2 of the
// accumulator layout, frag.h): x[nt][i] the block's logits l2 (base 2, beta included) of the
// thread's kNT x 4 accumulator elements; kCheck: some may be -inf (a key left out), and a row
// can have no admissible key yet (its m stays -inf, its sums 0).
template <bool kCheck, int kNT>
SSA_DEVICE void row_entropy_update(float (&m)[2], float (&lam)[2], float (&kc)[2], const float (&x)[kNT][4]) {
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mx[i >> 1] = fmaxf(mx[i >> 1], x[nt][i]);
  }
  float ref[2];  // what the block's logits are centred on: the new max (0 while it is -inf)
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const float mn = fmaxf(m[hi], quad_max(mx[hi]));
    ref[hi] = kCheck ? safe_max(mn) : mn;
    const float sh = m[hi] == neg_inf() ? 0.0f : m[hi] - ref[hi];  // lam is 0 while m is -inf
    const float a = ex2(sh);
    kc[hi] = a * (kc[hi] + lam[hi] * sh);
    lam[hi] *= a;
    m[hi] = mn;
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float l2 = x[nt][i];
      float c = l2 - ref[i >> 1], e;
      if (kCheck) {
        c = l2 == neg_inf() ? 0.0f : c;
        e = l2 == neg_inf() ? 0.0f : ex2(c);
      } else {
        e = ex2(c);
      }
      lam[i >> 1] += e;
      kc[i >> 1] += e * c;
    }
  }
}

// The row's H and LSE from this thread's partials (lam, kc summed over the quad; every lane of
// the warp calls it), written by the row's first lane for a row r < len_q (the sequence's length:
// p.len_q, or a packed sequence's own) to p.entropy[stat0 + r] and p.lse[stat0 + r]; a row with
// no admissible key gets H = 0 and LSE = -inf.
SSA_DEVICE void row_entropy_store(const FwdParams& p, int64_t stat0, int r, int len_q, float m, float lam, float kc,
                                  int lane) {
  const float l = quad_sum(lam);
  const float kcs = quad_sum(kc);
  if (Frag::rank(lane) == 0 && r < len_q) {
    const bool empty = l == 0.0f;
    p.entropy[stat0 + r] = empty ? 0.0f : (log2f(l) - kcs / l) * kLn2;
    p.lse[stat0 + r] = empty ? neg_inf() : (m + log2f(l)) * kLn2;
  }
}

}  // namespace ssa_flash
