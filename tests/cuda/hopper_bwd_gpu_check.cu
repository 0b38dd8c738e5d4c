// The sm_90a backward on a GPU, without torch (its launcher called directly): random bf16 inputs,
// today's forward for o and lse, then today's fused backward and the Hopper one on the same call;
// prints the largest differences of dq (the float32 accumulator), dk, dv and the score
// parameters' gradients (SSA: db, dn, summed over the partials) relative to the largest value,
// and both backwards' times and TFLOP/s (10 D FLOPs per visited score: 5 GEMMs). A check to run
// where a GPU is lent, not part of the CPU suite:
//
//   nvcc -arch=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -DSSA_FLASH_EXTRAS=0 \
//        -DSSA_FLASH_HEAD_DIM_32=0 -DSSA_FLASH_HEAD_DIM_96=0 -DSSA_FLASH_HEAD_DIM_256=0 \
//        -I csrc tests/cuda/hopper_bwd_gpu_check.cu -o /tmp/hbwd_check
//   /tmp/hbwd_check B H Hkv L D score causal     (score 0 softmax, 1 SSA; e.g. 1 16 16 16384 128 1 0)
//
// Exit status 0 when every relative difference is below 2e-2 (bf16 inputs, float32 sums in a
// different order), 1 otherwise, 2 on a CUDA or launch error.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "hopper/bwd_launch.h"
#include "launch_impl.h"  // today's kernels
#include "set_params.h"

using namespace ssa_flash;

namespace ssa_flash {
// (defined by fwd_fp16.cu in the extension)
int score_param_count(int score) {
  return known_score(score) ? score_switch(score, [](auto S) { return decltype(S)::kParams; }) : -1;
}
}  // namespace ssa_flash

namespace {

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                    \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

void check(const std::string& err) {
  if (!err.empty()) {
    std::fprintf(stderr, "%s\n", err.c_str());
    std::exit(2);
  }
}

template <typename T>
T* device(const std::vector<T>& host) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, host.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> host(const T* d, size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

float to_f(float x) { return x; }
float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// max |a - b| / max(1e-6, max |b|)
template <typename T>
double rel_diff(const std::vector<T>& a, const std::vector<T>& b) {
  double num = 0.0, den = 1e-6;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(to_f(a[i])) - to_f(b[i])));
    den = std::max(den, std::abs(static_cast<double>(to_f(b[i]))));
  }
  return num / den;
}

