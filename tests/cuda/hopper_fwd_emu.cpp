// The CPU emulation's entry point for the sm_90a warp-specialised forward (csrc/hopper/):
// tests/cuda/test_hopper_fwd_emulated.py builds it with the host compiler (c++ -std=c++17 -shared
// -fPIC -DSSA_FLASH_EMULATE -DSSA_FLASH_EMULATE_SM90 -DSSA_FLASH_HOPPER_FWD=1 -I csrc ...) and
// calls hopper_fwd_run and hopper_row_entropy_run through ctypes.
#ifndef SSA_FLASH_EMULATE
#define SSA_FLASH_EMULATE 1
#endif

#include <cstdint>
#include <string>

#include "fwd_kernel.h"  // today's attn_row_entropy_kernel, the row-entropy pass's comparison
#include "hopper/fwd_launch.h"
#include "traits.h"

namespace {

using namespace ssa_flash;
using namespace ssa_flash::hopper;

// the MUFU budgets the tests run (fast_math.h MufuBudget: eighths of ex2 / lg2 on the FMA pipe)
template <int kI>
using MufuOf = std::conditional_t<kI == 0, MufuAll,
                                  std::conditional_t<kI == 1, MufuBudget<2, 0>,
                                                     std::conditional_t<kI == 2, MufuBudget<0, 2>, MufuBudget<4, 4>>>>;
constexpr int kMufuVariants = 4;

template <typename T, int kD, int kMufu = 1>
std::string run_mufu(int mufu, const FwdParams& p, int score, bool adaptive) {
  if constexpr (kMufu < kMufuVariants) {
    if (mufu != kMufu) return run_mufu<T, kD, kMufu + 1>(mufu, p, score, adaptive);
    if constexpr (kMufu > 0) return run_fwd_ws_hdim<T, kD, MufuOf<kMufu>>(p, score, adaptive, nullptr);
  }
  return "unknown MUFU budget";
}

// a broken variant (FwdFault), softmax only
template <typename T, int kD, int kFault = 1>
std::string run_fault(int fault, const FwdParams& p) {
  if constexpr (kFault < kFaults) {
    if (fault != kFault) return run_fault<T, kD, kFault + 1>(fault, p);
    using Tr = WsFwdTraits<kD, T, MufuAll, kFault>;
    HopperFwdParams hp;
    const std::string err = make_fwd_ws_params<T, Tr>(p, hp);
    if (!err.empty()) return err;
    return detail::launch<T>(&attn_fwd_ws_kernel<Tr, Softmax, false>, "attn_fwd_ws_kernel", fwd_ws_grid<Tr>(p),
                             Tr::kThreads, ws_fwd_smem_bytes<Tr>(), nullptr, hp);
  }
  return "unknown fault";
}

// (the MUFU budgets other than MufuAll and the faults: bfloat16 only, to keep the build short)
template <typename T>
std::string run_typed(int d, int mufu, int fault, const FwdParams& p, int score, bool adaptive) {
  if (mufu == 0 && fault == 0)
    return d == 64 ? run_fwd_ws_hdim<T, 64>(p, score, adaptive, nullptr) : run_fwd_ws_hdim<T, 128>(p, score, adaptive, nullptr);
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    if (fault != 0) return d == 64 ? run_fault<T, 64>(fault, p) : run_fault<T, 128>(fault, p);
    if (!adaptive) return d == 64 ? run_mufu<T, 64>(mufu, p, score, false) : run_mufu<T, 128>(mufu, p, score, false);
  }
  return "MUFU budgets and faults: bfloat16, not adaptive only";
}

