// Forward kernel (FlashAttention-2 style, online rescaling in base-2 log units) and the
// statistics pass of the adaptive temperature (entropy and LSE of softmax(l), QK^T only).
// Mirrors ssa_flash/triton/forward.py and ssa_flash/triton/entropy.py.
//
// Grid (ceil(Lq / BM), H, B); CTA = 4 warps, each owning 16 query rows; the last (under causal
// the heaviest) query blocks are scheduled first.
#pragma once

#include "params.h"
#include "tile.h"
#include "traits.h"
#include "utils.h"

namespace ssa_flash {

// Forward: per row, l2 = (phi(z) + mask) * log2(e), times beta (ADAPTIVE); m = running max,
// l = running sum of 2^(l2 - m) (partial per thread, reduced over the quad at the end),
// acc = running sum of 2^(l2 - m) v. Writes o = acc / l and lse = (m + log2 l) * ln 2 (natural
// log, -inf for rows with no admissible key, whose output is 0).
//
// Pipeline per key block j (K and V single-buffered, each load overlapping a GEMM):
//   issue V_j | wait K_j | S = Q K_j^T, softmax | wait V_j | issue K_{j+1} | O += P V_j
template <typename Tr, bool kSSA, bool kAdaptive>
__global__ void __launch_bounds__(Tr::kNThreads) attn_fwd_kernel(const FwdParams p) {
  using T = typename Tr::Elem;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kD = Tr::kHeadDim;
  constexpr int kS = Tr::kStride;
  constexpr int kNThreads = Tr::kNThreads;
  constexpr int kNT = kBlockN / 8;  // n8 tiles of a score strip
  constexpr int kDT = kD / 8;       // n8 tiles of an output strip

#if defined(__CUDA_ARCH__)
  if (ElemInfo<T>::kMinArch > __CUDA_ARCH__) {
    __trap();
  } else {
#endif
  extern __shared__ uint4 smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kS;
  T* sV = sK + kBlockN * kS;

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y;
  const int bb = blockIdx.z;
  const int hk = h / p.group;
  const int m0 = m_block * kBlockM;

  const T* q = static_cast<const T*>(p.q) + bb * p.q_sb + h * p.q_sh;
  const T* k = static_cast<const T*>(p.k) + bb * p.k_sb + hk * p.k_sh;
  const T* v = static_cast<const T*>(p.v) + bb * p.v_sb + hk * p.v_sh;
  const LogitCtx ctx = make_logit_ctx(p, bb, h, kSSA);
  const int64_t stat0 = (static_cast<int64_t>(bb) * p.heads + h) * p.len_q;

  // this thread's two accumulator rows
  const int r_lo = m0 + warp * 16 + (lane >> 2);
  const int r_hi = r_lo + 8;
  float beta_lo = 1.0f, beta_hi = 1.0f;
  if (kAdaptive) {
    if (r_lo < p.len_q) beta_lo = p.beta[stat0 + r_lo];
    if (r_hi < p.len_q) beta_hi = p.beta[stat0 + r_hi];
  }

  const int n_end = p.causal ? min(p.len_k, m0 + kBlockM) : p.len_k;
  const int num_n = (n_end + kBlockN - 1) / kBlockN;

  load_tile<kBlockM, kD, kS, kNThreads>(sQ, q, p.q_sm, m0, p.len_q, p.dim, tid);
  load_tile<kBlockN, kD, kS, kNThreads>(sK, k, p.k_sm, 0, p.len_k, p.dim, tid);
  cp_async_commit();

  float acc_o[kDT][4];
  zero(acc_o);
  float m_lo = neg_inf(), m_hi = neg_inf();
  float l_lo = 0.0f, l_hi = 0.0f;
  const T* sQw = sQ + warp * 16 * kS;

  for (int j = 0; j < num_n; ++j) {
    const int n0 = j * kBlockN;
    load_tile<kBlockN, kD, kS, kNThreads>(sV, v, p.v_sm, n0, p.len_k, p.dim_v, tid);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K_j have landed
    __syncthreads();

    float s[kNT][4];
    zero(s);
    gemm_nt<T, kBlockN, kD, kS, kS>(s, sQw, sK, lane);

    float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;
        const int col = n0 + nt * 8 + (lane & 3) * 2 + (i & 1);
        float z, phi2;
        float l2 = logit2<kSSA>(ctx, s[nt][i], row, col, z, phi2);
        if (kAdaptive) l2 *= i < 2 ? beta_lo : beta_hi;
        s[nt][i] = l2;
        if (i < 2) mx_lo = fmaxf(mx_lo, l2);
        else mx_hi = fmaxf(mx_hi, l2);
      }
    }
    const float mn_lo = fmaxf(m_lo, quad_max(mx_lo));
    const float mn_hi = fmaxf(m_hi, quad_max(mx_hi));
    const float ms_lo = safe_max(mn_lo), ms_hi = safe_max(mn_hi);
    const float alpha_lo = ex2(m_lo - ms_lo), alpha_hi = ex2(m_hi - ms_hi);
    float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      s[nt][0] = ex2(s[nt][0] - ms_lo);
      s[nt][1] = ex2(s[nt][1] - ms_lo);
      s[nt][2] = ex2(s[nt][2] - ms_hi);
      s[nt][3] = ex2(s[nt][3] - ms_hi);
      sum_lo += s[nt][0] + s[nt][1];
      sum_hi += s[nt][2] + s[nt][3];
    }
    l_lo = l_lo * alpha_lo + sum_lo;
    l_hi = l_hi * alpha_hi + sum_hi;
    m_lo = mn_lo;
    m_hi = mn_hi;
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      acc_o[dt][0] *= alpha_lo;
      acc_o[dt][1] *= alpha_lo;
      acc_o[dt][2] *= alpha_hi;
      acc_o[dt][3] *= alpha_hi;
    }
    uint32_t pa[kBlockN / 16][4];
    acc_to_frag<T, kBlockN>(pa, s);

    cp_async_wait<0>();  // V_j has landed
    __syncthreads();     // and every warp is done with K_j
    if (j + 1 < num_n) {
      load_tile<kBlockN, kD, kS, kNThreads>(sK, k, p.k_sm, n0 + kBlockN, p.len_k, p.dim, tid);
      cp_async_commit();
    }
    gemm_rn<T, kD, kBlockN, kS>(acc_o, pa, sV, lane);
    __syncthreads();  // every warp is done with V_j
  }

  l_lo = quad_sum(l_lo);
  l_hi = quad_sum(l_hi);
  const float inv_lo = l_lo == 0.0f ? 0.0f : 1.0f / l_lo;
  const float inv_hi = l_hi == 0.0f ? 0.0f : 1.0f / l_hi;
  T* o = static_cast<T*>(p.o) + bb * p.o_sb + h * p.o_sh;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    const int col = dt * 8 + (lane & 3) * 2;
    if (col < p.dim_v) {
      if (r_lo < p.len_q)
        *reinterpret_cast<uint32_t*>(o + r_lo * p.o_sm + col) =
            pack2<T>(acc_o[dt][0] * inv_lo, acc_o[dt][1] * inv_lo);
      if (r_hi < p.len_q)
        *reinterpret_cast<uint32_t*>(o + r_hi * p.o_sm + col) =
            pack2<T>(acc_o[dt][2] * inv_hi, acc_o[dt][3] * inv_hi);
    }
  }
  if ((lane & 3) == 0) {
    if (r_lo < p.len_q) p.lse[stat0 + r_lo] = l_lo == 0.0f ? neg_inf() : (m_lo + log2f(l_lo)) * kLn2;
    if (r_hi < p.len_q) p.lse[stat0 + r_hi] = l_hi == 0.0f ? neg_inf() : (m_hi + log2f(l_hi)) * kLn2;
  }
