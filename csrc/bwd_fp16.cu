// Backward kernels (dQ, then dK/dV; or the pre-pass, then the fused kernel or, in a build holding
// it, the sm_90a one; then a learned mask's gradient), float16 (sm_75+).
#include "launch_impl.h"

namespace ssa_flash {

BwdPlan plan_bwd_fp16(const BwdParams& p, int score, bool adaptive, bool deterministic) {
  return detail::plan_bwd_call<__half>(p, score, adaptive, deterministic);
}

int hopper_bwd_control(int on) {
#if SSA_FLASH_HOPPER_FWD
  if (on >= 0) hopper::set_hopper_bwd_enabled(on != 0);
  return hopper::hopper_bwd_enabled() ? 1 : 0;
#else
  (void)on;
  return -1;
#endif
}

std::string run_bwd_fp16(const BwdParams& p, int score, bool adaptive, const BwdPlan& plan, cudaStream_t stream) {
  return detail::run_bwd<__half>(p, score, adaptive, plan, stream);
}

std::string run_mask_grad_fp16(const MaskGradParams& p, int score, bool adaptive, cudaStream_t stream) {
  return detail::run_mask_grad<__half>(p, score, adaptive, stream);
}

}  // namespace ssa_flash
