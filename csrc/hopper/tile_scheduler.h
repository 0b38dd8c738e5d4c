// Which tile a CTA of a warp-specialised sm_90a kernel works on. Non-persistent: one tile per
// CTA, from blockIdx (grid (tiles along the sequence, heads, batch)). Query-row kernels (the
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
