"""A learned additive ``attn_mask`` on the Triton backend (``ssa_flash/triton/mask_grad.py``): its
gradient, of the mask's own shape, reduced inside the kernel over the dims it broadcasts over.
float64 gradchecks per broadcast shape and variant, FlashAttention's error rule in 16 bits against
the float64 reference, bitwise reproducibility, causal / GQA / dropout / window / sinks / softcap
against the reference, SDPA's math path, and that a mask without grad launches nothing new."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ssa_flash
from ssa_flash import autograd
from ssa_flash.spec import AttentionSpec
from ssa_flash.triton import mask_grad as mask_grad_module

from attn_testing import DEVICE, FLOORS, LOW_PRECISION, fa_tolerance_check, learned_mask_inputs, needs_kernels

pytestmark = needs_kernels

B, H, L, S, D = 2, 2, 7, 6, 8
SHAPES = [(L, S), (1, H, L, S), (B, 1, L, S), (H, L, S), (B, H, L, S)]
VARIANTS = [("softmax", False), ("ssa", False), ("logit_scale", False), ("softmax", True), ("ssa", True)]
slow = pytest.mark.slow
# each broadcast shape with two variants, each variant with two shapes; the second of each shape
# slow (the interpreter: ~5-15 s a gradcheck on a shared 2-core machine)
CASES = [pytest.param(*VARIANTS[(i + j) % len(VARIANTS)], shape, marks=(slow,) if j else ())
         for i, shape in enumerate(SHAPES) for j in range(2)]


def _params(score, dtype=torch.float64):
    return {"softmax": None, "ssa": {"b": torch.tensor([1.0, 0.6], dtype=dtype, device=DEVICE), "n": 1.5},
            "logit_scale": {"s": torch.tensor([0.8, 1.3], dtype=dtype, device=DEVICE)}}[score]


def _inputs(shape, dtype=torch.float64, Hkv=H, Lq=L, Lk=S, seed=0):
    return learned_mask_inputs(B, H, D, shape, Hkv=Hkv, Lq=Lq, Lk=Lk, seed=seed, dtype=dtype)


def _grads(backend, score, adaptive, q, k, v, mask, dout, **kw):
    """Forward + backward through ``backend``: out and the gradients of q, k, v and the mask."""
    q, k, v, mask = (t.detach().requires_grad_() for t in (q, k, v, mask))
    out = ssa_flash.attention(q, k, v, attn_mask=mask, score=score, score_params=_params(score, q.dtype),
                              adaptive_temperature=adaptive, backend=backend, **kw)
    return (out, *torch.autograd.grad((out.double() * dout.double()).sum(), (q, k, v, mask)))


@pytest.mark.parametrize("score,adaptive,shape", CASES)
def test_gradcheck(score, adaptive, shape):
    """float64 gradcheck (fast mode: random projections) of out with respect to q and the mask."""
    q, k, v, mask, _ = _inputs(shape)

    def f(q_, m_):
        return ssa_flash.attention(q_, k, v, attn_mask=m_, score=score, score_params=_params(score),
                                   adaptive_temperature=adaptive, backend="triton")

    assert torch.autograd.gradcheck(f, (q.requires_grad_(), mask.requires_grad_()), eps=1e-6, atol=1e-7,
                                    rtol=1e-5, fast_mode=True)


@pytest.mark.slow
def test_gradcheck_full():
    """The full (element by element) float64 gradcheck of a (1, H, 2, 3) mask alone, adaptive SSA
    (two forwards per mask element through the interpreter: ~2 min on a loaded 2-core machine)."""
    q, k, v, mask, _ = _inputs((1, H, 2, 3), Lq=2, Lk=3)

    def f(m_):
        return ssa_flash.attention(q, k, v, attn_mask=m_, score="ssa", score_params=_params("ssa"),
                                   adaptive_temperature=True, backend="triton")

    assert torch.autograd.gradcheck(f, (mask.requires_grad_(),), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("score,adaptive,shape", [("ssa", True, (B, 1, L, S)),
                                                  pytest.param("softmax", False, (H, L, S), marks=slow)])
def test_low_precision_error_rule(dtype, score, adaptive, shape):
    """FlashAttention's rule (2x the naive same-precision error + a floor) for out and every
    gradient, the mask's included, against the float64 reference."""
    inputs = _inputs(shape, Lq=13, Lk=11)
    gold = _grads("reference", score, adaptive, *inputs)
    low = [t.to(dtype) for t in inputs]
    ours = _grads("triton", score, adaptive, *low)
    naive = _grads("reference", score, adaptive, *low)
    assert ours[4].shape == inputs[3].shape and ours[4].dtype == dtype
    for name, a, n, e in zip(("out", "dq", "dk", "dv", "dmask"), ours, naive, gold):
        # the mask's gradient sums over the broadcast (batch, head) pairs
        fa_tolerance_check(name, a, n, e, FLOORS[dtype] * (4 if name != "out" else 1))


