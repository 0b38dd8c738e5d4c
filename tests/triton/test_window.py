"""Local attention, ``window_size=(left, right)`` (docs/design.md §1.5): query i attends key j only if
``i - left <= j <= i + right`` (-1: unbounded), top-left aligned, intersected with ``is_causal``
and masks.

The kernels are held to the reference (an explicit band mask), each window case with two of the
four variants (``rotating_modes``; the feature matrix, tests/triton/test_triton_features.py, runs
windows with every variant), to SDPA and
FlexAttention given the equivalent mask (independent implementations), and to skipping the key
(query) blocks outside the window rather than masking them."""
import pytest
import torch
import torch.nn.functional as F

import ssa_flash
from ssa_flash import ops, reference
from ssa_flash.backends import cuda_backend
from ssa_flash.spec import AttentionSpec
from attn_testing import (DEVICE, FLOORS, INTERPRETER, call, check, fa_tolerance_check, head_params, make_qkv,
                          needs_kernels, rotating_modes)

pytestmark = needs_kernels

# (Lq, Lk, window, causal): ragged lengths over 16 x 16 interpreter blocks, both orders
CASES = [
    (37, 45, (3, 2), False),
    (45, 21, (5, -1), False),
    (37, 37, (20, -1), True),  # Mistral's sliding window: causal + left bound
    (21, 45, (-1, 4), False),
    (33, 40, (0, 0), False),  # the diagonal only (rows past Lk's diagonal are empty)
    (40, 33, (17, 16), True),
]


