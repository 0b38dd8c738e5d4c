"""The backends layer (ssa_flash/backends): one interface for every backend, layers that import
only downwards, the reference backend's explicit backward against autograd of the specification,
backend="auto"'s policy (the CUDA backend only where verified), the CUDA backend's device checks,
and the CUDA backend's Python glue run on the CPU through the emulation of its kernels."""
from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ssa_flash
from ssa_flash import autograd, backends, errors, reference
from ssa_flash.backends import cuda_backend
from ssa_flash.spec import AttentionSpec, Backend

from attn_testing import FLOORS, INTERPRETER, MODES, call, fa_tolerance_check, head_params
from emulation import build_emulator

PACKAGE = Path(ssa_flash.__file__).resolve().parent


# --------------------------------------------------------------------------------------------
# One interface, layers


def test_every_backend_has_the_interface():
    """Each backend module provides the Backend functions with the same parameter names (the
    Triton launcher's, which the other backends follow)."""
    for name in backends.NAMES:
        mod = backends.get(name)
        assert isinstance(mod, Backend), name
        assert mod.NAME == name
        for fn in ("unavailable_reason", "supports", "row_entropy", "forward", "backward"):
            expected = [p for p in inspect.signature(getattr(Backend, fn)).parameters if p != "self"]
            got = list(inspect.signature(getattr(mod, fn)).parameters)
            assert got == expected, f"{name}.{fn}{got} != {expected}"
    with pytest.raises(ValueError, match="unknown backend"):
        backends.get("flash")


def test_compile_constant_marker_is_torchs():
    """backends._compile sets the marker torch.compiler.assume_constant_result sets (it avoids
    importing torch._dynamo, and with it Triton, when the package is imported)."""
    from ssa_flash.backends._compile import constant_for_compile

    def ours():
        return 1

    def theirs():
        return 1

    assert vars(constant_for_compile(ours)) == vars(torch.compiler.assume_constant_result(theirs))
    assert vars(ours)


def test_import_does_not_import_triton_or_dynamo():
    """``python -m ssa_flash`` sets TRITON_INTERPRET=1 after the package is imported: importing it
    must not import Triton (nor torch._dynamo, which would)."""
    import subprocess
    import sys

    code = "import sys, ssa_flash; print('triton' in sys.modules, 'torch._dynamo' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


def test_error_type_is_shared():
    assert ssa_flash.BackendUnavailableError is errors.BackendUnavailableError
    assert ssa_flash.ops.BackendUnavailableError is errors.BackendUnavailableError
    assert issubclass(errors.BackendUnavailableError, ValueError)
    assert issubclass(errors.BackendUnavailableError, RuntimeError)


# The layers and import cycles: tests/test_layers.py (tools/import_graph.py, the whole package).


# --------------------------------------------------------------------------------------------
# The reference backend (explicit backward) against autograd of the specification


