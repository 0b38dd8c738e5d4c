"""The logit scale (``ssa_flash.scores.LOGIT_SCALE``, phi(z) = s_h z; csrc/logits.h, LogitScale) in the
CUDA kernels, on the CPU through the emulation of the kernels (csrc/emu, tests/emu_harness.py) driving
the CUDA backend's functions: forward, lse, and the gradients of q, k, v and s against a few lines of
torch (float64 gold, the input precision for the naive run: FlashAttention's error rule), with masks,
causality, GQA, soft-capping, the adaptive temperature, sinks, dropout, windows, both backward paths,
s = 0 (uniform weights) and float16 / bfloat16."""
from __future__ import annotations

import math

import pytest
import torch

from attn_testing import FLOORS, fa_tolerance_check
from emulation import build_emulator
from ssa_flash import reference, temperature

POLY = temperature.DEFAULT_POLY
THRESHOLD = 0.5


@pytest.fixture(scope="module")
def emu():
    return build_emulator()


def torch_logit_scale(q, k, v, s, *, scale, mask=None, causal=False, softcap=0.0, sinks=None, adaptive=False,
                      keep=None, dropout_p=0.0, window=(-1, -1)):
    """(out, lse) of softmax(beta * l) v, l = s_h z' + mask, z' = c tanh(z / c) (z without a cap),
    z = scale q k^T; the sink s_h appended to each row (zero value); beta from the entropy of
    softmax(l) (the adaptive temperature); dropout by the keep-mask ``keep`` on the final weights.
    Every row must have an admissible key."""
    B, H, Lq, _ = q.shape
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    z = scale * q @ k.transpose(-1, -2)
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    l = s.to(z.dtype).view(1, H, 1, 1) * z
    Lk = k.shape[2]
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if causal or window != (-1, -1):
        allowed = allowed & reference.window_band(Lq, Lk, (window[0], 0 if causal else window[1]))
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        l = l + mask.to(l.dtype)
    if sinks is not None:
        l = torch.cat([l, sinks.to(l.dtype).view(1, H, 1, 1).expand(B, H, Lq, 1)], dim=-1)
        allowed = torch.cat([allowed, torch.ones(B, H, Lq, 1, dtype=torch.bool)], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[:, :, :1])], dim=-2)
    l = l.masked_fill(~allowed, -math.inf)
    if adaptive:
        logp = torch.where(allowed, torch.log_softmax(l, dim=-1), 0)
        ent = -(logp.exp() * logp).sum(-1)
        p = temperature.polyval(POLY, ent)
        beta = torch.where((ent > THRESHOLD) & (p > 1), p, torch.ones_like(p))
        l = beta[..., None] * l
    lse = torch.logsumexp(l, dim=-1)
    w = torch.exp(l - lse[..., None])
    if keep is not None:
        keep = torch.cat([keep, torch.ones_like(keep[..., :1])], -1) if sinks is not None else keep
        w = torch.where(keep, w / (1 - dropout_p), 0)
    return w @ v, lse


def _grads(fn, q, k, v, s, sinks, dout, dlse, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, s)]
    sk = None if sinks is None else sinks.detach().clone().requires_grad_()
    out, lse = fn(*leaves, sinks=sk, **kw)
    loss = (out.double() * dout.double()).sum() + (lse.double() * dlse.double()).sum()
    gs = torch.autograd.grad(loss, leaves + ([sk] if sk is not None else []))
    res = dict(out=out.detach(), lse=lse.detach(), dq=gs[0], dk=gs[1], dv=gs[2], ds=gs[3])
    if sk is not None:
        res["dsinks"] = gs[4]
    return res


