// Device primitives of warp-specialised sm_90a kernels (docs/design.md §4.4): a producer
// warpgroup loads tiles with TMA into a ring of shared-memory stages, each guarded by a "full"
// and an "empty" mbarrier; consumer warpgroups take more registers (setmaxnreg) and order their
// GEMMs with named barriers. Thin wrappers over inline PTX (names from the PTX ISA); elsewhere
// than sm_90a they compile and trap (never reached); in the CPU emulation (SSA_FLASH_EMULATE)
// they are csrc/emu's, which model the same semantics on fibers.
//
// Tensor maps. The kernel takes its TMA descriptor as `const __grid_constant__ TmaDesc` (directly
// or inside a __grid_constant__ parameter struct) and passes its address to tma_load_2d / _3d:
// on the device TmaDesc is the driver's CUtensorMap, which the host builds from a TmaTileSpec with
// cuTensorMapEncodeTiled (the fields map one to one: base -> globalAddress, rank -> tensorRank,
// dims -> globalDim, strides[1..] -> globalStrides, box -> boxDim, elementStrides all 1,
// interleave NONE, swizzle_bytes 128 -> CU_TENSOR_MAP_SWIZZLE_128B, 0 -> _NONE, OOB fill NONE,
// i.e. zeros); in the emulation TmaDesc is the TmaTileSpec itself. Kernel code is the same in both.
//
// Shared-memory tiles to match smem_layout.h's Sw128Tile<R> (the layout gemm_wgmma.h's
// descriptors read): a tensor map with the 128-byte swizzle and a box of 64 x R 16-bit elements
// (64 columns = 128 bytes, R rows) writes one 64-column panel of the tile, row r at r * 128
// bytes with its 16-byte chunk c at c ^ (r % 8), when the destination is 1024-byte aligned (the
// swizzle is a function of shared-address bits 7-9, XORed into bits 4-6). A D-column tile is
// D / 64 such loads, panel p at p * Sw128Tile<R>::kPanelBytes, coordinates (64 p, row).
#pragma once

#include "arch.h"
#include "memory.h"

#if !defined(SSA_FLASH_EMULATE)
#include <cuda.h>  // CUtensorMap (the type only; nothing of the driver API is called here)
#endif

