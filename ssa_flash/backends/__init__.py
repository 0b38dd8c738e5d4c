"""The backends behind the public functions, and which one runs.

Layers, each importing only the ones below it::

    ssa_flash.ops            public functions: validation, backend choice (this module's resolve)
    ssa_flash.autograd       torch.library custom ops + their one autograd formula
    ssa_flash.backends.*     triton / cuda / reference: one interface (spec.Backend)
    ssa_flash.triton.*, the CUDA extension (csrc/), ssa_flash.reference: the kernels
    ssa_flash.spec, .scores, .conventions, .temperature, .errors: the contract

(The kernel layers take the one ``ssa_flash.spec.AttentionSpec`` / ``TemperatureState``; the
contract imports nothing above it. ``tools/import_graph.py`` draws the graph and
tests/test_layers.py holds the package to it.)

Every backend module provides ``NAME``, ``unavailable_reason(device)``,
``supports(q, k, v, spec, sinks=None)``, ``row_entropy(q, k, mask, params, sinks, spec)``,
``forward(q, k, v, mask, params, sinks, beta, spec)`` and
``backward(dout, q, k, v, out, lse, dlse, mask, params, sinks, temp, spec)`` (``spec.Backend``
documents them). Code that needs attention pieces rather than the public functions (ring attention: partial
attention over one key shard, ``ssa_flash.distributed.partial``) calls these directly; the adaptive
temperature's backward over a key shard also needs ``row_dbeta`` and ``backward_given_g``
(``spec.KeyShardTemperature``, optional: the Triton and reference backends have them). Optional
too, ``prepare(q, k, v, mask, params, sinks, spec)``: a ``spec.PreparedCall`` that later calls of
the same specialisation run instead (Triton: ``ssa_flash/triton/prepared.py``; CUDA C++:
``cuda_backend.PreparedCall``).

``backend="reference"`` in the public functions runs ``backends.reference_backend`` through the
custom ops like the other backends (as do degenerate inputs, where kernels launch nothing): the
specification's rows with an explicit backward in the accumulation dtype. The specification
itself, ``ssa_flash.reference``, is no backend: plain PyTorch under ordinary autograd, which the
tests hold every backend to.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..errors import BackendUnavailableError
from ..triton.interpreter import interpreting
from . import cuda_backend, reference_backend, triton_backend
from ._compile import constant_for_compile
from ..spec import AttentionSpec, Backend, KeyShardTemperature, TemperatureState
from .temperature import beta_from_entropy

__all__ = ["NAMES", "get", "available", "resolve", "forget", "auto_candidates", "preferred_backend", "AttentionSpec",
           "TemperatureState", "Backend", "KeyShardTemperature", "BackendUnavailableError", "beta_from_entropy"]

NAMES = ("triton", "cuda", "reference")
_MODULES = {"triton": triton_backend, "cuda": cuda_backend, "reference": reference_backend}


def get(name: str) -> Backend:
    """The backend module called ``name`` (one of :data:`NAMES`)."""
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {NAMES}")
    return _MODULES[name]


def _cuda_first(device: torch.device, dtype: Optional[torch.dtype]) -> bool:
    """The CUDA backend goes before Triton only where a GPU run verified it (cuda_backend.VERIFIED_ARCHS)
    and using it compiles nothing (a JIT build takes minutes)."""
    if device.type != "cuda" or not cuda_backend.ready():
        return False
    dtypes = (dtype,) if dtype is not None else (torch.float16, torch.bfloat16)
    return any(cuda_backend.verified(device, dt) for dt in dtypes)


def available(device, dtype: Optional[torch.dtype] = None) -> Tuple[str, ...]:
    """The backends that can run on ``device`` in this process, in ``backend="auto"``'s order of
    preference (``dtype``, if given, refines where the CUDA backend goes)."""
    device = torch.device(device)
    order = ("cuda", "triton", "reference") if _cuda_first(device, dtype) else NAMES
    return tuple(name for name in order if get(name).unavailable_reason(device) is None)


# Answers of resolve / auto_candidates, per (function, backend, device, dtype, _state()): probing
# availability (imports, device queries, the extension's files) costs tens of microseconds, too
# much for every call.
_answers: dict = {}


def forget() -> None:
    """Forget the remembered availability answers: after a CUDA extension was built or installed
    by another process (this process notices its own builds), or a test changed what the probes
    see."""
    _answers.clear()


def _state() -> tuple:
    """What availability depends on besides the device and dtype: whether Triton interprets, and
    the CUDA extension's loading state and emulation stack."""
    return (interpreting(), cuda_backend.load_state())


def _remembered(fn):
    def wrapper(*args):
        key = (fn, *args, _state())
        answer = _answers.get(key)
        if answer is None:
            answer = _answers[key] = fn(*args)
        return answer

    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


@constant_for_compile
@_remembered
def resolve(backend: str, device: torch.device, dtype: torch.dtype) -> Tuple[str, str]:
    """``(name, "")`` for the backend that runs ``backend`` ("auto" or a name) on ``device``, or
    ``("", why)`` when it is unavailable. ``"auto"``: the first of :func:`available`, except an
    unverified CUDA backend (an emulated one included), which ``auto`` never picks.

    A constant for torch.compile: evaluated once while tracing, so that probing (imports,
    device queries, the extension's files) stays out of the graph."""
    device = torch.device(device)
    if backend == "auto":
        for name in available(device, dtype):
            if name != "cuda" or _cuda_first(device, dtype):
                return name, ""
        return "reference", ""
    why = get(backend).unavailable_reason(device)
    return (backend, "") if why is None else ("", why)


@constant_for_compile
@_remembered
def auto_candidates(device: torch.device, dtype: torch.dtype) -> Tuple[str, ...]:
    """The backends ``backend="auto"`` may pick on ``device``, in its order of preference: those
    of :func:`available`, less an unverified CUDA backend; the reference last (it runs anything).
    The public functions take the first whose ``supports`` accepts the inputs."""
    names = [name for name in available(device, dtype) if name != "cuda" or _cuda_first(device, dtype)]
    return tuple(names) if "reference" in names else (*names, "reference")


# --------------------------------------------------------------------------------------------
# Which of the CUDA and Triton backends is faster on a GPU (a measurement; auto does not run it)

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
    if get("triton").unavailable_reason(device) is not None:
        return "cuda"
    dtype = torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (2, 8, 2048, 64)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4))
    b = torch.full((8,), 1.0, device=device)
    n = torch.full((8,), 1.5, device=device)
    spec = AttentionSpec(scale=64 ** -0.5, score="ssa", causal=True)
    times = {}
    for name in ("cuda", "triton"):
        be = get(name)

        def step():
            out, lse = be.forward(q, k, v, None, (b, n), None, None, spec)
            be.backward(dout, q, k, v, out, lse, None, None, (b, n), None, None, spec)

        try:
            times[name] = _time_ms(step)
        except Exception:
            times[name] = float("inf")
    return min(times, key=times.get)


def preferred_backend(device) -> str:
    """``"cuda"`` or ``"triton"``: whichever runs an SSA forward+backward (B=2, H=8, L=2048, D=64,
    causal) faster on this GPU model, through the backend interface. Measured once per GPU model
    and cached in memory and in ``~/.cache/ssa_flash/auto_backend.json``;
    ``SSA_FLASH_AUTO_BACKEND=cuda|triton`` overrides. A tool for deciding what goes into
    ``cuda_backend.VERIFIED_ARCHS``; ``backend="auto"`` reads only that table."""
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