#if defined(__CUDA_ARCH__)
  }
#endif
}

// Statistics pass: per row the running max m, lam = sum 2^(l2 - m) and the centred
// kc = sum 2^(l2 - m) (l2 - m) (base 2), so H = (log2 lam - kc / lam) ln 2 and
// lse = (m + log2 lam) ln 2 without cancellation between m and K / Lam. When m grows to m',
// with a = 2^(m - m'): lam' = a lam, kc' = a (kc + lam (m - m')); both are linear in (lam, kc),
// so per-thread partials rescale the same way and are summed over the quad at the end.
// Writes p.entropy (0 for empty rows) and p.lse (-inf for empty rows).
template <typename Tr, bool kSSA>
__global__ void __launch_bounds__(Tr::kNThreads) attn_stats_kernel(const FwdParams p) {
  using T = typename Tr::Elem;
  constexpr int kBlockM = Tr::kBlockM;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kD = Tr::kHeadDim;
  constexpr int kS = Tr::kStride;
  constexpr int kNThreads = Tr::kNThreads;
  constexpr int kNT = kBlockN / 8;

#if defined(__CUDA_ARCH__)
  if (ElemInfo<T>::kMinArch > __CUDA_ARCH__) {
    __trap();
  } else {
#endif
  extern __shared__ uint4 smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kS;  // two buffers

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y;
  const int bb = blockIdx.z;
  const int hk = h / p.group;
  const int m0 = m_block * kBlockM;

  const T* q = static_cast<const T*>(p.q) + bb * p.q_sb + h * p.q_sh;
  const T* k = static_cast<const T*>(p.k) + bb * p.k_sb + hk * p.k_sh;
  const LogitCtx ctx = make_logit_ctx(p, bb, h, kSSA);
  const int64_t stat0 = (static_cast<int64_t>(bb) * p.heads + h) * p.len_q;
  const int r_lo = m0 + warp * 16 + (lane >> 2);
  const int r_hi = r_lo + 8;

  const int n_end = p.causal ? min(p.len_k, m0 + kBlockM) : p.len_k;
  const int num_n = (n_end + kBlockN - 1) / kBlockN;

  load_tile<kBlockM, kD, kS, kNThreads>(sQ, q, p.q_sm, m0, p.len_q, p.dim, tid);
  load_tile<kBlockN, kD, kS, kNThreads>(sK, k, p.k_sm, 0, p.len_k, p.dim, tid);
  cp_async_commit();

  float m_lo = neg_inf(), m_hi = neg_inf();
  float lam_lo = 0.0f, lam_hi = 0.0f, kc_lo = 0.0f, kc_hi = 0.0f;
  const T* sQw = sQ + warp * 16 * kS;

  for (int j = 0; j < num_n; ++j) {
    const int n0 = j * kBlockN;
    if (j + 1 < num_n) {
      load_tile<kBlockN, kD, kS, kNThreads>(sK + ((j + 1) & 1) * kBlockN * kS, k, p.k_sm,
                                            n0 + kBlockN, p.len_k, p.dim, tid);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    float s[kNT][4];
    zero(s);
    gemm_nt<T, kBlockN, kD, kS, kS>(s, sQw, sK + (j & 1) * kBlockN * kS, lane);

    float mx_lo = neg_inf(), mx_hi = neg_inf();
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? r_lo : r_hi;
        const int col = n0 + nt * 8 + (lane & 3) * 2 + (i & 1);
        float z, phi2;
        const float l2 = logit2<kSSA>(ctx, s[nt][i], row, col, z, phi2);
        s[nt][i] = l2;
        if (i < 2) mx_lo = fmaxf(mx_lo, l2);
        else mx_hi = fmaxf(mx_hi, l2);
      }
    }
    const float mn_lo = fmaxf(m_lo, quad_max(mx_lo));
    const float mn_hi = fmaxf(m_hi, quad_max(mx_hi));
    const float ms_lo = safe_max(mn_lo), ms_hi = safe_max(mn_hi);
    const float sh_lo = m_lo == neg_inf() ? 0.0f : m_lo - ms_lo;  // lam is 0 while m is -inf
    const float sh_hi = m_hi == neg_inf() ? 0.0f : m_hi - ms_hi;
    const float a_lo = ex2(sh_lo), a_hi = ex2(sh_hi);
    kc_lo = a_lo * (kc_lo + lam_lo * sh_lo);
    kc_hi = a_hi * (kc_hi + lam_hi * sh_hi);
    lam_lo *= a_lo;
    lam_hi *= a_hi;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float l2 = s[nt][i];
        const float c = l2 == neg_inf() ? 0.0f : l2 - (i < 2 ? ms_lo : ms_hi);
        const float e = l2 == neg_inf() ? 0.0f : ex2(c);
        if (i < 2) {
          lam_lo += e;
          kc_lo += e * c;
        } else {
          lam_hi += e;
          kc_hi += e * c;
        }
      }
    }
    m_lo = mn_lo;
    m_hi = mn_hi;
    __syncthreads();  // every warp is done with this K buffer before it is refilled
  }

  lam_lo = quad_sum(lam_lo);
  lam_hi = quad_sum(lam_hi);
  kc_lo = quad_sum(kc_lo);
  kc_hi = quad_sum(kc_hi);
  if ((lane & 3) == 0) {
    if (r_lo < p.len_q) {
      const bool empty = lam_lo == 0.0f;
      p.entropy[stat0 + r_lo] = empty ? 0.0f : (log2f(lam_lo) - kc_lo / lam_lo) * kLn2;
      p.lse[stat0 + r_lo] = empty ? neg_inf() : (m_lo + log2f(lam_lo)) * kLn2;
    }
    if (r_hi < p.len_q) {
      const bool empty = lam_hi == 0.0f;
      p.entropy[stat0 + r_hi] = empty ? 0.0f : (log2f(lam_hi) - kc_hi / lam_hi) * kLn2;
      p.lse[stat0 + r_hi] = empty ? neg_inf() : (m_hi + log2f(lam_hi)) * kLn2;
    }
  }
#if defined(__CUDA_ARCH__)
  }
#endif
}

}  // namespace ssa_flash