namespace ssa_flash {

// Host-side description of a tiled TMA load (what cuTensorMapEncodeTiled takes; see above).
// Dimensions innermost first: dims[0] contiguous, strides[d] the bytes between consecutive
// indices of dimension d >= 1 (multiples of 16; strides[0] unused). Entries past `rank` unused.
// (Rank 4 is the attention kernels' (head dim, rows, head, batch) view of a (B, H, L, D) tensor
// with any batch and head strides.)
constexpr int kTmaMaxRank = 4;
struct TmaTileSpec {
  const void* base;
  int rank;           // 2, 3 or 4
  int elem_bytes;     // 2: fp16 / bf16
  int swizzle_bytes;  // 0 or 128
  int64_t dims[kTmaMaxRank];
  int64_t strides[kTmaMaxRank];
  int box[kTmaMaxRank];  // the tile's extent per dimension (box[0] * elem_bytes <= 128 with the swizzle)
};

#ifdef SSA_FLASH_EMULATE
using TmaDesc = TmaTileSpec;
#else
using TmaDesc = CUtensorMap;
#endif

// Named barriers of the kernels: 0 is __syncthreads'; ids 1..15 are free.
constexpr int kFirstNamedBarrier = 1;

#ifdef SSA_FLASH_EMULATE
using ssa_emu::elect_one;
using ssa_emu::fence_mbar_init;
using ssa_emu::mbar_arrive;
using ssa_emu::mbar_arrive_expect_tx;
using ssa_emu::mbar_init;
using ssa_emu::mbar_try_wait;
using ssa_emu::named_bar_arrive;
using ssa_emu::named_bar_sync;
using ssa_emu::setmaxnreg_dec;
using ssa_emu::setmaxnreg_inc;

SSA_DEVICE void prefetch_tma_desc(const TmaDesc*) {}

SSA_DEVICE void tma_load_2d(void* smem, const TmaDesc* desc, uint64_t* bar, int c0, int c1) {
  ssa_emu::tma_load(smem, desc, bar, 2, c0, c1, 0);
}

SSA_DEVICE void tma_load_3d(void* smem, const TmaDesc* desc, uint64_t* bar, int c0, int c1, int c2) {
  ssa_emu::tma_load(smem, desc, bar, 3, c0, c1, c2);
}

SSA_DEVICE void tma_load_4d(void* smem, const TmaDesc* desc, uint64_t* bar, int c0, int c1, int c2, int c3) {
  ssa_emu::tma_load(smem, desc, bar, 4, c0, c1, c2, c3);
}

SSA_DEVICE void tma_store_4d(const void* smem, const TmaDesc* desc, int c0, int c1, int c2, int c3) {
  ssa_emu::tma_store(smem, desc, 4, c0, c1, c2, c3);
}
using ssa_emu::tma_store_commit;
using ssa_emu::tma_store_wait_read;
#else
// ------------------------------------------------------------------------------------------
// mbarrier: a 64-bit shared-memory object counting arrivals and transaction bytes per phase.
// A phase completes when the expected number of threads arrived and every byte announced by
// expect_tx was delivered (by TMA's complete_tx); the barrier then enters the next phase, whose
// parity waiting threads test. All operations are on the CTA's own shared memory.

// mbarrier.init: arrivals expected per phase = count; phase 0 starts.
SSA_DEVICE void mbar_init(uint64_t* bar, uint32_t count) {
#if SSA_FLASH_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#else
  (void)bar; (void)count;
  __trap();
#endif
}

// After the inits and before the barrier that publishes them: makes the initialised mbarriers
// visible to the other threads and to the async proxy (the TMA unit completes transactions on
// them). fence.mbarrier_init exists only with .release.cluster (a CTA is a cluster of one).
SSA_DEVICE void fence_mbar_init() {
#if SSA_FLASH_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  __trap();
#endif
}

// mbarrier.arrive (release at CTA scope: this thread's earlier shared-memory accesses, e.g. the
// consumer's reads of a stage, happen before the phase completes). The returned state is
// discarded (sink `_`).
SSA_DEVICE void mbar_arrive(uint64_t* bar) {
#if SSA_FLASH_WGMMA
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
#else
  (void)bar;
  __trap();
#endif
}

// mbarrier.arrive.expect_tx: raises the phase's transaction count by `bytes` (what the TMA loads
// issued next will deliver), then arrives. The producer's one thread does this per stage.
SSA_DEVICE void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if SSA_FLASH_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
#else
  (void)bar; (void)bytes;
  __trap();
#endif
}

// mbarrier.try_wait.parity: true when the phase of parity `parity` has completed (i.e. the
// current phase has the other parity); may give up after a hardware time limit and return false
// (callers loop: mbar_wait). Acquire: the completed phase's data (TMA writes, the other side's
// reads) is ordered before this thread's later accesses.
SSA_DEVICE bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
#if SSA_FLASH_WGMMA
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
#else
  (void)bar; (void)parity;
  __trap();
  return false;
#endif
}

// ------------------------------------------------------------------------------------------
// TMA (cp.async.bulk.tensor): one thread asks the copy engine for a box of a tensor; the bytes
// land in shared memory (swizzled as the tensor map says) and are counted on the mbarrier
// (complete_tx), whose waiters then see them. The destination is .shared::cluster, which for a
// CTA's own shared memory is its .shared::cta address. `desc` is the generic address of the
// __grid_constant__ parameter (param space), which TMA reads directly.

// prefetch.tensormap: brings the descriptor into the cache ahead of the first load.
SSA_DEVICE void prefetch_tma_desc(const TmaDesc* desc) {
#if SSA_FLASH_WGMMA
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(desc)) : "memory");
#else
  (void)desc;
  __trap();
#endif
}

SSA_DEVICE void tma_load_2d(void* smem, const TmaDesc* desc, uint64_t* bar, int c0, int c1) {
#if SSA_FLASH_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
          "r"(smem_u32(smem)),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
#else
  (void)smem; (void)desc; (void)bar; (void)c0; (void)c1;
  __trap();
#endif
}

SSA_DEVICE void tma_load_3d(void* smem, const TmaDesc* desc, uint64_t* bar, int c0, int c1, int c2) {
#if SSA_FLASH_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(smem_u32(smem)),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
#else
  (void)smem; (void)desc; (void)bar; (void)c0; (void)c1; (void)c2;
  __trap();
#endif
}

