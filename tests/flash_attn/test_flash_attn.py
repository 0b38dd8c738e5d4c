"""ssa_flash.flash_attn, FlashAttention-2's calling convention: against ssa_flash's own functions
on the transposed layout with FlashAttention's bottom-right mask written out from its documented
rule, against SDPA for softmax, through the Triton kernels at small sizes, and its refusals."""
import pytest
import torch
import torch.nn.functional as F

import ssa_flash
from ssa_flash.flash_attn import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

from attn_testing import DEVICE, needs_kernels

SSA = dict(score="ssa", score_params={"b": 0.8, "n": 1.7})


def fa_mask(lq, lk, causal=False, window=(-1, -1)):
    """FlashAttention-2's rule as its docstring states it: query i sees keys
    [i + lk - lq - left, i + lk - lq + right] (-1: unbounded), with the window normalised as its
    C++ entry points and parameter setup do: a side >= lk is -1, causal sets right = 0, one side
    bounded alone bounds the other at lk."""
    left, right = (-1 if x >= lk else x for x in window)
    if causal:
        right = 0
    if left < 0 <= right:
        left = lk
    elif right < 0 <= left:
        right = lk
    pos = torch.arange(lq)[:, None] + lk - lq
    j = torch.arange(lk)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= pos - left
    if right >= 0:
        keep &= j <= pos + right
    return keep


def blhd(B=2, Lq=5, Lk=7, Hq=4, Hkv=2, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Lq, Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Lk, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Lk, Hkv, D, generator=g, dtype=torch.float64)
    return tuple(t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v))


def grads(out, inputs, seed=5):
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype).to(out.device)
    return torch.autograd.grad((out * dout).sum(), inputs)


def ours_with_mask(q, k, v, mask, **kw):
    """ssa_flash.attention on the (B, H, L, D) layout with an explicit mask: the specification;
    returns ``(out (B, L, H, D), lse (B, H, L))``."""
    out, lse = ssa_flash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask.to(q.device),
                                   enable_gqa=True, backend="reference", return_lse=True, **kw)
    return out.transpose(1, 2), lse


SIZES = [(5, 5), (3, 9), (9, 3), (1, 7), (7, 1)]
WINDOWS = [(-1, -1), (2, -1), (-1, 1), (2, 1), (0, 0), (1, 3), (12, 12)]


@pytest.mark.parametrize("lq,lk", SIZES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_bottom_right_alignment_matches_the_mask(lq, lk, causal, window):
    """Outputs, LSE and gradients of softmax and SSA against ssa_flash.attention with
    FlashAttention's mask (rows with no key: 0 on both sides)."""
    q, k, v = blhd(Lq=lq, Lk=lk)
    mask = fa_mask(lq, lk, causal, window)
    for variant in ({}, SSA):
        out, lse, probs = flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True,
                                          backend="reference", **variant)
        ref, ref_lse = ours_with_mask(q, k, v, mask, **variant)
        assert probs is None and out.is_contiguous() and out.shape == (2, lq, 4, 8) and lse.shape == (2, 4, lq)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        torch.testing.assert_close(torch.nan_to_num(lse, neginf=0), torch.nan_to_num(ref_lse, neginf=0))
        for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_matches_sdpa_for_softmax():
    """Softmax, no GQA: SDPA with is_causal (Lq == Lk) and with FlashAttention's bottom-right mask
    (Lq < Lk, every row sees a key), dropout off, a given softmax_scale and softcap off."""
    for lq, lk, causal, window in [(6, 6, True, (-1, -1)), (4, 9, True, (-1, -1)), (4, 9, False, (3, 2)),
                                   (6, 6, False, (-1, -1))]:
        q, k, v = blhd(Lq=lq, Lk=lk, Hkv=4)
        out = flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal, window_size=window, backend="reference")
        mask = fa_mask(lq, lk, causal, window)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=0.3).transpose(1, 2)
        torch.testing.assert_close(out, ref)


