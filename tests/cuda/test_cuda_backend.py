"""The CUDA C++ backend (csrc/, ssa_flash/backends/cuda_backend.py) on a GPU: against the float64 reference with
FlashAttention's error rule (error <= 2x the same-dtype naive error + a floor), against the
Triton backend, over the feature matrix of docs/design.md §1.4 and the four variants; determinism;
clear errors for inputs it does not run; compute-sanitizer memcheck and racecheck on a small run.

Skipped without a CUDA device. On a GPU without the extension (no prebuilt ssa_flash._C and no
toolkit to JIT-build it) the tests skip with the reason, except test_extension_loads, which fails
when ``ssa_flash.cuda.is_available()`` claims the extension can be built but it cannot.
"""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ssa_flash
from ssa_flash import cuda as cuda_backend
from ssa_flash import reference
from attn_testing import (FLOORS, MODES, compare, detached_copy, fa_tolerance_check, head_params, run,
                          make_qkv)

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


def _bf16_ok():
    return CUDA and torch.cuda.get_device_capability()[0] >= 8


DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not _bf16_ok(), reason="bf16 needs sm_80"))]


@pytest.fixture(scope="module", autouse=True)
def extension():
    if not cuda_backend.is_available():
        pytest.skip(f"CUDA backend unavailable: {cuda_backend.unavailable_reason('cuda')}")
    return cuda_backend.load_extension()  # builds (once) if not prebuilt; fails loudly if it cannot


def test_extension_loads():
    if not cuda_backend.is_available():
        pytest.skip(cuda_backend.unavailable_reason("cuda"))
    ext = cuda_backend.load_extension()
    assert hasattr(ext, "fwd") and hasattr(ext, "bwd") and hasattr(ext, "row_entropy")
    assert "cuda" in ssa_flash.available_backends("cuda")
    assert cuda_backend.ready()


# --------------------------------------------------------------------------------------------
# Helpers


def _gold_kw(kw):
    return {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
            for key, val in kw.items()}


def check(mode, q, k, v, b=None, n=None, with_dlse=False, against_triton=True, **kw):
    """CUDA backend (in q's dtype) vs the naive reference in the same dtype and in float64, and
    vs the Triton backend."""
    dtype = q.dtype
    g = torch.Generator().manual_seed(123)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=g).to(q.device)
    dlse = torch.randn(*q.shape[:-1], generator=g).to(q.device) if with_dlse else None
    if mode in ("ssa", "ssa_adaptive") and b is None:
        b, n = head_params(q.shape[-3], device=q.device)
    ours = run("cuda", mode, q, k, v, b, n, dout, dlse, **kw)
    naive = run("reference", mode, q, k, v, b, n, dout, dlse, **kw)
    cast = lambda t: detached_copy(t, torch.float64)  # noqa: E731
    gold = run("reference", mode, cast(q), cast(k), cast(v), cast(b), cast(n), dout, dlse, **_gold_kw(kw))
    assert ours[0].dtype == dtype and ours[0].shape == naive[0].shape
    assert ours[1].dtype == torch.float32 and ours[1].shape == q.shape[:-1]
    compare(ours, naive, gold, dtype, q.shape[-2], k.shape[-2])
    if against_triton and "triton" in ssa_flash.available_backends(q.device):
        tri = run("triton", mode, q, k, v, b, n, dout, dlse, **kw)
        # both are held to the same rule against the gold; here, that they agree within it
        floor = FLOORS[dtype]
        fa_tolerance_check("out vs triton", ours[0], naive[0], tri[0], 2 * floor)
        for name, grad in ours[2].items():
            gfloor = 2 * floor * (math.sqrt(q.shape[-2] * k.shape[-2]) if name in "bn" else 4)
            fa_tolerance_check(f"d{name} vs triton", grad, naive[2][name], tri[2][name], gfloor)
    return ours


# --------------------------------------------------------------------------------------------
# The feature matrix


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_basic(mode, dtype, causal):
    q, k, v = make_qkv(B=2, Hq=3, Lq=133, D=64, dtype=dtype)
    check(mode, q, k, v, is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256, 16, 59, 111, 200])
