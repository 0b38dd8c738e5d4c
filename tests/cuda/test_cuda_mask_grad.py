"""A learned additive ``attn_mask`` on the CUDA C++ backend (``csrc/mask_grad.h``): its gradient,
of the mask's own shape, reduced inside the kernel over the batch / head dims it broadcasts over.
On the CPU emulator (or the extension on a GPU): every broadcast shape against the float64
reference with FlashAttention's error rule in float16 / bfloat16, softmax / SSA / SSA+adaptive /
the logit scale, causal, GQA, dropout, a window with the soft cap, sinks, a key-padding bias;
the Triton backend's kernel; bitwise reproducibility; and that a mask without grad launches no
mask kernel."""
import pytest
import torch

import ssa_flash
from ssa_flash.backends import cuda_backend

from attn_testing import CUDA, DEVICE, FLOORS, fa_tolerance_check, learned_mask_inputs, needs_kernels
from emulation import build_emulator, cuda_backend_context

B, H, L, S, D = 2, 2, 19, 18, 16
SHAPES = [(L, S), (1, H, L, S), (B, 1, L, S), (H, L, S), (B, H, L, S)]
VARIANTS = [("softmax", False), ("ssa", False), ("ssa", True), ("logit_scale", True)]
slow = pytest.mark.slow
NAMES = ("out", "dq", "dk", "dv", "dmask")
# each broadcast shape with two variants (the second slow), each variant with two or three shapes
CASES = [pytest.param(*VARIANTS[(i + j) % len(VARIANTS)], shape, marks=(slow,) if j else ())
         for i, shape in enumerate(SHAPES) for j in range(2)]


@pytest.fixture(scope="module")
def on_cuda():
    return cuda_backend_context()


def _params(score, dtype=torch.float32):
    return {"softmax": None, "ssa": {"b": torch.tensor([1.0, 0.6], dtype=dtype, device=DEVICE), "n": 1.5},
            "logit_scale": {"s": torch.tensor([0.8, 1.3], dtype=dtype, device=DEVICE)}}[score]


def _inputs(shape, Hkv=H, Lq=L, Lk=S, seed=0):
    """float64 q, k, v, mask (attn_testing.learned_mask_inputs), dout."""
    return learned_mask_inputs(B, H, D, shape, Hkv=Hkv, Lq=Lq, Lk=Lk, seed=seed)


def _grads(backend, score, adaptive, inputs, dtype, seed=None, **kw):
    """out and the gradients of q, k, v and the mask through ``backend``, q, k, v in ``dtype`` (the
    mask float32 below float64, as a learned bias in mixed precision usually is)."""
    q, k, v, mask, dout = inputs
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    mask = mask.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    out = ssa_flash.attention(q, k, v, attn_mask=mask, score=score, score_params=_params(score, q.dtype),
                              adaptive_temperature=adaptive, backend=backend, **kw)
    return (out, *torch.autograd.grad((out.double() * dout).sum(), (q, k, v, mask)))


def _check(inputs, score, adaptive, dtype, on_cuda, seed=None, **kw):
    """FlashAttention's rule for out and every gradient (the mask's included) against the float64
    reference, naive = the reference in ``dtype``."""
    with on_cuda():
        ours = _grads("cuda", score, adaptive, inputs, dtype, seed, **kw)
    gold = _grads("reference", score, adaptive, inputs, torch.float64, seed, **kw)
    naive = _grads("reference", score, adaptive, inputs, dtype, seed, **kw)
    assert ours[4].shape == inputs[3].shape and ours[4].dtype == torch.float32
    for name, a, n, e in zip(NAMES, ours, naive, gold):
        fa_tolerance_check(name, a, n, e, FLOORS[dtype] * (4 if name != "out" else 1))
    return ours


@pytest.mark.parametrize("score,adaptive,shape", CASES)
def test_matches_reference(score, adaptive, shape, on_cuda):
    """Each broadcast shape of the mask, float16: its gradient (the logit gradient summed over
    the broadcast (batch, head) pairs inside the kernel) and every other gradient."""
    _check(_inputs(shape), score, adaptive, torch.float16, on_cuda)


@pytest.mark.parametrize("shape", [(B, 1, L, S), pytest.param((H, L, S), marks=slow)])
def test_bfloat16(shape, on_cuda):
    _check(_inputs(shape), "ssa", True, torch.bfloat16, on_cuda)


@pytest.mark.parametrize("score,adaptive,shape,kw", [
    pytest.param("ssa", True, (L, S), dict(is_causal=True), id="causal"),
    pytest.param("softmax", False, (H, L, S), dict(enable_gqa=True, Hkv=1), id="gqa"),
    pytest.param("ssa", False, (H, L, S), dict(dropout_p=0.3), id="dropout"),
    pytest.param("logit_scale", True, (B, 1, L, S), dict(window_size=(5, 3), softcap=5.0), id="window_softcap",
                 marks=slow),
    pytest.param("softmax", True, (1, H, L, S), dict(sinks=0.3, enable_gqa=True, Hkv=1), id="sinks_gqa",
                 marks=slow),
    pytest.param("ssa", False, (B, 1, 1, S), dict(is_causal=True), id="key_bias", marks=slow),  # over rows too
    # a negative scale: signed in the kernels' logit context (csrc/logits.h), no negated Q here
    pytest.param("ssa", True, (H, L, S), dict(scale=-0.3), id="negative_scale"),
    pytest.param("softmax", False, (B, 1, L, S), dict(scale=-0.3, softcap=4.0), id="negative_scale_softcap",
                 marks=slow),
])
def test_features(score, adaptive, shape, kw, on_cuda):
    """float16 against the float64 reference with causality, GQA, dropout (the forward's keep bits
    regenerated: same seed), a window with the soft cap, sinks, a mask broadcast over query rows
    (summed over them by the host) and a negative scale."""
    Hkv = kw.pop("Hkv", H)
    seed = 5 if "dropout_p" in kw else None
    _check(_inputs(shape, Hkv=Hkv, Lq=37, Lk=35), score, adaptive, torch.float16, on_cuda, seed, **kw)


