// Kernel parameters: plain structs of pointers, sizes and strides (in elements). No torch here.
//
// Conventions (enforced by the binding, csrc/api.cpp):
//  * q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) and do: any batch/head/row strides that
//    are multiples of 8 elements, unit stride along the head dim, 16-byte aligned base pointers;
//    in the backward, q and do row strides below 2^26 elements (tile offsets in 32 bits);
//    D and Dv multiples of 8 and at most the kernel's padded head dim (32, 64, 96, 128 or 256).
//  * Outputs (o, dq, dk, dv) and the per-row statistics are written by the kernels with the
//    strides given; statistics (lse, delta, beta, ...) are contiguous (B, H, Lq) float32.
//  * mask: kind 0 none, 1 boolean (uint8, nonzero = attend), 2 additive float32; any strides
//    (zero strides for broadcast dims), already expanded to (B, H, Lq, Lk).
#pragma once

#include "int_types.h"
#include "traits.h"

namespace ssa_flash {

enum MaskKind : int { kMaskNone = 0, kMaskBool = 1, kMaskAdd = 2 };

// The most per-head parameters a score function has (logits.h; SSA's b and n).
constexpr int kMaxScoreParams = 2;

struct AttnShape {
  int batch, heads, heads_kv, group;  // group = heads / heads_kv (GQA)
  int len_q, len_k;
  int dim, dim_v;                     // actual head dims (multiples of 8)
  float scale;                        // softmax scale applied to q.k, >= 0 (the Python wrapper negates q otherwise)
  bool causal;                        // key j visible to query i iff j <= i (top-left aligned)
  // Key j visible to query i iff i - win_left <= j <= i + win_right: the local window (docs/design.md
  // section 1.5) and causality as one band (set_band); window: a band narrower than causality's (the
  // backward then takes the two-kernel path; on sm_70 / sm_75 every visited block is checked).
  int win_left, win_right;
  int win_width;                      // win_left + win_right (>= 0)
  bool window;
  int mask_kind;
  const void* mask;                   // uint8 or float32, see mask_kind
  int64_t mask_sb, mask_sh, mask_sm, mask_sn;
  // the score function's per-head parameters (logits.h: the policy's kParams of them, in the
  // registry's order, ssa_flash/scores.py), (H,) float32 each; unused ones nullptr. (Fields, not an
  // array of kMaxScoreParams: with an array in the parameter struct, ptxas allocated registers
  // differently in existing kernels; these two sit where SSA's b and n pointers were.)
  const float* score_param0;
  const float* score_param1;
  // Dropout (docs/design.md section 1.5), nullptr drop_rng without: the int64 (seed, offset) on the device;
  // weight (b, h, i, j) is kept iff its Philox word is below drop_keep_below (dropout.h, drop_bits;
  // ssa_flash.reference.dropout_keep_mask), kept weights scaled by drop_scale = 1 / (1 - p)
  // (0 for p = 1, where nothing is kept); both as ssa_flash/conventions.py computes them.
  const int64_t* drop_rng;
  uint32_t drop_keep_below;
  float drop_scale;
};

// The band of the call's window (ssa_flash/conventions.py, kernel_window: both sides -1, NO_WINDOW,
// without one; else both in [0, len_q + len_k]; -1 on one side is still read as unbounded) with
// causality folded in (win_right = 0 under causal). An unbounded side, or one past the sequence,
// is clamped to the sequence's length (left: plus kMaxBlockRows, so that a query tile's last row, even one
// past len_q, never bounds its keys: block_info.h key_blocks), so row + win_right stays in int when
// len_q + len_k < 2^31 - 1024 (the binding checks both). Needs len_q, len_k and causal set.
inline void set_band(AttnShape& s, int64_t window_left, int64_t window_right) {
  const int64_t right = window_right < 0 || window_right > s.len_k ? s.len_k : window_right;
  s.win_left = static_cast<int>(window_left < 0 || window_left > s.len_q ? s.len_q + kMaxBlockRows : window_left);
  s.win_right = static_cast<int>(s.causal ? 0 : right);
  s.win_width = s.win_left + s.win_right;
  s.window = window_left >= 0 || (window_right >= 0 && !s.causal);
}

struct FwdParams : AttnShape {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  int64_t q_sb, q_sh, q_sm;
  int64_t k_sb, k_sh, k_sm;
  int64_t v_sb, v_sh, v_sm;
  int64_t o_sb, o_sh, o_sm;
  float* lse;         // (B, H, Lq): natural-log LSE of the (temperature-scaled) logit row
  const float* beta;  // (B, H, Lq) adaptive temperature, or nullptr
  // row-entropy pass only (run_row_entropy): entropy and LSE of softmax(l)
  float* entropy;
  // Attention sinks and logit soft-capping (docs/maths.md section 6), read only by the kernels
  // instantiated with them (dispatch.h, extras_switch): sinks (H,) the per-head sink logit
  // (natural units), or nullptr; the capped raw score s' = cap_out tanh(cap_in s) of a raw dot
  // product s, i.e. z' = c tanh(z / c) divided by scale (cap_in = scale / c, cap_out = c / scale):
  // the kernels transform th = tanh(cap_in s) with cap_out folded into the logit coefficient
  // (logits.h, make_logit_ctx), so everything downstream of the raw score is unchanged. (Last,
  // here and in BwdParams, so that the kernels without them see every other field at its former
  // offset.)
  const float* sinks;
  bool softcap;
  float cap_in, cap_out;
  // A packed batch of variable-length sequences (the sm_90a forward and row-entropy pass only,
  // csrc/hopper/; nullptr cu_seqlens_q for a dense call): sequence b is query rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o, seen as (1, H, total_q, D) (q_sm, q_sh its
  // strides; q_sb unused), attending to key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v
  // (1, Hkv, total_k, D); device int32 (batch + 1). len_q, len_k: the longest sequences (they size
  // the grid); positions (causal, top-left) count from each sequence's start. The statistics
  // (lse, beta, entropy) are (H, total_q), row cu_seqlens_q[b] + i of head h at h total_q + ....
  // (Last, as sinks: every other field at its former offset.)
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q, total_k;
};

struct BwdParams : AttnShape {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  int64_t q_sb, q_sh, q_sm;
  int64_t k_sb, k_sh, k_sm;
  int64_t v_sb, v_sh, v_sm;
  int64_t o_sb, o_sh, o_sm;
  int64_t do_sb, do_sh, do_sm;
  int64_t dq_sb, dq_sh, dq_sm;
  int64_t dk_sb, dk_sh, dk_sm;
  int64_t dv_sb, dv_sh, dv_sm;
  const float* lse;       // (B, H, Lq) from the forward
  const float* dlse;      // (B, H, Lq) gradient reaching lse, or nullptr
  // adaptive temperature (nullptr otherwise)
  const float* beta;      // (B, H, Lq)
  const float* lse_l;     // LSE of the temperature-free row
  const float* entropy;   // H of softmax(l)
  const float* dbeta_dh;  // d beta / d H
  // workspace (B, H, stat_rows, 2 or 6 adaptive): per query row lse (base 2), delta =
  // rowsum(dO * O) - dlse, and (adaptive) beta, lse of l (base 2), entropy, g = dbeta * dbeta_dh;
  // written by the dQ kernel / pre-pass, read by the dK/dV kernel (bwd_kernel.h, RowStat)
  float* rowstat;
  int stat_rows;          // bwd_stat_rows(len_q) (traits.h)
  // partial sums of the score function's parameter gradients, one (B, H, num_partials) buffer per
  // parameter (nullptr past kParams): per query block of the dQ kernel, or per (key block, warp)
  // of the fused kernel (launch.h, BwdPlan). (Fields, as score_param0 / 1.)
  float* dparam_part0;
  float* dparam_part1;
  // fused backward only: (B, H, stat_rows, padded head dim) float32, zero on entry; receives
  // dQ / scale by atomics (rows past len_q and columns past dim receive exact zeros)
  float* dq_accum;
  // as in FwdParams
  const float* sinks;
  bool softcap;
  float cap_in, cap_out;
  // additive masks only (mask_kind == kMaskAdd, else nullptr): (B, H, stat_rows, 5 + D / 2)
  // float32 (D the padded head dim), written by the recount kernel, three sections
  // (lse_residual.h): per query row the LSEs as (hi, lo) pairs in base 2, (hi, hi of l, lo, lo of
  // l), read by the dQ kernel / pre-pass (lo = 0 where the float LSE serves); per row the factor
  // f = 2^-lo; dO times f (B, H, stat_rows, D) in the inputs' 16-bit type, the key-block kernels'
  // dO (launch_impl.h)
  float* lse_lo;
};

// The learned additive mask's gradient kernel (mask_grad.h): the backward's parameters (the
// key-block kernels' view: dO the recount's scaled copy, launch_impl.h) and the gradient,
// (dmask_batch, dmask_heads, len_q, len_k) contiguous float32, dmask_batch 1 or batch,
// dmask_heads 1 or heads (a struct of its own: BwdParams, and so every other kernel, unchanged).
struct MaskGradParams : BwdParams {
  float* dmask;
  int dmask_batch, dmask_heads;
};

}  // namespace ssa_flash
