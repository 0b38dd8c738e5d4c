// A CPU emulation of the part of the CUDA execution model the ssa_flash kernels use, so that
// the kernels in csrc/ can be run and checked on a machine without a GPU (tests/
// test_csrc_compile.py). Compiled with a host C++ compiler and -DSSA_FLASH_EMULATE; the kernel
// sources are the same, only the primitives (memory.h, fast_math.h,
// gemm_mma.h, gemm_wgmma.h, pipeline.h) and the launch are replaced.
//
// Model. The threads of a block are fibers (ucontext to start them, then _setjmp/_longjmp, which
// needs -U_FORTIFY_SOURCE: glibc's checked longjmp refuses to switch stacks) run by one OS thread.
// The scheduler passes over the threads (in a shuffled order by default), running each runnable
// one up to its next wait. Every collective is first a meeting of the warp: all its lanes must
// reach the same collective (kind, barrier id and count), else the launch reports a collective
// reached divergently. A warp collective (shuffle, ldmatrix, mma.sync, __syncwarp, elect.sync)
// then completes; a warpgroup one (wgmma, setmaxnreg) waits for the other 3 warps of its
// warpgroup, whose operands must be uniform; a barrier (__syncthreads[_or], which is barrier 0
// over the block, and bar.sync / bar.arrive id, count) waits until its count of threads arrived
// (bar.arrive does not wait). Collective inputs are deposited in a per-thread slot indexed by the
// parity of the fiber's collective count (equal across a warp), read back by the lanes of the
// warp after the meeting. mbarriers (csrc/pipeline.h) are per thread: arrive / expect-tx update
// the phase's counts, a thread waiting for a phase blocks until it completes. When no thread can
// run and some have not finished, the launch reports a deadlock naming what each thread waits
// for. ldmatrix and mma.sync are implemented from the PTX ISA's definition of which thread
// holds which matrix element (not from the fragment arithmetic of frag.h / gemm_mma.h, which they
// therefore check). cp.async copies are performed either at issue ("eager") or at the
// cp.async.wait_group that retires them ("lazy"); both are legal hardware behaviours, so a
// correct kernel gives identical results in both modes (the sm_70 / sm_75 emulations, which have
// no cp.async, copy at issue in both). TMA tile loads likewise, lazily when the mbarrier phase
// they complete is waited for and nothing else is missing. wgmma (sm_90a) is emulated the same
// way: its operands are collected when the warpgroup meets, and it is carried out
// either at issue or at the wgmma.wait_group that retires it, reading shared memory through the
// descriptor as the PTX ISA's canonical layouts define (128-byte swizzle). Shared memory starts
// filled with NaNs, and its window starts at a shared address that is not 1024-byte aligned
// (kSmemWindowBase), as the kernels must not assume it is.
//
// Not modelled: warp scheduling beyond the above, memory-model subtleties, timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <setjmp.h>
#include <ucontext.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace ssa_flash {
// the dynamic shared memory of every kernel (`extern __shared__ uint4 smem_raw[]`)
alignas(1024) inline uint4 smem_raw[256 * 1024 / sizeof(uint4)];
}  // namespace ssa_flash