def _case(emu, *, dtype=torch.float16, B=2, Hq=4, Hkv=2, Lq=70, Lk=90, D=32, s_values=None, mask=None,
          causal=False, softcap=0.0, sinks=False, adaptive=False, deterministic=False, dropout_p=0.0,
          window=(-1, -1), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64).to(dtype)
    dout = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64).to(dtype)
    dlse = torch.randn(B, Hq, Lq, generator=g)
    s = (torch.tensor(s_values, dtype=torch.float32) if s_values is not None
         else 0.5 + torch.rand(Hq, generator=g))
    sk = torch.randn(Hq, generator=g) if sinks else None
    scale = D ** -0.5
    rng = keep = None
    if dropout_p > 0:
        rng = torch.tensor((1234, 5), dtype=torch.int64)
        keep = reference.dropout_keep_mask(1234, 5, (B, Hq, Lq, Lk), dropout_p)
    full_mask = None if mask is None else mask.expand(B, Hq, Lq, Lk)
    ours = emu.attention(q, k, v, mask=full_mask, score="logit_scale", params=(s,), scale=scale, causal=causal,
                         group=Hq // Hkv, adaptive=adaptive, poly=POLY, threshold=THRESHOLD, dout=dout, dlse=dlse,
                         deterministic=deterministic, dropout_p=dropout_p, dropout_rng=rng, window_size=window,
                         sinks=sk, softcap=softcap)
    kw = dict(scale=scale, mask=full_mask, causal=causal, softcap=softcap, adaptive=adaptive, keep=keep,
              dropout_p=dropout_p, window=window)
    d64 = dict(kw, mask=full_mask if full_mask is None or full_mask.dtype == torch.bool else full_mask.double())
    gold = _grads(torch_logit_scale, q.double(), k.double(), v.double(), s.double(),
                  None if sk is None else sk.double(), dout, dlse, **d64)
    naive = _grads(torch_logit_scale, q, k, v, s.to(dtype), None if sk is None else sk.to(dtype), dout,
                   dlse.to(dtype), **kw)
    floor = FLOORS[dtype]
    names = ["out", "lse", "dq", "dk", "dv", "ds"] + (["dsinks"] if sinks else [])
    for name in names:
        o = ours[name]
        assert torch.isfinite(o).all(), f"{name} has non-finite entries"
        # (ds sums Lq Lk terms per head: relative to its size, the kernels' error stays below 1e-3
        # where the naive run's reaches 1e-2, so the plain floor holds it to about 0.5 % in float16)
        fl = floor * (1 if name in ("out", "lse", "ds", "dsinks") else 4)
        fa_tolerance_check(name, o, naive[name], gold[name], fl)
    return ours, gold


def _bool_mask(Lq, Lk, seed=1):
    m = torch.rand(2, 1, Lq, Lk, generator=torch.Generator().manual_seed(seed)) > 0.3
    m[..., 0] = True  # (every row keeps a key: the torch lines above assume it)
    return m


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_logit_scale_plain(emu, dtype, adaptive):
    _case(emu, dtype=dtype, adaptive=adaptive)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "two_kernel"])
def test_logit_scale_causal_bool_mask_gqa(emu, adaptive, deterministic):
    _case(emu, causal=True, mask=_bool_mask(70, 90), adaptive=adaptive, deterministic=deterministic)


def test_logit_scale_additive_mask(emu):
    m = torch.randn(1, 4, 70, 90, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    _case(emu, mask=m, adaptive=True)


@pytest.mark.parametrize("extras", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_logit_scale_softcap_sinks(emu, extras, adaptive):
    _case(emu, softcap=2.0 if extras != "sinks" else 0.0, sinks=extras != "softcap", adaptive=adaptive,
          causal=extras == "both")


def test_logit_scale_dropout_window(emu):
    _case(emu, dropout_p=0.2, window=(20, 5), B=1, Hq=2, Hkv=1)


def test_logit_scale_zero_is_uniform(emu):
    """s_h = 0: uniform weights over the admissible keys (out = their mean of v, lse = log of
    their count), finite gradients, ds the torch lines' value; next to a head with s_h > 0."""
    ours, gold = _case(emu, s_values=[0.0, 1.0, 0.0, 2.0], causal=True, B=1, Lq=40, Lk=40)
    Lq = 40
    counts = torch.arange(1, Lq + 1, dtype=torch.float64)
    assert torch.allclose(ours["lse"][0, 0].double(), counts.log(), atol=1e-5)
    assert ours["ds"][0].abs() > 0 and torch.isfinite(ours["ds"]).all()


def test_logit_scale_head_dim_padding_and_long_rows(emu):
    """A head dim that is not a multiple of 8 (padded) and rows long enough for interior key
    blocks (the forward's steady-state loop with its conditional rescaling)."""
    _case(emu, D=27, Lq=150, Lk=400, B=1, Hq=2, Hkv=2)


def test_logit_scale_parameter_count_is_checked(emu):
    """The backend takes exactly the registry's parameters for the score function (one for
    logit_scale) and says so otherwise."""
    from ssa_flash.backends import cuda_backend
    from ssa_flash.spec import AttentionSpec

    q = torch.zeros(1, 2, 16, 32, dtype=torch.float16)
    spec = AttentionSpec(scale=0.5, score="logit_scale")
    with cuda_backend.emulated(emu):
        with pytest.raises(ValueError, match="takes 1 parameters"):
            cuda_backend.forward(q, q, q, None, (), None, None, spec)
        out, lse = cuda_backend.forward(q, q, q, None, (torch.ones(2),), None, None, spec)
        assert cuda_backend.supports(q, q, q, spec) is None
        assert "no policy" in cuda_backend.supports(q, q, q, AttentionSpec(scale=0.5, score="nope"))
    assert torch.isfinite(out).all() and torch.allclose(lse, torch.full_like(lse, math.log(16)))
