// Tile sizes per kernel and head dim. Plain constexpr: included by the kernels and by the host
// binding (which sizes the db/dn partial-sum buffers with dq_block_m).
//
// Every kernel gives each warp kMS 16-row strips of the tile it owns (query rows in the forward,
// row-entropy and dQ kernels; key rows in the dK/dV kernel). The forward and row-entropy kernels
// use two strips (32 rows per warp, 128-row tiles) up to D = 128: every K / V fragment a warp
// reads from shared memory then feeds two m16 strips, halving ldmatrix traffic per mma
// (FlashAttention-2's 128 x N tiles with 4 warps); at D = 128 the key block is 32 so that the
// output (128 registers) and scores fit without spills and the 52 KiB tile fits sm_75's 64 KiB.
// The backward kernels keep one strip per warp: their dQ or dK/dV accumulators plus two score
// tiles leave no registers for a second strip. Shared-memory rows are padded by 8 elements
// (16 bytes), which makes the 8 row addresses of each ldmatrix fall in distinct banks.
//
// Shared memory (16-bit elements, padded rows of P = D + 8):
//   forward      Q + K + V            (BM + 2 BN) P        K, V single-buffered, loads overlapped
//   row entropy  Q + 2 K              (BM + 2 BN) P        K double-buffered
//   dQ           Q + dO + 2 K + V     (2 BM + 3 BN) P      K double-buffered
//   dK/dV        K + V + 2 Q + dO     (2 BN + 3 BM) P      Q double-buffered (+ row statistics)
#pragma once

