"""Attention sinks and logit soft-capping above the kernels (docs/design.md §1.6): the custom ops
and the reference backend (float64 gradcheck of q, k, v, b, n and sinks), the public functions
(arguments, backend choice, results against ``ssa_flash.reference``), the CUDA backend's
refusal until its kernels implement them (the Triton kernels':
tests/triton/test_triton_sinks_softcap.py), the nn modules, and the key-shard pieces
of ring attention (the sink counted once per row). Multi-rank ring attention:
tests/distributed/test_distributed_sinks.py."""
import dataclasses

import pytest
import torch

import ssa_flash
from ssa_flash import autograd as ssa_autograd
from ssa_flash import reference
from ssa_flash.backends import cuda_backend, get, reference_backend, triton_backend
from ssa_flash.spec import AttentionSpec, TemperatureState
from ssa_flash.distributed import partial as P
from ssa_flash.nn import SSAttention
from ssa_flash.temperature import beta_from_entropy

from attn_testing import INTERPRETER, MODES, call, fake

F64 = torch.float64


def _qkv(B=1, Hq=4, Hkv=2, Lq=6, Lk=7, D=5, Dv=3, seed=0, dtype=F64, scale_q=1.5):
    g = torch.Generator().manual_seed(seed)
    q = (scale_q * torch.randn(B, Hq, Lq, D, generator=g, dtype=F64)).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=F64).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=F64).to(dtype).requires_grad_()
    return q, k, v


def _heads(Hq, seed=1):
    g = torch.Generator().manual_seed(seed)
    b = (0.4 + torch.rand(Hq, generator=g, dtype=F64)).requires_grad_()
    n = (1.1 + torch.rand(Hq, generator=g, dtype=F64)).requires_grad_()
    s = torch.randn(Hq, generator=g, dtype=F64).requires_grad_()
    return b, n, s


def _public_fn(mode):
    return {"softmax": ssa_flash.softmax_attention, "ssa": ssa_flash.ssa_attention,
            "adaptive": ssa_flash.adaptive_temperature_attention,
            "ssa_adaptive": ssa_flash.ssa_attention}[mode]


def _mode_kw(mode, b, n):
    kw = {}
    if "ssa" in mode:
        kw.update(b=b, n=n)
    if mode == "ssa_adaptive":
        kw.update(adaptive_temperature=True)
    return kw


# --------------------------------------------------------------------------------------------
# The custom ops on the reference backend: exact gradients (float64 gradcheck)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["dense_mask_window", "causal_gqa", "packed"])
def test_ops_gradcheck_reference_backend(mode, layout):
    """q, k, v, b, n and sinks through ``torch.ops.ssa_flash`` (the reference backend's explicit
    backward, not autograd of the specification): gradcheck, and the forward equals the
    specification. The sink of head 1 is -inf (no sink), the mask empties one row (all its
    weight on the sink), the threshold makes the temperature active on some rows."""
    if layout == "packed" and "ssa" not in mode:
        pytest.skip("packed: the SSA variants cover the layout (gradcheck is slow)")
    adaptive = "adaptive" in mode
    ssa = "ssa" in mode
    threshold = 0.2
    q, k, v = _qkv(Lq=5, Lk=6, D=4, Dv=2)  # small: gradcheck perturbs every element
    b, n, s = _heads(4)
    with torch.no_grad():
        s[1] = float("-inf")
    spec_kw = dict(scale=0.45, score="ssa" if ssa else "softmax", group=2, adaptive=adaptive, threshold=threshold,
                   softcap=1.3)
    mask = None
    if layout == "dense_mask_window":
        mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(3)) > 0.3
        mask[2] = False  # an empty row: out 0, all on the sink
        mask = mask.expand(1, 4, 5, 6)
        spec = AttentionSpec(window_left=3, window_right=2, **spec_kw)
    elif layout == "causal_gqa":
        spec = AttentionSpec(causal=True, **spec_kw)
    else:
        q, k, v = (x.detach()[0].transpose(0, 1).contiguous().requires_grad_()
                   for x in _qkv(Lq=5, Lk=6, D=4, Dv=2))
        cu_q = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # one sequence without rows
        cu_k = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
        spec = AttentionSpec(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4,
                             max_seqlen_k=3, **spec_kw)

    def fn(q, k, v, b, n, s):
        out, lse = ssa_autograd.attention(q, k, v, (b, n) if ssa else (), mask, "reference", spec, sinks=s)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    # full Jacobians for SSA + adaptive (every path, through beta), random projections otherwise
    assert torch.autograd.gradcheck(fn, (q, k, v, b, n, s), fast_mode=mode != "ssa_adaptive")
    if layout != "packed":  # the specification, under ordinary autograd
        out, lse = fn(q, k, v, b, n, s)
        window = (spec.window_left, spec.window_right)
        ref_out, ref_lse = reference.attention(q, k, v, mask, 0.0, spec.causal, spec.scale, True,
                                               score="ssa" if ssa else "softmax",
                                               score_params=(b, n) if ssa else None, adaptive_temperature=adaptive,
                                               threshold=threshold, window_size=window, sinks=s, softcap=1.3,
                                               return_lse=True)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, torch.where(torch.isfinite(ref_lse), ref_lse, torch.zeros_like(ref_lse)))
        if layout == "dense_mask_window":
            assert out[0, :, 2].abs().max() == 0  # the empty row
            # all on the sink: lse = beta s_h, beta = 1 there (a one-entry row has entropy 0)
            torch.testing.assert_close(lse[0, 0, 2], s[0].detach())


