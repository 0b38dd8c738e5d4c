// Backward kernels (dQ, then dK/dV), float16 (sm_75+).
#include "launch_impl.h"

namespace ssa_flash {

std::string run_bwd_fp16(const BwdParams& p, bool ssa, bool adaptive, cudaStream_t stream) {
  return detail::run_bwd<__half>(p, ssa, adaptive, stream);
}

}  // namespace ssa_flash
