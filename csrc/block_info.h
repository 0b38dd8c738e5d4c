// Which key blocks a query tile visits and in which order (KeyBlocks, key_blocks: interior blocks
// first, then the checked ones), and which query rows a key block sees (query_block_lo,
// query_end), from the sequence lengths and the band of causality and windows (params.h).
#pragma once

#include "arch.h"
#include "params.h"

namespace ssa_flash {

// Where a CTA's tile lies: its batch, query head, key/value head, and the first row of its tile
// along the sequence it owns. The query-row kernels (forward, row entropy, dQ; grid
// (ceil(Lq / BM), H, B)) own query rows [row0, row0 + BM) of query head `head`, the last query
// blocks scheduled first (under causal the heaviest); the key-block kernels (dK/dV, fused
// backward; grid (ceil(Lk / BN), Hkv, B)) own keys [row0, row0 + BN) of key/value head `head_kv`
// and loop over the query heads of its group themselves (`head` unset).
struct BlockInfo {
  int block;  // the tile's index along its sequence
  int head, batch, head_kv;
  int row0;

  static SSA_DEVICE BlockInfo query_tile(const AttnShape& p, int block_m) {
    BlockInfo b;
    b.block = gridDim.x - 1 - blockIdx.x;
    b.head = blockIdx.y;
    b.batch = blockIdx.z;
    b.head_kv = b.head / p.group;
    b.row0 = b.block * block_m;
    return b;
  }

  static SSA_DEVICE BlockInfo key_tile(int block_n) {
    BlockInfo b;
    b.block = blockIdx.x;
    b.head = 0;
    b.head_kv = blockIdx.y;
    b.batch = blockIdx.z;
    b.row0 = b.block * block_n;
    return b;
  }

  // The (batch, query head) index, b H + h, of the (B, H, ...) row statistics and partial sums.
  SSA_DEVICE int64_t batch_head(const AttnShape& p) const { return static_cast<int64_t>(batch) * p.heads + head; }

  // The first element of this tile's (batch, head) matrix of an input (B, H, L, D) with batch and
  // head strides sb, sh in elements: the query head's (q, o, dO) or the key/value head's (k, v).
  // (The kernels form their output pointers inline, at the stores: through this call the forward
  // epilogue's address arithmetic reached ptxas in another order.)
  template <typename T, typename V>
  SSA_DEVICE T* query_head(V* base, int64_t sb, int64_t sh) const {
    return static_cast<T*>(base) + batch * sb + head * sh;
  }
  template <typename T, typename V>
  SSA_DEVICE T* kv_head(V* base, int64_t sb, int64_t sh) const {
    return static_cast<T*>(base) + batch * sb + head_kv * sh;
  }
};

// The key blocks (of block_n keys) that query rows [m0, m0 + rows) visit, and the order the
// row-streaming kernels (forward, statistics, dQ) run them in. Visited: [lo, end), the blocks
// meeting the rows' band (causality and the window folded in, params.h set_band; every key
// without either). Interior: [a, n_int), the blocks that need no checks (inside the keys, every
// pair of a query tile row and a key inside the band, no mask, no dropout). The order is
// [lo, end) rotated to start at `a`: the interior blocks, then the checked ones, [n_int, end)
// (the causal diagonal or the window's right edge, the ragged last block), then [lo, a) (cut by
// the window's left edge); next(j) is the block after j (`a` after the last), steps() the number
// of blocks. Interior first keeps the interior loop as it is without a window: a windowed call
// pays the checks only on the band's edges. Streamed (cp.async kernels): an interior step
// prefetches the next block through TileStream, which copies only the next contiguous, full
// block, so when the block after the interior is not that (ragged, or the left edge's first),
// the last interior block runs checked. kWindowInterior = false (sm_70 / sm_75, whose registers
// are spent: the rotation spilled their D = 128 forward): a windowed call has no interior
// blocks, and the order is plain [lo, end).
template <bool kWindowInterior>
struct KeyBlocks {
  int lo, a, n_int, end;
  SSA_DEVICE int next(int j) const { return kWindowInterior && j + 1 == end ? lo : j + 1; }
  SSA_DEVICE int first() const { return n_int > a ? a : first_checked(); }
  SSA_DEVICE int first_checked() const { return !kWindowInterior || n_int < end ? n_int : lo; }
  SSA_DEVICE int steps() const { return end - lo; }
  // f(j, it) for each checked block j, `it` its step in the order (after the interior blocks)
  template <class F>
  SSA_DEVICE void each_checked(F&& f) const {
    int j = first_checked();
    for (int it = n_int - a; it < steps(); ++it, j = next(j)) f(j, it);
  }
};

template <bool kWindowInterior = SSA_FLASH_ASYNC_COPIES>
SSA_DEVICE KeyBlocks<kWindowInterior> key_blocks(const AttnShape& p, int m0, int rows, int block_n, bool streamed) {
  KeyBlocks<kWindowInterior> kb;
  kb.lo = m0 > p.win_left ? (m0 - p.win_left) / block_n : 0;
  kb.end = (min(p.len_k, m0 + rows + p.win_right) + block_n - 1) / block_n;
  int a = kb.lo, i_end = kb.lo;
  if (p.mask_kind == kMaskNone && p.drop_rng == nullptr && (kWindowInterior || !p.window)) {
    // block [n0, n0 + block_n) is interior iff n0 >= last row - win_left and
    // n0 + block_n <= min(len_k, m0 + win_right + 1). (The tile's last row, even past len_q:
    // min(m0 + rows, len_q) here moved the sm_90a dQ kernel's loop counter off the uniform
    // datapath, +20% instructions in its interior loop; rows past len_q are no loss without a
    // left bound, set_band.)
    const int left = m0 + rows - 1 - p.win_left;
    a = max(kb.lo, left > 0 ? (left + block_n - 1) / block_n : 0);
    i_end = min(kb.end, min(p.len_k, m0 + p.win_right + 1) / block_n);
    if (streamed && i_end > a && !(i_end < kb.end ? (i_end + 1) * block_n <= p.len_k : kb.lo == a)) --i_end;
    if (i_end <= a) a = i_end = kb.lo;
  }
  kb.a = a;
  kb.n_int = i_end;
  return kb;
}

// Query rows visited by the key block [n0, n0 + block_n) (the key-block kernels): from
// query_block_lo (a multiple of block_m) up to query_end (exclusive).
SSA_DEVICE int query_block_lo(const AttnShape& p, int n0, int block_m) {
  return n0 - p.win_right > 0 ? (n0 - p.win_right) / block_m * block_m : 0;
}
SSA_DEVICE int query_end(const AttnShape& p, int n0, int block_n) { return min(p.len_q, n0 + block_n + p.win_left); }

// The query blocks a key-block kernel's tile of keys [n0, n0 + block_n) visits, per query head:
// rows [first, end), `tiles` blocks of block_m rows from `first` (a multiple of block_m). kBand:
// those meeting the band (query_block_lo, query_end); else causality only (the fused backward,
// which runs no window: the band's bounds spilled it).
struct QueryBlocks {
  int first, end, tiles;
};

template <bool kBand>
SSA_DEVICE QueryBlocks query_blocks(const AttnShape& p, int n0, int block_m, int block_n) {
  QueryBlocks qb;
  qb.first = !kBand ? (p.causal ? (n0 / block_m) * block_m : 0) : query_block_lo(p, n0, block_m);
  qb.end = !kBand ? p.len_q : query_end(p, n0, block_n);
  qb.tiles = qb.first < qb.end ? (qb.end - qb.first + block_m - 1) / block_m : 0;
  return qb;
}

}  // namespace ssa_flash
