"""Our kernels against implementations we did not write: PyTorch's SDPA (softmax) and
FlexAttention's forward with an SSA score_mod."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import ssa_flash
from attn_testing import DEVICE, FLOORS, KERNEL_DTYPES, head_params, make_qkv, needs_kernels

pytestmark = needs_kernels


def _grads(out, inputs, seed=7):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    return torch.autograd.grad(out, inputs, dout)


def _tol(dtype):
    return dict(atol=50 * FLOORS[dtype], rtol=50 * FLOORS[dtype]) if dtype != torch.float64 else dict(atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", ["plain", "causal", "causal_rect", "bool_mask", "float_mask", "key_padding", "gqa", "scale"])
def test_softmax_matches_sdpa(dtype, case):
    Lq, Lk, Hq, Hkv = 23, 23, 2, 2
    kw = {}
    if case == "causal_rect":
        Lq, Lk = 17, 29
    if case == "gqa":
        Hq, Hkv = 4, 2
        kw["enable_gqa"] = True
    q, k, v = make_qkv(B=2, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=16, dtype=dtype)
    g = torch.Generator().manual_seed(11)
    if case.startswith("causal"):
        kw["is_causal"] = True
    elif case == "bool_mask":
        m = torch.rand(Lq, Lk, generator=g) > 0.4
        m[:, 0] = True  # SDPA gives NaN on empty rows; ours gives 0 (tested elsewhere)
        kw["attn_mask"] = m.to(DEVICE)
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(2, 1, Lq, Lk, generator=g).to(DEVICE, dtype)
    elif case == "key_padding":
        kw["attn_mask"] = (torch.arange(Lk) < torch.tensor([[Lk], [Lk - 7]])).view(2, 1, 1, Lk).to(DEVICE)
    elif case == "scale":
        kw["scale"] = 0.3
    ours = ssa_flash.softmax_attention(q, k, v, backend="triton", **kw)
    theirs = F.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(ours, theirs, **_tol(dtype))
    for a, b in zip(_grads(ours, (q, k, v)), _grads(theirs, (q, k, v))):
        torch.testing.assert_close(a, b, **_tol(dtype))


def _flex_ssa(q, k, v, b, n, causal):
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, bi, h, qi, kj):
        phi = n[h] * torch.sign(score) * torch.log1p(b[h] * torch.abs(score))
        if causal:
            phi = torch.where(kj <= qi, phi, float("-inf"))
        return phi

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
        return flex_attention(q, k, v, score_mod=score_mod)


@pytest.mark.parametrize("causal", [False, True])
def test_ssa_forward_matches_flex_attention(causal):
    dtype = torch.float64 if DEVICE == "cpu" else torch.float32
    q, k, v = make_qkv(B=2, Hq=3, Lq=21, Lk=21, D=16, dtype=dtype, requires_grad=False)
    b, n = head_params(3, dtype=dtype)
    b, n = b.detach(), n.detach()
    ours = ssa_flash.ssa_attention(q, k, v, is_causal=causal, b=b, n=n, backend="triton")
    theirs = _flex_ssa(q, k, v, b, n, causal)
    torch.testing.assert_close(ours, theirs, **_tol(dtype))


def test_ssa_weights_are_the_papers_power_form():
    """With V = identity the output rows are the attention weights themselves:
    (1 + b|z|)^(sgn(z) n) / sum_j (...), formed directly in float64."""
    L, D = 12, 16
    q, k, _ = make_qkv(B=1, Hq=1, Lq=L, Lk=L, D=D, dtype=torch.float64, requires_grad=False)
    v = torch.eye(L, dtype=torch.float64, device=DEVICE).view(1, 1, L, L)
    b, n = 0.7, 2.5
    weights = ssa_flash.ssa_attention(q, k, v, b=b, n=n, backend="triton")
    z = (q @ k.transpose(-1, -2)) / D**0.5
    w = (1 + b * z.abs()) ** (torch.sign(z) * n)
    torch.testing.assert_close(weights, w / w.sum(-1, keepdim=True), atol=1e-12, rtol=1e-12)
