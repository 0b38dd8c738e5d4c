// The code path each architecture compiles (sm_70: mma.m8n8k4; sm_75: no cp.async; sm_80+;
// sm_90a: wgmma), as preprocessor switches the kernels test with `if constexpr` / `#if`, and
// SSA_DEVICE, the qualifier of every device function (plain `inline` in the CPU emulation,
// csrc/emu, whose runtime this header then includes). No torch here.
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
// operands read from shared memory through matrix descriptors (smem_layout.h, Sw128Tile). Used by the
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
