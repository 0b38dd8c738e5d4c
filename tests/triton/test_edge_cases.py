"""Numerical edge cases with defined behaviour: huge logits, large n, tiny and huge b, float16
near its range, NaN / inf inputs, decoding shapes."""
import pytest
import torch

import ssa_flash
from ssa_flash import reference
from attn_testing import DEVICE, LOW_PRECISION, MODES, call, check, make_qkv, needs_kernels

pytestmark = needs_kernels


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("logit_scale", [1e2, 1e4])
def test_huge_logits(mode, logit_scale):
    """Logits up to +-1e4: finite and matching the reference (float32 in, float64 gold)."""
    q, k, v = make_qkv(Lq=17, Lk=23, D=16)
    q = (q * logit_scale / 16).detach().requires_grad_()  # |z| ~ logit_scale
    check(mode, q, k, v, is_causal=True)


@pytest.mark.parametrize("b,n", [(1.0, 50.0), (1e-4, 1.5), (1e3, 1.5), (1e3, 20.0), (1e-4, 50.0)])
@pytest.mark.parametrize("adaptive", [False, True])
def test_extreme_b_n(b, n, adaptive):
    q, k, v = make_qkv(Lq=19, Lk=21, D=16)
    bt = torch.full((2,), b, device=DEVICE, requires_grad=True)
    nt = torch.full((2,), n, device=DEVICE, requires_grad=True)
    check("ssa_adaptive" if adaptive else "ssa", q, k, v, bt, nt)


# With dlse the kernels' dq error (0.0163 on the CPU) is what it was before 2026-12-01, bisected:
# f6ea1bd made the float32 reference 13x more accurate here (beta * l taken on l less its row max),
# so FlashAttention's rule (2 x the naive error + floor) tightened from 0.026 to 0.0115. The kernels
# keep the float32 LSE of beta * l (~230 * beta in base 2) and lose its low digits; carrying the
# (max, log2 sum) pair of lse_residual.py for every adaptive row would recover them, at a cost to
# every adaptive call. Non-strict: a GPU's exp2 / log2 round differently.
@pytest.mark.parametrize("with_dlse", [False, pytest.param(True, marks=pytest.mark.xfail(
    strict=False, reason="float32 LSE of beta * l at |l| ~ 160: dq 0.0163 > 2 * naive 0.000604 + 0.0103 "
    "since the reference's centred beta * l (f6ea1bd); the kernels are unchanged"))])
def test_adaptive_dbeta_at_large_logits(with_dlse):
    """b = 1e3, n = 20 (logits near 160) and three equal keys, so that the rows that prefer them
    have an active temperature (H near log 3): dbeta = sum_j dS'_ij l_ij summed plainly cancels
    terms the size of the logits, and the rounding of the recomputed P' made dq 4.8x and dk 2.5x
    the tolerance here on the CPU (a GPU's approximate exp2 / log2 fails the plain sum at
    test_extreme_b_n's inputs too); the kernels sum it centred (docs/maths.md section 3.2). With a
    gradient on the LSE, the centred sum's offset lse^l dlse."""
    q, k, v = make_qkv(Lq=19, Lk=21, D=16, seed=1, requires_grad=False)
    k[:, :, 1:3] = k[:, :, :1]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    bt = torch.full((2,), 1e3, device=DEVICE, requires_grad=True)
    nt = torch.full((2,), 20.0, device=DEVICE, requires_grad=True)
    check("ssa_adaptive", q, k, v, bt, nt, with_dlse=with_dlse)


@pytest.mark.parametrize("mode", MODES)
def test_float16_near_its_range(mode):
    """Inputs of magnitude ~200 in float16: q.k reaches 1e5, beyond float16's range, but the
    kernels accumulate in float32; the naive float16 reference overflows."""
    q, k, v = make_qkv(Lq=16, Lk=16, D=16, dtype=LOW_PRECISION[0], requires_grad=False)
    q, k = q * 200, k * 200
    out = call(ssa_flash, mode, q, k, v, 1.0, 1.5, backend="triton")
    gold = call(reference, mode, q.double(), k.double(), v.double(), 1.0, 1.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), gold, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_inputs_propagate(mode, bad):
    """A non-finite query entry poisons its own row (as in SDPA) and no other; no crash."""
    q, k, v = make_qkv(Lq=12, Lk=12, D=16, requires_grad=False)
    q = q.clone()
    q[0, 0, 3, 0] = bad
    out = call(ssa_flash, mode, q, k, v, 1.0, 1.5, backend="triton")
    assert not torch.isfinite(out[0, 0, 3]).all()
    others = torch.ones(out.shape[:-1], dtype=torch.bool, device=DEVICE)
    others[0, 0, 3] = False
    assert torch.isfinite(out[others]).all()
    ref = call(reference, mode, q, k, v, 1.0, 1.5)
    torch.testing.assert_close(out[others], ref[others], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
def test_a_nan_key_reaches_only_the_rows_that_may_attend_to_it(mode):
    """A NaN in the last key of head 0 (docs/reliability.md): every row of head 0 is NaN when it is
    attended to and under an additive -inf mask (NaN + -inf is NaN); nothing is NaN when a boolean
    mask or the causal diagonal excludes it (SDPA's CPU backends differ: tests/docs/test_sdpa_facts.py)."""
    q, k, v = make_qkv(Lq=12, Lk=14, D=16, requires_grad=False)
    k = k.clone()
    k[0, 0, -1, 0] = float("nan")
    keep = torch.ones(12, 14, dtype=torch.bool, device=DEVICE)
    keep[:, -1] = False
    additive = torch.zeros(12, 14, device=DEVICE).masked_fill(~keep, float("-inf"))
    for kwargs, poisoned in (({}, True), ({"attn_mask": additive}, True), ({"attn_mask": keep}, False),
                             ({"is_causal": True}, False)):
        out = call(ssa_flash, mode, q, k, v, 1.0, 1.5, backend="triton", **kwargs)
        assert out[0, 1].isfinite().all(), kwargs  # head 1 has no NaN key
        assert (out[0, 0].isnan().all() if poisoned else out[0, 0].isfinite().all()), kwargs


@pytest.mark.parametrize("mode", MODES)
def test_decoding_shape(mode):
    """One new query against a long cache, with GQA and key padding (Lq = 1)."""
    q, k, v = make_qkv(B=2, Hq=4, Hkv=1, Lq=1, Lk=70, D=16)
    pad = (torch.arange(70) < torch.tensor([[70], [33]])).view(2, 1, 1, 70).to(DEVICE)
    check(mode, q, k, v, attn_mask=pad, enable_gqa=True)
