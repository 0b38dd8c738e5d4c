// The launch of one kernel (host side, no torch): the device's architecture and shared-memory
// limit, the checks before a launch, the launch itself (or, in the CPU emulation, csrc/emu's).
// Used by launch_impl.h and by the sm_90a kernels' launchers (csrc/hopper/).
#pragma once

#ifndef SSA_FLASH_EMULATE
#include <cuda_runtime.h>
#endif

#include <string>

#include "dispatch.h"
#include "elem.h"

// SSA_FLASH_HOPPER_FWD (default 0): the build holds the sm_90a warp-specialised kernels
// (csrc/hopper/), forward and backward: launch_impl.h's run_fwd dispatches to the forward where
// hopper::fwd_ws_declines takes the call, plan_bwd_call to the backward where
// hopper::hopper_bwd_declines does; each includes its run-time switch (hopper/tma_cache.h
// hopper_fwd_enabled, hopper/bwd_launch.h hopper_bwd_enabled: off unless switched on). Build systems set it for sm_90a builds with SSA_FLASH_BUILD_HOPPER_FWD=1
// (ssa_flash/backends/_cuda_build.py, hopper_fwd_flags).
#ifndef SSA_FLASH_HOPPER_FWD
#define SSA_FLASH_HOPPER_FWD 0
#endif

namespace ssa_flash {
namespace detail {

inline std::string cuda_error(const char* what, cudaError_t err) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

// The current device's architecture (major * 100 + minor * 10) and opt-in shared memory per
// block; an error message, or an empty string.
inline std::string device_info(int& arch, int& max_optin) {
#ifdef SSA_FLASH_EMULATE
#if defined(SSA_FLASH_EMULATE_SM70)
  arch = 700;
#elif defined(SSA_FLASH_EMULATE_SM75)
  arch = 750;
#elif defined(SSA_FLASH_EMULATE_SM90)
  arch = 900;
#else
  arch = 800;
#endif
  max_optin = 256 * 1024;
  return std::string();
#else
  int dev = 0, major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err != cudaSuccess) return cuda_error("querying the device", err);
  arch = major * 100 + minor * 10;
  return std::string();
#endif
}

// Checks the device can run element type T and `smem` bytes of dynamic shared memory, raises the
// kernel's shared-memory limit when above the 48 KiB default, launches.
template <typename T, typename Params>
std::string launch(void (*kernel)(const Params), const char* name, dim3 grid, int threads,
                   int smem, cudaStream_t stream, const Params& p) {
  if (kernel == nullptr) {  // dispatch.h: an instance this build leaves out (SSA_FLASH_EXTRAS)
    return std::string(name) + ": this build has no kernel for these options (built with SSA_FLASH_EXTRAS=" +
           std::to_string(SSA_FLASH_EXTRAS) + ")";
  }
#ifdef SSA_FLASH_EMULATE
  (void)stream;
  return ssa_emu::launch(kernel, name, grid, threads, smem, p);  // csrc/emu: CPU emulation
#else
  int arch = 0, max_optin = 0;
  std::string why = device_info(arch, max_optin);
  if (!why.empty()) return why;
  if (arch < ElemInfo<T>::kMinArch) {
    return std::string(ElemInfo<T>::kIsBF16 ? "bfloat16" : "float16") + " kernels need sm_" +
           std::to_string(ElemInfo<T>::kMinArch / 10) + " or newer, this device is sm_" +
           std::to_string(arch / 10);
  }
  if (grid.y > 65535 || grid.z > 65535) {
    return std::string(name) + ": heads and batch must each be at most 65535";
  }
  if (smem > max_optin) {
    return std::string(name) + ": the tile needs " + std::to_string(smem) +
           " bytes of shared memory per block, this device allows " + std::to_string(max_optin) +
           " (see docs/cuda.md, tile sizes)";
  }
  cudaError_t err;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return cuda_error(name, err);
  }
  kernel<<<grid, threads, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return cuda_error(name, err);
  return std::string();
#endif
}

}  // namespace detail
}  // namespace ssa_flash