namespace ssa_emu {

// The shared-memory address of smem_raw[0] (what cvta.to.shared would give): 16-byte aligned but
// not 1024-byte aligned, so a kernel that needs aligned swizzle atoms must align them itself.
constexpr uint32_t kSmemWindowBase = 400;

enum SyncKind : int {
  kBar = 1, kBarOr, kShfl, kLdm, kLdmT, kMma, kMma8, kMma884, kWarpSync, kWgmma,
  kNamedSync, kNamedArrive, kSetmaxnreg, kElect
};

inline const char* kind_name(int kind) {
  static const char* const names[] = {"?", "__syncthreads", "__syncthreads_or", "shfl", "ldmatrix", "ldmatrix.trans",
                                      "mma.m16n8k16", "mma.m16n8k8", "mma.m8n8k4", "__syncwarp", "wgmma",
                                      "bar.sync", "bar.arrive", "setmaxnreg", "elect.sync"};
  return kind >= 0 && kind <= kElect ? names[kind] : "?";
}

struct Slot {
  int kind;
  int arg[2];  // what every participant must agree on: barrier id and count, setmaxnreg's count and direction
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
  const void* addr;
  float val;
  int off;
  uint64_t desc[2];  // wgmma: A (when from shared memory) and B descriptors
};

// One wgmma of one thread: its accumulators and the operands (A rows of this thread collected at
// issue when A is in registers; shared-memory operands read when the operation is carried out).
struct WgmmaOp {
  float* d;  // float[n / 8][4]
  int n;
  bool a_regs, trans_b, bf16, accumulate;
  bool trans_a;  // A from shared memory MN-major (wgmma_ss_tt)
  uint64_t desc_a, desc_b;
  float a_rows[2][16];  // rows g and g + 8 of this warp's 16 (A in registers)
  int warp_in_group, lane;
};

struct Copy {
  void* dst;
  const void* src;
  bool pred;
};

// Operations a thread issued and has not waited for yet, in commit groups (cp.async's
// commit_group / wait_group, wgmma's likewise): `open` the uncommitted ones, `groups` the
// committed groups, oldest first.
template <typename Op>
struct PendingGroups {
  std::vector<Op> open;
  std::deque<std::vector<Op>> groups;
  void commit() {
    groups.push_back(std::move(open));
    open.clear();
  }
  // Carries out (run(op)) the oldest groups until at most n are left.
  template <typename Run>
  void wait(int n, Run&& run) {
    while (static_cast<int>(groups.size()) > n) {
      for (const Op& op : groups.front()) run(op);
      groups.pop_front();
    }
  }
  bool empty() const { return open.empty() && groups.empty(); }
};

// One TMA tile copy (cp.async.bulk.tensor, PTX ISA "Tensor copy"), a load or a store: the tensor
// map's fields, taken at issue, the box's coordinates (innermost first) and the shared-memory side
// (a load's destination, a store's source).
struct TmaCopy {
  char* dst;  // shared memory
  const char* base;
  int rank, elem_bytes, swizzle_bytes;
  int64_t dims[4], strides[4];
  int box[4], coord[4];
  int64_t bytes() const { return static_cast<int64_t>(box[0]) * box[1] * box[2] * box[3] * elem_bytes; }
};

// An mbarrier object (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier"),
// kept beside the shared-memory word it names: the phase, its pending arrival count, the
// transaction count (bytes expected and not yet delivered; may go negative when a copy lands
// before its expect-tx), and in the lazy mode the TMA loads issued on it but not yet performed.
struct Mbar {
  const void* addr = nullptr;
  uint32_t count = 0, pending = 0, phase = 0;
  int64_t tx = 0;
  std::vector<TmaCopy> lazy;
  int64_t lazy_bytes = 0;
  int waiters = 0;
};

// Where a fiber is: running or ready to (kRunnable); at a collective, waiting for the rest of its
// warp (kAtWarp), then for the other warps of its warpgroup (kAtWarpgroup: wgmma, setmaxnreg) or
// for a barrier's count (kAtBarrier: __syncthreads, bar.sync); waiting for an mbarrier phase
// (kAtMbar); abandoned after an error (kFailed); finished (kDone).
enum FiberState : uint8_t { kRunnable, kAtWarp, kAtWarpgroup, kAtBarrier, kAtMbar, kFailed, kDone };

struct Fiber {
  ucontext_t ctx;  // only to enter the fiber the first time
  jmp_buf jb;      // then _setjmp/_longjmp: no signal-mask system call per switch
  uint3 tid;
  int linear = 0;
  bool done = false;
  FiberState state = kRunnable;
  long syncs = 0;  // collectives passed: equal across the lanes of a warp
  int result = 0;  // of the last collective, set by whoever completed it (__syncthreads_or)
  int wait_bar = 0;
  const void* wait_mbar = nullptr;
  int wait_parity = 0;
  Slot slot[2];
  PendingGroups<Copy> copies;
  PendingGroups<WgmmaOp> wgmma;
  PendingGroups<TmaCopy> stores;  // TMA stores (bulk groups)
};

struct Config {
  bool lazy_copies = false;  // cp.async, TMA loads and wgmma complete at their wait, not at issue
  bool shuffle = true;
  unsigned seed = 1;
  // wgmma issued, counted per thread (tests: the path ran). Process-wide, like every static of
  // these inline functions: GCC makes them unique symbols, shared by all emulator libraries loaded.
  long wgmma_issued = 0;
  // launches per kernel name (tests: which kernel a dispatch chose)
  std::vector<std::pair<std::string, long>> launches;
  void count_launch(const char* name) {
    for (auto& l : launches)
      if (l.first == name) {
        ++l.second;
        return;
      }
    launches.emplace_back(name, 1);
  }
};

inline Config& config() {
  static Config c;
  return c;
}

// The A and B operands of the warp's current mma, rebuilt once per round (not once per lane).
struct MmaCache {
  long round = -1;
  float A[16][16];
  float B[16][8];
};

// A hardware barrier (bar.sync / bar.arrive id, count; __syncthreads is barrier 0 over the block):
// the count of its current use and the threads arrived so far.
struct NamedBar {
  int count = 0, arrived = 0;
  bool red = false;  // a __syncthreads_or (barrier.red.or) use
  int red_or = 0;
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<MmaCache> mma_cache;
  ucontext_t sched;
  jmp_buf sched_jb;
  int cur = -1;
  uint3 block_idx;
  dim3 grid_dim;
  dim3 block_dim;
  std::function<void()> body;
  int threads = 0, live = 0;
  std::vector<int> warp_arrived, warp_done, wg_arrived;  // lanes / warps at the current collective
  NamedBar bars[16];
  std::vector<Mbar> mbars;
  std::string error;  // the first error a fiber met; the launch stops the block
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}

inline Fiber& me() { return block()->fibers[block()->cur]; }

inline int lane_id() { return me().linear & 31; }

inline int warp_lanes(const Block& b, int w) { return std::min(32, b.threads - 32 * w); }

// Deposit slot of the current synchronisation point; then yield until every participant reached it.
inline Slot& deposit(int kind) {
  Fiber& f = me();
  Slot& s = f.slot[f.syncs & 1];
  s.kind = kind;
  s.arg[0] = s.arg[1] = 0;
  return s;
}

// The slot of the collective fiber f is at (or passed last).
inline const Slot& cur_slot(const Fiber& f) { return f.slot[(f.syncs - 1) & 1]; }

// Back to the scheduler; returns when the scheduler resumes this fiber.
inline void yield() {
  Fiber& f = me();
  if (_setjmp(f.jb) == 0) _longjmp(block()->sched_jb, 1);
}

inline std::string hex(uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%lx", static_cast<unsigned long>(v));
  return buf;
}

// An error met by a fiber: recorded for the launch (which stops the block and returns it), and the
// fiber is never resumed.
[[noreturn]] inline void fail(const std::string& what) {
  Block& b = *block();
  if (b.error.empty()) b.error = what;
  me().state = kFailed;
  yield();
  std::abort();  // (not reached: a failed fiber is not resumed)
}

inline void set_error(const std::string& what) {
  if (block()->error.empty()) block()->error = what;
}

inline void release(Fiber& f, int result) {
  f.state = kRunnable;
  f.result = result;
}

inline bool warpgroup_scope(int kind) { return kind == kWgmma || kind == kSetmaxnreg; }
inline bool barrier_scope(int kind) {
  return kind == kBar || kind == kBarOr || kind == kNamedSync || kind == kNamedArrive;
}

inline std::string point_name(const Slot& s) {
  std::string n = kind_name(s.kind);
  if (barrier_scope(s.kind)) n += " " + std::to_string(s.arg[0]) + ", " + std::to_string(s.arg[1]);
  if (s.kind == kSetmaxnreg) n += std::string(s.arg[1] ? ".inc " : ".dec ") + std::to_string(s.arg[0]);
  return n;
}

// Every warp of warpgroup g is at the same warpgroup collective: checks that its operands are
// uniform, then releases the 128 threads.
inline void warpgroup_complete(int g) {
  Block& b = *block();
  const Fiber& f0 = b.fibers[128 * g];
  const Slot& s0 = cur_slot(f0);
  for (int i = 128 * g; i < 128 * g + 128; ++i) {
    const Slot& s = cur_slot(b.fibers[i]);
    const bool same = s.kind == s0.kind && s.arg[0] == s0.arg[0] && s.arg[1] == s0.arg[1] &&
                      (s.kind != kWgmma || (s.desc[0] == s0.desc[0] && s.desc[1] == s0.desc[1] && s.off == s0.off));
    if (!same) {
      set_error(s.kind == kWgmma && s0.kind == kWgmma
                    ? "wgmma: operands differ between the threads of a warpgroup"
                    : "warpgroup " + std::to_string(g) + " not uniform: thread " + std::to_string(128 * g) + " at " +
                          point_name(s0) + ", thread " + std::to_string(i) + " at " + point_name(s));
      return;
    }
  }
  for (int i = 128 * g; i < 128 * g + 128; ++i) release(b.fibers[i], 0);
}

// Warp w arrived at barrier s.arg[0] (bar.sync / bar.arrive / __syncthreads[_or]) with count s.arg[1].
inline void barrier_arrive(int w, const Slot& s) {
  Block& b = *block();
  const int id = s.arg[0], count = s.arg[1], n = warp_lanes(b, w);
  NamedBar& nb = b.bars[id];
  const bool red = s.kind == kBarOr;
  if (nb.arrived == 0) {
    nb.count = count;
    nb.red = red;
    nb.red_or = 0;
  } else if (nb.count != count || nb.red != red) {
    set_error("barrier " + std::to_string(id) + " used with different counts or kinds at once (" +
              std::to_string(nb.count) + (nb.red ? " with .red" : "") + " and " + point_name(s) + ")");
    return;
  }
  for (int l = 0; l < n; ++l) {
    Fiber& f = b.fibers[32 * w + l];
    if (red) nb.red_or |= cur_slot(f).off != 0;
    if (s.kind == kNamedArrive) {
      release(f, 0);
    } else {
      f.state = kAtBarrier;
      f.wait_bar = id;
    }
  }
  nb.arrived += 32;  // (the hardware counts whole warps, a partial last warp too)
  if (nb.arrived > nb.count) {
    set_error("barrier " + std::to_string(id) + ": more threads arrived than its count " + std::to_string(nb.count));
  } else if (nb.arrived == nb.count) {
    for (Fiber& f : b.fibers)
      if (f.state == kAtBarrier && f.wait_bar == id) release(f, nb.red_or);
    nb.arrived = 0;
  }
}

// Every lane of warp w is at a collective: they must be at the same one (kind and barrier /
// count operands). A warp collective completes here; a warpgroup one waits for its other warps,
// a barrier for its count.
inline void warp_complete(int w) {
  Block& b = *block();
  const int n = warp_lanes(b, w);
  const Slot& s0 = cur_slot(b.fibers[32 * w]);
  for (int l = 1; l < n; ++l) {
    const Slot& s = cur_slot(b.fibers[32 * w + l]);
    if (s.kind != s0.kind || s.arg[0] != s0.arg[0] || s.arg[1] != s0.arg[1]) {
      set_error("collective reached divergently: warp " + std::to_string(w) + ": lane 0 at " + point_name(s0) +
                ", lane " + std::to_string(l) + " at " + point_name(s));
      return;
    }
  }
  if (warpgroup_scope(s0.kind)) {
    const int g = w / 4;
    if (128 * (g + 1) > b.threads) {
      set_error(std::string(kind_name(s0.kind)) + " in warpgroup " + std::to_string(g) +
                ", which the block does not fill (" + std::to_string(b.threads) + " threads)");
      return;
    }
    for (int l = 0; l < n; ++l) b.fibers[32 * w + l].state = kAtWarpgroup;
    if (++b.wg_arrived[g] == 4) {
      b.wg_arrived[g] = 0;
      warpgroup_complete(g);
    }
  } else if (barrier_scope(s0.kind)) {
    barrier_arrive(w, s0);
  } else {
    for (int l = 0; l < n; ++l) release(b.fibers[32 * w + l], 0);
  }
}

// The end of a collective's deposit: waits (yields) until the collective completes. Returns the
// parity of the slots the participants deposited in (valid for lanes of the same warp until
// this fiber's next collective).
inline int finish_round() {
  Fiber& f = me();
  Block& b = *block();
  const int parity = static_cast<int>(f.syncs & 1);
  f.syncs++;
  const int w = f.linear >> 5;
  if (b.warp_done[w])
    fail("collective reached divergently: warp " + std::to_string(w) + ": lane " + std::to_string(f.linear & 31) +
         " at " + point_name(cur_slot(f)) + " after other lanes finished");
  f.state = kAtWarp;
  if (++b.warp_arrived[w] == warp_lanes(b, w)) {
    b.warp_arrived[w] = 0;
    warp_complete(w);
  }
  yield();
  return parity;
}

inline const Slot& lane_slot(int lane, int parity) {
  Fiber& f = me();
  return block()->fibers[(f.linear & ~31) + lane].slot[parity];
}

inline int block_barrier_count() { return (block()->threads + 31) / 32 * 32; }

inline void syncthreads() {
  Slot& s = deposit(kBar);
  s.arg[1] = block_barrier_count();
  finish_round();
}

// __syncthreads_or(pred): a barrier that also returns whether any thread of the block passed
// a nonzero predicate.
inline int syncthreads_or(int pred) {
  Slot& s = deposit(kBarOr);
  s.arg[1] = block_barrier_count();
  s.off = pred != 0;
  finish_round();
  return me().result;
}

// __shfl_xor_sync of a 4-byte value (float, int, unsigned), bits moved unchanged
template <typename V>
inline V shfl_xor(V v, int off) {
  static_assert(sizeof(V) == 4, "shfl_xor: 4-byte values");
  Slot& s = deposit(kShfl);
  std::memcpy(&s.val, &v, 4);
  s.off = off;
  const int par = finish_round();
  V out;
  std::memcpy(&out, &lane_slot(lane_id() ^ off, par).val, 4);
  return out;
}

// ------------------------------------------------------------------------------------------
// Primitives of memory.h, fast_math.h, gemm_mma.h

inline float ex2(float x) { return std::exp2(x); }
inline float lg2(float x) { return std::log2(x); }
inline float rcp(float x) { return 1.0f / x; }
inline float tanh_approx(float x) { return std::tanh(x); }

// __syncwarp(): a synchronisation point like the others (every lane of the warp arrives first).
inline void syncwarp() {
  deposit(kWarpSync);
  finish_round();
}

inline void do_copy(const Copy& c) {
  if (c.pred) std::memcpy(c.dst, c.src, 16);
  else std::memset(c.dst, 0, 16);
}

// Only cp.async (sm_80+) can land late: on the sm_70 / sm_75 code paths (arch.h,
// SSA_FLASH_ASYNC_COPIES 0) a copy is a load and a store, complete at issue whatever the mode.
inline void cp_async_16(void* smem, const void* gmem, bool pred) {
  const Copy c{smem, gmem, pred};
  if (SSA_FLASH_ASYNC_COPIES && config().lazy_copies) me().copies.open.push_back(c);
  else do_copy(c);
}

inline void cp_async_commit() { me().copies.commit(); }

template <int N>
inline void cp_async_wait() {
  me().copies.wait(N, do_copy);
}

inline uint16_t load16(const void* row, int col) {
  uint16_t v;
  std::memcpy(&v, static_cast<const char*>(row) + 2 * col, 2);
  return v;
}

// ldmatrix.m8n8.x4(.trans).b16: lanes 8i..8i+7 give the row addresses of matrix i. Without
// .trans thread t receives row t/4, elements 2(t%4), 2(t%4)+1 of each matrix; with .trans the
// same of the transposed matrix, i.e. rows 2(t%4), 2(t%4)+1 of column t/4.
inline void ldmatrix_impl(uint32_t (&r)[4], const void* addr, bool trans) {
  Slot& s = deposit(trans ? kLdmT : kLdm);
  s.addr = addr;
  const int par = finish_round();
  const int lane = lane_id();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const void* row = lane_slot(8 * i + lane / 4, par).addr;
      lo = load16(row, 2 * (lane % 4));
      hi = load16(row, 2 * (lane % 4) + 1);
    } else {
      lo = load16(lane_slot(8 * i + 2 * (lane % 4), par).addr, lane / 4);
      hi = load16(lane_slot(8 * i + 2 * (lane % 4) + 1, par).addr, lane / 4);
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* addr) { ldmatrix_impl(r, addr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* addr) { ldmatrix_impl(r, addr, true); }

template <typename T>
inline float to_float(uint16_t bits) {
  T h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// D += A B (A: 16 x kK, B: kK x 8, unpacked from the quad's fragments) for this lane's C/D
// fragment of an m16n8 product: c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1).
template <int kK>
inline void add_product_m16n8(float (&d)[4], const float (&A)[16][kK], const float (&B)[kK][8]) {
  const int lane = lane_id();
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + (i >= 2 ? 8 : 0);
    const int col = 2 * t + (i & 1);
    float acc = 0.0f;
    for (int k = 0; k < kK; ++k) acc += A[row][k] * B[k][col];
    d[i] += acc;
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A (16x16) B (16x8) + C, with the PTX
// ISA fragment layouts (groupID g = lane/4, t = lane%4):
//   A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); lower column in the
//      low half of each register
//   B: b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8..2t+9, n = g)
//   C/D: c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Slot& s = deposit(kMma);
  std::memcpy(s.a, a, sizeof(s.a));
  s.b[0] = b0;
  s.b[1] = b1;
  const int par = finish_round();
  MmaCache& cache = block()->mma_cache[me().linear / 32];
  auto& A = cache.A;
  auto& B = cache.B;
  if (cache.round != me().syncs) {
    cache.round = me().syncs;
  for (int l = 0; l < 32; ++l) {
    const Slot& o = lane_slot(l, par);
    const int g = l / 4, t = l % 4;
    auto put_a = [&](int row, int col, uint32_t v) {
      A[row][col] = to_float<T>(static_cast<uint16_t>(v & 0xffff));
      A[row][col + 1] = to_float<T>(static_cast<uint16_t>(v >> 16));
    };
    put_a(g, 2 * t, o.a[0]);
    put_a(g + 8, 2 * t, o.a[1]);
    put_a(g, 2 * t + 8, o.a[2]);
    put_a(g + 8, 2 * t + 8, o.a[3]);
    B[2 * t][g] = to_float<T>(static_cast<uint16_t>(o.b[0] & 0xffff));
    B[2 * t + 1][g] = to_float<T>(static_cast<uint16_t>(o.b[0] >> 16));
    B[2 * t + 8][g] = to_float<T>(static_cast<uint16_t>(o.b[1] & 0xffff));
    B[2 * t + 9][g] = to_float<T>(static_cast<uint16_t>(o.b[1] >> 16));
  }
  }
  add_product_m16n8(d, A, B);
}

// mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 (sm_75): A (16x8): a0 (g, 2t..2t+1),
// a1 (g+8, 2t..2t+1); B (8x8): b0 (k = 2t..2t+1, n = g); C/D as for m16n8k16.
inline void mma_1688_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  Slot& s = deposit(kMma8);
  s.a[0] = a0;
  s.a[1] = a1;
  s.b[0] = b0;
  const int par = finish_round();
  float A[16][8], B[8][8];
  for (int l = 0; l < 32; ++l) {
    const Slot& o = lane_slot(l, par);
    const int g = l / 4, t = l % 4;
    A[g][2 * t] = to_float<__half>(static_cast<uint16_t>(o.a[0] & 0xffff));
    A[g][2 * t + 1] = to_float<__half>(static_cast<uint16_t>(o.a[0] >> 16));
    A[g + 8][2 * t] = to_float<__half>(static_cast<uint16_t>(o.a[1] & 0xffff));
    A[g + 8][2 * t + 1] = to_float<__half>(static_cast<uint16_t>(o.a[1] >> 16));
    B[2 * t][g] = to_float<__half>(static_cast<uint16_t>(o.b[0] & 0xffff));
    B[2 * t + 1][g] = to_float<__half>(static_cast<uint16_t>(o.b[0] >> 16));
  }
  add_product_m16n8(d, A, B);
}

// mma.sync.aligned.m8n8k4.row.{col,row}.f32.f16.f16.f32 (sm_70): four independent 8x8x4
// products, quad pair q made of lanes 4q..4q+3 ("low", h = 0) and 16+4q..16+4q+3 ("high",
// h = 1). PTX ISA, "Matrix fragments for mma.m8n8k4 with .f16", for lane t = lane % 4:
//   A (row-major): row t + 4h, col (k) = i for a_i, i = 0..3 (a0 = {a_0, a_1}, a1 = {a_2, a_3})
//   B .col: row (k) = i, col t + 4h;  B .row: row (k) = t, col i + 4h
//   C/D (f32): c_i at row X + 4h, col (t & 2) + (i & 1) + (i & 4), X = (t & 1) + (i & 2)
// c_0..c_3 are c_lo, c_4..c_7 c_hi.
template <bool kRowB>
inline void mma_884(float (&c_lo)[4], float (&c_hi)[4], uint32_t a0, uint32_t a1, uint32_t b0,
                    uint32_t b1) {
  Slot& s = deposit(kMma884);
  s.a[0] = a0;
  s.a[1] = a1;
  s.b[0] = b0;
  s.b[1] = b1;
  const int par = finish_round();
  const int lane = lane_id();
  const int q = (lane >> 2) & 3;
  float A[8][4], B[4][8];
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < 4; ++t) {
      const Slot& o = lane_slot(16 * h + 4 * q + t, par);
      const uint16_t av[4] = {static_cast<uint16_t>(o.a[0] & 0xffff), static_cast<uint16_t>(o.a[0] >> 16),
                              static_cast<uint16_t>(o.a[1] & 0xffff), static_cast<uint16_t>(o.a[1] >> 16)};
      const uint16_t bv[4] = {static_cast<uint16_t>(o.b[0] & 0xffff), static_cast<uint16_t>(o.b[0] >> 16),
                              static_cast<uint16_t>(o.b[1] & 0xffff), static_cast<uint16_t>(o.b[1] >> 16)};
      for (int i = 0; i < 4; ++i) {
        A[t + 4 * h][i] = to_float<__half>(av[i]);
        if (kRowB) B[t][i + 4 * h] = to_float<__half>(bv[i]);
        else B[i][t + 4 * h] = to_float<__half>(bv[i]);
      }
    }
  }
  const int t = lane & 3, h = lane >> 4;
  for (int i = 0; i < 8; ++i) {
    const int row = (t & 1) + (i & 2) + 4 * h;
    const int col = (t & 2) + (i & 1) + (i & 4);
    float acc = 0.0f;
    for (int k = 0; k < 4; ++k) acc += A[row][k] * B[k][col];
    (i < 4 ? c_lo[i] : c_hi[i - 4]) += acc;
  }
}

