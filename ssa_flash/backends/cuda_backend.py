"""The CUDA C++ backend: :class:`~ssa_flash.spec.Backend` over the extension built from
``csrc/``, with everything the extension leaves to its caller: zero-padding of head dims to a
multiple of 8, strides and alignment, mask conversion, the CUDA device and stream, and the
reduction of the per-block db/dn partial sums.

The extension ``ssa_flash._C`` is built by ``pip install --no-build-isolation .`` when a CUDA
toolkit and a CUDA-enabled torch are present. Without it, the first ``backend="cuda"`` call
JIT-compiles the same sources once with ``torch.utils.cpp_extension.load`` (cached by torch in
``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``) or raises
``BackendUnavailableError`` saying why it cannot.

What the kernels run (anything else: :func:`supports` says why): float16 (sm_70+) and bfloat16
(sm_80+) CUDA tensors; head dims up to 256 (compiled for 32, 64, 96, 128, 256, others
zero-padded); any strides (copies are made where the head dim is not contiguous, not a multiple of
8, or rows are not 16-byte aligned); boolean or additive masks of any strides; causal; GQA;
the score functions of ``KERNEL_SCORES`` (softmax, SSA, logit scale), fixed or adaptive
temperature; attention sinks and logit soft-capping
(kernels compiled with them only for calls that use them). The backward is one fused kernel after a
pre-pass (FlashAttention-2's five GEMMs per tile, dQ accumulated with float32 atomics) where the
device and head dim allow it, and the two-kernel path (dQ kernel, dK/dV kernel, no atomics) with
``deterministic=True`` or elsewhere; the score parameters' gradients are per-block partial sums
reduced in a fixed order either way. A built extension runs on the GPUs its shared object holds code for (cubins of the
GPU's major version, or PTX of an older architecture, ``_cuda_build``); elsewhere
:func:`supports` and :func:`unavailable_reason` say so rather than a launch failing.

Testing without a GPU: inside ``with emulated(ext):`` CPU tensors run through ``ext``, any object
with the extension's ``fwd``/``row_entropy``/``bwd`` (``tests/emu_harness.py``'s ``Emulator``: the real
kernels compiled for the host against an emulation of the CUDA execution model), through this
module's glue and the package's custom ops like CUDA tensors through the real extension.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import threading
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import scores
from ..conventions import NO_WINDOW, dropout_keep_threshold, dropout_scale, kernel_window
from ..errors import BackendUnavailableError
from . import _cuda_build, cuda_fwd_choice
from .temperature import beta_from_entropy as _beta_from_entropy
from ._compile import constant_for_compile
from ..spec import AttentionSpec, TemperatureState

__all__ = [
    "NAME",
    "VERIFIED_ARCHS",
    "unavailable_reason",
    "supports",
    "row_entropy",
    "forward",
    "backward",
    "is_available",
    "ready",
    "verified",
    "load_extension",
    "source_dir",
    "emulated",
    "active_emulator",
    "load_state",
]

NAME = "cuda"
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)

# Where the CUDA backend has been verified on hardware: compute capability -> what was run there.
# backend="auto" prefers the CUDA backend over Triton on an architecture (and dtype) only once it
# is listed here. A GPU session adds an entry after tests/cuda/test_cuda_backend.py passed in full on
# that GPU (compute-sanitizer included) and the benchmark showed the CUDA backend at least as fast
# as Triton there, e.g.
#     (9, 0): {"dtypes": ("float16", "bfloat16"),
#              "evidence": "2025-01-31 H100 SXM, commit abc1234: test_cuda_backend 512 passed; "
#                          "bench/results/2025-01-31-h100.json"},
# and updates the table in docs/cuda.md. No entry yet: no GPU run has checked the CUDA kernels
# (docs/verified.md).
VERIFIED_ARCHS: Dict[Tuple[int, int], Dict[str, object]] = {}

# nvcc flags of the JIT build (keep in step with setup.py)
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]

_PACKAGE = Path(__file__).resolve().parent.parent
_lock = threading.Lock()
_ext = None
_ext_error: Optional[str] = None
_emulators: list = []  # stack of the extensions that `emulated` installed for CPU tensors


# --------------------------------------------------------------------------------------------
# The CPU emulation hook (tests)


@contextlib.contextmanager
def emulated(ext):
    """Within the block, CPU tensors given to this backend run through ``ext`` (an object with the
    extension's ``fwd``, ``row_entropy`` and ``bwd``, e.g. ``tests/emu_harness.py``'s ``Emulator``), and
    ``backend="cuda"`` is available for CPU tensors. ``ext=None`` changes nothing. The custom ops'
    autograd formula re-enters the emulator of the forward for the backward, so a backward run
    after the block ends still uses it. Never chosen by ``backend="auto"``."""
    if ext is None:
        yield
        return
    _emulators.append(ext)
    try:
        yield
    finally:
        _emulators.pop()


def active_emulator():
    """The extension object of the innermost :func:`emulated` block, or None."""
    return _emulators[-1] if _emulators else None


# --------------------------------------------------------------------------------------------
# Finding, building and loading the extension


def source_dir() -> Optional[Path]:
    """csrc/ of a source checkout, or the copy shipped inside an installed package."""
    for d in (_PACKAGE.parent / "csrc", _PACKAGE / "_csrc"):
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


def jit_arch_list() -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST for a JIT build: the user's, with a plain ``9.0`` built as ``9.0a``
    (warned), or when none is set the visible GPUs' architectures, an sm_90 one as ``9.0a``
    (torch's default would build plain sm_90 code, without the kernels' wgmma path). None without
    a GPU and without a user list (torch then decides)."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given:
        archs, notes = _cuda_build.normalize_arch_list(given)
        for note in notes:
            warnings.warn(f"ssa_flash CUDA JIT build: {note}", stacklevel=2)
        return archs
    if not torch.cuda.is_available():
        return None
    archs = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{ma}.{mi}{'a' if (ma, mi) == (9, 0) else ''}" for ma, mi in archs) or None


def _jit_build():
    from torch.utils.cpp_extension import load

    src = source_dir()
    sources = sorted(str(p) for p in src.glob("*.cu")) + [str(src / "api.cpp")]
    archs = jit_arch_list()
    old = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    try:
        return load(name="ssa_flash_cuda_ext", sources=sources, extra_include_paths=[str(src)],
                    extra_cflags=["-O3"], extra_cuda_cflags=[*NVCC_FLAGS, *_cuda_build.hopper_fwd_flags(archs or "")],
                    verbose=os.environ.get("SSA_FLASH_VERBOSE_BUILD", "0") not in ("", "0"))
    finally:
        if archs:
            if old is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = old


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
            raise BackendUnavailableError(_ext_error)
        try:
            from .. import _C as ext  # type: ignore[attr-defined]
        except ImportError as err:
            prebuilt = "not built" if isinstance(err, ModuleNotFoundError) else f"not importable ({err})"
            blocker = _build_blocker()
            if blocker is not None:
                _ext_error = (f"the CUDA extension ssa_flash._C is {prebuilt} and cannot be JIT-compiled: "
                              f"{blocker}")
                raise BackendUnavailableError(_ext_error) from None
            try:
                ext = _jit_build()
            except Exception as build_err:
                _ext_error = (f"the CUDA extension ssa_flash._C is {prebuilt} and its JIT build failed: "
                              f"{type(build_err).__name__}: {build_err}")
                raise BackendUnavailableError(_ext_error) from build_err
        _ext = ext
        return ext


def _extension(device: torch.device):
    if device.type == "cuda":
        return load_extension()
    ext = active_emulator()
    if ext is None:
        raise BackendUnavailableError(f"backend='cuda' is unavailable: {_device_reason(device)}")
    return ext


# --------------------------------------------------------------------------------------------
# Availability


@constant_for_compile
def _capability(device: torch.device) -> Tuple[int, int, int]:
    """``(major, minor, opt-in shared memory per block in bytes or 0)`` of a CUDA device, or
    ``(0, 0, 0)`` when CUDA is unavailable. A constant for torch.compile (read once while tracing,
    so no device query lands in a graph)."""
    if not torch.cuda.is_available():
        return 0, 0, 0
    major, minor = torch.cuda.get_device_capability(device)
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0) or 0
    return int(major), int(minor), int(optin)


def _extension_file() -> Optional[str]:
    """The shared object of the loaded or prebuilt extension, without importing or building it
    (None when there is none yet)."""
    if _ext is not None:
        return getattr(_ext, "__file__", None)
    if _ext_error is not None:
        return None
    try:
        spec = importlib.util.find_spec("ssa_flash._C")
    except Exception:
        return None
    return spec.origin if spec is not None else None


@functools.lru_cache(maxsize=None)
def _image_reason_for(path: str, major: int, minor: int) -> Optional[str]:
    # (by path: the file of a loaded module does not change under it; a reinstall needs a restart)
    return _cuda_build.image_reason((major, minor), _cuda_build.fatbin_images(path))


@constant_for_compile
def _image_reason(device: torch.device) -> Optional[str]:
    """Why the built extension has no kernel image that runs on ``device`` (a CUDA device), read
    from the fat binaries in its shared object (cubins and PTX with their architectures), or None
    (also when nothing is built yet, or the file holds no fat binary this can read). A launch
    without an image fails with "no kernel image is available for execution on the device"."""
    path = _extension_file()
    if not path:
        return None
    major, minor, _ = _capability(device)
    if major == 0:
        return None
    return _image_reason_for(path, major, minor)


def _device_reason(device: Optional[torch.device]) -> Optional[str]:
    if device is not None and device.type == "cpu" and active_emulator() is not None:
        return None
    if device is not None and device.type != "cuda":
        return f"tensors are on {device}; the CUDA kernels need CUDA tensors"
    major, minor, _ = _capability(device if device is not None else torch.device("cuda"))
    if major == 0:
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    if (major, minor) < (7, 0):
        return (f"the GPU is sm_{major}{minor}; the CUDA kernels need sm_70 or newer (float16; "
                "bfloat16 needs sm_80)")
    return None


def _reason(device: Optional[torch.device]) -> Optional[str]:
    why = _device_reason(device)
    if why is not None:
        return why
    if device is not None and device.type == "cpu":  # emulated
        return None
    why = _image_reason(device if device is not None else torch.device("cuda"))
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


def unavailable_reason(device: torch.device) -> Optional[str]:
    try:
        return _reason(torch.device(device))
    except Exception as err:
        return f"the CUDA backend could not be probed ({type(err).__name__}: {err})"


def is_available() -> bool:
    """True when a CUDA device (sm_70+) is present and the extension is built or buildable.
    Cheap (no build, no kernel launch) and never raises."""
    try:
        return _reason(None) is None
    except Exception:
        return False


def load_state() -> tuple:
    """Changes whenever the answers of :func:`unavailable_reason` and :func:`ready` may change in
    this process: the extension loaded or failed, an emulator entered or left."""
    return (_ext is not None, _ext_error, len(_emulators))


def ready() -> bool:
    """True when the extension is loaded or prebuilt, i.e. using it compiles nothing."""
    try:
        return _ext is not None or (_ext_error is None and _prebuilt())
    except Exception:
        return False


def verified(device: torch.device, dtype: torch.dtype) -> bool:
    """True when :data:`VERIFIED_ARCHS` lists ``device``'s architecture for ``dtype``."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    major, minor, _ = _capability(device)
    entry = VERIFIED_ARCHS.get((major, minor))
    return entry is not None and str(dtype).replace("torch.", "") in entry.get("dtypes", ())


