// The torch binding: the only file of csrc/ that includes torch. It checks what a tensor alone
// tells (device, dtype, shape against the others, strides, alignment), describes the call as an
// AttnCall and allocates the outputs; the checks on sizes and flags, the parameter structs, the
// backward's plan and its workspaces' shapes are the torch-free set_params.h, shared with the CPU
// emulator (emu/emu_main.cpp). Layout preparation (padding odd head dims to a multiple of 8,
// making the head dim contiguous, compacting masks, applying a negative scale to -q) is done by
// the Python wrapper, ssa_flash/backends/cuda_backend.py.
//
// It deliberately includes no c10/cuda header: the caller passes the CUDA stream (as an integer,
// torch.cuda.current_stream().cuda_stream) and makes the tensors' device current, so this file
// also compiles against the headers of a CPU-only torch (the CI compile check).
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "set_params.h"

namespace {

using at::Tensor;
using c10::optional;
using ssa_flash::AttnCall;
using ssa_flash::Operand;

void check_qkv_like(const Tensor& t, const char* name, const Tensor& q) {
  TORCH_CHECK(t.is_cuda(), "ssa_flash: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.device() == q.device(), "ssa_flash: ", name, " is on ", t.device(), ", query on ", q.device());
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "ssa_flash: ", name, " has dtype ", t.scalar_type(),
              ", query ", q.scalar_type());
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "ssa_flash CUDA kernels take float16 or bfloat16, got ", t.scalar_type(), " for ", name);
  TORCH_CHECK(t.dim() == 4, "ssa_flash: ", name, " must be 4-D (B, H, L, D)");
  TORCH_CHECK(t.size(3) % 8 == 0 && t.size(3) > 0 && t.size(3) <= 256, "ssa_flash: ", name,
              "'s head dim must be a positive multiple of 8, at most 256 (got ", t.size(3), ")");
  TORCH_CHECK(t.stride(3) == 1, "ssa_flash: ", name, " must be contiguous along the head dim");
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(t.size(i) == 1 || t.stride(i) % 8 == 0, "ssa_flash: ", name,
                "'s strides must be multiples of 8 elements (16 bytes)");
  }
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, "ssa_flash: ", name,
              " must be 16-byte aligned");
}

void check_stat(const optional<Tensor>& t, const char* name, const Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->is_cuda() && t->device() == q.device(), "ssa_flash: ", name, " must be on ", q.device());
  TORCH_CHECK(t->scalar_type() == at::kFloat, "ssa_flash: ", name, " must be float32");
  TORCH_CHECK(t->is_contiguous(), "ssa_flash: ", name, " must be contiguous");
  TORCH_CHECK(t->dim() == 3 && t->size(0) == q.size(0) && t->size(1) == q.size(1) && t->size(2) == q.size(2),
              "ssa_flash: ", name, " must have shape (B, H, Lq)");
}