// ------------------------------------------------------------------------------------------
// wgmma (sm_90a), from the PTX ISA ("Asynchronous Warpgroup Level Matrix Multiply-Accumulate"):
// wgmma.mma_async.m64nNk16.f32.{f16,bf16}: D (64 x N) = A (64 x 16) B (16 x N) + (scale-d ? D : 0).
// Thread `lane` of warp w of the warpgroup (g = lane / 4, t = lane % 4) holds
//   D: d[nt][i] at row 16 w + g + 8 (i / 2), column 8 nt + 2 t + (i % 2)
//   A in registers: a0 (16 w + g, k 2t..2t+1), a1 (16 w + g + 8, 2t..), a2 (16 w + g, 2t+8..),
//   a3 (16 w + g + 8, 2t+8..), lower k in the low half
// Shared-memory operands through a matrix descriptor: start address (bits 0-13), leading byte
// offset LBO (16-29), stride byte offset SBO (32-45), each >> 4; base offset (49-51); swizzle
// mode (62-63; 1 = 128 B). Canonical layouts (CuTe notation, in elements, T = 8 16-bit
// elements per 16 bytes), then Swizzle<3,4,3> of the byte address (bits 7-9 XORed into 4-6):
//   K-major,  128 B swizzle: ((8, m), (T, 2k)) : ((8T, SBO), (1, T))
//   MN-major, 128 B swizzle: ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO))
// Only what the kernels use is modelled (16-bit types, the 128-byte swizzle, base offset 0);
// anything else aborts the emulation.

