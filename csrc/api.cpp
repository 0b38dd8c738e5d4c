// The torch binding: the only file of csrc/ that includes torch. It checks what the kernels
// assume (see params.h), allocates outputs, fills the parameter structs and launches on the
// stream it is given. Layout preparation (padding odd head dims to a multiple of 8, making the head
// dim contiguous, compacting masks) is done by the Python wrapper, ssa_flash/cuda.py.
//
// It deliberately includes no c10/cuda header: the caller passes the CUDA stream (as an integer,
// torch.cuda.current_stream().cuda_stream) and makes the tensors' device current, so this file
// also compiles against the headers of a CPU-only torch (the CI compile check).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>

#include "launch.h"
#include "params.h"

namespace {

using at::Tensor;
using c10::optional;

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

const float* stat_ptr(const optional<Tensor>& t) { return t.has_value() ? t->data_ptr<float>() : nullptr; }

// Sizes, scale, causality, window, mask and SSA parameters common to every launch. window_left /
// window_right: DESIGN.md 1.5's window_size (-1: that side unbounded).
void fill_shape(ssa_flash::AttnShape& s, const Tensor& q, const Tensor& k, int64_t dim_v,
                const optional<Tensor>& mask, int64_t mask_kind, const optional<Tensor>& b,
                const optional<Tensor>& n, double scale, bool causal, int64_t group, int64_t window_left,
                int64_t window_right) {
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), "ssa_flash: key does not match query");
  TORCH_CHECK(group >= 1 && q.size(1) == k.size(1) * group, "ssa_flash: query heads must be group * key heads");
  TORCH_CHECK(q.size(2) > 0 && k.size(2) > 0, "ssa_flash: empty sequences are handled by the caller");
  TORCH_CHECK(q.size(2) < (int64_t(1) << 31) && k.size(2) < (int64_t(1) << 31), "ssa_flash: sequence too long");
  s.batch = static_cast<int>(q.size(0));
  s.heads = static_cast<int>(q.size(1));
  s.heads_kv = static_cast<int>(k.size(1));
  s.group = static_cast<int>(group);
  s.len_q = static_cast<int>(q.size(2));
  s.len_k = static_cast<int>(k.size(2));
  s.dim = static_cast<int>(q.size(3));
  s.dim_v = static_cast<int>(dim_v);
  s.scale = static_cast<float>(scale);
  s.causal = causal;
  TORCH_CHECK(window_left >= -1 && window_right >= -1, "ssa_flash: window bounds must be >= -1, got (",
              window_left, ", ", window_right, ")");
  TORCH_CHECK(q.size(2) + k.size(2) < (int64_t(1) << 31) - 1024, "ssa_flash: sequences too long");
  ssa_flash::set_band(s, window_left, window_right);
  s.mask_kind = static_cast<int>(mask_kind);
  s.mask = nullptr;
  s.mask_sb = s.mask_sh = s.mask_sm = s.mask_sn = 0;
  if (mask_kind != ssa_flash::kMaskNone) {
    TORCH_CHECK(mask.has_value(), "ssa_flash: mask_kind set without a mask");
    const Tensor& m = *mask;
    TORCH_CHECK(m.is_cuda() && m.device() == q.device(), "ssa_flash: mask must be on ", q.device());
    TORCH_CHECK(m.dim() == 4 && m.size(0) == q.size(0) && m.size(1) == q.size(1) && m.size(2) == q.size(2) &&
                    m.size(3) == k.size(2),
                "ssa_flash: mask must be expanded to (B, H, Lq, Lk)");
    if (mask_kind == ssa_flash::kMaskBool) {
      TORCH_CHECK(m.scalar_type() == at::kByte || m.scalar_type() == at::kBool, "ssa_flash: boolean mask must be bool/uint8");
    } else {
      TORCH_CHECK(mask_kind == ssa_flash::kMaskAdd, "ssa_flash: unknown mask_kind ", mask_kind);
      TORCH_CHECK(m.scalar_type() == at::kFloat, "ssa_flash: additive mask must be float32");
    }
    s.mask = m.data_ptr();
    s.mask_sb = m.stride(0);
    s.mask_sh = m.stride(1);
    s.mask_sm = m.stride(2);
    s.mask_sn = m.stride(3);
  }
  TORCH_CHECK(b.has_value() == n.has_value(), "ssa_flash: give both b and n or neither");
  s.ssa_b = s.ssa_n = nullptr;
  if (b.has_value()) {
    for (const Tensor* t : {&*b, &*n}) {
      TORCH_CHECK(t->is_cuda() && t->device() == q.device() && t->scalar_type() == at::kFloat &&
                      t->is_contiguous() && t->dim() == 1 && t->size(0) == q.size(1),
                  "ssa_flash: b and n must be contiguous float32 (H,) tensors on ", q.device());
    }
    s.ssa_b = b->data_ptr<float>();
    s.ssa_n = n->data_ptr<float>();
  }
}