def test_ops_without_sinks_return_no_sink_gradient():
    q, k, v = _qkv()
    spec = AttentionSpec(scale=0.4, group=2)
    out, lse = ssa_autograd.attention(q, k, v, (), None, "reference", spec)
    out.sum().backward()
    dq, dk, dv, dparams, dsinks = reference_backend.backward(
        torch.ones_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, None, None, (), None,
        None, spec)
    assert dparams == () and dsinks is None
    torch.testing.assert_close(dq, q.grad)


# --------------------------------------------------------------------------------------------
# Public functions


@pytest.mark.parametrize("mode", MODES)
def test_public_functions_match_the_specification(mode):
    """Outputs, LSE and gradients (q, k, v, b, n, sinks) of the public functions with a sink
    tensor and a cap equal ``ssa_flash.reference`` run on the same arguments."""
    q, k, v = _qkv(B=2)
    b, n, s = _heads(4)
    kw = dict(is_causal=True, enable_gqa=True, sinks=s, softcap=2.0, return_lse=True)
    out, lse = _public_fn(mode)(q, k, v, **kw, **_mode_kw(mode, b, n))
    leaves = (q, k, v, b, n, s) if "ssa" in mode else (q, k, v, s)
    grads = torch.autograd.grad((out.square().sum() + lse.sum()), leaves)
    ref_out, ref_lse = call(reference, mode, q, k, v, b, n, **kw)
    ref_grads = torch.autograd.grad((ref_out.square().sum() + ref_lse.sum()), leaves)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours, ref)


def test_sinks_as_a_number_and_entropy():
    q, k, v = _qkv()
    out = ssa_flash.softmax_attention(q, k, v, enable_gqa=True, sinks=0.5)
    ref = reference.attention(q, k, v, enable_gqa=True, sinks=torch.full((4,), 0.5, dtype=F64))
    torch.testing.assert_close(out, ref)
    ent = ssa_flash.attention_entropy(q, k, enable_gqa=True,
                                      score="ssa", score_params={"b": 0.7, "n": 1.4}, sinks=0.5, softcap=1.0)
    ref = reference.attention_entropy(q, k, enable_gqa=True, score="ssa", score_params=(0.7, 1.4), sinks=0.5,
                                      softcap=1.0)
    torch.testing.assert_close(ent, ref)
    assert not torch.allclose(ent, ssa_flash.attention_entropy(q, k, enable_gqa=True,
                                                               score="ssa", score_params={"b": 0.7, "n": 1.4}))