inline uint32_t smem_u32(const void* p) {
  return kSmemWindowBase + static_cast<uint32_t>(static_cast<const char*>(p) -
                                                 reinterpret_cast<const char*>(ssa_flash::smem_raw));
}

[[noreturn]] inline void emu_fail(const char* what) {
  std::fprintf(stderr, "ssa_emu: %s\n", what);
  std::abort();
}

// Element (mn, k) of the operand `desc` describes (K-major or MN-major), as a float.
inline float wgmma_elem(uint64_t desc, int mn, int k, bool mn_major, bool bf16) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3FFF) << 4;
  const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3FFF) << 4;
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4;
  if ((desc >> 62) != 1 || ((desc >> 49) & 7) != 0) emu_fail("wgmma: only the 128-byte swizzle with base offset 0 is emulated");
  constexpr int kT = 8;
  uint32_t off;
  if (!mn_major) {
    // mn = r0 + 8 r1 -> r0 * 8T + r1 * SBO; k (< 2T within one instruction) -> k
    off = static_cast<uint32_t>((mn % 8) * 8 * kT * 2) + static_cast<uint32_t>(mn / 8) * sbo + static_cast<uint32_t>(k * 2);
  } else {
    // mn = n0 + T n1 + 8T n2 -> n0 + T n1 + n2 * LBO; k = k0 + 8 k1 -> k0 * 8T + k1 * SBO
    off = static_cast<uint32_t>((mn % (8 * kT)) * 2) + static_cast<uint32_t>(mn / (8 * kT)) * lbo +
          static_cast<uint32_t>((k % 8) * 8 * kT * 2) + static_cast<uint32_t>(k / 8) * sbo;
  }
  uint32_t addr = start + off;
  addr ^= ((addr >> 7) & 7u) << 4;
  if (addr < kSmemWindowBase || addr + 2 > kSmemWindowBase + sizeof(ssa_flash::smem_raw)) emu_fail("wgmma: operand outside shared memory");
  const void* p = reinterpret_cast<const char*>(ssa_flash::smem_raw) + (addr - kSmemWindowBase);
  return bf16 ? to_float<__nv_bfloat16>(load16(p, 0)) : to_float<__half>(load16(p, 0));
}

