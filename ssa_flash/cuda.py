"""The CUDA C++ backend (csrc/): loads the compiled extension and wraps it for autograd.

The extension ``ssa_flash._C`` is built by ``pip install --no-build-isolation .`` when a CUDA
toolkit and a CUDA-enabled torch are present. Without it, the first ``backend="cuda"`` call
JIT-compiles the same sources once with ``torch.utils.cpp_extension.load`` (cached by torch in
``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) or raises
``BackendUnavailableError`` saying why it cannot.

What the kernels run (anything else raises ``BackendUnavailableError``, see :func:`supports`):
float16 (sm_70+) and bfloat16 (sm_80+) CUDA tensors; head dims up to 256 (compiled for 32, 64,
96, 128, 256, others zero-padded); any strides (copies are made where the head dim is not
contiguous, not a multiple of 8, or rows are not 16-byte aligned); boolean or additive masks of
any strides; causal; GQA; softmax or SSA logits, fixed or adaptive temperature. The backward is
always deterministic (no atomics: db/dn are per-block partial sums reduced in a fixed order).

Interface used by :mod:`ssa_flash.ops`: :func:`is_available`, :func:`unavailable_reason`,
:func:`supports`, :func:`attention`, :func:`entropy`; for ``backend="auto"``, :func:`ready`
(nothing to compile) and :func:`preferred_backend` (which of the CUDA and Triton backends is
faster on this GPU, measured once).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import threading
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from . import temperature

__all__ = [
    "is_available",
    "ready",
    "unavailable_reason",
    "supports",
    "attention",
    "entropy",
    "preferred_backend",
    "load_extension",
]

MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2

# nvcc flags of the JIT build (keep in step with setup.py)
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]

_HERE = Path(__file__).resolve().parent
_lock = threading.Lock()
_ext = None
_ext_error: Optional[str] = None


def _unavailable(msg: str) -> Exception:
    from .ops import BackendUnavailableError  # lazily: ops imports this module lazily too

    return BackendUnavailableError(msg)


# --------------------------------------------------------------------------------------------
# Finding, building and loading the extension


def source_dir() -> Optional[Path]:
    """csrc/ of a source checkout, or the copy shipped inside an installed package."""
    for d in (_HERE.parent / "csrc", _HERE / "_csrc"):
        if (d / "api.cpp").is_file():
            return d
    return None


def _prebuilt() -> bool:
    try:
        return importlib.util.find_spec("ssa_flash._C") is not None
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _ninja_available() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available

        return bool(is_ninja_available())
    except Exception:
        return False


def _build_blocker() -> Optional[str]:
    """Why the extension cannot be JIT-compiled in this environment, or None."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if source_dir() is None:
        return "the csrc/ sources are not found next to the package"
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception as err:  # pragma: no cover - broken torch install
        return f"torch.utils.cpp_extension is unusable ({err})"
    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    if not _ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def _jit_build():
    from torch.utils.cpp_extension import load

    src = source_dir()
    sources = sorted(str(p) for p in src.glob("*.cu")) + [str(src / "api.cpp")]
    return load(name="ssa_flash_cuda_ext", sources=sources, extra_include_paths=[str(src)],
                extra_cflags=["-O3"], extra_cuda_cflags=list(NVCC_FLAGS),
                verbose=os.environ.get("SSA_FLASH_VERBOSE_BUILD", "0") not in ("", "0"))


def load_extension():
    """The extension module: the prebuilt ``ssa_flash._C``, else a JIT build (once per process;
    torch caches the build on disk). Raises ``BackendUnavailableError`` saying why it cannot."""
    global _ext, _ext_error
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        if _ext_error is not None:
            raise _unavailable(_ext_error)
        try:
            from . import _C as ext  # type: ignore[attr-defined]
        except ImportError as err:
            prebuilt = "not built" if isinstance(err, ModuleNotFoundError) else f"not importable ({err})"
            blocker = _build_blocker()
            if blocker is not None:
                _ext_error = (f"the CUDA extension ssa_flash._C is {prebuilt} and cannot be JIT-compiled: "
                              f"{blocker}")
                raise _unavailable(_ext_error) from None
            try:
                ext = _jit_build()
            except Exception as build_err:
                _ext_error = (f"the CUDA extension ssa_flash._C is {prebuilt} and its JIT build failed: "
                              f"{type(build_err).__name__}: {build_err}")
                raise _unavailable(_ext_error) from build_err
        _ext = ext
        return ext


