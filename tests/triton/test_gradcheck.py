"""torch.autograd.gradcheck in float64 of q, k, v, b, n through the Triton kernels (interpreter on
the CPU), for the four variants with causality, masks and GQA."""
import pytest
import torch

import ssa_flash
from attn_testing import DEVICE, MODES, call, head_params, make_qkv, needs_kernels

pytestmark = needs_kernels


def _inputs(mode, Hq, Hkv, Lq, Lk, D, q_scale=1.0):
    q, k, v = make_qkv(B=1, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, dtype=torch.float64, q_scale=q_scale)
    b, n = head_params(Hq, dtype=torch.float64)
    return (q, k, v, b, n) if "ssa" in mode else (q, k, v)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["causal_gqa", "bool_mask", "float_mask"])
def test_gradcheck(mode, case):
    """float64 gradients on tiny inputs: the full Jacobian once, for SSA with the adaptive
    temperature (every gradient path: q, k, v, b, n, through beta) with causality and GQA, random
    projections (gradcheck's fast mode, which a wrong gradient fails just as surely) for the other
    cases: the interpreter makes each of the full Jacobian's evaluations costly (~40 s each)."""
    Hq, Hkv, Lq, Lk, D = (2, 1, 4, 3, 2) if case == "causal_gqa" else (2, 2, 3, 4, 2)
    kw = {"backend": "triton"}
    if case == "causal_gqa":
        kw.update(is_causal=True, enable_gqa=True)
    elif case == "bool_mask":
        m = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(0)) > 0.4
        m[1] = False  # one empty row
        m[0, 0] = True
        kw["attn_mask"] = m.to(DEVICE)
    else:
        m = torch.randn(1, Hq, Lq, Lk, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        m[..., 2, :2] = float("-inf")
        kw["attn_mask"] = m.to(DEVICE)
    # q_scale spreads row entropies over both sides of the adaptive threshold
    inputs = _inputs(mode, Hq, Hkv, Lq, Lk, D, q_scale=2.5)

    def f(*args):
        out, lse = call(ssa_flash, mode, *args[:3], *(args[3:] or (None, None)), return_lse=True, **kw)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=(mode, case) != ("ssa_adaptive", "causal_gqa"))


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
def test_gradcheck_across_blocks(mode):
    """Lengths spanning several kernel blocks (interior and ragged tiles), fast-mode gradcheck
    (random projections), for the variant with neither SSA nor the adaptive temperature and the
    one with both: the code that carries a row across key blocks is the same for the other two
    (which the single-block cases above and the feature matrix's multi-block rows take)."""
    inputs = _inputs(mode, 2, 1, 35, 20, 4, q_scale=2.0)
    f = lambda *a: call(ssa_flash, mode, *a[:3], *(a[3:] or (None, None)), is_causal=True,  # noqa: E731
                        enable_gqa=True, backend="triton")
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
def test_float64_bool_mask_as_additive_is_the_same_attention(mode, monkeypatch):
    """On a GPU a float64 call's boolean mask reaches the kernels as an additive 0 / -inf mask (a
    Triton 3.6 limit: kernel_args.bool_mask_as_additive). Both kinds give the same out, lse and
    gradients, empty rows and a broadcast (stride-0) batch dimension included."""
    from ssa_flash.triton import kernel_args, launch

    q, k, v = make_qkv(B=2, Hq=2, Hkv=2, Lq=5, Lk=7, D=4, dtype=torch.float64)
    b, n = head_params(2, dtype=torch.float64)
    m = torch.rand(1, 1, 5, 7, generator=torch.Generator().manual_seed(3)) > 0.4
    m[..., 2, :] = False
    m[..., 0, 0] = True
    kw = dict(attn_mask=m.expand(2, 2, 5, 7).to(DEVICE), backend="triton")
    args = (q, k, v, b, n) if "ssa" in mode else (q, k, v)

    def run():
        out, lse = call(ssa_flash, mode, *args[:3], *(args[3:] or (None, None)), return_lse=True, **kw)
        grads = torch.autograd.grad((out * 1.3).sum() + torch.where(torch.isfinite(lse), lse, 0).sum(), args)
        return (out, lse) + grads

    as_is = run()
    seen = []
    original = kernel_args.additive_from_bool
    monkeypatch.setattr(kernel_args, "bool_mask_as_additive", lambda like: like.dtype == torch.float64)
    monkeypatch.setattr(kernel_args, "additive_from_bool", lambda mask: seen.append(mask) or original(mask))
    converted = run()
    assert seen and all(t.dtype == torch.bool for t in seen)
    assert torch.isneginf(converted[1][:, :, 2]).all()
    for a, c in zip(as_is, converted):
        torch.testing.assert_close(c, a, atol=1e-14, rtol=1e-13)
