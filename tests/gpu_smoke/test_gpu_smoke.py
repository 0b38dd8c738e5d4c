"""The GPU smoke tier: ``pytest -m gpu_smoke tests``.

A few tests that between them run every kernel family once, each at small odd shapes and with
several features at a time, against the reference with FlashAttention's rule (the error against
the float64 reference at most twice the error of the naive reference run in the same low
precision, plus a small floor: ``attn_testing.compare``):

* dense attention, the four variants (softmax, SSA, adaptive temperature, SSA + adaptive), forward
  and backward (gradients of q, k, v and of SSA's b, n; the LSE's gradient too), on both backends
  (Triton and the CUDA C++ extension), in two cases that together cover boolean and additive
  masks, rows with no admissible key, causality, GQA, dropout (against the reference given the
  kernels' own keep mask), local windows, head dims that are not a power of two, value head dim
  != query head dim, float16 and bfloat16;
* packed variable-length batches (Triton only: the CUDA backend has no packed layout), forward and
  backward, with empty sequences, GQA, causality, a window and dropout;
* decoding over a KV cache with split-KV (Triton only), new rows appended, left padding, causality
  and a window;
* the entropy diagnostic (``attention_entropy``) on both backends.

On one GPU the tier takes a few minutes, nearly all of it kernel compilation (a few dozen
specialisations; block-size autotuning is switched off here, so each launch compiles its first
configuration only): ``bench/run_gpu.sh`` runs it before the full suite, so that a short GPU
session learns first whether every kernel family compiles and computes the right thing.

Without a GPU the same tests run on the CPU: the Triton kernels through Triton's interpreter (in
float16 and float32: the interpreter's bfloat16 ``tl.dot`` is not exact), the CUDA kernels
through their CPU emulation (``tests/emulation.py``; float16 and bfloat16, head dims <= 32, which
is what the emulator is compiled for), at smaller shapes that still cross block boundaries (the
interpreter's tiles are 16 x 16): about a CPU-minute for the file, so the tier's own code is checked
by every CPU run before a GPU session depends on it.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import pytest
import torch

import ssa_flash
from ssa_flash import cuda as cuda_backend
from ssa_flash import reference

from attn_testing import (CUDA, DEVICE, FLOORS, check, compare, detached_copy, fa_tolerance_check,
                          head_params, make_qkv, needs_kernels)
from emulation import build_emulator

pytestmark = [pytest.mark.gpu_smoke, needs_kernels]

BF16_OK = CUDA and torch.cuda.get_device_capability()[0] >= 8


@pytest.fixture(scope="module", autouse=True)
def first_block_configuration():
    """One compile per specialisation: the launcher's first block configuration that fits, not a
    timed choice among all of them (each would be compiled). The configurations themselves are
    checked by the full suite."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSA_FLASH_AUTOTUNE", "0")
        yield


@pytest.fixture(scope="module")
def cuda_kernels(tmp_path_factory):
    """A context manager under which ``backend="cuda"`` runs on this device: the extension on a
    GPU (skipped with the backend's reason when it is neither built nor buildable), its CPU
    emulation otherwise (skipped without the CUDA headers)."""
    if CUDA:
        why = cuda_backend.unavailable_reason(torch.device("cuda"))  # "" when available
        if why:
            pytest.skip(f"CUDA backend unavailable: {why}")
        cuda_backend.load_extension()  # builds it if needed; a failed build is an error, not a skip
        return contextlib.nullcontext
    emulator = build_emulator(tmp_path_factory.mktemp("emu_smoke"))
    return lambda: cuda_backend.emulated(emulator)


def _dtype(gpu_dtype, cpu_dtype):
    if CUDA:
        if gpu_dtype == torch.bfloat16 and not BF16_OK:
            pytest.skip("bfloat16 needs sm_80")
        return gpu_dtype
    return cpu_dtype


# --------------------------------------------------------------------------------------------
# Dense attention: both backends, the four variants, forward and backward


class Case(NamedTuple):
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    left: int  # the window's left bound (the window case)


def pick(gpu, cpu):
    """A GPU's size, or the CPU's: the interpreter and the emulator run a program at a time, and
    the emulator is compiled for head dims up to 32."""
    return gpu if CUDA else cpu


# name: (shape, dtype on a GPU and of the emulated CUDA kernels, dtype of the Triton interpreter)
CASES = {
    # GQA, causal (top-left, Lq < Lk), a broadcast boolean mask with one row masked out entirely
    # (output 0, lse -inf, zero gradients), dropout, the LSE's gradient, a head dim that is not a
    # multiple of 16 (40: padded to 64 by both backends)
    "gqa_causal_boolmask_dropout": (pick(Case(2, 4, 2, 67, 130, 40, 40, 0), Case(1, 2, 1, 19, 35, 24, 24, 0)),
                                    torch.float16, torch.float16),
    # a two-sided local window over Lq > Lk (the last query rows see no key), an additive
    # key-padding mask with -inf entries, Dv != D, head dims that are not powers of two
    "window_addmask_dv": (pick(Case(2, 3, 3, 130, 67, 96, 64, 23), Case(2, 1, 1, 35, 19, 32, 16, 5)),
                          torch.bfloat16, torch.float32),
}


