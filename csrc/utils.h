// Warp-level building blocks: cp.async, ldmatrix, mma.sync (m16n8k16 / m16n8k8 / m8n8k4, f32
// accumulate), fast exp2/log2, and the fragment layouts they imply. No torch here.
//
// Fragment layouts of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// lane = threadIdx.x % 32, g = lane / 4 (group), t = lane % 4 (thread in group):
//   A (16x16, row-major), 4 x b32 (two 16-bit elements each, lower column in the low half):
//       a0: (g,   2t..2t+1)   a1: (g+8, 2t..2t+1)   a2: (g, 2t+8..2t+9)   a3: (g+8, 2t+8..2t+9)
//   B (16x8, k x n), 2 x b32: b0: (k = 2t..2t+1, n = g)   b1: (k = 2t+8..2t+9, n = g)
//   C/D (16x8, f32): c0, c1: (g, 2t..2t+1)   c2, c3: (g+8, 2t..2t+1)
// So the accumulators of two adjacent n8 tiles of a 16-row strip, rounded to 16 bits, are exactly
// the A fragment of a 16x16 block: the softmax P (and dS) never leave registers (FlashAttention-2).
//
// sm_70 (Volta) has only mma.m8n8k4, a quad-pair instruction (see tile.h for how a 16-row strip
// is tiled with it); its accumulators follow another layout (struct Frag below), and P / dS go
// through a small per-warp shared-memory buffer between the two GEMMs instead of registers.
#pragma once

#include "int_types.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "ssa_flash CUDA kernels need sm_70 or newer (mma.sync); see docs/cuda.md"
#endif

// The Volta code path: mma.m8n8k4, plain shared-memory loads (no ldmatrix, no cp.async).
#if defined(SSA_FLASH_EMULATE_SM70) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750)
#define SSA_FLASH_SM70 1
#else
#define SSA_FLASH_SM70 0
#endif

// cp.async (sm_80+): copies land in shared memory without passing through registers, so kernels
// issue the next tile's loads early to overlap them with compute. Without it (sm_70, sm_75, and
// their emulations) a copy is a load into registers and a store, and loads issued early hold
// registers across the GEMMs (the dK/dV kernel spilled): kernels then issue them late.
#if defined(SSA_FLASH_EMULATE_SM70) || defined(SSA_FLASH_EMULATE_SM75) || \
    (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
#define SSA_FLASH_ASYNC_COPIES 0
#else
#define SSA_FLASH_ASYNC_COPIES 1
#endif

// The Hopper code path (sm_90a, not plain sm_90): wgmma, the asynchronous warpgroup MMA, with
// operands read from shared memory through matrix descriptors (tile.h, Sw128Tile). Used by the
// kernels that say so (bwd_kernel.h, dq_wgmma); elsewhere sm_90 runs the sm_80 code.
#if defined(SSA_FLASH_EMULATE_SM90) || (defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
#define SSA_FLASH_WGMMA 1
#else
#define SSA_FLASH_WGMMA 0
#endif

#ifdef SSA_FLASH_EMULATE
// CPU emulation of the CUDA execution model for testing without a GPU (csrc/emu/).
#include "emu/emu_runtime.h"
#define SSA_DEVICE inline
#else
#define SSA_DEVICE __device__ __forceinline__
#endif

namespace ssa_flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ------------------------------------------------------------------------------------------
// Element types

template <typename T>
struct ElemInfo;

template <>
struct ElemInfo<__half> {
  static constexpr bool kIsBF16 = false;
  static constexpr int kMinArch = 700;
};

template <>
struct ElemInfo<__nv_bfloat16> {
  static constexpr bool kIsBF16 = true;
  static constexpr int kMinArch = 800;
};

// Kernels the host never launches on the architecture being compiled: bfloat16 below sm_80, and
// head dims above 128 on sm_75 (their tiles exceed its 64 KiB of shared memory; launch_impl.h
// refuses them). Their bodies become a trap: less code, and no register pressure (spills) from
// code that cannot run.
template <typename T, int kHeadDim>
SSA_DEVICE constexpr bool kernel_unsupported() {
#if defined(__CUDA_ARCH__)
  return ElemInfo<T>::kMinArch > __CUDA_ARCH__ || (kHeadDim > 128 && __CUDA_ARCH__ >= 750 && __CUDA_ARCH__ < 800);
#else
  return false;
#endif
}

// Two floats rounded to the 16-bit type, packed into one b32 register (first in the low half).
template <typename T>
SSA_DEVICE uint32_t pack2(float lo, float hi);

template <>
SSA_DEVICE uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
SSA_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
SSA_DEVICE float2 unpack2(uint32_t v);

template <>
SSA_DEVICE float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}

