"""SDPA's shapes (ssa_flash._shapes): any number of leading batch dims, 2-D and 3-D inputs, batch and
head dims broadcast between query and key/value, masks broadcast accordingly; against SDPA
(outputs and gradients), against ssa_flash's own 4-D calls for the other variants, and the views
(no copy) where the strides allow them."""
import pytest
import torch
import torch.nn.functional as F

import ssa_flash
from ssa_flash import _shapes, ops

from attn_testing import DEVICE, needs_kernels


def rand(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE).requires_grad_()


# (query shape, key shape, value shape, mask shape or None, kwargs)
CASES = [
    ((5, 8), (7, 8), (7, 6), None, {}),                                    # 2-D
    ((4, 5, 8), (4, 7, 8), (4, 7, 8), (5, 7), {"is_causal": False}),       # 3-D (N, L, E), a 2-D mask
    ((4, 5, 8), (1, 7, 8), (1, 7, 8), None, {"is_causal": True}),          # 3-D, broadcast leading dim
    ((2, 3, 4, 5, 8), (2, 3, 4, 7, 8), (2, 3, 4, 7, 8), None, {}),         # 5-D
    ((2, 3, 4, 5, 8), (1, 3, 4, 7, 8), (1, 3, 4, 7, 8), (3, 1, 5, 7), {}),  # batch broadcast, mask broadcast
    ((1, 3, 4, 5, 8), (2, 1, 4, 7, 8), (2, 1, 4, 7, 8), None, {}),         # both sides broadcast
    ((2, 2, 2, 4, 5, 8), (1, 1, 1, 4, 7, 8), (1, 1, 1, 4, 7, 8), (2, 1, 1, 1, 1, 7), {}),  # 6-D
    ((5, 8), (2, 4, 7, 8), (2, 4, 7, 8), None, {}),                       # a 2-D query against 4-D keys
    ((2, 1, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), None, {}),                 # one query head, broadcast
    ((2, 4, 5, 8), (2, 1, 7, 8), (2, 1, 7, 8), None, {"is_causal": True}),  # one key head, no enable_gqa
    ((1, 4, 5, 8), (3, 4, 7, 8), (3, 4, 7, 8), None, {}),                 # 4-D, query batch broadcast
    ((2, 3, 4, 5, 8), (2, 3, 2, 7, 8), (2, 3, 2, 7, 8), None, {"enable_gqa": True}),  # 5-D GQA
]


@pytest.mark.parametrize("qs,ks,vs,ms,kw", CASES)
def test_matches_sdpa(qs, ks, vs, ms, kw):
    q, k, v = rand(*qs), rand(*ks, seed=1), rand(*vs, seed=2)
    mask = None if ms is None else torch.rand(*ms, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.2
    if mask is not None:
        mask[..., 0] = True  # every row keeps a key (SDPA gives NaN where none is left)
    ours = ssa_flash.softmax_attention(q, k, v, attn_mask=mask, backend="reference", **kw)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=ref.dtype).to(DEVICE)
    for a, b in zip(torch.autograd.grad((ours * dout).sum(), (q, k, v)),
                    torch.autograd.grad((ref * dout).sum(), (q, k, v))):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b)