namespace ssa_flash {

// The head dims kernels are compiled for; others run zero-padded to the next one.
constexpr int padded_head_dim(int d) {
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : d <= 256 ? 256 : -1;
}

// forward and row-entropy pass: BM query rows (4 warps), BN keys per step
constexpr int fwd_block_m(int d) { return d <= 128 ? 128 : 64; }
constexpr int fwd_block_n(int d) { return d <= 64 ? 64 : 32; }
// the largest query tile of any kernel (params.h set_band relies on it)
constexpr int kMaxBlockRows = 128;
constexpr int fwd_warps(int) { return 4; }

// dQ kernel (also delta, the adaptive-temperature g and the db/dn partials)
constexpr int dq_block_m(int d) { return d <= 128 ? 64 : 32; }
constexpr int dq_block_n(int d) { return d <= 64 ? 64 : d <= 128 ? 32 : 16; }
constexpr int dq_warps(int d) { return dq_block_m(d) / 16; }

// dK/dV kernel: BN keys (16 per warp strip), BM queries per step. At D = 256 the dK and dV
// accumulators of a 16-key strip (2 x 16 x 256 floats, 256 registers per thread) do not fit, so
// two warps share each strip, each accumulating half of the columns (both compute the strip's
// scores: the S^T and dP^T GEMMs are duplicated, the dK/dV GEMMs are not).
// (32 queries per step at every head dim: 64 at D <= 64 spilled in the adaptive variants on
// sm_70 / sm_75)
constexpr int dkdv_block_n(int d) { return d <= 128 ? 64 : 32; }
constexpr int dkdv_block_m(int) { return 32; }
constexpr int dkdv_col_split(int d) { return d <= 128 ? 1 : 2; }
constexpr int dkdv_warps(int d) { return dkdv_block_n(d) / 16 * dkdv_col_split(d); }

constexpr int smem_row(int d) { return d + 8; }

// sm_70 only: per-warp shared memory through which P / dS reach the second GEMM (gemm_mma.h,
// gemm_rn), 16 rows per strip of the warp, K + 8 elements each (K = the GEMM's reduction size).
constexpr int sm70_scratch_bytes(int warps, int strips, int k, int elem_bytes) {
  return warps * strips * 16 * (k + 8) * elem_bytes;
}

constexpr int fwd_strips(int d) { return fwd_block_m(d) / (16 * fwd_warps(d)); }

// The code path of an architecture (100 major + 10 minor): sm_70 (mma.m8n8k4, no ldmatrix),
// sm_75 (m16n8k8, no cp.async), sm_80+ (m16n8k16, cp.async), sm_90 (the sm_80 code, and wgmma
// where a kernel has it and the build has sm_90a code). Shared memory depends on it.
enum CodePath : int { kPathSm70 = 0, kPathSm75 = 1, kPathSm80 = 2, kPathSm90 = 3 };
constexpr int code_path(int arch) {
  return arch < 750 ? kPathSm70 : arch < 800 ? kPathSm75 : arch == 900 ? kPathSm90 : kPathSm80;
}

// The dQ kernel's GEMMs are wgmma on sm_90a at these head dims (bwd_kernel.h): its 64-row query
// tile is one warpgroup's m64, and the head dim is whole 64-column panels of the swizzled tiles
// (the dQ GEMM's N-major B operand is read a panel per wgmma).
constexpr bool dq_wgmma(int d) { return d == 64 || d == 128; }
// The forward's and the row-entropy pass's GEMMs likewise (fwd_kernel.h): their 128-row query tile
// is two m64 halves of the warpgroup.
constexpr bool fwd_wgmma(int d) { return d == 64 || d == 128; }
// The key-block kernels' (dK/dV and fused backward, bwd_kernel.h): their 64-key block is the m64.
constexpr bool bwd_wgmma(int d) { return d == 64 || d == 128; }
// Bytes of a 128-byte-swizzled tile (smem_layout.h, Sw128Tile): 64-column panels of 128-byte rows.
constexpr int sw128_tile_bytes(int rows, int d) { return (d + 63) / 64 * rows * 128; }
constexpr int max_int(int a, int b) { return a > b ? a : b; }

// Shared memory of each kernel on code path `path`: sm_70 adds the gemm_rn scratch.
// (on sm_90 at least the wgmma layout's: swizzled tiles plus 1024 bytes to align them; then 8
// bytes per thread of dropout flags, fwd_kernel.h drop_slot)
constexpr int fwd_drop_bytes(int d) { return fwd_warps(d) * 32 * 8; }
constexpr int fwd_smem_bytes(int d, int elem_bytes, int path = kPathSm80) {
  return max_int((fwd_block_m(d) + 2 * fwd_block_n(d)) * smem_row(d) * elem_bytes +
                     (path == kPathSm70 ? sm70_scratch_bytes(fwd_warps(d), fwd_strips(d), fwd_block_n(d), elem_bytes) : 0),
                 path == kPathSm90 && fwd_wgmma(d)
                     ? sw128_tile_bytes(fwd_block_m(d), d) + 2 * sw128_tile_bytes(fwd_block_n(d), d) + 1024
                     : 0) +
         fwd_drop_bytes(d);
}
constexpr int row_entropy_smem_bytes(int d, int elem_bytes, int path = kPathSm80) {
  return max_int((fwd_block_m(d) + 2 * fwd_block_n(d)) * smem_row(d) * elem_bytes,
                 path == kPathSm90 && fwd_wgmma(d)
                     ? sw128_tile_bytes(fwd_block_m(d), d) + 2 * sw128_tile_bytes(fwd_block_n(d), d) + 1024
                     : 0);
}
// On sm_90 the larger of the wgmma layout's (swizzled tiles, plus 1024 bytes to align them) and
// the sm_80 one's, as the build may hold either code for the device.
constexpr int dq_smem_bytes(int d, int elem_bytes, int path = kPathSm80) {
  return max_int((2 * dq_block_m(d) + 3 * dq_block_n(d)) * smem_row(d) * elem_bytes +
                     (path == kPathSm70 ? sm70_scratch_bytes(dq_warps(d), 1, dq_block_n(d), elem_bytes) : 0),
                 path == kPathSm90 && dq_wgmma(d)
                     ? 2 * sw128_tile_bytes(dq_block_m(d), d) + 3 * sw128_tile_bytes(dq_block_n(d), d) + 1024
                     : 0);
}
// The learned mask's gradient kernel (mask_grad.h): the dQ kernel's tile, Q + dO + K + V single
// buffers in the padded layout (mma.sync on every path)
constexpr int mask_grad_smem_bytes(int d, int elem_bytes) {
  return (2 * dq_block_m(d) + 2 * dq_block_n(d)) * smem_row(d) * elem_bytes;
}
// the key-block kernels' per-thread word of dropout flags (bwd_kernel.h, drop_slot), for up to 8
// warps (sm_75's split dK/dV kernels, DkdvTraitsSm75, have 8 at D = 96 / 128)
constexpr int key_block_drop_bytes(int) { return 8 * 32 * 4; }
// per query row of a dK/dV tile: lse, delta, and (adaptive) beta, lse_l, entropy, g; two buffers
constexpr int dkdv_stat_count(bool adaptive) { return adaptive ? 6 : 2; }
// Rows of the backward's row-statistics workspace and fused dQ accumulator: len_q rounded up to
// a multiple of every query tile (dQ kernel 64 or 32, dK/dV kernel 32), so that whole tiles are
// copied and added without bounds checks.
constexpr int bwd_stat_rows(int len_q) { return (len_q + 63) / 64 * 64; }
// Whether the dK/dV kernel passes dS^T to its dK GEMM through shared memory (as the fused kernel
// does) rather than registers: above D = 64 on sm_80+, where the 8 registers it frees per thread
// keep ptxas from spilling (the dK / dV accumulators take 2 D / 4 registers; sm_75's 64 KiB do
// not hold the extra tile at D = 128).
constexpr bool dkdv_stores_ds(int d, int path) { return d > 64 && path >= kPathSm80; }
// (sm_90: at least the wgmma layout's, swizzled K, V, Q, dO without the dS^T tile, plus 1024)
constexpr int dkdv_smem_bytes(int d, int elem_bytes, bool adaptive, int path = kPathSm80) {
  return max_int((2 * dkdv_block_n(d) + 3 * dkdv_block_m(d)) * smem_row(d) * elem_bytes +
                     2 * dkdv_stat_count(adaptive) * dkdv_block_m(d) * 4 +
                     (dkdv_stores_ds(d, path) ? dkdv_block_n(d) * (dkdv_block_m(d) + 8) * elem_bytes : 0) +
                     (path == kPathSm70 ? sm70_scratch_bytes(dkdv_warps(d), 1, dkdv_block_m(d), elem_bytes) : 0) +
                     key_block_drop_bytes(d),
                 path == kPathSm90 && bwd_wgmma(d)
                     ? 2 * sw128_tile_bytes(dkdv_block_n(d), d) + 3 * sw128_tile_bytes(dkdv_block_m(d), d) +
                           2 * dkdv_stat_count(adaptive) * dkdv_block_m(d) * 4 + key_block_drop_bytes(d) + 1024
                     : 0);
}

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Elem_, int kColSplit_ = 1>
struct KernelTraits {
  using Elem = Elem_;
  static constexpr int kColSplit = kColSplit_;  // warps sharing a 16-row strip (dK/dV kernel)
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static_assert(kBlockM_ <= kMaxBlockRows, "kMaxBlockRows: the largest query tile");
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = 32 * kNWarps_;
  // 16-row strips per warp (forward, row-entropy and dQ kernels; the dK/dV kernel has its own
  // strip arithmetic)
  static constexpr int kMS = kBlockM_ / (16 * kNWarps_) > 0 ? kBlockM_ / (16 * kNWarps_) : 1;
  static constexpr int kStride = smem_row(kHeadDim_);  // shared-memory row stride, elements
  static_assert(kHeadDim % 16 == 0, "head dim must be a multiple of 16");
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "tiles are made of 16x16 mma blocks");
};