template <>
SSA_DEVICE float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}

#ifdef SSA_FLASH_EMULATE
using ssa_emu::cp_async_16;
using ssa_emu::cp_async_commit;
using ssa_emu::cp_async_wait;
using ssa_emu::ex2;
using ssa_emu::ldmatrix_x4;
using ssa_emu::ldmatrix_x4_trans;
using ssa_emu::lg2;
using ssa_emu::rcp;
using ssa_emu::mma_1688_f16;
using ssa_emu::mma_884;
using ssa_emu::smem_u32;
using ssa_emu::syncwarp;
using ssa_emu::fence_proxy_async;
using ssa_emu::wgmma_commit;
using ssa_emu::wgmma_fence;
using ssa_emu::wgmma_fence_operand;
using ssa_emu::wgmma_rs_tb;
using ssa_emu::wgmma_ss;
using ssa_emu::wgmma_wait;
#else
// ------------------------------------------------------------------------------------------
// Fast math: base-2 exponential and logarithm (MUFU). ex2(-inf) = +0, lg2(0) = -inf.

SSA_DEVICE float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

SSA_DEVICE float lg2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

SSA_DEVICE float rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif  // SSA_FLASH_EMULATE

// x with its sign flipped where s is negative: sgn(s) * x in one LOP3 (also for s = -0, whose
// x is 0 in every use here).
SSA_DEVICE float xor_sign(float x, float s) {
  return __int_as_float(__float_as_int(x) ^ (__float_as_int(s) & 0x80000000));
}

SSA_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// A running row max with -inf (nothing admissible yet) replaced by 0, so that ex2(l - m) is 0
// instead of NaN for -inf logits.
SSA_DEVICE float safe_max(float m) { return m == neg_inf() ? 0.0f : m; }

// ------------------------------------------------------------------------------------------
// Dropout bits: Philox4x32-10 (Random123's philox4x32_R(10), cuRAND's Philox4_32_10), the
// generator of the Triton kernels and of ssa_flash.reference.dropout_keep_mask, so a (seed,
// offset) gives every backend the same mask. Weight (b, h, i, j) (query i, key j) is kept iff
// word bit3(i) + 2 bit0(j) of Philox under the key (seed low, seed high) and the counter
// (j / 2, (i / 16) 8 + i % 8, h, (b + offset) mod 2^32) is below keep_below: one evaluation
// serves {i, i + 8} x {j, j + 1}, which on the m16n8 layouts is exactly one thread's 4
// accumulators of an n8 tile (rows g and g + 8, columns 2t and 2t + 1).

struct DropCtx {
  uint32_t k0, k1;  // the seed
  uint32_t head, batch;  // counter words 2 and 3 (batch: b + offset)
  uint32_t keep_below;
};

SSA_DEVICE DropCtx make_drop_ctx(const int64_t* rng, uint32_t keep_below, int batch, int head) {
  const uint64_t seed = static_cast<uint64_t>(rng[0]);
  DropCtx d;
  d.k0 = static_cast<uint32_t>(seed);
  d.k1 = static_cast<uint32_t>(seed >> 32);
  d.head = static_cast<uint32_t>(head);
  d.batch = static_cast<uint32_t>(static_cast<uint64_t>(batch) + static_cast<uint64_t>(rng[1]));
  d.keep_below = keep_below;
  return d;
}