inline void wgmma_run(const WgmmaOp& op) {
  const int g = op.lane / 4, t = op.lane % 4;
  float A[2][16];
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 16; ++k)
      A[h][k] = op.a_regs ? op.a_rows[h][k]
                          : wgmma_elem(op.desc_a, 16 * op.warp_in_group + g + 8 * h, k, op.trans_a, op.bf16);
  for (int nt = 0; nt < op.n / 8; ++nt) {
    for (int c = 0; c < 2; ++c) {
      const int col = 8 * nt + 2 * t + c;
      float B[16];
      for (int k = 0; k < 16; ++k) B[k] = wgmma_elem(op.desc_b, col, k, op.trans_b, op.bf16);
      for (int h = 0; h < 2; ++h) {
        float acc = 0.0f;
        for (int k = 0; k < 16; ++k) acc += A[h][k] * B[k];
        float& d = op.d[4 * nt + 2 * h + c];
        d = (op.accumulate ? d : 0.0f) + acc;
      }
    }
  }
}

// Issue: a synchronisation point of the block (the warpgroup's operands are collected; every
// thread must pass the same descriptors), then carried out now or at the retiring wait.
inline void wgmma_issue(float* d, int n, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool accumulate,
                        bool trans_b, bool bf16, bool trans_a = false) {
  Slot& s = deposit(kWgmma);
  if (a) std::memcpy(s.a, a, sizeof(s.a));
  s.desc[0] = desc_a;
  s.desc[1] = desc_b;
  s.off = accumulate;
  const int par = finish_round();
  Fiber& f = me();
  // (the warpgroup's operands were checked uniform when its last warp arrived)
  WgmmaOp op{};
  op.d = d;
  op.n = n;
  op.a_regs = a != nullptr;
  op.trans_b = trans_b;
  op.trans_a = trans_a;
  op.bf16 = bf16;
  op.accumulate = accumulate;
  op.desc_a = desc_a;
  op.desc_b = desc_b;
  op.warp_in_group = (f.linear >> 5) & 3;
  op.lane = f.linear & 31;
  if (a) {
    const int g = op.lane / 4;
    for (int tt = 0; tt < 4; ++tt) {
      const Slot& o = lane_slot(4 * g + tt, par);
      for (int h = 0; h < 2; ++h) {
        for (int hk = 0; hk < 2; ++hk) {  // a0 / a1: k 2tt..; a2 / a3: k 2tt + 8..
          const uint32_t v = o.a[h + 2 * hk];
          const int k = 2 * tt + 8 * hk;
          op.a_rows[h][k] = bf16 ? to_float<__nv_bfloat16>(static_cast<uint16_t>(v & 0xffff))
                                 : to_float<__half>(static_cast<uint16_t>(v & 0xffff));
          op.a_rows[h][k + 1] = bf16 ? to_float<__nv_bfloat16>(static_cast<uint16_t>(v >> 16))
                                     : to_float<__half>(static_cast<uint16_t>(v >> 16));
        }
      }
    }
  }
  config().wgmma_issued++;
  if (config().lazy_copies) f.wgmma.open.push_back(op);
  else wgmma_run(op);
}

template <typename T, int N>
inline void wgmma_ss(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
  wgmma_issue(&d[0][0], N, nullptr, da, db, accumulate != 0, false, std::is_same<T, __nv_bfloat16>::value);
}

template <typename T, int N>
inline void wgmma_rs_tb(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t db, int accumulate) {
  wgmma_issue(&d[0][0], N, a, 0, db, accumulate != 0, true, std::is_same<T, __nv_bfloat16>::value);
}

// Both operands from shared memory, both MN-major (the PTX ISA's imm-trans-a = imm-trans-b = 1):
// A (64 x 16) with m contiguous, B (16 x N) with n contiguous (csrc/hopper/bwd_gemm.h).
template <typename T, int N>
inline void wgmma_ss_tt(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
  wgmma_issue(&d[0][0], N, nullptr, da, db, accumulate != 0, true, std::is_same<T, __nv_bfloat16>::value, true);
}

// Both operands from shared memory, A K-major, B MN-major (imm-trans-b = 1; csrc/hopper/bwd_gemm.h).
template <typename T, int N>
inline void wgmma_ss_tb(float (&d)[N / 8][4], uint64_t da, uint64_t db, int accumulate) {
  wgmma_issue(&d[0][0], N, nullptr, da, db, accumulate != 0, true, std::is_same<T, __nv_bfloat16>::value, false);
}

inline void wgmma_commit() { me().wgmma.commit(); }

template <int N>
inline void wgmma_wait() {
  me().wgmma.wait(N, wgmma_run);
}

inline void wgmma_fence() {}
inline void fence_proxy_async() {}
template <int N>
inline void wgmma_fence_operand(float (&)[N][4]) {}
template <int N>
inline void wgmma_fence_operand(uint32_t (&)[N][4]) {}

// ------------------------------------------------------------------------------------------
// Warp specialisation (sm_90a, csrc/pipeline.h): mbarriers, TMA tile loads, named barriers,
// setmaxnreg, elect.sync. mbarrier operations are per thread (not collectives): a thread waiting
// for a phase is blocked until the phase completes. A TMA load is performed at issue (eager) or
// as late as the PTX ISA allows (lazy): when the phase it completes could otherwise complete
// and a thread waits for it.

