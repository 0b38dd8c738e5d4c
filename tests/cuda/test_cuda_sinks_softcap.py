"""Attention sinks and logit soft-capping in the CUDA C++ kernels (docs/maths.md §6): the kernels
instantiated with them (csrc/dispatch.h, extras_switch), on the CPU through the emulation of the
kernels (csrc/emu, emulation.py) in float16, on a GPU through the extension, against the float64
specification (ssa_flash.reference) by FlashAttention's rule (attn_testing.compare): out, lse
and the gradients of q, k, v, b, n and the sinks, for the four variants with sinks, soft-capping
and both, combined with causality, masks (rows with no admissible key), GQA, windows, dropout
and either backward path. The CUDA backend has no packed or KV-cache path (docs/support.md), so
those combinations are the Triton and reference backends' alone."""
from __future__ import annotations

import math

import pytest
import torch

import ssa_flash
from attn_testing import CUDA, MODES, call, compare, detached_copy, head_params
from emulation import cuda_backend_context
from ssa_flash import reference
from ssa_flash.backends import cuda_backend
from ssa_flash.spec import AttentionSpec

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]
EXTRAS = {"sinks": dict(sinks=True), "softcap": dict(softcap=2.0), "both": dict(sinks=True, softcap=1.5)}


@pytest.fixture(scope="module")
def runs_on():
    """The context the CUDA backend runs in: the extension on a GPU, else the emulator."""
    return cuda_backend_context()


