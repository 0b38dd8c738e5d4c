"""The score-function registry (ssa_flash/scores.py): each entry's derivatives are autograd's of
its ``phi``, the registry's invariants, and the public ``attention(score=, score_params=)`` on the
reference path (the kernels are held to it by the shared feature matrix, tests/features.py)."""
import pytest
import torch

import ssa_flash
from ssa_flash import reference, scores

F64 = torch.float64


@pytest.mark.parametrize("name", list(scores.SCORES))
def test_derivatives_are_autograds(name):
    """``derivatives(z, *params)`` equals autograd's vector-Jacobian products of ``phi``, at
    scores of both signs, zero included (SSA's continuous limit ``n b`` at ``z = 0``)."""
    f = scores.get(name)
    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(2, 3, 4, 5, generator=g, dtype=F64))
    z[0, :, 0, 0] = 0.0
    z = z.requires_grad_()
    params = [(e * (0.5 + torch.rand(3, generator=g, dtype=F64))).view(3, 1, 1).requires_grad_()
              for e in f.example]
    dl = torch.randn(z.shape, generator=g, dtype=F64)
    grads = torch.autograd.grad(f.phi(z, *params), (z, *params), grad_outputs=dl, allow_unused=True)
    dz, dparams = f.derivatives(z.detach(), *(p.detach() for p in params))
    torch.testing.assert_close(dl * dz, grads[0], rtol=1e-12, atol=1e-12)
    assert len(dparams) == len(f.params)
    for name_, d, expected in zip(f.params, dparams, grads[1:]):
        torch.testing.assert_close((dl * d).sum(dim=(0, 2, 3)).view(-1, 1, 1), expected, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"d{name_}: {m}")


def test_registry_invariants():
    ids = [f.id for f in scores.SCORES.values()]
    assert len(set(ids)) == len(ids) and scores.SOFTMAX.id == 0
    for f in scores.SCORES.values():
        assert len(f.params) == len(f.rules) == len(f.example), f.name
        assert all(r in ("> 0", ">= 0") for r in f.rules), f.name
        assert scores.get(f.name) is f and scores.get(f.id) is f
    names = [v.name for v in scores.variants()]
    assert names[:4] == ["softmax", "adaptive", "ssa", "ssa_adaptive"] and len(names) == 2 * len(scores.SCORES)
    with pytest.raises(ValueError, match="unknown score function"):
        scores.get("relu")


def _qkv(H=2, L=6, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, H, L, D, generator=g, dtype=F64).requires_grad_() for _ in range(3)]


def test_logit_scale_is_softmax_with_a_per_head_scale():
    """``phi(z) = s_h z``: the softmax of the scores scaled by ``s_h`` per head, forward and
    gradients; ``s = 0`` gives uniform weights over the admissible keys and a finite gradient."""
    q, k, v = _qkv()
    s = torch.tensor([0.6, 1.7], dtype=F64, requires_grad=True)
    out = ssa_flash.attention(q, k, v, is_causal=True, score="logit_scale", score_params={"s": s},
                              backend="reference")
    scaled = q * s.view(1, 2, 1, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(scaled, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    g1 = torch.autograd.grad(out.square().sum(), (q, k, v, s))
    g2 = torch.autograd.grad(expected.square().sum(), (q, k, v, s))
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)

    zero = torch.zeros(2, dtype=F64, requires_grad=True)
    out0 = ssa_flash.attention(q, k, v, is_causal=True, score="logit_scale", score_params=(zero,),
                               backend="reference")
    uniform = torch.cumsum(v, 2) / torch.arange(1, 7, dtype=F64).view(1, 1, 6, 1)
    torch.testing.assert_close(out0, uniform.detach(), rtol=1e-12, atol=1e-12)
    (ds,) = torch.autograd.grad(out0.sum(), zero)
    assert torch.isfinite(ds).all() and (ds != 0).any()


def test_ssa_through_attention_equals_ssa_attention():
    q, k, v = _qkv()
    a = ssa_flash.attention(q, k, v, score="ssa", score_params={"b": 0.7, "n": 2.0}, backend="reference")
    b = ssa_flash.ssa_attention(q, k, v, b=0.7, n=2.0, backend="reference")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    c = reference.attention(q, k, v, score="ssa", score_params=(0.7, 2.0))
    torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize("score, params, error, match", [
    ("relu", None, ValueError, "unknown score function"),
    (3, None, TypeError, "score must be a str"),
    ("logit_scale", None, ValueError, "takes 1 parameter"),
    ("logit_scale", {"b": 1.0}, ValueError, "missing .'s',.*unknown .'b',"),
    ("logit_scale", {"s": -1.0}, ValueError, "s must be >= 0"),
    ("logit_scale", {"s": torch.tensor([1.0, float("nan")])}, ValueError, "s must be finite"),
    ("ssa", (1.0,), ValueError, "takes 2 parameter"),
    ("ssa", {"b": 0.0, "n": 1.0}, ValueError, "b must be > 0"),
    ("softmax", 1.0, TypeError, "score_params must be"),
])
def test_attention_validates_the_score(score, params, error, match):
    q, k, v = (t.detach().float() for t in _qkv())
    with pytest.raises(error, match=match):
        ssa_flash.attention(q, k, v, score=score, score_params=params, backend="reference")