def test_head_dims(mode, dtype, D):
    q, k, v = make_qkv(B=1, Hq=2, Lq=97, Lk=75, D=D, dtype=dtype)
    check(mode, q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_value_head_dim_differs(mode, dtype):
    q, k, v = make_qkv(B=1, Hq=2, Lq=70, Lk=90, D=64, Dv=40, dtype=dtype)
    check(mode, q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 200), (200, 1), (65, 64), (64, 65), (300, 129), (129, 300)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths(mode, Lq, Lk, causal):
    q, k, v = make_qkv(B=1, Hq=2, Lq=Lq, Lk=Lk, D=64, dtype=torch.float16)
    check(mode, q, k, v, is_causal=causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("group", [2, 4])
def test_gqa(mode, dtype, group):
    q, k, v = make_qkv(B=2, Hq=2 * group, Hkv=2, Lq=77, Lk=130, D=64, dtype=dtype)
    check(mode, q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["bool", "bool_broadcast", "float", "float16_broadcast", "neg_inf_rows"])
def test_masks(mode, kind):
    B, H, Lq, Lk = 2, 2, 90, 110
    q, k, v = make_qkv(B=B, Hq=H, Lq=Lq, Lk=Lk, D=64, dtype=torch.float16)
    g = torch.Generator().manual_seed(5)
    if kind == "bool":
        mask = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
    elif kind == "bool_broadcast":
        mask = torch.rand(1, 1, Lq, Lk, generator=g) > 0.5
    elif kind == "float":
        mask = torch.randn(B, H, Lq, Lk, generator=g)
    elif kind == "float16_broadcast":
        mask = torch.randn(B, 1, 1, Lk, generator=g).half()
    else:  # rows with no admissible key: output 0, zero gradients, lse -inf
        mask = torch.zeros(B, H, Lq, Lk)
        mask[:, :, ::7] = float("-inf")
        mask[:, :, 3, 5:] = float("-inf")
    check(mode, q, k, v, attn_mask=mask.to(q.device), is_causal=(kind == "bool"))


@pytest.mark.parametrize("mode", MODES)
def test_empty_rows_bool(mode):
    q, k, v = make_qkv(B=1, Hq=2, Lq=50, Lk=60, D=32, dtype=torch.float16)
    mask = torch.ones(1, 2, 50, 60, dtype=torch.bool)
    mask[:, :, 10:20] = False
    out = check(mode, q, k, v, attn_mask=mask.to(q.device))
    assert torch.all(out[0][:, :, 10:20] == 0)
    assert torch.all(out[2]["q"][:, :, 10:20] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous(mode):
    """A transpose of (B, L, H, D), as produced by most model code, and an odd-strided slice."""
    B, L, H, D = 2, 81, 3, 64
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(B, L, H, D + 8, generator=g).half().cuda() for _ in range(3)]
    q, k, v = (x[..., :D].transpose(1, 2).requires_grad_() for x in base)  # leaves: strided views
    check(mode, q, k, v, is_causal=True)


@pytest.mark.parametrize("mode", MODES)
def test_lse_gradient(mode):
    q, k, v = make_qkv(B=1, Hq=2, Lq=70, D=64, dtype=torch.float16)
    check(mode, q, k, v, with_dlse=True, is_causal=True)


@pytest.mark.parametrize("mode", ["ssa", "ssa_adaptive"])
def test_scalar_and_large_ssa_params(mode):
    q, k, v = make_qkv(B=1, Hq=2, Lq=64, D=64, dtype=torch.float16, q_scale=4.0)
    b = torch.tensor([0.1, 5.0], device=q.device, requires_grad=True)
    n = torch.tensor([1.0, 4.0], device=q.device, requires_grad=True)
    check(mode, q, k, v, b=b, n=n)


@pytest.mark.parametrize("mode", ["ssa", "ssa_adaptive"])
@pytest.mark.parametrize("causal", [False, True])
def test_ssa_n_zero(mode, causal):
    """n = 0: uniform weights, finite gradients (dn does not divide by n)."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=200, Lk=170, D=64, dtype=torch.float16)
    b = torch.tensor([1.0, 0.5], device=q.device, requires_grad=True)
    n = torch.zeros(2, device=q.device, requires_grad=True)
    check(mode, q, k, v, b=b, n=n, is_causal=causal)


@pytest.mark.parametrize("mode", MODES)
def test_negative_scale(mode):
    """The kernels take |scale| on -q when the scale is negative (ssa_flash/backends/cuda_backend.py, for the extension and the emulator alike)."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=150, Lk=140, D=64, dtype=torch.float16)
    check(mode, q, k, v, scale=-0.2, is_causal=True)


@pytest.mark.parametrize("mode", MODES)
def test_many_interior_key_blocks(mode):
    """Long rows: most key blocks run the kernels' unmasked interior loop."""
    q, k, v = make_qkv(B=1, Hq=2, Lq=700, Lk=650, D=128, dtype=torch.float16)
    check(mode, q, k, v)
    check(mode, q, k, v, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ssa", [False, True])
def test_entropy(dtype, ssa):
    q, k, _ = make_qkv(B=2, Hq=4, Hkv=2, Lq=150, Lk=170, D=64, dtype=dtype, requires_grad=False)
    b, n = (t.detach() for t in head_params(4, device=q.device)) if ssa else (None, None)
    mask = (torch.rand(1, 1, 150, 170) > 0.2).to(q.device)
    score = "ssa" if ssa else "softmax"
    ours = ssa_flash.attention_entropy(q, k, mask, is_causal=True, enable_gqa=True,
                                       score=score, score_params=(b, n) if ssa else None, backend="cuda")
    gold = reference.attention_entropy(q.double(), k.double(), mask, True, None, True, score=score,
                                       score_params=(b.double(), n.double()) if ssa else None)
    naive = reference.attention_entropy(q, k, mask, True, None, True, score=score,
                                        score_params=(b, n) if ssa else None)
    assert ours.dtype == torch.float32 and ours.shape == (2, 4, 150)
    fa_tolerance_check("entropy", ours, naive, gold, FLOORS[dtype])


# --------------------------------------------------------------------------------------------
# Determinism, errors, auto


@pytest.mark.parametrize("mode", MODES)
def test_backward_deterministic(mode):
    q, k, v = make_qkv(B=2, Hq=4, Lq=300, D=64, dtype=torch.float16)
    b, n = head_params(4, device=q.device) if "ssa" in mode else (None, None)
    dout = torch.randn(2, 4, 300, 64, device=q.device, dtype=torch.float16)
    first = run("cuda", mode, q, k, v, b, n, dout, is_causal=True, deterministic=True)
    second = run("cuda", mode, q, k, v, b, n, dout, is_causal=True, deterministic=True)
    assert torch.equal(first[0], second[0])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), f"d{name} differs between runs"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout(mode, deterministic):
    """Dropout: the mask of the seed (ssa_flash.dropout_mask after the same torch.manual_seed, the
    mask of the Triton and reference backends) against the reference given that mask; the Triton
    backend after the same seed agrees; the call is reproducible under the seed."""
    q, k, v = make_qkv(B=2, Hq=4, Hkv=2, Lq=150, Lk=170, D=64, dtype=torch.float16)
    b, n = head_params(4, device=q.device) if "ssa" in mode else (None, None)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(2, 4, 150, 64, generator=g).to(q.device)
    p = 0.3
    kw = dict(is_causal=True, enable_gqa=True, dropout_p=p)
    torch.manual_seed(11)
    keep = ssa_flash.dropout_mask((2, 4, 150, 170), p, device=q.device)
    torch.manual_seed(11)
    ours = run("cuda", mode, q, k, v, b, n, dout, **kw, deterministic=deterministic)
    torch.manual_seed(11)
    again = run("cuda", mode, q, k, v, b, n, dout, **kw, deterministic=True)
    assert torch.equal(ours[0], again[0])
    ref_kw = dict(is_causal=True, enable_gqa=True, dropout_p=p, dropout_mask=keep)
    naive = run("reference", mode, q, k, v, b, n, dout, **ref_kw)
    cast = lambda t: detached_copy(t, torch.float64)  # noqa: E731
    gold = run("reference", mode, cast(q), cast(k), cast(v), cast(b), cast(n), dout, **ref_kw)
    floor = FLOORS[torch.float16]
    fa_tolerance_check("out", ours[0], naive[0], gold[0], floor)
    for name, grad in ours[2].items():
        gfloor = floor * (math.sqrt(150 * 170) if name in "bn" else 4)
        fa_tolerance_check(f"d{name}", grad, naive[2][name], gold[2][name], gfloor)
    if "triton" in ssa_flash.available_backends(q.device):
        torch.manual_seed(11)
        tri = run("triton", mode, q, k, v, b, n, dout, **kw)
        fa_tolerance_check("out vs triton", ours[0], naive[0], tri[0], 2 * floor)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window,causal,Lq,Lk", [((70, 9), False, 300, 290), ((100, -1), True, 260, 330),
                                                 ((0, 0), False, 330, 100), ((5, 0), False, 60, 270)])