// Keep bits of (i0 + 8 u, j0 + s), bit u + 2 s, for i0 = i with bit 3 cleared and j0 = j rounded
// down to even: one Philox evaluation (10 rounds of two 32 x 32 -> 64-bit products).
SSA_DEVICE uint32_t drop_bits(const DropCtx& d, int i, int j) {
  uint32_t c0 = static_cast<uint32_t>(j) >> 1, c1 = ((static_cast<uint32_t>(i) >> 4) << 3) + (static_cast<uint32_t>(i) & 7u);
  uint32_t c2 = d.head, c3 = d.batch, k0 = d.k0, k1 = d.k1;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(c0) * 0xD2511F53u, p1 = static_cast<uint64_t>(c2) * 0xCD9E8D57u;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return static_cast<uint32_t>(c0 < d.keep_below) | (static_cast<uint32_t>(c1 < d.keep_below) << 1) |
         (static_cast<uint32_t>(c2 < d.keep_below) << 2) | (static_cast<uint32_t>(c3 < d.keep_below) << 3);
}

// Whether weight (i, j) is kept, from drop_bits of its pair.
SSA_DEVICE bool drop_kept(uint32_t bits, int i, int j) { return (bits >> (((i >> 3) & 1) + 2 * (j & 1))) & 1u; }

// ------------------------------------------------------------------------------------------
// Where the accumulators of a 16-row strip live. A strip of N columns is held as float[N / 8][4];
// element (nt, i) of lane `lane` is at
//     row = Frag::row(lane) + Frag::kHi * (i / 2),   col = Frag::col(lane, nt) + (i % 2),
// so every thread holds two rows, in pairs of adjacent columns (one packed b32 operand each).
// The four lanes holding the same rows differ in the bits kRowLanes0 and kRowLanes1;
// Frag::rank(lane) numbers them 0..3.
struct Frag {
#if SSA_FLASH_SM70
  // mma.m8n8k4: quad pair q = (lane / 4) % 4 owns rows 8 (q % 2) .. +8 and the n8 tiles of
  // parity q / 2 (tile.h); inside its 8x8 tile lane (t = lane % 4, h = lane / 16) holds
  // rows t % 2 + 2 v1 + 4 h, columns 2 (t / 2) + v0 + 4 v2 (PTX ISA, m8n8k4 f32 accumulators)
  // as element (tile 2p + v2, i = v0 + 2 v1).
  static constexpr int kHi = 2;
  static constexpr int kRowLanes0 = 2, kRowLanes1 = 8;
  static SSA_DEVICE int row(int lane) { return (lane & 1) + 4 * (lane >> 4) + 8 * ((lane >> 2) & 1); }
  static SSA_DEVICE int col(int lane, int nt) {
    return 8 * (nt & ~1) + 8 * ((lane >> 3) & 1) + 4 * (nt & 1) + 2 * ((lane >> 1) & 1);
  }
  static SSA_DEVICE int rank(int lane) { return ((lane >> 1) & 1) | (((lane >> 3) & 1) << 1); }
#else
  static constexpr int kHi = 8;
  static constexpr int kRowLanes0 = 1, kRowLanes1 = 2;
  static SSA_DEVICE int row(int lane) { return lane >> 2; }
  static SSA_DEVICE int col(int lane, int nt) { return 8 * nt + 2 * (lane & 3); }
  static SSA_DEVICE int rank(int lane) { return lane & 3; }
#endif
};

// Reductions over the 4 lanes that hold the same accumulator rows.
SSA_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes0);
  x += __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes1);
  return x;
}

SSA_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes0));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, Frag::kRowLanes1));
  return x;
}

