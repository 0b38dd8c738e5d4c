"""The reference (the spec) against independent formulations: SDPA for softmax, the paper's power
form for SSA, a literal translation of the adaptive-temperature paper's Fig. 4."""
import math

import pytest
import torch
import torch.nn.functional as F

from ssa_flash import reference, scores

D64 = torch.float64


def _qkv(B=2, H=2, Lq=9, Lk=11, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, dtype=D64) for L in (Lq, Lk, Lk))


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_reference_is_sdpa(causal):
    q, k, v = _qkv()
    mask = torch.randn(9, 11, dtype=D64)
    torch.testing.assert_close(reference.attention(q, k, v, mask, is_causal=causal),
                               F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal))


def test_ssa_reference_power_form():
    q, k, v = _qkv()
    b, n = torch.tensor([0.5, 2.0], dtype=D64), torch.tensor([1.5, 3.0], dtype=D64)
    z = q @ k.transpose(-1, -2) / math.sqrt(8)
    w = (1 + b.view(1, 2, 1, 1) * z.abs()) ** (torch.sign(z) * n.view(1, 2, 1, 1))
    torch.testing.assert_close(reference.attention(q, k, v, score="ssa", score_params=(b, n)),
                               (w / w.sum(-1, keepdim=True)) @ v)


def test_phi_derivative_is_continuous_at_zero():
    z = torch.zeros(3, dtype=D64, requires_grad=True)
    scores.ssa_logits(z, torch.tensor(0.7, dtype=D64), torch.tensor(2.0, dtype=D64)).sum().backward()
    torch.testing.assert_close(z.grad, torch.full((3,), 1.4, dtype=D64))


def test_phi_gradient_finite_where_the_other_branch_is_singular():
    """b|z| = 1 makes the unused branch log1p(-b z) singular; gradients must stay finite."""
    z = torch.tensor([1.0, -1.0, 0.5, 0.0], dtype=D64, requires_grad=True)
    b = torch.tensor(1.0, dtype=D64, requires_grad=True)
    scores.ssa_logits(z, b, torch.tensor(1.5, dtype=D64)).sum().backward()
    torch.testing.assert_close(z.grad, 1.5 / (1 + z.detach().abs()))
    assert torch.isfinite(b.grad)


def _paper_adaptive_softmax(logits, poly=(-0.037, 0.481, -2.3, 4.917, -1.791)):
    """Fig. 4 of "Softmax is not Enough", line by line, with the exact entropy (no 1e-9)."""
    original_probs = torch.softmax(logits, -1)
    entropy = torch.sum(-original_probs * torch.log(original_probs), -1, keepdim=True)
    poly_fit = sum(c * entropy ** (len(poly) - 1 - i) for i, c in enumerate(poly))
    beta = torch.where(entropy > 0.5, torch.maximum(poly_fit, torch.ones_like(poly_fit)), 1.0)
    return torch.softmax(logits * beta, -1)


def test_adaptive_reference_is_the_papers_function():
    q, k, v = _qkv(Lq=12, Lk=12)
    q = q * torch.linspace(0.1, 6, 12, dtype=D64).view(1, 1, 12, 1)  # both sides of the threshold
    q.requires_grad_()
    z = q @ k.transpose(-1, -2) / math.sqrt(8)
    expected = _paper_adaptive_softmax(z) @ v
    got = reference.attention(q, k, v, adaptive_temperature=True)
    torch.testing.assert_close(got, expected)
    g1 = torch.autograd.grad(got.sum(), q)[0]
    g2 = torch.autograd.grad(expected.sum(), q)[0]
    torch.testing.assert_close(g1, g2)


def test_entropy_reference():
    q, k, _ = _qkv()
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    torch.testing.assert_close(reference.attention_entropy(q, k), -(p * p.log()).sum(-1))


def test_empty_rows_are_zero_in_reference():
    q, k, v = _qkv()
    q.requires_grad_()
    mask = torch.ones(9, 11, dtype=torch.bool)
    mask[3] = False
    for variant in (dict(), dict(score="ssa", score_params=(1.0, 1.5)), dict(adaptive_temperature=True)):
        out, lse = reference.attention(q, k, v, mask, return_lse=True, **variant)
        assert (out[:, :, 3] == 0).all() and torch.isinf(lse[:, :, 3]).all()
        (g,) = torch.autograd.grad(out.sum(), q)
        assert torch.isfinite(g).all() and (g[:, :, 3] == 0).all()


def test_a_stray_keyword_is_refused_not_ignored():
    """The spec's functions take only the spec's keywords: a run option of the public functions
    (backend=) or an old score keyword (ssa= / b= / n=) raises, never quietly computes softmax."""
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="backend"):
        reference.attention(q, q, q, backend="triton")
    with pytest.raises(TypeError, match="'b'"):
        reference.attention(q, q, q, b=1.0, n=1.5)
    with pytest.raises(TypeError, match="ssa"):
        reference.attention(q, q, q, ssa=True)
    with pytest.raises(TypeError, match="'b'"):
        reference.attention_entropy(q, q, b=1.0, n=1.5)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(TypeError, match="ssa"):
        reference.varlen_attention(q[0].transpose(0, 1), q[0].transpose(0, 1), q[0].transpose(0, 1), cu, cu, ssa=True)
    with pytest.raises(TypeError, match="'b'"):
        reference.attention_with_kvcache(q, q, q, torch.tensor([5], dtype=torch.int32), b=1.0)