// Dropout (params.h): rng the int64 (seed, offset) on the device, keep31 = round((1 - p) 2^31)
// at most 2^31 - 1 (computed by the caller, ssa_flash.reference.dropout_keep_threshold, so every
// backend rounds alike), scale = 1 / (1 - p) (0 for p = 1). No rng: no dropout.
void fill_dropout(ssa_flash::AttnShape& s, const Tensor& q, const optional<Tensor>& rng, int64_t keep31,
                  double scale) {
  s.drop_rng = nullptr;
  s.drop_keep_below = 0;
  s.drop_scale = 0.0f;
  if (!rng.has_value()) return;
  TORCH_CHECK(rng->is_cuda() && rng->device() == q.device() && rng->scalar_type() == at::kLong &&
                  rng->numel() == 2 && rng->is_contiguous(),
              "ssa_flash: the dropout rng must be a contiguous int64 (2,) tensor (seed, offset) on ", q.device());
  TORCH_CHECK(keep31 >= 0 && keep31 < (int64_t(1) << 31), "ssa_flash: dropout keep31 out of range: ", keep31);
  TORCH_CHECK(std::isfinite(scale) && scale >= 0, "ssa_flash: dropout scale must be finite and >= 0");
  s.drop_rng = rng->data_ptr<int64_t>();
  s.drop_keep_below = static_cast<uint32_t>(2 * keep31);
  s.drop_scale = static_cast<float>(scale);
}

// The kernels take scale >= 0 (params.h: the forward's row max is taken on raw scores); a
// negative scale is applied as |scale| to -q (a copy; the caller negates dq back).
Tensor nonnegative_scale(const Tensor& q, double& scale) {
  TORCH_CHECK(std::isfinite(scale), "ssa_flash: scale must be finite, got ", scale);
  if (scale >= 0) return q;
  scale = -scale;
  return q.neg().contiguous();
}

void raise_if(const std::string& err) { TORCH_CHECK(err.empty(), "ssa_flash CUDA kernel: ", err); }

bool is_bf16(const Tensor& q) { return q.scalar_type() == at::kBFloat16; }

std::tuple<Tensor, Tensor> fwd(const Tensor& q_in, const Tensor& k, const Tensor& v, const optional<Tensor>& mask,
                               int64_t mask_kind, const optional<Tensor>& b, const optional<Tensor>& n,
                               const optional<Tensor>& beta, double scale, bool causal, int64_t group,
                               int64_t stream_handle, const optional<Tensor>& drop_rng, int64_t drop_keep31,
                               double drop_scale, int64_t window_left, int64_t window_right) {
  check_qkv_like(q_in, "query", q_in);
  const Tensor q = nonnegative_scale(q_in, scale);
  check_qkv_like(k, "key", q);
  check_qkv_like(v, "value", q);
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "ssa_flash: value does not match key");
  check_stat(beta, "beta", q);
  ssa_flash::FwdParams p{};
  fill_shape(p, q, k, v.size(3), mask, mask_kind, b, n, scale, causal, group, window_left, window_right);
  fill_dropout(p, q, drop_rng, drop_keep31, drop_scale);
  Tensor o = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_sm = q.stride(2);
  p.k_sb = k.stride(0); p.k_sh = k.stride(1); p.k_sm = k.stride(2);
  p.v_sb = v.stride(0); p.v_sh = v.stride(1); p.v_sm = v.stride(2);
  p.o_sb = o.stride(0); p.o_sh = o.stride(1); p.o_sm = o.stride(2);
  p.lse = lse.data_ptr<float>();
  p.beta = stat_ptr(beta);
  p.entropy = nullptr;
  const bool ssa = p.ssa_b != nullptr, adaptive = p.beta != nullptr;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  raise_if(is_bf16(q) ? ssa_flash::run_fwd_bf16(p, ssa, adaptive, stream)
                      : ssa_flash::run_fwd_fp16(p, ssa, adaptive, stream));
  return {o, lse};
}

