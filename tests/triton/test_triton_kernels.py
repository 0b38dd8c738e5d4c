"""The Triton kernel family (forward, entropy pass, backward) against the materialised reference,
in depth over the corners of docs/design.md §1.4's features (lengths, head dims, GQA ratios, mask
kinds, dtypes, layouts). On the CPU this runs through Triton's interpreter, on a GPU on the device.

The feature matrix (tests/triton/test_triton_features.py) runs every feature with every variant in
the first of ``KERNEL_DTYPES``, the LSE gradient included; here each corner runs with two of the
four variants (``rotating_modes``: one of softmax scores, one of SSA's; each variant takes half
of the corners), since the corner's code is shared by the variants."""
import pytest
import torch

import ssa_flash
from ssa_flash import reference
from attn_testing import (DEVICE, KERNEL_DTYPES, LOW_PRECISION, MODES, call, check, head_params,
                          make_qkv, needs_kernels, rotating_modes)

pytestmark = needs_kernels


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", KERNEL_DTYPES[1:])  # the first: the feature matrix's
@pytest.mark.parametrize("causal", [False, True])
def test_basic(mode, dtype, causal):
    q, k, v = make_qkv(B=2, Hq=2, Lq=37, Lk=37, D=16, dtype=dtype)
    check(mode, q, k, v, is_causal=causal)


@pytest.mark.parametrize("mode,lq,lk,causal", rotating_modes(
    [(lq, lk, causal) for lq, lk in [(21, 45), (45, 21), (1, 33), (33, 1), (1, 1)] for causal in (False, True)]))
def test_lengths(mode, lq, lk, causal):
    q, k, v = make_qkv(Lq=lq, Lk=lk, D=16)
    check(mode, q, k, v, is_causal=causal)


@pytest.mark.parametrize("mode,d,dv", rotating_modes([(59, 59), (111, 111), (8, 24), (1, 3), (256, 256)]))
def test_head_dims(mode, d, dv):
    q, k, v = make_qkv(Hq=1, Lq=20, Lk=18, D=d, Dv=dv)
    check(mode, q, k, v)


@pytest.mark.parametrize("mode,hq,hkv,causal", rotating_modes(
    [(hq, hkv, causal) for hq, hkv in [(4, 2), (4, 1), (6, 3)] for causal in (False, True)]))
def test_gqa(mode, hq, hkv, causal):
    q, k, v = make_qkv(Hq=hq, Hkv=hkv, Lq=18, Lk=23, D=16)
    check(mode, q, k, v, is_causal=causal, enable_gqa=True)