def _sinks(H, scale=1.5, seed=4):
    """Per-head sink logits around the rows' logits (so that P_sink is neither ~0 nor ~1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(H, generator=g, dtype=torch.float64) * scale).to(DEVICE, torch.float32)


def _run(module, mode, q, k, v, b, n, sinks, dout, dlse, **kw):
    """(out, lse, {name: grad}) of one variant with ``sinks`` (a leaf, or None)."""
    out, lse = call(module, mode, q, k, v, b, n, sinks=sinks, return_lse=True, **kw)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse.double()).sum()
    named = [(nm, t) for nm, t in zip(("q", "k", "v", "b", "n", "sinks"), (q, k, v, b, n, sinks))
             if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss, [t for _, t in named])
    return out, lse, {nm: g for (nm, _), g in zip(named, grads)}


class _Spec:
    """ssa_flash.reference with the ``backend`` / ``deterministic`` keywords dropped."""

    def __getattr__(self, name):
        fn = getattr(reference, name)
        return lambda *a, backend=None, deterministic=None, **kw: fn(*a, **kw)


def _check(runs_on, mode, extras, dtype=torch.float16, B=2, Hq=4, Hkv=2, Lq=70, Lk=150, D=32, with_dlse=True,
           dropout_p=0.0, mask=None, seed=0, **kw):
    """The CUDA backend against the naive reference in ``dtype`` and the float64 gold; returns
    ours (out, lse, grads) and the inputs' sinks."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g, dtype=torch.float64)
               for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    q, k, v = (t.to(DEVICE, dtype).requires_grad_() for t in (q * 1.5, k, v))
    dout = torch.randn(B, Hq, Lq, D, generator=g).to(DEVICE)
    dlse = torch.randn(B, Hq, Lq, generator=g).to(DEVICE) if with_dlse else None
    b = n = None
    if "ssa" in mode:
        b, n = head_params(Hq, device=DEVICE)
    sinks = _sinks(Hq).requires_grad_() if extras.get("sinks") else None
    kw = dict(kw, softcap=extras.get("softcap", 0.0))
    if Hq != Hkv:
        kw["enable_gqa"] = True
    if mask is not None:
        kw["attn_mask"] = mask.to(DEVICE) if mask.dtype == torch.bool else mask.to(DEVICE, dtype)
    ref_kw = dict(kw)
    if dropout_p:
        kw["dropout_p"] = ref_kw["dropout_p"] = dropout_p
        torch.manual_seed(1234)
        ref_kw["dropout_mask"] = ssa_flash.dropout_mask((B, Hq, Lq, Lk), dropout_p, device=DEVICE)
        torch.manual_seed(1234)  # ours draws the same (seed, offset)
    with runs_on():
        ours = _run(ssa_flash, mode, q, k, v, b, n, sinks, dout, dlse, backend="cuda", **kw)
    naive = _run(_Spec(), mode, q, k, v, b, n, sinks, dout, dlse, **ref_kw)
    d64 = lambda t: detached_copy(t, torch.float64)  # noqa: E731
    gold_kw = {key: (val.double() if torch.is_tensor(val) and val.is_floating_point() else val)
               for key, val in ref_kw.items()}
    gold = _run(_Spec(), mode, d64(q), d64(k), d64(v), d64(b), d64(n), d64(sinks), dout, dlse, **gold_kw)
    assert ours[0].dtype == dtype and ours[0].shape == gold[0].shape
    # dsinks sums over every row of a head (B Lq of them): compare's sqrt(Lq Lk) floor of b, n
    # would be too loose, its 4 x floor of q, k, v too tight for float16 sums; checked on its own
    ds = ours[2].pop("sinks", None)
    compare(ours, (naive[0], naive[1], {nm: naive[2][nm] for nm in ours[2]}),
            (gold[0], gold[1], {nm: gold[2][nm] for nm in ours[2]}), dtype, Lq, Lk)
    if ds is not None:
        from attn_testing import FLOORS, fa_tolerance_check
        fa_tolerance_check("dsinks", ds, naive[2]["sinks"], gold[2]["sinks"], FLOORS[dtype] * math.sqrt(B * Lq))
        ours[2]["sinks"] = ds
    return ours, sinks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extras", list(EXTRAS), ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_cuda_sinks_softcap_variants(runs_on, mode, extras, dtype):
    """Each variant with sinks, soft-capping and both: GQA, dlse, interior key blocks (no mask, not
    causal: the forward's steady-state loop, the fused backward) and ragged ends."""
    _check(runs_on, mode, EXTRAS[extras], dtype)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_sinks_softcap_causal_masked(runs_on, mode):
    """Both extras with causality, a boolean mask with rows that attend to nothing (output 0,
    lse = s_h: all their weight on the sink), the two-kernel backward (deterministic)."""
    mask = torch.rand(2, 1, 77, 130, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, :, 5] = False
    ours, sinks = _check(runs_on, mode, EXTRAS["both"], B=2, Lq=77, Lk=130, is_causal=True, mask=mask,
                         deterministic=True)
    out, lse = ours[0], ours[1]
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))
    torch.testing.assert_close(lse[:, :, 5], sinks.detach().view(1, -1).expand(2, -1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_sinks_softcap_float_mask_window_dropout(runs_on, mode):
    """Both extras with an additive mask (-inf entries), a local window and dropout (which leaves
    the sink alone)."""
    mask = torch.randn(1, 1, 90, 120, generator=torch.Generator().manual_seed(6))
    mask[:, :, ::7] = float("-inf")
    _check(runs_on, mode, EXTRAS["both"], B=1, Hq=2, Hkv=1, Lq=90, Lk=120, mask=mask, window_size=(40, 8),
           dropout_p=0.25)


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
@pytest.mark.parametrize("extras", ["sinks", "softcap"])
def test_cuda_sinks_softcap_window_dropout_alone(runs_on, mode, extras):
    """Each extra alone with a causal window (the checked loops only) and with dropout."""
    _check(runs_on, mode, EXTRAS[extras], B=1, Hq=2, Hkv=2, Lq=100, Lk=100, is_causal=True, window_size=(30, -1))
    _check(runs_on, mode, EXTRAS[extras], B=1, Hq=2, Hkv=1, Lq=60, Lk=140, dropout_p=0.3, seed=2)


@pytest.mark.parametrize("mode", MODES)
def test_minus_inf_sink_is_no_sink(runs_on, mode):
    """sinks = -inf runs the sink kernels (a sink tensor is given) and computes what the kernels
    without sinks compute, bit for bit; its gradient is 0."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, L, 32, generator=g).to(DEVICE, torch.float16) for L in (50, 90, 90))
    b, n = head_params(2, device=DEVICE) if "ssa" in mode else (None, None)
    dout = torch.randn(1, 2, 50, 32, generator=g).to(DEVICE)
    dlse = torch.randn(1, 2, 50, generator=g).to(DEVICE)
    results = []
    for sinks in (None, torch.full((2,), float("-inf"), device=DEVICE, requires_grad=True)):
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (q, k, v, b, n)]
        with runs_on():
            results.append(_run(ssa_flash, mode, *leaves, sinks, dout, dlse, backend="cuda", is_causal=True))
    (out0, lse0, g0), (out1, lse1, g1) = results
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)
    for name, grad in g0.items():
        assert torch.equal(grad, g1[name]), name
    assert torch.equal(g1["sinks"], torch.zeros(2, device=DEVICE))


def test_entropy_counts_the_sink(runs_on):
    """attention_entropy through the row-entropy kernel: the sink is an entry of the row."""
    g = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 2, L, 32, generator=g).to(DEVICE, torch.float16) for L in (40, 100))
    s = _sinks(2)
    for cap in (0.0, 2.0):
        with runs_on():
            ours = ssa_flash.attention_entropy(q, k, score="ssa", score_params={"b": 0.8, "n": 1.5}, sinks=s,
                                               softcap=cap, backend="cuda")
        gold = reference.attention_entropy(q.double(), k.double(), score="ssa", score_params=(0.8, 1.5),
                                           sinks=s.double(), softcap=cap)
        naive = reference.attention_entropy(q, k, score="ssa", score_params=(0.8, 1.5), sinks=s, softcap=cap)
        err, naive_err = (ours.double() - gold).abs().max(), (naive.double() - gold).abs().max()
        assert err <= 2 * naive_err + 2e-3, (cap, err, naive_err)


def test_supports_accepts_sinks_and_softcap(monkeypatch):
    """The backend takes sinks and soft-capping now (docs/support.md), on a GPU (an A100's
    answers) as on the emulator, and still checks the cap's value in the kernels' call."""
    monkeypatch.setattr(cuda_backend, "_capability", lambda device: (8, 0, 166912))
    monkeypatch.setattr(cuda_backend, "_image_reason", lambda device: None)  # built for it (a GPU machine's is not)
    from attn_testing import fake
    x = fake((1, 4, 8, 64))
    assert cuda_backend.supports(x, x, x, AttentionSpec(scale=0.1, softcap=5.0), torch.zeros(4)) is None
    # every option reaches the binding once, as the spec says it (soft-cap 0: off, no sinks: None)
    assert cuda_backend._spec_args(AttentionSpec(scale=0.1), 0.1, None, 8, 8) == dict(
        sinks=None, score=0, scale=0.1, causal=False, group=1, window_left=-1, window_right=-1, softcap=0.0)
