"""The reference's attention sinks and logit soft-capping (issue 26, docs/maths.md "Attention sinks
and soft-capping") against independent formulations:

* sinks as one more key: a zero key row and a zero value row appended to every key/value head, the
  sink logit ``s_h`` put on that column by an additive float mask, run through the reference
  *without* sinks (SSA: ``phi(0) = 0``, softcap: ``c tanh(0) = 0``, so the column's logit is ``s_h``);
* the weights written directly in the power form ``(1 + b|z|)^(sgn(z) n)`` / ``exp(z)`` with the
  sink weight ``exp(s_h)``, the adaptive temperature as powers ``w^beta``, no log-sum-exp;
* the sink's gradient from the formula of docs/maths.md against autograd;
* float64 gradcheck of q, k, v, b, n and the sinks under soft-capping.
"""
import math

import pytest
import torch

from ssa_flash import reference, scores
from ssa_flash.temperature import DEFAULT_POLY, DEFAULT_THRESHOLD

D64 = torch.float64
MODES = ["softmax", "ssa", "adaptive", "ssa_adaptive"]


def _call(mode, q, k, v, b=None, n=None, **kw):
    if mode == "softmax":
        return reference.attention(q, k, v, **kw)
    if mode == "adaptive":
        return reference.attention(q, k, v, **kw, adaptive_temperature=True)
    return reference.attention(q, k, v, score="ssa", score_params=(b, n), adaptive_temperature=(mode == "ssa_adaptive"),
                               **kw)


def _inputs(B=2, Hq=2, Hkv=2, Lq=5, Lk=6, D=4, q_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=D64) * q_scale
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=D64)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=D64)
    b = 0.5 + torch.rand(Hq, generator=g, dtype=D64)
    n = 1.0 + 1.5 * torch.rand(Hq, generator=g, dtype=D64)
    sinks = torch.randn(Hq, generator=g, dtype=D64)
    return [t.requires_grad_() for t in (q, k, v, b, n, sinks)]


def _allowed(Lq, Lk, causal=False, window=(-1, -1), bool_mask=None):
    """The admissible set, written out (top-left alignment)."""
    i = torch.arange(Lq).view(Lq, 1)
    j = torch.arange(Lk).view(1, Lk)
    ok = torch.ones(Lq, Lk, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window[0] >= 0:
        ok &= j >= i - window[0]
    if window[1] >= 0:
        ok &= j <= i + window[1]
    if bool_mask is not None:
        ok = ok & bool_mask
    return ok


CASES = {
    # name: (reference keywords, Hkv, what _allowed needs)
    "plain": ({}, 2, {}),
    "causal_gqa": ({"is_causal": True, "enable_gqa": True}, 1, {"causal": True}),
    "window": ({"window_size": (2, 1)}, 2, {"window": (2, 1)}),
    "bool_mask_empty_row": (None, 2, None),  # built in _case
    "float_mask": (None, 2, None),
}


def _case(name, Lq, Lk, Hq):
    """``(keywords for the reference, Hkv, allowed (Lq, Lk) bool, float mask or None)``."""
    if name == "bool_mask_empty_row":
        m = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(3)) > 0.4
        m[0, 0] = True
        m[1] = False  # a row with no admissible key
        return {"attn_mask": m}, 2, m, None
    if name == "float_mask":
        fm = torch.randn(1, Hq, Lq, Lk, generator=torch.Generator().manual_seed(4), dtype=D64)
        fm[..., 2, :3] = float("-inf")
        return {"attn_mask": fm}, 2, torch.ones(Lq, Lk, dtype=torch.bool), fm
    kw, hkv, akw = CASES[name]
    return dict(kw), hkv, _allowed(Lq, Lk, **akw), None


