// The epilogue of the sm_90a forward: O / l to global memory and the row LSE, from a consumer
// thread's registers (FwdConsumer's two rows). A plain store of packed pairs, as today's forward
// (csrc/fwd_kernel.h) does; the shared-memory + TMA-store epilogue of docs/design.md section 4.4
// is not built (the store is once per query tile, off the main loop).
#pragma once

#include "../elem.h"
#include "../fast_math.h"
#include "../frag.h"
#include "../params.h"

namespace ssa_flash {
namespace hopper {

// o: the thread's kDT n8 tiles of its two rows (row0, row0 + Frag::kHi); m, l as FwdConsumer's.
// Rows past len_q and columns past dim_v are not written. A row with l = 0 (no admissible key)
// gets O = 0 and LSE = -inf.
template <typename T, int kDT>
SSA_DEVICE void fwd_epilogue(const FwdParams& p, const float (&o)[kDT][4], const float (&m)[2], const float (&l)[2],
                             int row0, int batch, int head, int lane) {
  T* out = static_cast<T*>(p.o) + batch * p.o_sb + head * p.o_sh;
  const int64_t stat0 = (static_cast<int64_t>(batch) * p.heads + head) * p.len_q;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const float sum = quad_sum(l[hi]);
    const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
    const int r = row0 + hi * Frag::kHi;
    if (r < p.len_q) {
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt) {
        const int col = Frag::col(lane, dt);
        if (col < p.dim_v)
          *reinterpret_cast<uint32_t*>(out + r * p.o_sm + col) = pack2<T>(o[dt][2 * hi] * inv, o[dt][2 * hi + 1] * inv);
      }
      if (Frag::rank(lane) == 0) p.lse[stat0 + r] = sum == 0.0f ? neg_inf() : (m[hi] + log2f(sum)) * kLn2;
    }
  }
}

}  // namespace hopper
}  // namespace ssa_flash