def _mask(kind, B, H, Lq, Lk, seed=5):
    g = torch.Generator().manual_seed(seed)
    if kind == "bool_full":
        m = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
    elif kind == "bool_2d":
        m = torch.rand(Lq, Lk, generator=g) > 0.5
    elif kind == "key_padding":
        lengths = torch.tensor([Lk, Lk // 2])[:B]
        m = (torch.arange(Lk)[None, :] < lengths[:, None]).view(B, 1, 1, Lk)
    elif kind == "float_2d":
        m = torch.randn(Lq, Lk, generator=g)
        m[torch.rand(Lq, Lk, generator=g) > 0.7] = float("-inf")
    elif kind == "float_heads":
        m = torch.randn(1, H, Lq, Lk, generator=g) * 3
    elif kind == "bool_empty_rows":
        m = torch.rand(B, 1, Lq, Lk, generator=g) > 0.5
        m[:, :, ::3] = False  # every third query row attends to nothing
    elif kind == "float_empty_rows":
        m = torch.zeros(B, H, Lq, Lk)
        m[:, :, 1::4] = float("-inf")
    else:
        raise ValueError(kind)
    return m.to(DEVICE)


MASKS = ["bool_full", "bool_2d", "key_padding", "float_2d", "float_heads", "bool_empty_rows",
         "float_empty_rows"]


@pytest.mark.parametrize("mode,kind", rotating_modes(MASKS))
def test_masks(mode, kind):
    B, H, Lq, Lk = 2, 2, 19, 26
    q, k, v = make_qkv(B=B, Hq=H, Lq=Lq, Lk=Lk, D=16)
    check(mode, q, k, v, attn_mask=_mask(kind, B, H, Lq, Lk))


@pytest.mark.parametrize("mode,kind", rotating_modes(["bool_full", "float_2d"]))
def test_mask_with_causal(mode, kind):
    B, H, L = 2, 2, 24
    q, k, v = make_qkv(B=B, Hq=H, Lq=L, D=16)
    check(mode, q, k, v, attn_mask=_mask(kind, B, H, L, L), is_causal=True)


@pytest.mark.parametrize("mode", MODES)
def test_mask_dtype_matches_input(mode):
    """A float mask in the inputs' low precision dtype, as SDPA users pass it."""
    q, k, v = make_qkv(Lq=17, Lk=20, D=16, dtype=LOW_PRECISION[0])
    mask = _mask("float_2d", 1, 2, 17, 20).to(LOW_PRECISION[0])
    check(mode, q, k, v, attn_mask=mask)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision(mode, dtype):
    q, k, v = make_qkv(B=2, Hq=2, Lq=40, Lk=33, D=32, dtype=dtype)
    check(mode, q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_inputs(mode):
    """Transposed (B, L, H, D) layouts and sliced views, as models produce them."""
    B, L, H, D = 2, 21, 2, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, L, 3, H, 2 * D, generator=g).to(DEVICE)
    q, k, v = (qkv[:, :, i, :, :D].transpose(1, 2).requires_grad_() for i in range(3))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    assert not q.is_contiguous()
    check(mode, q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", MODES)
def test_scale(mode):
    q, k, v = make_qkv(Lq=15, Lk=22, D=16)
    check(mode, q, k, v, scale=0.9)


@pytest.mark.parametrize("mode", ["ssa", "ssa_adaptive"])
@pytest.mark.parametrize("bn", ["floats", "scalar_tensors", "per_head"])
def test_b_n_forms(mode, bn):
    q, k, v = make_qkv(Hq=3, Lq=14, Lk=17, D=16)
    if bn == "floats":
        b, n = 0.8, 2.0
        kw = dict(b=b, n=n)
        out = ssa_flash.ssa_attention(q, k, v, backend="triton", adaptive_temperature=mode == "ssa_adaptive", **kw)
        ref = reference.attention(q, k, v, adaptive_temperature=mode == "ssa_adaptive", score="ssa",
                                  score_params=(b, n))
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
        return
    if bn == "scalar_tensors":
        b = torch.tensor(0.8, device=DEVICE, requires_grad=True)
        n = torch.tensor(2.0, device=DEVICE, requires_grad=True)
    else:
        b, n = head_params(3)
    check(mode, q, k, v, b, n)


@pytest.mark.parametrize("mode", ["ssa", "ssa_adaptive"])
@pytest.mark.parametrize("causal", [False, True])
def test_n_zero(mode, causal):
    """A head with n = 0 (weights uniform over the admissible keys; a learnable n passes through
    it): forward, LSE and every gradient, dn included, finite and as the reference's. The
    backward never divides by n."""
    q, k, v = make_qkv(Hq=2, Lq=21, Lk=19, D=16)
    b, n = head_params(2)
    with torch.no_grad():
        n[0] = 0.0
    out = check(mode, q, k, v, b, n, is_causal=causal, with_dlse=True)
    assert out[2]["n"][0] != 0  # dn of the n = 0 head: the weights do depend on n there


@pytest.mark.parametrize("mode", MODES)
def test_empty_rows_give_zero(mode):
    """Rows that can attend to nothing: output 0, zero gradients, never NaN."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=9, Lk=12, D=16)
    mask = torch.ones(1, 1, 9, 12, dtype=torch.bool, device=DEVICE)
    mask[..., 4, :] = False
    b, n = head_params(2)
    out = call(ssa_flash, mode, q, k, v, b, n, attn_mask=mask, backend="triton")
    assert torch.isfinite(out).all()
    assert (out[:, :, 4] == 0).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and (q.grad[:, :, 4] == 0).all()
    for t in (k, v):
        assert torch.isfinite(t.grad).all()


def test_entirely_masked_input():
    q, k, v = make_qkv(Lq=6, Lk=7, D=16)
    mask = torch.zeros(6, 7, dtype=torch.bool, device=DEVICE)
    out, lse = ssa_flash.ssa_attention(q, k, v, mask, backend="triton", return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    out.sum().backward()
    assert (q.grad == 0).all() and (k.grad == 0).all() and (v.grad == 0).all()


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_backward(mode):
    q, k, v = make_qkv(Hq=4, Hkv=2, Lq=30, Lk=30, D=16)
    b, n = head_params(4)
    grads = []
    for _ in range(2):
        out = call(ssa_flash, mode, q, k, v, b, n, is_causal=True, enable_gqa=True,
                   backend="triton", **({"deterministic": True} if mode in ("ssa", "ssa_adaptive") else {}))
        inputs = [q, k, v] + ([b, n] if "ssa" in mode else [])
        grads.append(torch.autograd.grad(out.square().sum(), inputs))
    for g1, g2 in zip(*grads):
        assert torch.equal(g1, g2)


def test_unbatched_inputs():
    q, k, v = make_qkv(Lq=10, Lk=12, D=16)
    out = ssa_flash.ssa_attention(q[0], k[0], v[0], backend="triton")
    assert out.shape == (2, 10, 16)
    torch.testing.assert_close(out, ssa_flash.ssa_attention(q, k, v, backend="triton")[0])


@pytest.mark.parametrize("shape", [(0, 2, 5, 5), (1, 2, 0, 5), (1, 2, 5, 0)])
def test_empty_tensors(shape):
    B, H, Lq, Lk = shape
    q = torch.randn(B, H, Lq, 8, device=DEVICE, requires_grad=True)
    k = torch.randn(B, H, Lk, 8, device=DEVICE, requires_grad=True)
    v = torch.randn(B, H, Lk, 8, device=DEVICE, requires_grad=True)
    out, lse = ssa_flash.ssa_attention(q, k, v, backend="triton", return_lse=True)
    assert out.shape == (B, H, Lq, 8) and lse.shape == (B, H, Lq)
    assert (out == 0).all()
    out.sum().backward()
    assert q.grad.shape == q.shape and (q.grad == 0).all()