def _extended(mode, q, k, v, b, n, sinks, allowed, fmask, softcap, enable_gqa, **kw):
    """The reference without sinks on inputs with one more key (zero key, zero value) whose logit
    is the sink, carried by an additive float mask; the admissible set goes into the same mask."""
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    k_ext = torch.cat([k, k.new_zeros(B, k.shape[1], 1, k.shape[3])], dim=2)
    v_ext = torch.cat([v, v.new_zeros(B, v.shape[1], 1, v.shape[3])], dim=2)
    m = torch.zeros(B, Hq, Lq, Lk, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    if fmask is not None:
        m = m + fmask
    sink_col = sinks.view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
    mask = torch.cat([m, sink_col], dim=-1)
    return _call(mode, q, k_ext, v_ext, b, n, attn_mask=mask, enable_gqa=enable_gqa, softcap=softcap,
                 return_lse=True, **kw)


def _grads(outputs, inputs, seed=7):
    """Gradients of a fixed random projection of ``(out, lse)`` (lse where finite)."""
    out, lse = outputs
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=D64)
    dlse = torch.randn(lse.shape, generator=g, dtype=D64)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_sinks_equal_an_extra_key_column(mode, case, softcap):
    """Outputs, LSE and every gradient (q, k, v, b, n, sinks) equal the extra-key formulation."""
    Hq, Lq, Lk = 2, 5, 6
    kw, Hkv, allowed, fmask = _case(case, Lq, Lk, Hq)
    q, k, v, b, n, s = _inputs(Hkv=Hkv, Lq=Lq, Lk=Lk, q_scale=2.0)
    ssa = "ssa" in mode
    b, n = (b, n) if ssa else (None, None)
    got = _call(mode, q, k, v, b, n, sinks=s, softcap=softcap, return_lse=True, **kw)
    want = _extended(mode, q, k, v, b, n, s, allowed, fmask, softcap, kw.get("enable_gqa", False))
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert torch.isfinite(got[1]).all()  # the sink makes every row non-empty
    inputs = [t for t in (q, k, v, b, n, s) if t is not None]
    names = ["q", "k", "v", "b", "n", "sinks"] if ssa else ["q", "k", "v", "sinks"]
    for name, g1, g2 in zip(names, _grads(got, inputs), _grads(want, inputs)):
        torch.testing.assert_close(g1, g2, msg=f"d{name}")


def _poly(h):
    out = torch.zeros_like(h)
    for c in DEFAULT_POLY:
        out = out * h + c
    return out


def _direct(mode, q, k, v, b, n, sinks, softcap, allowed, scale):
    """Weights in the power form, without logs: ``w = exp(z)`` or ``(1 + b|z|)^(sgn(z) n)``, the
    sink's ``exp(s)``; adaptive: ``w^beta / (sum w^beta + exp(s)^beta)``. Returns
    ``(out, lse, entropy)``."""
    Hq = q.shape[1]
    z = scale * q @ k.transpose(-1, -2)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    if "ssa" in mode:
        w = (1 + b.view(1, Hq, 1, 1) * z.abs()) ** (torch.sign(z) * n.view(1, Hq, 1, 1))
    else:
        w = torch.exp(z)
    w = torch.where(allowed, w, 0.0)
    ws = torch.exp(sinks).view(1, Hq, 1).expand(w.shape[:-1])
    total = w.sum(-1) + ws
    p, ps = w / total.unsqueeze(-1), ws / total
    h = -(torch.xlogy(p, p).sum(-1) + torch.xlogy(ps, ps))
    if "adaptive" in mode:
        beta = torch.where(h > DEFAULT_THRESHOLD, torch.clamp(_poly(h), min=1.0), 1.0)
        w, ws = w ** beta.unsqueeze(-1), ws ** beta
        total = w.sum(-1) + ws
    return (w / total.unsqueeze(-1)) @ v, torch.log(total), h


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_against_the_power_form(mode, softcap):
    """Output, LSE (with the sink) and, through ``attention_entropy``, the row entropy including
    the sink, against weights written without any log-domain step."""
    q, k, v, b, n, s = _inputs(Lq=6, Lk=6, q_scale=2.5)
    allowed = _allowed(6, 6, causal=True)
    out, lse = _call(mode, q, k, v, b, n, sinks=s, softcap=softcap, is_causal=True, return_lse=True)
    want_out, want_lse, want_h = _direct(mode, q, k, v, b, n, s, softcap, allowed, 0.5)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    ssa = "ssa" in mode
    h = reference.attention_entropy(q, k, is_causal=True, score="ssa" if ssa else "softmax",
                                    score_params=(b, n) if ssa else None, sinks=s, softcap=softcap)
    torch.testing.assert_close(h, want_h)
    if "adaptive" in mode:  # the inputs do exercise the temperature on both sides of the threshold
        assert (want_h > DEFAULT_THRESHOLD).any() and (want_h <= DEFAULT_THRESHOLD).any()


@pytest.mark.parametrize("mode", MODES)
def test_softcap_without_sinks_against_the_power_form(mode):
    q, k, v, b, n, _ = _inputs(q_scale=3.0)
    allowed = torch.ones(5, 6, dtype=torch.bool)
    minus_inf = torch.full((2,), float("-inf"), dtype=D64)  # exp(-inf) = 0: the formula without a sink
    want_out, want_lse, _ = _direct(mode, q, k, v, b, n, minus_inf, 1.25, allowed, 0.5)
    out, lse = _call(mode, q, k, v, b, n, softcap=1.25, return_lse=True)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["causal_gqa", "bool_mask_empty_row", "float_mask", "window"])