def _dense_inputs(name, dtype):
    c = CASES[name][0]
    q, k, v = make_qkv(B=c.B, Hq=c.Hq, Hkv=c.Hkv, Lq=c.Lq, Lk=c.Lk, D=c.D, Dv=c.Dv, dtype=dtype, q_scale=1.5)
    g = torch.Generator().manual_seed(7)
    if c.Hq != c.Hkv:
        mask = torch.rand(1, 1, c.Lq, c.Lk, generator=g) > 0.25
        mask[:, :, 5] = False
        kw = dict(attn_mask=mask.to(DEVICE), is_causal=True, enable_gqa=True, dropout_p=0.2,
                  with_dlse=True, dropout_seed=11)
    else:
        mask = torch.randn(c.B, 1, 1, c.Lk, generator=g)
        mask[0, ..., 3:9] = float("-inf")
        kw = dict(attn_mask=mask.to(DEVICE), window_size=(c.left, 9), with_dlse=True)
    return c, q, k, v, kw


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", ["softmax", "ssa", "adaptive", "ssa_adaptive"])
def test_dense(mode, case, backend, request):
    _, gpu_dtype, interpreter_dtype = CASES[case]
    if backend == "cuda":
        kernels = request.getfixturevalue("cuda_kernels")
        dtype = _dtype(gpu_dtype, gpu_dtype)
    else:
        kernels = contextlib.nullcontext
        dtype = _dtype(gpu_dtype, interpreter_dtype)
    c, q, k, v, kw = _dense_inputs(case, dtype)
    with kernels():
        out, _, grads = check(mode, q, k, v, backend=backend, **kw)
    assert set(grads) == ({"q", "k", "v", "b", "n"} if "ssa" in mode else {"q", "k", "v"})
    if "dropout_p" in kw:  # the row the mask removes entirely
        assert (out[:, :, 5] == 0).all() and (grads["q"][:, :, 5] == 0).all()
    else:  # rows i > Lk - 1 + left see no key of the window
        assert (out[:, :, c.Lk + c.left:] == 0).all() and (out[:, :, :c.Lk + c.left] != 0).any()


# --------------------------------------------------------------------------------------------
# Packed variable-length batches (Triton)


def _packed(lengths, H, d, dtype, g, scale=1.0):
    return (torch.randn(sum(lengths), H, d, generator=g, dtype=torch.float64) * scale).to(DEVICE, dtype)


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("mode,gpu_dtype,cpu_dtype", [("softmax", torch.float16, torch.float16),
                                                      ("ssa_adaptive", torch.bfloat16, torch.float32)])
def test_varlen(mode, gpu_dtype, cpu_dtype):
    """Four sequences: two longer than a block, one without queries, one without keys; GQA, causal,
    a left window, dropout (after the same seed every backend draws the same bits: the reference
    backend's Philox drops the keys the kernels drop), the LSE's gradient."""
    dtype = _dtype(gpu_dtype, cpu_dtype)
    lens_q, lens_k = pick(([67, 0, 5, 130], [61, 4, 0, 130]), ([19, 0, 3, 21], [17, 4, 0, 21]))
    Hq, Hkv, D, left = pick((4, 2, 64, 40), (2, 1, 16, 8))
    g = torch.Generator().manual_seed(3)
    q, k, v = (_packed(lens_q, Hq, D, dtype, g, 1.5), _packed(lens_k, Hkv, D, dtype, g),
               _packed(lens_k, Hkv, D, dtype, g))
    b, n = head_params(Hq)
    dout = torch.randn(q.shape[0], Hq, D, generator=g).to(DEVICE)
    dlse = torch.randn(Hq, q.shape[0], generator=g).to(DEVICE)
    ssa = "ssa" in mode

    def run(backend, q, k, v, b, n):
        leaves = [t.requires_grad_() for t in ((q, k, v, b, n) if ssa else (q, k, v))]
        torch.manual_seed(5)
        out, lse = ssa_flash.varlen_attention(
            q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), dropout_p=0.15, is_causal=True,
            enable_gqa=True, score="ssa" if ssa else "softmax", score_params=(b, n) if ssa else None,
            adaptive_temperature="adaptive" in mode,
            window_size=(left, -1), return_lse=True, backend=backend)
        loss = (out.float() * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0).float() * dlse).sum()
        return out, lse, dict(zip("qkvbn", torch.autograd.grad(loss, leaves)))

    ours = run("triton", q, k, v, b, n)
    naive = run("reference", q, k, v, b, n)
    gold = run("reference", *(detached_copy(t, torch.float64) for t in (q, k, v, b, n)))
    assert ours[0].dtype == dtype and ours[0].shape == (sum(lens_q), Hq, D)
    assert ours[1].dtype == torch.float32 and ours[1].shape == (Hq, sum(lens_q))
    compare(ours, naive, gold, dtype, max(lens_q), max(lens_k))
    no_keys = slice(lens_q[0], lens_q[0] + lens_q[2])  # the third sequence
    assert (ours[0][no_keys] == 0).all() and (ours[1][:, no_keys] == float("-inf")).all()
    no_queries = slice(lens_k[0], lens_k[0] + lens_k[1])  # the second
    assert (ours[2]["k"][no_queries] == 0).all() and (ours[2]["v"][no_queries] == 0).all()