def _case(mode, mask_kind, dtype=torch.float64, B=2, Hq=4, Hkv=2, Lq=7, Lk=9, D=5, Dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (2.5 * torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    b, n = head_params(Hq, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device="cpu")
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(Lq, Lk, generator=g) > 0.4
        mask[2] = False  # a row with no admissible key
    elif mask_kind == "float":
        mask = torch.randn(1, Hq, Lq, Lk, generator=g, dtype=torch.float64)
        mask[..., 3, :4] = float("-inf")
        mask[..., 1, :] = float("-inf")
    if "ssa" not in mode:
        b = n = None
    return q, k, v, b, n, mask


def _leaves(q, k, v, b, n):
    return [t for t in (q, k, v, b, n) if t is not None]


def _score(b) -> str:
    return "softmax" if b is None else "ssa"


def _params(b, n) -> tuple:
    return () if b is None else (b, n)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_reference_backend_matches_autograd_of_the_spec(mode, mask_kind):
    """Outputs, LSE and every gradient (with an LSE gradient too) of the reference backend through
    the ops equal autograd through ssa_flash.reference, to rounding, in float64."""
    q, k, v, b, n, mask = _case(mode, mask_kind)
    B, Hq, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    full = None if mask is None else mask.expand(B, Hq, Lq, Lk)
    adaptive = "adaptive" in mode
    spec = AttentionSpec(scale=q.shape[-1] ** -0.5, score=_score(b), causal=True, group=2, adaptive=adaptive)
    out, lse = autograd.attention(q, k, v, _params(b, n), full, "reference", spec)
    ref_out, ref_lse = reference.attention(q, k, v, full, 0.0, True, None, True, score=_score(b),
                                           score_params=_params(b, n), adaptive_temperature=adaptive, return_lse=True)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss(o, lse_):
        return (o * dout).sum() + (torch.where(torch.isfinite(lse_), lse_, 0) * dlse).sum()

    ours = torch.autograd.grad(loss(out, lse), _leaves(q, k, v, b, n))
    ref = torch.autograd.grad(loss(ref_out, ref_lse), _leaves(q, k, v, b, n))
    for name, a, e in zip("qkvbn", ours, ref):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-10, msg=lambda m: f"d{name}: {m}")
    ent = autograd.row_entropy(q.detach(), k.detach(), _params(b, n), full, "reference", spec)
    torch.testing.assert_close(ent, reference.attention_entropy(q.detach(), k.detach(), full, True, None, True,
                                                                score=_score(b), score_params=_params(b, n)),
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_reference_backend_gradcheck(mode):
    q, k, v, b, n, mask = _case(mode, "bool", B=1, Hq=2, Hkv=1, Lq=4, Lk=3, D=2, Dv=2)
    spec = AttentionSpec(scale=0.7, score=_score(b), causal=False, group=2, adaptive="adaptive" in mode)
    full = mask.expand(1, 2, 4, 3)

    def f(*args):
        out, lse = autograd.attention(*args[:3], tuple(args[3:]), full, "reference", spec)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    assert torch.autograd.gradcheck(f, _leaves(q, k, v, b, n), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_reference_backend_low_precision_accumulates_in_float32():
    q, k, v, b, n, _ = _case("ssa", None, dtype=torch.float16)
    spec = AttentionSpec(scale=0.4, score="ssa", group=2)
    out, lse = autograd.attention(q, k, v, (b, n), None, "reference", spec)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    gold = reference.attention(*(t.detach().double() for t in (q, k, v)), scale=0.4, enable_gqa=True,
                               score="ssa", score_params=(b.detach().double(), n.detach().double()))
    assert (out.double() - gold).abs().max() < 2e-3


# --------------------------------------------------------------------------------------------
# backend="auto" and the CUDA backend's device checks (no GPU needed: the probes are replaced)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a chosen architecture with the extension prebuilt, as far as the CUDA
    backend's probes can tell."""
    arch = {"cap": (9, 0)}
    monkeypatch.setattr(cuda_backend, "_capability", lambda device: (*arch["cap"], 232448))
    monkeypatch.setattr(cuda_backend, "_prebuilt", lambda: True)
    # built for the pretended GPU (on a GPU machine the real extension holds its own GPU's images only)
    monkeypatch.setattr(cuda_backend, "_image_reason", lambda device: None)
    monkeypatch.setattr(cuda_backend, "_ext_error", None)
    monkeypatch.setattr(cuda_backend, "VERIFIED_ARCHS", {})
    monkeypatch.setattr(backends, "_answers", {})  # availability is remembered per probe state
    return arch


def test_auto_picks_cuda_only_where_verified(fake_gpu, monkeypatch):
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # Triton's probe asks it too
    if backends.get("triton").unavailable_reason(gpu) is not None:
        pytest.skip("Triton is not importable")
    assert backends.resolve("cuda", gpu, torch.float16) == ("cuda", "")
    assert backends.resolve("auto", gpu, torch.float16) == ("triton", "")
    assert backends.available(gpu) == ("triton", "cuda", "reference")
    monkeypatch.setitem(cuda_backend.VERIFIED_ARCHS, (9, 0), {"dtypes": ("float16",), "evidence": "test"})
    assert backends.resolve("auto", gpu, torch.float16) == ("triton", "")  # remembered
    backends.forget()
    assert backends.resolve("auto", gpu, torch.float16) == ("cuda", "")
    assert backends.available(gpu, torch.float16)[0] == "cuda"
    assert backends.resolve("auto", gpu, torch.bfloat16) == ("triton", "")  # not verified for bf16
    assert backends.resolve("auto", gpu, torch.float32) == ("triton", "")
    fake_gpu["cap"] = (8, 0)  # another architecture
    backends.forget()
    assert backends.resolve("auto", gpu, torch.float16) == ("triton", "")
    fake_gpu["cap"] = (9, 0)
    monkeypatch.setattr(cuda_backend, "_prebuilt", lambda: False)  # would need a JIT build first
    backends.forget()
    assert backends.resolve("auto", gpu, torch.float16) == ("triton", "")


def _fake_tensor(dtype, shape=(1, 2, 8, 64)):
    return SimpleNamespace(device=torch.device("cuda"), dtype=dtype, shape=shape)


@pytest.mark.parametrize("cap,fp16,bf16", [((7, 0), True, False), ((7, 5), True, False),
                                            ((8, 0), True, True), ((6, 1), False, False)])
def test_cuda_device_check(fake_gpu, cap, fp16, bf16):
    """sm_70 and sm_75 run float16 only, bfloat16 needs sm_80, older GPUs are refused."""
    fake_gpu["cap"] = cap
    spec = AttentionSpec(scale=1.0)
    for dtype, ok in ((torch.float16, fp16), (torch.bfloat16, bf16)):
        t = _fake_tensor(dtype)
        why = cuda_backend.supports(t, t, t, spec)
        assert (why is None) == ok, (cap, dtype, why)
    if not fp16:
        assert "sm_70" in cuda_backend.unavailable_reason(torch.device("cuda"))
    else:
        assert cuda_backend.unavailable_reason(torch.device("cuda")) is None
    t = _fake_tensor(torch.float32)
    assert ("float16 or bfloat16" if fp16 else "sm_70") in (cuda_backend.supports(t, t, t, spec) or "")


def test_jit_build_targets_sm90a(monkeypatch):
    """A JIT build with no TORCH_CUDA_ARCH_LIST compiles an H100's code as sm_90a (the dQ kernel's
    wgmma path; torch's default, plain sm_90, would leave it out), other GPUs as themselves."""
    caps = [(9, 0), (8, 0), (9, 0)]
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)  # a GPU image may set one (the H200's did)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])
    assert cuda_backend.jit_arch_list() == "8.0;9.0a"
    caps[:] = [(8, 6)]
    assert cuda_backend.jit_arch_list() == "8.6"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_backend.jit_arch_list() is None


def test_auto_never_picks_an_emulated_cuda_backend():
    with cuda_backend.emulated(object()):
        assert "cuda" in ssa_flash.available_backends("cpu")
        name, why = backends.resolve("auto", torch.device("cpu"), torch.float16)
        assert why == "" and name == ("triton" if INTERPRETER else "reference")
    assert "cuda" not in ssa_flash.available_backends("cpu")


# --------------------------------------------------------------------------------------------
# The CUDA backend's glue on CPU tensors, through the emulation of its kernels


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build_emulator(tmp_path_factory.mktemp("emu_backends"))


def _half_case(mode, *, B=2, Hq=4, Hkv=2, Lq=37, Lk=45, D=30, Dv=20, transpose=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transpose:  # (B, L, H, D) storage: not 16-byte aligned rows for D=30, so the glue copies
        q = torch.randn(B, Lq, Hq, D, generator=g).half().transpose(1, 2)
    else:
        q = torch.randn(B, Hq, Lq, D, generator=g).half()
    k = torch.randn(B, Hkv, Lk, D, generator=g).half()
    v = torch.randn(B, Hkv, Lk, Dv, generator=g).half()
    b, n = head_params(Hq, device="cpu") if "ssa" in mode else (None, None)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), b, n


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["gqa_causal_float16_mask", "transposed_bool_mask", "dropout_gqa_causal",
                                  "window_causal_bool_mask", "window_two_sided"])
def test_emulated_cuda_backend_through_public_api(emulator, mode, case, monkeypatch):
    """ssa_flash.*(backend="cuda") on CPU float16 tensors: padding of odd head dims (30, 20),
    non-contiguous inputs, masks, GQA, LSE gradients, db/dn reduction, dropout (the seed's mask,
    ssa_flash.dropout_mask, given to the reference), local windows; held to FlashAttention's rule
    against the float64 reference, and the emulated kernels did run."""
    q, k, v, b, n = _half_case(mode, transpose=case.startswith("transposed"))
    Lq, Lk = q.shape[2], k.shape[2]
    g = torch.Generator().manual_seed(7)
    if case.startswith("gqa"):
        mask = torch.randn(2, 1, 1, Lk, generator=g).half()
        kw = dict(attn_mask=mask, is_causal=True, enable_gqa=True)
    elif case.startswith("transposed"):
        mask = torch.rand(Lq, Lk, generator=g) > 0.3
        mask[4] = False
        kw = dict(attn_mask=mask, enable_gqa=True)
    elif case.startswith("window_causal"):
        mask = torch.rand(Lq, Lk, generator=g) > 0.3
        kw = dict(attn_mask=mask, is_causal=True, enable_gqa=True, window_size=(9, -1))
    elif case.startswith("window"):
        kw = dict(enable_gqa=True, window_size=(4, 7))
    else:
        kw = dict(is_causal=True, enable_gqa=True, dropout_p=0.3)
    drop_kw = {}
    if "dropout_p" in kw:
        torch.manual_seed(21)
        drop_kw = dict(dropout_mask=ssa_flash.dropout_mask((q.shape[0], q.shape[1], Lq, Lk), kw["dropout_p"]))
    calls = []
    for fn in ("fwd", "row_entropy", "bwd"):
        orig = getattr(emulator, fn)
        monkeypatch.setattr(emulator, fn, lambda *a, _o=orig, _f=fn, **k_: calls.append(_f) or _o(*a, **k_))
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=g)
    dlse = torch.randn(*q.shape[:-1], generator=g)

    def run(module, q, k, v, b, n, **extra):
        out, lse = call(module, mode, q, k, v, b, n, return_lse=True, **kw, **extra)
        loss = (out.double() * dout.double()).sum() + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse).sum()
        leaves = _leaves(q, k, v, b, n)
        return out, lse, dict(zip("qkvbn", torch.autograd.grad(loss, leaves)))

    with cuda_backend.emulated(emulator):
        torch.manual_seed(21)
        ours = run(ssa_flash, q, k, v, b, n, backend="cuda")
    assert calls.count("fwd") == 1 and calls.count("bwd") == 1
    assert calls.count("row_entropy") == (1 if "adaptive" in mode else 0)
    naive = run(reference, q, k, v, b, n, **drop_kw)
    d64 = [None if t is None else t.detach().double().requires_grad_() for t in (q, k, v, b, n)]
    gold_kw = {key: (val.double() if isinstance(val, torch.Tensor) and val.is_floating_point() else val)
               for key, val in kw.items()}
    out, lse = call(reference, mode, *d64, return_lse=True, **gold_kw, **drop_kw)
    loss = (out * dout.double()).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()
    gold = (out, lse, dict(zip("qkvbn", torch.autograd.grad(loss, _leaves(*d64)))))
    floor = FLOORS[torch.float16]
    assert ours[0].dtype == torch.float16 and ours[1].dtype == torch.float32
    fa_tolerance_check("out", ours[0], naive[0], gold[0], floor)
    finite = torch.isfinite(gold[1])
    assert torch.equal(torch.isfinite(ours[1]), finite)
    fa_tolerance_check("lse", ours[1][finite], naive[1][finite], gold[1][finite], floor)
    for name, grad in ours[2].items():
        assert grad.shape == gold[2][name].shape and torch.isfinite(grad).all(), name
        gfloor = floor * ((Lq * Lk) ** 0.5 if name in "bn" else 4)
        fa_tolerance_check(f"d{name}", grad, naive[2][name], gold[2][name], gfloor)


