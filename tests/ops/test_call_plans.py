"""Call plans (ssa_flash/ops.py): a call with the same argument types and values and the same tensor
metadata as an earlier one skips the checks it passed, but never a check that reads values, and
never runs with anything kept from the earlier call's tensors."""
import pytest
import torch

import ssa_flash
from ssa_flash import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton"


@pytest.fixture(autouse=True)
def fresh_plans():
    ops._call_plans.clear()
    yield
    ops._call_plans.clear()


def _qkv(seed, dtype=torch.float32, L=24, D=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, L, D, generator=g, dtype=dtype).to(DEVICE) for _ in range(3)]


def test_a_repeated_call_is_planned_and_computes_with_its_own_inputs():
    for seed in range(3):
        q, k, v = _qkv(seed)
        b = torch.tensor([0.5 + seed, 1.0], device=DEVICE)
        kw = dict(score="ssa", score_params={"b": b, "n": 1.5}, is_causal=True)
        out = ssa_flash.attention(q, k, v, backend=BACKEND, **kw)
        torch.testing.assert_close(out, ssa_flash.attention(q, k, v, backend="reference", **kw), atol=2e-5, rtol=2e-5)
    assert len(ops._call_plans) == 1


@pytest.mark.parametrize("bad, error", [
    (dict(is_causal=1), TypeError),  # 1 == True, but a flag given an int is refused
    (dict(scale=float("nan")), ValueError),
    (dict(dropout_p=1.5), ValueError),
    (dict(window_size=(-2, 0)), ValueError),
    (dict(score_params={"b": -1.0, "n": 1.5}), ValueError),
])
def test_a_planned_call_still_refuses_bad_arguments(bad, error):
    q, k, v = _qkv(0)
    good = dict(score="ssa", score_params={"b": 1.0, "n": 1.5}, is_causal=True, scale=0.25, dropout_p=0.0,
                window_size=(-1, -1))
    ssa_flash.attention(q, k, v, backend=BACKEND, **good)
    ssa_flash.attention(q, k, v, backend=BACKEND, **good)  # planned
    with pytest.raises(error):
        ssa_flash.attention(q, k, v, backend=BACKEND, **dict(good, **bad))


@pytest.mark.skipif(DEVICE != "cpu", reason="a CUDA tensor's values are not read (no device sync)")
def test_a_planned_call_still_checks_a_parameter_tensors_values():
    q, k, v = _qkv(0)
    ok = torch.tensor([1.0, 2.0])
    ssa_flash.attention(q, k, v, score="ssa", score_params={"b": ok, "n": 1.5}, backend=BACKEND)
    ssa_flash.attention(q, k, v, score="ssa", score_params={"b": ok, "n": 1.5}, backend=BACKEND)
    with pytest.raises(ValueError, match="b must be finite and > 0"):
        ssa_flash.attention(q, k, v, score="ssa", score_params={"b": torch.tensor([1.0, -2.0]), "n": 1.5},
                            backend=BACKEND)


def test_a_mask_requiring_grad_gets_its_gradient_after_a_planned_call():
    """A planned call's replay must not bypass the learned-mask path: the same shapes with a mask
    that requires grad get the mask's gradient (the reference backend's, to rounding)."""
    q, k, v = _qkv(0)
    mask = torch.randn(24, 24, device=DEVICE)
    ssa_flash.attention(q, k, v, attn_mask=mask, backend=BACKEND)
    ssa_flash.attention(q, k, v, attn_mask=mask, backend=BACKEND)
    grads = []
    for backend in (BACKEND, "reference"):
        learned = mask.clone().requires_grad_()
        ssa_flash.attention(q, k, v, attn_mask=learned, backend=backend).square().sum().backward()
        grads.append(learned.grad)
    assert grads[0] is not None and grads[0].shape == mask.shape
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


def test_planned_dropout_draws_fresh_bits_every_call():
    q, k, v = _qkv(0)
    outs = []
    for seed in (1, 2, 2):
        torch.manual_seed(seed)
        outs.append(ssa_flash.attention(q, k, v, dropout_p=0.4, backend=BACKEND))
    assert len(ops._call_plans) == 1
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])
    torch.manual_seed(2)
    torch.testing.assert_close(outs[2], ssa_flash.attention(q, k, v, dropout_p=0.4, backend="reference"),
                               atol=2e-5, rtol=2e-5)


def test_gradients_flow_through_a_planned_call():
    for seed in range(2):
        q, k, v = (t.requires_grad_() for t in _qkv(seed))
        n = torch.tensor(1.5, device=DEVICE, requires_grad=True)
        out = ssa_flash.attention(q, k, v, score="ssa", score_params={"b": 1.0, "n": n}, backend=BACKEND)
        grads = torch.autograd.grad(out.sum(), (q, k, v, n))
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        n2 = n.detach().requires_grad_()
        ref = ssa_flash.attention(q2, k2, v2, score="ssa", score_params={"b": 1.0, "n": n2}, backend="reference")
        for a, b in zip(grads, torch.autograd.grad(ref.sum(), (q2, k2, v2, n2))):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(ops._call_plans) == 1


def test_unhashable_or_unplanned_arguments_take_the_checked_path():
    q, k, v = _qkv(0)
    out = ssa_flash.attention(q, k, v, window_size=[3, 0], backend=BACKEND)  # a list: hashed as a tuple
    ref = ssa_flash.attention(q, k, v, window_size=(3, 0), backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    ssa_flash.attention(q, k, v, backend="reference")  # the reference: never planned
    assert len(ops._call_plans) == 1
    ssa_flash.attention(q[0], k[0], v[0], backend=BACKEND)  # 3-D: planned as its (1, H, L, D) view
    assert len(ops._call_plans) == 2


def test_a_call_without_gradients_skips_the_autograd_function(monkeypatch):
    """No input requires grad (or grad mode is off): the forward runs without the autograd.Function
    (its host cost buys nothing there); inside forward-mode AD it stays, to refuse tangents."""
    from ssa_flash import autograd

    applied = []
    real = autograd._EagerAttention.apply
    monkeypatch.setattr(autograd._EagerAttention, "apply", lambda *a: applied.append(1) or real(*a))
    q, k, v = _qkv(0)
    out = ssa_flash.attention(q, k, v, backend=BACKEND)
    assert not applied and not out.requires_grad
    q.requires_grad_()
    with torch.no_grad():
        ssa_flash.attention(q, k, v, backend=BACKEND)
    assert not applied
    out = ssa_flash.attention(q, k, v, backend=BACKEND)
    assert applied and out.requires_grad
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(q.detach(), torch.ones_like(q))
        with pytest.raises(RuntimeError):
            fwAD.unpack_dual(ssa_flash.attention(dual, k, v, backend=BACKEND)).tangent.sum()
