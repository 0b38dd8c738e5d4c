// Host entry points of the kernels, one set per element type (defined in the *_fp16.cu and
// *_bf16.cu files). No torch here: the binding (api.cpp) validates tensors and fills the params.
// Each returns an empty string on success, else a message saying what went wrong (shared memory
// too small for the tile, unsupported head dim or architecture, launch error).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "params.h"
#include "traits.h"

namespace ssa_flash {

// `score`: the score function's id (ssa_flash/scores.py; logits.h, dispatch.h), its kParams
// parameters in p.score_param.

// The number of per-head parameters of score function `score`, or -1 for an id the kernels do
// not know (dispatch.h, Scores).
int score_param_count(int score);

// forward: o, lse (p.beta != nullptr iff adaptive)
std::string run_fwd_fp16(const FwdParams& p, int score, bool adaptive, cudaStream_t stream);
// The sm_90a warp-specialised forward's run-time switch and tensor-map cache (hopper/tma_cache.h),
// defined in fwd_fp16.cu: on 1 / 0 sets the switch, -1 leaves it; mufu >= 0 sets the MUFU budget
// of the sweep (8 * ex2 + lg2 eighths; hopper/fwd_launch.h), -1 leaves it; returns 1 if the switch
// is on, 0 if off, -1 if this build does not hold the kernel (SSA_FLASH_HOPPER_FWD=0 at compile
// time). stats, when not null, receives the cache's hits, misses, patches and entries, the budget,
// and whether the build holds the sweep's instances (SSA_FLASH_HOPPER_MUFU_SWEEP).
int hopper_fwd_control(int on, int mufu, long stats[6]);
std::string run_fwd_bf16(const FwdParams& p, int score, bool adaptive, cudaStream_t stream);
// row-entropy pass: p.entropy and p.lse of softmax(l) (p.o, p.v, p.beta unused)
std::string run_row_entropy_fp16(const FwdParams& p, int score, cudaStream_t stream);
std::string run_row_entropy_bf16(const FwdParams& p, int score, cudaStream_t stream);
// How a backward runs on the current device: fused (pre-pass + one kernel, dQ accumulated with
// atomics in p.dq_accum, which the caller zeroes, then scales and converts) or the two-kernel
// path (dQ kernel, dK/dV kernel: bitwise reproducible); num_partials is the last dim of the
// parameter gradients' partial-sum buffers (B, H, num_partials) for either. hopper: the fused
// path's buffers filled by the sm_90a backward instead (hopper/bwd_launch.h; only in a build
// holding it, switched on, for the calls it takes).
struct BwdPlan {
  bool fused;
  int num_partials;
  int stat_rows;    // rows of the row-statistics workspace (B, H, stat_rows, stat_count) and of
  int stat_count;   // the fused path's dQ accumulator (B, H, stat_rows, accum_cols), float32
  int accum_cols;   // the kernels' padded head dim
  bool hopper;
};
// The plan of a call: p's sizes and features (set_params.h, plan_backward: the workspaces'
// pointers are not read), the score function's id, adaptive, deterministic.
BwdPlan plan_bwd_fp16(const BwdParams& p, int score, bool adaptive, bool deterministic);
BwdPlan plan_bwd_bf16(const BwdParams& p, int score, bool adaptive, bool deterministic);
// The sm_90a backward's run-time switch (hopper/bwd_launch.h), defined in bwd_fp16.cu: on 1 / 0
// sets it, -1 leaves it; returns 1 if on, 0 if off, -1 if this build does not hold the kernel.
int hopper_bwd_control(int on);

// backward as planned: dq (two-kernel) or p.dq_accum (fused), dk, dv, delta, g (adaptive),
// the parameters' partials (p.dparam_part)
std::string run_bwd_fp16(const BwdParams& p, int score, bool adaptive, const BwdPlan& plan, cudaStream_t stream);
std::string run_bwd_bf16(const BwdParams& p, int score, bool adaptive, const BwdPlan& plan, cudaStream_t stream);

// The learned additive mask's gradient (mask_grad.h) into p.dmask, after run_bwd of the same call
// (it reads the row-statistics workspace and p.lse_lo that pass wrote)
std::string run_mask_grad_fp16(const MaskGradParams& p, int score, bool adaptive, cudaStream_t stream);
std::string run_mask_grad_bf16(const MaskGradParams& p, int score, bool adaptive, cudaStream_t stream);

}  // namespace ssa_flash
