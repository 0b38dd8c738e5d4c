"""Partial attention (ssa_flash.distributed.partial) on one process: the keys split into shards,
each shard's results merged, against the unsharded kernels of the same backend. Every variant
(softmax, SSA, adaptive, SSA + adaptive), causal (query and key shards cut at the same positions:
fully visible, invisible or diagonal pairs) and not, forward and backward, GQA.

Tolerances: float64 in the Triton interpreter agrees to a few ulps (1e-12 relative here); float32
to 2e-6 (partial outputs and dq partials are rounded to the inputs' dtype before the merge)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ssa_flash import backends, temperature
from ssa_flash.spec import AttentionSpec, KeyShardTemperature
from ssa_flash.distributed import partial as P

from attn_testing import INTERPRETER, MODES

needs_kernels = pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETER),
                                   reason="needs CUDA or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float64: 1e-12, torch.float32: 2e-6}


def _inputs(mode, dtype, L=24, Hq=2, Hkv=1, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(DEVICE, dtype)

    q, k, v = rnd(1, Hq, L, D, scale=1.5), rnd(1, Hkv, L, D), rnd(1, Hkv, L, D)
    dout = rnd(1, Hq, L, D)
    b = n = None
    if "ssa" in mode:
        b = (0.5 + torch.rand(Hq, generator=g, dtype=torch.float64)).to(DEVICE, acc)
        n = (1.0 + 1.5 * torch.rand(Hq, generator=g, dtype=torch.float64)).to(DEVICE, acc)
    return q, k, v, dout, b, n


def _params(b, n) -> tuple:
    return () if b is None else (b, n)


def _unsharded(be, q, k, v, dout, b, n, spec, dlse=None):
    temp = beta = None
    if spec.adaptive:
        ent, lse_l = be.row_entropy(q, k, None, _params(b, n), None, spec)
        beta, dbeta_dh = temperature.beta_from_entropy(ent, spec.poly, spec.threshold)
        temp = backends.TemperatureState(beta, lse_l, ent, dbeta_dh)
    out, lse = be.forward(q, k, v, None, _params(b, n), None, beta, spec)
    dq, dk, dv, dparams, _ = be.backward(dout, q, k, v, out, lse, dlse, None, _params(b, n), None, temp, spec)
    grads = (dq, dk, dv, *dparams)
    return out, lse, temp, grads


def _pairs(L, causal, cuts):
    """(query rows, key rows, diagonal) of every visible pair of shards."""
    if not causal:  # all queries against each key shard
        return [(slice(0, L), slice(a, c), False) for a, c in cuts]
    pairs = []
    for qi, (qa, qc) in enumerate(cuts):
        for ki, (ka, kc) in enumerate(cuts):
            vis = P.causal_pair(qi, ki)
            if vis is not P.Visibility.NONE:
                pairs.append((slice(qa, qc), slice(ka, kc), vis is P.Visibility.DIAGONAL))
    return pairs


def _sharded(name, q, k, v, dout, b, n, spec, pairs, out_full, lse_full, temp_full, dlse=None):
    """Forward and backward assembled from the partial functions over ``pairs``. The backward
    uses the unsharded out/lse/temperature (the forward's merged ones are compared separately),
    so forward and backward errors do not mix. ``dlse``: the gradient reaching the LSE, if any."""
    def sp(diag):
        return dataclasses.replace(spec, causal=diag)

    rows = lambda t, s: t[:, :, s]  # noqa: E731
    temp = None
    if spec.adaptive:
        stats = P.empty_row_stats(q)
        for qs, ks, diag in pairs:
            part = P.partial_entropy(rows(q, qs), rows(k, ks), _params(b, n), sp(diag), name)
            merged = P.merge_entropy(P.RowStats(rows(stats.lse, qs), rows(stats.entropy, qs)), part)
            rows(stats.lse, qs).copy_(merged.lse)
            rows(stats.entropy, qs).copy_(merged.entropy)
        temp = P.temperature_state(stats, spec)
    out, lse = P.empty_output(q, v.shape[-1])
    for qs, ks, diag in pairs:
        beta = rows(temp.beta, qs) if spec.adaptive else None
        o, l = P.partial_forward(rows(q, qs), rows(k, ks), rows(v, ks), _params(b, n), beta, sp(diag), name)
        mo, ml = P.merge_outputs(rows(out, qs), rows(lse, qs), o, l)
        rows(out, qs).copy_(mo)
        rows(lse, qs).copy_(ml)

    def temp_rows(qs):
        return backends.TemperatureState(*(rows(t, qs) for t in temp_full))

    g = None
    if spec.adaptive:
        dbeta = torch.zeros_like(lse_full)
        for qs, ks, diag in pairs:
            rows(dbeta, qs).add_(P.partial_dbeta(rows(dout, qs), rows(q, qs), rows(k, ks), rows(v, ks),
                                                 rows(out_full, qs), rows(lse_full, qs), _params(b, n), temp_rows(qs),
                                                 sp(diag), name, dlse=None if dlse is None else rows(dlse, qs)))
        if dlse is not None:  # the shards' parts are centred at lse_l: its term once per row
            lse_l = temp_full.lse_l
            dbeta += torch.where(torch.isfinite(lse_l), lse_l, torch.zeros_like(lse_l)) * dlse
        g = dbeta * temp_full.dbeta_dh
    acc = lse_full.dtype
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    db = dn = 0.0
    for qs, ks, diag in pairs:
        pq, pk, pv, pparams = P.partial_backward(
            rows(dout, qs), rows(q, qs), rows(k, ks), rows(v, ks), rows(out_full, qs), rows(lse_full, qs),
            _params(b, n),
            sp(diag), name, temp=temp_rows(qs) if spec.adaptive else None,
            g=rows(g, qs) if spec.adaptive else None, dlse=None if dlse is None else rows(dlse, qs))
        rows(dq, qs).add_(pq)
        rows(dk, ks).add_(pk)
        rows(dv, ks).add_(pv)
        if b is not None:
            db, dn = db + pparams[0], dn + pparams[1]
    return out.to(q.dtype), lse, temp, (dq, dk, dv, db, dn) if b is not None else (dq, dk, dv)


def _close(name, ours, ref, tol):
    ours, ref = ours.double(), ref.double()
    err = (ours - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"{name}: max error {err:.3g}"


def _check(name, mode, causal, dtype, cuts, L, with_dlse=False):
    q, k, v, dout, b, n = _inputs(mode, dtype, L=L)
    spec = AttentionSpec(scale=0.3, score="ssa" if b is not None else "softmax", causal=causal,
                         group=q.shape[1] // k.shape[1], adaptive="adaptive" in mode)
    be = backends.get(name)
    dlse = None
    if with_dlse:
        g = torch.Generator().manual_seed(9)
        dlse = torch.randn(q.shape[:-1], generator=g, dtype=torch.float64).to(DEVICE, dtype)  # (float32 / 64 only)
    out_ref, lse_ref, temp_ref, grads_ref = _unsharded(be, q, k, v, dout, b, n, spec, dlse)
    if spec.adaptive:  # the temperature must be active on some rows, or the test proves little
        assert (temp_ref.dbeta_dh != 0).any() and (temp_ref.beta > 1).any()
    out, lse, temp, grads = _sharded(name, q, k, v, dout, b, n, spec, _pairs(L, causal, cuts),
                                     out_ref, lse_ref, temp_ref, dlse)
    tol = TOL[dtype]
    _close("out", out, out_ref, tol)
    _close("lse", lse, lse_ref, tol)
    if spec.adaptive:
        for field in ("beta", "lse_l", "entropy", "dbeta_dh"):
            _close(field, getattr(temp, field), getattr(temp_ref, field), tol)
    for gname, ours, ref in zip(("dq", "dk", "dv", "db", "dn"), grads, grads_ref):
        _close(gname, ours, ref, tol * (10 if gname in ("db", "dn") else 1))


UNEVEN = [(0, 5), (5, 16), (16, 24)]  # three key shards of different lengths
EVEN3 = [(0, 8), (8, 16), (16, 24)]  # causal: query and key shards at the same cuts


@needs_kernels
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_triton_shards_merge_to_unsharded(mode, causal):
    """Three key shards (three query shards when causal: 6 visible pairs, 3 of them diagonal),
    GQA (2 query heads on 1 key/value head), float64: close to bitwise."""
    _check("triton", mode, causal, torch.float64, EVEN3 if causal else UNEVEN, 24)


@needs_kernels
def test_triton_shards_float32_and_four_shards():
    """float32, four causal shards (10 visible pairs), SSA with the adaptive temperature."""
    _check("triton", "ssa_adaptive", True, torch.float32, [(0, 6), (6, 12), (12, 18), (18, 24)], 24)


@pytest.mark.parametrize("name", [pytest.param("triton", marks=needs_kernels), "reference"])
def test_shards_with_a_gradient_on_the_lse(name):
    """A gradient reaching the LSE too (dlse): each shard's part of dbeta is centred at the row's
    lse^l, and its caller adds lse^l dlse once per row (docs/maths.md section 3.2)."""
    _check(name, "ssa_adaptive", True, torch.float64, EVEN3, 24, with_dlse=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_reference_backend_shards_merge_to_unsharded(mode, causal):
    """The reference backend's row_dbeta / backward_given_g (the formulas the kernels follow),
    two shards."""
    _check("reference", mode, causal, torch.float64, [(0, 12), (12, 24)], 24)


def test_merge_identities_and_empty_rows():
    """The merges: empty statistics/outputs are identities, a set with no admissible key (lse
    -inf) weighs nothing and makes no NaN, a row empty everywhere stays empty, and merging is
    the entropy of the union (a hand-made example)."""
    torch.manual_seed(0)
    la, lb = torch.randn(1, 1, 3, 5, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64)
    la[0, 0, 1] = float("-inf")  # row 1: no key in set a
    lb[0, 0, 2] = float("-inf")
    la[0, 0, 2] = float("-inf")  # row 2: no key at all

    def stats(l):
        lse = torch.logsumexp(l, -1)
        p = torch.softmax(l, -1).nan_to_num(0.0)
        ent = -(p * torch.where(p > 0, torch.log(p), torch.zeros_like(p))).sum(-1)
        return P.RowStats(lse, ent)

    whole = stats(torch.cat([la, lb], -1))
    merged = P.merge_entropy(stats(la), stats(lb))
    assert torch.isfinite(merged.entropy).all()
    torch.testing.assert_close(merged.lse, whole.lse, rtol=0, atol=1e-14)
    torch.testing.assert_close(merged.entropy, whole.entropy, rtol=0, atol=1e-14)
    assert merged.entropy[0, 0, 2] == 0 and merged.lse[0, 0, 2] == float("-inf")
    q = torch.zeros(1, 1, 3, 2, dtype=torch.float64)
    ident = P.merge_entropy(P.empty_row_stats(q), stats(la))
    torch.testing.assert_close(ident.entropy, stats(la).entropy, rtol=0, atol=0)

    va, vb = torch.randn(1, 1, 5, 2, dtype=torch.float64), torch.randn(1, 1, 4, 2, dtype=torch.float64)

    def attend(l, v):
        return torch.softmax(l, -1).nan_to_num(0.0) @ v, torch.logsumexp(l, -1)

    out, lse = P.merge_outputs(*attend(la, va), *attend(lb, vb))
    out_w, lse_w = attend(torch.cat([la, lb], -1), torch.cat([va, vb], -2))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_w, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, lse_w, rtol=0, atol=1e-14)
    out0, lse0 = P.empty_output(q, 2)
    out1, _ = P.merge_outputs(out0, lse0, *attend(la, va))
    torch.testing.assert_close(out1, attend(la, va)[0], rtol=0, atol=0)
    P.merge_outputs_(out0, lse0, *attend(la, va))  # in place, rows of a larger accumulator too
    P.merge_outputs_(out0, lse0, *attend(lb, vb))
    torch.testing.assert_close(out0, out, rtol=0, atol=1e-15)
    torch.testing.assert_close(lse0, lse, rtol=0, atol=0)
    big_out, big_lse = P.empty_output(torch.zeros(1, 1, 7, 2, dtype=torch.float64), 2)
    P.merge_outputs_(big_out[:, :, 2:5], big_lse[:, :, 2:5], *attend(la, va))
    P.merge_outputs_(big_out[:, :, 2:5], big_lse[:, :, 2:5], *attend(lb, vb))
    torch.testing.assert_close(big_out[:, :, 2:5], out, rtol=0, atol=1e-15)
    assert (big_out[:, :, :2] == 0).all() and (big_lse[:, :, 5:] == float("-inf")).all()


def test_key_shard_interface_and_backend_resolution():
    """The Triton and reference backends implement KeyShardTemperature with the parameter names
    of the protocol; the adaptive temperature refuses a backend without it, and "auto" passes
    over one."""
    import inspect

    for name in ("triton", "reference"):
        mod = backends.get(name)
        assert isinstance(mod, KeyShardTemperature), name
        for fn in ("row_dbeta", "backward_given_g"):
            expected = [p for p in inspect.signature(getattr(KeyShardTemperature, fn)).parameters if p != "self"]
            assert list(inspect.signature(getattr(mod, fn)).parameters) == expected, (name, fn)
    assert not isinstance(backends.get("cuda"), KeyShardTemperature)

    q = torch.zeros(1, 2, 4, 8)
    spec = AttentionSpec(scale=1.0, adaptive=True)
    with pytest.raises(ValueError, match="needs beta"):
        P.partial_forward(q, q, q, (), None, spec, "reference")
    with pytest.raises(ValueError, match="needs temp and g"):
        P.partial_backward(q, q, q, q, q, q[..., 0], (), spec, "reference")
    with pytest.raises(ValueError, match="adaptive temperature"):
        P.partial_dbeta(q, q, q, q, q, q[..., 0], (), None, AttentionSpec(scale=1.0), "reference")
    with pytest.raises(backends.BackendUnavailableError, match="row_dbeta"):
        P.partial_dbeta(q, q, q, q, q, q[..., 0], (), None, spec, "cuda")