@pytest.mark.parametrize("adaptive", [False, True])
def test_rows_masked_by_finite_values(adaptive, on_cuda):
    """A row at finfo(float32).min (and one at -1e30 over a span of keys): its LSE is recounted
    (csrc/lse_residual.h), and the mask kernel's weights take the residual through the workspace
    and the scaled dO as the dK/dV kernel's do: within the rule of the float64 reference (the
    naive float16 one is off by the size of the gradients there)."""
    inputs = _inputs((B, 1, L, S))
    inputs[3][0, :, 3] = torch.finfo(torch.float32).min
    inputs[3][1, :, 5, :7] = -1e30
    ours = _check(inputs, "ssa", adaptive, torch.float16, on_cuda)
    assert all(bool(torch.isfinite(t).all()) for t in ours)


@slow
@needs_kernels
def test_matches_triton(on_cuda):
    """The Triton backend's mask gradient (float64: its own kernel, ssa_flash/triton/mask_grad.py)
    as the gold value of the same rule: the two kernels compute the same sum."""
    inputs = _inputs((B, 1, L, S))
    with on_cuda():
        ours = _grads("cuda", "ssa", True, inputs, torch.float16)
    gold = _grads("triton", "ssa", True, inputs, torch.float64)
    naive = _grads("reference", "ssa", True, inputs, torch.float16)
    for name, a, n, e in zip(NAMES, ours, naive, gold):
        fa_tolerance_check(name, a, n, e, FLOORS[torch.float16] * (4 if name != "out" else 1))


@pytest.mark.parametrize("deterministic", [True, False])
def test_bitwise_reproducible(deterministic, on_cuda):
    """Two runs give the same bits for the mask's gradient (a fixed summation order, no atomics),
    on the two-kernel path (deterministic=True) and the fused one alike."""
    inputs = _inputs((L, S), Lq=37, Lk=35)
    with on_cuda():
        first = _grads("cuda", "ssa", True, inputs, torch.float16, deterministic=deterministic)
        second = _grads("cuda", "ssa", True, inputs, torch.float16, deterministic=deterministic)
    assert torch.equal(first[4], second[4]) and bool(first[4].abs().sum() > 0)
    if deterministic:
        for a, b in zip(first, second):
            assert torch.equal(a, b)


def test_only_learned_masks_launch_the_mask_kernel(monkeypatch, on_cuda):
    """A mask that does not require grad (or a call under no_grad) never reaches the mask kernel
    (no gradient buffer, no launch); one that does, does (so this test can fail)."""
    calls = []
    real = cuda_backend._mask_grad_buffer
    monkeypatch.setattr(cuda_backend, "_mask_grad_buffer", lambda *a: calls.append(1) or real(*a))
    emu = None if CUDA else build_emulator()
    kernel = "attn_bwd_mask_grad_kernel"
    before = None if emu is None else emu.launches(kernel)
    inputs = _inputs((L, S))
    with on_cuda():
        _grads("cuda", "softmax", False, inputs, torch.float16)
        assert calls == [1]
        q, k, v, mask, _ = (t.to(torch.float16) for t in inputs)
        q.requires_grad_()
        out = ssa_flash.softmax_attention(q, k, v, attn_mask=mask.float(), backend="cuda")  # mask without grad
        out.float().sum().backward()
        with torch.no_grad():
            ssa_flash.softmax_attention(q, k, v, attn_mask=mask.float().requires_grad_(), backend="cuda")
    assert calls == [1]
    if emu is not None:  # (the emulator's launch counter is the process's: every library's)
        assert emu.launches(kernel) - before > 0
        after = emu.launches(kernel)
        with on_cuda():
            out = ssa_flash.softmax_attention(q, k, v, attn_mask=mask.float(), backend="cuda")
            out.float().sum().backward()
        assert emu.launches(kernel) == after


def test_through_the_custom_ops(on_cuda):
    """Under a dispatch mode (the custom ops' path, as torch.compile takes it: attn_bwd(mask_grad))
    the learned mask's gradient is the eager path's, bit for bit, of the mask's own shape."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = _inputs((B, 1, L, S))
    with on_cuda():
        eager = _grads("cuda", "ssa", True, inputs, torch.float16, deterministic=True)
        with FlopCounterMode(display=False):
            ops = _grads("cuda", "ssa", True, inputs, torch.float16, deterministic=True)
    assert ops[4].shape == inputs[3].shape
    for a, b in zip(eager, ops):
        assert torch.equal(a, b)


def test_wrong_gradient_shape_is_a_value_error():
    """The backend's own check: a gradient shape that is not the mask's broadcast of (B, H, Lq, Lk)."""
    q = torch.zeros(B, H, L, D)
    k = torch.zeros(B, H, S, D)
    mask = torch.zeros(B, H, L, S)
    with pytest.raises(ValueError, match="learned mask's gradient of shape"):
        cuda_backend._mask_grad_buffer(mask, (3, 1, L, S), q, k)
    with pytest.raises(ValueError, match="learned mask's gradient of shape"):
        cuda_backend._mask_grad_buffer(mask.bool(), (1, 1, L, S), q, k)
    assert cuda_backend._mask_grad_buffer(mask, (1, H, 1, S), q, k).shape == (1, H, L, S)