def _device_reason(device: Optional[torch.device]) -> Optional[str]:
    if device is not None and device.type != "cuda":
        return f"tensors are on {device}; the CUDA kernels need CUDA tensors"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (7, 0):
        return f"the GPU is sm_{major}{minor}; the CUDA kernels need sm_70 or newer (mma.sync)"
    return None


def _reason(device: Optional[torch.device]) -> Optional[str]:
    why = _device_reason(device)
    if why is not None or _ext is not None:
        return why
    if _ext_error is not None:
        return _ext_error
    if _prebuilt():
        return None
    blocker = _build_blocker()
    if blocker is not None:
        return f"the CUDA extension ssa_flash._C is not built and cannot be JIT-compiled: {blocker}"
    return None


def is_available() -> bool:
    """True when a CUDA device (sm_70+) is present and the extension is built or buildable.
    Cheap (no build, no kernel launch) and never raises."""
    try:
        return _reason(None) is None
    except Exception:
        return False


def ready() -> bool:
    """True when the extension is loaded or prebuilt, i.e. using it compiles nothing. For
    ``backend="auto"``: prefer the CUDA backend only then (a JIT build takes minutes)."""
    try:
        return _ext is not None or (_ext_error is None and _prebuilt())
    except Exception:
        return False


def unavailable_reason(device) -> str:
    """Why ``backend="cuda"`` cannot run on ``device`` (empty string if it can)."""
    try:
        return _reason(torch.device(device)) or ""
    except Exception as err:
        return f"the CUDA backend could not be probed ({type(err).__name__}: {err})"


# --------------------------------------------------------------------------------------------
# What the kernels accept

def _padded_head_dim(d: int) -> int:
    for p in (32, 64, 96, 128, 256):
        if d <= p:
            return p
    return -1