# --------------------------------------------------------------------------------------------
# What the kernels accept


def _padded_head_dim(d: int) -> int:
    for p in (32, 64, 96, 128, 256):
        if d <= p:
            return p
    return -1


def _code_path(major: int, minor: int) -> int:
    """csrc/traits.h's code_path: 0 sm_70, 1 sm_75, 2 sm_80+, 3 sm_90."""
    arch = major * 100 + minor * 10
    return 0 if arch < 750 else 1 if arch < 800 else 3 if arch == 900 else 2


def _smem_bytes(d: int, adaptive: bool, path: int = 2) -> int:
    """Largest dynamic shared memory of the kernels for padded head dim d on code path ``path``
    (0 sm_70, 1 sm_75, 2 sm_80+, 3 sm_90; mirrors csrc/traits.h: the Volta code path adds
    per-warp buffers; on sm_90 every kernel may run with 128-byte-swizzled tiles at D = 64 / 128,
    plus 1024 bytes to align them)."""
    sm70 = path == 0
    row = (d + 8) * 2
    fwd_m, fwd_n = (128 if d <= 128 else 64), (64 if d <= 64 else 32)
    fwd = (fwd_m + 2 * fwd_n) * row + (4 * (fwd_m // 64) * 16 * (fwd_n + 8) * 2 if sm70 else 0)
    fwd_drop = 4 * 32 * 8  # dropout flags, 8 bytes per thread (fwd_drop_bytes)
    dq_m, dq_n = (64 if d <= 128 else 32), (64 if d <= 64 else 32 if d <= 128 else 16)
    dq = (2 * dq_m + 3 * dq_n) * row + ((dq_m // 16) * 16 * (dq_n + 8) * 2 if sm70 else 0)
    if path == 3 and d in (64, 128):  # traits.h fwd_wgmma / dq_wgmma, sw128_tile_bytes
        fwd = max(fwd, (fwd_m + 2 * fwd_n) * (d // 64) * 128 + 1024)
        dq = max(dq, (2 * dq_m + 3 * dq_n) * (d // 64) * 128 + 1024)
    fwd += fwd_drop
    kv_n, kv_m = (64 if d <= 128 else 32), 32
    kv_warps = kv_n // 16 * (1 if d <= 128 else 2)
    stats = 2 * (6 if adaptive else 2) * kv_m * 4
    drop = 8 * 32 * 4  # a word of dropout flags per thread, up to 8 warps (key_block_drop_bytes)
    dkdv = ((2 * kv_n + 3 * kv_m) * row + stats
            + (kv_n * (kv_m + 8) * 2 if d > 64 and path >= 2 else 0)  # dS^T (dkdv_stores_ds)
            + (kv_warps * 16 * (kv_m + 8) * 2 if sm70 else 0) + drop)
    if path == 3 and d in (64, 128):  # traits.h bwd_wgmma: swizzled tiles, no dS^T
        dkdv = max(dkdv, (2 * kv_n + 3 * kv_m) * (d // 64) * 128 + stats + drop + 1024)
    return max(fwd, dq, dkdv)


#: the score functions the kernels are compiled for, by registry name: every registered one
#: (csrc/dispatch.h's list of csrc/logits.h's policies; tests/cuda/test_csrc_compile.py holds that
#: list to the registry, so a score function enters the registry with its CUDA C++ policy)
KERNEL_SCORES = tuple(scores.SCORES)


def _feature_reason(spec: AttentionSpec, sinks=None) -> Optional[str]:
    """Why the kernels cannot compute ``spec`` (with ``sinks``), or None."""
    if spec.score not in KERNEL_SCORES:
        return (f"the CUDA C++ kernels have no policy for score function {spec.score!r} "
                f"(they implement {', '.join(KERNEL_SCORES)}; csrc/logits.h)")
    if spec.dropout_p > 0 and spec.dropout_rng is None:
        return "dropout_p > 0 needs the (seed, offset) tensor spec.dropout_rng"
    return None


def _refuse_unsupported(spec: AttentionSpec, sinks=None) -> None:
    """Direct callers of the backend functions get an error instead of a silently ignored option."""
    why = _feature_reason(spec, sinks)
    if why is not None:
        raise ValueError(f"ssa_flash CUDA backend: {why}")


def supports(q, k, v, spec: AttentionSpec, sinks=None) -> Optional[str]:
    if spec.packed or spec.kv_cache:
        return ("the CUDA C++ kernels do not implement packed variable-length batches or KV-cache "
                "decoding (varlen_attention, attention_with_kvcache): use backend='triton'")
    why = _device_reason(q.device)
    if why is not None:
        return why
    if q.dtype not in SUPPORTED_DTYPES:
        return f"the CUDA kernels take float16 or bfloat16 inputs, got {q.dtype}"
    d = max(q.shape[-1], v.shape[-1])
    if d > MAX_HEAD_DIM:
        return f"the CUDA kernels support head dims up to {MAX_HEAD_DIM}, got {d}"
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return "batch and heads must each be at most 65535"
    why = _feature_reason(spec, sinks)
    if why is not None:
        return why
    if q.device.type != "cuda":  # emulated: no hardware limits
        return None
    why = _image_reason(q.device)
    if why is not None:
        return why
    major, minor, optin = _capability(q.device)
    if q.dtype == torch.bfloat16 and major < 8:
        return f"bfloat16 needs sm_80 or newer, this GPU is sm_{major}{minor}"
    need = _smem_bytes(_padded_head_dim(d), spec.adaptive, _code_path(major, minor))
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
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):  # (a loop: no generator's Python frames)
        if size != 1 and stride % 8 != 0:
            return False
    return True


def _prep(x: torch.Tensor, width: int) -> torch.Tensor:
    """x with head dim zero-padded to ``width`` (a multiple of 8), unit stride along it and rows
    16-byte aligned; a copy only where needed."""
    if x.shape[-1] != width:
        return F.pad(x, (0, width - x.shape[-1])).contiguous()
    return x if _kernel_layout(x) else x.contiguous()


def _unpad(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else x[..., :width].contiguous()


def _prep_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mask as the kernels take it (its kind is its dtype): bool as is, float masks as float32;
    broadcast (zero-stride) dims stay broadcast (the conversion runs on the compact tensor)."""
    if mask is None or mask.dtype in (torch.bool, torch.float32):
        return mask
    sizes = [1 if st == 0 else sz for sz, st in zip(mask.shape, mask.stride())]
    compact = mask.as_strided(sizes, mask.stride()).to(torch.float32)
    return compact.expand(mask.shape)


def _score_params(params, spec: AttentionSpec) -> list:
    """The score function's per-head parameters as the kernels take them: (Hq,) contiguous
    float32 each, in the registry's order (``ssa_flash.scores``); a wrong count is a ValueError."""
    names = spec.score_fn.params
    params = tuple(params)
    if len(params) != len(names):
        raise ValueError(f"ssa_flash CUDA backend: score function {spec.score!r} takes {len(names)} "
                         f"parameters {names}, got {len(params)}")
    return [t.float().contiguous() for t in params]


def _spec_args(spec: AttentionSpec, scale: float, sinks: Optional[torch.Tensor], len_q: int, len_k: int) -> dict:
    """The options every pass of the extension takes (csrc/api.cpp), each once, as the spec says
    them: the score function's id, the (non-negative: ``_nonnegative_scale``) scale, causal, group,
    the window (``ssa_flash.conventions.kernel_window``'s, both sides ``NO_WINDOW`` without one),
    soft-cap."""
    band = kernel_window(spec.window_left, spec.window_right, spec.causal, len_q, len_k)
    left, right = (NO_WINDOW, NO_WINDOW) if band is None else band
    return dict(sinks=None if sinks is None else sinks.float().contiguous(), score=spec.score_fn.id,
                scale=scale, causal=bool(spec.causal), group=int(spec.group),
                window_left=left, window_right=right, softcap=float(spec.softcap))


def _dropout_args(spec: AttentionSpec) -> dict:
    """The kernels' dropout as ``ssa_flash.conventions`` encodes it (the keep threshold and the
    kept weights' scale) and the (seed, offset) tensor; no tensor without dropout."""
    p = float(spec.dropout_p)
    if p > 0:
        return dict(drop_keep31=dropout_keep_threshold(p), drop_scale=dropout_scale(p), drop_rng=spec.dropout_rng)
    return dict(drop_keep31=0, drop_scale=0.0, drop_rng=None)


def _sinks_grad(sinks: torch.Tensor, lse: torch.Tensor, rowstat: torch.Tensor,
                temp: Optional[TemperatureState]) -> torch.Tensor:
    """``dsinks (Hq,)`` float32 from per-row statistics (docs/maths.md §6.2): the forward's ``lse``
    (sink included) and the backward's row-statistics workspace ``rowstat (B, Hq, stat_rows, 2 or
    6)`` (csrc/bwd_kernel.h, RowStat: delta = <dO, o> - dlse at 1, the adaptive g = dbeta dbeta/dH,
    dbeta with the sink's term, at 5). Plain: ``-sum_{b,i} P_sink delta``; adaptive:
    ``sum_{b,i} [-beta P'_sink delta - g P_sink (s - lse_l + H)]``. A per-row formula reduced by
    one torch sum over a fixed shape (deterministic); a sink of -inf gets 0."""
    lq = lse.shape[2]
    stats = rowstat[:, :, :lq]
    delta = stats[..., 1]
    s = sinks.float().view(1, -1, 1).expand_as(delta)
    finite = torch.isfinite(s)
    s0 = torch.where(finite, s, torch.zeros_like(s))
    lse = lse.float()
    if temp is None:
        term = -torch.exp(s0 - lse) * delta
    else:
        beta, lse_l, ent = temp.beta.float(), temp.lse_l.float(), temp.entropy.float()
        g = stats[..., 5]
        term = -beta * torch.exp(beta * s0 - lse) * delta - g * torch.exp(s0 - lse_l) * (s0 - lse_l + ent)
    return torch.where(finite, term, torch.zeros_like(term)).sum(dim=(0, 2))


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _on_device(device: torch.device):
    """Makes ``device`` current for the launches (the binding launches on the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# The backend interface


def _nonnegative_scale(q: torch.Tensor, scale: float) -> Tuple[torch.Tensor, float]:
    """The kernels take scale >= 0 (csrc/params.h: the forward's row max is taken on raw scores):
    a negative scale is applied as |scale| to -q, (q, scale) -> (-q, -scale); the backward then
    negates dq back (:func:`_finish_dq`)."""
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return (-q, -scale) if scale < 0 else (q, scale)


def _finish_dq(dq: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """The extension's dq as the gradient of the (padded, B, H, Lq, D) query: a float32
    (B, H, stat_rows, accum_cols) tensor is the fused backward's accumulator of dQ / scale
    (csrc/set_params.h, bwd_buffers), cropped, scaled and converted here; ``scale`` is the
    caller's (signed: -q was run for a negative one)."""
    if dq.dtype == torch.float32 and q.dtype != torch.float32:
        # crop, scale and cast in one operation (one launch, not two)
        return torch.mul(dq[:, :, : q.shape[2], : q.shape[3]], scale,
                         out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
    return -dq if scale < 0 else dq


def row_entropy(q, k, mask, params, sinks, spec: AttentionSpec):
    _refuse_unsupported(spec, sinks)
    ext = _extension(q.device)
    d8 = _round8(q.shape[-1])
    # the adaptive temperature's first pass takes the forward's kernel family (csrc/hopper/
    # fwd_row_entropy.h where the switch is on): the same choice, keyed on Q's head dim here
    _choose_fwd_kernel(ext, q, k, spec, d8, d8)
    qs, scale = _nonnegative_scale(q, float(spec.scale))
    with _on_device(q.device):
        return ext.row_entropy(_prep(qs, d8), _prep(k, d8), _prep_mask(mask), _score_params(params, spec),
                               stream=_stream(q.device), **_spec_args(spec, scale, sinks, q.shape[-2], k.shape[-2]))


# ---- the forward's kernel: today's or the sm_90a warp-specialised one (issue 48) ----
def _choose_kernel(ext, kernel: str, q, k, spec: AttentionSpec, d8: int, dv8: int) -> None:
    """Sets the extension's switch of the sm_90a ``kernel`` (``"fwd"``: csrc/api.cpp hopper_fwd;
    ``"bwd"``: hopper_bwd) where cuda_fwd_choice says what this call should run (forced, or a
    committed table row of that kernel for this architecture); leaves it otherwise (the
    environment variable SSA_FLASH_HOPPER_FWD / _BWD, read by the extension, or off). Costs nothing
    while the table has no row of that kernel and nothing is forced."""
    switch = getattr(ext, "hopper_fwd" if kernel == "fwd" else "hopper_bwd", None)
    if switch is None or not cuda_fwd_choice.may_apply(kernel):
        return
    # (the emulator's library emulates sm_90a when it holds the kernel)
    capability = _capability(q.device)[:2] if q.device.type == "cuda" else (9, 0)
    want = cuda_fwd_choice.wanted(capability, str(q.dtype).replace("torch.", ""),
                                  _padded_head_dim(max(d8, dv8)), bool(spec.causal), q.shape[-2], k.shape[-2],
                                  spec.score, bool(spec.adaptive), kernel=kernel)
    if want is not None:
        switch(want)


def _choose_fwd_kernel(ext, q, k, spec: AttentionSpec, d8: int, dv8: int) -> None:
    _choose_kernel(ext, "fwd", q, k, spec, d8, dv8)


def hopper_fwd_state(device: Optional[torch.device] = None) -> dict:
    """The extension's (or the active emulator's) sm_90a forward switch and tensor-map cache:
    ``built``, ``enabled``, ``hits``, ``misses``, ``patches``, ``entries`` (csrc/api.cpp)."""
    ext = _extension(torch.device("cuda") if device is None else torch.device(device))
    return dict(ext.hopper_fwd()) if hasattr(ext, "hopper_fwd") else dict(built=False, enabled=False)


def hopper_bwd_state(device: Optional[torch.device] = None) -> dict:
    """The extension's (or the active emulator's) sm_90a backward switch: ``built``, ``enabled``."""
    ext = _extension(torch.device("cuda") if device is None else torch.device(device))
    return dict(ext.hopper_bwd()) if hasattr(ext, "hopper_bwd") else dict(built=False, enabled=False)
# ---- end of the forward's kernel choice ----


def forward(q, k, v, mask, params, sinks, beta, spec: AttentionSpec):
    _refuse_unsupported(spec, sinks)
    ext = _extension(q.device)
    d8, dv8 = _round8(q.shape[-1]), _round8(v.shape[-1])
    _choose_fwd_kernel(ext, q, k, spec, d8, dv8)
    beta = beta.float().contiguous() if spec.adaptive else None
    qs, scale = _nonnegative_scale(q, float(spec.scale))
    with _on_device(q.device):
        o, lse = ext.fwd(_prep(qs, d8), _prep(k, d8), _prep(v, dv8), _prep_mask(mask), _score_params(params, spec),
                         beta=beta, stream=_stream(q.device), **_spec_args(spec, scale, sinks, q.shape[-2], k.shape[-2]),
                         **_dropout_args(spec))
    return _unpad(o, v.shape[-1]), lse


def backward(dout, q, k, v, out, lse, dlse, mask, params, sinks, temp: Optional[TemperatureState],
             spec: AttentionSpec, mask_grad_shape=None):
    """``(dq, dk, dv, dparams, dsinks)`` (spec.Backend.backward): the kernels' per-block partial
    sums of each parameter's gradient, (B, Hq, blocks), are summed here in a fixed order. Rows of
    a float mask's call whose LSE is huge (finite masks at ``finfo.min``) are recounted by the
    kernels (csrc/lse_residual.h), on the device. ``mask_grad_shape`` (a learned float mask, 4-D,
    dims 1 where it broadcasts): a sixth result, its float32 gradient of that shape
    (:func:`_mask_grad_buffer`)."""
    _refuse_unsupported(spec, sinks)
    ext = _extension(q.device)
    d, dv = q.shape[-1], v.shape[-1]
    d8, dv8 = _round8(d), _round8(dv)
    if spec.adaptive:
        beta, lse_l, ent, dbeta_dh = (t.float().contiguous() for t in temp)
    else:
        beta = lse_l = ent = dbeta_dh = None
    _choose_kernel(ext, "bwd", q, k, spec, d8, dv8)
    qs, scale = _nonnegative_scale(q, float(spec.scale))
    qp = _prep(qs, d8)
    # (only a learned mask's call passes dmask: every other call runs the kernels it did)
    dmask = None if mask_grad_shape is None else _mask_grad_buffer(mask, mask_grad_shape, q, k)
    with _on_device(q.device):
        dq, dk, dvv, parts, rowstat = ext.bwd(
            _prep(dout.to(q.dtype), dv8), qp, _prep(k, d8), _prep(v, dv8), _prep(out, dv8),
            lse.float().contiguous(), None if dlse is None else dlse.float().contiguous(), _prep_mask(mask),
            _score_params(params, spec), beta=beta, lse_l=lse_l, entropy=ent, dbeta_dh=dbeta_dh,
            deterministic=bool(spec.deterministic), stream=_stream(q.device),
            **_spec_args(spec, scale, sinks, q.shape[-2], k.shape[-2]),
            **_dropout_args(spec), **({} if dmask is None else {"dmask": dmask}))
        dq = _finish_dq(dq, qp, float(spec.scale))
    # (B, Hq, plan's num_partials): per query block (two-kernel path), per (key block, warp) (fused,
    # sm_90a); every slot written, summed by one reduction over a fixed shape (deterministic)
    dparams = tuple(part.sum(dim=(0, 2)) for part in parts)
    dsinks = None if sinks is None else _sinks_grad(sinks, lse, rowstat, temp if spec.adaptive else None)
    if dmask is None:
        return _unpad(dq, d), _unpad(dk, d), _unpad(dvv, dv), dparams, dsinks
    # a mask broadcast over rows or keys: the (Bm, Hm, Lq, Lk) gradient summed over those dims here
    dims = tuple(i for i in (2, 3) if mask_grad_shape[i] == 1 and dmask.shape[i] != 1)
    dmask = dmask.sum(dim=dims, keepdim=True) if dims else dmask
    return _unpad(dq, d), _unpad(dk, d), _unpad(dvv, dv), dparams, dsinks, dmask


def _mask_grad_buffer(mask, mask_grad_shape, q, k) -> torch.Tensor:
    """The kernel's output for a learned mask's gradient (csrc/mask_grad.h): ``(Bm, Hm, Lq, Lk)``
    float32 (Bm, Hm the mask's batch and head dims, 1 or the call's), ``mask`` the expanded
    float mask the forward read; a ValueError for another shape or mask."""
    B, H, Lq = q.shape[:3]
    Lk = k.shape[2]
    shape = tuple(int(s) for s in mask_grad_shape)
    if (mask is None or not mask.is_floating_point() or tuple(mask.shape) != (B, H, Lq, Lk) or len(shape) != 4
            or any(s not in (1, full) for s, full in zip(shape, (B, H, Lq, Lk)))):
        raise ValueError(f"ssa_flash cuda backend: a learned mask's gradient of shape {shape} for a float mask "
                         f"expanded to (B, Hq, Lq, Lk) = {(B, H, Lq, Lk)}, got "
                         f"{None if mask is None else (tuple(mask.shape), mask.dtype)}")
    return torch.empty((shape[0], shape[1], Lq, Lk), device=q.device, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# Prepared calls (spec.Backend.prepare): what forward and backward above work out from the
# call's key alone (the checks, the head dims' padding, which inputs are already in the kernels'
# layout, the converted constant parameters, the options), worked out once per specialisation


def prepare(q, k, v, mask, params, sinks, spec: AttentionSpec):
    """A :class:`PreparedCall` for calls whose tensors have the metadata (shape, strides, dtype,
    device, 16-byte alignment) of these and whose spec equals ``spec`` but for its tensors, or
    None (sinks, a negative scale: the full path)."""
    if sinks is not None or float(spec.scale) < 0 or spec.packed or spec.kv_cache or _feature_reason(spec) is not None:
        return None
    return PreparedCall(q, k, v, params, spec)


_NO_DEVICE = contextlib.nullcontext()  # (reusable) what _on_device gives for a CPU tensor


class PreparedCall:
    """:func:`forward` and :func:`backward` for one specialisation (see :func:`prepare`):
    ``forward`` returns the extension it ran on as its fourth result, which ``backward`` takes
    (so a CPU emulator of the forward serves its backward, as the custom ops' formula does)."""

    def __init__(self, q, k, v, params, spec: AttentionSpec):
        self.d, self.dv = q.shape[-1], v.shape[-1]
        self.d8, self.dv8 = _round8(self.d), _round8(self.dv)
        # q, k, v as they are where _prep would return them unchanged
        self.q_as_is = self.d == self.d8 and _kernel_layout(q)
        self.k_as_is = self.d == self.d8 and _kernel_layout(k)
        self.v_as_is = self.dv == self.dv8 and _kernel_layout(v)
        self.params, self.kernel_params = params, _score_params(params, spec)
        scale = float(spec.scale)
        self.scale = scale
        self.options = _spec_args(spec, scale, None, q.shape[-2], k.shape[-2])  # every pass's
        self.dropout = _dropout_args(spec)  # the forward's and backward's
        self.adaptive, self.deterministic = spec.adaptive, bool(spec.deterministic)

    def _inputs(self, q, k, v):
        return (q if self.q_as_is else _prep(q, self.d8), k if self.k_as_is else _prep(k, self.d8),
                v if self.v_as_is else _prep(v, self.dv8))

    def _options(self, params, spec: AttentionSpec) -> tuple:
        """The kernels' parameters and the keyword options of the passes with dropout."""
        kernel_params = self.kernel_params
        if len(params) != len(self.params):
            kernel_params = _score_params(params, spec)  # (raises for the wrong count)
        for given, prepared in zip(params, self.params):
            if given is not prepared:  # not the call plan's constant parameters
                kernel_params = _score_params(params, spec)
                break
        dropout = self.dropout
        if spec.dropout_rng is not None:
            dropout = dict(dropout, drop_rng=spec.dropout_rng)
        return kernel_params, dict(self.options, **dropout)

    def forward(self, q, k, v, mask, params, spec: AttentionSpec):
        """``(out, lse, temp, ext)``: :func:`forward` (after :func:`row_entropy` and the
        temperature with ``spec.adaptive``; ``temp`` a :class:`TemperatureState` or None)."""
        ext = _extension(q.device)
        kernel_params, options = self._options(params, spec)
        dev = q.device
        qp, kp, vp = self._inputs(q, k, v)
        if mask is not None:
            mask = _prep_mask(mask)
        # (before both passes: the row-entropy pass takes the forward's kernel family)
        _choose_fwd_kernel(ext, q, k, spec, self.d8, self.dv8)
        with (torch.cuda.device(dev) if dev.type == "cuda" else _NO_DEVICE):
            stream = _stream(dev)
            temp, beta = None, None
            if self.adaptive:
                ent, lse_l = ext.row_entropy(qp, kp, mask, kernel_params, stream=stream, **self.options)
                beta, dbeta_dh = _beta_from_entropy(ent, spec.poly, spec.threshold)
                temp = TemperatureState(beta, lse_l, ent, dbeta_dh)
                beta = beta.float().contiguous()
            o, lse = ext.fwd(qp, kp, vp, mask, kernel_params, beta=beta, stream=stream, **options)
        return (o if self.dv == self.dv8 else _unpad(o, self.dv)), lse, temp, ext

    def backward(self, ext, dout, dlse, q, k, v, out, lse, mask, params, temp, spec: AttentionSpec):
        """``(dq, dk, dv, dparams, None)``: :func:`backward` on ``ext``, the forward's extension."""
        kernel_params, options = self._options(params, spec)
        beta = lse_l = ent = dbeta_dh = None
        if self.adaptive:
            beta, lse_l, ent, dbeta_dh = (temp.beta.float().contiguous(), temp.lse_l.float().contiguous(),
                                          temp.entropy.float().contiguous(), temp.dbeta_dh.float().contiguous())
        qp, kp, vp = self._inputs(q, k, v)
        if mask is not None:
            mask = _prep_mask(mask)
        _choose_kernel(ext, "bwd", q, k, spec, self.d8, self.dv8)
        dev = q.device
        with (torch.cuda.device(dev) if dev.type == "cuda" else _NO_DEVICE):
            dq, dk, dvv, parts, _ = ext.bwd(
                _prep(dout.to(q.dtype), self.dv8), qp, kp, vp, _prep(out, self.dv8), lse.float().contiguous(),
                None if dlse is None else dlse.float().contiguous(), mask, kernel_params, beta=beta, lse_l=lse_l,
                entropy=ent, dbeta_dh=dbeta_dh, deterministic=self.deterministic, stream=_stream(dev), **options)
            dq = _finish_dq(dq, qp, self.scale)
        dparams = []
        for part in parts:
            dparams.append(part.sum(dim=(0, 2)))
        if self.d != self.d8:
            dq, dk = _unpad(dq, self.d), _unpad(dk, self.d)
        return dq, dk, (dvv if self.dv == self.dv8 else _unpad(dvv, self.dv)), tuple(dparams), None