@pytest.mark.parametrize("score,adaptive,shape,kw", [
    pytest.param("ssa", True, (L, S), dict(is_causal=True), id="causal"),
    pytest.param("softmax", False, (H, L, S), dict(enable_gqa=True, Hkv=1), id="gqa"),
    pytest.param("logit_scale", True, (B, 1, L, S), dict(window_size=(2, 1), softcap=5.0), id="window_softcap",
                 marks=slow),
    pytest.param("softmax", True, (1, H, L, S), dict(sinks=0.3, enable_gqa=True, Hkv=1), id="sinks_gqa",
                 marks=slow),
    pytest.param("ssa", False, (B, 1, 1, S), dict(is_causal=True), id="key_bias", marks=slow),  # over rows too
])
def test_features_match_reference(score, adaptive, shape, kw):
    """float64: out and every gradient equal the reference's with causality, GQA, a window, the
    soft cap, sinks and a mask broadcast over query rows."""
    Hkv = kw.pop("Hkv", H)
    inputs = _inputs(shape, Hkv=Hkv, Lq=19, Lk=18)
    ours = _grads("triton", score, adaptive, *inputs, **kw)
    ref = _grads("reference", score, adaptive, *inputs, **kw)
    assert ours[4].shape == inputs[3].shape
    for name, a, e in zip(("out", "dq", "dk", "dv", "dmask"), ours, ref):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)


@slow
def test_dropout_matches_reference():
    """Dropout: the mask kernel regenerates the forward's keep mask (same seed, same bits)."""
    inputs = _inputs((H, L, S), Lq=19, Lk=18)
    torch.manual_seed(5)
    ours = _grads("triton", "ssa", False, *inputs, dropout_p=0.3)
    torch.manual_seed(5)
    ref = _grads("reference", "ssa", False, *inputs, dropout_p=0.3)
    for name, a, e in zip(("out", "dq", "dk", "dv", "dmask"), ours, ref):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=name)


def test_deterministic_bitwise():
    """deterministic=True: two runs give the same bits (a fixed summation order, no atomics)."""
    inputs = _inputs((L, S), dtype=torch.float32, Lq=37, Lk=35)
    first = _grads("triton", "ssa", True, *inputs, deterministic=True)
    second = _grads("triton", "ssa", True, *inputs, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", [(B, 1, L, S), pytest.param((L, S), marks=slow), pytest.param((1, H, L, S), marks=slow)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_sdpa_math(shape):
    """softmax with a learned bias: out and every gradient equal SDPA's math path in float32."""
    q, k, v, mask, dout = _inputs(shape, dtype=torch.float32)
    ours = _grads("triton", "softmax", False, q, k, v, mask, dout)
    q, k, v, mask = (t.detach().requires_grad_() for t in (q, k, v, mask))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = (ref, *torch.autograd.grad((ref.double() * dout.double()).sum(), (q, k, v, mask)))
    for name, a, e in zip(("out", "dq", "dk", "dv", "dmask"), ours, theirs):
        torch.testing.assert_close(a, e, msg=name)


def test_only_learned_masks_launch_the_mask_kernel(monkeypatch):
    """A mask that does not require grad (or a call under no_grad) never reaches the mask kernel;
    one that does, does (so this test can fail)."""
    calls = []
    real = mask_grad_module.mask_grad
    monkeypatch.setattr(mask_grad_module, "mask_grad", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, mask, dout = _inputs((L, S), dtype=torch.float32)
    _grads("triton", "softmax", False, q, k, v, mask, dout)
    assert calls == [1]
    q.requires_grad_()
    out = ssa_flash.softmax_attention(q, k, v, attn_mask=mask, backend="triton")  # mask without grad
    out.sum().backward()
    with torch.no_grad():
        ssa_flash.softmax_attention(q, k, v, attn_mask=mask.requires_grad_(), backend="triton")
    assert calls == [1]


def test_refusals():
    """A backend without a mask-gradient kernel refuses a learned mask with a ValueError naming
    it, rather than a silent zero gradient (the eager learned-mask path's own check)."""
    q, k, v, mask, _ = _inputs((L, S), dtype=torch.float32)
    mask.requires_grad_()
    assert "reference" in autograd.LEARNED_MASK_BACKENDS  # (its explicit backward computes it)
    with pytest.raises(ValueError, match="attn_mask requires grad: the 'nope' backend"):
        autograd.attention_learned_mask(q, k, v, (), mask, "nope", AttentionSpec(scale=D ** -0.5))


@pytest.mark.parametrize("shape", [(L, S), (B, 1, L, S)])
def test_through_the_custom_ops(shape):
    """Under a dispatch mode (the custom ops' path, as torch.compile takes it) the learned mask's
    gradient is the eager path's, bit for bit, of the mask's own shape."""
    from torch.utils.flop_counter import FlopCounterMode

    q, k, v, mask, dout = _inputs(shape, dtype=torch.float32)
    eager = _grads("triton", "ssa", True, q, k, v, mask, dout)
    with FlopCounterMode(display=False):
        ops = _grads("triton", "ssa", True, q, k, v, mask, dout)
    assert ops[-1].shape == mask.shape
    for a, b in zip(eager, ops):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@slow
def test_under_torch_compile():
    """torch.compile (fullgraph, the custom ops): out and the (L, S) mask's gradient as the eager
    path's."""
    q, k, v, mask, dout = _inputs((L, S), dtype=torch.float32)
    params = {"b": torch.tensor([1.0, 0.6], device=DEVICE), "n": 1.5}

    def f(q_, m_):
        return ssa_flash.attention(q_, k, v, attn_mask=m_, score="ssa", score_params=params, backend="triton")

    got = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        q_, m_ = q.detach().requires_grad_(), mask.detach().requires_grad_()
        out = fn(q_, m_)
        got.append((out, *torch.autograd.grad((out * dout).sum(), (q_, m_))))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
