"""ssa_flash.varlen_attention (packed variable-length batches, docs/design.md §1.5) through the Triton
kernels: against the reference applied to each sequence, against the dense kernels on a padded
layout, gradients (b, n included, float64 gradcheck), validation, and the op registration."""
import pytest
import torch

import ssa_flash
from ssa_flash import reference
from ssa_flash.spec import AttentionSpec
from ssa_flash.errors import BackendUnavailableError
from ssa_flash.triton import launch

from attn_testing import DEVICE, MODES, fa_tolerance_check, head_params, host_values_only, needs_kernels

pytestmark = needs_kernels

# lengths per sequence, with empty sequences, one-row sequences, queries without keys and keys
# without queries, and one sequence longer than a few kernel blocks
LENS_Q = [5, 0, 37, 1, 3, 2]
LENS_K = [7, 3, 37, 0, 1, 2]


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def packed_inputs(lens_q, lens_k, Hq=4, Hkv=2, D=16, Dv=None, dtype=torch.float64, seed=0, q_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    Dv = Dv or D
    q = torch.randn(sum(lens_q), Hq, D, generator=g, dtype=torch.float64) * q_scale
    k = torch.randn(sum(lens_k), Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), Hkv, Dv, generator=g, dtype=torch.float64)
    return tuple(t.to(device=DEVICE, dtype=dtype).requires_grad_() for t in (q, k, v))


def run_varlen(mode, q, k, v, b, n, lens_q, lens_k, dout, dlse, backend, **kw):
    """Forward and backward of one variant; returns (out, lse, {name: grad})."""
    ssa = "ssa" in mode
    out, lse = ssa_flash.varlen_attention(
        q, k, v, cu(lens_q), cu(lens_k), max(max(lens_q), 1), max(max(lens_k), 1), score="ssa" if ssa else "softmax",
        score_params=(b, n) if ssa else None,
        adaptive_temperature="adaptive" in mode,
        return_lse=True, backend=backend, **kw)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()
    names, inputs = zip(*[(nm, t) for nm, t in zip("qkvbn", (q, k, v, b, n)) if t is not None and (ssa or nm in "qkv")])
    grads = torch.autograd.grad(loss, inputs)
    return out, lse, dict(zip(names, grads))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_per_sequence(mode, causal):
    """Outputs, LSE and gradients of q, k, v, b, n against the reference run on each sequence in
    turn (float64); GQA, per-head b and n, empty sequences and sequences without keys."""
    q, k, v = packed_inputs(LENS_Q, LENS_K, q_scale=2.0)
    b, n = head_params(4, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(q.shape[0], 4, 16, generator=g, dtype=torch.float64).to(DEVICE)
    dlse = torch.randn(4, q.shape[0], generator=g, dtype=torch.float64).to(DEVICE)
    kw = dict(is_causal=causal, enable_gqa=True)
    ours = run_varlen(mode, q, k, v, b, n, LENS_Q, LENS_K, dout, dlse, "triton", **kw)
    ref = run_varlen(mode, q, k, v, b, n, LENS_Q, LENS_K, dout, dlse, "reference", **kw)
    assert ours[0].shape == (sum(LENS_Q), 4, 16) and ours[1].shape == (4, sum(LENS_Q))
    torch.testing.assert_close(ours[0], ref[0], atol=1e-10, rtol=1e-10)
    # rows of the sequence without keys: output 0, lse -inf
    no_key = slice(sum(LENS_Q[:3]), sum(LENS_Q[:4]))
    assert (ours[0][no_key] == 0).all() and (ours[1][:, no_key] == float("-inf")).all()
    assert torch.equal(torch.isfinite(ours[1]), torch.isfinite(ref[1]))
    finite = torch.isfinite(ref[1])
    torch.testing.assert_close(ours[1][finite], ref[1][finite], atol=1e-10, rtol=1e-10)
    assert set(ours[2]) == set(ref[2])
    for name, grad in ours[2].items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, ref[2][name], atol=1e-9, rtol=1e-9, msg=f"d{name}")
    assert (ours[2]["q"][no_key] == 0).all()  # rows without keys: zero gradients
    keys_without_queries = slice(sum(LENS_K[:1]), sum(LENS_K[:2]))
    assert (ours[2]["k"][keys_without_queries] == 0).all() and (ours[2]["v"][keys_without_queries] == 0).all()


