"""ssa_flash.nn.SSAttention: the module against the reference, its parametrisation and state dict."""
import math

import pytest
import torch

import ssa_flash
from ssa_flash import reference
from ssa_flash.nn import SSAttention

from attn_testing import DEVICE, make_qkv, needs_kernels

# float64 where the backend can (the interpreter), float32 on a GPU
DTYPE = torch.float32 if DEVICE == "cuda" else torch.float64
TOL = dict(atol=1e-4, rtol=1e-4) if DTYPE == torch.float32 else dict(atol=1e-10, rtol=1e-9)


def _grads(out, dout, tensors):
    return torch.autograd.grad(out, tensors, dout)


@needs_kernels
@pytest.mark.parametrize("case", ["causal", "bool_mask_gqa", "float_mask", "window_dropout"])
def test_module_matches_reference(case):
    Hq, Hkv = (4, 2) if case == "bool_mask_gqa" else (2, 2)
    q, k, v = make_qkv(B=1, Hq=Hq, Hkv=Hkv, Lq=13, Lk=21, D=8, dtype=DTYPE)
    attn = SSAttention(Hq, b_init=[0.6, 1.3, 0.9, 2.0][:Hq], n_init=[1.2, 2.5, 1.7, 3.0][:Hq],
                       backend="triton", device=DEVICE, dtype=DTYPE)
    g = torch.Generator().manual_seed(3)
    kw = {}
    if case == "causal":
        kw["is_causal"] = True
    elif case == "bool_mask_gqa":
        kw["attn_mask"] = (torch.rand(13, 21, generator=g) > 0.3).to(DEVICE)
        kw["enable_gqa"] = True
    elif case == "float_mask":
        kw["attn_mask"] = torch.randn(1, Hq, 13, 1, generator=g, dtype=DTYPE).to(DEVICE)
        kw["scale"] = 0.4
    else:  # keyword-only extras: local attention and attention dropout
        kw.update(window_size=(3, 5), dropout_p=0.3)
    ref_kw = dict(kw)
    if "dropout_p" in kw:
        torch.manual_seed(0)
        ref_kw["dropout_mask"] = ssa_flash.dropout_mask((1, Hq, 13, 21), 0.3, device=DEVICE)
        torch.manual_seed(0)
    out = attn(q, k, v, **kw)
    ref = reference.attention(q, k, v, score="ssa", score_params=(attn.b, attn.n), **ref_kw)
    torch.testing.assert_close(out, ref, **TOL)

    dout = torch.randn(out.shape, generator=g, dtype=DTYPE).to(DEVICE)
    params = [q, k, v, attn.b_raw, attn.n_raw]
    ours = _grads(out, dout, params)
    theirs = _grads(ref, dout, params)
    for name, a, e in zip(["q", "k", "v", "b_raw", "n_raw"], ours, theirs):
        assert a.abs().sum() > 0, f"d{name} is zero"
        torch.testing.assert_close(a, e, **TOL, msg=lambda m: f"d{name}: {m}")


def test_parametrisation_round_trips_init_values():
    attn = SSAttention(3, b_init=[0.01, 1.0, 40.0], n_init=[1.001, 1.5, 30.0], dtype=torch.float64)
    torch.testing.assert_close(attn.b, torch.tensor([0.01, 1.0, 40.0], dtype=torch.float64))
    torch.testing.assert_close(attn.n, torch.tensor([1.001, 1.5, 30.0], dtype=torch.float64))
    default = SSAttention(2)
    assert default.b_raw.dtype == torch.float32
    torch.testing.assert_close(default.b, torch.ones(2))
    torch.testing.assert_close(default.n, torch.full((2,), 1.5))


def test_constraints_hold_for_any_raw_value():
    attn = SSAttention(4, dtype=torch.float64)
    with torch.no_grad():
        attn.b_raw.copy_(torch.tensor([-700.0, -30.0, 0.0, 1e6], dtype=torch.float64))
        attn.n_raw.copy_(torch.tensor([-700.0, -30.0, 0.0, 1e6], dtype=torch.float64))
    assert (attn.b > 0).all() and torch.isfinite(attn.b).all()
    assert (attn.n >= 1).all() and torch.isfinite(attn.n).all()
    # a large optimiser step cannot leave the feasible set
    attn = SSAttention(2)
    opt = torch.optim.SGD(attn.parameters(), lr=1e3)
    (attn.b.sum() + attn.n.sum()).backward()
    opt.step()
    assert (attn.b > 0).all() and (attn.n >= 1).all()