float* stat_ptr(const optional<Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

Operand operand(const Tensor& t) { return Operand{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

// Per-head tensors ((H,) contiguous float32 on q's device): the score function's parameters and
// the sinks.
const float* head_tensor(const Tensor& t, const char* name, const Tensor& q) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == 1 && t.size(0) == q.size(1),
              "ssa_flash: ", name, " must be a contiguous float32 (H,) tensor on ", q.device());
  return t.data_ptr<float>();
}

// The call described from the tensors and the options every pass takes, as the Python side
// (ssa_flash/backends/cuda_backend.py) passes them from the AttentionSpec (ssa_flash/spec.py): score
// (the registry id) with its per-head parameters `params` (in the registry's order), scale (>= 0:
// the Python side applies a negative one to -q), causal, group, window_left / window_right
// (ssa_flash/conventions.py kernel_window's band, both -1 without a window), softcap (0: off), dropout as ssa_flash/conventions.py
// encodes it (drop_keep31, drop_scale) with drop_rng, the int64 (seed, offset) on the device, or
// none; mask (boolean / uint8, or float32 additive, expanded to (B, H, Lq, Lk), any strides; its
// kind is its dtype); sinks. The value checks (set_params.h, check_call) run once per call, in the
// pass, before any allocation; this checks the tensors.
AttnCall describe(const Tensor& q, const Tensor& k, int64_t dim_v, const optional<Tensor>& mask,
                  const std::vector<Tensor>& params, const optional<Tensor>& sinks, int64_t score, double scale,
                  bool causal, int64_t group, int64_t window_left, int64_t window_right, double softcap) {
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "ssa_flash: key does not match query");
  AttnCall c{};
  c.batch = q.size(0);
  c.heads = q.size(1);
  c.heads_kv = k.size(1);
  c.group = group;
  c.len_q = q.size(2);
  c.len_k = k.size(2);
  c.dim = q.size(3);
  c.dim_v = dim_v;
  c.bf16 = q.scalar_type() == at::kBFloat16;
  c.score = score;
  c.scale = scale;
  c.causal = causal;
  c.window_left = window_left;
  c.window_right = window_right;
  c.softcap = softcap;
  c.q = operand(q);
  c.k = operand(k);
  c.mask_kind = ssa_flash::kMaskNone;
  if (mask.has_value()) {
    const Tensor& m = *mask;
    TORCH_CHECK(m.is_cuda() && m.device() == q.device(), "ssa_flash: mask must be on ", q.device());
    TORCH_CHECK(m.dim() == 4 && m.size(0) == q.size(0) && m.size(1) == q.size(1) && m.size(2) == q.size(2) &&
                    m.size(3) == k.size(2),
                "ssa_flash: mask must be expanded to (B, H, Lq, Lk)");
    if (m.scalar_type() == at::kBool || m.scalar_type() == at::kByte) {
      c.mask_kind = ssa_flash::kMaskBool;
    } else {
      TORCH_CHECK(m.scalar_type() == at::kFloat, "ssa_flash: a mask is boolean (bool / uint8) or float32 additive, got ",
                  m.scalar_type());
      c.mask_kind = ssa_flash::kMaskAdd;
    }
    c.mask = m.data_ptr();
    c.mask_sb = m.stride(0);
    c.mask_sh = m.stride(1);
    c.mask_sm = m.stride(2);
    c.mask_sn = m.stride(3);
  }
  TORCH_CHECK(params.size() <= ssa_flash::kMaxScoreParams, "ssa_flash: at most ", ssa_flash::kMaxScoreParams,
              " score parameters, got ", params.size());
  for (size_t i = 0; i < params.size(); ++i) c.score_param[i] = head_tensor(params[i], "a score parameter", q);
  if (sinks.has_value()) c.sinks = head_tensor(*sinks, "sinks", q);
  return c;
}

// Dropout on a described call: the keep threshold and scale of ssa_flash/conventions.py, the
// (seed, offset) tensor; none without the tensor.
void set_dropout(AttnCall& c, const Tensor& q, int64_t drop_keep31, double drop_scale, const optional<Tensor>& rng) {
  if (!rng.has_value()) return;
  TORCH_CHECK(rng->is_cuda() && rng->device() == q.device() && rng->scalar_type() == at::kLong &&
                  rng->numel() == 2 && rng->is_contiguous(),
              "ssa_flash: the dropout rng must be a contiguous int64 (2,) tensor (seed, offset) on ", q.device());
  c.drop_rng = rng->data_ptr<int64_t>();
  c.drop_keep31 = drop_keep31;
  c.drop_scale = drop_scale;
}

// A learned additive mask's gradient (bwd's dmask: (1 or B, 1 or H, Lq, Lk) contiguous float32,
// written by the mask kernel, mask_grad.h); check_call checks its dims against the call.
void set_mask_grad(AttnCall& c, const optional<Tensor>& dmask, const Tensor& q, const Tensor& k) {
  if (!dmask.has_value()) return;
  const Tensor& g = *dmask;
  TORCH_CHECK(g.is_cuda() && g.device() == q.device() && g.scalar_type() == at::kFloat && g.is_contiguous() &&
                  g.dim() == 4 && g.size(2) == q.size(2) && g.size(3) == k.size(2),
              "ssa_flash: dmask must be a contiguous float32 (1 or B, 1 or H, Lq, Lk) tensor on ", q.device());
  c.dmask = g.data_ptr<float>();
  c.dmask_batch = g.size(0);
  c.dmask_heads = g.size(1);
}