def test_varlen_and_kvcache_match_the_specification():
    g = torch.Generator().manual_seed(7)
    H, D = 2, 4
    q = torch.randn(7, H, D, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(8, H, D, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(8, H, D, generator=g, dtype=F64, requires_grad=True)
    s = torch.tensor([0.3, -0.8], dtype=F64, requires_grad=True)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 8], dtype=torch.int32)  # the first sequence has no key: all on the sink
    kw = dict(is_causal=False, score="ssa", score_params=(0.9, 1.6), sinks=s, softcap=1.7, return_lse=True)
    out, lse = ssa_flash.varlen_attention(q, k, v, cu_q, cu_k, 4, 8, **kw)
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, 4, 8, **kw)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    torch.testing.assert_close(lse[:, :3], s.detach()[:, None].expand(2, 3))
    grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v, s))
    ref_grads = torch.autograd.grad(ref_out.sum() + ref_lse.sum(), (q, k, v, s))
    for ours, ref in zip(grads, ref_grads):
        torch.testing.assert_close(ours, ref)

    qc = torch.randn(2, H, 1, D, generator=g, dtype=F64)
    kc, vc = torch.randn(2, H, 5, D, generator=g, dtype=F64), torch.randn(2, H, 5, D, generator=g, dtype=F64)
    lens = torch.tensor([4, 0], dtype=torch.int32)
    ours = ssa_flash.attention_with_kvcache(qc, kc, vc, lens, is_causal=True, sinks=s.detach(), softcap=1.7,
                                            return_lse=True, score="ssa", score_params=(1.0, 1.5))
    ref = reference.attention_with_kvcache(qc, kc, vc, lens, is_causal=True, sinks=s.detach(), softcap=1.7,
                                           return_lse=True, score="ssa", score_params=(1.0, 1.5))
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r)
    assert ours[0][1].abs().max() == 0  # an empty cache: all on the sink