SSA_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Adds (a, b) to two adjacent floats of global memory (8-byte aligned) atomically, without a
// return value: one vector reduction (red.global.add.v2.f32) on sm_90, two scalar ones below.
// Inline PTX because atomicAdd on a generic pointer checks the address space first (a branch
// around every add in the SASS).
#ifdef SSA_FLASH_EMULATE
SSA_DEVICE void red_add2(float* addr, float a, float b) {
  atomicAdd(addr, a);
  atomicAdd(addr + 1, b);
}
#else
SSA_DEVICE void red_add2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(addr), "f"(a), "f"(b) : "memory");
#else
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(addr), "f"(a) : "memory");
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(addr + 1), "f"(b) : "memory");
#endif
}
#endif

#ifndef SSA_FLASH_EMULATE
// ------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+; plain 16-byte loads and stores on sm_75).

SSA_DEVICE uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes, or writes 16 zero bytes when !pred (gmem must still be a valid address).
SSA_DEVICE void cp_async_16(void* smem, const void* gmem, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(src_bytes));
#else
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (pred) v = __ldg(reinterpret_cast<const uint4*>(gmem));
  *reinterpret_cast<uint4*>(smem) = v;
#endif
}

SSA_DEVICE void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
SSA_DEVICE void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ------------------------------------------------------------------------------------------
// ldmatrix: four 8x8 16-bit matrices; lanes 8i..8i+7 give the row addresses of matrix i.

SSA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(addr)));
}

SSA_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(addr)));
}

// ------------------------------------------------------------------------------------------
// mma.sync m16n8k8 (f16), the only f16 shape of sm_75 besides m8n8k4.

SSA_DEVICE void mma_1688_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// ------------------------------------------------------------------------------------------
// mma.sync m8n8k4 (sm_70), f16 inputs, f32 accumulators, in place. A warp computes four
// independent 8x8x4 products, one per quad pair (lanes 4q..4q+3 and 16+4q..16+4q+3). In each,
// lane (t = lane % 4, h = lane / 16) gives A row t + 4h, k = 0..3 (a0: k 0-1, a1: k 2-3) and B
// column t + 4h, k = 0..3 (".col" B, k contiguous: b0 k 0-1, b1 k 2-3) or B row k = t, columns
// 4h..4h+3 (".row" B, n contiguous: b0 n 4h..4h+1, b1 n 4h+2..4h+3); it receives the
// accumulators c[v], v = v0 + 2 v1 + 4 v2, at row t % 2 + 2 v1 + 4 h, column 2 (t / 2) + v0 + 4 v2
// (PTX ISA, "Matrix fragments for mma.m8n8k4"): c[0..3] in c_lo, c[4..7] in c_hi.
template <bool kRowB>
SSA_DEVICE void mma_884(float (&c_lo)[4], float (&c_hi)[4], uint32_t a0, uint32_t a1, uint32_t b0,
                        uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 750
  if constexpr (kRowB) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11}, {%0, %1, %2, %3, %4, %5, %6, %7};\n"
        : "+f"(c_lo[0]), "+f"(c_lo[1]), "+f"(c_lo[2]), "+f"(c_lo[3]), "+f"(c_hi[0]), "+f"(c_hi[1]),
          "+f"(c_hi[2]), "+f"(c_hi[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11}, {%0, %1, %2, %3, %4, %5, %6, %7};\n"
        : "+f"(c_lo[0]), "+f"(c_lo[1]), "+f"(c_lo[2]), "+f"(c_lo[3]), "+f"(c_hi[0]), "+f"(c_hi[1]),
          "+f"(c_hi[2]), "+f"(c_hi[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
  }
#else
  // only the sm_70 code path (tile.h) calls this, and only in sm_70 device code
  (void)c_lo; (void)c_hi; (void)a0; (void)a1; (void)b0; (void)b1;
  __trap();
#endif
}

SSA_DEVICE void syncwarp() { __syncwarp(); }
#endif  // !SSA_FLASH_EMULATE

// sm_75 (Turing) has m16n8k8 only: the k16 product is two k8 products, (a0, a1) x b0 for
// k = 0..7 and (a2, a3) x b1 for k = 8..15 (the k8 A fragment is {(g, 2t..), (g+8, 2t..)} and
// its B fragment (k = 2t..2t+1, n = g)).
SSA_DEVICE void mma_16816_sm75(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  mma_1688_f16(d, a[0], a[1], b0);
  mma_1688_f16(d, a[2], a[3], b1);
}

// ------------------------------------------------------------------------------------------
// mma.sync m16n8k16, f32 accumulators, in place: d += a * b.

#ifdef SSA_FLASH_EMULATE
template <typename T>
SSA_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef SSA_FLASH_EMULATE_SM75
  if constexpr (!ElemInfo<T>::kIsBF16) {
    mma_16816_sm75(d, a, b0, b1);
    return;
  }
#endif
  ssa_emu::mma_16816<T>(d, a, b0, b1);
}
#else
template <typename T>
SSA_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
SSA_DEVICE void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  mma_16816_sm75(d, a, b0, b1);
#endif
}