// The emulation's mode (lazy copies, the schedule's seed: 0 in order) and the parameters every
// entry point sets: shapes, no mask or window, the score's per-head parameters, q and k with
// element strides s[0..5] = q_sb, q_sh, q_sm, k_*.
FwdParams emulated_params(int lazy, unsigned seed, int batch, int heads, int heads_kv, int len_q, int len_k, int dim,
                          int dim_v, float scale, int causal, const float* param0, const float* param1,
                          const void* q, const void* k, const int64_t* s) {
  ssa_emu::config().lazy_copies = lazy != 0;
  ssa_emu::config().seed = seed;
  ssa_emu::config().shuffle = seed != 0;
  FwdParams p{};
  p.batch = batch;
  p.heads = heads;
  p.heads_kv = heads_kv;
  p.group = heads / heads_kv;
  p.len_q = len_q;
  p.len_k = len_k;
  p.dim = dim;
  p.dim_v = dim_v;
  p.scale = scale;
  p.causal = causal != 0;
  set_band(p, -1, -1);
  p.mask_kind = kMaskNone;
  p.score_param0 = param0;
  p.score_param1 = param1;
  p.q = q;
  p.k = k;
  int64_t* const fields[6] = {&p.q_sb, &p.q_sh, &p.q_sm, &p.k_sb, &p.k_sh, &p.k_sm};
  for (int i = 0; i < 6; ++i) *fields[i] = s[i];
  set_hopper_fwd_enabled(true);  // (the run-time switch: this library always runs the kernels)
  return p;
}

}  // namespace

namespace {

// cu_q null: dense; else a packed batch (FwdParams cu_seqlens_*: `batch` sequences, len_q / len_k
// the longest, the tensors' (1, H, total, D) views' strides)
const char* fwd_run(int bf16, int score, int adaptive, int mufu, int fault, const void* q, const void* k, const void* v,
                    void* o, float* lse, const float* beta, const float* param0, const float* param1, int batch,
                    int heads, int heads_kv, int len_q, int len_k, int dim, int dim_v, float scale, int causal,
                    const int64_t* strides, int lazy, unsigned seed, const int* cu_q, const int* cu_k, int total_q,
                    int total_k) {
  FwdParams p = emulated_params(lazy, seed, batch, heads, heads_kv, len_q, len_k, dim, dim_v, scale, causal, param0,
                                param1, q, k, strides);
  p.v = v;
  p.o = o;
  int64_t* const fields[6] = {&p.v_sb, &p.v_sh, &p.v_sm, &p.o_sb, &p.o_sh, &p.o_sm};
  for (int i = 0; i < 6; ++i) *fields[i] = strides[6 + i];
  p.lse = lse;
  p.beta = adaptive ? beta : nullptr;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.total_q = total_q;
  p.total_k = total_k;
  static std::string err;
  const char* why = fwd_ws_declines(p, 900);
  if (why != nullptr) {
    err = std::string("declined: ") + why;
    return err.c_str();
  }
  const int d = padded_head_dim(dim > dim_v ? dim : dim_v);
  err = bf16 ? run_typed<__nv_bfloat16>(d, mufu, fault, p, score, adaptive != 0)
             : run_typed<__half>(d, mufu, fault, p, score, adaptive != 0);
  return err.c_str();
}

}  // namespace

// Shapes as FwdParams (csrc/params.h): q (B, H, Lq, dim), k (B, Hkv, Lk, dim), v (B, Hkv, Lk,
// dim_v), o (B, H, Lq, dim_v), 16-bit (bf16 != 0: bfloat16), with element strides strides[0..11]
// = q_sb, q_sh, q_sm, k_*, v_*, o_*; lse (B, H, Lq) float; beta (B, H, Lq) or null; param0 / 1 the
// score's per-head parameters (H) or null. Returns "" or the error (a declined call, the
// emulator's report).
extern "C" const char* hopper_fwd_run(int bf16, int score, int adaptive, int mufu, int fault, const void* q,
                                      const void* k, const void* v, void* o, float* lse, const float* beta,
                                      const float* param0, const float* param1, int batch, int heads, int heads_kv,
                                      int len_q, int len_k, int dim, int dim_v, float scale, int causal,
                                      const int64_t* strides, int lazy, unsigned seed) {
  return fwd_run(bf16, score, adaptive, mufu, fault, q, k, v, o, lse, beta, param0, param1, batch, heads, heads_kv,
                 len_q, len_k, dim, dim_v, scale, causal, strides, lazy, seed, nullptr, nullptr, 0, 0);
}

