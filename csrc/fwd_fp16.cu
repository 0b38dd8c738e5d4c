// Forward and row-entropy kernels, float16 (sm_75+).
#include "launch_impl.h"

namespace ssa_flash {

std::string run_fwd_fp16(const FwdParams& p, bool ssa, bool adaptive, cudaStream_t stream) {
  return detail::run_fwd<__half>(p, ssa, adaptive, stream);
}

std::string run_row_entropy_fp16(const FwdParams& p, bool ssa, cudaStream_t stream) {
  return detail::run_row_entropy<__half>(p, ssa, stream);
}

}  // namespace ssa_flash
