// The host side's tensor maps of the sm_90a warp-specialised forward: encoded once per shape
// and kept (TmaMapCache), the driver's entry points obtained without linking libcuda, and the
// run-time switch that lets a build holding the kernel use it or not (hopper_fwd_enabled).
// No torch here.
//
// Key: the operand (q, k or v) and everything its map encodes except the global address (element type, rank, dims, byte
// strides, box, swizzle). The address is patched on a hit (cuTensorMapReplaceAddress, a
// documented driver call that rewrites only the address field) rather than keyed: a model's layers
// call with the same shapes on different tensors, so an address-keyed cache of bounded size would
// miss on every layer and re-encode, while the shape key keeps one entry per (shape, operand) and
// pays one host-side patch. Bounded: kTmaCacheEntries, replaced round-robin; a mutex guards it
// (autograd may call from several threads).
//
// No host-device synchronisation: encoding and patching write a 128-byte host struct; the maps
// travel to the kernel as a `const __grid_constant__` parameter (HopperFwdParams, by value in
// parameter space). CUDA graphs: a captured launch records its parameters by value, so a graph
// replays the maps of the tensors it captured (as every captured kernel replays its pointers);
// the cache's later patches do not reach a captured graph.
//
// Only the CPU emulation has run this code (tests/cuda/test_hopper_fwd_emulated.py counts the
// cache's hits, misses and patches there); the driver calls have not run on a device.
#pragma once

#ifndef SSA_FLASH_EMULATE
#include <cuda.h>
#include <cuda_runtime.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "../pipeline.h"

