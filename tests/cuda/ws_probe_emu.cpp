// The CPU emulation's entry point for tests/cuda/ws_probe.cuh (tests/cuda/test_pipeline_emulated.py
// builds it with the host compiler: c++ -std=c++17 -shared -fPIC -DSSA_FLASH_EMULATE -I csrc ...).
#ifndef SSA_FLASH_EMULATE
#define SSA_FLASH_EMULATE 1
#endif

#include <string>

#include "ws_probe.cuh"

namespace {

// ws_probe_kernel<kBug> for a runtime bug number
template <int kBug = 0>
std::string launch_probe(int bug, const ssa_flash::ProbeParams& p) {
  using namespace ssa_flash;
  if constexpr (kBug < kProbeBugs) {
    if (bug != kBug) return launch_probe<kBug + 1>(bug, p);
    return ssa_emu::launch(ws_probe_kernel<kBug>, "ws_probe", dim3(1, 1, 1), kProbeThreads, kProbeSmemBytes, p);
  }
  return "unknown bug";
}

}  // namespace

// q: lq x 128 bf16 (lq <= 128), k: lk x 128 bf16, both row-major, K loaded by 2-D or 3-D TMA (k_rank); s: 128 x 64 n_tiles floats
// (n_tiles = ceil(lk / 64)), rowsum: 128, order: 2 n_tiles. Returns "" or the emulator's error.
extern "C" const char* ws_probe_run(const void* q, int lq, const void* k, int lk, int k_rank, int bug, int lazy,
                                    unsigned seed, float* s, float* rowsum, int* order) {
  using namespace ssa_flash;
  ssa_emu::config().lazy_copies = lazy != 0;
  ssa_emu::config().seed = seed;
  ssa_emu::config().shuffle = seed != 0;
  ProbeParams p{};
  p.tma_q = TmaTileSpec{q, 2, 2, 128, {kProbeD, lq, 1}, {0, 2 * kProbeD, 0}, {64, kProbeBM, 1}};
  p.tma_k = k_rank == 3 ? TmaTileSpec{k, 3, 2, 128, {64, lk, kProbeD / 64}, {0, 2 * kProbeD, 128}, {64, kProbeBN, kProbeD / 64}}
                        : TmaTileSpec{k, 2, 2, 128, {kProbeD, lk, 1}, {0, 2 * kProbeD, 0}, {64, kProbeBN, 1}};
  p.k_rank = k_rank;
  p.s = s;
  p.rowsum = rowsum;
  p.order = order;
  p.n_tiles = (lk + kProbeBN - 1) / kProbeBN;
  static std::string err;
  err = bug >= 0 && bug < kProbeBugs ? launch_probe(bug, p) : "unknown bug " + std::to_string(bug);
  return err.c_str();
}
