// Backward kernels (dQ, then dK/dV; or the pre-pass, then the fused kernel or, in a build holding
// it, the sm_90a one; then a learned mask's gradient), bfloat16 (sm_80+).
#include "launch_impl.h"

namespace ssa_flash {

BwdPlan plan_bwd_bf16(const BwdParams& p, int score, bool adaptive, bool deterministic) {
  return detail::plan_bwd_call<__nv_bfloat16>(p, score, adaptive, deterministic);
}

std::string run_bwd_bf16(const BwdParams& p, int score, bool adaptive, const BwdPlan& plan, cudaStream_t stream) {
  return detail::run_bwd<__nv_bfloat16>(p, score, adaptive, plan, stream);
}

std::string run_mask_grad_bf16(const MaskGradParams& p, int score, bool adaptive, cudaStream_t stream) {
  return detail::run_mask_grad<__nv_bfloat16>(p, score, adaptive, stream);
}

}  // namespace ssa_flash