// p .. p + bytes inside the shared-memory window, its shared address a multiple of `align`.
inline void check_smem(const void* p, int64_t bytes, uint32_t align, const char* what) {
  const char* c = static_cast<const char*>(p);
  const char* lo = reinterpret_cast<const char*>(ssa_flash::smem_raw);
  if (c < lo || c + bytes > lo + sizeof(ssa_flash::smem_raw))
    fail(std::string(what) + ": address outside shared memory");
  if (smem_u32(p) % align)
    fail(std::string(what) + ": shared address " + hex(smem_u32(p)) + " not " + std::to_string(align) + "-byte aligned");
}

inline Mbar* find_mbar(const void* bar) {
  for (Mbar& m : block()->mbars)
    if (m.addr == bar) return &m;
  return nullptr;
}

inline Mbar& mbar_of(const void* bar, const char* op) {
  Mbar* m = find_mbar(bar);
  if (m == nullptr) fail(std::string(op) + ": no mbarrier initialised at shared " + hex(smem_u32(bar)));
  return *m;
}

// mbarrier.init.shared::cta.b64 [bar], count
inline void mbar_init(uint64_t* bar, uint32_t count) {
  check_smem(bar, 8, 8, "mbarrier.init");
  if (count < 1 || count > (1u << 20) - 1) fail("mbarrier.init: count " + std::to_string(count) + " outside 1..2^20-1");
  Mbar* m = find_mbar(bar);
  if (m == nullptr) {
    block()->mbars.emplace_back();
    m = &block()->mbars.back();
  } else if (m->waiters || !m->lazy.empty()) {
    fail("mbarrier.init: the mbarrier at shared " + hex(smem_u32(bar)) + " is in use");
  }
  *m = Mbar();
  m->addr = bar;
  m->count = m->pending = count;
}

inline void fence_mbar_init() {}

// f(shared-memory bytes of box element i, its global coordinates coord + i, whether they are inside
// the tensor) for every element of the box, in box order; with the 128-byte swizzle the 16-byte
// chunk index of the shared address (bits 4-6) is XORed with bits 7-9.
template <typename F>
inline void tma_box_walk(const TmaCopy& c, F&& f) {
  const uint32_t s0 = smem_u32(c.dst);
  for (int i3 = 0; i3 < c.box[3]; ++i3)
  for (int i2 = 0; i2 < c.box[2]; ++i2)
    for (int i1 = 0; i1 < c.box[1]; ++i1)
      for (int i0 = 0; i0 < c.box[0]; ++i0) {
        const int64_t g[4] = {static_cast<int64_t>(c.coord[0]) + i0, static_cast<int64_t>(c.coord[1]) + i1,
                              static_cast<int64_t>(c.coord[2]) + i2, static_cast<int64_t>(c.coord[3]) + i3};
        bool inside = true;
        for (int d = 0; d < c.rank; ++d) inside = inside && g[d] >= 0 && g[d] < c.dims[d];
        uint32_t a = s0 + static_cast<uint32_t>((((i3 * c.box[2] + i2) * c.box[1] + i1) * c.box[0] + i0) * c.elem_bytes);
        if (c.swizzle_bytes == 128) a ^= ((a >> 7) & 7u) << 4;
        f(reinterpret_cast<char*>(ssa_flash::smem_raw) + (a - kSmemWindowBase), g, inside);
      }
}

// The global address of element g of the copy's tensor.
inline char* tma_global(const TmaCopy& c, const int64_t (&g)[4]) {
  char* at = const_cast<char*>(c.base) + g[0] * c.elem_bytes;
  for (int d = 1; d < c.rank; ++d) at += g[d] * c.strides[d];
  return at;
}

// A load: the box from the tensor (zeros outside it, as the hardware fills them) to shared memory.
inline void tma_perform(const TmaCopy& c) {
  tma_box_walk(c, [&](char* sm, const int64_t (&g)[4], bool inside) {
    if (inside) std::memcpy(sm, tma_global(c, g), c.elem_bytes);
    else std::memset(sm, 0, c.elem_bytes);
  });
}

// The phase completes when no arrival is pending and the transaction count is zero: the next
// phase starts (pending = count) and the threads waiting for the completed one resume. Lazy TMA
// loads are performed here when they are all that is missing and a thread waits (`observed`: the
// thread now asking).
inline void mbar_try_complete(Mbar& m, bool observed) {
  if (m.pending != 0) return;
  if (!m.lazy.empty() && m.tx == m.lazy_bytes && (observed || m.waiters > 0)) {
    for (const TmaCopy& c : m.lazy) tma_perform(c);
    m.tx -= m.lazy_bytes;
    m.lazy.clear();
    m.lazy_bytes = 0;
  }
  if (m.tx != 0) return;
  const int completed = static_cast<int>(m.phase & 1);
  m.phase++;
  m.pending = m.count;
  if (m.waiters == 0) return;
  for (Fiber& f : block()->fibers) {
    if (f.state == kAtMbar && f.wait_mbar == m.addr && f.wait_parity == completed) {
      release(f, 0);
      m.waiters--;
    }
  }
}

// mbarrier.arrive (.expect_tx: the transaction count first raised by tx bytes)
inline void mbar_arrive_impl(uint64_t* bar, uint32_t tx, const char* op) {
  Mbar& m = mbar_of(bar, op);
  m.tx += tx;
  if (m.pending == 0) mbar_try_complete(m, true);  // (lazy loads that would have landed by now)
  if (m.pending == 0)
    fail(std::string(op) + ": more arrivals than the count (" + std::to_string(m.count) + ") of the mbarrier at shared " +
         hex(smem_u32(bar)) + " in one phase");
  m.pending--;
  mbar_try_complete(m, false);
  yield();  // a scheduling point: others may act on the arrival before this thread goes on
}

inline void mbar_arrive(uint64_t* bar) { mbar_arrive_impl(bar, 0, "mbarrier.arrive"); }
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  mbar_arrive_impl(bar, bytes, "mbarrier.arrive.expect_tx");
}

// mbarrier.try_wait.parity: true once the phase of parity `parity` has completed (the current
// phase's parity differs). The hardware may time out and return false; here the thread blocks
// until the phase completes (a deadlock, if it never does, is reported by the launch).
inline bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  Mbar& m = mbar_of(bar, "mbarrier.try_wait");
  if ((m.phase & 1) != (parity & 1)) return true;
  mbar_try_complete(m, true);
  if ((m.phase & 1) != (parity & 1)) return true;
  Fiber& f = me();
  f.state = kAtMbar;
  f.wait_mbar = bar;
  f.wait_parity = static_cast<int>(parity & 1);
  m.waiters++;
  yield();
  return true;
}

