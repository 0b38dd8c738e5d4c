"""Attention sinks and logit soft-capping in the Triton kernels (docs/design.md §1.6, docs/maths.md
§6): forward, LSE, entropy and the gradients of q, k, v, b, n and the sinks against the reference
backend (the specification's explicit backward) in float64, for the four variants, alone and
combined with causality, masks, GQA, dropout, windows, packed batches and split-KV decoding;
float64 gradchecks of the kernels' own backward; the limits (no sink, an infinite cap) and rows
with nothing admissible. Under the interpreter (small sizes) or on a GPU."""
import pytest
import torch

from ssa_flash import autograd as ssa_autograd
from ssa_flash.spec import AttentionSpec

from attn_testing import MODES, needs_kernels

pytestmark = needs_kernels

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FEATURES = {"sinks": dict(sinks=True, softcap=0.0), "softcap": dict(sinks=False, softcap=1.3),
            "both": dict(sinks=True, softcap=1.3)}


def _inputs(B=1, Hq=2, Hkv=1, Lq=9, Lk=11, D=16, Dv=None, seed=0, q_scale=1.5):
    g = torch.Generator().manual_seed(seed)
    Dv = D if Dv is None else Dv
    q = q_scale * torch.randn(B, Hq, Lq, D, generator=g, dtype=F64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=F64)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=F64)
    b = 0.4 + torch.rand(Hq, generator=g, dtype=F64)
    n = 1.1 + torch.rand(Hq, generator=g, dtype=F64)
    s = torch.randn(Hq, generator=g, dtype=F64)
    return [x.to(DEVICE).requires_grad_() for x in (q, k, v, b, n, s)]


def _spec(mode, softcap, Hq, Hkv, **kw):
    return AttentionSpec(scale=0.45, group=Hq // Hkv, adaptive="adaptive" in mode, threshold=0.2,
                         softcap=softcap, score="ssa" if "ssa" in mode else "softmax", **kw)


def _attend(backend, mode, q, k, v, b, n, s, mask, spec):
    ssa = "ssa" in mode
    return ssa_autograd.attention(q, k, v, (b, n) if ssa else (), mask, backend, spec, sinks=s)


def _results(backend, mode, inputs, mask, spec, sinks=True):
    """Output, LSE and the gradients of every input that matters, for a fixed upstream gradient
    on both the output and the (finite part of the) LSE."""
    q, k, v, b, n, s = inputs
    out, lse = _attend(backend, mode, q, k, v, b, n, s if sinks else None, mask, spec)
    dout = torch.cos(torch.arange(out.numel(), dtype=out.dtype, device=out.device)).view_as(out)
    dlse = torch.sin(torch.arange(lse.numel(), dtype=lse.dtype, device=lse.device)).view_as(lse)
    lse_f = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wrt = [q, k, v] + ([b, n] if "ssa" in mode else []) + ([s] if sinks else [])
    grads = torch.autograd.grad((out * dout).sum() + (lse_f * dlse).sum(), wrt, allow_unused=True)
    return [out, lse] + list(grads)