@pytest.mark.parametrize("kw, error, match", [
    (dict(softcap=-1.0), ValueError, "softcap must be >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
    (dict(softcap="1"), TypeError, "softcap must be a real number"),
    (dict(softcap=True), TypeError, "softcap must be a real number"),
    (dict(sinks="0"), TypeError, "sinks must be None, a real number or a floating tensor"),
    (dict(sinks=True), TypeError, "sinks must be None"),
    (dict(sinks=float("nan")), ValueError, "sinks must be a real number or -inf"),
    (dict(sinks=float("inf")), ValueError, "sinks must be a real number or -inf"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be a number or a tensor of shape \(\) or \(4,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "sinks must be a floating tensor"),
    (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), ValueError, "sinks must be real numbers or -inf"),
    (dict(sinks=torch.zeros(4, device="meta")), ValueError, "sinks is on meta"),
])
@pytest.mark.parametrize("fn", ["ssa_attention", "softmax_attention", "adaptive_temperature_attention",
                                "attention_entropy"])
def test_errors_name_the_argument(fn, kw, error, match):
    q = torch.zeros(1, 4, 3, 8)
    args = (q, q) if fn == "attention_entropy" else (q, q, q)
    with pytest.raises(error, match=match):
        getattr(ssa_flash, fn)(*args, **kw)


def test_errors_varlen_kvcache():
    q = torch.zeros(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="softcap"):
        ssa_flash.varlen_attention(q, q, q, cu, cu, 4, 4, softcap=-0.5, score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match="sinks"):
        ssa_flash.varlen_attention(q, q, q, cu, cu, 4, 4, sinks=torch.zeros(3), score="ssa", score_params=(1.0, 1.5))
    qc = torch.zeros(1, 2, 1, 8)
    with pytest.raises(TypeError, match="sinks"):
        ssa_flash.attention_with_kvcache(qc, qc, qc, torch.zeros(1, dtype=torch.int32), sinks=[0.0, 1.0], score="ssa",
                                         score_params=(1.0, 1.5))


# --------------------------------------------------------------------------------------------
# Backend choice: both kernel families take them; auto runs them on the kernels


def test_kernel_backends_accept_sinks_and_softcap(monkeypatch):
    """Both kernel families implement sinks and soft-capping (tests/triton/test_triton_sinks_softcap.py,
    tests/cuda/test_cuda_sinks_softcap.py): their supports() accept them where they accept the call
    without them."""
    monkeypatch.setattr(cuda_backend, "_capability", lambda device: (8, 0, 166912))  # an A100
    monkeypatch.setattr(cuda_backend, "_image_reason", lambda device: None)  # built for it (a GPU machine's is not)
    x = fake((1, 4, 8, 64))
    sinks = torch.zeros(4)
    for mod in (triton_backend, cuda_backend):
        assert mod.supports(x, x, x, AttentionSpec(scale=0.1)) is None
        assert mod.supports(x, x, x, AttentionSpec(scale=0.1), sinks) is None
        assert mod.supports(x, x, x, AttentionSpec(scale=0.1, softcap=5.0), sinks) is None


@pytest.mark.skipif(not INTERPRETER and not torch.cuda.is_available(), reason="needs the Triton kernels")
def test_auto_runs_sinks_and_softcap_on_the_triton_kernels(monkeypatch):
    """``"auto"`` (and ``backend="triton"``) run calls with sinks and softcap on the Triton
    kernels, which match the specification; without them the op call is the one it was."""
    from ssa_flash.triton import launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (x.detach().to(device, torch.float32) for x in _qkv(Hq=2, Hkv=2, D=8, Dv=8))
    launches, op_calls = [], []
    fwd, attention = launch.forward, ssa_autograd.attention
    monkeypatch.setattr(launch, "forward", lambda *a, **kw: launches.append(1) or fwd(*a, **kw))
    monkeypatch.setattr(ssa_autograd, "attention",
                        lambda *a, **kw: op_calls.append((a[5], kw.get("sinks") is not None, a[6].softcap))
                        or attention(*a, **kw))
    for backend in ("auto", "triton"):
        out = ssa_flash.ssa_attention(q, k, v, sinks=0.5, softcap=3.0, backend=backend)
        want = reference.attention(q, k, v, sinks=0.5, softcap=3.0, score="ssa", score_params=(1.0, 1.5))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert len(launches) == 2 and op_calls == [("triton", True, 3.0)] * 2
    ssa_flash.ssa_attention(q, k, v)
    assert op_calls[-1] == ("triton", False, 0.0)


def test_auto_candidates_end_with_the_reference():
    from ssa_flash import backends

    names = backends.auto_candidates(torch.device("cpu"), torch.float32)
    assert names[-1] == "reference" and "cuda" not in names


# --------------------------------------------------------------------------------------------
# nn modules


def test_ssattention_learnable_sinks_and_softcap():
    torch.manual_seed(0)
    attn = SSAttention(4, sinks=True, sinks_init=[0.1, -0.2, 0.3, 1.0], softcap=2.5, dtype=F64)
    assert sorted(attn.state_dict()) == ["b_raw", "n_raw", "sinks"]
    assert isinstance(attn.sinks, torch.nn.Parameter) and attn.softcap == 2.5
    q, k, v = _qkv(Hq=4, Hkv=4)
    out = attn(q, k, v, is_causal=True)
    ref = reference.attention(q, k, v, is_causal=True, score="ssa", score_params=(attn.b, attn.n), sinks=attn.sinks,
                              softcap=2.5)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    assert attn.sinks.grad is not None and (attn.sinks.grad != 0).all()
    assert "sinks=[0.1, -0.2, 0.3, 1]" in repr(attn) and "softcap=2.5" in repr(attn)
    frozen = SSAttention(4, learnable=False, sinks=True)
    assert "sinks" in dict(frozen.named_buffers()) and "sinks" in frozen.state_dict()
    plain = SSAttention(4)
    assert plain.sinks is None and "sinks" not in plain.state_dict() and plain.softcap == 0.0
    frozen.reset_parameters(sinks_init=2.0)
    assert torch.equal(frozen.sinks, torch.full((4,), 2.0))
    with pytest.raises(ValueError, match="sinks_init"):
        SSAttention(4, sinks=True, sinks_init=float("nan"))
    with pytest.raises(ValueError, match="softcap"):
        SSAttention(4, softcap=-1.0)
    with pytest.raises(TypeError, match="sinks"):
        SSAttention(4, sinks=1)


# --------------------------------------------------------------------------------------------
# Key shards (ring attention's pieces, one process): the sink once per row


@pytest.mark.parametrize("mode", MODES)
def test_key_shards_with_the_sink_once_per_row(mode):
    """The keys split in two shards run through ``partial`` without the sink, the sink added
    once with ``sink_stats`` / ``add_sink`` / ``sink_dbeta`` / ``sink_backward``: equal to the
    unsharded reference backend with the sink, outputs and every gradient."""
    adaptive, ssa = "adaptive" in mode, "ssa" in mode
    q, k, v = (x.detach() for x in _qkv(B=2, Lk=8))
    b, n, s = (x.detach() for x in _heads(4))
    s[2] = float("-inf")
    params = (b, n) if ssa else ()
    spec = AttentionSpec(scale=0.5, score="ssa" if ssa else "softmax", group=2, adaptive=adaptive, threshold=0.2,
                         softcap=2.0)
    be = get("reference")
    dout = torch.randn(2, 4, 6, 3, generator=torch.Generator().manual_seed(9), dtype=F64)

    # unsharded, with the sink
    temp = beta = None
    if adaptive:
        ent, lse_l = be.row_entropy(q, k, None, params, s, spec)
        beta, dbeta_dh = beta_from_entropy(ent, spec.poly, spec.threshold)
        temp = TemperatureState(beta, lse_l, ent, dbeta_dh)
    out_ref, lse_ref = be.forward(q, k, v, None, params, s, beta, spec)
    grads_ref = be.backward(dout, q, k, v, out_ref, lse_ref, None, None, params, s, temp, spec)

    shards = [slice(0, 3), slice(3, 8)]
    ks = [(k[:, :, sl], v[:, :, sl]) for sl in shards]
    stemp = None
    if adaptive:
        stats = P.empty_row_stats(q)
        for kk, _ in ks:
            stats = P.merge_entropy(stats, P.partial_entropy(q, kk, params, spec, "reference"))
        stemp = P.temperature_state(P.merge_entropy(stats, P.sink_stats(s, stats.lse)), spec)
    out, lse = P.empty_output(q, v.shape[-1])
    for kk, vv in ks:
        P.merge_outputs_(out, lse, *P.partial_forward(q, kk, vv, params, stemp.beta if adaptive else None, spec,
                                                      "reference"))
    P.add_sink(out, lse, s, stemp.beta if adaptive else None)
    torch.testing.assert_close(out, out_ref.to(out.dtype))
    torch.testing.assert_close(lse, lse_ref)

    g = None
    if adaptive:
        dbeta = sum(P.partial_dbeta(dout, q, kk, vv, out, lse, params, stemp, spec, "reference") for kk, vv in ks)
        g = (dbeta + P.sink_dbeta(dout, out, lse, s, stemp)) * stemp.dbeta_dh
    parts = [P.partial_backward(dout, q, kk, vv, out, lse, params, spec, "reference", temp=stemp, g=g)
             for kk, vv in ks]
    dsinks = P.sink_backward(dout, out, lse, s, stemp, g)
    torch.testing.assert_close(parts[0][0] + parts[1][0], grads_ref[0])
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]], 2), grads_ref[1])
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]], 2), grads_ref[2])
    assert len(grads_ref[3]) == len(params)
    for a, b_, ref in zip(parts[0][3], parts[1][3], grads_ref[3]):
        torch.testing.assert_close(a + b_, ref)
    torch.testing.assert_close(dsinks, grads_ref[4])
    assert dsinks[2] == 0 and (dsinks[[0, 1, 3]] != 0).all()