@pytest.mark.parametrize("mode,lq,lk,window,causal", rotating_modes(CASES))
def test_against_reference(mode, lq, lk, window, causal):
    q, k, v = make_qkv(B=1, Hq=2, Lq=lq, Lk=lk, D=16)
    check(mode, q, k, v, window_size=window, is_causal=causal, with_dlse=True)


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])  # the matrix: windows with GQA for adaptive, ssa
def test_gqa_masks(mode):
    """GQA, a float mask with -inf entries, a window, causal: every rule intersects."""
    q, k, v = make_qkv(B=2, Hq=4, Hkv=2, Lq=35, Lk=35, D=16)
    g = torch.Generator().manual_seed(6)
    mask = torch.randn(2, 1, 35, 35, generator=g)
    mask[torch.rand(2, 1, 35, 35, generator=g) > 0.8] = float("-inf")
    check(mode, q, k, v, attn_mask=mask.to(DEVICE), window_size=(7, 3), is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
def test_with_dropout(mode):
    q, k, v = make_qkv(B=1, Hq=2, Lq=38, Lk=38, D=16)
    check(mode, q, k, v, window_size=(6, 6), dropout_seed=2, dropout_p=0.3)


@pytest.mark.parametrize("lq,lk,window,causal", CASES)
def test_softmax_against_sdpa(lq, lk, window, causal):
    """Softmax attention with a window equals SDPA given the band as a boolean mask (rows with no
    admissible key excluded: SDPA gives NaN there, we give 0)."""
    q, k, v = make_qkv(B=2, Hq=2, Lq=lq, Lk=lk, D=16, dtype=torch.float64, requires_grad=False)
    band = reference.window_band(lq, lk, window, DEVICE)
    if causal:
        band = band & torch.ones(lq, lk, dtype=torch.bool, device=DEVICE).tril()
    ours = ssa_flash.softmax_attention(q, k, v, window_size=window, is_causal=causal, backend="triton")
    rows = band.any(-1)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    torch.testing.assert_close(ours[:, :, rows], sdpa[:, :, rows], atol=1e-10, rtol=1e-10)
    assert (ours[:, :, ~rows] == 0).all()


def test_ssa_against_flex_attention():
    """SSA with a window against FlexAttention's forward: SSA as a score_mod, the window as a
    mask_mod (float64, CPU eager)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = make_qkv(B=1, Hq=2, Lq=37, Lk=45, D=16, dtype=torch.float64, requires_grad=False)
    b = torch.tensor([0.7, 1.3], dtype=torch.float64, device=DEVICE)
    n = torch.tensor([1.5, 2.5], dtype=torch.float64, device=DEVICE)
    left, right = 4, 9

    def score_mod(s, bi, h, i, j):
        return n[h] * torch.sign(s) * torch.log1p(b[h] * torch.abs(s))

    def mask_mod(bi, h, i, j):
        return (j >= i - left) & (j <= i + right)

    block_mask = create_block_mask(mask_mod, None, None, 37, 45, device=DEVICE)
    flex = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    ours = ssa_flash.ssa_attention(q, k, v, b=b, n=n, window_size=(left, right),
                                   backend="triton")
    torch.testing.assert_close(ours, flex, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mode", ["softmax", "ssa_adaptive"])
def test_blocks_outside_the_window_are_skipped(mode):
    """NaN in value rows (and output-gradient rows) that no query's window reaches: a kernel that
    visited their blocks with zero weights would compute 0 * NaN = NaN; skipping them keeps the
    output and every gradient finite and equal to the reference on clean inputs. Lengths are in
    units of T, the widest tile a launch may take (16 under the interpreter, 128 on a GPU: with
    T = 16 on a GPU the NaN rows shared a visited 64-key block, and 0 * NaN is NaN there as in
    any materialised product)."""
    T = 16 if INTERPRETER else 128
    Lq, Lk, window = 2 * T, 4 * T, (5, 4)  # queries < 2T reach keys < 2T + 5: keys >= 3T never
    q, k, v = make_qkv(B=1, Hq=2, Lq=Lq, Lk=Lk, D=16, requires_grad=False)
    v_nan = v.clone()
    v_nan[:, :, 3 * T:] = float("nan")
    b, n = head_params(2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v_nan)]
    out = call(ssa_flash, mode, *leaves, b, n, window_size=window, backend="triton")
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad(out.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    clean = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = call(reference, mode, *clean, b, n, window_size=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    ref_grads = torch.autograd.grad(ref.sum(), clean)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=2e-5)
    # the left edge: queries >= 2T reach keys >= 2T - 5 only, so key block 0..T-1 is skipped for them
    q, k, v = make_qkv(B=1, Hq=2, Lq=4 * T, Lk=4 * T, D=16)
    v_nan = v.detach().clone()
    v_nan[:, :, :T] = float("nan")
    q_ = q.detach().clone().requires_grad_()
    out = call(ssa_flash, mode, q_, k, v_nan, b, n, window_size=window, backend="triton")
    assert torch.isfinite(out[:, :, 2 * T:]).all() and torch.isnan(out[:, :, :8]).all()
    (dq,) = torch.autograd.grad(out[:, :, 2 * T:].sum(), (q_,))
    assert torch.isfinite(dq[:, :, 2 * T:]).all()
    # the dK/dV kernel: query blocks outside a key block's window are skipped too, on both sides
    out = call(ssa_flash, mode, q, k, v, b, n, window_size=window, backend="triton")
    for rows, keys in ((slice(3 * T, 4 * T), slice(0, 2 * T)), (slice(0, T), slice(2 * T, 4 * T))):
        dout = torch.ones_like(out)
        dout[:, :, rows] = float("nan")  # queries >= 3T reach keys >= 3T - 5; queries < T, keys < T + 4
        dk, dv = torch.autograd.grad(out, (k, v), dout, retain_graph=True)
        assert torch.isfinite(dk[:, :, keys]).all() and torch.isfinite(dv[:, :, keys]).all()


def test_entropy():
    q, k, _ = make_qkv(B=1, Hq=2, Lq=37, Lk=29, D=16, requires_grad=False)
    b, n = head_params(2)
    b, n = b.detach(), n.detach()
    for kw in (dict(window_size=(4, 6)), dict(window_size=(9, -1), is_causal=True)):
        ours = ssa_flash.attention_entropy(q, k, score="ssa", score_params={"b": b, "n": n}, backend="triton", **kw)
        gold = reference.attention_entropy(q.double(), k.double(), score="ssa", score_params=(b.double(), n.double()),
                                           **kw)
        naive = reference.attention_entropy(q, k, score="ssa", score_params=(b, n), **kw)
        fa_tolerance_check("entropy", ours, naive, gold, FLOORS[torch.float32])


def test_empty_rows_and_zero_gradients():
    """Rows that the window leaves empty (Lq > Lk, diagonal-only window) give 0 and zero grads."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=30, Lk=12, D=8)
    out, lse = ssa_flash.ssa_attention(q, k, v, window_size=(0, 0), return_lse=True, backend="triton")
    assert (out[:, :, 12:] == 0).all() and (lse[:, :, 12:] == float("-inf")).all()
    assert torch.isfinite(lse[:, :, :12]).all()
    (gq,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.isfinite(gq).all() and (gq[:, :, 12:] == 0).all()


def test_unbounded_windows_are_no_window():
    """Sides that exclude nothing become -1 (so the kernels compile as without a window)."""
    eff = ops._effective_window
    assert eff((-1, -1), 10, 12, False) == (-1, -1)
    assert eff((9, 11), 10, 12, False) == (-1, -1)
    assert eff((8, 10), 10, 12, False) == (8, 10)
    assert eff((3, 5), 10, 12, True) == (3, -1)  # causal is tighter than any right bound
    q, k, v = make_qkv(Lq=10, Lk=12, D=8, requires_grad=False)
    torch.testing.assert_close(ssa_flash.ssa_attention(q, k, v, window_size=(9, 11), backend="triton"),
                               ssa_flash.ssa_attention(q, k, v, backend="triton"))


def test_kernel_window_is_one_encoding_for_both_backends():
    """ssa_flash.conventions.kernel_window: None without a bound (both NO_WINDOW, or the right side
    alone under causal), else both sides in [0, Lq + Lk]; the Triton kernels' window arguments and
    the CUDA binding's are that band."""
    from ssa_flash.conventions import NO_WINDOW, kernel_window
    from ssa_flash.triton.kernel_args import feature_args

    assert kernel_window(NO_WINDOW, NO_WINDOW, False, 8, 10) is None
    assert kernel_window(NO_WINDOW, 4, True, 8, 10) is None  # causality bounds the right side already
    assert kernel_window(NO_WINDOW, 4, False, 8, 10) == (18, 4)
    assert kernel_window(3, NO_WINDOW, True, 8, 10) == (3, 18)
    assert kernel_window(100, 50, False, 8, 10) == (18, 18)
    for spec in (AttentionSpec(scale=1.0, window_left=3), AttentionSpec(scale=1.0, window_right=2),
                 AttentionSpec(scale=1.0, window_right=2, causal=True), AttentionSpec(scale=1.0)):
        band = kernel_window(spec.window_left, spec.window_right, spec.causal, 8, 10)
        args, consts = feature_args(None, 8, 10, spec)
        assert args["window"] == band and consts["WINDOW"] == (band is not None)
        cuda = cuda_backend._spec_args(spec, 1.0, None, 8, 10)
        assert (cuda["window_left"], cuda["window_right"]) == (band or (NO_WINDOW, NO_WINDOW))


def test_cuda_backend_takes_windows():
    """The CUDA kernels run windows (numerics: tests/cuda/test_csrc_compile.py and tests/ops/test_backends.py,
    emulated; tests/cuda/test_cuda_backend.py on a GPU): the spec's bounds reach the kernels' arguments
    as ssa_flash.conventions.kernel_window encodes them (an unbounded side: Lq + Lk), and a call without
    a window passes NO_WINDOW (-1) for both sides."""
    spec = AttentionSpec(scale=1.0, window_left=3)
    assert cuda_backend._feature_reason(spec) is None
    args = cuda_backend._spec_args(spec, 1.0, None, 8, 10)
    assert (args["window_left"], args["window_right"]) == (3, 18)
    args = cuda_backend._spec_args(AttentionSpec(scale=1.0), 1.0, None, 8, 10)
    assert (args["window_left"], args["window_right"]) == (-1, -1)
    q, k, v = make_qkv(Lq=8, Lk=8, D=8, dtype=torch.float16, requires_grad=False)
    with cuda_backend.emulated(object()):
        assert cuda_backend.supports(q, k, v, spec) is None


@pytest.mark.parametrize("fn", ["ssa_attention", "softmax_attention", "adaptive_temperature_attention"])
def test_validation(fn):
    q, k, v = make_qkv(Lq=8, Lk=8, D=8, requires_grad=False)
    f = getattr(ssa_flash, fn)
    for bad in ((-2, 0), (0, -5)):
        with pytest.raises(ValueError, match="window_size"):
            f(q, k, v, window_size=bad)
    for bad in ((1,), (1, 2, 3)):
        with pytest.raises(ValueError, match="window_size"):
            f(q, k, v, window_size=bad)
    for bad in (3, "3,3", (1.5, 2), (True, 1), None):
        with pytest.raises(TypeError, match="window_size"):
            f(q, k, v, window_size=bad)
    with pytest.raises(ValueError, match="window_size"):
        ssa_flash.attention_entropy(q, k, window_size=(-3, 1))
