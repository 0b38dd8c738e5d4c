// Which tile a CTA of a warp-specialised sm_90a kernel works on, and (query-row kernels) its
// sequence (QuerySeq). Non-persistent: one tile per CTA, from blockIdx (grid (tiles along the
// sequence, heads, batch); packed sequences: tiles of the longest, CTAs past their own sequence's
// end exit at once). Query-row kernels (the
// forward) get the last query blocks first (under causal the heaviest: they finish last
// otherwise); key-block kernels (a backward) get key blocks in order. A persistent scheduler
// (a loop over tiles per CTA) would keep this interface: `tile()` then `next()`.
#pragma once

#include "../arch.h"
#include "../params.h"

namespace ssa_flash {
namespace hopper {

struct Tile {
  int block;  // index along the sequence the tile runs over (query blocks or key blocks)
  int head;   // the query head (query-row kernels) or the key/value head (key-block kernels)
  int batch;
  int head_kv;  // the key/value head of `head` (GQA: head / group); = head for key-block kernels
  bool valid;
};

// The sequence of a query-row tile (the forward, the row-entropy pass): its lengths and where it
// lies in the tensor maps and the statistics. QuerySeq<false>, dense tensors: batch element
// tile.batch, every length the call's, each read from the parameters where it is used (so the
// dense kernels compile to the code they had before packed sequences). QuerySeq<true>, a packed
// batch (FwdParams cu_seqlens_*; the maps are (head dim, total rows, heads, 1)): sequence
// tile.batch's rows from the offsets, read once by every thread in the CTA's prologue.
//   len_q(), len_k()   its query and key rows (causal: top-left, positions from its start)
//   q_row(), k_row()   its first query / key row in the maps' row coordinate (dense: 0)
//   tma_batch()        the maps' batch coordinate
//   stat0()            the statistics' index (lse, beta, entropy) of (its row 0, the tile's head)
template <bool kVarlen>
struct QuerySeq;

template <>
struct QuerySeq<false> {
  const FwdParams& p;
  int batch, head;
  SSA_DEVICE QuerySeq(const FwdParams& params, const Tile& t) : p(params), batch(t.batch), head(t.head) {}
  SSA_DEVICE int len_q() const { return p.len_q; }
  SSA_DEVICE int len_k() const { return p.len_k; }
  SSA_DEVICE bool causal() const { return p.causal; }
  SSA_DEVICE int q_row() const { return 0; }
  SSA_DEVICE int k_row() const { return 0; }
  SSA_DEVICE int tma_batch() const { return batch; }
  SSA_DEVICE int64_t stat0() const { return (static_cast<int64_t>(batch) * p.heads + head) * p.len_q; }  // (B, H, Lq)
};

template <>
struct QuerySeq<true> {
  const FwdParams& p;
  int q0, k0, lq, lk;
  int64_t s0;
  SSA_DEVICE QuerySeq(const FwdParams& params, const Tile& t)
      : p(params), q0(params.cu_seqlens_q[t.batch]), k0(params.cu_seqlens_k[t.batch]),
        lq(params.cu_seqlens_q[t.batch + 1] - q0), lk(params.cu_seqlens_k[t.batch + 1] - k0),
        s0(static_cast<int64_t>(t.head) * params.total_q + q0) {}  // (H, total_q)
  SSA_DEVICE int len_q() const { return lq; }
  SSA_DEVICE int len_k() const { return lk; }
  SSA_DEVICE bool causal() const { return p.causal; }
  SSA_DEVICE int q_row() const { return q0; }
  SSA_DEVICE int k_row() const { return k0; }
  SSA_DEVICE int tma_batch() const { return 0; }
  SSA_DEVICE int64_t stat0() const { return s0; }
};

struct SingleTileScheduler {
  // grid for `blocks` tiles along the sequence, `heads` heads, `batch` batch elements
  static dim3 grid(int blocks, int heads, int batch) {
    return dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(heads), static_cast<unsigned>(batch));
  }
  // query-row tiles: the last block first
  static SSA_DEVICE Tile query_tile(const AttnShape& p) {
    Tile t;
    t.block = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
    t.head = blockIdx.y;
    t.batch = blockIdx.z;
    t.head_kv = t.head / p.group;
    t.valid = true;
    return t;
  }
  // key-block tiles, in order
  static SSA_DEVICE Tile key_tile() {
    Tile t;
    t.block = blockIdx.x;
    t.head = t.head_kv = blockIdx.y;
    t.batch = blockIdx.z;
    t.valid = true;
    return t;
  }
};

}  // namespace hopper
}  // namespace ssa_flash
