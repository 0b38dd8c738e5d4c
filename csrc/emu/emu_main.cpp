// C entry points of the CPU emulation (see emu_runtime.h), for ctypes: runs the binding's shared
// code (set_params.h: checks, parameter structs, backward plan), the real launch code of
// launch_impl.h (head-dim dispatch, tile traits, grids) and the real kernels on host memory. The
// call is described by the same AttnCall as api.cpp fills; emu/harness.py mirrors it as a
// ctypes.Structure, checked against ssa_emu_layout by tests/cuda/test_csrc_compile.py.
//
// Build (tests/cuda/test_csrc_compile.py does this):
//   c++ -std=c++17 -O1 -shared -fPIC -DSSA_FLASH_EMULATE -I csrc -I <cuda>/include \
//       csrc/emu/emu_main.cpp -o libssa_emu.so
#ifndef SSA_FLASH_EMULATE
#define SSA_FLASH_EMULATE 1
#endif

#include <cstddef>
#include <cstring>
#include <string>

#include "../launch_impl.h"
// the per-element-type entry points of launch.h, as the extension compiles them
#include "../bwd_bf16.cu"
#include "../bwd_fp16.cu"
#include "../fwd_bf16.cu"
#include "../fwd_fp16.cu"
#include "../set_params.h"

namespace {

std::string& last_error() {
  static std::string e;
  return e;
}

struct LayoutEntry {
  const char* name;
  long value;
};

#define SSA_EMU_SIZE(S) {#S, static_cast<long>(sizeof(ssa_flash::S))}
#define SSA_EMU_FIELD(S, F) {#S "." #F, static_cast<long>(offsetof(ssa_flash::S, F))}

// sizeof of each struct ctypes mirrors, and offsetof of each field ("Struct.field")
const LayoutEntry kLayout[] = {
    SSA_EMU_SIZE(Operand),
    SSA_EMU_FIELD(Operand, ptr), SSA_EMU_FIELD(Operand, sb), SSA_EMU_FIELD(Operand, sh), SSA_EMU_FIELD(Operand, sm),
    SSA_EMU_SIZE(AttnCall),
    SSA_EMU_FIELD(AttnCall, batch), SSA_EMU_FIELD(AttnCall, heads), SSA_EMU_FIELD(AttnCall, heads_kv),
    SSA_EMU_FIELD(AttnCall, group), SSA_EMU_FIELD(AttnCall, len_q), SSA_EMU_FIELD(AttnCall, len_k),
    SSA_EMU_FIELD(AttnCall, dim), SSA_EMU_FIELD(AttnCall, dim_v), SSA_EMU_FIELD(AttnCall, bf16),
    SSA_EMU_FIELD(AttnCall, score), SSA_EMU_FIELD(AttnCall, scale), SSA_EMU_FIELD(AttnCall, causal), SSA_EMU_FIELD(AttnCall, window_left),
    SSA_EMU_FIELD(AttnCall, window_right), SSA_EMU_FIELD(AttnCall, deterministic),
    SSA_EMU_FIELD(AttnCall, mask_kind), SSA_EMU_FIELD(AttnCall, mask), SSA_EMU_FIELD(AttnCall, mask_sb),
    SSA_EMU_FIELD(AttnCall, mask_sh), SSA_EMU_FIELD(AttnCall, mask_sm), SSA_EMU_FIELD(AttnCall, mask_sn),
    SSA_EMU_FIELD(AttnCall, score_param), SSA_EMU_FIELD(AttnCall, drop_keep31), SSA_EMU_FIELD(AttnCall, drop_scale),
    SSA_EMU_FIELD(AttnCall, drop_rng),
    SSA_EMU_FIELD(AttnCall, q),
    SSA_EMU_FIELD(AttnCall, k), SSA_EMU_FIELD(AttnCall, v), SSA_EMU_FIELD(AttnCall, o),
    SSA_EMU_FIELD(AttnCall, dout), SSA_EMU_FIELD(AttnCall, dq), SSA_EMU_FIELD(AttnCall, dk),
    SSA_EMU_FIELD(AttnCall, dv), SSA_EMU_FIELD(AttnCall, lse), SSA_EMU_FIELD(AttnCall, entropy),
    SSA_EMU_FIELD(AttnCall, dlse), SSA_EMU_FIELD(AttnCall, beta), SSA_EMU_FIELD(AttnCall, lse_l),
    SSA_EMU_FIELD(AttnCall, dbeta_dh), SSA_EMU_FIELD(AttnCall, rowstat), SSA_EMU_FIELD(AttnCall, dq_accum),
    SSA_EMU_FIELD(AttnCall, dparam_part),
    SSA_EMU_FIELD(AttnCall, sinks), SSA_EMU_FIELD(AttnCall, softcap), SSA_EMU_FIELD(AttnCall, lse_lo),
    SSA_EMU_FIELD(AttnCall, dmask), SSA_EMU_FIELD(AttnCall, dmask_batch), SSA_EMU_FIELD(AttnCall, dmask_heads),
    SSA_EMU_SIZE(BwdPlan),
    SSA_EMU_FIELD(BwdPlan, fused), SSA_EMU_FIELD(BwdPlan, num_partials), SSA_EMU_FIELD(BwdPlan, stat_rows),
    SSA_EMU_FIELD(BwdPlan, stat_count), SSA_EMU_FIELD(BwdPlan, accum_cols), SSA_EMU_FIELD(BwdPlan, hopper),
    SSA_EMU_SIZE(BwdBuffers),
    SSA_EMU_FIELD(BwdBuffers, fused), SSA_EMU_FIELD(BwdBuffers, rowstat), SSA_EMU_FIELD(BwdBuffers, dq_accum),
    SSA_EMU_FIELD(BwdBuffers, partials), SSA_EMU_FIELD(BwdBuffers, nparams), SSA_EMU_FIELD(BwdBuffers, lse_lo),
};

}  // namespace

