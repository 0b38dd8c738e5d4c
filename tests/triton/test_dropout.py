"""Attention dropout (docs/design.md §1.5): SDPA's semantics on the final weights, Philox bits generated
in the Triton kernels and regenerated in the backward.

The kernels are held to the reference given the same keep mask (``ssa_flash.dropout_mask``
materialises the kernels' mask; ``ssa_flash.reference`` takes it explicitly), the mask function to
a PyTorch Philox written from the paper's round function and Random123's known-answer vectors,
and the statistics (keep rate, expectation) to their definitions."""
import math

import pytest
import torch

import ssa_flash
from ssa_flash import backends, reference
from ssa_flash.backends import cuda_backend
from ssa_flash.spec import AttentionSpec
from attn_testing import DEVICE, MODES, call, check, head_params, make_qkv, needs_kernels

pytestmark = needs_kernels


def _shape(q, k):
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# --------------------------------------------------------------------------------------------
# The mask function


@pytest.mark.parametrize("ctr,key,expected", [
    # Random123 kat_vectors, philox4x32_R(10)
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(ctr, key, expected):
    words = reference.philox4x32_10(*(torch.tensor([c], dtype=torch.int64) for c in ctr), *key)
    assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_kernel_mask_is_the_reference_mask(p):
    """The mask kernel (tiles 32 x 64, unlike the attention kernels' 16 x 16 under the
    interpreter) against the PyTorch Philox: bit for bit, at ragged sizes, with a seed and an
    offset using all 64 bits (the offset wraps the batch counter)."""
    rng = torch.tensor([-0x5A5A5A5A12345677, 0xFFFFFFFF], dtype=torch.int64, device=DEVICE)
    shape = (2, 3, 37, 45)
    ours = ssa_flash.dropout_mask(shape, p, rng=rng, backend="triton")
    ref = ssa_flash.dropout_mask(shape, p, rng=rng, backend="reference")
    assert ours.dtype == torch.bool and ours.shape == shape
    assert torch.equal(ours, ref)
    if p == 0.0:
        assert ours.all()
    if p == 1.0:
        assert not ours.any()


def test_mask_statistics():
    """Keep rate 1 - p within 5 sigma; (batch, head) slices and seeds give different masks."""
    p = 0.3
    shape = (2, 4, 64, 96)
    keep = ssa_flash.dropout_mask(shape, p, rng=torch.tensor([11, 0]), backend="reference")
    n = keep.numel()
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    flat = keep.view(8, -1)
    for a in range(8):
        for b_ in range(a + 1, 8):
            assert not torch.equal(flat[a], flat[b_])
    other = ssa_flash.dropout_mask(shape, p, rng=torch.tensor([12, 0]), backend="reference")
    assert (other != keep).float().mean() > 0.3
    # neighbours inside one Philox evaluation ({i, i+8} x {j, j+1}) are not correlated
    k = keep.float()
    pairs = {"j, j+1": (k[..., 0::2], k[..., 1::2]), "i, i+8": (k[:, :, 0:8], k[:, :, 8:16])}
    for name, (x, y) in pairs.items():
        corr = ((x - x.mean()) * (y - y.mean())).mean() / (x.std() * y.std())
        assert abs(corr.item()) < 5 / math.sqrt(x.numel()), name


def test_mask_draw_follows_manual_seed():
    shape = (1, 2, 20, 20)
    torch.manual_seed(5)
    a = ssa_flash.dropout_mask(shape, 0.5, device=DEVICE)
    torch.manual_seed(5)
    b = ssa_flash.dropout_mask(shape, 0.5, device=DEVICE)
    c = ssa_flash.dropout_mask(shape, 0.5, device=DEVICE)
    assert torch.equal(a, b) and not torch.equal(a, c)


# --------------------------------------------------------------------------------------------
# Kernels against the reference with the same mask


# (variant, causal): the feature matrix's dropout rows (tests/features.py) take the other four
@pytest.mark.parametrize("mode,causal", [("softmax", False), ("ssa", True), ("adaptive", True),
                                         ("ssa_adaptive", False)])
def test_against_reference(mode, causal):
    q, k, v = make_qkv(B=2, Hq=2, Lq=37, Lk=29, D=16)
    check(mode, q, k, v, dropout_seed=3, dropout_p=0.3, is_causal=causal, with_dlse=True)


@pytest.mark.parametrize("mode", ["ssa", "ssa_adaptive"])  # the matrix: dropout with GQA for softmax, adaptive
def test_gqa_mask_lengths(mode):
    """GQA (the dK/dV kernel sums over a group's query heads, each with its own bits), a boolean
    mask with an empty row, Lq > Lk."""
    q, k, v = make_qkv(B=1, Hq=4, Hkv=2, Lq=34, Lk=19, D=16)
    mask = torch.rand(34, 19, generator=torch.Generator().manual_seed(2)) > 0.25
    mask[5] = False
    check(mode, q, k, v, dropout_seed=8, dropout_p=0.45, attn_mask=mask.to(DEVICE), enable_gqa=True)


def test_float64_exact():
    """float64: the kernels' dropout matches the reference to rounding (scale 1/(1-p) included)."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=21, Lk=33, D=8, dtype=torch.float64)
    check("ssa", q, k, v, dropout_seed=1, dropout_p=0.2, is_causal=True)


def test_reference_backend_uses_the_kernels_bits():
    """backend="reference" draws the same (seed, offset) and builds the same mask."""
    q, k, v = make_qkv(Lq=20, Lk=18, D=8, requires_grad=False)
    outs = []
    for backend in ("triton", "reference"):
        torch.manual_seed(4)
        outs.append(ssa_flash.ssa_attention(q, k, v, dropout_p=0.4, backend=backend))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_reproducible_under_manual_seed():
    q, k, v = make_qkv(Lq=24, Lk=24, D=8)
    b, n = head_params(2)

    def run(seed):
        torch.manual_seed(seed)
        out = ssa_flash.ssa_attention(q, k, v, dropout_p=0.5, b=b, n=n, backend="triton")
        return (out,) + torch.autograd.grad(out.square().sum(), (q, k, v, b, n))

    first, again, other = run(0), run(0), run(1)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    assert not torch.equal(first[0], other[0])


def test_dropout_p_one():
    """p = 1: output 0, finite; the LSE is the undropped row's and keeps its gradient."""
    q, k, v = make_qkv(Lq=20, Lk=17, D=8)
    b, n = head_params(2)

    def run(p):
        return ssa_flash.ssa_attention(q, k, v, dropout_p=p, b=b, n=n, return_lse=True, backend="triton")

    out, lse = run(1.0)
    _, lse0 = run(0.0)
    assert (out == 0).all()
    torch.testing.assert_close(lse, lse0)
    grads = torch.autograd.grad(out.sum(), (q, k, v, b, n))
    assert all((g == 0).all() for g in grads)
    out, lse = run(1.0)
    grads = torch.autograd.grad((out.sum() + lse.sum()), (q, k, v, b, n))
    ref = torch.autograd.grad(lse0.sum(), (q, k, v, b, n), allow_unused=True)
    for g, r in zip(grads, ref):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, torch.zeros_like(g) if r is None else r, atol=1e-5, rtol=1e-5)


def test_expected_output_is_undropped():
    """E[out] = the undropped output: one call holds 128 independent draws (each (batch, head)
    slice has its own bits) of the same attention; their mean is within 5 standard errors."""
    g = torch.Generator().manual_seed(0)
    q1, k1, v1 = (torch.randn(1, 1, 16, 8, generator=g) for _ in range(3))
    rep = lambda t: t.expand(8, 16, 16, 8).contiguous().to(DEVICE)  # noqa: E731
    q, k, v = rep(q1), rep(k1), rep(v1)
    torch.manual_seed(0)
    out = ssa_flash.ssa_attention(q, k, v, dropout_p=0.5, b=1.0, n=1.5, backend="triton")
    clean = ssa_flash.ssa_attention(q[:1, :1], k[:1, :1], v[:1, :1], b=1.0, n=1.5, backend="triton")
    draws = out.reshape(128, 16, 8)
    sem = draws.std(dim=0) / math.sqrt(128)
    z = (draws.mean(dim=0) - clean[0, 0]) / sem.clamp(min=1e-6)
    assert z.abs().max() < 5, z.abs().max()
    assert (draws.std(dim=0) > 0).all()  # it did drop


# --------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(mode):
    """float64 Jacobians at a fixed seed (the function reseeds on each evaluation), as random
    projections (gradcheck's fast mode; the interpreter makes each evaluation slow): the full
    Jacobian without dropout is tests/triton/test_gradcheck.py's."""
    q, k, v = make_qkv(B=1, Hq=2, Hkv=1, Lq=4, Lk=5, D=2, dtype=torch.float64, q_scale=2.5)
    b, n = head_params(2, dtype=torch.float64)
    inputs = (q, k, v, b, n) if "ssa" in mode else (q, k, v)

    def f(*args):
        torch.manual_seed(7)
        out, lse = call(ssa_flash, mode, *args[:3], *(args[3:] or (None, None)), dropout_p=0.4,
                        is_causal=True, enable_gqa=True, return_lse=True, backend="triton")
        return out, torch.where(torch.isfinite(lse), lse, 0)

    torch.manual_seed(7)
    keep = ssa_flash.dropout_mask((1, 2, 4, 5), 0.4, device=DEVICE)
    assert keep.any() and not keep.all()  # the seed drops some and keeps some
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_gradcheck_across_blocks():
    q, k, v = make_qkv(B=1, Hq=2, Lq=35, Lk=20, D=4, dtype=torch.float64, q_scale=2.0)
    b, n = head_params(2, dtype=torch.float64)

    def f(*args):
        torch.manual_seed(3)
        return ssa_flash.ssa_attention(*args[:3], b=args[3], n=args[4], dropout_p=0.3,
                                       is_causal=True, backend="triton")

    assert torch.autograd.gradcheck(f, (q, k, v, b, n), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


# --------------------------------------------------------------------------------------------
# Plumbing


def test_cuda_backend_takes_dropout_and_auto_keeps_it(monkeypatch):
    """The CUDA kernels run dropout (numerics: tests/ops/test_backends.py, emulated, and
    tests/cuda/test_cuda_backend.py on a GPU); a spec without its (seed, offset) tensor is refused."""
    q, k, v = make_qkv(Lq=8, Lk=8, D=8, dtype=torch.float16, requires_grad=False)
    spec = AttentionSpec(scale=0.3, dropout_p=0.1, dropout_rng=torch.tensor([1, 2]))
    assert cuda_backend._feature_reason(spec) is None
    no_rng = AttentionSpec(scale=0.3, dropout_p=0.1)
    assert "dropout_rng" in cuda_backend._feature_reason(no_rng)
    with pytest.raises(ValueError, match="dropout_rng"):
        cuda_backend.forward(q, k, v, None, (), None, None, no_rng)
    # auto on a verified CUDA backend keeps it for dropout
    monkeypatch.setattr(backends, "resolve", lambda *a: ("cuda", ""))
    with cuda_backend.emulated(object()):
        assert ssa_flash.ops._resolve_backend("auto", q, k, v, spec) == "cuda"


def test_validation():
    q, k, v = make_qkv(Lq=8, Lk=8, D=8, requires_grad=False)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="dropout_p"):
            ssa_flash.ssa_attention(q, k, v, dropout_p=bad)
    with pytest.raises(TypeError, match="dropout_p"):
        ssa_flash.ssa_attention(q, k, v, dropout_p="0.1")
    with pytest.raises(ValueError, match="shape"):
        ssa_flash.dropout_mask((2, 3), 0.1)
    with pytest.raises(ValueError, match="rng"):
        ssa_flash.dropout_mask((1, 1, 2, 2), 0.1, rng=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="dropout_p"):
        ssa_flash.dropout_mask((1, 1, 2, 2), 2.0)