def test_emulated_cuda_entropy(emulator):
    q, k, _, b, n = _half_case("ssa")
    q, k, b, n = (t.detach() for t in (q, k, b, n))
    for kw in (dict(is_causal=True), dict(window_size=(3, 5))):
        with cuda_backend.emulated(emulator):
            ours = ssa_flash.attention_entropy(q, k, enable_gqa=True,
                                               score="ssa", score_params={"b": b, "n": n}, backend="cuda", **kw)
        gold = reference.attention_entropy(q.double(), k.double(), enable_gqa=True, score="ssa",
                                           score_params=(b.double(), n.double()), **kw)
        naive = reference.attention_entropy(q, k, enable_gqa=True, score="ssa", score_params=(b, n), **kw)
        assert ours.dtype == torch.float32 and ours.shape == gold.shape
        fa_tolerance_check("entropy", ours, naive, gold, FLOORS[torch.float16])


def test_emulated_cuda_refuses_what_the_kernels_do_not_run(emulator):
    q = torch.randn(1, 2, 8, 16)
    with cuda_backend.emulated(emulator):
        with pytest.raises(ssa_flash.BackendUnavailableError, match="float16 or bfloat16"):
            ssa_flash.ssa_attention(q, q, q, backend="cuda")
    with pytest.raises(ssa_flash.BackendUnavailableError, match="cuda"):
        ssa_flash.ssa_attention(q.half(), q.half(), q.half(), backend="cuda")


