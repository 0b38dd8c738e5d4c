// Forward and row-entropy kernels, bfloat16 (sm_80+).
#include "launch_impl.h"

namespace ssa_flash {

std::string run_fwd_bf16(const FwdParams& p, int score, bool adaptive, cudaStream_t stream) {
  return detail::run_fwd<__nv_bfloat16>(p, score, adaptive, stream);
}

std::string run_row_entropy_bf16(const FwdParams& p, int score, cudaStream_t stream) {
  return detail::run_row_entropy<__nv_bfloat16>(p, score, stream);
}

}  // namespace ssa_flash
