// Dropout bits: the Philox4x32-10 generator shared with the Triton and reference backends
// (DropCtx, drop_bits), and the kernels' per-thread flags of one tile of scores (drop_tile_bits,
// DropFlags; drop_bits_keys for the key-block kernels' transposed scores).
#pragma once

#include "arch.h"
#include "frag.h"
#include "int_types.h"

namespace ssa_flash {

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

// Dropout flags of one n8 tile of a strip, bit e for this thread's accumulator e (rows `row` and
// row + Frag::kHi, columns `col` and col + 1, col even; struct Frag's element order). One Philox
// evaluation on the m16n8 layouts (rows 8 apart), two on sm_70's. Kernels evaluate the flags of
// a step before its GEMMs, when the score registers are not live (with the scores live, the
// evaluation's registers spilled the D = 128 forward), and apply them after (drop_apply).
SSA_DEVICE uint32_t drop_tile_bits(const DropCtx& d, int row, int col) {
  const uint32_t lo = drop_bits(d, row, col);
  const uint32_t hi = Frag::kHi == 8 ? lo : drop_bits(d, row + Frag::kHi, col);
  uint32_t out = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    out |= static_cast<uint32_t>(drop_kept(e >> 1 ? hi : lo, row + (e >> 1) * Frag::kHi, col + (e & 1))) << e;
  return out;
}

// Packed dropout flags of up to 16 n8 tiles, 4 per tile (bit 4 tile + e). Kernels fill them in a
// rolled loop, one Philox evaluation at a time (unrolled, ptxas interleaved the independent
// evaluations and the kernels at 255 registers spilled), and read them with constant shifts.
struct DropFlags {
  uint64_t w;
  SSA_DEVICE void clear() { w = 0; }
  SSA_DEVICE void set(int tile, uint32_t bits4) { w |= static_cast<uint64_t>(bits4) << (4 * tile); }
  // x times the dropout factor of element e of `tile`: `scale` (1 / (1 - p)) kept, 0 dropped
  SSA_DEVICE float apply(int tile, int e, float x, float scale) const {
    return (w >> (4 * tile + e)) & 1u ? x * scale : 0.0f;
  }
};

// Dropout flags of the key-block kernels' transposed scores (rows: keys, columns: queries) for
// one 16-query block: bit c + 2 hi + 4 u for this thread's element (key key0 + Frag::row(lane) +
// Frag::kHi hi, query q0 + Frag::col(lane, u) + c), key0 the warp strip's first key and q0 the
// block's first query (multiples of 16). Here one Philox evaluation's words {i, i + 8} x {j, j + 1}
// belong to different threads; on the m16n8 layouts (keys g, g + 8, queries 2t, 2t + 1, 8 + ...)
// lane (g, t) evaluates the two counters of key pair (g / 2) + 4 (g % 2), queries 2t, 2t + 1, and
// swaps with lane ^ 4 (g ^ 1, the other key of each pair) the half the partner needs: two
// evaluations and one shuffle per 16 x 16 block, as the forward. sm_70: one evaluation per score.
SSA_DEVICE uint32_t drop_bits_keys(const DropCtx& d, int key0, int q0, int lane) {
  uint32_t out = 0;
  if constexpr (Frag::kHi == 8) {
    const int g = lane >> 2, t = lane & 3, par = g & 1;
    const int kp = (g >> 1) + 4 * par;  // this lane's key pair: keys key0 + 2 kp, + 1
    uint32_t mine = 0, send = 0;        // bit c + 2 u: query q0 + 8 u + 2 t + c
#pragma unroll 1
    for (int c = 0; c < 2; ++c) {
      const uint32_t b = drop_bits(d, q0 + 2 * t + c, key0 + 2 * kp);  // bit u + 2 s
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        mine |= ((b >> (u + 2 * par)) & 1u) << (c + 2 * u);
        send |= ((b >> (u + 2 * (par ^ 1))) & 1u) << (c + 2 * u);
      }
    }
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, send, 4);
    const uint32_t lo = par ? recv : mine, hi = par ? mine : recv;  // keys g, g + 8
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        out |= ((lo >> (c + 2 * u)) & 1u) << (c + 4 * u);
        out |= ((hi >> (c + 2 * u)) & 1u) << (c + 2 + 4 * u);
      }
    }
  } else {
#pragma unroll 1
    for (int b = 0; b < 8; ++b) {  // (one chain at a time: sm_70's kernels have no registers to spare)
      const int u = b >> 2, e = b & 3;
      const int q = q0 + Frag::col(lane, u) + (e & 1), key = key0 + Frag::row(lane) + (e >> 1) * Frag::kHi;
      out |= static_cast<uint32_t>(drop_kept(drop_bits(d, q, key), q, key)) << b;
    }
  }
  return out;
}

}  // namespace ssa_flash