// check_call, once per call, before the pass allocates anything
void check(const AttnCall& c) {
  const std::string why = ssa_flash::check_call(c);
  TORCH_CHECK(why.empty(), "ssa_flash: ", why);
}

void raise_if(const std::string& err) { TORCH_CHECK(err.empty(), "ssa_flash CUDA kernel: ", err); }

cudaStream_t as_stream(int64_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                               const std::vector<Tensor>& params, const optional<Tensor>& sinks,
                               const optional<Tensor>& beta, int64_t score, double scale, bool causal, int64_t group,
                               int64_t window_left, int64_t window_right, double softcap, int64_t drop_keep31,
                               double drop_scale, const optional<Tensor>& drop_rng, int64_t stream_handle) {
  check_qkv_like(q, "query", q);
  check_qkv_like(k, "key", q);
  check_qkv_like(v, "value", q);
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "ssa_flash: value does not match key");
  check_stat(beta, "beta", q);
  AttnCall c = describe(q, k, v.size(3), mask, params, sinks, score, scale, causal, group, window_left, window_right,
                        softcap);
  set_dropout(c, q, drop_keep31, drop_scale, drop_rng);
  c.beta = stat_ptr(beta);
  check(c);
  Tensor o = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  c.v = operand(v);
  c.o = operand(o);
  c.lse = lse.data_ptr<float>();
  raise_if(ssa_flash::launch_forward(c, as_stream(stream_handle)));
  return {o, lse};
}

std::tuple<Tensor, Tensor> row_entropy(const Tensor& q, const Tensor& k, const optional<Tensor>& mask,
                                       const std::vector<Tensor>& params, const optional<Tensor>& sinks,
                                       int64_t score, double scale, bool causal, int64_t group, int64_t window_left,
                                       int64_t window_right, double softcap, int64_t stream_handle) {
  check_qkv_like(q, "query", q);
  check_qkv_like(k, "key", q);
  // (the statistics are of the undropped rows)
  AttnCall c = describe(q, k, q.size(3), mask, params, sinks, score, scale, causal, group, window_left, window_right,
                        softcap);
  check(c);
  Tensor ent = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  Tensor lse = at::empty_like(ent);
  c.lse = lse.data_ptr<float>();
  c.entropy = ent.data_ptr<float>();
  raise_if(ssa_flash::launch_row_entropy(c, as_stream(stream_handle)));
  return {ent, lse};
}

// the backward kernels keep query-tile offsets in 32 bits (params.h): row strides >= 2^26
// elements (a layout such as (L, B, H, D) with a huge B * H * D) are made contiguous
Tensor small_row_stride(const Tensor& t) { return t.stride(2) < (int64_t(1) << 26) ? t : t.contiguous(); }

at::IntArrayRef shape(const int64_t* dims, size_t n) { return at::IntArrayRef(dims, n); }