SSA_DEVICE void tma_load_4d(void* smem, const TmaDesc* desc, uint64_t* bar, int c0, int c1, int c2, int c3) {
#if SSA_FLASH_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_u32(smem)),
      "l"(reinterpret_cast<uint64_t>(desc)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#else
  (void)smem; (void)desc; (void)bar; (void)c0; (void)c1; (void)c2; (void)c3;
  __trap();
#endif
}

// TMA store (cp.async.bulk.tensor, global <- shared, bulk-group completion): one thread writes a
// box of shared memory (the layout as for a load: the tensor map's swizzle) to the tensor at the
// coordinates; elements of the box outside the tensor are not written (the store clips ragged
// ends). The threads that wrote the shared tile make their writes visible to the async proxy
// first (fence_proxy_async, then a barrier with the storing thread). tma_store_commit closes a
// bulk group of this thread's stores; tma_store_wait_read<N> waits until at most N groups still
// read shared memory (the tile may then be overwritten, and the CTA may exit: its shared memory
// must outlive the reads).
SSA_DEVICE void tma_store_4d(const void* smem, const TmaDesc* desc, int c0, int c1, int c2, int c3) {
#if SSA_FLASH_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(desc)),
      "r"(smem_u32(smem)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#else
  (void)smem; (void)desc; (void)c0; (void)c1; (void)c2; (void)c3;
  __trap();
#endif
}

SSA_DEVICE void tma_store_commit() {
#if SSA_FLASH_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#else
  __trap();
#endif
}

template <int N>
SSA_DEVICE void tma_store_wait_read() {
#if SSA_FLASH_WGMMA
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#else
  __trap();
#endif
}

// ------------------------------------------------------------------------------------------
// Named barriers: bar.sync id, count waits until `count` threads (a multiple of 32, counted per
// warp) have arrived at barrier `id`; bar.arrive id, count arrives without waiting. A pair of
// them orders two warpgroups (ping-pong): one arrives where the other syncs.

SSA_DEVICE void named_bar_sync(int id, int count) {
#if SSA_FLASH_WGMMA
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#else
  (void)id; (void)count;
  __trap();
#endif
}

SSA_DEVICE void named_bar_arrive(int id, int count) {
#if SSA_FLASH_WGMMA
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
#else
  (void)id; (void)count;
  __trap();
#endif
}

// ------------------------------------------------------------------------------------------
// setmaxnreg.{inc,dec}.sync.aligned.u32 N: the warp's per-thread register budget becomes N (24..256,
// a multiple of 8); every warp of a warpgroup must execute the same one. The producer gives
// registers back (dec) so the consumers can take them (inc: waits until the pool has them).

template <int N>
SSA_DEVICE void setmaxnreg_inc() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: 24..256, a multiple of 8");
#if SSA_FLASH_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#else
  __trap();
#endif
}

template <int N>
SSA_DEVICE void setmaxnreg_dec() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: 24..256, a multiple of 8");
#if SSA_FLASH_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#else
  __trap();
#endif
}

// elect.sync _|p, 0xffffffff: true in exactly one lane of the (fully active) warp.
SSA_DEVICE bool elect_one() {
#if SSA_FLASH_WGMMA
  uint32_t pred;
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(pred));
  return pred != 0;
#else
  __trap();
  return false;
#endif
}
#endif  // !SSA_FLASH_EMULATE

// Waits until the phase of parity `parity` of `bar` has completed.
SSA_DEVICE void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// The warpgroup (128 consecutive threads) of this thread, and its warp within the warpgroup.
// Read through a shuffle on the device so the compiler knows it is warp-uniform.
SSA_DEVICE int warpgroup_idx() {
#ifdef SSA_FLASH_EMULATE
  return static_cast<int>(threadIdx.x) / 128;
#else
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / 128, 0);
#endif
}

SSA_DEVICE int warp_idx_in_warpgroup() { return (static_cast<int>(threadIdx.x) / 32) % 4; }

// The stage and phase bit of one side of a kStages ring. Each stage's mbarriers complete one
// phase per use; the phase bit flips each time the index wraps. The consumer waits on full[stage]
// for parity `phase` (the load of this round landed); the producer waits on empty[stage] for
// parity `phase ^ 1`: in the first round that is the phase "before" phase 0, which counts as
// completed, so the producer fills every stage once without waiting.
template <int kStages>
struct RingPos {
  int stage = 0;
  uint32_t phase = 0;
  SSA_DEVICE void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

}  // namespace ssa_flash
