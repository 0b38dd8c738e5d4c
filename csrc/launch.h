// Host entry points of the kernels, one set per element type (defined in the *_fp16.cu and
// *_bf16.cu files). No torch here: the binding (api.cpp) validates tensors and fills the params.
// Each returns an empty string on success, else a message saying what went wrong (shared memory
// too small for the tile, unsupported head dim or architecture, launch error).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "params.h"
#include "traits.h"

namespace ssa_flash {

// forward: o, lse (p.beta != nullptr iff adaptive)
std::string run_fwd_fp16(const FwdParams& p, bool ssa, bool adaptive, cudaStream_t stream);
std::string run_fwd_bf16(const FwdParams& p, bool ssa, bool adaptive, cudaStream_t stream);
// statistics pass: p.entropy and p.lse of softmax(l) (p.o, p.v, p.beta unused)
std::string run_stats_fp16(const FwdParams& p, bool ssa, cudaStream_t stream);
std::string run_stats_bf16(const FwdParams& p, bool ssa, cudaStream_t stream);
// backward: dq, dk, dv, delta, g (adaptive), db/dn partials (ssa; (B, H, bwd_num_m_blocks))
std::string run_bwd_fp16(const BwdParams& p, bool ssa, bool adaptive, cudaStream_t stream);
std::string run_bwd_bf16(const BwdParams& p, bool ssa, bool adaptive, cudaStream_t stream);

// Number of query blocks of the dQ kernel: the last dim of the db/dn partial-sum buffers.
inline int bwd_num_m_blocks(int dim, int dim_v, int len_q) {
  const int d = padded_head_dim(dim > dim_v ? dim : dim_v);
  const int bm = dq_block_m(d < 0 ? 256 : d);
  return (len_q + bm - 1) / bm;
}

}  // namespace ssa_flash