template <>
SSA_DEVICE void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  // bf16 tensor cores need sm_80; the host never launches bf16 kernels on older devices.
  __trap();
#endif
}
#endif  // !SSA_FLASH_EMULATE

// ------------------------------------------------------------------------------------------
// wgmma (sm_90a): D (64 x N, f32) = A (64 x 16) * B (16 x N) [+ D], issued by a warpgroup (4
// consecutive warps) and completed asynchronously: issue, commit the group, wait for it.
// Register layouts (PTX ISA, "Matrix fragments for wgmma.m64nNk16"): warp w of the group holds
// rows 16 w .. 16 w + 15, and inside them exactly the mma.m16n8k16 layouts above, so
// accumulators are float[N / 8][4] as struct Frag describes and an A operand in registers is
// the uint32_t[4] of one 16 x 16 block (acc_to_frag). Operands in shared memory are described by
// a 64-bit matrix descriptor; the tiles here use the 128-byte swizzle only (tile.h, Sw128Tile):
//   bits 0-13 start address >> 4, 16-29 leading-dimension byte offset >> 4, 32-45 stride-
//   dimension byte offset >> 4, 49-51 base offset (0: every swizzle atom 1024-byte aligned),
//   62-63 swizzle mode (1: 128 B).
// K-major operand (k contiguous, 64 elements = 128 B per row of m or n): rows 8 apart are SBO
// bytes apart; a k step of 16 elements inside the 128-byte row is +32 bytes on the start address
// (the swizzle is a function of the address bits, 7-9 into 4-6). MN-major operand (n contiguous,
// 64 n per 128-byte row of one k): k rows 8 apart are SBO apart, the next 64 n LBO apart.
// Ordering: shared memory written through the generic proxy (st.shared, cp.async) must be fenced
// (fence_proxy_async) by the writing threads before the barrier after which wgmma reads it; the
// accumulators and the A registers must not be touched between issue and wait (the compiler is
// kept from moving code across with wgmma_fence_operand).

