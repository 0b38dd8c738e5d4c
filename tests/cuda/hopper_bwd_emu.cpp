// The CPU emulation's entry point for the sm_90a backward (csrc/hopper/bwd_launch.h):
// tests/cuda/test_hopper_bwd.py builds it with the host compiler (c++ -std=c++17 -shared -fPIC
// -DSSA_FLASH_EMULATE -DSSA_FLASH_EMULATE_SM90 -I csrc ...) and describes each call with
// tests/emu_harness.py's AttnCall, as the extension's binding would.
#ifndef SSA_FLASH_EMULATE
#define SSA_FLASH_EMULATE 1
#endif
#ifndef SSA_FLASH_EXTRAS
#define SSA_FLASH_EXTRAS 0  // (the pre-pass without its soft-capping / sink instances)
#endif

#include <string>

#include "hopper/bwd_launch.h"
#include "set_params.h"

namespace ssa_flash {
// (defined by fwd_fp16.cu in the extension)
int score_param_count(int score) {
  return known_score(score) ? score_switch(score, [](auto S) { return decltype(S)::kParams; }) : -1;
}
}  // namespace ssa_flash

namespace {

using namespace ssa_flash;
using namespace ssa_flash::hopper;

// run_hopper_bwd_hdim<T, kD, kBug> for a runtime bug number (the broken variants: bf16, D = 64)
template <int kBug = 0>
std::string run_bug(int bug, const BwdParams& p, int score, bool adaptive) {
  if constexpr (kBug < kBwdBugs) {
    if (bug != kBug) return run_bug<kBug + 1>(bug, p, score, adaptive);
    return run_hopper_bwd_hdim<__nv_bfloat16, 64, kBug>(p, score, adaptive, nullptr);
  }
  return "unknown bug " + std::to_string(bug);
}

}  // namespace

// The plan of a call's buffers: num_partials, stat_rows, stat_count, accum_cols (hopper_bwd_plan).
extern "C" void hopper_bwd_emu_plan(const AttnCall* call, int* out) {
  const BwdPlan plan = hopper_bwd_plan(static_cast<int>(call->dim), static_cast<int>(call->len_q),
                                       static_cast<int>(call->len_k), call->beta != nullptr);
  out[0] = plan.num_partials;
  out[1] = plan.stat_rows;
  out[2] = plan.stat_count;
  out[3] = plan.accum_cols;
}

// Why the sm_90a backward would not run this call on an sm_90a device ("" if it would).
extern "C" const char* hopper_bwd_emu_unsupported(const AttnCall* call) {
  const BwdPlan plan = hopper_bwd_plan(static_cast<int>(call->dim), static_cast<int>(call->len_q),
                                       static_cast<int>(call->len_k), call->beta != nullptr);
  const BwdParams p = bwd_params(*call, plan);
  const char* why = hopper_bwd_unsupported(p, static_cast<int>(call->score), call->deterministic != 0, 900, true);
  return why ? why : "";
}

// The backward of a call (its buffers as hopper_bwd_emu_plan sizes them: dq_accum zeroed, dk,
// dv, rowstat, dparam_part) by the pre-pass and hopper_bwd_kernel<bug> (bug != 0: bf16, D = 64
// only). lazy / seed: the emulation's schedule. Returns "" or the error.
extern "C" const char* hopper_bwd_emu_run(const AttnCall* call, int lazy, unsigned seed, int bug) {
  static std::string err;
  ssa_emu::config().lazy_copies = lazy != 0;
  ssa_emu::config().seed = seed;
  ssa_emu::config().shuffle = seed != 0;
  err = check_call(*call);
  if (!err.empty()) return err.c_str();
  const bool adaptive = call->beta != nullptr;
  const BwdPlan plan = hopper_bwd_plan(static_cast<int>(call->dim), static_cast<int>(call->len_q),
                                       static_cast<int>(call->len_k), adaptive);
  const BwdParams p = bwd_params(*call, plan);
  const int score = static_cast<int>(call->score);
  if (const char* why = hopper_bwd_unsupported(p, score, call->deterministic != 0, 900, true)) {
    err = std::string("routed to today's backward: ") + why;
  } else if (bug != 0) {
    err = call->bf16 && p.dim == 64 ? run_bug(bug, p, score, adaptive) : "broken variants: bf16, D = 64 only";
  } else {
    err = call->bf16 ? run_hopper_bwd<__nv_bfloat16>(p, score, adaptive, nullptr)
                     : run_hopper_bwd<__half>(p, score, adaptive, nullptr);
  }
  return err.c_str();
}