def _compare(mode, inputs, mask, spec, sinks=True, tol=1e-10):
    ours = _results("triton", mode, inputs, mask, spec, sinks)
    ref = _results("reference", mode, inputs, mask, spec, sinks)
    names = ["out", "lse", "dq", "dk", "dv"] + (["db", "dn"] if "ssa" in mode else []) + (["dsinks"] if sinks else [])
    for name, a, r in zip(names, ours, ref):
        assert a is not None and r is not None, name
        torch.testing.assert_close(a, r, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    return ours


# --------------------------------------------------------------------------------------------
# Against the specification (the reference backend), float64


def _causal_gqa(mode, feature):
    f = FEATURES[feature]
    inputs = _inputs(Hq=4, Hkv=2, Lq=10, Lk=13)
    with torch.no_grad():
        inputs[5][1] = float("-inf")
    _compare(mode, inputs, None, _spec(mode, f["softcap"], 4, 2, causal=True), sinks=f["sinks"])


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_causal_gqa(mode):
    """Every variant with a sink and a cap, causal with GQA (two query heads per key head); one
    sink is -inf (no sink)."""
    _causal_gqa(mode, "both")


@pytest.mark.parametrize("feature", ["sinks", "softcap"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_one_feature(mode, feature):
    """As above with a sink alone and a cap alone."""
    _causal_gqa(mode, feature)


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("mode", MODES)
def test_masks_with_sinks_and_softcap(mode, mask_kind):
    """A boolean or additive mask (added after the cap), with a row left with nothing admissible:
    all its weight on the sink (output 0, lse = s_h)."""
    q, k, v, b, n, s = inputs = _inputs(Lq=9, Lk=11)
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(9, 11, generator=g) > 0.3
    keep[4] = False
    if mask_kind == "bool":
        mask = keep
    else:
        mask = torch.where(keep, torch.randn(9, 11, generator=g, dtype=F64), torch.tensor(float("-inf"), dtype=F64))
    mask = mask.to(DEVICE).expand(1, 2, 9, 11)
    out, lse = _compare(mode, inputs, mask, _spec(mode, 1.3, 2, 1))[:2]
    assert out[0, :, 4].abs().max() == 0
    torch.testing.assert_close(lse[0, :, 4], s.detach())  # beta = 1 on a row of one entry


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
def test_dropout_and_window(mode):
    """Dropout (the sink is not dropped; same Philox mask as the reference) and a sliding window."""
    inputs = _inputs(Lq=12, Lk=12)
    rng = torch.tensor([1234, 5], dtype=torch.int64, device=DEVICE)
    spec = _spec(mode, 1.3, 2, 1, dropout_p=0.3, dropout_rng=rng, window_left=3, window_right=2)
    _compare(mode, inputs, None, spec)


@pytest.mark.parametrize("mode", ["ssa", "adaptive"])
def test_packed_batch(mode):
    """A packed variable-length batch, one sequence without keys for its queries (lse = s_h)."""
    q, k, v, b, n, s = _inputs(Hq=2, Hkv=1, Lq=9, Lk=11)
    pack = [x.detach()[0].transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v)]
    cu_q = torch.tensor([0, 3, 6, 9], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 5, 11], dtype=torch.int32, device=DEVICE)  # sequence 1: no keys
    spec = _spec(mode, 1.3, 2, 1, causal=False, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 max_seqlen_q=3, max_seqlen_k=6)
    lse = _compare(mode, pack + [b, n, s], None, spec)[1]
    torch.testing.assert_close(lse[:, 3:6], s.detach()[:, None].expand(2, 3))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_kvcache_split_kv_decode(mode, splits):
    """Decoding on a KV cache, the keys split among programs: the sink counted once per row (in
    the merge of the splits' partial results), entropy included; one cache empty (lse = s_h)."""
    q, k, v, b, n, s = (x.detach() for x in _inputs(B=2, Hq=2, Hkv=1, Lq=2, Lk=40))
    used = torch.tensor([37, 0], dtype=torch.int32, device=DEVICE)
    spec = _spec(mode, 1.3, 2, 1, causal=True, seqused_k=used, num_splits=splits)
    ours = _attend("triton", mode, q, k, v, b, n, s, None, spec)
    ref = _attend("reference", mode, q, k, v, b, n, s, None, spec)
    for a, r in zip(ours, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[1][1], s[:, None].expand(2, 2))
    assert ours[0][1].abs().max() == 0
    if mode == "ssa":  # the statistics pass (row_entropy) through the split merge too
        ent = ssa_autograd.row_entropy(q, k, (b, n), None, "triton", spec, sinks=s)
        ent_ref = ssa_autograd.row_entropy(q, k, (b, n), None, "reference", spec, sinks=s)
        torch.testing.assert_close(ent, ent_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mode", ["softmax", "ssa"])
def test_entropy_includes_the_sink(mode):
    q, k, v, b, n, s = (x.detach() for x in _inputs(Lq=9, Lk=11))
    spec = _spec(mode, 1.3, 2, 1, causal=True)
    ssa = mode == "ssa"
    params = (b, n) if ssa else ()
    ent = ssa_autograd.row_entropy(q, k, params, None, "triton", spec, sinks=s)
    ref = ssa_autograd.row_entropy(q, k, params, None, "reference", spec, sinks=s)
    no_sink = ssa_autograd.row_entropy(q, k, params, None, "triton", spec)
    torch.testing.assert_close(ent, ref, rtol=1e-10, atol=1e-10)
    assert (ent - no_sink).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# Limits


@pytest.mark.parametrize("mode", ["ssa", "adaptive"])
def test_kernel_sinks_minus_inf_is_no_sink(mode):
    inputs = _inputs(Lq=9, Lk=11)
    with torch.no_grad():
        inputs[5].fill_(float("-inf"))
    spec = _spec(mode, 0.0, 2, 1, causal=True)
    with_sink = _results("triton", mode, inputs, None, spec)
    without = _results("triton", mode, inputs, None, spec, sinks=False)
    for a, r in zip(with_sink, without):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    assert with_sink[-1].abs().max() == 0  # dsinks


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
def test_large_softcap_is_no_softcap(mode):
    """``c tanh(z / c) = z (1 - (z/c)^2 / 3 + ...)``: with ``c = 1e4`` the results are those without
    a cap to about (z/c)^2 ~ 1e-7, not to 1e-12 (the cap is applied)."""
    inputs = _inputs(Lq=9, Lk=11)
    capped = _results("triton", mode, inputs, None, _spec(mode, 1e4, 2, 1), sinks=False)
    plain = _results("triton", mode, inputs, None, _spec(mode, 0.0, 2, 1), sinks=False)
    diff = max((a - r).abs().max().item() for a, r in zip(capped, plain))
    assert 1e-13 < diff < 1e-5


# --------------------------------------------------------------------------------------------
# The kernels' backward is the derivative of their forward (float64 gradcheck)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_with_sinks_and_softcap(mode):
    """q, k, v, b, n and the sinks with a cap, a mask emptying one row and a -inf sink: random
    projections (fast_mode); for SSA with the adaptive temperature also the full Jacobian in b, n
    and the sinks (that of q, k, v too would take ~700 interpreted launches)."""
    q, k, v, b, n, s = _inputs(Hq=2, Hkv=1, Lq=5, Lk=6, D=16, Dv=16)
    with torch.no_grad():
        s[1] = float("-inf")
    keep = torch.rand(5, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[2] = False
    mask = keep.to(DEVICE).expand(1, 2, 5, 6)
    spec = _spec(mode, 1.3, 2, 1)
    ssa = "ssa" in mode

    def fn(q, k, v, b, n, s):
        out, lse = _attend("triton", mode, q, k, v, b if ssa else None, n if ssa else None, s, mask, spec)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(fn, (q, k, v, b, n, s), fast_mode=True)
    if mode == "ssa_adaptive":
        # the full Jacobian in b, n, sinks of two fixed random projections of (out, lse): two
        # backward passes instead of one per output element (170 interpreted backward launches)
        g = torch.Generator().manual_seed(7)
        w_out = torch.randn(1, 2, 5, 16, generator=g, dtype=torch.float64).to(DEVICE)
        w_lse = torch.randn(1, 2, 5, generator=g, dtype=torch.float64).to(DEVICE)

        def projected(b, n, s):
            out, lse = fn(q.detach(), k.detach(), v.detach(), b, n, s)
            return (out * w_out).sum(), (lse * w_lse).sum()

        assert torch.autograd.gradcheck(projected, (b, n, s))


# --------------------------------------------------------------------------------------------
# The switches


def _captured(sinks, softcap):
    from ssa_flash.triton import kernel_args, launch

    q = torch.empty(1, 4, 64, 64, device="meta", dtype=torch.float16)
    k = torch.empty(1, 2, 64, 64, device="meta", dtype=torch.float16)
    b = torch.empty(4, device="meta", dtype=torch.float32)
    rows = torch.empty(1, 4, 64, device="meta", dtype=torch.float32)
    s = b if sinks else None
    spec = AttentionSpec(scale=0.125, group=2, adaptive=True, softcap=softcap, score="ssa")
    temp = launch.TemperatureState(rows, rows, rows, rows)
    with launch.capture_launches(90) as cap:
        launch.row_entropy(q, k, None, (b, b), spec, sinks=s)
        launch.forward(q, k, k, None, (b, b), rows, spec, sinks=s)
        launch.backward(q, q, k, k, q, rows, None, None, (b, b), temp, spec, sinks=s)
    return {kl.name: kl for kl in cap}


def test_calls_without_them_launch_the_kernels_as_before():
    """Off, neither constexpr is passed and both arguments are None (constants to Triton): the
    launches are those of the kernels without these features (the audit compares their code).
    On, each kernel gets the switches it uses (the dK/dV kernel needs no sink)."""
    from ssa_flash.triton import kernel_args, launch

    off = _captured(False, 0.0)
    assert set(off) == {"row_entropy", "fwd", "bwd_dq", "bwd_dkdv"}
    for name, kl in off.items():
        assert not {"SINKS", "SOFTCAP"} & set(kl.constexprs), name
        params = kernel_args.PARAMS[name]
        assert all(kl.args[params.index(p)] is None for p in ("sinks", "softcap") if p in params), name
    on = _captured(True, 30.0)
    for name, kl in on.items():
        assert kl.constexprs.get("SOFTCAP") is True, name
        assert kl.constexprs.get("SINKS", False) is (name != "bwd_dkdv"), name
    assert "sinks" not in kernel_args.PARAMS["bwd_dkdv"]