def test_gradcheck_sinks_softcap(mode, case):
    """float64 gradcheck of q, k, v, (b, n,) sinks under soft-capping, LSE included."""
    Hq, Lq, Lk = 2, 4, 3
    kw, Hkv, _, _ = _case(case, Lq, Lk, Hq)
    q, k, v, b, n, s = _inputs(B=1, Hkv=Hkv, Lq=Lq, Lk=Lk, D=2, q_scale=2.5, seed=1)
    inputs = (q, k, v, b, n, s) if "ssa" in mode else (q, k, v, s)

    def f(*a):
        bn = a[3:5] if "ssa" in mode else (None, None)
        out, lse = _call(mode, *a[:3], *bn, sinks=a[-1], softcap=1.5, return_lse=True, **kw)
        return out, lse

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def _dsink_formula(mode, q, k, v, b, n, s, out, lse, dout, dlse, scale):
    """docs/maths.md: ``ds_h = sum_i [beta_i dS'_i,sink - g_i P_i,sink (log P_i,sink + H_i)]``
    with ``dS'_i,sink = -P'_i,sink delta_i``, ``delta_i = <dO_i, O_i> - dlse_i``, and without the
    temperature ``beta = 1``, ``g = 0``: ``ds_h = -sum_i P_i,sink delta_i``. Everything from the
    forward's ``out`` and ``lse`` plus the logit row, as a kernel would have them."""
    Hq = q.shape[1]
    delta = (dout * out).sum(-1) - dlse
    sh = s.view(1, Hq, 1)
    if "adaptive" not in mode:
        p_sink = torch.exp(sh - lse)
        return -(p_sink * delta).sum(dim=(0, 2))
    z = scale * q @ k.transpose(-1, -2)
    l = scores.ssa_logits(z, b.view(1, Hq, 1, 1), n.view(1, Hq, 1, 1)) if "ssa" in mode else z
    l_ext = torch.cat([l, sh.unsqueeze(-1).expand(*l.shape[:-1], 1)], dim=-1)
    logp = l_ext - torch.logsumexp(l_ext, dim=-1, keepdim=True)  # the temperature-free row P
    p = logp.exp()
    h = -(p * logp).sum(-1)
    active = (h > DEFAULT_THRESHOLD) & (_poly(h) > 1)
    beta = torch.where(active, _poly(h), 1.0)
    dpoly = torch.zeros_like(h)
    for i, c in enumerate(DEFAULT_POLY[:-1]):
        dpoly = dpoly * h + c * (len(DEFAULT_POLY) - 1 - i)
    p_t = torch.exp(beta.unsqueeze(-1) * l_ext - lse.unsqueeze(-1))  # P' = softmax(beta l)
    v_ext = torch.cat([v, v.new_zeros(*v.shape[:-2], 1, v.shape[-1])], dim=-2)
    dp = dout @ v_ext.transpose(-1, -2)  # the sink column's dP is 0 (zero value)
    ds_t = p_t * (dp - delta.unsqueeze(-1))
    dbeta = (ds_t * l_ext).sum(-1)  # the sink's entry s_h counts in dbeta too
    g = torch.where(active, dbeta * dpoly, 0.0)
    ds = beta * ds_t[..., -1] - g * p[..., -1] * (logp[..., -1] + h)
    return ds.sum(dim=(0, 2))


@pytest.mark.parametrize("mode", MODES)
def test_sink_gradient_formula(mode):
    """The analytic d s_h of docs/maths.md (plain, and through the adaptive temperature's entropy
    path) against autograd, with an LSE gradient."""
    q, k, v, b, n, s = _inputs(Lq=7, Lk=7, q_scale=2.5, seed=2)
    with torch.no_grad():
        s.mul_(3.0)  # sinks large enough to matter
    out, lse = _call(mode, q, k, v, b, n, sinks=s, return_lse=True, scale=0.5)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g, dtype=D64)
    dlse = torch.randn(lse.shape, generator=g, dtype=D64)
    (want,) = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), [s])
    with torch.no_grad():
        got = _dsink_formula(mode, q, k, v, b, n, s, out, lse, dout, dlse, 0.5)
    torch.testing.assert_close(got, want)
    if "adaptive" in mode:  # the entropy path is exercised: some rows have an active temperature
        ssa = "ssa" in mode
        h = reference.attention_entropy(q, k, scale=0.5, score="ssa" if ssa else "softmax",
                                        score_params=(b, n) if ssa else None, sinks=s)
        assert ((h > DEFAULT_THRESHOLD) & (_poly(h) > 1)).any()