namespace ssa_flash {
namespace hopper {

// ---- run-time switch ------------------------------------------------------------------------
// Whether a build holding the kernel (SSA_FLASH_HOPPER_FWD=1 at compile time) uses it: the
// environment variable SSA_FLASH_HOPPER_FWD ("1" on, anything else or unset off), read once at the
// first call; set_hopper_fwd_enabled overrides it (the bench and the device tests compare both
// kernels in one process; the extension exposes it as set_hopper_fwd).
inline std::atomic<int>& hopper_fwd_state() {
  static std::atomic<int> state{-1};  // -1: not read yet, 0 off, 1 on
  return state;
}

// A switch `state` (-1 not read yet, 0 off, 1 on) read from the environment variable `name` ("1"
// on) at its first use unless set before. (The backward's, SSA_FLASH_HOPPER_BWD: bwd_launch.h.)
inline bool env_switch_on(std::atomic<int>& state, const char* name) {
  int s = state.load(std::memory_order_relaxed);
  if (s < 0) {
    const char* e = std::getenv(name);
    int from_env = e != nullptr && std::strcmp(e, "1") == 0 ? 1 : 0;
    int expected = -1;
    state.compare_exchange_strong(expected, from_env);
    s = state.load(std::memory_order_relaxed);
  }
  return s == 1;
}

inline bool hopper_fwd_enabled() { return env_switch_on(hopper_fwd_state(), "SSA_FLASH_HOPPER_FWD"); }

inline void set_hopper_fwd_enabled(bool on) { hopper_fwd_state().store(on ? 1 : 0); }

// The MUFU budget of the sweep (fwd_launch.h, SSA_FLASH_HOPPER_MUFU_SWEEP): eighths of the
// interior blocks' ex2 and lg2 on the FMA pipe, as 8 * ex2 + lg2; 0 (all on MUFU, the shipped
// instances) unless set (the extension's hopper_fwd(mufu=...)).
inline std::atomic<int>& hopper_mufu_budget() {
  static std::atomic<int> budget{0};
  return budget;
}

// ---- the driver's entry points --------------------------------------------------------------
#ifndef SSA_FLASH_EMULATE
struct TmaDriver {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  using ReplaceAddress = CUresult (*)(CUtensorMap*, void*);
  Encode encode = nullptr;
  ReplaceAddress replace_address = nullptr;
  std::string error;  // why not, when either is null
};

// Through the runtime (cudaGetDriverEntryPointByVersion from CUDA 12.5, cudaGetDriverEntryPoint
// before), so the extension does not link libcuda; looked up once.
inline const TmaDriver& tma_driver() {
  static const TmaDriver d = [] {
    TmaDriver t;
    auto get = [&t](const char* name, void** fn) {
      cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
      const cudaError_t err = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
#else
      const cudaError_t err = cudaGetDriverEntryPoint(name, fn, cudaEnableDefault, &q);
#endif
      if (err != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == nullptr) {
        *fn = nullptr;
        if (t.error.empty())
          t.error = std::string(name) + " is not available from the CUDA driver (" +
                    (err != cudaSuccess ? cudaGetErrorString(err) : "entry point not found") +
                    "): the sm_90a forward needs a CUDA 12 driver; unset SSA_FLASH_HOPPER_FWD to use today's kernel";
      }
    };
    void* fn = nullptr;
    get("cuTensorMapEncodeTiled", &fn);
    t.encode = reinterpret_cast<TmaDriver::Encode>(fn);
    fn = nullptr;
    get("cuTensorMapReplaceAddress", &fn);
    t.replace_address = reinterpret_cast<TmaDriver::ReplaceAddress>(fn);
    return t;
  }();
  return d;
}
#endif

// ---- encoding one map -----------------------------------------------------------------------
// 16-bit elements (bf16 or float16) or, spec.elem_bytes 4, float32. In the CPU emulation TmaDesc is
// the spec itself (pipeline.h).
inline std::string encode_tma(const TmaTileSpec& spec, bool bf16, TmaDesc* out) {
#ifdef SSA_FLASH_EMULATE
  (void)bf16;
  *out = spec;
  return std::string();
#else
  const TmaDriver& drv = tma_driver();
  if (drv.encode == nullptr) return drv.error;
  cuuint64_t dims[kTmaMaxRank], strides[kTmaMaxRank];
  cuuint32_t box[kTmaMaxRank], elem_strides[kTmaMaxRank];
  for (int i = 0; i < spec.rank; ++i) {
    dims[i] = static_cast<cuuint64_t>(spec.dims[i]);
    strides[i] = static_cast<cuuint64_t>(spec.strides[i]);
    box[i] = static_cast<cuuint32_t>(spec.box[i]);
    elem_strides[i] = 1;
  }
  // (4-byte elements: the backward's float32 row statistics)
  const CUtensorMapDataType type = spec.elem_bytes == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : bf16               ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = drv.encode(out, type,
                                static_cast<cuuint32_t>(spec.rank), const_cast<void*>(spec.base), dims, strides + 1,
                                box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                spec.swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return "cuTensorMapEncodeTiled failed (error " + std::to_string(static_cast<int>(r)) + ")";
  return std::string();
#endif
}

// A map's address replaced (the rest as encoded).
inline std::string patch_tma_address(TmaDesc* map, const void* base) {
#ifdef SSA_FLASH_EMULATE
  map->base = base;
  return std::string();
#else
  const TmaDriver& drv = tma_driver();
  if (drv.replace_address == nullptr) return drv.error;
  const CUresult r = drv.replace_address(map, const_cast<void*>(base));
  if (r != CUDA_SUCCESS) return "cuTensorMapReplaceAddress failed (error " + std::to_string(static_cast<int>(r)) + ")";
  return std::string();
#endif
}

// ---- the cache ------------------------------------------------------------------------------
// a forward's 4 maps (q, k, v, o; the row-entropy pass's 2 more) and a backward's 5: two adaptive
// (shape, dtype) training steps before any replacement
constexpr int kTmaCacheEntries = 32;

struct TmaCacheStats {
  long hits = 0;     // a map found (its address patched or already right)
  long misses = 0;   // a map encoded
  long patches = 0;  // hits whose address was replaced
};

class TmaMapCache {
 public:
  // The map of `spec` (element type bf16 or float16, or float32 for 4-byte elements) for operand
  // `role` (the forward's 0 q, 1 k, 2 v, 3 o; the backward's: bwd_launch.h, BwdMapRole; K and V
  // maps of the same layout are kept apart, so that a call patches neither when its tensors are
  // those of the last call) into *out: from the cache, its address patched where it differs, or
  // encoded and kept. An error message, or "".
  std::string get(int role, const TmaTileSpec& spec, bool bf16, TmaDesc* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int i = 0; i < used_; ++i) {
      Entry& e = entries_[i];
      if (e.role != role || e.bf16 != bf16 || !same_layout(e.spec, spec)) continue;
      ++stats_.hits;
      if (e.spec.base != spec.base) {
        const std::string err = patch_tma_address(&e.map, spec.base);
        if (!err.empty()) return err;
        e.spec.base = spec.base;
        ++stats_.patches;
      }
      *out = e.map;
      return std::string();
    }
    ++stats_.misses;
    Entry fresh;
    fresh.spec = spec;
    fresh.bf16 = bf16;
    fresh.role = role;
    const std::string err = encode_tma(spec, bf16, &fresh.map);
    if (!err.empty()) return err;  // nothing kept
    const int slot = used_ < kTmaCacheEntries ? used_++ : (next_++ % kTmaCacheEntries);
    entries_[slot] = fresh;
    *out = fresh.map;
    return std::string();
  }

  TmaCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  int size() {
    std::lock_guard<std::mutex> lock(mutex_);
    return used_;
  }
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    used_ = 0;
    next_ = 0;
    stats_ = TmaCacheStats{};
  }

 private:
  struct Entry {
    TmaTileSpec spec{};
    bool bf16 = false;
    int role = 0;
    TmaDesc map{};
  };

  // every field the map encodes but the address
  static bool same_layout(const TmaTileSpec& a, const TmaTileSpec& b) {
    if (a.rank != b.rank || a.elem_bytes != b.elem_bytes || a.swizzle_bytes != b.swizzle_bytes) return false;
    for (int i = 0; i < a.rank; ++i)
      if (a.dims[i] != b.dims[i] || a.strides[i] != b.strides[i] || a.box[i] != b.box[i]) return false;
    return true;
  }

  std::mutex mutex_;
  Entry entries_[kTmaCacheEntries];
  int used_ = 0;
  long next_ = 0;
  TmaCacheStats stats_;
};

// The process's cache (one for every device: a tensor map holds no device handle).
inline TmaMapCache& tma_cache() {
  static TmaMapCache cache;
  return cache;
}

}  // namespace hopper
}  // namespace ssa_flash
