"""Jagged nested tensors (ssa_flash._nested) in the dense functions: against SDPA's own nested
path on the CPU, against the dense functions on each sequence for every variant (causal, cross
attention, GQA), gradients to the nested inputs, the Triton kernels, torch.compile(fullgraph=True)
and the refusals."""
import pytest
import torch
import torch.nn.functional as F

import ssa_flash

from attn_testing import DEVICE, needs_kernels

LENS_Q = [3, 5, 1, 4]
LENS_K = [4, 2, 6, 4]

VARIANTS = [
    ("softmax", ssa_flash.softmax_attention, {}),
    ("ssa", ssa_flash.ssa_attention, {"b": 0.8, "n": 1.6}),
    ("adaptive", ssa_flash.adaptive_temperature_attention, {}),
    ("ssa_adaptive", ssa_flash.ssa_attention, {"b": 0.8, "n": 1.6, "adaptive_temperature": True}),
    ("logit_scale", ssa_flash.attention, {"score": "logit_scale", "score_params": {"s": 1.3}}),
]


def sequences(lens, H, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=g, dtype=dtype).to(DEVICE) for n in lens]


def nested(seqs):
    """(B, H, j, D) from (L_s, H, D) sequences, as a transformers / torchtune user builds it."""
    leaf = torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=True)
    return leaf, leaf.transpose(1, 2)


def test_matches_sdpa_nested():
    """Self-attention, non-causal (what SDPA's nested path takes on the CPU): outputs and
    gradients with respect to the nested leaves."""
    leaf, q = nested(sequences(LENS_Q, 2, 8, 0))
    out = ssa_flash.softmax_attention(q, q, q, backend="reference")
    ref = F.scaled_dot_product_attention(q, q, q)
    assert out.is_nested and out.shape[:2] == (4, 2) and out.shape[2] == q.shape[2]
    torch.testing.assert_close(out.values(), ref.values())
    ours = torch.autograd.grad((out.values() ** 2).sum(), leaf)[0]
    theirs = torch.autograd.grad((ref.values() ** 2).sum(), leaf)[0]
    torch.testing.assert_close(ours.values(), theirs.values())


@pytest.mark.parametrize("name,fn,kw", VARIANTS, ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("causal", [False, True])
def test_every_variant_against_each_sequence(name, fn, kw, causal):
    """Cross attention with GQA (4 query heads, 2 key/value heads), keys of other lengths than
    the queries: output, lse and gradients against the dense function on each sequence."""
    qs, ks, vs = sequences(LENS_Q, 4, 8, 0), sequences(LENS_K, 2, 8, 1), sequences(LENS_K, 2, 8, 2)
    (ql, q), (kl, k), (vl, v) = nested(qs), nested(ks), nested(vs)
    out, lse = fn(q, k, v, is_causal=causal, enable_gqa=True, return_lse=True, backend="reference", **kw)
    assert lse.is_nested and lse.shape[:2] == (4, 4)
    loss = (out.values() ** 2).sum() + lse.values().sum()
    grads = torch.autograd.grad(loss, (ql, kl, vl))
    for s, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        dense = [x.detach().transpose(0, 1)[None].requires_grad_() for x in (qs[s], ks[s], vs[s])]
        ref, ref_lse = fn(*dense, is_causal=causal, enable_gqa=True, return_lse=True, backend="reference", **kw)
        torch.testing.assert_close(out.unbind()[s], ref[0])
        torch.testing.assert_close(lse.unbind()[s], ref_lse[0])
        ref_grads = torch.autograd.grad((ref ** 2).sum() + ref_lse.sum(), dense)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.unbind()[s], r[0].transpose(0, 1))


def test_options_reach_the_packed_call():
    """dropout, window, sinks, softcap, scale, deterministic: the nested call equals
    varlen_attention on the packed rows with the same seed."""
    qs, ks = sequences(LENS_Q, 2, 8, 0), sequences(LENS_K, 2, 8, 1)
    (_, q), (_, k) = nested(qs), nested(ks)
    kw = dict(dropout_p=0.3, is_causal=True, scale=0.4, window_size=(2, -1), sinks=0.5, softcap=3.0,
              deterministic=True, return_lse=True, backend="reference")
    torch.manual_seed(7)
    out, lse = ssa_flash.ssa_attention(q, k, k, b=0.8, n=1.6, **kw)
    cu_q = torch.tensor([0, 3, 8, 9, 13], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 6, 12, 16], dtype=torch.int32, device=DEVICE)
    torch.manual_seed(7)
    ref, ref_lse = ssa_flash.varlen_attention(torch.cat(qs), torch.cat(ks), torch.cat(ks), cu_q, cu_k, 5, 6,
                                              score="ssa", score_params=(0.8, 1.6), **kw)
    torch.testing.assert_close(out.values().transpose(0, 1), ref)
    torch.testing.assert_close(lse.values(), ref_lse)  # (Hq, total) both


def test_packed_rows_are_views():
    """The kernels get views of the nested buffers, and the output shares the query's ragged
    dim (so residual additions work)."""
    _, q = nested(sequences(LENS_Q, 2, 8, 0))
    rows = q.values().transpose(0, 1)
    assert rows.data_ptr() == q.values().data_ptr() and rows.shape == (sum(LENS_Q), 2, 8)
    out = ssa_flash.ssa_attention(q, q, q, backend="reference")
    assert (out + q).shape == q.shape


def test_refusals():
    _, q = nested(sequences(LENS_Q, 2, 8, 0))
    dense = torch.randn(4, 2, 5, 8, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="key must be a nested tensor"):
        ssa_flash.ssa_attention(q, dense, dense)
    with pytest.raises(ValueError, match="attn_mask is not supported with nested tensors"):
        ssa_flash.ssa_attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"ragged sequence dim third"):
        ssa_flash.ssa_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
    _, k = nested(sequences(LENS_K[:3], 2, 8, 1))
    with pytest.raises(ValueError, match="same batch size"):
        ssa_flash.ssa_attention(q, k, k)
    with pytest.raises(ValueError, match="attention_entropy does not take nested tensors"):
        ssa_flash.attention_entropy(q, q)


@needs_kernels
def test_triton_kernels_forward_backward():
    qs, ks = sequences(LENS_Q, 2, 16, 0, torch.float32), sequences(LENS_K, 2, 16, 1, torch.float32)
    results = []
    for backend in ("triton", "reference"):
        (ql, q), (kl, k) = nested(qs), nested(ks)
        out = ssa_flash.ssa_attention(q, k, k, is_causal=True, b=0.8, n=1.6, window_size=(2, -1), backend=backend)
        results.append((out.values(), *torch.autograd.grad((out.values() ** 2).sum(), (ql, kl))))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-5, rtol=2e-5)
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a.values(), b.values(), atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.slow
def test_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) (inductor) of a nested call through the Triton kernels:
    no graph break, the eager results forward and backward."""
    def f(q, k):
        return ssa_flash.ssa_attention(q, k, k, is_causal=True, b=0.8, n=1.6, backend="triton")

    qs, ks = sequences(LENS_Q, 2, 16, 0, torch.float32), sequences(LENS_K, 2, 16, 1, torch.float32)
    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        (ql, q), (kl, k) = nested(qs), nested(ks)
        out = fn(q, k)
        results.append((out.values(), *torch.autograd.grad((out.values() ** 2).sum(), (ql, kl))))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1:], results[1][1:]):
        torch.testing.assert_close(a.values(), b.values())