def test_former_entry_point_runs_through_the_ops(emulator, monkeypatch):
    """ssa_flash.cuda.CudaAttentionFunction.apply(..., ext) (tests/emu_harness.py's entry point)
    goes through ssa_flash.autograd (the eager path's autograd.Function), and its backward, run
    after the call returned, still uses the emulator it was given."""
    q, k, v, b, n = _half_case("ssa_adaptive", D=32, Dv=32)
    seen = []
    orig = cuda_backend.backward

    def spy(*args):
        seen.append(cuda_backend.active_emulator())
        return orig(*args)

    out, lse = ssa_flash.cuda.CudaAttentionFunction.apply(q, k, v, b, n, None, 32 ** -0.5, True, 2, True,
                                                          (-0.037, 0.481, -2.3, 4.917, -1.791), 0.5, emulator)
    assert "CompiledFunction" not in type(out.grad_fn).__name__ and "EagerAttention" in type(out.grad_fn).__name__
    monkeypatch.setattr(cuda_backend, "backward", spy)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v, b, n))
    assert seen == [emulator]
    assert cuda_backend.active_emulator() is None
    ref = reference.attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True,
                              score="ssa", score_params=(b.double(), n.double()), adaptive_temperature=True)
    assert (out.double() - ref).abs().max() < 1e-2
    assert all(torch.isfinite(g).all() for g in grads)