def test_learnable_flag_and_state_dict_round_trip():
    attn = SSAttention(2, b_init=[0.5, 2.0], n_init=[1.25, 4.0])
    assert {name for name, _ in attn.named_parameters()} == {"b_raw", "n_raw"}
    fresh = SSAttention(2)
    fresh.load_state_dict(attn.state_dict())
    torch.testing.assert_close(fresh.b, attn.b)
    torch.testing.assert_close(fresh.n, attn.n)

    frozen = SSAttention(2, b_init=0.8, n_init=2.0, learnable=False)
    assert list(frozen.parameters()) == []
    assert set(frozen.state_dict()) == {"b_raw", "n_raw"}
    assert not frozen.b.requires_grad
    other = SSAttention(2, learnable=False)
    other.load_state_dict(frozen.state_dict())
    torch.testing.assert_close(other.b, torch.full((2,), 0.8))


@needs_kernels
def test_frozen_module_forward_matches_reference():
    q, k, v = make_qkv(B=1, Hq=2, Lq=9, D=8, dtype=DTYPE, requires_grad=False)
    attn = SSAttention(2, b_init=0.5, n_init=2.0, learnable=False, backend="triton", device=DEVICE,
                       dtype=DTYPE)
    out = attn(q, k, v, is_causal=True)
    torch.testing.assert_close(out, reference.attention(q, k, v, is_causal=True, score="ssa", score_params=(0.5, 2.0)),
                               **TOL)


def test_reset_parameters():
    attn = SSAttention(2)
    attn.reset_parameters(b_init=[0.3, 0.4], n_init=3.0)
    torch.testing.assert_close(attn.b, torch.tensor([0.3, 0.4]))
    torch.testing.assert_close(attn.n, torch.tensor([3.0, 3.0]))


@pytest.mark.parametrize("kwargs, exc", [
    (dict(num_heads=0), ValueError),
    (dict(num_heads=2.0), ValueError),
    (dict(num_heads=2, b_init=0.0), ValueError),
    (dict(num_heads=2, b_init=-1.0), ValueError),
    (dict(num_heads=2, b_init=math.inf), ValueError),
    (dict(num_heads=2, n_init=1.0), ValueError),
    (dict(num_heads=2, n_init=[1.5, 0.5]), ValueError),
    (dict(num_heads=2, n_init=[1.5, 1.5, 1.5]), ValueError),
    (dict(num_heads=2, b_init="1"), TypeError),
    (dict(num_heads=2, learnable=1), TypeError),
    (dict(num_heads=2, dtype=torch.int32), TypeError),
])
def test_invalid_arguments(kwargs, exc):
    with pytest.raises(exc):
        SSAttention(**kwargs)


def test_wrong_head_count_is_rejected():
    attn = SSAttention(3)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="3 query heads"):
        attn(q, q, q)


def test_unknown_backend_is_refused_at_construction():
    """backend="trition" used to be accepted at construction and to fail only at the first
    forward, possibly hours into building a model; RingSSAttention inherits the check."""
    from ssa_flash.distributed import RingSSAttention

    for cls in (SSAttention, RingSSAttention):
        with pytest.raises(ValueError, match=r"unknown backend 'trition'.*'auto', 'triton', 'cuda', 'reference'"):
            cls(2, backend="trition")
        with pytest.raises(TypeError, match="backend must be a str"):
            cls(2, backend=None)
        for name in ("auto", "triton", "cuda", "reference"):  # availability is decided per call
            assert cls(2, backend=name).backend == name


def test_flags_accept_numpy_bool_and_refuse_ints():
    np = pytest.importorskip("numpy")
    from ssa_flash.distributed import RingSSAttention

    attn = SSAttention(2, learnable=np.bool_(False), adaptive_temperature=np.bool_(True))
    assert attn.learnable is False and attn.adaptive_temperature is True
    assert "b_raw" in dict(attn.named_buffers())
    ring = RingSSAttention(2, is_causal=np.bool_(True), reduce_param_grads=np.bool_(False))
    assert ring.is_causal is True and ring.reduce_param_grads is False
    with pytest.raises(TypeError, match="adaptive_temperature must be a bool, got int"):
        SSAttention(2, adaptive_temperature=1)
    with pytest.raises(TypeError, match="is_causal must be a bool, got int"):
        RingSSAttention(2, is_causal=1)
