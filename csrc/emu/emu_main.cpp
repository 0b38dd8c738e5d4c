// C entry points of the CPU emulation (see emu_runtime.h), for ctypes: runs the real launch code
// of launch_impl.h (head-dim dispatch, tile traits, grids) and the real kernels on host memory.
//
// Build (tests/test_csrc_compile.py does this):
//   c++ -std=c++17 -O1 -shared -fPIC -DSSA_FLASH_EMULATE -I csrc -I <cuda>/include \
//       csrc/emu/emu_main.cpp -o libssa_emu.so
#ifndef SSA_FLASH_EMULATE
#define SSA_FLASH_EMULATE 1
#endif

#include <string>

#include "../launch_impl.h"

namespace {

std::string& last_error() {
  static std::string e;
  return e;
}

// ints: B, H, Hkv, group, Lq, Lk, D, Dv, causal, mask_kind, mask strides (4), then (b, h, row)
// strides of q, k, v, o, dout, dq, dk, dv (8 x 3), stat_rows, dropout keep31, window_size (2)
template <typename P>
void fill(P& p, const long long* iv, double scale, void* const* ptr, double drop_scale) {
  p.batch = static_cast<int>(iv[0]);
  p.heads = static_cast<int>(iv[1]);
  p.heads_kv = static_cast<int>(iv[2]);
  p.group = static_cast<int>(iv[3]);
  p.len_q = static_cast<int>(iv[4]);
  p.len_k = static_cast<int>(iv[5]);
  p.dim = static_cast<int>(iv[6]);
  p.dim_v = static_cast<int>(iv[7]);
  p.causal = iv[8] != 0;
  p.mask_kind = static_cast<int>(iv[9]);
  p.mask_sb = iv[10];
  p.mask_sh = iv[11];
  p.mask_sm = iv[12];
  p.mask_sn = iv[13];
  p.scale = static_cast<float>(scale);
  p.mask = ptr[18];
  p.ssa_b = static_cast<const float*>(ptr[19]);
  p.ssa_n = static_cast<const float*>(ptr[20]);
  p.drop_rng = static_cast<const int64_t*>(ptr[22]);
  p.drop_keep_below = static_cast<uint32_t>(2 * iv[39]);
  p.drop_scale = static_cast<float>(drop_scale);
  ssa_flash::set_band(p, iv[40], iv[41]);
}

}  // namespace

