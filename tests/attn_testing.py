"""Shared helpers for the tests: devices, dtypes, input builders and FlashAttention's error rule."""
from __future__ import annotations

import math
import os

import pytest
import torch

import ssa_flash
from ssa_flash import reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# The interpreter's tl.dot is exact for float64/32/16 but not bfloat16 (docs/design.md §3).
KERNEL_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if CUDA else [torch.float32, torch.float64]
LOW_PRECISION = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRETER), reason="needs CUDA or TRITON_INTERPRET=1")
# Values inside GPU tensors (cu_seqlens_*, cache_seqlens, cache_leftpad, b, n) are not validated:
# that would synchronise the device on every call (docs/api.md, Errors). Tests of those value checks
# run where the tensors are on the CPU.
host_values_only = pytest.mark.skipif(CUDA, reason="values of GPU tensors are not validated (no device sync)")

MODES = ["softmax", "ssa", "adaptive", "ssa_adaptive"]


def rotating_modes(cases, per_case=2):
    """``(mode, *case)`` tuples for ``pytest.mark.parametrize``: case i with ``per_case``
    consecutive variants from ``MODES[i % 4]`` on, so that each variant takes its share of the
    cases and, with ``per_case=2``, every case runs with one variant of softmax scores and one of
    SSA's. The in-depth files use it where a case's corner (a length, a mask kind, a GQA ratio)
    is handled by code the variants share; the feature matrix (tests/features.py) takes every
    feature with every variant."""
    out = []
    for i, case in enumerate(cases):
        case = case if isinstance(case, tuple) else (case,)
        out += [(MODES[(i + j) % len(MODES)], *case) for j in range(per_case)]
    return out


def make_qkv(B=1, Hq=2, Hkv=None, Lq=19, Lk=None, D=16, Dv=None, dtype=torch.float32,
             device=DEVICE, requires_grad=True, q_scale=1.0, seed=0):
    Hkv = Hq if Hkv is None else Hkv
    Lk = Lq if Lk is None else Lk
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64) * q_scale
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v))