Operand operand(void* p, int64_t H, int64_t L, int64_t D) { return Operand{p, H * L * D, L * D, D}; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s B H Hkv L D score(0 softmax, 1 ssa) causal\n", argv[0]);
    return 2;
  }
  const int64_t B = std::atoi(argv[1]), H = std::atoi(argv[2]), Hkv = std::atoi(argv[3]), L = std::atoi(argv[4]),
                D = std::atoi(argv[5]), score = std::atoi(argv[6]), causal = std::atoi(argv[7]);
  using T = __nv_bfloat16;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  auto randn = [&](int64_t n) {
    std::vector<T> v(n);
    for (auto& x : v) x = __float2bfloat16(normal(rng));
    return v;
  };
  T* q = device(randn(B * H * L * D));
  T* k = device(randn(B * Hkv * L * D));
  T* v = device(randn(B * Hkv * L * D));
  T* dout = device(randn(B * H * L * D));
  T* o = device(std::vector<T>(B * H * L * D));
  float* lse = device(std::vector<float>(B * H * L));
  std::vector<float> b(H), n(H);
  for (int h = 0; h < H; ++h) b[h] = 0.5f + 0.05f * h, n[h] = 1.0f + 0.1f * h;
  const float* params[2] = {device(b), device(n)};

  AttnCall c{};
  c.batch = B, c.heads = H, c.heads_kv = Hkv, c.group = H / Hkv, c.len_q = c.len_k = L, c.dim = c.dim_v = D;
  c.bf16 = 1, c.score = score, c.scale = 1.0 / std::sqrt(static_cast<double>(D)), c.causal = causal;
  c.window_left = c.window_right = -1;
  if (score == 1) c.score_param[0] = params[0], c.score_param[1] = params[1];
  c.q = operand(q, H, L, D), c.k = operand(k, Hkv, L, D), c.v = operand(v, Hkv, L, D);
  c.o = operand(o, H, L, D), c.dout = operand(dout, H, L, D), c.lse = lse;
  check(check_call(c));
  check(detail::run_fwd<T>(fwd_params(c), static_cast<int>(score), false, nullptr));

  // today's backward (fused where plan_backward says) and the Hopper one, each with its buffers
  struct Run {
    float *dq_accum, *rowstat, *part[2];
    T *dk, *dv;
    int num_partials;
  };
  const BwdPlan today = detail::plan_bwd<T>(static_cast<int>(D), static_cast<int>(D), static_cast<int>(L),
                                            static_cast<int>(L), static_cast<int>(score), false, false, false);
  const BwdPlan hop = hopper::hopper_bwd_plan(static_cast<int>(D), static_cast<int>(L), static_cast<int>(L), false);
  if (!today.fused) {
    std::fprintf(stderr, "today's plan is the two-kernel path here: compare needs the fused one\n");
    return 2;
  }
  auto alloc = [&](const BwdPlan& plan) {
    Run r{};
    r.num_partials = plan.num_partials;
    CHECK_CUDA(cudaMalloc(&r.dq_accum, B * H * plan.stat_rows * plan.accum_cols * 4));
    CHECK_CUDA(cudaMalloc(&r.rowstat, B * H * plan.stat_rows * plan.stat_count * 4));
    for (int i = 0; i < 2; ++i) CHECK_CUDA(cudaMalloc(&r.part[i], B * H * plan.num_partials * 4));
    CHECK_CUDA(cudaMalloc(&r.dk, B * Hkv * L * D * 2));
    CHECK_CUDA(cudaMalloc(&r.dv, B * Hkv * L * D * 2));
    return r;
  };
  Run rt = alloc(today), rh = alloc(hop);
  auto call_for = [&](const Run& r) {
    AttnCall cc = c;
    cc.dq_accum = r.dq_accum, cc.rowstat = r.rowstat, cc.dparam_part[0] = r.part[0], cc.dparam_part[1] = r.part[1];
    cc.dk = operand(r.dk, Hkv, L, D), cc.dv = operand(r.dv, Hkv, L, D);
    return cc;
  };
  auto run_today = [&]() {
    CHECK_CUDA(cudaMemsetAsync(rt.dq_accum, 0, B * H * today.stat_rows * today.accum_cols * 4));
    check(detail::run_bwd<T>(bwd_params(call_for(rt), today), static_cast<int>(score), false, today, nullptr));
  };
  const BwdParams ph = bwd_params(call_for(rh), hop);
  if (const char* why = hopper::hopper_bwd_unsupported(ph, static_cast<int>(score), false, 900, true)) {
    std::fprintf(stderr, "routed away: %s\n", why);
    return 2;
  }
  auto run_hopper = [&]() {
    CHECK_CUDA(cudaMemsetAsync(rh.dq_accum, 0, B * H * hop.stat_rows * hop.accum_cols * 4));
    check(hopper::run_hopper_bwd<T>(ph, static_cast<int>(score), false, nullptr));
  };
  run_today();
  run_hopper();
  CHECK_CUDA(cudaDeviceSynchronize());

  // the dq accumulators have the same shape (stat_rows, D); partials summed per head
  const size_t nq = B * H * today.stat_rows * D, nk = B * Hkv * L * D;
  double worst = 0.0;
  auto report = [&](const char* name, double d) {
    std::printf("%-4s relative difference %.3g\n", name, d);
    worst = std::max(worst, d);
  };
  report("dq", rel_diff(host(rh.dq_accum, nq), host(rt.dq_accum, nq)));
  report("dk", rel_diff(host(rh.dk, nk), host(rt.dk, nk)));
  report("dv", rel_diff(host(rh.dv, nk), host(rt.dv, nk)));
  for (int i = 0; i < (score == 1 ? 2 : 0); ++i) {
    std::vector<float> a(H, 0.0f), e(H, 0.0f);
    const auto ha = host(rh.part[i], B * H * hop.num_partials), he = host(rt.part[i], B * H * today.num_partials);
    for (int64_t bh = 0; bh < B * H; ++bh) {
      for (int j = 0; j < hop.num_partials; ++j) a[bh % H] += ha[bh * hop.num_partials + j];
      for (int j = 0; j < today.num_partials; ++j) e[bh % H] += he[bh * today.num_partials + j];
    }
    report(i == 0 ? "db" : "dn", rel_diff(a, e));
  }

  // times: 3 warm-up runs, then the mean of 10
  auto time = [&](auto&& fn) {
    for (int i = 0; i < 3; ++i) fn();
    cudaEvent_t t0, t1;
    CHECK_CUDA(cudaEventCreate(&t0));
    CHECK_CUDA(cudaEventCreate(&t1));
    CHECK_CUDA(cudaEventRecord(t0));
    for (int i = 0; i < 10; ++i) fn();
    CHECK_CUDA(cudaEventRecord(t1));
    CHECK_CUDA(cudaEventSynchronize(t1));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
    return ms / 10.0;
  };
  const double flops = 10.0 * D * B * H * L * L * (causal ? 0.5 : 1.0);
  const double ms_t = time(run_today), ms_h = time(run_hopper);
  std::printf("today's fused backward %.3f ms (%.1f TFLOP/s), hopper backward %.3f ms (%.1f TFLOP/s)\n", ms_t,
              flops / ms_t * 1e-9, ms_h, flops / ms_h * 1e-9);
  return worst < 2e-2 ? 0 : 1;
}
