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

int hopper_fwd_control(int on, int mufu, long stats[6]) {
#if SSA_FLASH_HOPPER_FWD
  if (on >= 0) hopper::set_hopper_fwd_enabled(on != 0);
  if (mufu >= 0) hopper::hopper_mufu_budget().store(mufu);
  if (stats != nullptr) {
    const hopper::TmaCacheStats s = hopper::tma_cache().stats();
    stats[0] = s.hits;
    stats[1] = s.misses;
    stats[2] = s.patches;
    stats[3] = hopper::tma_cache().size();
    stats[4] = hopper::hopper_mufu_budget().load();
    stats[5] = SSA_FLASH_HOPPER_MUFU_SWEEP;
  }
  return hopper::hopper_fwd_enabled() ? 1 : 0;
#else
  (void)on;
  (void)mufu;
  if (stats != nullptr)
    for (int i = 0; i < 6; ++i) stats[i] = 0;
  return -1;
#endif
}

std::string run_row_entropy_fp16(const FwdParams& p, int score, cudaStream_t stream) {
  return detail::run_row_entropy<__half>(p, score, stream);
}

}  // namespace ssa_flash