# --------------------------------------------------------------------------------------------
# Decoding over a KV cache with split-KV (Triton)


@pytest.mark.parametrize("mode,gpu_dtype,cpu_dtype", [("softmax", torch.bfloat16, torch.float32),
                                                      ("ssa_adaptive", torch.float16, torch.float16)])
def test_kvcache_split(mode, gpu_dtype, cpu_dtype):
    """Three query rows over three caches: one holding a few key blocks' rows, one empty, one
    left-padded; three new rows appended in place, bottom-right causality, a sliding window, the
    keys split over 3 programs per row; outputs, LSE and the updated caches against the reference."""
    dtype = _dtype(gpu_dtype, cpu_dtype)
    B, Hq, Hkv, Lq = 3, *pick((4, 2), (2, 1)), 3
    Lcache, D, lengths, pad, left = pick((300, 96, [257, 0, 61], 17, 150), (70, 16, [53, 0, 21], 5, 30))
    g = torch.Generator().manual_seed(4)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(DEVICE, dtype)  # noqa: E731
    q, k_cache, v_cache = make(B, Hq, Lq, D), make(B, Hkv, Lcache, D), make(B, Hkv, Lcache, D)
    k_new, v_new = make(B, Hkv, Lq, D), make(B, Hkv, Lq, D)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    leftpad = torch.tensor([0, 0, pad], dtype=torch.int32, device=DEVICE)
    b, n = (t.detach() for t in head_params(Hq))
    ssa = "ssa" in mode

    def run(backend, cast):
        kc, vc = cast(k_cache).clone(), cast(v_cache).clone()
        out, lse = ssa_flash.attention_with_kvcache(
            cast(q), kc, vc, seqlens, cast(k_new), cast(v_new), is_causal=True, enable_gqa=True,
            score="ssa" if ssa else "softmax", score_params=(cast(b), cast(n)) if ssa else None,
            adaptive_temperature="adaptive" in mode, window_size=(left, -1),
            cache_leftpad=leftpad, num_splits=3, return_lse=True, backend=backend)
        return out, lse, {}, kc, vc

    same = lambda t: t  # noqa: E731
    ours, naive = run("triton", same), run("reference", same)
    gold = run("reference", lambda t: t.double())
    assert ours[0].dtype == dtype and ours[0].shape == (B, Hq, Lq, D) and not ours[0].requires_grad
    compare(ours[:3], naive[:3], gold[:3], dtype, Lq, Lcache)
    assert torch.equal(ours[3], naive[3]) and torch.equal(ours[4], naive[4]), "the new rows, written in place"
    assert not torch.equal(ours[3], k_cache)
    assert (ours[0][1] != 0).any()  # the empty cache's element still sees its three new rows


# --------------------------------------------------------------------------------------------
# The entropy diagnostic


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_entropy(backend, request):
    """Per-row entropy of SSA weights under a mask, causality, a window and GQA."""
    kernels = request.getfixturevalue("cuda_kernels") if backend == "cuda" else contextlib.nullcontext
    dtype = _dtype(torch.float16, torch.float16 if backend == "cuda" else torch.float32)
    B, Hq, Hkv, Lq, Lk, D, left = pick((2, 4, 2, 67, 130, 64, 30), (1, 2, 1, 19, 35, 16, 7))
    q, k, _ = make_qkv(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, dtype=dtype, requires_grad=False)
    b, n = (t.detach() for t in head_params(Hq))
    mask = (torch.rand(1, 1, Lq, Lk, generator=torch.Generator().manual_seed(2)) > 0.2).to(DEVICE)
    kw = dict(is_causal=True, enable_gqa=True, window_size=(left, -1))
    with kernels():
        ours = ssa_flash.attention_entropy(q, k, mask,
                                           score="ssa", score_params={"b": b, "n": n}, backend=backend, **kw)
    gold = reference.attention_entropy(q.double(), k.double(), mask, score="ssa",
                                       score_params=(b.double(), n.double()), **kw)
    naive = reference.attention_entropy(q, k, mask, score="ssa", score_params=(b, n), **kw)
    assert ours.dtype == torch.float32 and ours.shape == (B, Hq, Lq)
    fa_tolerance_check("entropy", ours, naive, gold, FLOORS[dtype])
