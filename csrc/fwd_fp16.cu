// Forward and row-entropy kernels, float16 (sm_75+).
#include "launch_impl.h"

namespace ssa_flash {

// (here, in one translation unit, because the binding cannot include the kernel headers)
int score_param_count(int score) {
  if (!known_score(score)) return -1;
  return score_switch(score, [](auto S) { return decltype(S)::kParams; });
}

std::string run_fwd_fp16(const FwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  return detail::run_fwd<__half>(p, score, adaptive, stream);
}

std::string run_row_entropy_fp16(const FwdParams& p, int score, cudaStream_t stream) {
  return detail::run_row_entropy<__half>(p, score, stream);
}

}  // namespace ssa_flash