def test_score_functions_by_keyword():
    """score / score_params / adaptive_temperature reach ssa_flash's functions: SSA equals
    ssa_attention on the transposed layout (Lq == Lk: both alignments agree), per-head tensor
    parameters receive gradients, the logit scale and the adaptive temperature run."""
    q, k, v = blhd(Lq=6, Lk=6)
    b = torch.full((4,), 0.8, dtype=torch.float64, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=True, score="ssa", score_params=(b, 1.7), backend="reference")
    ref = ssa_flash.ssa_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                  enable_gqa=True, b=0.8, n=1.7, backend="reference").transpose(1, 2)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert b.grad is not None and torch.isfinite(b.grad).all()
    for kw in (dict(score="logit_scale", score_params={"s": 2.0}), dict(adaptive_temperature=True)):
        out = flash_attn_func(q, k, v, causal=True, backend="reference", **kw)
        ref = ssa_flash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                  enable_gqa=True, backend="reference",
                                  score=kw.get("score", "softmax"), score_params=kw.get("score_params"),
                                  adaptive_temperature=kw.get("adaptive_temperature", False)).transpose(1, 2)
        torch.testing.assert_close(out, ref)


def test_packed_forms_are_views_of_the_unpacked():
    q, k, v = blhd(Lq=6, Lk=6, Hkv=4)
    qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_()
    out = flash_attn_qkvpacked_func(qkv, causal=True, backend="reference", **SSA)
    ref = flash_attn_func(*qkv.unbind(2), causal=True, backend="reference", **SSA)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(flash_attn_kvpacked_func(q, kv, window_size=(2, 1), backend="reference"),
                               flash_attn_func(q, k, v, window_size=(2, 1), backend="reference"))


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def packed(lens_q, lens_k, Hq=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), Hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), Hkv, D, generator=g, dtype=torch.float64)
    return tuple(t.to(DEVICE).requires_grad_() for t in (q, k, v))


def per_sequence(q, k, v, lens_q, lens_k, **kw):
    """flash_attn_func on each sequence in turn (its own bottom-right alignment), packed back."""
    outs, lses, cq, ck = [], [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        out, lse, _ = flash_attn_func(q[None, cq:cq + lq], k[None, ck:ck + lk], v[None, ck:ck + lk],
                                      return_attn_probs=True, backend="reference", **kw)
        outs.append(out[0])
        lses.append(lse[0])
        cq, ck = cq + lq, ck + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("lens_q,lens_k,causal,window", [
    ([3, 0, 5, 2], [5, 2, 5, 1], True, (-1, -1)),      # Lq_s < Lk_s, = and > (a row sees nothing)
    ([3, 4, 2], [6, 4, 9], False, (2, 1)),             # a window, every Lq_s <= Lk_s
    ([3, 4, 2], [6, 4, 9], True, (1, -1)),
    ([4, 4], [4, 4], True, (-1, -1)),                   # equal offsets in two tensors
])
def test_varlen_bottom_right_per_sequence(lens_q, lens_k, causal, window):
    """The re-packed path (offsets that differ) against flash_attn_func per sequence: outputs,
    LSE, gradients; softmax and SSA."""
    q, k, v = packed(lens_q, lens_k)
    for variant in ({}, SSA):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k),
                                             causal=causal, window_size=window, return_attn_probs=True,
                                             backend="reference", **variant)
        ref, ref_lse = per_sequence(q, k, v, lens_q, lens_k, causal=causal, window_size=window, **variant)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
        for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_varlen_packed_forms_and_refusal():
    lens = [3, 5]
    q, k, v = packed(lens, lens, Hkv=4)
    offsets = cu(lens)
    qkv = torch.stack([q, k, v], dim=1)
    ref = flash_attn_varlen_func(q, k, v, offsets, offsets, 5, 5, causal=True, backend="reference")
    torch.testing.assert_close(flash_attn_varlen_qkvpacked_func(qkv, offsets, 5, causal=True, backend="reference"), ref)
    torch.testing.assert_close(flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], dim=1), offsets, offsets, 5, 5,
                                                               causal=True, backend="reference"), ref)
    q, k, v = packed([4, 2], [2, 2])
    with pytest.raises(NotImplementedError, match="more queries than keys"):
        flash_attn_varlen_func(q, k, v, cu([4, 2]), cu([2, 2]), 4, 2, window_size=(1, 1), backend="reference")


