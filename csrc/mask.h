// Which scores are admissible (sequence bounds, the band of causality and windows, boolean
// masks) and additive masks: apply_mask, used by the checked key blocks only.
#pragma once

#include "fast_math.h"
#include "logits.h"
#include "params.h"

namespace ssa_flash {

// A finite additive mask's base-2 contribution `m * mask_mult`, saturated at -2^100 instead of
// (times beta under the adaptive temperature) overflowing to -inf (finfo(float32).min * log2(e) does): a row whose keys are all masked by
// finite values keeps finite logits, SDPA's uniform row, instead of becoming an empty row. -inf
// stays -inf (masked out), NaN stays NaN. As ssa_flash/triton/masks.py (MASK_FLOOR2).
constexpr float kMaskFloor2 = 1.2676506002282294e30f;  // 2^100

SSA_DEVICE float saturated_mask(float m, float mask_mult) {
  // the floor scales with beta (mask_mult = log2(e) beta > 0) as the logits do: m clamped at
  // -2^100 ln 2 before the product, which is then the floor's (rounding is monotonic), one
  // product and no second live value (the product and floor compared after it spilled the sm_90a
  // fused SSA backward at D = 128)
  constexpr float kFloor = -kMaskFloor2 * 0.6931471805599453f;
  return (m == neg_inf() ? m : m < kFloor ? kFloor : m) * mask_mult;
}

// l2 where key `col` is admissible for query `row`, else -inf: out of range (rows past the
// queries are -inf too: the mask is not read there), outside the band (a window, or after the
// query under causal), masked out; additive masks are added (times `mask_mult`, log2(e) times
// the row's beta). Only the tiles on the diagonal, the ragged last tile, and every tile of a
// masked or windowed call need this (the kernels skip it elsewhere). kBand = false: causality
// only, for a kernel that never runs a window (the fused backward: the band's two bounds spilled
// it at D = 96). kMaskable = false: never a mask (a kernel whose calls have none: the mask's
// address arithmetic is not compiled in).
template <bool kBand = true, bool kMaskable = true>
SSA_DEVICE float apply_mask(const AttnShape& p, const LogitCtx& c, float l2, int row, int col,
                            float mask_mult) {
  // the band -win_left <= col - row <= win_right (causality folded in, params.h) as one unsigned
  // compare: fewer live values than two bounds per row (they spilled the D = 128 forward)
  const bool in_band = kBand ? static_cast<unsigned>(col - row + p.win_left) <= static_cast<unsigned>(p.win_width)
                             : !p.causal || col <= row;
  bool ok = row < p.len_q && col < p.len_k && in_band;
  if (kMaskable && p.mask_kind != kMaskNone && ok) {
    const int64_t off = c.batch * p.mask_sb + c.head * p.mask_sh + static_cast<int64_t>(row) * p.mask_sm +
                        static_cast<int64_t>(col) * p.mask_sn;
    if (p.mask_kind == kMaskBool) {
      ok = static_cast<const uint8_t*>(p.mask)[off] != 0;
    } else {
      l2 += saturated_mask(static_cast<const float*>(p.mask)[off], mask_mult);
    }
  }
  return ok ? l2 : neg_inf();
}

}  // namespace ssa_flash