std::tuple<Tensor, Tensor> stats(const Tensor& q_in, const Tensor& k, const optional<Tensor>& mask,
                                 int64_t mask_kind, const optional<Tensor>& b, const optional<Tensor>& n,
                                 double scale, bool causal, int64_t group, int64_t stream_handle,
                                 int64_t window_left, int64_t window_right) {
  check_qkv_like(q_in, "query", q_in);
  const Tensor q = nonnegative_scale(q_in, scale);
  check_qkv_like(k, "key", q);
  ssa_flash::FwdParams p{};
  fill_shape(p, q, k, q.size(3), mask, mask_kind, b, n, scale, causal, group, window_left, window_right);
  fill_dropout(p, q, c10::nullopt, 0, 0.0);  // (the statistics are of the undropped rows)
  Tensor ent = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  Tensor lse = at::empty_like(ent);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_sm = q.stride(2);
  p.k_sb = k.stride(0); p.k_sh = k.stride(1); p.k_sm = k.stride(2);
  p.lse = lse.data_ptr<float>();
  p.entropy = ent.data_ptr<float>();
  const bool ssa = p.ssa_b != nullptr;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  raise_if(is_bf16(q) ? ssa_flash::run_stats_bf16(p, ssa, stream) : ssa_flash::run_stats_fp16(p, ssa, stream));
  return {ent, lse};
}