@pytest.mark.parametrize("mode", MODES)
def test_rows_with_no_key_go_to_the_sink(mode):
    """Fully masked rows: output 0, LSE = s_h, every gradient finite, d s_h = dlse summed."""
    q, k, v, b, n, s = _inputs()
    m = torch.ones(5, 6, dtype=torch.bool)
    m[1] = False
    m[3] = False
    out, lse = _call(mode, q, k, v, b, n, attn_mask=m, sinks=s, softcap=2.0, return_lse=True)
    assert (out[:, :, [1, 3]] == 0).all()
    torch.testing.assert_close(lse[:, :, [1, 3]], s.detach().view(1, 2, 1).expand(2, 2, 2))
    dlse = torch.zeros_like(lse)
    dlse[:, :, [1, 3]] = 1.0
    grads = torch.autograd.grad((out.sum()) * 0 + (lse * dlse).sum(), [q, k, v, s])
    assert all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(grads[3], torch.full((2,), 4.0, dtype=D64))  # 2 batches x 2 rows
    # every row empty, and the entropy of the sink-only row is 0
    none = torch.zeros(5, 6, dtype=torch.bool)
    out, lse = _call(mode, q, k, v, b, n, attn_mask=none, sinks=s, return_lse=True)
    assert (out == 0).all()
    grads = torch.autograd.grad(out.sum() + lse.sum(), [q, k, v, s])
    assert all(torch.isfinite(g).all() for g in grads)
    h = reference.attention_entropy(q, k, none, sinks=s)
    assert (h == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_large_softcap_is_no_softcap(mode):
    q, k, v, b, n, _ = _inputs(q_scale=2.0)
    a = _call(mode, q, k, v, b, n, softcap=1e4, return_lse=True, is_causal=True)
    c = _call(mode, q, k, v, b, n, return_lse=True, is_causal=True)
    torch.testing.assert_close(a[0], c[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a[1], c[1], rtol=1e-6, atol=1e-6)
    # and a small cap does change the result (the keyword is not ignored)
    assert not torch.allclose(_call(mode, q, k, v, b, n, softcap=0.5), c[0])


@pytest.mark.parametrize("mode", MODES)
def test_minus_inf_sink_is_no_sink(mode):
    q, k, v, b, n, _ = _inputs()
    m = torch.ones(5, 6, dtype=torch.bool)
    m[2] = False
    a = _call(mode, q, k, v, b, n, attn_mask=m, sinks=float("-inf"), return_lse=True)
    c = _call(mode, q, k, v, b, n, attn_mask=m, return_lse=True)
    torch.testing.assert_close(a[0], c[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], c[1], rtol=0, atol=0)  # the empty row: 0 and -inf
    ga = _grads(a, [q, k, v])
    gc = _grads(c, [q, k, v])
    for x, y in zip(ga, gc):
        torch.testing.assert_close(x, y)


def test_float_sink_is_a_per_head_constant():
    q, k, v, b, n, _ = _inputs()
    a = reference.attention(q, k, v, score="ssa", score_params=(b, n), sinks=0.7, return_lse=True)
    c = reference.attention(q, k, v, score="ssa", score_params=(b, n), sinks=torch.full((2,), 0.7, dtype=D64),
                            return_lse=True)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    # the weights of a row sum to 1 - P_sink < 1: with v = I the output is the weight matrix
    eye = torch.eye(6, dtype=D64).expand(2, 2, 6, 6)
    w = reference.attention(q, k, eye, sinks=0.7)
    lse = reference.attention(q, k, eye, sinks=0.7, return_lse=True)[1]
    torch.testing.assert_close(w.sum(-1), 1 - torch.exp(0.7 - lse))


def test_sink_not_subject_to_dropout():
    """Dropout acts on the key weights (mask of the keys' shape), after the sink's column is gone:
    ``P * M / (1 - p)`` with ``P`` the sink-attended weights; the LSE is unchanged."""
    q, k, v, b, n, s = _inputs()
    eye = torch.eye(6, dtype=D64).expand(2, 2, 6, 6)
    keep = torch.rand(2, 2, 5, 6, generator=torch.Generator().manual_seed(9)) > 0.3
    w, lse = reference.attention(q, k, eye, score="ssa", score_params=(b, n), sinks=s, return_lse=True)
    wd, lsed = reference.attention(q, k, eye, score="ssa", score_params=(b, n), sinks=s, return_lse=True, dropout_p=0.3,
                                   dropout_mask=keep)
    torch.testing.assert_close(wd, torch.where(keep, w / 0.7, 0.0))
    torch.testing.assert_close(lsed, lse)


def test_bad_softcap_and_sinks():
    q, k, v, b, n, _ = _inputs()
    with pytest.raises(ValueError, match="softcap"):
        reference.attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap"):
        reference.attention_entropy(q, k, softcap=float("nan"))
    with pytest.raises(ValueError, match="sinks"):
        reference.attention(q, k, v, sinks=torch.zeros(3, dtype=D64))


@pytest.mark.parametrize("adaptive", [False, True])
def test_varlen_sinks_per_sequence(adaptive):
    """Each packed sequence is the dense computation with the same sinks and softcap; a sequence
    with no key puts its rows on the sink (output 0, LSE s_h)."""
    g = torch.Generator().manual_seed(11)
    lq, lk = [3, 2, 4], [4, 0, 5]
    cq = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    ck = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    q = torch.randn(9, 2, 4, generator=g, dtype=D64).requires_grad_()
    k = torch.randn(9, 2, 4, generator=g, dtype=D64).requires_grad_()
    v = torch.randn(9, 2, 4, generator=g, dtype=D64).requires_grad_()
    b = torch.tensor([0.8, 1.3], dtype=D64)
    n = torch.tensor([1.5, 2.0], dtype=D64)
    s = torch.tensor([0.4, -0.9], dtype=D64, requires_grad=True)
    kw = dict(score="ssa", score_params=(b, n), adaptive_temperature=adaptive, sinks=s, softcap=2.0, is_causal=True)
    out, lse = reference.varlen_attention(q, k, v, cq, ck, return_lse=True, **kw)
    for i in range(3):
        rows = slice(int(cq[i]), int(cq[i + 1]))
        keys = slice(int(ck[i]), int(ck[i + 1]))
        if lk[i] == 0:
            assert (out[rows] == 0).all()
            torch.testing.assert_close(lse[:, rows], s.detach().view(2, 1).expand(2, lq[i]))
            continue
        o, l_ = reference.attention(*(x[r].transpose(0, 1).unsqueeze(0) for x, r in
                                      ((q, rows), (k, keys), (v, keys))), return_lse=True, **kw)
        torch.testing.assert_close(out[rows], o[0].transpose(0, 1))
        torch.testing.assert_close(lse[:, rows], l_[0])
    grads = torch.autograd.grad(out.sum() + lse.sum(), [q, k, v, s])
    assert all(torch.isfinite(t).all() for t in grads)


def test_kvcache_sinks_per_row():
    """Decoding with sinks: each batch element is the dense attention over its valid cache rows
    with the bottom-right causal mask and the same sinks; an element with no valid row: 0 and s_h."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(3, 2, 2, 4, generator=g, dtype=D64)
    kc = torch.randn(3, 2, 6, 4, generator=g, dtype=D64)
    vc = torch.randn(3, 2, 6, 4, generator=g, dtype=D64)
    s = torch.tensor([0.2, 1.1], dtype=D64)
    lens = torch.tensor([5, 0, 3], dtype=torch.int32)
    out, lse = reference.attention_with_kvcache(q, kc, vc, lens, score="softmax", sinks=s, softcap=3.0,
                                                return_lse=True)
    assert (out[1] == 0).all()
    torch.testing.assert_close(lse[1], s.view(2, 1).expand(2, 2))
    for i in (0, 2):
        L = int(lens[i])
        o, l_ = reference.attention(q[i:i + 1], kc[i:i + 1, :, :L], vc[i:i + 1, :, :L], sinks=s,
                                    softcap=3.0, return_lse=True)
        torch.testing.assert_close(out[i:i + 1], o)
        torch.testing.assert_close(lse[i:i + 1], l_)
    # bottom-right causality with sinks: against the extra-key formulation
    out_c, lse_c = reference.attention_with_kvcache(q, kc, vc, lens, score="softmax", sinks=s, is_causal=True,
                                                    return_lse=True)
    L = 5
    allowed = torch.arange(L).view(1, L) <= torch.arange(2).view(2, 1) + (L - 2)
    want = _extended("softmax", q[:1], kc[:1, :, :L], vc[:1, :, :L], None, None, s, allowed, None, 0.0, False)
    torch.testing.assert_close(out_c[:1], want[0])
    torch.testing.assert_close(lse_c[:1], want[1])