// A TMA copy's fields from tensor map `d` (ssa_flash::TmaTileSpec), the box at coordinates c
// (innermost first), checked as the PTX ISA and the driver's encoder require. `smem`: the
// shared-memory side (destination of a load, source of a store: smem_role names it in errors).
template <typename Desc>
inline TmaCopy tma_copy_of(const void* smem, const Desc* d, int rank, const int (&coord)[4], const char* what,
                           const char* smem_role) {
  if (d->rank != rank)
    fail(std::string(what) + "." + std::to_string(rank) + "d with a rank-" + std::to_string(d->rank) + " tensor map");
  TmaCopy c{};
  c.dst = static_cast<char*>(const_cast<void*>(smem));
  c.base = static_cast<const char*>(d->base);
  c.rank = rank;
  c.elem_bytes = d->elem_bytes;
  c.swizzle_bytes = d->swizzle_bytes;
  for (int i = 0; i < 4; ++i) {
    c.dims[i] = i < rank ? d->dims[i] : 1;
    c.strides[i] = i < rank ? d->strides[i] : 0;
    c.box[i] = i < rank ? d->box[i] : 1;
    c.coord[i] = i < rank ? coord[i] : 0;
    if (c.box[i] < 1 || c.box[i] > 256) fail("tensor map: box sizes are 1..256");
    if (i > 0 && i < rank && c.strides[i] % 16) fail("tensor map: strides are multiples of 16 bytes");
  }
  if (c.swizzle_bytes != 0 && c.swizzle_bytes != 128) fail("tensor map: only no swizzle or the 128-byte one is emulated");
  if (c.swizzle_bytes == 128 && c.box[0] * c.elem_bytes > 128)
    fail("tensor map: with the 128-byte swizzle the box's inner dimension is at most 128 bytes");
  if ((c.box[0] * c.elem_bytes) % 16) fail("tensor map: the box's inner dimension is a multiple of 16 bytes");
  if (reinterpret_cast<uintptr_t>(c.base) % 16) fail("tensor map: the global address is 16-byte aligned");
  check_smem(smem, c.bytes(), c.swizzle_bytes == 128 ? 1024 : 128, (std::string(what) + " " + smem_role).c_str());
  return c;
}

// cp.async.bulk.tensor.{2,3,4}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes: the box at
// coordinates c (innermost first) of the tensor map `d` (ssa_flash::TmaTileSpec) into `dst`,
// completing the box's bytes on `bar`.
template <typename Desc>
inline void tma_load(void* dst, const Desc* d, uint64_t* bar, int rank, int c0, int c1, int c2, int c3 = 0) {
  const int coord[4] = {c0, c1, c2, c3};
  const TmaCopy c = tma_copy_of(dst, d, rank, coord, "cp.async.bulk.tensor", "destination");
  Mbar& m = mbar_of(bar, "cp.async.bulk.tensor");
  if (config().lazy_copies) {
    m.lazy.push_back(c);
    m.lazy_bytes += c.bytes();
  } else {
    tma_perform(c);
    m.tx -= c.bytes();
  }
  mbar_try_complete(m, false);
}

// The store itself: box element i from the shared source (the layout as tma_perform's) to global
// coordinates coord + i, the elements outside the tensor not written.
inline void tma_store_perform(const TmaCopy& c) {
  tma_box_walk(c, [&](const char* sm, const int64_t (&g)[4], bool inside) {
    if (inside) std::memcpy(tma_global(c, g), sm, c.elem_bytes);
  });
}

// cp.async.bulk.tensor.{4}d.global.shared::cta.tile.bulk_group: the box of shared memory at `src`
// to the tensor at coordinates c, in this thread's current bulk group. Performed at issue
// (eager) or at the wait_group that covers it (lazy: shared memory is read as late as allowed,
// so a tile rewritten before the wait, or written by others after the store was issued, shows).
template <typename Desc>
inline void tma_store(const void* src, const Desc* d, int rank, int c0, int c1, int c2, int c3 = 0) {
  const int coord[4] = {c0, c1, c2, c3};
  const TmaCopy c = tma_copy_of(src, d, rank, coord, "cp.async.bulk.tensor", "store source");
  if (config().lazy_copies) me().stores.open.push_back(c);
  else tma_store_perform(c);
}

// cp.async.bulk.commit_group / cp.async.bulk.wait_group.read N
inline void tma_store_commit() { me().stores.commit(); }
template <int N>
inline void tma_store_wait_read() {
  if (!me().stores.open.empty()) fail("cp.async.bulk.wait_group: stores issued but not committed to a group");
  me().stores.wait(N, tma_store_perform);
}

// bar.sync / bar.arrive id, count: count threads (whole warps) of the block meet at barrier id;
// bar.arrive counts its warp without waiting.
inline void named_barrier(int id, int count, bool sync) {
  if (id < 0 || id > 15) fail("bar.sync / bar.arrive: barrier ids are 0..15");
  if (count <= 0 || count % 32 || count > block_barrier_count())
    fail("bar.sync / bar.arrive: count " + std::to_string(count) + " is not a multiple of 32 up to the block's size");
  Slot& s = deposit(sync ? kNamedSync : kNamedArrive);
  s.arg[0] = id;
  s.arg[1] = count;
  finish_round();
}

inline void named_bar_sync(int id, int count) { named_barrier(id, count, true); }
inline void named_bar_arrive(int id, int count) { named_barrier(id, count, false); }

// setmaxnreg.{inc,dec}.sync.aligned.u32 n: no registers here; checked to be used as the PTX ISA
// requires: n in 24..256, a multiple of 8, the same instruction by every warp of the warpgroup.
inline void setmaxnreg(int n, bool inc) {
  if (n < 24 || n > 256 || n % 8) fail("setmaxnreg: " + std::to_string(n) + " is not a multiple of 8 in 24..256");
  Slot& s = deposit(kSetmaxnreg);
  s.arg[0] = n;
  s.arg[1] = inc;
  finish_round();
}

template <int N>
inline void setmaxnreg_inc() {
  setmaxnreg(N, true);
}
template <int N>
inline void setmaxnreg_dec() {
  setmaxnreg(N, false);
}

// elect.sync with a full mask: one lane of the warp (here lane 0) is elected.
inline bool elect_one() {
  deposit(kElect);
  finish_round();
  return lane_id() == 0;
}

// What fiber f waits for (the deadlock report).
inline std::string describe_wait(const Block& b, const Fiber& f) {
  const int w = f.linear >> 5;
  switch (f.state) {
    case kRunnable: return "runnable";
    case kDone: return "finished";
    case kFailed: return "failed";
    case kAtWarp:
      return "at " + point_name(cur_slot(f)) + ", waiting for the rest of warp " + std::to_string(w) + " (" +
             std::to_string(b.warp_arrived[w]) + " of " + std::to_string(warp_lanes(b, w)) + " lanes there)";
    case kAtWarpgroup:
      return "at " + point_name(cur_slot(f)) + ", waiting for the other warps of warpgroup " + std::to_string(w / 4) +
             " (" + std::to_string(b.wg_arrived[w / 4]) + " of 4 there)";
    case kAtBarrier: {
      const NamedBar& nb = b.bars[f.wait_bar];
      return "at " + point_name(cur_slot(f)) + " (" + std::to_string(nb.arrived) + " of " + std::to_string(nb.count) +
             " threads arrived)";
    }
    case kAtMbar: {
      const Mbar* m = nullptr;
      for (const Mbar& x : b.mbars)
        if (x.addr == f.wait_mbar) m = &x;
      if (m == nullptr) return "waiting on a vanished mbarrier";
      return "waiting on the mbarrier at shared " + hex(smem_u32(f.wait_mbar)) + " for the phase of parity " +
             std::to_string(f.wait_parity) + " (phase " + std::to_string(m->phase) + ": " + std::to_string(m->pending) +
             " of " + std::to_string(m->count) + " arrivals pending, " + std::to_string(m->tx) + " transaction bytes)";
    }
  }
  return "?";
}