SSA_DEVICE uint64_t wgmma_desc(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t addr = smem_u32(smem);
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// The first 1024-byte aligned address at or after `p` (shared memory; the kernel asks for 1024
// bytes more than its tiles need).
template <typename T>
SSA_DEVICE T* align_smem_1024(void* p) {
  return reinterpret_cast<T*>(static_cast<char*>(p) + ((1024 - (smem_u32(p) & 1023)) & 1023));
}

#ifndef SSA_FLASH_EMULATE
SSA_DEVICE void fence_proxy_async() {
#if SSA_FLASH_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

SSA_DEVICE void wgmma_fence() {
#if SSA_FLASH_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

SSA_DEVICE void wgmma_commit() {
#if SSA_FLASH_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N>
SSA_DEVICE void wgmma_wait() {
#if SSA_FLASH_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// An empty asm that "modifies" each register: the compiler may not move reads or writes of
// them across it (placed after a wait and before an issue).
template <int N>
SSA_DEVICE void wgmma_fence_operand(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}

template <int N>
SSA_DEVICE void wgmma_fence_operand(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}

#define SSA_WG_D1(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define SSA_WG_D4(i) SSA_WG_D1(i), SSA_WG_D1(i + 1), SSA_WG_D1(i + 2), SSA_WG_D1(i + 3)
#define SSA_WG_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SSA_WG_R32                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SSA_WG_R64                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "  \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "   \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "   \
  "%62, %63}"
// "accumulate" is scale-d: 0 gives D = A B (the old D is not read)
#define SSA_WG_SS(N, REGS, TY, IA, IB, IS, ...)                                                    \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                                    \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", %" IA ", %" IB \
               ", p, 1, 1, 0, 0;\n}\n"                                                              \
               : __VA_ARGS__                                                                        \
               : "l"(da), "l"(db), "r"(accumulate))
// A from registers (operands A0..A3), B N-major ("transposed")
#define SSA_WG_RS_TB(N, REGS, TY, A0, A1, A2, A3, IB, IS, ...)                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" IS ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " REGS ", {%" A0 ", %" A1 \
               ", %" A2 ", %" A3 "}, %" IB ", p, 1, 1, 1;\n}\n"                                          \
               : __VA_ARGS__                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate))

// Both operands from shared memory, both K-major: d (64 x N) [+]= A (desc da) * B (desc db).
template <typename T, int N>
SSA_DEVICE void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
  static_assert(N == 32 || N == 64, "wgmma_ss: N = 32 or 64");
#if SSA_FLASH_WGMMA
  if constexpr (N == 32) {
    if constexpr (ElemInfo<T>::kIsBF16) SSA_WG_SS(32, SSA_WG_R16, "bf16", "16", "17", "18", SSA_WG_D4(0));
    else SSA_WG_SS(32, SSA_WG_R16, "f16", "16", "17", "18", SSA_WG_D4(0));
  } else {
    if constexpr (ElemInfo<T>::kIsBF16) SSA_WG_SS(64, SSA_WG_R32, "bf16", "32", "33", "34", SSA_WG_D4(0), SSA_WG_D4(4));
    else SSA_WG_SS(64, SSA_WG_R32, "f16", "32", "33", "34", SSA_WG_D4(0), SSA_WG_D4(4));
  }
#else
  (void)d; (void)da; (void)db; (void)accumulate;
  __trap();
#endif
}

// A from registers (one 16 x 16 block per warp, the mma.m16n8k16 A fragment), B from shared
// memory N-major: d (64 x N) [+]= A * B (desc db).
template <typename T, int N>
SSA_DEVICE void wgmma_rs_tb(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_rs_tb: N = 64 or 128");
#if SSA_FLASH_WGMMA
  if constexpr (N == 64) {
    if constexpr (ElemInfo<T>::kIsBF16)
      SSA_WG_RS_TB(64, SSA_WG_R32, "bf16", "32", "33", "34", "35", "36", "37", SSA_WG_D4(0), SSA_WG_D4(4));
    else SSA_WG_RS_TB(64, SSA_WG_R32, "f16", "32", "33", "34", "35", "36", "37", SSA_WG_D4(0), SSA_WG_D4(4));
  } else {
    if constexpr (ElemInfo<T>::kIsBF16)
      SSA_WG_RS_TB(128, SSA_WG_R64, "bf16", "64", "65", "66", "67", "68", "69", SSA_WG_D4(0), SSA_WG_D4(4),
                   SSA_WG_D4(8), SSA_WG_D4(12));
    else SSA_WG_RS_TB(128, SSA_WG_R64, "f16", "64", "65", "66", "67", "68", "69", SSA_WG_D4(0), SSA_WG_D4(4),
                      SSA_WG_D4(8), SSA_WG_D4(12));
  }
#else
  (void)d; (void)a; (void)db; (void)accumulate;
  __trap();
#endif
}
#undef SSA_WG_D1
#undef SSA_WG_D4
#undef SSA_WG_R16
#undef SSA_WG_R32
#undef SSA_WG_R64
#undef SSA_WG_SS
#undef SSA_WG_RS_TB
#endif  // !SSA_FLASH_EMULATE

}  // namespace ssa_flash
