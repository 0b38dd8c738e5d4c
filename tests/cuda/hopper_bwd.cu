// The sm_90a backward's shipped instances compiled for the device (tests/cuda/
// test_hopper_bwd_sass.py: nvcc -arch=sm_90a -cubin -I csrc, then the SASS is read): the kernel
// for fp16 / bf16, D 64 / 128, softmax / SSA, fixed / adaptive temperature, through the launcher
// (bwd_launch.h, run_hopper_bwd), which also compiles its host side.
#include "hopper/bwd_launch.h"

namespace ssa_flash {
// (defined by fwd_fp16.cu in the extension)
int score_param_count(int score) {
  return known_score(score) ? score_switch(score, [](auto S) { return decltype(S)::kParams; }) : -1;
}

std::string hopper_bwd_sass_instances(const BwdParams& p, int score, bool adaptive, bool bf16) {
  return bf16 ? hopper::run_hopper_bwd<__nv_bfloat16>(p, score, adaptive, nullptr)
              : hopper::run_hopper_bwd<__half>(p, score, adaptive, nullptr);
}
}  // namespace ssa_flash