def test_kvcache_is_bottom_right_and_writes_the_cache():
    """flash_attn_with_kvcache against flash_attn_func on each batch element's valid rows; new
    rows are written into the caller's (B, L, H, D) caches in place."""
    g = torch.Generator().manual_seed(0)
    B, Lc, Hq, Hkv, D, Lq = 3, 12, 4, 2, 8, 2
    k_cache = torch.randn(B, Lc, Hkv, D, generator=g, dtype=torch.float64).to(DEVICE)
    v_cache = torch.randn(B, Lc, Hkv, D, generator=g, dtype=torch.float64).to(DEVICE)
    q = torch.randn(B, Lq, Hq, D, generator=g, dtype=torch.float64).to(DEVICE)
    k_new = torch.randn(B, Lq, Hkv, D, generator=g, dtype=torch.float64).to(DEVICE)
    v_new = torch.randn(B, Lq, Hkv, D, generator=g, dtype=torch.float64).to(DEVICE)
    seqlens = torch.tensor([3, 0, 7], dtype=torch.int32, device=DEVICE)
    for variant in ({}, SSA):
        kc, vc = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, causal=True,
                                           window_size=(4, 0), return_softmax_lse=True, backend="reference",
                                           **variant)
        assert out.shape == (B, Lq, Hq, D) and lse.shape == (B, Hq, Lq)
        for b, n in enumerate(seqlens.tolist()):
            assert torch.equal(kc[b, n:n + Lq], k_new[b]) and torch.equal(vc[b, n:n + Lq], v_new[b])
            ref = flash_attn_func(q[b:b + 1], kc[b:b + 1, :n + Lq], vc[b:b + 1, :n + Lq], causal=True,
                                  window_size=(4, 0), backend="reference", **variant)
            torch.testing.assert_close(out[b:b + 1], ref)
    full = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, backend="reference")
    torch.testing.assert_close(full, flash_attn_func(q, k_cache, v_cache, backend="reference"))
    torch.testing.assert_close(flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=Lc, backend="reference"),
                               full)


def test_refusals_name_the_argument():
    q, k, v = blhd()
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_func(q, k, v, alibi_slopes=torch.ones(4))
    lens = [5, 5]
    with pytest.raises(NotImplementedError, match="block_table"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu(lens[:1]), cu([7]), 5, 7, block_table=torch.zeros(1, 1))
    for name in ("rotary_cos", "cache_batch_idx", "block_table", "alibi_slopes"):
        with pytest.raises(NotImplementedError, match=name):
            flash_attn_with_kvcache(q, k, v, cache_seqlens=2, **{name: torch.zeros(2)})
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k.detach(), v.detach(), k[:, :1].detach(), v[:, :1].detach())
    with pytest.raises(ValueError, match=r"q must have shape \(batch, seqlen, nheads, headdim\)"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, k, v, window_size=(-2, 0))


@needs_kernels
@pytest.mark.parametrize("lq,lk,causal,window", [(5, 21, True, (3, -1)), (21, 5, True, (-1, -1)),
                                                 (17, 17, False, (4, 2))])
def test_triton_kernels(lq, lk, causal, window):
    """The Triton kernels (the interpreter on a CPU) give what the reference gives, forward and
    backward, on the sliced views."""
    q, k, v = blhd(B=1, Lq=lq, Lk=lk, D=16, dtype=torch.float32)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, backend="triton", **SSA)
    ref = flash_attn_func(q, k, v, causal=causal, window_size=window, backend="reference", **SSA)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@needs_kernels
def test_triton_varlen_repacked():
    lens_q, lens_k = [3, 6, 1], [5, 6, 4]
    q, k, v = (t.detach().float().requires_grad_() for t in packed(lens_q, lens_k, D=16))
    out = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), 6, 6, causal=True, backend="triton")
    ref = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), 6, 6, causal=True, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@needs_kernels
@pytest.mark.slow
def test_torch_compile_fullgraph():
    """The slices, the zero rows and the varlen re-packing trace without a graph break."""
    q, k, v = blhd(B=1, Lq=9, Lk=5, D=16, dtype=torch.float32)
    dense = lambda q, k, v: flash_attn_func(q, k, v, causal=True, backend="triton", **SSA)  # noqa: E731
    torch.testing.assert_close(torch.compile(dense, fullgraph=True, backend="aot_eager")(q, k, v), dense(q, k, v))
    q, k, v = (t.detach().float() for t in packed([0, 3, 5], [2, 5, 4], D=16))
    offsets_q, offsets_k = cu([0, 3, 5]), cu([2, 5, 4])
    varlen = lambda q, k, v: flash_attn_varlen_func(q, k, v, offsets_q, offsets_k, 5, 5, causal=True,  # noqa: E731
                                                    backend="triton")
    torch.testing.assert_close(torch.compile(varlen, fullgraph=True, backend="aot_eager")(q, k, v), varlen(q, k, v))
