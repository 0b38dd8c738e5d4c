// Backward kernels (dQ, then dK/dV), bfloat16 (sm_80+).
#include "launch_impl.h"

namespace ssa_flash {

std::string run_bwd_bf16(const BwdParams& p, bool ssa, bool adaptive, cudaStream_t stream) {
  return detail::run_bwd<__nv_bfloat16>(p, ssa, adaptive, stream);
}

}  // namespace ssa_flash