def test_spec_softcap_is_an_op_argument():
    spec = AttentionSpec(scale=0.25, softcap=30.0)
    assert AttentionSpec.schema().endswith("Tensor? dropout_rng, float softcap")
    assert AttentionSpec.from_op_args(spec.op_args()) == spec
    assert dataclasses.replace(spec, softcap=0.0) != spec


def test_auto_falling_back_to_the_reference_on_a_gpu_is_logged_once(monkeypatch, caplog):
    """``"auto"`` taking the reference on a GPU (a refused feature or shape) says so, once per reason:
    the reference materialises the score matrix, which a user should not meet silently."""
    import types

    from ssa_flash import ops
    monkeypatch.setattr(ops.backends, "resolve", lambda b, dev, dt: ("triton", ""))
    monkeypatch.setattr(ops.backends, "auto_candidates", lambda dev, dt: ("triton", "reference"))
    monkeypatch.setattr(ops, "_supports", lambda name, *a: None if name == "reference" else "no sinks here")
    monkeypatch.setattr(ops, "_fallbacks_logged", set())
    q = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float16)
    spec = AttentionSpec(scale=1.0)
    with caplog.at_level("WARNING", logger="ssa_flash"):
        assert ops._resolve_backend("auto", q, q, q, spec) == "reference"
        assert ops._resolve_backend("auto", q, q, q, spec) == "reference"
    records = [r for r in caplog.records if "reference implementation" in r.getMessage()]
    assert len(records) == 1 and "triton: no sinks here" in records[0].getMessage()
    q_cpu = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float16)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ssa_flash"):
        monkeypatch.setattr(ops, "_fallbacks_logged", set())
        assert ops._resolve_backend("auto", q_cpu, q_cpu, q_cpu, spec) == "reference"
    assert not caplog.records  # on the CPU the reference is the expected backend
