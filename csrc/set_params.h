// One attention call, described without torch, and everything the bindings decide from it: the
// checks on sizes and flags, the kernels' parameter structs (params.h), the backward's plan and
// workspaces (launch.h), the launch. Shared by the torch binding (api.cpp: tensors -> AttnCall,
// allocation) and the CPU emulator (emu/emu_main.cpp, which receives an AttnCall from ctypes:
// emu/harness.py mirrors the struct, and a test checks the mirror against the offsets the
// emulator exports, ssa_emu_layout).
//
// AttnCall holds only 8-byte fields (int64_t, double, pointers) so that its layout is the same
// for every compiler and for ctypes: no padding.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "launch.h"
#include "params.h"

namespace ssa_flash {

// A (B, H, L, D) tensor: its data and its batch, head and row strides in elements (the head dim
// is contiguous). A null ptr: absent.
struct Operand {
  void* ptr;
  int64_t sb, sh, sm;
};

struct AttnCall {
  // sizes: q (batch, heads, len_q, dim), k (batch, heads_kv, len_k, dim), v (.., dim_v);
  // heads = group * heads_kv (GQA); dim, dim_v multiples of 8 (the wrapper pads), at most 256
  int64_t batch, heads, heads_kv, group, len_q, len_k, dim, dim_v;
  int64_t bf16;           // element type: 0 float16, 1 bfloat16
  int64_t score;          // the score function's id (ssa_flash/scores.py; logits.h, dispatch.h)
  double scale;           // >= 0 (ssa_flash/backends/cuda_backend.py applies a negative scale to -q)
  int64_t causal;
  int64_t window_left, window_right;  // ssa_flash/conventions.py kernel_window, -1 both: none (set_band)
  int64_t deterministic;  // backward: the two-kernel path (bitwise reproducible)
  // mask (params.h): kind 0 none, 1 boolean (uint8), 2 additive float32, expanded to (B, H, Lq, Lk)
  int64_t mask_kind;
  const void* mask;
  int64_t mask_sb, mask_sh, mask_sm, mask_sn;
  // the score function's per-head parameters, (H,) float32 each, in the registry's order: its
  // kParams entries set, the others null
  const float* score_param[kMaxScoreParams];
  // dropout, as ssa_flash/conventions.py encodes it (the one place): a weight is kept iff its
  // Philox word is below 2 drop_keep31 (dropout_keep_threshold), kept weights scaled by drop_scale
  // (dropout_scale); drop_rng the int64 (seed, offset) on the device, null without dropout (then
  // drop_keep31 and drop_scale are not read)
  int64_t drop_keep31;
  double drop_scale;
  const int64_t* drop_rng;
  // operands (q, k, v in every pass; o, dout, dq, dk, dv as the pass needs; the forward's output
  // o; dq absent on the fused backward path, whose dQ goes to dq_accum)
  Operand q, k, v, o, dout, dq, dk, dv;
  // per-row statistics, contiguous (B, H, Lq) float32: lse (written by fwd / row_entropy, read by bwd),
  // entropy (written by row_entropy, read by bwd), dlse (optional), the adaptive temperature's beta,
  // lse_l, dbeta_dh (all four of beta, lse_l, entropy, dbeta_dh in an adaptive backward)
  float* lse;
  float* entropy;
  const float* dlse;
  const float* beta;
  const float* lse_l;
  const float* dbeta_dh;
  // backward workspaces, shaped by bwd_buffers: rowstat, dq_accum (zeroed, fused path only), the
  // parameters' partial sums (one per parameter of the score function)
  float* rowstat;
  float* dq_accum;
  float* dparam_part[kMaxScoreParams];
  // attention sinks (H,) float32 (natural-log logits) or null; logit soft-cap c >= 0 (0: off)
  // (docs/maths.md section 6; the kernels instantiated with them: dispatch.h, extras_switch)
  const float* sinks;
  double softcap;
  // backward workspace of an additive mask's call (bwd_buffers, lse_lo; null otherwise): the
  // LSEs' (hi, lo) pairs the recount kernel writes (lse_residual.h)
  float* lse_lo;
  // backward of a learned additive mask (mask_grad.h; null otherwise): its gradient, written,
  // (dmask_batch, dmask_heads, len_q, len_k) contiguous float32, dmask_batch 1 or batch and
  // dmask_heads 1 or heads (the dims the mask broadcasts over are summed)
  float* dmask;
  int64_t dmask_batch, dmask_heads;
};

// Shapes of the backward's buffers for a plan (row-major, float32). A zero-size shape: not
// allocated (the pointer stays null).
struct BwdBuffers {
  int64_t fused;            // the plan's path: dq_accum instead of dq
  int64_t rowstat[4];       // (B, H, stat_rows, stat_count), written before it is read
  int64_t dq_accum[4];      // (B, H, stat_rows, accum_cols), zero on entry; fused path only
  int64_t partials[3];      // each of the nparams dparam_part: (B, H, num_partials)
  int64_t nparams;          // the score function's parameters (score_param_count)
  int64_t lse_lo[4];        // (B, H, stat_rows, 5 + accum_cols / 2), additive masks only (else zero-size), written before it is read
};

// Sizes and flags the kernels assume (params.h); an error message, or an empty string. What a
// tensor alone tells (device, dtype, shapes against each other, strides) is the binding's part.
// Run once per call, by whoever describes it (api.cpp, emu/emu_main.cpp), before the launch_*
// functions below.
inline std::string check_call(const AttnCall& c) {
  if (c.group < 1 || c.heads_kv < 1 || c.heads != c.heads_kv * c.group)
    return "query heads must be group * key heads";
  if (c.len_q < 1 || c.len_k < 1) return "empty sequences are handled by the caller";
  if (c.len_q >= (int64_t(1) << 31) || c.len_k >= (int64_t(1) << 31) ||
      c.len_q + c.len_k >= (int64_t(1) << 31) - 1024)
    return "sequences too long";
  for (int64_t d : {c.dim, c.dim_v}) {
    if (d < 8 || d > 256 || d % 8 != 0)
      return "head dims must be positive multiples of 8, at most 256, got " + std::to_string(c.dim) + " and " +
             std::to_string(c.dim_v);
  }
  if (!std::isfinite(c.scale) || c.scale < 0)
    return "scale must be finite and >= 0 (a negative scale is applied to -q by the caller), got " +
           std::to_string(c.scale);
  if (c.window_left < -1 || c.window_right < -1)
    return "window bounds must be >= -1, got (" + std::to_string(c.window_left) + ", " +
           std::to_string(c.window_right) + ")";
  if (c.mask_kind != kMaskNone && c.mask_kind != kMaskBool && c.mask_kind != kMaskAdd)
    return "unknown mask_kind " + std::to_string(c.mask_kind);
  if ((c.mask_kind != kMaskNone) != (c.mask != nullptr)) return "mask_kind set without a mask, or a mask without it";
  const int nparams = score_param_count(static_cast<int>(c.score));
  if (c.score < 0 || c.score > (int64_t(1) << 30) || nparams < 0)
    return "unknown score function id " + std::to_string(c.score);
  for (int i = 0; i < kMaxScoreParams; ++i) {
    if ((i < nparams) != (c.score_param[i] != nullptr))
      return "score function " + std::to_string(c.score) + " takes " + std::to_string(nparams) +
             " per-head parameters; parameter " + std::to_string(i) + (i < nparams ? " missing" : " given");
  }
  if (c.drop_rng != nullptr && (c.drop_keep31 < 0 || c.drop_keep31 > 2147483647))
    return "drop_keep31 must be in [0, 2^31 - 1], got " + std::to_string(c.drop_keep31);
  if (c.drop_rng != nullptr && (!std::isfinite(c.drop_scale) || c.drop_scale < 0))
    return "drop_scale must be finite and >= 0, got " + std::to_string(c.drop_scale);
  if (!std::isfinite(c.softcap) || c.softcap < 0)
    return "softcap must be finite and >= 0 (0: off), got " + std::to_string(c.softcap);
  if (c.dmask != nullptr && c.mask_kind != kMaskAdd) return "a mask's gradient needs an additive (float) mask";
  if (c.dmask != nullptr && ((c.dmask_batch != 1 && c.dmask_batch != c.batch) ||
                             (c.dmask_heads != 1 && c.dmask_heads != c.heads)))
    return "the mask gradient's batch and heads must each be 1 or the call's, got (" +
           std::to_string(c.dmask_batch) + ", " + std::to_string(c.dmask_heads) + ")";
  return std::string();
}

// The fields of AttnShape (params.h) every pass shares.
inline void set_shape(AttnShape& s, const AttnCall& c) {
  s.batch = static_cast<int>(c.batch);
  s.heads = static_cast<int>(c.heads);
  s.heads_kv = static_cast<int>(c.heads_kv);
  s.group = static_cast<int>(c.group);
  s.len_q = static_cast<int>(c.len_q);
  s.len_k = static_cast<int>(c.len_k);
  s.dim = static_cast<int>(c.dim);
  s.dim_v = static_cast<int>(c.dim_v);
  s.scale = static_cast<float>(c.scale);
  s.causal = c.causal != 0;
  set_band(s, c.window_left, c.window_right);
  s.mask_kind = static_cast<int>(c.mask_kind);
  s.mask = c.mask_kind == kMaskNone ? nullptr : c.mask;
  s.mask_sb = s.mask ? c.mask_sb : 0;
  s.mask_sh = s.mask ? c.mask_sh : 0;
  s.mask_sm = s.mask ? c.mask_sm : 0;
  s.mask_sn = s.mask ? c.mask_sn : 0;
  static_assert(kMaxScoreParams == 2, "params.h: score_param0, score_param1");
  s.score_param0 = c.score_param[0];
  s.score_param1 = c.score_param[1];
  s.drop_rng = c.drop_rng;
  s.drop_keep_below = s.drop_rng ? static_cast<uint32_t>(2 * c.drop_keep31) : 0u;
  s.drop_scale = s.drop_rng ? static_cast<float>(c.drop_scale) : 0.0f;
}

// Sinks and soft-capping (the last fields of FwdParams and BwdParams): s' = (c / scale)
// tanh((scale / c) s), z' = c tanh(z / c) in raw units; scale 0 makes every score 0, capped or not.
template <typename P>
inline void set_extras(P& p, const AttnCall& c) {
  p.sinks = c.sinks;
  p.softcap = c.softcap > 0;
  p.cap_in = p.softcap ? static_cast<float>(c.scale / c.softcap) : 0.0f;
  p.cap_out = p.softcap && c.scale > 0 ? static_cast<float>(c.softcap / c.scale) : 0.0f;
}

// An operand's pointer and strides, into a params struct's fields of that operand.
template <typename Ptr>
inline void set_operand(Ptr& ptr, int64_t& sb, int64_t& sh, int64_t& sm, const Operand& o) {
  ptr = o.ptr;
  sb = o.sb;
  sh = o.sh;
  sm = o.sm;
}

// q, k, v, o: the operands FwdParams and BwdParams share.
template <typename P>
inline void set_qkvo(P& p, const AttnCall& c) {
  set_operand(p.q, p.q_sb, p.q_sh, p.q_sm, c.q);
  set_operand(p.k, p.k_sb, p.k_sh, p.k_sm, c.k);
  set_operand(p.v, p.v_sb, p.v_sh, p.v_sm, c.v);
  set_operand(p.o, p.o_sb, p.o_sh, p.o_sm, c.o);
}

// The forward's parameters: o, lse written (beta: the adaptive temperature, or null).
inline FwdParams fwd_params(const AttnCall& c) {
  FwdParams p{};
  set_shape(p, c);
  set_qkvo(p, c);
  p.lse = c.lse;
  p.beta = c.beta;
  p.entropy = nullptr;
  set_extras(p, c);
  return p;
}

// The row-entropy pass's parameters: entropy and lse of softmax(l) written; dim_v = dim, and
// the statistics are of the undropped rows (no dropout).
inline FwdParams row_entropy_params(AttnCall c) {
  c.dim_v = c.dim;
  c.drop_rng = nullptr;
  FwdParams p{};
  set_shape(p, c);
  set_operand(p.q, p.q_sb, p.q_sh, p.q_sm, c.q);
  set_operand(p.k, p.k_sb, p.k_sh, p.k_sm, c.k);
  p.lse = c.lse;
  p.entropy = c.entropy;
  set_extras(p, c);
  return p;
}

// The backward's plan on the current device (launch.h; launch_impl.h, plan_bwd_call): dropout and
// windows take the two-kernel path (the fused kernel has no code for them, see bwd_kernel.h), as
// does deterministic; the sm_90a backward where it takes the call (hopper/bwd_launch.h).
inline BwdPlan plan_backward(const AttnCall& c) {
  BwdParams p{};
  set_shape(p, c);
  // (the operands too: the sm_90a backward declines those a tensor map cannot address)
  set_qkvo(p, c);
  set_operand(p.dout, p.do_sb, p.do_sh, p.do_sm, c.dout);
  set_extras(p, c);
  const bool adaptive = c.beta != nullptr;
  const int score = static_cast<int>(c.score);
  return c.bf16 ? plan_bwd_bf16(p, score, adaptive, c.deterministic != 0)
                : plan_bwd_fp16(p, score, adaptive, c.deterministic != 0);
}

inline BwdBuffers bwd_buffers(const AttnCall& c, const BwdPlan& plan) {
  BwdBuffers b{};
  b.fused = plan.fused;
  const int64_t rowstat[4] = {c.batch, c.heads, plan.stat_rows, plan.stat_count};
  const int64_t accum[4] = {c.batch, c.heads, plan.stat_rows, plan.accum_cols};
  const int nparams = score_param_count(static_cast<int>(c.score));
  b.nparams = nparams > 0 ? nparams : 0;
  const int64_t parts[3] = {b.nparams > 0 ? c.batch : 0, c.heads, plan.num_partials};
  for (int i = 0; i < 4; ++i) {
    b.rowstat[i] = rowstat[i];
    b.dq_accum[i] = plan.fused ? accum[i] : 0;
  }
  for (int i = 0; i < 3; ++i) b.partials[i] = parts[i];
  // (the recount's pairs and each row's dO factor, then dO scaled by it, 16-bit: params.h)
  const int64_t lse_lo[4] = {c.batch, c.heads, plan.stat_rows, 5 + plan.accum_cols / 2};
  for (int i = 0; i < 4; ++i) b.lse_lo[i] = c.mask_kind == kMaskAdd ? lse_lo[i] : 0;
  return b;
}

// The backward's parameters for `plan`: dq (two-kernel path) or dq_accum (fused), dk, dv, the
// parameters' partials written; rowstat as workspace.
inline BwdParams bwd_params(const AttnCall& c, const BwdPlan& plan) {
  BwdParams p{};
  set_shape(p, c);
  set_qkvo(p, c);
  set_operand(p.dout, p.do_sb, p.do_sh, p.do_sm, c.dout);
  if (!plan.fused) set_operand(p.dq, p.dq_sb, p.dq_sh, p.dq_sm, c.dq);
  p.dq_accum = plan.fused ? c.dq_accum : nullptr;
  set_operand(p.dk, p.dk_sb, p.dk_sh, p.dk_sm, c.dk);
  set_operand(p.dv, p.dv_sb, p.dv_sh, p.dv_sm, c.dv);
  p.lse = c.lse;
  p.dlse = c.dlse;
  p.rowstat = c.rowstat;
  p.stat_rows = plan.stat_rows;
  p.beta = c.beta;
  p.lse_l = c.lse_l;
  p.entropy = c.entropy;
  p.dbeta_dh = c.dbeta_dh;
  p.dparam_part0 = c.dparam_part[0];
  p.dparam_part1 = c.dparam_part[1];
  set_extras(p, c);
  p.lse_lo = c.mask_kind == kMaskAdd ? c.lse_lo : nullptr;
  return p;
}

// A learned mask's gradient (c.dmask), after the backward `p` of the same call ran (mask_grad.h:
// it reads that pass's workspaces).
inline std::string launch_mask_grad(const AttnCall& c, const BwdParams& p, cudaStream_t stream) {
  MaskGradParams m{};
  static_cast<BwdParams&>(m) = p;
  m.dmask = c.dmask;
  m.dmask_batch = static_cast<int>(c.dmask_batch);
  m.dmask_heads = static_cast<int>(c.dmask_heads);
  const int score = static_cast<int>(c.score);
  const bool adaptive = c.beta != nullptr;
  return c.bf16 ? run_mask_grad_bf16(m, score, adaptive, stream) : run_mask_grad_fp16(m, score, adaptive, stream);
}

// The passes of a call that check_call accepted: fill, launch on `stream`; an error message or an
// empty string.
inline std::string launch_forward(const AttnCall& c, cudaStream_t stream) {
  const FwdParams p = fwd_params(c);
  const int score = static_cast<int>(c.score);
  return c.bf16 ? run_fwd_bf16(p, score, c.beta != nullptr, stream) : run_fwd_fp16(p, score, c.beta != nullptr, stream);
}

inline std::string launch_row_entropy(const AttnCall& c, cudaStream_t stream) {
  const FwdParams p = row_entropy_params(c);
  const int score = static_cast<int>(c.score);
  return c.bf16 ? run_row_entropy_bf16(p, score, stream) : run_row_entropy_fp16(p, score, stream);
}

// The backward as `plan` (plan_backward of the same call) says; the buffers of bwd_buffers given
// (checked here: they are the caller's allocation, not part of the call's description).
inline std::string launch_backward(const AttnCall& c, const BwdPlan& plan, cudaStream_t stream) {
  const bool adaptive = c.beta != nullptr;
  if (adaptive != (c.lse_l != nullptr) || adaptive != (c.entropy != nullptr) || adaptive != (c.dbeta_dh != nullptr))
    return "give all of beta, lse_l, entropy, dbeta_dh or none";
  if (plan.fused ? c.dq_accum == nullptr : c.dq.ptr == nullptr) return "dq or dq_accum missing against the plan";
  const int nparams = score_param_count(static_cast<int>(c.score));
  bool parts = true;
  for (int i = 0; i < nparams; ++i) parts = parts && c.dparam_part[i] != nullptr;
  if (c.rowstat == nullptr || !parts || (c.mask_kind == kMaskAdd && c.lse_lo == nullptr))
    return "backward workspaces missing (bwd_buffers)";
  const BwdParams p = bwd_params(c, plan);
  const int score = static_cast<int>(c.score);
  const std::string err =
      c.bf16 ? run_bwd_bf16(p, score, adaptive, plan, stream) : run_bwd_fp16(p, score, adaptive, plan, stream);
  if (!err.empty() || c.dmask == nullptr) return err;
  return launch_mask_grad(c, p, stream);
}

}  // namespace ssa_flash