def _smem_bytes(d: int, adaptive: bool, sm70: bool = False) -> int:
    """Largest dynamic shared memory of the kernels for padded head dim d (mirrors csrc/traits.h;
    ``sm70``: the Volta code path's extra per-warp buffers)."""
    row = (d + 8) * 2
    fwd_m, fwd_n = (128 if d <= 128 else 64), (64 if d <= 64 else 32)
    fwd = (fwd_m + 2 * fwd_n) * row + (4 * (fwd_m // 64) * 16 * (fwd_n + 8) * 2 if sm70 else 0)
    dq_m, dq_n = (64 if d <= 128 else 32), (64 if d <= 64 else 32 if d <= 128 else 16)
    dq = (2 * dq_m + 3 * dq_n) * row + ((dq_m // 16) * 16 * (dq_n + 8) * 2 if sm70 else 0)
    kv_n, kv_m = (64 if d <= 128 else 32), 32
    kv_warps = kv_n // 16 * (1 if d <= 128 else 2)
    dkdv = ((2 * kv_n + 3 * kv_m) * row + 2 * (6 if adaptive else 2) * kv_m * 4
            + (kv_warps * 16 * (kv_m + 8) * 2 if sm70 else 0))
    return max(fwd, dq, dkdv)


def supports(query, key, value, adaptive: bool = False) -> Optional[str]:
    """None if the CUDA kernels can run these inputs on their device, else the reason (a
    sentence). Looks at dtypes, shapes and the device only (no synchronisation)."""
    why = _device_reason(query.device)
    if why is not None:
        return why
    if query.dtype not in SUPPORTED_DTYPES:
        return f"the CUDA kernels take float16 or bfloat16 inputs, got {query.dtype}"
    major, minor = torch.cuda.get_device_capability(query.device)
    if query.dtype == torch.bfloat16 and major < 8:
        return f"bfloat16 needs sm_80 or newer, this GPU is sm_{major}{minor}"
    d = max(query.shape[-1], value.shape[-1])
    if d > MAX_HEAD_DIM:
        return f"the CUDA kernels support head dims up to {MAX_HEAD_DIM}, got {d}"
    if query.shape[0] > 65535 or query.shape[1] > 65535:
        return "batch and heads must each be at most 65535"
    optin = getattr(torch.cuda.get_device_properties(query.device), "shared_memory_per_block_optin", None)
    need = _smem_bytes(_padded_head_dim(d), adaptive, sm70=(major, minor) < (7, 5))
    if optin and need > optin:
        return (f"head dim {d} needs {need} bytes of shared memory per block, this GPU allows {optin} "
                "(see docs/cuda.md)")
    return None


# --------------------------------------------------------------------------------------------
# Layout preparation


def _round8(d: int) -> int:
    return (d + 7) // 8 * 8


def _kernel_layout(x: torch.Tensor) -> bool:
    if x.stride(-1) != 1 or x.data_ptr() % 16 != 0:
        return False
    return all(size == 1 or stride % 8 == 0 for size, stride in zip(x.shape[:-1], x.stride()[:-1]))


def _prep(x: torch.Tensor, width: int) -> torch.Tensor:
    """x with head dim zero-padded to ``width`` (a multiple of 8), unit stride along it and rows
    16-byte aligned; a copy only where needed."""
    if x.shape[-1] != width:
        return F.pad(x, (0, width - x.shape[-1])).contiguous()
    return x if _kernel_layout(x) else x.contiguous()


def _prep_mask(mask: Optional[torch.Tensor]):
    """(tensor, kind): bool masks as a uint8 view, float masks as float32; broadcast (zero-stride)
    dims stay broadcast (the conversion runs on the compact tensor)."""
    if mask is None:
        return None, MASK_NONE
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), MASK_BOOL
    if mask.dtype != torch.float32:
        sizes = [1 if st == 0 else sz for sz, st in zip(mask.shape, mask.stride())]
        compact = mask.as_strided(sizes, mask.stride()).to(torch.float32)
        mask = compact.expand(mask.shape)
    return mask, MASK_ADD


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _on_device(device: torch.device):
    """Makes ``device`` current for the launches (the binding launches on the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_supported(q, k, v, adaptive):
    why = supports(q, k, v, adaptive)
    if why is not None:
        raise _unavailable(f"backend='cuda' cannot run these inputs: {why}")


# --------------------------------------------------------------------------------------------
# Autograd


class CudaAttentionFunction(torch.autograd.Function):
    """Inputs as :func:`attention`; returns ``(out, lse)``, differentiable in q, k, v, b, n.
    ``ext`` is the extension module (or anything with its ``fwd``/``stats``/``bwd``: the CPU
    emulation of csrc/emu drives this same code in tests/test_csrc_compile.py)."""

    @staticmethod
    def forward(ctx, q, k, v, b, n, mask, scale: float, causal: bool, group: int,
                adaptive: bool, poly: Sequence[float], threshold: float, ext=None):
        ext = ext if ext is not None else load_extension()
        d8, dv8 = _round8(q.shape[-1]), _round8(v.shape[-1])
        qp, kp, vp = _prep(q, d8), _prep(k, d8), _prep(v, dv8)
        mask_t, kind = _prep_mask(mask)
        bf = b.float().contiguous() if b is not None else None
        nf = n.float().contiguous() if n is not None else None
        beta = lse_l = ent = dbeta_dh = None
        with _on_device(q.device):
            stream = _stream(q.device)
            if adaptive:
                ent, lse_l = ext.stats(qp, kp, mask_t, kind, bf, nf, scale, causal, group, stream)
                beta, dbeta_dh = temperature.beta_from_entropy(ent, poly, threshold)
                beta, dbeta_dh = beta.contiguous(), dbeta_dh.contiguous()
            o, lse = ext.fwd(qp, kp, vp, mask_t, kind, bf, nf, beta, scale, causal, group, stream)
        ctx.save_for_backward(qp, kp, vp, o, lse, bf, nf, mask_t, beta, lse_l, ent, dbeta_dh)
        ctx.args = (kind, scale, causal, group, q.shape[-1], v.shape[-1])
        ctx.ext = ext
        ctx.set_materialize_grads(False)
        out = o if o.shape[-1] == v.shape[-1] else o[..., : v.shape[-1]].contiguous()
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        qp, kp, vp, o, lse, bf, nf, mask_t, beta, lse_l, ent, dbeta_dh = ctx.saved_tensors
        kind, scale, causal, group, d, dv = ctx.args
        ext = ctx.ext
        if dout is None:
            dout = torch.zeros_like(o)
        else:
            dout = _prep(dout.to(o.dtype), o.shape[-1])
        if dlse is not None:
            dlse = dlse.float().contiguous()
        with _on_device(qp.device):
            dq, dk, dvv, db_part, dn_part = ext.bwd(
                dout, qp, kp, vp, o, lse, dlse, mask_t, kind, bf, nf, beta, lse_l, ent, dbeta_dh,
                scale, causal, group, _stream(qp.device))
        dq = dq[..., :d] if dq.shape[-1] != d else dq
        dk = dk[..., :d] if dk.shape[-1] != d else dk
        dvv = dvv[..., :dv] if dvv.shape[-1] != dv else dvv
        db = dn = None
        if bf is not None:
            db = db_part.sum(dim=(0, 2))
            dn = dn_part.sum(dim=(0, 2))
        return dq, dk, dvv, db, dn, None, None, None, None, None, None, None, None


def attention(q, k, v, b, n, mask, scale: float, causal: bool, group: int, adaptive: bool,
              poly: Sequence[float], threshold: float, deterministic: bool = False):
    """``(out, lse)`` through the CUDA kernels, differentiable in q, k, v, b, n.

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), any strides; b, n None (softmax) or
    (Hq,) float32; mask None or a bool / float tensor expanded to (B, Hq, Lq, Lk). The backward is
    deterministic whatever ``deterministic`` says."""
    _check_supported(q, k, v, adaptive)
    ext = load_extension()
    return CudaAttentionFunction.apply(q, k, v, b, n, mask, float(scale), bool(causal), int(group),
                                       bool(adaptive), tuple(float(c) for c in poly), float(threshold),
                                       ext)


def entropy(q, k, mask, b, n, scale: float, causal: bool, group: int) -> torch.Tensor:
    """Per-row entropy (natural log) of ``softmax(l)``, (B, Hq, Lq) float32; 0 for empty rows."""
    _check_supported(q, k, k, False)
    ext = load_extension()
    d8 = _round8(q.shape[-1])
    mask_t, kind = _prep_mask(mask)
    bf = b.float().contiguous() if b is not None else None
    nf = n.float().contiguous() if n is not None else None
    with torch.no_grad(), _on_device(q.device):
        ent, _ = ext.stats(_prep(q, d8), _prep(k, d8), mask_t, kind, bf, nf, float(scale),
                           bool(causal), int(group), _stream(q.device))
    return ent


# --------------------------------------------------------------------------------------------
# backend="auto": which backend is faster on this GPU

_preferred: dict = {}


def _cache_file() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ssa_flash" / "auto_backend.json"


def _time_ms(fn, reps: int = 5) -> float:
    fn()  # warm-up (compilation, autotuning)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _measure(device: torch.device) -> str:
    from . import ops

    if not ops._triton_importable():
        return "cuda"
    dtype = torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (2, 8, 2048, 64)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    times = {}
    for backend in ("cuda", "triton"):
        def step():
            out = ops.ssa_attention(q, k, v, is_causal=True, backend=backend)
            torch.autograd.grad(out, (q, k, v), dout)
        try:
            times[backend] = _time_ms(step)
        except Exception:
            times[backend] = float("inf")
    return min(times, key=times.get)


def preferred_backend(device) -> str:
    """``"cuda"`` or ``"triton"``: whichever runs an SSA forward+backward (B=2, H=8, L=2048, D=64,
    causal) faster on this GPU model. Measured once per GPU model and cached in memory and in
    ``~/.cache/ssa_flash/auto_backend.json``; ``SSA_FLASH_AUTO_BACKEND=cuda|triton`` overrides.
    Only meaningful when both backends are available on ``device``."""
    forced = os.environ.get("SSA_FLASH_AUTO_BACKEND", "").strip().lower()
    if forced in ("cuda", "triton"):
        return forced
    device = torch.device(device)
    name = torch.cuda.get_device_name(device)
    if name in _preferred:
        return _preferred[name]
    path = _cache_file()
    try:
        cached = json.loads(path.read_text())
    except Exception:
        cached = {}
    key = f"{name}|torch {torch.__version__}"
    if cached.get(key) in ("cuda", "triton"):
        _preferred[name] = cached[key]
        return cached[key]
    choice = _measure(device)
    _preferred[name] = choice
    try:
        cached[key] = choice
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    except Exception:
        pass
    return choice