// A packed batch of `batch` sequences: q (total_q, H, dim), k (total_k, Hkv, dim), v, o likewise,
// passed as their (1, H, total, D) views' strides (q_sb etc. unused); cu_q, cu_k int32 (batch + 1);
// len_q, len_k the longest sequences; lse and beta (H, total_q). Otherwise as hopper_fwd_run.
extern "C" const char* hopper_fwd_varlen_run(int bf16, int score, int adaptive, int mufu, int fault, const void* q,
                                             const void* k, const void* v, void* o, float* lse, const float* beta,
                                             const float* param0, const float* param1, int batch, int heads,
                                             int heads_kv, int len_q, int len_k, int dim, int dim_v, float scale,
                                             int causal, const int64_t* strides, int lazy, unsigned seed,
                                             const int* cu_q, const int* cu_k, int total_q, int total_k) {
  return fwd_run(bf16, score, adaptive, mufu, fault, q, k, v, o, lse, beta, param0, param1, batch, heads, heads_kv,
                 len_q, len_k, dim, dim_v, scale, causal, strides, lazy, seed, cu_q, cu_k, total_q, total_k);
}

// The adaptive temperature's row-entropy pass: entropy and lse (B, H, Lq) float of q (B, H, Lq,
// dim), k (B, Hkv, Lk, dim) with element strides strides[0..5] = q_sb, q_sh, q_sm, k_*; todays != 0:
// today's attn_row_entropy_kernel (csrc/fwd_kernel.h, its sm_90a wgmma path; bfloat16 only) instead
// of the warp-specialised one; cu_q non-null: a packed batch as hopper_fwd_varlen_run's (entropy and
// lse (H, total_q); the warp-specialised pass only). Returns "" or the error.
extern "C" const char* hopper_row_entropy_run(int bf16, int score, int todays, const void* q, const void* k,
                                              float* entropy, float* lse, const float* param0, const float* param1,
                                              int batch, int heads, int heads_kv, int len_q, int len_k, int dim,
                                              float scale, int causal, const int64_t* strides, int lazy,
                                              unsigned seed, const int* cu_q, const int* cu_k, int total_q,
                                              int total_k) {
  FwdParams p = emulated_params(lazy, seed, batch, heads, heads_kv, len_q, len_k, dim, dim, scale, causal, param0,
                                param1, q, k, strides);
  p.lse = lse;
  p.entropy = entropy;
  p.cu_seqlens_q = cu_q;
  p.cu_seqlens_k = cu_k;
  p.total_q = total_q;
  p.total_k = total_k;
  static std::string err;
  const int d = padded_head_dim(dim);
  if (todays) {
    if (!bf16 || cu_q != nullptr) return "today's kernel: bfloat16, dense only here";
    auto run = [&](auto D) {
      using Tr = FwdTraits<decltype(D)::value, __nv_bfloat16>;
      auto kernel = score_switch(score, [](auto S) { return &attn_row_entropy_kernel<Tr, decltype(S)>; });
      return detail::launch<__nv_bfloat16>(kernel, "attn_row_entropy_kernel",
                                           dim3((len_q + Tr::kBlockM - 1) / Tr::kBlockM, heads, batch), Tr::kNThreads,
                                           row_entropy_smem_bytes(decltype(D)::value, 2, kPathSm90), nullptr, p);
    };
    err = d == 64 ? run(std::integral_constant<int, 64>()) : run(std::integral_constant<int, 128>());
    return err.c_str();
  }
  const char* why = row_entropy_ws_declines(p, 900);
  if (why != nullptr) {
    err = std::string("declined: ") + why;
    return err.c_str();
  }
  err = bf16 ? run_row_entropy_ws<__nv_bfloat16>(p, score, nullptr) : run_row_entropy_ws<__half>(p, score, nullptr);
  return err.c_str();
}

// fast_math.h's FMA-pipe forms, for their accuracy test
extern "C" float hopper_ex2_poly(float x) { return ssa_flash::ex2_poly(x); }
extern "C" float hopper_lg2_poly(float u) { return ssa_flash::lg2_poly(u); }
