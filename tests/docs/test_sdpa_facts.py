"""What docs/api.md ("Fully masked rows: SDPA and us") and docs/reliability.md say about SDPA
itself, checked against the installed torch on the CPU instead of remembered: its math backend
and its CPU flash kernel (the one the default picks on the CPU), forward and gradients.

A row that can attend to nothing (a boolean mask all False, or -inf throughout) gives 0 and a zero
query gradient; a row masked with ``torch.finfo(dtype).min`` is no masked row for SDPA (a softmax
over equal logits: the mean of V); a NaN key reaches every row of its head on the math backend,
even where the mask or the causal diagonal excludes it. The CUDA backends are not checked here
(docs/api.md says what is documented for them)."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, LQ, LK, D = 1, 2, 4, 5, 8
BACKENDS = {"default": None, "math": SDPBackend.MATH, "cpu_flash": SDPBackend.FLASH_ATTENTION}
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def _sdpa(backend, *args, **kwargs):
    with sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] is not None else contextlib.nullcontext():
        return F.scaled_dot_product_attention(*args, **kwargs)


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
            for n in (LQ, LK, LK)]


def _row1_masked(kind, dtype):
    """A mask whose query row 1 admits no key (kind "bool", "-inf") or every key at finfo.min."""
    if kind == "bool":
        m = torch.ones(LQ, LK, dtype=torch.bool)
        m[1] = False
        return m
    m = torch.zeros(LQ, LK, dtype=dtype)
    m[1] = float("-inf") if kind == "-inf" else torch.finfo(dtype).min
    return m


def test_the_default_cpu_path_is_the_flash_kernel():
    q, k, v = _inputs(torch.float32)
    choice = torch._fused_sdp_choice(q, k, v, _row1_masked("bool", torch.float32), 0.0, False)
    assert SDPBackend(choice) == SDPBackend.FLASH_ATTENTION


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_a_row_that_attends_to_nothing_gives_zero(kind, dtype, backend):
    q, k, v = _inputs(dtype)
    out = _sdpa(backend, q, k, v, attn_mask=_row1_masked(kind, dtype))
    out.sum().backward()
    assert torch.all(out[:, :, 1] == 0) and torch.all(q.grad[:, :, 1] == 0)
    assert out.isfinite().all() and all(t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_at_finfo_min_is_the_mean_of_v(dtype, backend):
    """finfo.min is finite: the row's logits + finfo.min round to one value (float32, float64,
    bfloat16), so the weights are uniform. (float16: finfo.min's spacing is 32, the logits are
    rounded to it and the weights are not uniform; not asserted.)"""
    q, k, v = _inputs(dtype)
    out = _sdpa(backend, q, k, v, attn_mask=_row1_masked("finfo.min", dtype))
    out.sum().backward()
    mean = v.detach().double().mean(dim=-2)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out[:, :, 1].double(), mean, atol=tol, rtol=0)
    assert all(t.grad.isfinite().all() for t in (q, k, v))


def test_math_backend_propagates_a_nan_key_past_the_mask():
    """A NaN in key 4 of head 0: every row of head 0 is NaN on the math backend, with key 4 masked
    out by a boolean or -inf mask, or beyond every row's causal diagonal (LQ < LK); head 1 stays
    finite. A NaN query poisons its own row only."""
    q, k, v = (t.detach() for t in _inputs(torch.float32))
    k[0, 0, LK - 1, 0] = float("nan")
    bool_mask = torch.ones(LQ, LK, dtype=torch.bool)
    bool_mask[:, LK - 1] = False
    inf_mask = torch.zeros(LQ, LK).masked_fill(~bool_mask, float("-inf"))
    for kwargs in ({}, {"attn_mask": bool_mask}, {"attn_mask": inf_mask}, {"is_causal": True}):
        out = _sdpa("math", q, k, v, **kwargs)
        assert out[0, 0].isnan().all() and out[0, 1].isfinite().all(), kwargs
    q2, k2 = q.clone(), k.clone()
    k2[0, 0, LK - 1, 0] = 0.0
    q2[0, 0, 1, 0] = float("nan")
    out = _sdpa("math", q2, k2, v)
    assert out[0, 0, 1].isnan().all() and out[0, 0, [0, 2, 3]].isfinite().all() and out[0, 1].isfinite().all()


def test_cpu_flash_skips_keys_beyond_the_causal_diagonal():
    """The CPU flash kernel never reads a key block beyond the causal diagonal (a NaN there does not
    propagate), but a NaN key that a mask excludes still reaches every row."""
    q, k, v = (t.detach() for t in _inputs(torch.float32))
    k[0, 0, LK - 1, 0] = float("nan")
    assert _sdpa("cpu_flash", q, k, v, is_causal=True).isfinite().all()
    bool_mask = torch.ones(LQ, LK, dtype=torch.bool)
    bool_mask[:, LK - 1] = False
    assert _sdpa("cpu_flash", q, k, v, attn_mask=bool_mask)[0, 0].isnan().all()