// Returns dq, dk, dv (padded head dims, like the inputs), the (B, H, num_partials) partial sums
// of each score parameter's gradient (one per parameter; the caller sums them over (0, 2)) and
// the row-statistics workspace (B, H, stat_rows, 2 or 6: bwd_kernel.h, RowStat), from which the
// caller reduces the sinks' gradient (ssa_flash/backends/cuda_backend.py).
// dq is the float32 accumulator (B, H, stat_rows, accum_cols) of dQ / scale when the backward
// ran fused (set_params.h, bwd_buffers); the caller crops, scales and converts it. deterministic:
// the two-kernel path (bitwise reproducible); else the fused kernel where the device and head dim
// allow it, or the sm_90a one where the build holds it, it is switched on and takes the call
// (launch.h, BwdPlan: the fused kernel's buffers, its own num_partials). beta, lse_l, entropy, dbeta_dh: the adaptive temperature's (all or
// none). dmask: a learned additive mask's gradient, written after the backward (set_mask_grad,
// mask_grad.h).
std::tuple<Tensor, Tensor, Tensor, std::vector<Tensor>, Tensor> bwd(
    const Tensor& dout_in, const Tensor& q_in, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
    const optional<Tensor>& dlse, const optional<Tensor>& mask, const std::vector<Tensor>& params,
    const optional<Tensor>& sinks, const optional<Tensor>& beta, const optional<Tensor>& lse_l,
    const optional<Tensor>& entropy, const optional<Tensor>& dbeta_dh, int64_t score, double scale, bool causal,
    int64_t group, int64_t window_left, int64_t window_right, double softcap, int64_t drop_keep31, double drop_scale,
    const optional<Tensor>& drop_rng, bool deterministic, int64_t stream_handle, const optional<Tensor>& dmask) {
  check_qkv_like(q_in, "query", q_in);
  check_qkv_like(dout_in, "grad_out", q_in);
  const Tensor q = small_row_stride(q_in);
  const Tensor dout = small_row_stride(dout_in);
  check_qkv_like(k, "key", q);
  check_qkv_like(v, "value", q);
  check_qkv_like(o, "out", q);
  TORCH_CHECK(o.sizes() == dout.sizes() && o.size(0) == q.size(0) && o.size(1) == q.size(1) &&
                  o.size(2) == q.size(2) && o.size(3) == v.size(3),
              "ssa_flash: out / grad_out shapes do not match");
  check_stat(lse, "lse", q);
  check_stat(dlse, "grad_lse", q);
  check_stat(beta, "beta", q);
  check_stat(lse_l, "lse_l", q);
  check_stat(entropy, "entropy", q);
  check_stat(dbeta_dh, "dbeta_dh", q);
  TORCH_CHECK(beta.has_value() == lse_l.has_value() && beta.has_value() == entropy.has_value() &&
                  beta.has_value() == dbeta_dh.has_value(),
              "ssa_flash: give all of beta, lse_l, entropy, dbeta_dh or none");
  AttnCall c = describe(q, k, v.size(3), mask, params, sinks, score, scale, causal, group, window_left, window_right,
                        softcap);
  set_dropout(c, q, drop_keep31, drop_scale, drop_rng);
  c.deterministic = deterministic;
  c.beta = stat_ptr(beta);
  set_mask_grad(c, dmask, q, k);
  check(c);
  c.v = operand(v);
  c.o = operand(o);
  c.dout = operand(dout);
  c.lse = lse.data_ptr<float>();
  c.dlse = stat_ptr(dlse);
  c.lse_l = stat_ptr(lse_l);
  c.entropy = stat_ptr(entropy);
  c.dbeta_dh = stat_ptr(dbeta_dh);
  const ssa_flash::BwdPlan plan = ssa_flash::plan_backward(c);
  const ssa_flash::BwdBuffers buf = ssa_flash::bwd_buffers(c, plan);
  auto f32 = q.options().dtype(at::kFloat);
  Tensor dq = plan.fused ? at::zeros(shape(buf.dq_accum, 4), f32) : at::empty(q.sizes(), q.options());
  Tensor dk = at::empty(k.sizes(), k.options());
  Tensor dv = at::empty(v.sizes(), v.options());
  Tensor rowstat = at::empty(shape(buf.rowstat, 4), f32);
  std::vector<Tensor> parts;
  for (int64_t i = 0; i < buf.nparams; ++i) {
    parts.push_back(at::empty(shape(buf.partials, 3), f32));
    c.dparam_part[i] = parts.back().data_ptr<float>();
  }
  if (plan.fused) c.dq_accum = dq.data_ptr<float>();
  else c.dq = operand(dq);
  c.dk = operand(dk);
  c.dv = operand(dv);
  c.rowstat = rowstat.data_ptr<float>();
  Tensor lse_lo = at::empty(shape(buf.lse_lo, 4), f32);  // (additive masks; zero-size otherwise)
  if (lse_lo.numel() > 0) c.lse_lo = lse_lo.data_ptr<float>();
  raise_if(ssa_flash::launch_backward(c, plan, as_stream(stream_handle)));
  return {dq, dk, dv, parts, rowstat};
}