// ptr: q, k, v, o, dout, dq, dk, dv, lse, dlse, rowstat, beta, lse_l, entropy, dbeta_dh, (unused),
//      db_part, dn_part, mask, b, n, dq_accum, dropout rng (int64 seed, offset; or null);
// iv[38]: stat_rows (backward), iv[39]: dropout keep31, iv[40], iv[41]: window_size
// deterministic: the backward's plan (launch.h); dq_accum must then be given iff the plan is fused
extern "C" const char* ssa_emu_run(int op, int bf16, int ssa, int adaptive, const long long* iv,
                                   double scale, void* const* ptr, int lazy_copies, unsigned seed,
                                   int deterministic, double drop_scale) {
  using namespace ssa_flash;
  ssa_emu::config().lazy_copies = lazy_copies != 0;
  ssa_emu::config().seed = seed;
  ssa_emu::config().shuffle = seed != 0;
  const long long* st = iv + 14;
  std::string err;
  if (op == 0 || op == 1) {  // forward / statistics
    FwdParams p{};
    fill(p, iv, scale, ptr, drop_scale);
    p.q = ptr[0];
    p.k = ptr[1];
    p.v = ptr[2];
    p.o = ptr[3];
    p.q_sb = st[0]; p.q_sh = st[1]; p.q_sm = st[2];
    p.k_sb = st[3]; p.k_sh = st[4]; p.k_sm = st[5];
    p.v_sb = st[6]; p.v_sh = st[7]; p.v_sm = st[8];
    p.o_sb = st[9]; p.o_sh = st[10]; p.o_sm = st[11];
    p.lse = static_cast<float*>(op == 0 ? ptr[8] : ptr[12]);
    p.beta = static_cast<const float*>(ptr[11]);
    p.entropy = static_cast<float*>(ptr[13]);
    if (op == 0)
      err = bf16 ? detail::run_fwd<__nv_bfloat16>(p, ssa, adaptive, nullptr)
                 : detail::run_fwd<__half>(p, ssa, adaptive, nullptr);
    else
      err = bf16 ? detail::run_stats<__nv_bfloat16>(p, ssa, nullptr) : detail::run_stats<__half>(p, ssa, nullptr);
  } else {
    BwdParams p{};
    fill(p, iv, scale, ptr, drop_scale);
    p.q = ptr[0];
    p.k = ptr[1];
    p.v = ptr[2];
    p.o = ptr[3];
    p.dout = ptr[4];
    p.dq = ptr[5];
    p.dk = ptr[6];
    p.dv = ptr[7];
    p.q_sb = st[0]; p.q_sh = st[1]; p.q_sm = st[2];
    p.k_sb = st[3]; p.k_sh = st[4]; p.k_sm = st[5];
    p.v_sb = st[6]; p.v_sh = st[7]; p.v_sm = st[8];
    p.o_sb = st[9]; p.o_sh = st[10]; p.o_sm = st[11];
    p.do_sb = st[12]; p.do_sh = st[13]; p.do_sm = st[14];
    p.dq_sb = st[15]; p.dq_sh = st[16]; p.dq_sm = st[17];
    p.dk_sb = st[18]; p.dk_sh = st[19]; p.dk_sm = st[20];
    p.dv_sb = st[21]; p.dv_sh = st[22]; p.dv_sm = st[23];
    p.lse = static_cast<const float*>(ptr[8]);
    p.dlse = static_cast<const float*>(ptr[9]);
    p.rowstat = static_cast<float*>(ptr[10]);
    p.stat_rows = static_cast<int>(iv[38]);
    p.beta = static_cast<const float*>(ptr[11]);
    p.lse_l = static_cast<const float*>(ptr[12]);
    p.entropy = static_cast<const float*>(ptr[13]);
    p.dbeta_dh = static_cast<const float*>(ptr[14]);
    p.db_part = static_cast<float*>(ptr[16]);
    p.dn_part = static_cast<float*>(ptr[17]);
    p.dq_accum = static_cast<float*>(ptr[21]);
    const bool unfused = p.drop_rng != nullptr || p.window;
    const BwdPlan plan = bf16 ? detail::plan_bwd<__nv_bfloat16>(p.dim, p.dim_v, p.len_q, p.len_k, ssa, adaptive, deterministic, unfused)
                              : detail::plan_bwd<__half>(p.dim, p.dim_v, p.len_q, p.len_k, ssa, adaptive, deterministic, unfused);
    if (plan.fused != (p.dq_accum != nullptr)) err = "dq_accum given or missing against the plan";
    else err = bf16 ? detail::run_bwd<__nv_bfloat16>(p, ssa, adaptive, plan, nullptr)
                    : detail::run_bwd<__half>(p, ssa, adaptive, plan, nullptr);
  }
  last_error() = err;
  return last_error().c_str();
}

// The backward's plan (launch.h): out = {fused, num_partials, stat_rows, stat_count, accum_cols}.
extern "C" void ssa_emu_bwd_plan(int dim, int dim_v, int len_q, int len_k, int ssa, int adaptive, int deterministic,
                                 int bf16, int unfused_features, int* out) {
  using namespace ssa_flash;
  const BwdPlan plan = bf16 ? detail::plan_bwd<__nv_bfloat16>(dim, dim_v, len_q, len_k, ssa, adaptive, deterministic, unfused_features)
                            : detail::plan_bwd<__half>(dim, dim_v, len_q, len_k, ssa, adaptive, deterministic, unfused_features);
  out[0] = plan.fused;
  out[1] = plan.num_partials;
  out[2] = plan.stat_rows;
  out[3] = plan.stat_count;
  out[4] = plan.accum_cols;
}

// wgmma operations issued (per thread) in this process so far, by any emulator library loaded
// (emu_runtime.h, Config): it grows only while a kernel runs its sm_90a path.
extern "C" long ssa_emu_wgmma_issued() { return ssa_emu::config().wgmma_issued; }