// op 0: forward (o, lse), 1: row entropy (entropy, lse of softmax(l)), 2: backward (as
// plan_backward of the same call says; the buffers of ssa_emu_bwd_plan given; then the learned
// mask's gradient where call->dmask is set), after check_call
// (once, as api.cpp). lazy_copies and seed: the emulation's schedule (emu_runtime.h, Config).
// Returns an error message or "".
extern "C" const char* ssa_emu_run(int op, const ssa_flash::AttnCall* call, int lazy_copies, unsigned seed) {
  using namespace ssa_flash;
  ssa_emu::config().lazy_copies = lazy_copies != 0;
  ssa_emu::config().seed = seed;
  ssa_emu::config().shuffle = seed != 0;
  std::string err = check_call(*call);
  if (!err.empty()) {
  } else if (op == 0) {
    err = launch_forward(*call, nullptr);
  } else if (op == 1) {
    err = launch_row_entropy(*call, nullptr);
  } else if (op == 2) {
    err = launch_backward(*call, plan_backward(*call), nullptr);
  } else {
    err = "unknown op " + std::to_string(op);
  }
  last_error() = err;
  return last_error().c_str();
}

// The backward's plan for a call (launch.h, BwdPlan) and the shapes of its buffers
// (set_params.h, bwd_buffers); the call's sizes, flags and operands (their alignment) are read.
extern "C" void ssa_emu_bwd_plan(const ssa_flash::AttnCall* call, ssa_flash::BwdPlan* plan,
                                 ssa_flash::BwdBuffers* buffers) {
  *plan = ssa_flash::plan_backward(*call);
  *buffers = ssa_flash::bwd_buffers(*call, *plan);
}

// The layout of the structs above: sizeof("AttnCall") or offsetof("AttnCall.scale"); -1 for an
// unknown name. ssa_emu_layout_name(i) lists the names (null past the last).
extern "C" long ssa_emu_layout(const char* name) {
  for (const LayoutEntry& e : kLayout)
    if (std::strcmp(e.name, name) == 0) return e.value;
  return -1;
}

extern "C" const char* ssa_emu_layout_name(int i) {
  return i >= 0 && i < static_cast<int>(sizeof(kLayout) / sizeof(kLayout[0])) ? kLayout[i].name : nullptr;
}

// wgmma operations issued (per thread) in this process so far, by any emulator library loaded
// (emu_runtime.h, Config): it grows only while a kernel runs its sm_90a path.
extern "C" long ssa_emu_wgmma_issued() { return ssa_emu::config().wgmma_issued; }

// launches of the kernel `name` so far (which kernel the dispatch chose)
extern "C" long ssa_emu_launches(const char* name) {
  for (const auto& l : ssa_emu::config().launches)
    if (l.first == name) return l.second;
  return 0;
}

#if SSA_FLASH_HOPPER_FWD
// The sm_90a warp-specialised forward's run-time switch (csrc/hopper/tma_cache.h): on = 1 or 0
// sets it, -1 only reads it; returns it.
extern "C" int ssa_emu_hopper_fwd(int on) {
  if (on >= 0) ssa_flash::hopper::set_hopper_fwd_enabled(on != 0);
  return ssa_flash::hopper::hopper_fwd_enabled() ? 1 : 0;
}

// The sm_90a backward's (csrc/hopper/bwd_launch.h; launch.h, hopper_bwd_control): on = 1 or 0
// sets it, -1 only reads it; returns it.
extern "C" int ssa_emu_hopper_bwd(int on) { return ssa_flash::hopper_bwd_control(on); }

// The tensor-map cache (the forward's and the backward's maps): which 0 hits, 1 misses (maps encoded), 2 patches (hits whose address was
// replaced), 3 entries held; -1 empties it (counters reset) and returns 0.
extern "C" long ssa_emu_tma_cache(int which) {
  auto& cache = ssa_flash::hopper::tma_cache();
  if (which < 0) {
    cache.clear();
    return 0;
  }
  const ssa_flash::hopper::TmaCacheStats s = cache.stats();
  return which == 0 ? s.hits : which == 1 ? s.misses : which == 2 ? s.patches : cache.size();
}
#endif