def test_windows(mode, window, causal, Lq, Lk):
    """Local windows: the band's key (query) blocks only, empty query blocks (output 0, lse -inf),
    key blocks no query sees (dK, dV 0); against the reference and the Triton backend."""
    q, k, v = make_qkv(B=1, Hq=4, Hkv=2, Lq=Lq, Lk=Lk, D=64, dtype=torch.float16)
    check(mode, q, k, v, with_dlse=True, window_size=window, is_causal=causal, enable_gqa=True)


def test_unsupported_inputs_raise_clearly():
    q, k, v = make_qkv(B=1, Hq=2, Lq=10, D=64, dtype=torch.float32)
    with pytest.raises(ssa_flash.BackendUnavailableError, match="float16 or bfloat16"):
        ssa_flash.ssa_attention(q, k, v, backend="cuda")
    assert cuda_backend.supports(q, k, v) is not None
    q16 = q.half()
    assert cuda_backend.supports(q16, k.half(), v.half()) is None


def test_preferred_backend():
    assert cuda_backend.preferred_backend("cuda") in ("cuda", "triton")


# --------------------------------------------------------------------------------------------
# compute-sanitizer

SANITIZER = shutil.which("compute-sanitizer")

_SANITIZED_RUN = textwrap.dedent("""
    import torch, ssa_flash
    torch.manual_seed(0)
    for dtype in (torch.float16,) + ((torch.bfloat16,) if torch.cuda.get_device_capability()[0] >= 8 else ()):
        for D in (64, 111):
            q = torch.randn(1, 4, 70, D, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(1, 2, 90, D, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(1, 2, 90, D, device="cuda", dtype=dtype, requires_grad=True)
            mask = torch.rand(1, 1, 70, 90, device="cuda") > 0.2
            b = torch.full((4,), 1.0, device="cuda", requires_grad=True)
            n = torch.full((4,), 1.5, device="cuda", requires_grad=True)
            for adaptive in (False, True):
                out = ssa_flash.ssa_attention(q, k, v, mask, is_causal=True, enable_gqa=True, b=b, n=n,
                                              adaptive_temperature=adaptive, backend="cuda")
                out.float().sum().backward()
                out = ssa_flash.softmax_attention(q, k, v, is_causal=False, enable_gqa=True, backend="cuda")
                out.float().sum().backward()
    torch.cuda.synchronize()
    print("SANITIZED RUN OK")
""")


@pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer not on PATH")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer(tool, tmp_path):
    cuda_backend.load_extension()  # build outside the sanitizer
    script = tmp_path / "run.py"
    script.write_text(_SANITIZED_RUN)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *sys.path]))
    proc = subprocess.run([SANITIZER, "--tool", tool, "--error-exitcode", "99", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=1800, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "SANITIZED RUN OK" in output, output[-10000:]
    assert "ERROR SUMMARY: 0 errors" in output or "RACECHECK SUMMARY: 0 hazards" in output, output[-10000:]
