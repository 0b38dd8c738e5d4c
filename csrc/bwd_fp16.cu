// Backward kernels (dQ, then dK/dV; or the pre-pass, then the fused kernel), float16 (sm_75+).
#include "launch_impl.h"

namespace ssa_flash {

BwdPlan plan_bwd_fp16(int dim, int dim_v, int len_q, int len_k, int score, bool adaptive, bool deterministic,
                      bool unfused_features) {
  return detail::plan_bwd<__half>(dim, dim_v, len_q, len_k, score, adaptive, deterministic, unfused_features);
}

std::string run_bwd_fp16(const BwdParams& p, int score, bool adaptive, const BwdPlan& plan, cudaStream_t stream) {
  return detail::run_bwd<__half>(p, score, adaptive, plan, stream);
}

}  // namespace ssa_flash