def test_float_mask_and_every_variant_equal_the_flattened_call():
    """5-D inputs with a broadcast float mask, for every public function, equal the 4-D call on
    the flattened tensors (outputs and lse, viewed back to (N1, N2, H, Lq))."""
    q, k, v = rand(2, 3, 4, 5, 8), rand(2, 3, 4, 7, 8, seed=1), rand(2, 3, 4, 7, 8, seed=2)
    mask = torch.randn(3, 1, 5, 7, dtype=torch.float64, device=DEVICE)
    flat = [x.reshape(6, *x.shape[2:]) for x in (q, k, v)]
    flat_mask = mask.expand(2, 3, 4, 5, 7).reshape(6, 4, 5, 7)
    b = torch.full((4,), 0.7, dtype=torch.float64, device=DEVICE)
    for fn, kw in ((ssa_flash.ssa_attention, dict(b=b, n=1.7)), (ssa_flash.adaptive_temperature_attention, {}),
                   (ssa_flash.attention, dict(score="logit_scale", score_params={"s": 1.5})),
                   (ssa_flash.softmax_attention, dict(window_size=(2, 1), sinks=0.3))):
        out, lse = fn(q, k, v, attn_mask=mask, return_lse=True, backend="reference", **kw)
        ref, ref_lse = fn(*flat, attn_mask=flat_mask, return_lse=True, backend="reference", **kw)
        torch.testing.assert_close(out, ref.view(2, 3, 4, 5, 8))
        torch.testing.assert_close(lse, ref_lse.view(2, 3, 4, 5))
    ent = ssa_flash.attention_entropy(q, k, attn_mask=mask,
                                      score="ssa", score_params={"b": 0.7, "n": 1.7}, backend="reference")
    torch.testing.assert_close(ent, ssa_flash.attention_entropy(*flat[:2], attn_mask=flat_mask,
                                                                score="ssa", score_params={"b": 0.7, "n": 1.7},
                                                                backend="reference").view(2, 3, 4, 5))
    assert ssa_flash.attention_entropy(q[0, 0, 0], k[0, 0, 0], backend="reference").shape == (5,)


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_views_not_copies():
    """Leading dims merged, broadcast keys, one query head broadcast, a (B, L, H, D) input
    transposed, keys broadcast over the leading batch dim only (its trailing batch dim merged
    into the heads): views of the caller's tensors. Where no split of the batch dims gives views
    (that last case with the transposed query), the keys are copied (documented)."""
    base = torch.randn(2, 3, 5, 4, 8, device=DEVICE)         # (N1, N2, L, H, D)
    q = base.transpose(-3, -2)                               # (N1, N2, H, L, D), not contiguous
    k = torch.randn(1, 1, 4, 7, 8, device=DEVICE)
    q4, k4, v4, _, gqa, heads, repeat, _ = _shapes.to_bhld(q, k, k, None, False)
    assert q4.shape == (6, 4, 5, 8) and k4.shape == (6, 4, 7, 8) and not gqa and (heads, repeat) == (4, 1)
    assert _same_storage(q4, base) and _same_storage(k4, k) and k4.stride(0) == 0
    q1 = torch.randn(2, 1, 5, 8, device=DEVICE)
    q4, *_ = _shapes.to_bhld(q1, k[0].expand(2, 4, 7, 8), k[0].expand(2, 4, 7, 8), None, False)
    assert _same_storage(q4, q1) and q4.stride(1) == 0 and q4.shape == (2, 4, 5, 8)
    k_mixed = torch.randn(1, 3, 4, 7, 8, device=DEVICE)
    q_contiguous = q.contiguous()
    q4, k4, _, _, _, heads, repeat, _ = _shapes.to_bhld(q_contiguous, k_mixed, k_mixed, None, False)
    assert q4.shape == (2, 12, 5, 8) and k4.shape == (2, 12, 7, 8) and (heads, repeat) == (4, 3)
    assert _same_storage(q4, q_contiguous) and _same_storage(k4, k_mixed) and k4.stride(0) == 0
    _, k4, *_ = _shapes.to_bhld(q, k_mixed, k_mixed, None, False)
    assert k4.shape == (6, 4, 7, 8) and not _same_storage(k4, k_mixed)


