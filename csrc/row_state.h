// The running state of this thread's query rows in the online-softmax passes (forward: the
// reference max m and the sum l of 2^(l2 - m); row entropy: also the centred sum kc), as it is
// before the first key block: nothing admissible yet, m = -inf and the sums 0. The forward and the
// row-entropy pass start their rows here, so that what a row starts from is decided in one place.
#pragma once

#include "fast_math.h"

namespace ssa_flash {

// m, l (and kc, when given) of kMS strips x 2 rows
template <int kMS>
SSA_DEVICE void init_row_state(float (&m)[kMS][2], float (&l)[kMS][2]) {
#pragma unroll
  for (int ms = 0; ms < kMS; ++ms) {
    m[ms][0] = m[ms][1] = neg_inf();
    l[ms][0] = l[ms][1] = 0.0f;
  }
}

template <int kMS>
SSA_DEVICE void init_row_state(float (&m)[kMS][2], float (&l)[kMS][2], float (&kc)[kMS][2]) {
  init_row_state(m, l);
#pragma unroll
  for (int ms = 0; ms < kMS; ++ms) kc[ms][0] = kc[ms][1] = 0.0f;
}

// With an attention sink (docs/maths.md section 6.2) a row starts from its sink instead of the
// empty row: m = sink2 (the sink logit in base-2 units, beta included), l = 1 (2^(sink2 - m)),
// kc = 0 (the sink's centred logit is 0). l and kc are per-thread partials summed over the quad
// at the end, so only the quad's first lane (Frag::rank 0, quad_first) holds the sink's 1. A sink of -inf is the
// empty row (m = -inf, l = 0).
SSA_DEVICE void init_row_sink(float& m, float& l, float sink2, bool quad_first) {
  m = sink2;
  l = (sink2 != neg_inf() && quad_first) ? 1.0f : 0.0f;
}

}  // namespace ssa_flash