def _pad(x, lengths, L):
    """Packed (total, H, d) -> padded (B, H, L, d) with zeros."""
    out = x.new_zeros(len(lengths), x.shape[1], L, x.shape[2])
    start = 0
    for i, length in enumerate(lengths):
        out[i, :, :length] = x[start:start + length].transpose(0, 1)
        start += length
    return out


def _unpad(x, lengths):
    return torch.cat([x[i, :, :length].transpose(0, 1) for i, length in enumerate(lengths)])


@pytest.mark.parametrize("mode", ["ssa", "softmax", "ssa_adaptive"])
def test_matches_dense_kernels_on_padded_layout(mode):
    """The packed kernels equal the dense kernels on the same sequences padded to a common length
    with a key-padding mask (float32, causal, GQA): what the mask-free layout replaces."""
    lens_q, lens_k = [9, 1, 20, 4], [9, 6, 20, 0]
    q, k, v = packed_inputs(lens_q, lens_k, dtype=torch.float32, seed=1)
    b, n = head_params(4)
    Lq, Lk = max(lens_q), max(lens_k)
    qp, kp, vp = (_pad(t.detach(), ls, L).requires_grad_() for t, ls, L in
                  ((q, lens_q, Lq), (k, lens_k, Lk), (v, lens_k, Lk)))
    key_ok = (torch.arange(Lk)[None, :] < torch.tensor(lens_k)[:, None]).view(4, 1, 1, Lk).to(DEVICE)
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(q.shape[0], 4, 16, generator=g).to(DEVICE)
    ssa, adaptive = "ssa" in mode, "adaptive" in mode
    kw = dict(is_causal=True, enable_gqa=True, adaptive_temperature=adaptive, backend="triton")
    out = ssa_flash.varlen_attention(q, k, v, cu(lens_q), cu(lens_k), Lq, Lk, score="ssa" if ssa else "softmax",
                                     score_params=(b, n) if ssa else None, **kw)
    if ssa:
        dense = ssa_flash.ssa_attention(qp, kp, vp, key_ok, b=b, n=n, **kw)
    elif adaptive:
        dense = ssa_flash.adaptive_temperature_attention(qp, kp, vp, key_ok, **{k_: v_ for k_, v_ in kw.items() if k_ != "adaptive_temperature"})
    else:
        kw.pop("adaptive_temperature")
        dense = ssa_flash.softmax_attention(qp, kp, vp, key_ok, **kw)
    torch.testing.assert_close(out, _unpad(dense, lens_q), atol=2e-6, rtol=2e-5)
    inputs = [q, k, v] + ([b, n] if ssa else [])
    g_packed = torch.autograd.grad((out * dout).sum(), inputs)
    g_dense = torch.autograd.grad((_unpad(dense, lens_q) * dout).sum(), [qp, kp, vp] + ([b, n] if ssa else []))
    torch.testing.assert_close(g_packed[0], _unpad(g_dense[0], lens_q), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(g_packed[1], _unpad(g_dense[1], lens_k), atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(g_packed[2], _unpad(g_dense[2], lens_k), atol=2e-5, rtol=2e-4)
    for gp, gd in zip(g_packed[3:], g_dense[3:]):
        torch.testing.assert_close(gp, gd, atol=1e-4, rtol=1e-4)


def test_gradcheck_float64():
    """Gradients of q, k, v, b, n in float64 at tiny size (causal, GQA, an empty sequence and a
    query without keys): gradcheck's random projections of the inputs (fast mode, which a wrong
    gradient fails as surely) of two fixed random projections of (out, lse). The full Jacobian
    took 80 interpreted forward and 24 backward launches (~2-3 minutes of CI); the dense kernels'
    full-Jacobian case is tests/triton/test_gradcheck.py's."""
    lens_q, lens_k = [2, 0, 1, 1], [2, 1, 2, 0]
    q, k, v = packed_inputs(lens_q, lens_k, Hq=2, Hkv=1, D=2, q_scale=2.0)
    b, n = head_params(2, dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    w_out = torch.randn(sum(lens_q), 2, 2, generator=g, dtype=torch.float64).to(DEVICE)
    w_lse = torch.randn(2, sum(lens_q), generator=g, dtype=torch.float64).to(DEVICE)

    def f(q, k, v, b, n):
        out, lse = ssa_flash.varlen_attention(q, k, v, cu(lens_q), cu(lens_k), 2, 2, is_causal=True,
                                              enable_gqa=True, score="ssa", score_params=(b, n), return_lse=True,
                                              backend="triton")
        return (out * w_out).sum(), (torch.where(torch.isfinite(lse), lse, 0) * w_lse).sum()

    assert torch.autograd.gradcheck(f, (q, k, v, b, n), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_gradcheck_adaptive_fast_mode():
    """The adaptive temperature's exact gradient through the packed kernels (random projections)."""
    lens_q, lens_k = [3, 1], [2, 3]
    q, k, v = packed_inputs(lens_q, lens_k, Hq=2, Hkv=2, D=4, q_scale=3.0)
    b, n = head_params(2, dtype=torch.float64)
    f = lambda q, k, v, b, n: ssa_flash.varlen_attention(  # noqa: E731
        q, k, v, cu(lens_q), cu(lens_k), 3, 3, score="ssa", score_params=(b, n), adaptive_temperature=True,
        backend="triton")
    assert torch.autograd.gradcheck(f, (q, k, v, b, n), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_low_precision_within_flash_tolerance():
    """float16 inputs: error at most twice the naive float16 reference's, against float64."""
    dtype = torch.float16
    q, k, v = packed_inputs(LENS_Q, LENS_K, dtype=dtype, seed=2)
    b, n = head_params(4)
    kw = dict(is_causal=True, enable_gqa=True, score="ssa", score_params=(b, n))
    ours = ssa_flash.varlen_attention(q, k, v, cu(LENS_Q), cu(LENS_K), 37, 37, backend="triton", **kw)
    naive = reference.varlen_attention(q, k, v, cu(LENS_Q), cu(LENS_K), **kw)
    gold = reference.varlen_attention(*(t.double() for t in (q, k, v)), cu(LENS_Q), cu(LENS_K),
                                      **dict(kw, score_params=(b.double(), n.double())))
    assert ours.dtype == dtype
    fa_tolerance_check("out", ours, naive, gold, 2e-3)


def test_no_mask_reaches_the_kernels(monkeypatch):
    """The packed path reads no mask: the kernels are launched with mask=None and a packed layout."""
    seen = []
    fwd = launch.forward

    def forward(q, k, v, mask, *args, **kw):
        seen.append((mask, args[3] if len(args) > 3 else kw.get("layout")))  # params, beta, spec, layout
        return fwd(q, k, v, mask, *args, **kw)

    monkeypatch.setattr(launch, "forward", forward)
    q, k, v = packed_inputs([3, 2], [3, 2], Hq=2, Hkv=2, D=8)
    ssa_flash.varlen_attention(q, k, v, cu([3, 2]), cu([3, 2]), 3, 3, is_causal=True, backend="triton", score="ssa",
                               score_params=(1.0, 1.5))
    assert len(seen) == 1 and seen[0][0] is None and isinstance(seen[0][1], launch.Packed)


# --------------------------------------------------------------------------------------------
# Validation (no kernel runs)


def _args():
    q, k, v = packed_inputs([3, 2], [3, 2], Hq=2, Hkv=2, D=8)
    return q, k, v, cu([3, 2]), cu([3, 2]), 3, 3


@pytest.mark.parametrize("change,error,match", [
    (lambda a: {3: a[3].long()}, TypeError, "cu_seqlens_q must be an int32"),
    (lambda a: {4: a[4].float()}, TypeError, "cu_seqlens_k must be an int32"),
    (lambda a: {3: a[3].view(1, 3)}, ValueError, "cu_seqlens_q must have shape"),
    (lambda a: {4: a[4][:2]}, ValueError, "cu_seqlens_k must have shape"),
    (lambda a: {3: torch.tensor([0, 0, 3, 5, 5], dtype=torch.int32, device=DEVICE)[::2]}, ValueError, "cu_seqlens_q must be contiguous"),
    pytest.param(lambda a: {3: torch.tensor([0, 4, 5], dtype=torch.int32, device=DEVICE)}, ValueError, "max_seqlen_q", marks=host_values_only),
    pytest.param(lambda a: {3: torch.tensor([0, 3, 4], dtype=torch.int32, device=DEVICE)}, ValueError, "cu_seqlens_q must start at 0 and end", marks=host_values_only),
    pytest.param(lambda a: {4: torch.tensor([0, 3, 2], dtype=torch.int32, device=DEVICE)}, ValueError, "cu_seqlens_k must", marks=host_values_only),
    (lambda a: {5: 0}, ValueError, "max_seqlen_q must be >= 1"),
    (lambda a: {6: 2.0}, TypeError, "max_seqlen_k must be an int"),
    (lambda a: {6: True}, TypeError, "max_seqlen_k must be an int"),
    (lambda a: {0: a[0].unsqueeze(0)}, ValueError, "query must have 3 dims"),
    (lambda a: {1: a[1].float()}, TypeError, "share a dtype"),
    (lambda a: {2: a[2][:4]}, ValueError, r"key \(5, 2, 8\) and value \(4, 2, 8\)"),
])
def test_invalid_arguments(change, error, match):
    args = list(_args())
    for i, value in change(args).items():
        args[i] = value
    with pytest.raises(error, match=match):
        ssa_flash.varlen_attention(*args, backend="triton", score="ssa", score_params=(1.0, 1.5))


@pytest.mark.parametrize("mode,causal,window", [("ssa_adaptive", False, (3, 1)), ("softmax", False, (3, 1)),
                                                ("ssa", True, (4, -1)), ("adaptive", True, (4, -1))])
def test_dropout_and_window_match_reference(mode, causal, window):
    """Dropout (p = 0.3) and a window together, float64: outputs, LSE and every gradient against the
    reference run sequence by sequence with the documented keep mask (sequence s: batch element s of
    ``ssa_flash.dropout_mask((batch, Hq, max_seqlen_q, max_seqlen_k), p)``), for the same seed."""
    q, k, v = packed_inputs(LENS_Q, LENS_K, q_scale=2.0, seed=5)
    b, n = head_params(4, dtype=torch.float64)
    g = torch.Generator().manual_seed(6)
    dout = torch.randn(q.shape[0], 4, 16, generator=g, dtype=torch.float64).to(DEVICE)
    dlse = torch.randn(4, q.shape[0], generator=g, dtype=torch.float64).to(DEVICE)
    kw = dict(is_causal=causal, enable_gqa=True, dropout_p=0.3, window_size=window)
    torch.manual_seed(11)
    ours = run_varlen(mode, q, k, v, b, n, LENS_Q, LENS_K, dout, dlse, "triton", **kw)
    torch.manual_seed(11)
    ref = run_varlen(mode, q, k, v, b, n, LENS_Q, LENS_K, dout, dlse, "reference", **kw)
    torch.manual_seed(11)
    keep = ssa_flash.dropout_mask((len(LENS_Q), 4, max(LENS_Q), max(LENS_K)), 0.3, device=DEVICE)
    ssa = "ssa" in mode
    explicit = reference.varlen_attention(
        q, k, v, cu(LENS_Q), cu(LENS_K), dropout_p=0.3, is_causal=causal, enable_gqa=True,
        score="ssa" if ssa else "softmax", score_params=(b, n) if ssa else None,
        adaptive_temperature="adaptive" in mode,
        window_size=window, dropout_mask=keep)
    assert 0.55 < keep.float().mean() < 0.85
    torch.testing.assert_close(ours[0], ref[0], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ours[0], explicit, atol=1e-10, rtol=1e-10)
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(ours[1]), finite)
    torch.testing.assert_close(ours[1][finite], ref[1][finite], atol=1e-10, rtol=1e-10)
    for name, grad in ours[2].items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, ref[2][name], atol=1e-9, rtol=1e-9, msg=f"d{name}")
    # the window and the dropout both change the result (ours equals the reference: compared with
    # the reference without them, which costs no interpreted kernel)
    plain = run_varlen(mode, q, k, v, b, n, LENS_Q, LENS_K, dout, dlse, "reference", is_causal=causal, enable_gqa=True)
    assert not torch.allclose(ours[0], plain[0])


def test_dropout_window_gradcheck_float64():
    """Jacobians of q, k, v, b, n (random projections) at a fixed seed with dropout and a window."""
    lens_q, lens_k = [3, 0, 2], [3, 1, 2]
    q, k, v = packed_inputs(lens_q, lens_k, Hq=2, Hkv=1, D=2, q_scale=2.0, seed=7)
    b, n = head_params(2, dtype=torch.float64)

    def f(q, k, v, b, n):
        torch.manual_seed(3)
        return ssa_flash.varlen_attention(q, k, v, cu(lens_q), cu(lens_k), 3, 3, enable_gqa=True, score="ssa",
                                          score_params=(b, n),
                                          dropout_p=0.4, window_size=(1, 0), backend="triton")

    assert torch.autograd.gradcheck(f, (q, k, v, b, n), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_dropout_and_window_validation():
    args = _args()
    with pytest.raises(ValueError, match="dropout_p"):
        ssa_flash.varlen_attention(*args, dropout_p=1.5, score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(ValueError, match="window_size"):
        ssa_flash.varlen_attention(*args, window_size=(-2, 0), score="ssa", score_params=(1.0, 1.5))
    with pytest.raises(TypeError, match="window_size"):
        ssa_flash.varlen_attention(*args, window_size=4, score="ssa", score_params=(1.0, 1.5))
    torch.manual_seed(0)  # p = 1: every weight dropped, zeros (finite)
    out = ssa_flash.varlen_attention(*args, dropout_p=1.0, backend="triton", score="ssa", score_params=(1.0, 1.5))
    assert torch.equal(out, torch.zeros_like(out))


def test_cuda_backend_refuses_packed_batches():
    with pytest.raises(BackendUnavailableError, match="packed|cuda"):
        ssa_flash.varlen_attention(*_args(), backend="cuda", score="ssa", score_params=(1.0, 1.5))


# --------------------------------------------------------------------------------------------
# The op layer


def _op_args(backend="triton"):
    q, k, v = packed_inputs([3, 0, 2], [2, 1, 2], Hq=4, Hkv=2, D=8)
    b, n = head_params(4, dtype=torch.float64)
    spec = AttentionSpec(scale=0.3, score="ssa", causal=True, group=2, adaptive=True, cu_seqlens_q=cu([3, 0, 2]),
                         cu_seqlens_k=cu([2, 1, 2]), max_seqlen_q=3, max_seqlen_k=2)
    return (q, k, v, [b, n], None, None, backend, *spec.op_args())


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_opcheck_packed_forward(backend):
    """Schema with the Tensor? cu_seqlens fields, fake shapes (H, total_q), autograd (the cu_seqlens
    saved for the backward), AOT dispatch."""
    torch.library.opcheck(torch.ops.ssa_flash.attn_fwd.default, _op_args(backend))


def test_fake_shapes_packed():
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = AttentionSpec(scale=0.3, group=2, adaptive=True, cu_seqlens_q=cu([3, 2]), cu_seqlens_k=cu([3, 2]),
                         max_seqlen_q=3, max_seqlen_k=3)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(5, 4, 8)
        k = torch.empty(7, 2, 8)
        v = torch.empty(7, 2, 3)
        out, lse, beta, *_ = torch.ops.ssa_flash.attn_fwd(q, k, v, [], None, None, "triton", *spec.op_args())
        assert out.shape == (5, 4, 3) and lse.shape == beta.shape == (4, 5)
        ent, lse_l = torch.ops.ssa_flash.row_entropy(q, k, [], None, None, "triton", *spec.op_args())
        assert ent.shape == (4, 5)


def test_torch_compile_fullgraph():
    """One graph through the packed path (the cu_seqlens are Tensor? op arguments), forward and
    backward equal to eager."""
    lens = [3, 0, 5]
    q, k, v = packed_inputs(lens, lens, Hq=2, Hkv=2, D=8)
    b, n = head_params(2, dtype=torch.float64)

    def f(q, k, v, b, n):
        return ssa_flash.varlen_attention(q, k, v, cu(lens), cu(lens), 5, 5, is_causal=True, score="ssa",
                                          score_params=(b, n),
                                          backend="triton")

    eager = f(q, k, v, b, n)
    g_eager = torch.autograd.grad(eager.sum(), (q, k, v, b, n))
    compiled = torch.compile(f, fullgraph=True)(q, k, v, b, n)
    g_comp = torch.autograd.grad(compiled.sum(), (q, k, v, b, n))
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    for a, c in zip(g_comp, g_eager):
        torch.testing.assert_close(a, c, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_huge_max_seqlen_is_lowered_to_the_rows(backend):
    """max_seqlen_q=10**12 failed 17 frames deep (int32 kernel arguments; a 10**24-element mask
    on the reference path with dropout) without naming max_seqlen_q. No sequence is longer than
    all the rows, so the bound is lowered to them: the result is that of the exact bound."""
    lens = [3, 2]
    q, k, v = packed_inputs(lens, lens, Hq=2, Hkv=2, D=8)
    kw = dict(is_causal=True, return_lse=True, backend=backend, dropout_p=0.25)
    torch.manual_seed(5)
    want = ssa_flash.varlen_attention(q, k, v, cu(lens), cu(lens), 3, 3, **kw)
    torch.manual_seed(5)
    got = ssa_flash.varlen_attention(q, k, v, cu(lens), cu(lens), 10**12, 10**12, **kw)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