def test_batch_dims_merged_into_heads_tile_the_parameters():
    """Keys broadcast over the leading batch dim only: per-head b, n, sinks tensors and a float
    mask with its own heads, against the call on copies flattened to (N1 N2, H, L, D); outputs,
    lse and the gradients of q, k, v, b, sinks."""
    q, k, v = rand(2, 3, 4, 5, 8), rand(1, 3, 4, 7, 8, seed=1), rand(1, 3, 4, 7, 8, seed=2)
    mask = torch.randn(1, 3, 4, 5, 7, dtype=torch.float64, device=DEVICE)
    b = torch.tensor([0.5, 0.8, 1.1, 1.4], dtype=torch.float64, device=DEVICE, requires_grad=True)
    sinks = torch.tensor([0.1, -0.3, 0.2, 0.0], dtype=torch.float64, device=DEVICE, requires_grad=True)
    kw = dict(n=1.6, is_causal=True, return_lse=True, backend="reference")
    out, lse = ssa_flash.ssa_attention(q, k, v, attn_mask=mask, b=b, sinks=sinks, **kw)
    flat = [x.expand(2, 3, 4, *x.shape[-2:]).reshape(6, 4, *x.shape[-2:]) for x in (q, k, v)]
    b2, sinks2 = b.detach().requires_grad_(), sinks.detach().requires_grad_()
    ref, ref_lse = ssa_flash.ssa_attention(*flat, attn_mask=mask.expand(2, 3, 4, 5, 7).reshape(6, 4, 5, 7),
                                           b=b2, sinks=sinks2, **kw)
    torch.testing.assert_close(out, ref.view(2, 3, 4, 5, 8))
    torch.testing.assert_close(lse, ref_lse.view(2, 3, 4, 5))
    ours = torch.autograd.grad(out.square().sum(), (q, k, v, b, sinks))
    theirs = torch.autograd.grad(ref.square().sum(), (q, k, v, b2, sinks2))
    for a, r in zip(ours, theirs):
        torch.testing.assert_close(a, r)
    ent = ssa_flash.attention_entropy(q, k, attn_mask=mask,
                                      score="ssa", score_params={"b": b.detach(), "n": 1.6}, backend="reference")
    torch.testing.assert_close(ent, ssa_flash.attention_entropy(
        *flat[:2], attn_mask=mask.expand(2, 3, 4, 5, 7).reshape(6, 4, 5, 7), score="ssa",
        score_params={"b": b.detach(), "n": 1.6}, backend="reference").view(2, 3, 4, 5))


def test_planned_4d_calls_do_not_reach_the_shapes(monkeypatch):
    """A plain 4-D call never enters ssa_flash._shapes (nor _nested)."""
    def refuse(*a, **k):
        raise AssertionError("a plain 4-D call reached the shape normalisation")

    monkeypatch.setattr(_shapes, "attention", refuse)
    q, k, v = rand(1, 2, 5, 8), rand(1, 2, 7, 8, seed=1), rand(1, 2, 7, 8, seed=2)
    ssa_flash.ssa_attention(q, k, v, backend="reference")
    ssa_flash.ssa_attention(q, k[:, :1], v[:, :1], enable_gqa=True, backend="reference")
    with pytest.raises(AssertionError, match="shape normalisation"):
        ssa_flash.ssa_attention(q[0], k[0], v[0], backend="reference")
    assert ops._shapes is _shapes


def test_errors_name_the_argument():
    q, k = rand(2, 4, 5, 8), rand(3, 4, 7, 8)
    with pytest.raises(ValueError, match="batch dims of query, key, value do not broadcast"):
        ssa_flash.ssa_attention(q, k, k)
    with pytest.raises(ValueError, match="attn_mask .* does not broadcast"):
        ssa_flash.ssa_attention(q[None], q[None], q[None], attn_mask=torch.ones(3, 1, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask .* more dims"):
        ssa_flash.ssa_attention(q[0], q[0], q[0], attn_mask=torch.ones(1, 1, 4, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="key must have at least 2 dims"):
        ssa_flash.softmax_attention(q, k[0, 0, 0], k)


@needs_kernels
@pytest.mark.parametrize("qs,ks", [((2, 3, 2, 9, 16), (1, 3, 2, 11, 16)),   # zero-stride key batch
                                   ((1, 2, 9, 16), (3, 2, 11, 16)),         # zero-stride query batch
                                   ((2, 1, 9, 16), (2, 2, 11, 16))])        # zero-stride query heads
def test_triton_kernels_on_broadcast_views(qs, ks):
    """The Triton kernels take the zero-stride views of broadcast inputs, forward and backward,
    against the reference."""
    q, k, v = (rand(*qs, dtype=torch.float32), rand(*ks, seed=1, dtype=torch.float32),
               rand(*ks, seed=2, dtype=torch.float32))
    outs = [ssa_flash.ssa_attention(q, k, v, is_causal=True, b=0.8, n=1.6, backend=be) for be in ("triton", "reference")]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_torch_compile_fullgraph():
    """The normalisation traces without a graph break (strides read, never a view tried)."""
    fn = lambda q, k: ssa_flash.ssa_attention(q, k, k, is_causal=True, backend="reference")  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for qs, ks in (((2, 3, 4, 5, 8), (1, 3, 4, 7, 8)), ((5, 8), (7, 8))):
        q, k = rand(*qs), rand(*ks, seed=1)
        torch.testing.assert_close(compiled(q, k), fn(q, k))