// Returns dq, dk, dv (padded head dims, like the inputs) and the (B, H, num_partials) partial
// sums of db and dn (empty tensors for softmax); the caller sums the partials over (0, 2).
// deterministic: the two-kernel path (bitwise reproducible); else the fused kernel where the
// device and head dim allow it (launch.h, BwdPlan), whose dQ is accumulated with atomics.
Tensor small_row_stride(const Tensor& t) { return t.stride(2) < (int64_t(1) << 26) ? t : t.contiguous(); }

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd(
    const Tensor& dout_in, const Tensor& q_in, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
    const optional<Tensor>& dlse, const optional<Tensor>& mask, int64_t mask_kind, const optional<Tensor>& b,
    const optional<Tensor>& n, const optional<Tensor>& beta, const optional<Tensor>& lse_l,
    const optional<Tensor>& entropy, const optional<Tensor>& dbeta_dh, double scale, bool causal, int64_t group,
    int64_t stream_handle, bool deterministic, const optional<Tensor>& drop_rng, int64_t drop_keep31,
    double drop_scale, int64_t window_left, int64_t window_right) {
  check_qkv_like(q_in, "query", q_in);
  check_qkv_like(dout_in, "grad_out", q_in);
  const bool negated = scale < 0;
  // the backward kernels keep query-tile offsets in 32 bits (params.h): rows strides >= 2^26
  // elements (a layout such as (L, B, H, D) with a huge B * H * D) are made contiguous
  const Tensor q = small_row_stride(nonnegative_scale(q_in, scale));
  const Tensor dout = small_row_stride(dout_in);
  check_qkv_like(k, "key", q);
  check_qkv_like(v, "value", q);
  check_qkv_like(o, "out", q);
  TORCH_CHECK(o.sizes() == dout.sizes() && o.size(0) == q.size(0) && o.size(1) == q.size(1) &&
                  o.size(2) == q.size(2) && o.size(3) == v.size(3),
              "ssa_flash: out / grad_out shapes do not match");
  check_stat(lse, "lse", q);
  check_stat(dlse, "grad_lse", q);
  const bool adaptive = beta.has_value();
  TORCH_CHECK(adaptive == lse_l.has_value() && adaptive == entropy.has_value() && adaptive == dbeta_dh.has_value(),
              "ssa_flash: give all of beta, lse_l, entropy, dbeta_dh or none");
  check_stat(beta, "beta", q);
  check_stat(lse_l, "lse_l", q);
  check_stat(entropy, "entropy", q);
  check_stat(dbeta_dh, "dbeta_dh", q);
  ssa_flash::BwdParams p{};
  fill_shape(p, q, k, v.size(3), mask, mask_kind, b, n, scale, causal, group, window_left, window_right);
  fill_dropout(p, q, drop_rng, drop_keep31, drop_scale);
  const bool ssa = p.ssa_b != nullptr, unfused = p.drop_rng != nullptr || p.window;
  auto f32 = q.options().dtype(at::kFloat);
  const ssa_flash::BwdPlan plan =
      is_bf16(q) ? ssa_flash::plan_bwd_bf16(p.dim, p.dim_v, p.len_q, p.len_k, ssa, adaptive, deterministic, unfused)
                 : ssa_flash::plan_bwd_fp16(p.dim, p.dim_v, p.len_q, p.len_k, ssa, adaptive, deterministic, unfused);
  // the fused path accumulates dQ / scale in float32 with atomics (zeroed here; rows and columns
  // padded to whole tiles), converted below
  Tensor dq_accum = plan.fused ? at::zeros({q.size(0), q.size(1), plan.stat_rows, plan.accum_cols}, f32) : Tensor();
  Tensor dq = plan.fused ? Tensor() : at::empty(q.sizes(), q.options());
  Tensor dk = at::empty(k.sizes(), k.options());
  Tensor dv = at::empty(v.sizes(), v.options());
  Tensor rowstat = at::empty({q.size(0), q.size(1), plan.stat_rows, plan.stat_count}, f32);
  Tensor db_part = at::empty({ssa ? q.size(0) : 0, q.size(1), plan.num_partials}, f32);
  Tensor dn_part = at::empty_like(db_part);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = o.data_ptr();
  p.dout = dout.data_ptr();
  p.dq = plan.fused ? nullptr : dq.data_ptr();
  p.dq_accum = plan.fused ? dq_accum.data_ptr<float>() : nullptr;
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.q_sb = q.stride(0); p.q_sh = q.stride(1); p.q_sm = q.stride(2);
  p.k_sb = k.stride(0); p.k_sh = k.stride(1); p.k_sm = k.stride(2);
  p.v_sb = v.stride(0); p.v_sh = v.stride(1); p.v_sm = v.stride(2);
  p.o_sb = o.stride(0); p.o_sh = o.stride(1); p.o_sm = o.stride(2);
  p.do_sb = dout.stride(0); p.do_sh = dout.stride(1); p.do_sm = dout.stride(2);
  if (!plan.fused) {
    p.dq_sb = dq.stride(0); p.dq_sh = dq.stride(1); p.dq_sm = dq.stride(2);
  }
  p.dk_sb = dk.stride(0); p.dk_sh = dk.stride(1); p.dk_sm = dk.stride(2);
  p.dv_sb = dv.stride(0); p.dv_sh = dv.stride(1); p.dv_sm = dv.stride(2);
  p.lse = lse.data_ptr<float>();
  p.dlse = stat_ptr(dlse);
  p.rowstat = rowstat.data_ptr<float>();
  p.stat_rows = plan.stat_rows;
  p.beta = stat_ptr(beta);
  p.lse_l = stat_ptr(lse_l);
  p.entropy = stat_ptr(entropy);
  p.dbeta_dh = stat_ptr(dbeta_dh);
  p.db_part = ssa ? db_part.data_ptr<float>() : nullptr;
  p.dn_part = ssa ? dn_part.data_ptr<float>() : nullptr;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  raise_if(is_bf16(q) ? ssa_flash::run_bwd_bf16(p, ssa, adaptive, plan, stream)
                      : ssa_flash::run_bwd_fp16(p, ssa, adaptive, plan, stream));
  if (plan.fused) {
    dq = dq_accum.narrow(2, 0, q.size(2)).narrow(3, 0, q.size(3)).mul(negated ? -scale : scale).to(q.scalar_type());
  }
  else if (negated) dq.neg_();
  return {dq, dk, dv, db_part, dn_part};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ssa_flash CUDA kernels (see ssa_flash/cuda.py for the Python API)";
  m.def("fwd", &fwd, "attention forward: (out, lse)", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"),
        py::arg("mask_kind"), py::arg("b"), py::arg("n"), py::arg("beta"), py::arg("scale"), py::arg("causal"),
        py::arg("group"), py::arg("stream"), py::arg("drop_rng") = py::none(), py::arg("drop_keep31") = 0,
        py::arg("drop_scale") = 0.0, py::arg("window_left") = -1, py::arg("window_right") = -1);
  m.def("stats", &stats, "statistics pass: (entropy, lse) of softmax(l)", py::arg("q"), py::arg("k"),
        py::arg("mask"), py::arg("mask_kind"), py::arg("b"), py::arg("n"), py::arg("scale"), py::arg("causal"),
        py::arg("group"), py::arg("stream"), py::arg("window_left") = -1, py::arg("window_right") = -1);
  m.def("bwd", &bwd, "attention backward: (dq, dk, dv, db_part, dn_part)", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dlse"), py::arg("mask"),
        py::arg("mask_kind"), py::arg("b"), py::arg("n"), py::arg("beta"), py::arg("lse_l"), py::arg("entropy"),
        py::arg("dbeta_dh"), py::arg("scale"), py::arg("causal"), py::arg("group"), py::arg("stream"),
        py::arg("deterministic") = false, py::arg("drop_rng") = py::none(), py::arg("drop_keep31") = 0,
        py::arg("drop_scale") = 0.0, py::arg("window_left") = -1, py::arg("window_right") = -1);
}