template <int D, typename T>
using FwdTraits = KernelTraits<D, fwd_block_m(D), fwd_block_n(D), fwd_warps(D), T>;
template <int D, typename T>
using DqTraits = KernelTraits<D, dq_block_m(D), dq_block_n(D), dq_warps(D), T>;
template <int D, typename T>
using DkdvTraits = KernelTraits<D, dkdv_block_m(D), dkdv_block_n(D), dkdv_warps(D), T, dkdv_col_split(D)>;
// sm_75 runs the float16 dK/dV kernels at D = 96 and 128 with two warps per key strip
// (kSplit = 2, 8 warps): with one, they spill there (sm_75's m16n8k8 pairs and synchronous
// copies; 16 to 180 bytes); launch_impl.h picks this by architecture, and other architectures
// never run it.
template <int D, typename T>
using DkdvTraitsSm75 = KernelTraits<D, dkdv_block_m(D), dkdv_block_n(D), dkdv_block_n(D) / 16 * 2, T, 2>;
// Warps per key strip of the dK/dV kernel that runs on architecture `arch` (100 major + 10 minor).
constexpr int dkdv_split_for(int d, bool bf16, int arch) {
  return arch >= 750 && arch < 800 && !bf16 && (d == 96 || d == 128) ? 2 : dkdv_col_split(d);
}

