"""The streamed entropy pass and the adaptive temperature (docs/design.md §1.3)."""
import pytest
import torch

import ssa_flash
from ssa_flash import reference
from ssa_flash.temperature import DEFAULT_POLY, polyval
from attn_testing import DEVICE, KERNEL_DTYPES, head_params, make_qkv, needs_kernels

pytestmark = needs_kernels


def _spread_queries(q, top=1.2):
    """Scale query rows from near-uniform attention (high entropy) to peaked (low entropy)."""
    L = q.shape[-2]
    return (q * torch.logspace(-1.5, top, L, device=q.device, dtype=q.dtype).view(1, 1, L, 1)).detach()


@pytest.mark.parametrize("ssa", [False, True])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "float_mask", "gqa"])
def test_streamed_entropy_equals_materialised(ssa, dtype, case):
    Hq, Hkv = (4, 2) if case == "gqa" else (2, 2)
    q, k, _ = make_qkv(B=2, Hq=Hq, Hkv=Hkv, Lq=27, Lk=35, D=16, dtype=dtype, requires_grad=False)
    q = _spread_queries(q)
    kw = {"enable_gqa": case == "gqa", "is_causal": case == "causal"}
    g = torch.Generator().manual_seed(2)
    if case == "bool_mask":
        m = torch.rand(27, 35, generator=g) > 0.5
        m[4] = False
        kw["attn_mask"] = m.to(DEVICE)
    elif case == "float_mask":
        kw["attn_mask"] = (torch.randn(2, 1, 27, 35, generator=g) * 2).to(DEVICE)
    bn = {}
    if ssa:
        b, n = head_params(Hq)
        bn = dict(b=b.detach(), n=n.detach())
    ours = ssa_flash.attention_entropy(q, k, backend="triton", **kw,
                                       **(dict(score="ssa", score_params=bn) if bn else {}))
    gold_bn = {key: val.double() for key, val in bn.items()}
    gold = reference.attention_entropy(q.double(), k.double(), **{
        key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
        for key, val in kw.items()}, **(dict(score="ssa", score_params=gold_bn) if bn else {}))
    assert ours.shape == q.shape[:-1] and not ours.requires_grad
    atol = 1e-10 if dtype == torch.float64 else 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), gold, atol=atol, rtol=0)
    if case == "bool_mask":
        assert (ours[:, :, 4] == 0).all()


def test_entropy_of_large_logits():
    """Logits of order 1e3: the centred running sums avoid cancelling m against K / Lam."""
    q, k, _ = make_qkv(Lq=20, Lk=40, D=16, dtype=torch.float32, requires_grad=False)
    q = q * torch.linspace(0.01, 300, 20, device=DEVICE).view(1, 1, 20, 1)
    ours = ssa_flash.attention_entropy(q, k, backend="triton")
    gold = reference.attention_entropy(q.double(), k.double())
    torch.testing.assert_close(ours.double(), gold, atol=5e-4, rtol=0)
    assert (ours >= -1e-4).all()


def test_entropy_argument_checks():
    q, k, _ = make_qkv(requires_grad=False)
    with pytest.raises(TypeError, match="'b'"):  # the score function's parameters: score_params
        ssa_flash.attention_entropy(q, k, b=1.0)
    with pytest.raises(ValueError, match="missing"):
        ssa_flash.attention_entropy(q, k, score="ssa", score_params={"b": 1.0})
    with pytest.raises(ValueError, match="key"):
        ssa_flash.attention_entropy(q, k[..., :3])


@pytest.mark.parametrize("ssa", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_covers_both_sides_of_threshold(ssa, causal):
    """Rows below the threshold, rows above it where poly(H) < 1 (beta = 1), rows with beta > 1:
    forward and every gradient against the reference."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=48, Lk=48, D=16, dtype=torch.float64)
    q = _spread_queries(q).requires_grad_()
    kw = dict(is_causal=causal)
    if ssa:  # SSA weights ~ |z|^n for large |z|: peaked rows need a large n, not only large logits
        b = torch.tensor([0.7, 1.3], dtype=torch.float64, device=DEVICE, requires_grad=True)
        n = torch.tensor([6.0, 9.0], dtype=torch.float64, device=DEVICE, requires_grad=True)
        kw.update(b=b, n=n)
    score = dict(score="ssa", score_params=(kw["b"], kw["n"])) if ssa else {}
    ent = reference.attention_entropy(q, k, is_causal=causal, **score).detach()
    p = polyval(DEFAULT_POLY, ent)
    assert (ent < 0.5).any() and ((ent > 0.5) & (p < 1)).any() and ((ent > 0.5) & (p > 1)).any()

    fn = ssa_flash.ssa_attention if ssa else ssa_flash.adaptive_temperature_attention
    extra = dict(adaptive_temperature=True) if ssa else {}
    ours = fn(q, k, v, backend="triton", **extra, **kw)
    ref = reference.attention(q, k, v, is_causal=causal, adaptive_temperature=True, **score)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)
    inputs = [q, k, v] + ([kw["b"], kw["n"]] if ssa else [])
    dout = torch.randn_like(ours)
    for a, r in zip(torch.autograd.grad(ours, inputs, dout), torch.autograd.grad(ref, inputs, dout)):
        torch.testing.assert_close(a, r, atol=1e-9, rtol=1e-9)


def test_temperature_changes_the_output():
    """The temperature is not a no-op: adaptive output differs from softmax where beta > 1."""
    q, k, v = make_qkv(Lq=30, Lk=30, D=16, requires_grad=False)
    q = _spread_queries(q)
    a = ssa_flash.adaptive_temperature_attention(q, k, v, backend="triton")
    s = ssa_flash.softmax_attention(q, k, v, backend="triton")
    assert (a - s).abs().max() > 1e-2


@pytest.mark.parametrize("poly,threshold", [((0.5, 1.2), 0.2), ((2.0,), 0.0), ((0.1, -0.2, 0.3, 1.5), 1.0)])
def test_custom_polynomial_and_threshold(poly, threshold):
    q, k, v = make_qkv(Lq=25, Lk=25, D=16, dtype=torch.float64)
    q = _spread_queries(q).requires_grad_()
    ours = ssa_flash.adaptive_temperature_attention(q, k, v, poly=poly, threshold=threshold, backend="triton")
    ref = reference.attention(q, k, v, poly=poly, threshold=threshold, adaptive_temperature=True)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)
    g1, = torch.autograd.grad(ours.sum(), q)
    g2, = torch.autograd.grad(ref.sum(), q)
    torch.testing.assert_close(g1, g2, atol=1e-9, rtol=1e-9)