// No thread can run and not all have finished: what each waits for, consecutive threads alike
// in one line.
inline std::string describe_deadlock(const Block& b) {
  std::string out = "deadlock: no thread can run and not all have finished";
  int start = 0;
  std::string cur = describe_wait(b, b.fibers[0]);
  for (int i = 1; i <= b.threads; ++i) {
    const std::string d = i < b.threads ? describe_wait(b, b.fibers[i]) : std::string();
    if (i < b.threads && d == cur) continue;
    out += (i - 1 > start ? "\n  threads " + std::to_string(start) + "-" + std::to_string(i - 1)
                          : "\n  thread " + std::to_string(start)) + ": " + cur;
    start = i;
    cur = d;
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// Launch: blocks one after the other, threads as fibers.

inline void trampoline() {
  yield();  // parks at the start: the first resume runs the kernel
  block()->body();
  Block& b = *block();
  Fiber& f = me();
  f.done = true;
  f.state = kDone;
  b.live--;
  const int w = f.linear >> 5;
  b.warp_done[w]++;
  if (b.warp_arrived[w]) {
    std::string at = "a collective";
    for (int l = 32 * w; l < 32 * w + warp_lanes(b, w); ++l)
      if (b.fibers[l].state == kAtWarp) at = point_name(cur_slot(b.fibers[l]));
    set_error("collective reached divergently: warp " + std::to_string(w) + ": lane " + std::to_string(f.linear & 31) +
              " finished while other lanes wait at " + at);
  }
  if (!f.wgmma.empty()) set_error("a thread ended with a wgmma not waited for");
  if (!f.stores.empty())
    set_error("a thread ended with a TMA store not waited for (cp.async.bulk.wait_group.read): its shared source "
              "may be gone before the store read it");
  _longjmp(b.sched_jb, 1);
}

template <typename Params>
std::string launch(void (*kernel)(const Params), const char* name, dim3 grid, int threads,
                   int smem_bytes, const Params& p);

}  // namespace ssa_emu

// CUDA builtins the kernels use
namespace ssa_emu {
struct Builtin {
  static const uint3& thread_idx() { return me().tid; }
  static const uint3& block_idx() { return block()->block_idx; }
  static const dim3& grid_dim() { return block()->grid_dim; }
};
}  // namespace ssa_emu

#undef __global__
#define __global__
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__
#undef __grid_constant__
#define __grid_constant__
#define threadIdx (::ssa_emu::Builtin::thread_idx())
#define blockIdx (::ssa_emu::Builtin::block_idx())
#define gridDim (::ssa_emu::Builtin::grid_dim())
#define __syncthreads() ::ssa_emu::syncthreads()
#define __syncthreads_or(pred) ::ssa_emu::syncthreads_or(pred)
// Fibers run one at a time: an atomic add is a plain one. Its order across threads follows the
// (shuffled) schedule and across blocks the (shuffled) block order, as on a GPU.
inline float atomicAdd(float* addr, float v) {
  const float old = *addr;
  *addr = old + v;
  return old;
}
#define __shfl_xor_sync(mask, v, off) ::ssa_emu::shfl_xor((v), (off))
#define __trap() std::abort()

inline float ssa_emu_int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
#define __int_as_float(i) ssa_emu_int_as_float(i)
#define __fdividef(a, b) ((a) / (b))
inline int ssa_emu_float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
#define __float_as_int(f) ssa_emu_float_as_int(f)
using std::max;
using std::min;


namespace ssa_emu {

template <typename Params>
std::string launch(void (*kernel)(const Params), const char* name, dim3 grid, int threads,
                   int smem_bytes, const Params& p) {
  if (smem_bytes > static_cast<int>(sizeof(ssa_flash::smem_raw))) return std::string(name) + ": smem too big";
  config().count_launch(name);
  std::mt19937 rng(config().seed);
  constexpr size_t kStack = 512 * 1024;
  // blocks one after the other, in a shuffled order when threads are shuffled (a GPU runs them
  // in no promised order; the order of atomic adds from different blocks follows it)
  std::vector<uint3> blocks;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) blocks.push_back(make_uint3(x, y, z));
  if (config().shuffle) std::shuffle(blocks.begin(), blocks.end(), rng);
  for (const uint3& bi : blocks) {
    const unsigned x = bi.x, y = bi.y, z = bi.z;
    {
      {
        std::memset(ssa_flash::smem_raw, 0xff, smem_bytes);  // NaN in every 16- and 32-bit float
        Block b;
        b.block_idx = make_uint3(x, y, z);
        b.grid_dim = grid;
        b.block_dim = dim3(threads, 1, 1);
        b.body = [&]() { kernel(p); };
        b.fibers.resize(threads);
        b.mma_cache.resize((threads + 31) / 32);
        b.threads = b.live = threads;
        b.warp_arrived.assign((threads + 31) / 32, 0);
        b.warp_done.assign((threads + 31) / 32, 0);
        b.wg_arrived.assign((threads + 127) / 128, 0);
        static std::vector<std::vector<char>> stacks;  // reused by every block
        if (static_cast<int>(stacks.size()) < threads) stacks.resize(threads);
        block() = &b;
        for (int i = 0; i < threads; ++i) {
          Fiber& f = b.fibers[i];
          f.linear = i;
          f.tid = make_uint3(i, 0, 0);
          stacks[i].resize(kStack);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = stacks[i].data();
          f.ctx.uc_stack.ss_size = kStack;
          f.ctx.uc_link = &b.sched;
          makecontext(&f.ctx, trampoline, 0);
          b.cur = i;
          ucontext_t here;
          if (_setjmp(b.sched_jb) == 0) swapcontext(&here, &f.ctx);  // runs up to the park
        }
        std::vector<int> order(threads);
        std::iota(order.begin(), order.end(), 0);
        std::string error;
        const std::string where = " (block " + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + ")";
        // passes over the threads (in a shuffled order), each running every runnable one up to its next
        // wait; a pass that finds none runnable with threads unfinished is a deadlock
        while (true) {
          if (config().shuffle) std::shuffle(order.begin(), order.end(), rng);
          int ran = 0;
          for (int i : order) {
            if (b.fibers[i].state != kRunnable) continue;
            b.cur = i;
            ++ran;
            if (_setjmp(b.sched_jb) == 0) _longjmp(b.fibers[i].jb, 1);
            if (!b.error.empty()) break;
          }
          if (!b.error.empty()) {
            error = std::string(name) + ": " + b.error + where;
            break;
          }
          if (b.live == 0) break;
          if (ran == 0) {
            error = std::string(name) + where + ": " + describe_deadlock(b);
            break;
          }
        }
        for (const Mbar& m : b.mbars)
          if (error.empty() && !m.lazy.empty())
            error = std::string(name) + ": the block ended with TMA loads whose mbarrier phase never completed" + where;
        block() = nullptr;
        if (!error.empty()) return error;
      }
    }
  }
  return std::string();
}

}  // namespace ssa_emu