// The fused backward (attn_bwd_fused_kernel: five GEMMs per tile, dQ by fp32 atomics) runs
// where ptxas compiles it without spilling: head dims up to 128 (64 on sm_70) where the split of
// the architecture is one warp per key strip, any variant, except SSA at D = 64 on sm_75 (4
// bytes; `sm75_spills`: the score function's kFusedSpillsSm75, logits.h). At D = 96 / 128 the dK / dV accumulators (2 D / 4 registers per thread) leave room for
// the dQ GEMM's accumulators of one chunk of columns at a time (32 at D = 128, 16 at D = 96;
// bwd_kernel.h); on sm_70 it spilled 8 to 88 bytes there. At D = 256 (two warps per key strip)
// the two-kernel path runs, and wherever the caller asks for a deterministic backward.
constexpr bool bwd_fused_for(int d, bool sm75_spills, bool bf16, int arch) {
  return d <= (arch < 750 ? 64 : 128) && dkdv_split_for(d, bf16, arch) == 1 &&
         !(sm75_spills && d > 32 && arch >= 750 && arch < 800);
}
// Shared memory of the fused kernel: the dK/dV kernel's and dS^T (BN x (BM + 8)); on sm_70 the
// gemm_rn scratch serves the dQ GEMM too (reduction size BN).
// Queries per step of the fused kernel (as the dK/dV kernel's)
constexpr int fused_block_m(int d) { return dkdv_block_m(d); }
constexpr int bwd_fused_smem_bytes(int d, int elem_bytes, bool adaptive, int path = kPathSm80) {
  return max_int((2 * dkdv_block_n(d) + 3 * fused_block_m(d)) * smem_row(d) * elem_bytes,
                 path == kPathSm90 && bwd_wgmma(d)
                     ? 2 * sw128_tile_bytes(dkdv_block_n(d), d) + 3 * sw128_tile_bytes(fused_block_m(d), d) + 1024
                     : 0) +
         2 * dkdv_stat_count(adaptive) * fused_block_m(d) * 4 +
         dkdv_block_n(d) * (fused_block_m(d) + 8) * elem_bytes +
         (path == kPathSm70 ? sm70_scratch_bytes(dkdv_warps(d), 1,
                                                 dkdv_block_n(d) > fused_block_m(d) ? dkdv_block_n(d) : fused_block_m(d),
                                                 elem_bytes)
                            : 0) +
         key_block_drop_bytes(d);
}
// Shared memory of the fused backward's pre-pass (the dQ kernel with kPrep): delta only needs the
// dO tile (after the unused Q tile); the adaptive dbeta pass needs the dQ kernel's tiles.
constexpr int bwd_prep_smem_bytes(int d, int elem_bytes, bool adaptive, int path = kPathSm80) {
  return adaptive ? dq_smem_bytes(d, elem_bytes, path)
                  : max_int(2 * dq_block_m(d) * smem_row(d) * elem_bytes,
                            path == kPathSm90 && dq_wgmma(d) ? 2 * sw128_tile_bytes(dq_block_m(d), d) + 1024 : 0);
}

template <int D, typename T>
using FusedTraits = KernelTraits<D, fused_block_m(D), dkdv_block_n(D), dkdv_warps(D), T, dkdv_col_split(D)>;

}  // namespace ssa_flash