// ---- the sm_90a warp-specialised forward's run-time switch (issue 48; csrc/hopper/tma_cache.h) ----
// on: True / False sets it, None leaves it; mufu: the sweep's MUFU budget (8 * ex2 + lg2 eighths
// on the FMA pipe, 0 all on MUFU), None leaves it. Returns {"built": the build holds the kernel,
// "enabled": the switch, "hits" / "misses" / "patches" / "entries": its tensor-map cache, "mufu":
// the budget, "mufu_sweep": the build holds the sweep's instances}.
py::dict hopper_fwd(optional<bool> on, optional<int64_t> mufu) {
  long stats[6] = {0, 0, 0, 0, 0, 0};
  TORCH_CHECK(!mufu.has_value() || (*mufu >= 0 && *mufu < 64), "ssa_flash: mufu must be 8 * ex2 + lg2 eighths, got ",
              *mufu);
  const int state = ssa_flash::hopper_fwd_control(on.has_value() ? int(*on) : -1,
                                                  mufu.has_value() ? int(*mufu) : -1, stats);
  py::dict d;
  d["built"] = state >= 0;
  d["enabled"] = state == 1;
  d["hits"] = stats[0];
  d["misses"] = stats[1];
  d["patches"] = stats[2];
  d["entries"] = stats[3];
  d["mufu"] = stats[4];
  d["mufu_sweep"] = stats[5] != 0;
  return d;
}
// ---- end of the sm_90a forward's switch ----

// ---- the sm_90a backward's run-time switch (issue 48; csrc/hopper/bwd_launch.h) ----
// on: True / False sets it, None leaves it. Returns {"built": the build holds the kernel,
// "enabled": the switch}. (Its tensor maps share the forward's cache: hopper_fwd()'s counters.)
py::dict hopper_bwd(optional<bool> on) {
  const int state = ssa_flash::hopper_bwd_control(on.has_value() ? int(*on) : -1);
  py::dict d;
  d["built"] = state >= 0;
  d["enabled"] = state == 1;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ssa_flash CUDA kernels (see ssa_flash/backends/cuda_backend.py for the Python side)";
  m.def("fwd", &fwd, "attention forward: (out, lse)", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("params"), py::arg("sinks"), py::arg("beta"), py::arg("score"), py::arg("scale"), py::arg("causal"),
        py::arg("group"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("drop_keep31"), py::arg("drop_scale"), py::arg("drop_rng"), py::arg("stream"));
  m.def("row_entropy", &row_entropy, "row-entropy pass: (entropy, lse) of softmax(l)", py::arg("q"), py::arg("k"),
        py::arg("mask"), py::arg("params"), py::arg("sinks"), py::arg("score"), py::arg("scale"), py::arg("causal"),
        py::arg("group"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"), py::arg("stream"));
  m.def("bwd", &bwd, "attention backward: (dq, dk, dv, [dparam partials], rowstat)", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dlse"), py::arg("mask"),
        py::arg("params"), py::arg("sinks"), py::arg("beta"), py::arg("lse_l"), py::arg("entropy"),
        py::arg("dbeta_dh"), py::arg("score"), py::arg("scale"), py::arg("causal"), py::arg("group"),
        py::arg("window_left"), py::arg("window_right"), py::arg("softcap"), py::arg("drop_keep31"),
        py::arg("drop_scale"), py::arg("drop_rng"), py::arg("deterministic"), py::arg("stream"),
        py::arg("dmask") = py::none());
  m.def("hopper_fwd", &hopper_fwd, "the sm_90a warp-specialised forward's run-time switch and tensor-map cache",
        py::arg("on") = py::none(), py::arg("mufu") = py::none());
  m.def("hopper_bwd", &hopper_bwd, "the sm_90a warp-specialised backward's run-time switch", py::arg("on") = py::none());
}
