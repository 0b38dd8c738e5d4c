// What every kernel (fwd_kernel.h, bwd_kernel.h) starts with: the names of its tile from the
// traits (SSA_TILE_NAMES) and the exit of an instance its architecture never launches
// (never_launched). Where the tile lies in the sequences is block_info.h's (BlockInfo). (The
// dynamic shared memory stays declared in each kernel: behind a helper returning its start, ptxas
// schedules the sm_80 kernels differently; bench/NOTES.md.)
#pragma once

#include "arch.h"
#include "smem_layout.h"  // PaddedTile

namespace ssa_flash {

// The names a kernel's body uses for its traits Tr (traits.h): T the element type, the tile
// kBlockM x kBlockN (query rows x keys), head dim kD, the padded shared-memory row stride kS and
// its layout Pad, kNThreads threads. (A macro: the names are the body's own locals, so its code
// reads as before; compile-time constants, they change no instruction.)
#define SSA_TILE_NAMES(Tr)               \
  using T = typename Tr::Elem;           \
  constexpr int kBlockM = Tr::kBlockM;   \
  constexpr int kBlockN = Tr::kBlockN;   \
  constexpr int kD = Tr::kHeadDim;       \
  constexpr int kS = Tr::kStride;        \
  using Pad = PaddedTile<kS>;            \
  constexpr int kNThreads = Tr::kNThreads

// True, after a trap, in an instance that this architecture never launches (`unsupported`:
// elem.h kernel_unsupported, and what else a kernel's host side never picks); the kernel then
// returns at once, its body dead code: less code, and no register pressure (spills) from code
// that cannot run. False without __CUDA_ARCH__ (the host pass, the CPU emulation).
SSA_DEVICE bool never_launched(bool unsupported) {
#if defined(__CUDA_ARCH__)
  if (unsupported) __trap();
  return unsupported;
#else
  (void)unsupported;
  return false;
#endif
}

}  // namespace ssa_flash
