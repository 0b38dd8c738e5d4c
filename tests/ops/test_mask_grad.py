"""A float ``attn_mask`` that requires grad (a learned additive bias: T5's relative bias, ALiBi
variants, Swin): its gradient is the logit gradient ``dl`` summed over the dims it broadcasts
over, of the mask's own shape. The reference backend gives it (autograd through the
specification), Triton too (its own kernel, tests/triton/test_triton_mask_grad.py); the CUDA
kernels refuse such a mask with a ``ValueError`` naming the backend (docs/support.md) rather than
leaving it a silent zero."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ssa_flash

B, H, L, S, D = 2, 2, 5, 4, 8
SHAPES = [(L, S), (1, H, L, S), (B, 1, L, S), (H, L, S), (B, H, L, S)]
VARIANTS = [("softmax", False), ("ssa", False), ("logit_scale", False), ("softmax", True), ("ssa", True)]


def _qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v))


def _params(score):
    return {"softmax": None, "ssa": {"b": torch.tensor([1.0, 0.6], dtype=torch.float64), "n": 1.5},
            "logit_scale": {"s": torch.tensor([0.8, 1.3], dtype=torch.float64)}}[score]


# each broadcast shape with two of the variants, each variant with two shapes (the reduction over
# broadcast dims is autograd's, shared by the variants)
CASES = [(*VARIANTS[(i + j) % len(VARIANTS)], shape) for i, shape in enumerate(SHAPES) for j in range(2)]


@pytest.mark.parametrize("score,adaptive,shape", CASES)
def test_gradcheck_reference(score, adaptive, shape):
    """float64 gradcheck of out with respect to q and the mask, for each broadcast shape."""
    q, k, v = _qkv()
    mask = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).requires_grad_()

    def f(q_, m_):
        return ssa_flash.attention(q_, k.detach(), v.detach(), attn_mask=m_, score=score, score_params=_params(score),
                                   adaptive_temperature=adaptive, backend="reference")

    assert torch.autograd.gradcheck(f, (q, mask), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("shape", [(L, S), (1, H, L, S), (B, 1, L, S)], ids=lambda s: "x".join(map(str, s)))
def test_matches_sdpa_math(shape):
    """softmax with a learned bias: out and every gradient (mask included, of its own shape) equal
    SDPA's math path with the same bias, in float32."""
    q, k, v = _qkv(torch.float32)
    mask = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
    dout = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(2))
    out = ssa_flash.softmax_attention(q, k, v, attn_mask=mask, backend="reference")
    ours = torch.autograd.grad((out * dout).sum(), (q, k, v, mask))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = torch.autograd.grad((ref * dout).sum(), (q, k, v, mask))
    torch.testing.assert_close(out, ref)
    assert ours[3].shape == mask.shape
    for name, a, e in zip(("q", "k", "v", "mask"), ours, theirs):
        torch.testing.assert_close(a, e, msg=name)


def test_every_backend_takes_a_mask_that_requires_grad():
    """Triton, the CUDA C++ backend and the reference compute the mask's gradient
    (tests/triton/test_triton_mask_grad.py, tests/cuda/test_cuda_mask_grad.py): the rule once the
    backend is chosen (``ops._check_mask_grad``) takes it on each, and refuses it by name on a
    backend outside ``autograd.LEARNED_MASK_BACKENDS``."""
    mask = torch.zeros(L, S, requires_grad=True)
    for backend in ("triton", "cuda", "reference"):
        ssa_flash.ops._check_mask_grad(mask, backend)
    with pytest.raises(ValueError, match="attn_mask requires grad: the 'other' backend"):
        ssa_flash.ops._check_mask_grad(mask, "other")


def test_no_grad_mask_that_requires_grad_runs_anywhere():
    """Under no_grad (inference with a learned bias) nothing needs the mask's gradient."""
    q, k, v = _qkv(torch.float32)
    mask = torch.randn(L, S, requires_grad=True)
    with torch.no_grad():
        out = ssa_flash.softmax_attention(q, k, v, attn_mask=mask, backend="reference")
    assert out.shape == (B, H, L, D)