def head_params(H, dtype=torch.float32, device=DEVICE, seed=1):
    g = torch.Generator().manual_seed(seed)
    b = (0.5 + torch.rand(H, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
    n = (1.0 + 1.5 * torch.rand(H, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
    return b.requires_grad_(), n.requires_grad_()


def call(module, mode, q, k, v, b=None, n=None, **kw):
    """Runs one of the four variants through ``module``: ssa_flash (its named functions) or the
    specification (``ssa_flash.reference``, or an object with its ``attention``: one function
    for every variant)."""
    if not hasattr(module, "ssa_attention"):
        ssa = mode in ("ssa", "ssa_adaptive")
        return module.attention(q, k, v, score="ssa" if ssa else "softmax", score_params=(b, n) if ssa else None,
                                adaptive_temperature=mode in ("adaptive", "ssa_adaptive"), **kw)
    if mode == "softmax":
        return module.softmax_attention(q, k, v, **kw)
    if mode == "adaptive":
        return module.adaptive_temperature_attention(q, k, v, **kw)
    return module.ssa_attention(q, k, v, b=b, n=n, adaptive_temperature=(mode == "ssa_adaptive"), **kw)


def detached_copy(t, dtype=None):
    if t is None or not isinstance(t, torch.Tensor):
        return t
    out = t.detach().to(dtype or t.dtype)
    return out.requires_grad_(t.requires_grad)


def learned_mask_inputs(B, H, D, shape, Hkv=None, Lq=7, Lk=6, seed=0, dtype=torch.float64):
    """The inputs of a learned-mask test (tests/triton/test_triton_mask_grad.py,
    tests/cuda/test_cuda_mask_grad.py): q (B, H, Lq, D), k, v (B, Hkv, Lk, D), a mask of ``shape``
    (its row and key dims following Lq, Lk; a dim of 1 stays 1) and dout, drawn in float64 from
    ``seed``, as ``dtype`` on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    shape = (*shape[:-2], Lq if shape[-2] != 1 else 1, Lk if shape[-1] != 1 else 1)
    mask = torch.randn(*shape, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    return [t.to(DEVICE, dtype) for t in (q, k, v, mask, dout)]


def fa_tolerance_check(name, ours, naive, gold, floor):
    """FlashAttention's rule: |ours - gold| <= 2 * |naive - gold| + floor * max(1, |gold|) (max
    norms), where ``naive`` is the materialised reference in the same precision as ``ours``."""
    # the floor is relative to the size of the values (gradients scale with n, logits with 1e4)
    floor = floor * max(1.0, gold.double().abs().nan_to_num(posinf=0).max().item())
    ours_err = (ours.double() - gold.double()).abs().nan_to_num(posinf=1e30).max().item()
    naive_err = (naive.double() - gold.double()).abs().nan_to_num(posinf=1e30).max().item()
    assert ours_err <= 2 * naive_err + floor, f"{name}: error {ours_err:.3g} > 2 * naive {naive_err:.3g} + {floor:g}"


FLOORS = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def run(module_or_backend, mode, q, k, v, b, n, dout, dlse=None, **kw):
    """Forward + backward; returns (out, lse, grads of q, k, v, b, n and of ``sinks`` when it is a
    tensor that requires grad)."""
    if module_or_backend == "reference":
        out, lse = call(reference, mode, q, k, v, b, n, return_lse=True, **kw)
    else:
        out, lse = call(ssa_flash, mode, q, k, v, b, n, return_lse=True, backend=module_or_backend, **kw)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).float() * dlse).sum()
    leaves = list(zip(("q", "k", "v", "b", "n"), (q, k, v, b, n)))
    if isinstance(kw.get("sinks"), torch.Tensor):  # a per-head sink logit that requires grad
        leaves.append(("sinks", kw["sinks"]))
    names = [nm for nm, t in leaves if t is not None and t.requires_grad]
    inputs = [t for nm, t in leaves if t is not None and t.requires_grad]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return out, lse, dict(zip(names, grads))


def check(mode, q, k, v, b=None, n=None, with_dlse=False, dropout_seed=None, backend="triton", **kw):
    """Ours (``backend``, in q's dtype) vs the naive reference in the same dtype and in float64. With
    ``dropout_seed`` (and ``dropout_p`` in ``kw``) ours runs after ``torch.manual_seed(dropout_seed)``
    and the references get the keep mask that this seed gives (``ssa_flash.dropout_mask``)."""
    dtype = q.dtype
    g = torch.Generator().manual_seed(123)
    Dv = v.shape[-1]
    dout = torch.randn(*q.shape[:-1], Dv, generator=g).to(q.device)
    dlse = torch.randn(*q.shape[:-1], generator=g).to(q.device) if with_dlse else None
    if mode in ("ssa", "ssa_adaptive") and b is None:
        b, n = head_params(q.shape[-3], device=q.device)
    ref_kw = dict(kw)
    if dropout_seed is not None:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        torch.manual_seed(dropout_seed)
        ref_kw["dropout_mask"] = ssa_flash.dropout_mask(shape, kw["dropout_p"], device=q.device)
        torch.manual_seed(dropout_seed)
    ours = run(backend, mode, q, k, v, b, n, dout, dlse, **kw)
    naive = run("reference", mode, q, k, v, b, n, dout, dlse, **ref_kw)
    cast = lambda t: detached_copy(t, torch.float64)  # noqa: E731
    gkw = {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
           for key, val in ref_kw.items()}
    gold = run("reference", mode, cast(q), cast(k), cast(v), cast(b), cast(n), dout, dlse, **gkw)
    assert ours[0].dtype == dtype and ours[0].shape == naive[0].shape
    expected_lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert ours[1].dtype == expected_lse_dtype and ours[1].shape == q.shape[:-1]
    compare(ours, naive, gold, dtype, q.shape[-2], k.shape[-2])
    return ours


def compare(ours, naive, gold, dtype, Lq, Lk):
    """FlashAttention's rule on ``(out, lse, {name: grad})`` triples (as :func:`run` returns; the
    gradient dict may be empty): ours and the naive reference in ``dtype`` against the float64
    gold; the LSE must be -inf exactly where the gold's is. ``Lq``, ``Lk``: the longest rows, for
    the floor of the b, n gradients."""
    floor = FLOORS[dtype]
    fa_tolerance_check("out", ours[0], naive[0], gold[0], floor)
    finite = torch.isfinite(gold[1])
    assert torch.equal(torch.isfinite(ours[1]), finite), "lse: -inf exactly on the rows with no admissible key"
    fa_tolerance_check("lse", ours[1][finite], naive[1][finite], gold[1][finite], floor)
    for name, grad in ours[2].items():
        assert grad is not None and torch.isfinite(grad).all(), f"d{name} not finite"
        assert grad.shape == gold[2][name].shape, f"d{name} shape"
        # b, n (and sink) gradients sum over every score of a head: allow for the length of that sum
        gfloor = floor * (math.sqrt(Lq * Lk) if name in ("b", "n", "sinks") else 4)
        fa_tolerance_check(f"d{name}", grad, naive[2][name], gold[2][name], gfloor)


def fake(shape, dtype=torch.float16, device="cuda"):
    """A stand-in for a tensor: what a backend's ``supports`` reads (shape, dtype, device), so its
    answers for a GPU can be checked without one."""
    from types import SimpleNamespace
    return SimpleNamespace(shape=torch.Size(shape), dtype=dtype, device=torch.device(device))


def compiled_kernels_env(triton_dir=None) -> dict:
    """Environment of a subprocess that compiles real Triton kernels (no interpreter): ``triton_dir``
    (another Triton install, which must win over this one) and this checkout first on the path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    paths = ([triton_dir] if triton_dir else []) + [root]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
