"""Host side of the Triton kernels: block sizes, strides, grids, launches.

Tensors arrive already validated (see ``ssa_flash.ops``): ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``,
``v (B, Hkv, Lk, Dv)`` with any strides; ``mask`` is None or a boolean / floating tensor already
expanded (as a view) to ``(B, Hq, Lq, Lk)``; ``params`` is the score function's
(``spec.score``, ``ssa_flash.scores``) tuple of per-head parameters, one contiguous ``(Hq,)`` tensor
in the accumulation dtype per name in its ``params`` (``()`` for softmax; SSA ``(b, n)``, the logit
scale ``(s,)``); the kernels are compiled for ``SCORE = score.id``. Per-row statistics are
contiguous ``(B, Hq, Lq)``. ``spec`` is the backends' one :class:`~ssa_flash.backends.spec.AttentionSpec`
(``spec.softcap`` turns on the kernels' ``SOFTCAP``; the sink logits, an ``(Hq,)`` tensor in the
accumulation dtype, arrive as ``sinks=`` and turn on ``SINKS``; the layout fields reach these
functions as ``layout=`` below).

Two other layouts (``layout=``, see ``extents.py``'s ``VARLEN``):

* :class:`Packed`: a packed variable-length batch, ``q (total_q, Hq, D)``, ``k (total_k, Hkv, D)``,
  ``v (total_k, Hkv, Dv)``, outputs ``(total_q, Hq, Dv)``, per-row statistics ``(Hq, total_q)``;
  forward, statistics and backward. No mask.
* :class:`KVCache`: dense tensors where batch element ``b`` attends only cache rows
  ``[k_start[b], seqused_k[b])`` with bottom-right causality; forward and statistics only, with
  the keys optionally split among several programs per row (:func:`num_splits_heuristic`).
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import json
import logging
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor
import triton
import triton.language as tl

# The one spec type of every backend. The backends' interface module depends on nothing above
# ssa_flash.temperature and imports no backend, so this import (the kernels' host side reading the
# interface's data types) makes no cycle: tests/ops/test_backends.py checks the import graph.
from .. import scores
from ..backends.spec import AttentionSpec, TemperatureState
from ..reference import dropout_keep_threshold
from .backward import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel
from .dropout import dropout_mask_kernel
from .row_entropy import row_entropy_kernel
from .extents import VARLEN_CACHE, VARLEN_CACHE_START, VARLEN_NONE, VARLEN_PACKED
from .forward import attention_fwd_kernel
from .interpreter import interpreting
from .logits import kernel_params, poly_exp2_pays
from .masks import MASK_ADD, MASK_BOOL, MASK_NONE
from .splitkv import merge_entropy_kernel, merge_output_kernel
# The tile tables live in tiles.py; these names are re-exported (tests and the audit use them, and
# the audit replaces ``launch.block_candidates`` to compile later candidates).
from . import direct, plans, tiles  # noqa: F401
from .tiles import Blocks, block_candidates, prune as _prune_candidates  # noqa: F401
from .tiles import decode_candidates as _decode_candidates  # noqa: F401

_MAX_GRID = 2**31 - 1


class Packed(NamedTuple):
    """A packed variable-length batch: sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``
    and key rows ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` (int32 ``(batch + 1,)`` on the tensors'
    device); ``max_seqlen_*`` bound every sequence's length (they size the grid)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class KVCache(NamedTuple):
    """A KV cache: batch element ``b`` attends cache rows ``[k_start[b], seqused_k[b])`` (clamped to
    the cache), query ``i`` of ``Lq`` at position ``seqused_k[b] - Lq + i`` under causality.
    ``seqused_k``, ``k_start``: int32 ``(B,)`` (``k_start`` None: 0). ``num_splits``: programs per
    row sharing the keys (0: :func:`num_splits_heuristic`)."""

    seqused_k: torch.Tensor
    k_start: Optional[torch.Tensor] = None
    num_splits: int = 0


@dataclass(frozen=True)
class KernelLaunch:
    """Everything that decides what a kernel launch compiles to and runs: the kernel, its grid,
    positional arguments, ``tl.constexpr`` keyword arguments (block sizes included) and compile
    options. :func:`capture_launches` records these instead of running them (the static audit
    compiles exactly what the launcher would launch)."""

    name: str  # "fwd", "row_entropy", "bwd_dq" or "bwd_dkdv"
    kernel: object
    grid: tuple
    args: tuple
    constexprs: dict
    blocks: Blocks
    candidates: tuple  # every configuration the launcher may choose for this specialisation


def _cdiv(a: int, b: int) -> int:
    # plain Python: triton.cdiv / next_power_of_2 are constexpr functions (Triton 3.9), ~10 us
    # per host call
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _head_block(d: int) -> int:
    return max(16, _next_pow2(d))


# Split-KV decoding: the SM count the heuristic fills when it cannot ask a GPU (the interpreter,
# meta tensors): an H100 SXM's.
DEFAULT_SMS = 132
MAX_SPLITS = 64
MIN_BLOCKS_PER_SPLIT = 4


def num_splits_heuristic(programs: int, key_blocks: int, sms: int = DEFAULT_SMS) -> int:
    """How many programs share each row block's keys in split-KV decoding.

    ``programs`` is the number of programs without splitting (query blocks x batch x query heads),
    ``key_blocks`` the number of key tiles of the longest row (the cache's capacity). Splitting pays
    when the unsplit grid leaves SMs idle: one wave of ``sms`` programs is the target, so the split
    count is ``sms // programs``, capped so that every split keeps at least ``MIN_BLOCKS_PER_SPLIT``
    key tiles (the merge and the per-program prologue must stay small next to the key loop) and at
    ``MAX_SPLITS``. E.g. an H100 (132 SMs), batch 1, 16 heads, one query, 8192 keys in tiles of 128:
    ``min(132 // 16, 64 // 4) = 8`` splits, 128 programs; batch 16 x 16 heads: 1 (no split)."""
    if programs <= 0:
        return 1
    return max(1, min(sms // programs, key_blocks // MIN_BLOCKS_PER_SPLIT, MAX_SPLITS))


_sm_counts: dict = {}


def _sm_count(device: torch.device) -> int:
    if _pretended_arch() is not None or device.type != "cuda" or interpreting():
        return DEFAULT_SMS
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


# (launch name, device, arch, head block, dtype, constexprs, deterministic, size bucket) -> Blocks;
# and ((launch name, device, arch, head block, dtype, constexprs), "candidates") -> the pruned
# candidate list (one table: clearing it forgets both)
_chosen_blocks: dict = {}
_capture: Optional[list] = None
_capture_arch: Optional[int] = None


def _pretended_arch() -> Optional[int]:
    """The architecture that launch capture or stub mode (``direct.stub``) plans for, else None."""
    return _capture_arch if _capture is not None else direct.stub_arch()


@contextmanager
def capture_launches(arch: int):
    """Within this context the launcher records a :class:`KernelLaunch` per kernel launch (with
    the configuration it would choose first on compute capability ``arch``) instead of running
    it. Call the host functions with ``meta`` tensors: outputs are allocated, nothing runs."""
    global _capture, _capture_arch
    if _capture is not None:
        raise RuntimeError("capture_launches is not re-entrant")
    _capture, _capture_arch = [], int(arch)
    try:
        yield _capture
    finally:
        _capture, _capture_arch = None, None


_archs: dict = {}


def _device_arch(device: torch.device) -> Optional[int]:
    """Compute capability of ``device`` as an int (90), None for the interpreter and non-CUDA
    tensors; the pretended one under capture or stub mode. Read once per device."""
    pretended = _pretended_arch()
    if pretended is not None:
        return pretended
    if device.type != "cuda" or interpreting():  # (the device type first: no knob read on the CPU)
        return None
    arch = _archs.get(device)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(device)
        arch = _archs[device] = 10 * major + minor
    return arch


def _autotuning() -> bool:
    """Whether timed choices are allowed: not with ``SSA_FLASH_AUTOTUNE=0``, nor under
    ``torch.use_deterministic_algorithms(True)`` (which also fixes the tiles of the KV-cache and
    ring paths, which take no ``deterministic`` argument)."""
    return (os.environ.get("SSA_FLASH_AUTOTUNE", "1") not in ("", "0")
            and not torch.are_deterministic_algorithms_enabled())


def _on_device(device: torch.device):
    """Context making ``device`` the current CUDA device for the launches inside it.

    Triton launches on the current device and that device's current stream, whatever device the
    tensors are on: tensors on ``cuda:1`` while ``cuda:0`` is current (a model split with
    ``device_map="auto"``) fail ("pointer cannot be accessed") or, with peer access, run on the
    wrong GPU racing the right one's stream. Entering the tensors' device is cheap when it is
    already current. Nothing to enter for the CPU (interpreter) or ``meta`` tensors (capture)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _timed(run) -> float:
    """Median milliseconds of ``run()`` on the current stream, timed with CUDA events after two
    warm-up runs: 3 to 20 runs, as many as fit ~50 ms. No L2 flush between runs (unlike
    ``triton.testing.do_bench``, which allocates a 256 MB buffer to clear the cache: the GPU may
    be nearly full when a model's first call tunes); every candidate is timed alike."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    reps = int(max(3, min(20, 50.0 / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for s, e in events:
        s.record()
        run()
        e.record()
    events[-1][1].synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in events))


def _split_grid(grid, consts):
    """A ``(programs, splits)`` grid of a kernel with a ``SPLIT`` switch left open (``None``):
    ``SPLIT`` is whether there is more than one split, and the grid one-dimensional without."""
    if consts.get("SPLIT", False) is not None:
        return grid, consts
    split = grid[1] > 1
    return (grid if split else grid[:1]), dict(consts, SPLIT=split)


def _compile_errors() -> tuple:
    """The exceptions by which Triton says a configuration cannot be built for this GPU (what its
    own autotuner skips): too much shared memory or too many registers (``OutOfResources``),
    ptxas failing (``PTXASError`` of ``triton.runtime.errors``), a
    ``tl.static_assert`` or a shape rule failing at compile time (``CompilationError``, of which
    ``CompileTimeAssertionFailure`` is one). Looked up defensively: a name missing from the
    installed Triton is left out."""
    places = {"OutOfResources": ("triton.runtime.errors", "triton.runtime.autotuner"),
              "PTXASError": ("triton.runtime.errors", "triton.runtime.autotuner"),
              "CompilationError": ("triton.compiler.errors", "triton.compiler")}
    found = []
    for name, modules in places.items():
        for module in modules:
            try:
                cls = getattr(importlib.import_module(module), name, None)
            except Exception:  # absent in this version, or a backend that cannot load here
                continue
            if isinstance(cls, type) and issubclass(cls, Exception):
                found.append(cls)
                break
    return tuple(found)


_COMPILE_ERRORS = _compile_errors()

# Tuned choices on disk, one small JSON file per choice (see _cache_key); writes go to a
# temporary file in the same folder renamed over the target, so readers never see half a file.
CACHE_ENV = "SSA_FLASH_CACHE_DIR"
_SLOW_TUNING_S = 5.0  # tuning longer than this is logged (one line, logger "ssa_flash")
logger = logging.getLogger("ssa_flash")


def cache_dir() -> Path:
    """Where tuned block configurations are kept: ``$SSA_FLASH_CACHE_DIR/autotune``, by default
    ``~/.cache/ssa_flash/autotune`` (``$XDG_CACHE_HOME/ssa_flash/autotune`` if that is set)."""
    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "ssa_flash")
    return Path(root) / "autotune"


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def _cache_key(kernel, name, device, head_block, dtype, bucket, consts, cands) -> Optional[str]:
    """The text a tuned choice is filed under: everything that decides which configuration wins
    (the GPU model, torch, Triton and ssa_flash versions, the kernel's source with the JIT
    functions it calls, as Triton keys its compiled kernels, the specialisation, the size bucket
    and the candidate list). None when it cannot be formed (nothing is cached then)."""
    try:
        from .. import __version__ as ours

        source = _kernel_identity(kernel)
        parts = (f"gpu={_gpu_name(device)}", f"torch={torch.__version__}", f"triton={triton.__version__}",
                 f"ssa_flash={ours}", f"kernel={source}", f"name={name}", f"head_block={head_block}",
                 f"dtype={dtype}", f"bucket={bucket}", f"consts={sorted((k, repr(v)) for k, v in consts.items())}",
                 f"candidates={[tuple(_block_list(c)) for c in cands]}")
        return "\n".join(parts)
    except Exception as err:  # e.g. no device name: tune, but keep the choice in memory only
        logger.debug("ssa_flash: no autotuning cache key (%r)", err)
        return None


def _jit_name(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return getattr(fn, "__name__", type(kernel).__name__)


_identities: dict = {}  # id(kernel) -> (kernel, identity): kept per process, computed once


def _kernel_identity(kernel) -> str:
    """``<kernel name>:<hash>``, what the tuning cache files a choice under for the kernel's code:
    sha256 over the source of ``kernel`` and of every JIT function it refers to, transitively
    (each by module, name and source text, in name order), and the ``tl.constexpr`` globals they
    read (name and value). It covers what Triton's ``cache_key`` covers, less line numbers (a
    shifted kernel keeps its tunings), and reads the same wherever the sources are the same: Triton
    3.6's ``cache_key`` of identical sources differed between the GPU machine (Python 3.12) and
    the CPU machines (Python 3.11; the cause not pinned down), so that entries could neither be
    checked nor carried over a kernel edit away from the GPU (bench/rekey_tuning.py). The same
    here under Triton 3.6 and 3.9 (Triton's own functions are named by its version). A stand-in
    without Python source: :func:`_source_hash`."""
    hit = _identities.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    fn = getattr(kernel, "fn", None)
    if not callable(fn):
        return _source_hash(kernel)
    try:
        identity = f"{_jit_name(kernel)}:{_closure_hash(kernel)}"
    except (OSError, TypeError, SyntaxError):  # no source to read
        return _source_hash(kernel)
    _identities[id(kernel)] = (kernel, identity)
    return identity


def _is_jit(val) -> bool:
    """A Triton JIT function (or the interpreter's stand-in for one): a Triton object wrapping ``fn``."""
    return callable(getattr(val, "fn", None)) and type(val).__module__.startswith("triton")


def _closure_hash(kernel) -> str:
    import ast
    import textwrap
    import types

    sources, consts, todo = {}, {}, [kernel]
    while todo:
        jf = todo.pop()
        fn = jf.fn
        name = f"{fn.__module__}.{fn.__qualname__}"
        if name in sources or (fn.__module__ or "").startswith("triton"):
            continue  # Triton's own library functions: the key names Triton's version
        src = textwrap.dedent(inspect.getsource(fn))
        sources[name] = f"{src}\0noinline={getattr(jf, 'noinline', None)}"
        scope = fn.__globals__

        def resolve(node):
            if isinstance(node, ast.Name):
                return scope.get(node.id)
            if isinstance(node, ast.Attribute):
                base = resolve(node.value)
                return getattr(base, node.attr, None) if isinstance(base, types.ModuleType) else None
            return None

        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, (ast.Name, ast.Attribute)):
                continue
            val = resolve(node)
            if _is_jit(val):
                todo.append(val)
            elif isinstance(val, tl.constexpr):
                label = node.id if isinstance(node, ast.Name) else ast.unparse(node)
                consts[f"{fn.__module__}:{label}"] = repr(getattr(val, "value", val))
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(f"{name}\0{sources[name]}\0".encode("utf-8"))
    for name in sorted(consts):
        h.update(f"{name}={consts[name]}\0".encode("utf-8"))
    return h.hexdigest()


def _source_hash(kernel) -> str:
    """A kernel without Triton's ``cache_key`` (the interpreter's, a test's stand-in): its name
    and a hash of its Python source where there is one."""
    try:
        src = inspect.getsource(getattr(kernel, "fn", kernel))
    except (OSError, TypeError):
        src = ""
    return f"{_jit_name(kernel)}:{hashlib.sha256(src.encode('utf-8')).hexdigest()[:16]}"


def _cache_path(key: str) -> Path:
    return cache_dir() / (hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] + ".json")


def _cache_load(key: Optional[str], cands) -> Optional[Blocks]:
    """The choice filed under ``key`` if it is one of ``cands``, else None. A missing, unreadable,
    corrupt or foreign file is None: the caller tunes again."""
    if key is None:
        return None
    try:
        data = json.loads(_cache_path(key).read_text())
        if data.get("key") != key:
            return None
        blk = Blocks(*(int(x) for x in data["blocks"][:4]), *(bool(x) for x in data["blocks"][4:5]))
    except Exception:
        return None
    return blk if blk in cands else None


def _block_list(blk: Blocks) -> list:
    """``blk`` as the cache files list it: ``[m, n, warps, stages]``, ``+ [1]`` if warp-specialised."""
    return [blk.m, blk.n, blk.warps, blk.stages] + ([1] if blk.ws else [])


def _cache_store(key: Optional[str], blk: Blocks, timings) -> None:
    """File ``blk`` under ``key`` (atomically: temporary file + rename). Failing to write (a
    read-only home, a full disk) only costs the next process a new tuning."""
    if key is None:
        return
    tmp = None
    try:
        path = _cache_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"key": key, "blocks": _block_list(blk), "timings_ms": [[_block_list(c), ms] for c, ms in timings]}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
        tmp = None
    except Exception as err:
        logger.debug("ssa_flash: could not write the autotuning cache (%r)", err)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


WS_ENV = "SSA_FLASH_WARP_SPECIALIZE"


def _triton_warp_specializes() -> bool:
    """Whether this Triton warp-specialises the forward kernel's key loop (``tl.range(...,
    warp_specialize=True)`` with device-side tensor descriptors): 3.6 and later (compiled for
    sm_90 with 3.6 and 3.9, static audit)."""
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 6)


def _tma_ready(*tensors) -> bool:
    """Whether TMA can read each 4-D tensor's ``(rows, D)`` slices: unit column stride, every other
    stride and the data pointer 16-byte aligned. A tensor without memory (a fake or meta tensor of
    a trace or a test) has no pointer to read: its alignment is taken as the allocator's (16)."""
    for t in tensors:
        e = t.element_size()
        if t.stride(-1) != 1 or any(st * e % 16 for st in t.stride()[:-1]):
            return False
        if not (t.is_meta or isinstance(t, FakeTensor)) and t.data_ptr() % 16:
            return False
    return True


def _with_warp_specialized(cands: list, name: str, arch: Optional[int], head_block: int, dtype) -> list:
    """``cands`` with the forward kernel's warp-specialised configuration (``tiles.warp_specialized_forward``)
    where there is one: second by default, so that the autotuner times it against the tile table
    and ``deterministic=True`` (the first candidate) never takes it; first with
    ``SSA_FLASH_WARP_SPECIALIZE=1``, left out with ``=0`` (for measurement)."""
    knob = os.environ.get(WS_ENV, "")
    blk = tiles.warp_specialized_forward(arch, head_block, dtype)
    if knob == "0" or blk is None or name != "fwd" or not _triton_warp_specializes():
        return cands
    return [blk] + cands if knob == "1" else cands[:1] + [blk] + cands[1:]


def _candidates(name: str, arch: Optional[int], head_block: int, dtype, consts: dict, ws_ok: bool = False) -> list:
    """The configurations ``_launch`` may choose, best first, de-duplicated and pruned of what
    cannot fit (never compiled); ``ws_ok``: the launch may take the warp-specialised forward
    (:func:`_with_warp_specialized`)."""
    if name.endswith("_decode"):
        cands = _decode_candidates(arch, head_block, dtype)
    else:
        cands = block_candidates(arch, head_block, dtype, name, masked=consts.get("MASK_KIND", 0) != 0,
                                 adaptive=bool(consts.get("ADAPTIVE", False)),
                                 dropout=bool(consts.get("DROPOUT", False)), window=bool(consts.get("WINDOW", False)))
    cands = _prune_candidates(cands, name, head_block, dtype, arch)
    if arch is not None and consts.get("MASK_KIND", 0) == MASK_BOOL:
        # the mask's bytes miscompile silently at 16-wide tiles (H200, Triton 3.6: wrong out / dQ /
        # dK at 16 x 16, right at 32 x 32 and above, right with an additive mask at 16 x 16): a
        # P.V operand layout that does not fit K = 16 (bench/gpu_diag/bool_mask.md, "Failure 2")
        cands = [c for c in cands if min(c.m, c.n) > 16] or cands
    if ws_ok:
        cands = _with_warp_specialized(cands, name, arch, head_block, dtype)
    return list(dict.fromkeys(cands))


def _bucket(programs: int, sizes: tuple) -> tuple:
    """The problem-size bucket a tuned choice is kept for: powers of two of the program count and
    of ``sizes`` (the launch's sequence lengths and batch x heads), so that tiles timed at 1k
    tokens x batch 16 are not reused at 16k x batch 1, which has as many programs."""
    return (_next_pow2(max(1, programs)),
            *(_next_pow2(max(1, int(x))) for x in sizes))


def _launch(kernel, name: str, grid_fn, args, consts, device, head_block, dtype, deterministic: bool = False,
            sizes: tuple = (), ws_ok: bool = False):
    """Launch ``kernel`` with the best block configuration for this GPU, on ``device`` (the
    tensors' device, made current: see :func:`_on_device`) and its current stream.

    ``grid_fn(blk)`` and ``args(blk)`` give the grid and the runtime arguments (signature order)
    for a configuration, ``consts`` the constexprs; ``sizes`` the launch's sequence lengths and
    batch x heads (:func:`_bucket`). Names ending in ``_decode`` take the decoding table
    (:func:`_decode_candidates`), the others :func:`block_candidates`. A candidate that cannot be
    built for this GPU (see :func:`_compile_errors`) is skipped. The first time a specialisation
    meets a problem-size bucket, every candidate that builds is timed on the real arguments and
    the fastest is kept (all kernels of the family are idempotent: they only write their
    outputs), in memory and on disk (:func:`cache_dir`), so that later calls and later processes
    on the same GPU model and software skip the timing.

    A later call of the same specialisation and bucket is the host's fast path: the kept choice,
    its grid and arguments, and the kept compiled kernel launched directly (``direct.py``).

    ``deterministic=True``, ``SSA_FLASH_AUTOTUNE=0``, stub mode and the interpreter take the first
    candidate that builds, without timing and without the cache: a fixed choice, the same in
    every process (outputs depend on the tiles in their last bits). So does a CUDA-graph capture
    without a remembered choice (no timing during capture).

    ``ws_ok``: the launch qualifies for the warp-specialised forward (dense layout, no mask,
    dropout, window, sinks or cap, TMA-aligned tensors), one more candidate on sm_90
    (:func:`_with_warp_specialized`)."""
    arch = _device_arch(device)
    if _capture is not None:  # fresh: the audit replaces block_candidates between captures
        cands = _candidates(name, arch, head_block, dtype, consts, ws_ok)
        blk = cands[0]
        grid, kconsts = _split_grid(grid_fn(blk), consts)
        _capture.append(KernelLaunch(name, kernel, grid, tuple(args(blk)),
                                     _block_consts(kconsts, blk), blk, tuple(cands)))
        return blk
    spec_key = (name, device, arch, head_block, dtype, tuple(consts.items()), ws_ok)
    cands = _chosen_blocks.get((spec_key, "candidates"))
    if cands is None:
        cands = _chosen_blocks[(spec_key, "candidates")] = _candidates(name, arch, head_block, dtype, consts, ws_ok)
    key = spec_key + (bool(deterministic), _bucket(grid_fn(cands[0])[0], sizes))
    with _on_device(device):
        blk = _chosen_blocks.get(key)
        if blk is not None:  # the fast path: a kept choice
            _run(kernel, blk, grid_fn, args, consts, arch, device)
            return blk
        return _choose_and_run(kernel, name, grid_fn, args, consts, device, head_block, dtype,
                               bool(deterministic), arch, cands, key)


def _block_consts(consts: dict, blk: Blocks) -> dict:
    """The constexprs of a launch in configuration ``blk``: the tile sizes, and ``WARP_SPECIALIZE``
    only for the warp-specialised form (so that the others compile exactly as before it), with
    its ``WS_FULL_BLOCKS`` where the forward set it in ``consts`` (dropped for the others)."""
    if blk.ws:
        return dict(consts, BLOCK_M=blk.m, BLOCK_N=blk.n, WARP_SPECIALIZE=True)
    if "WS_FULL_BLOCKS" in consts:
        consts = {k: v for k, v in consts.items() if k != "WS_FULL_BLOCKS"}
    return dict(consts, BLOCK_M=blk.m, BLOCK_N=blk.n)


def _tma_scratch(size: int, alignment: int, stream):
    # torch's caching allocator: stream-ordered reuse, no synchronisation, 512-byte alignment
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors live in global scratch memory that Triton asks an allocator
    for at launch (``triton.set_allocator``): install one backed by torch's caching allocator,
    unless the caller installed their own."""
    try:
        from triton.runtime import _allocation

        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # another Triton layout: install ours
        pass
    triton.set_allocator(_tma_scratch)


def _options(blk: Blocks, arch: Optional[int]) -> dict:
    """The compile options of configuration ``blk`` (none under the interpreter)."""
    return {} if arch is None else {"num_warps": blk.warps, "num_stages": blk.stages}


def _run(kernel, blk: Blocks, grid_fn, args, consts, arch, device):
    """One launch of ``kernel`` in configuration ``blk``."""
    grid, kconsts = _split_grid(grid_fn(blk), consts)
    if grid[0] > _MAX_GRID or (len(grid) > 1 and grid[1] > 65535):
        raise ValueError(f"ssa_flash: problem too large for one launch ({grid} programs)")
    options = _options(blk, arch)
    if blk.ws:
        _ensure_allocator()
    direct.LAUNCHER.run(kernel, grid, args(blk), _block_consts(kconsts, blk), options, device)


def _choose_and_run(kernel, name, grid_fn, args, consts, device, head_block, dtype, deterministic, arch, cands,
                    key):
    """:func:`_launch`'s choice and launches, with ``device`` current; ``cands`` de-duplicated;
    the choice is kept under ``key``."""
    bucket = key[-1]
    may_tune = (not deterministic and arch is not None and len(cands) > 1 and _autotuning()
                and direct.stub_arch() is None)
    disk_key = None
    chosen = None
    if may_tune:
        disk_key = _cache_key(kernel, name, device, head_block, dtype, bucket, consts, cands)
        chosen = _cache_load(disk_key, cands)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    tune = may_tune and chosen is None and not capturing
    if chosen is not None:  # remembered; should it no longer build, the first candidate that does
        cands = [chosen] + [c for c in cands if c != chosen]
    started = time.perf_counter()
    best, best_ms, last_err, blk = None, float("inf"), None, None
    timings = []
    for blk in cands:

        def run(blk=blk):
            _run(kernel, blk, grid_fn, args, consts, arch, device)

        try:
            run()
        except _COMPILE_ERRORS as err:  # this configuration cannot be built for this GPU
            last_err = err
            logger.debug("ssa_flash: %s %s skipped: %s", name, blk, type(err).__name__)
            continue
        except RuntimeError as err:
            # Triton's warp specialisation failing in its MLIR passes ("PassManager::run failed")
            # on a specialisation the static audit did not compile: the other configurations remain
            if not blk.ws:
                raise
            last_err = err
            logger.debug("ssa_flash: %s %s (warp-specialised) skipped: %s", name, blk, err)
            continue
        if not tune:
            _chosen_blocks[key] = blk
            return blk
        ms = _timed(run)
        timings.append((blk, ms))
        if ms < best_ms:
            best, best_ms = blk, ms
    if best is None:
        # the last failure's own text: where every configuration fails alike (a tl.static_assert of
        # the kernel, not a resource limit) it is the cause the user needs to see
        why = f": the last one failed with {type(last_err).__name__}: {str(last_err).strip()}" if last_err is not None else ""
        raise RuntimeError(f"ssa_flash: no block configuration of {name} fits this GPU{why}") from last_err
    if best != blk:  # leave the outputs of the chosen configuration (some depend on the tiles)
        _run(kernel, best, grid_fn, args, consts, arch, device)
    _chosen_blocks[key] = best
    _cache_store(disk_key, best, timings)
    elapsed = time.perf_counter() - started
    if elapsed > _SLOW_TUNING_S:
        logger.warning("ssa_flash: tuning the Triton kernel %s (head dim block %d, %s, size bucket %s) took "
                       "%.1f s over %d block configurations; the choice is kept in %s for later processes "
                       "(SSA_FLASH_AUTOTUNE=0: the first that fits, no timing)", name, head_block,
                       str(dtype).replace("torch.", ""), bucket, elapsed, len(timings), cache_dir())
    return best


def _check_offsets(*tensors):
    """Kernels index (batch, head) slices with int64 and positions inside one slice with int32."""
    for t in tensors:
        if t.is_contiguous() and t.numel() < 2**31:  # then no slice spans 2^31 (the common case, cheap)
            continue
        span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape[2:], t.stride()[2:]))
        if span >= 2**31:
            raise ValueError(f"ssa_flash: one (batch, head) slice of a tensor of shape {tuple(t.shape)} "
                             f"and strides {t.stride()} spans {span} elements; the Triton kernels "
                             "support up to 2^31 per slice (make the tensor contiguous)")


def _split_scale(scale: float):
    """Python floats reach kernels as float32: pass the scale as float32 head + remainder."""
    hi = float(np.float32(scale))
    return hi, float(np.float32(scale - hi))


def _scale_args(scale: float) -> dict:
    """The softmax scale's kernel argument ``scale = (hi, lo)`` (:func:`_split_scale`)."""
    return dict(scale=_split_scale(scale))


def _bool_mask_as_additive(like: torch.Tensor) -> bool:
    """Whether a boolean mask reaches compiled float64 kernels as an additive one (0 / -inf).

    Triton 3.6 cannot compile a float64 ``tl.dot`` whose operand is computed from 8-bit data (the
    boolean mask's bytes feed the probabilities of the second matmul): its MMA lowering takes the
    narrowest type on the operand's chain for the k-width and asserts "fp64 don't support largeK
    MMA" (seen on an H200, 2026-11-26). float64 is the dtype of gradient checks, where a float mask's
    8 bytes per element cost nothing that matters; the interpreter has no such limit."""
    return like.dtype == torch.float64 and like.device.type == "cuda" and not interpreting()


def _additive_from_bool(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (bool, True = attend) as a float64 additive mask, 0 where True and -inf where False,
    with the same broadcast (stride-0) dimensions: a row with no True stays a row of -inf, which the
    kernels treat as they treat an empty boolean row."""
    base = mask[tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.stride())]
    return torch.zeros(base.shape, dtype=torch.float64, device=mask.device).masked_fill_(
        ~base, float("-inf")).expand(mask.shape)


def _mask_args(mask: Optional[torch.Tensor], like: torch.Tensor):
    """``(MASK=..., mask_strides=...)`` kernel arguments and the ``MASK_KIND`` of ``mask``."""
    if mask is None:
        return dict(MASK=like, mask_strides=(0, 0, 0, 0)), MASK_NONE
    if mask.dtype == torch.bool and _bool_mask_as_additive(like):
        mask = _additive_from_bool(mask)
    if mask.dtype == torch.bool:  # bytes: kernels read 0 / non-zero, not i1 pointers
        return dict(MASK=mask.view(torch.uint8), mask_strides=_strides(mask)), MASK_BOOL
    return dict(MASK=mask, mask_strides=_strides(mask)), MASK_ADD


def _strides(t: torch.Tensor) -> tuple:
    """A 4-D tensor's strides as the kernels take them, one tuple argument ``(batch, head, row,
    column)``. Triton specialises each element as it would a scalar argument (1: a constant;
    a multiple of 16: known divisible), so unit strides still compile to contiguous accesses."""
    return tuple(int(st) for st in t.stride())


def _runtime_params(kernel) -> tuple:
    """Names of ``kernel``'s parameters that are not ``tl.constexpr``, in signature order."""
    params = inspect.signature(getattr(kernel, "fn", kernel)).parameters.values()
    return tuple(p.name for p in params if p.annotation is not tl.constexpr and p.annotation != "tl.constexpr")


# The attention kernels' runtime parameters by launch name, read from their definitions once (tests
# replace the kernels the launcher calls by stand-ins; the arguments follow the definitions).
_PARAMS = {"fwd": _runtime_params(attention_fwd_kernel), "row_entropy": _runtime_params(row_entropy_kernel),
           "bwd_dq": _runtime_params(attention_bwd_dq_kernel), "bwd_dkdv": _runtime_params(attention_bwd_dkdv_kernel)}


def _positional(kernel: str, **named) -> tuple:
    """The runtime arguments of attention kernel ``kernel`` (``"fwd"``, ``"row_entropy"``,
    ``"bwd_dq"``, ``"bwd_dkdv"``) in signature order, from their names: launch sites name every
    argument, and one the kernel does not take or one left out is an error here rather than a
    misplaced argument. Related arguments travel as one tuple (strides, the split scale, the
    dropout and window parameters; Triton >= 3.3); :class:`KernelLaunch` records the positional
    tuple."""
    names = _PARAMS[kernel]
    if len(named) == len(names):
        try:
            return tuple([named[n] for n in names])
        except KeyError:
            pass
    unknown = set(named) - set(names)
    missing = [n for n in names if n not in named]
    raise TypeError(f"ssa_flash: {kernel} kernel: unknown arguments {sorted(unknown)}, missing {missing}")


def _fast_math(q) -> bool:
    """Hardware approximations (``lg2.approx``, ``rcp.approx``) on a GPU in float32 accumulation;
    the interpreter runs exact maths (it cannot run inline PTX)."""
    on_gpu = _pretended_arch() is not None or (q.device.type == "cuda" and not interpreting())
    return on_gpu and q.dtype != torch.float64


def _feature_args(q, Lq: int, Lk: int, spec: AttentionSpec):
    """The feature arguments of the attention kernels by name, ``dropout = (RNG, keep31,
    drop_scale_hi, drop_scale_lo)`` and ``window = (left, right)``, and their ``DROPOUT`` /
    ``WINDOW`` constexprs. Without dropout or a window they are None, which Triton turns into
    constants: the kernels then take exactly the parameters they take without these features. An
    unbounded side of a window is passed as ``Lq + Lk``, which no index difference reaches."""
    dropout = spec.dropout_p > 0.0
    drop_args = None
    if dropout:
        if spec.dropout_rng is None:
            raise ValueError("ssa_flash: dropout_p > 0 needs the (seed, offset) tensor spec.dropout_rng")
        p = float(spec.dropout_p)
        hi, lo = _split_scale(1.0 / (1.0 - p) if p < 1.0 else 0.0)
        drop_args = (spec.dropout_rng, dropout_keep_threshold(p), hi, lo)
    window = spec.window_left >= 0 or spec.window_right >= 0
    unbounded = Lq + Lk
    left = min(spec.window_left, unbounded) if spec.window_left >= 0 else unbounded
    right = min(spec.window_right, unbounded) if spec.window_right >= 0 else unbounded
    return dict(dropout=drop_args, window=(left, right) if window else None), dict(DROPOUT=dropout, WINDOW=window)


def _logit_args(spec: AttentionSpec, sinks: Optional[torch.Tensor], acc: torch.dtype):
    """The attention kernels' ``sinks`` and ``softcap = (hi, lo)`` arguments and their ``SINKS`` /
    ``SOFTCAP`` constexprs, which appear only when on: without a sink or a cap the arguments are
    None (constants to Triton) and the constexprs those of the kernels' defaults, so such calls
    compile exactly the kernels they compiled before these features existed."""
    args = dict(sinks=None, softcap=None)
    consts = {}
    if sinks is not None:
        args["sinks"] = sinks.to(acc).contiguous()
        consts["SINKS"] = True
    if spec.softcap > 0:
        args["softcap"] = _split_scale(float(spec.softcap))
        consts["SOFTCAP"] = True
    return args, consts


# Tests set this to 3 or 4 to run the polynomial exp2 under the interpreter (see below).
FORCE_POLY_EXP2: Optional[int] = None


def _poly_exp2_degree(q, score: int, head_block: int, kernel: str) -> int:
    """Degree of the polynomial ``exp2`` (``fast_math.exp2_poly``) that computes half of the interior
    tiles' MUFU work on the FMA pipe, or 0 for none: in the forward half of the weights' exp2, in
    the dK/dV kernel half of SSA's reciprocals ``1 / (1 + b|z|) = 2^-|x|``. Only where the
    audit's bound says it pays: SSA (two MUFU ops per element in the forward, LG2 and EX2; three
    in the backward, with RCP) at head dims <= 64, where the MUFU time (1/16 clock per op and
    element on sm_80/sm_90) exceeds the tensor and the issue time; on a GPU with 16-bit inputs
    (degree 3, relative error 7.5e-5, for bfloat16's 2^-9 rounding; degree 4, 2.6e-6, for
    float16's 2^-11).

    The forward and the dQ kernel keep the hardware exp2 / reciprocal unless
    ``SSA_FLASH_POLY_EXP2=1``: there the polynomial lowers the bound (forward D=64 bf16 sm_90:
    0.127 -> 0.102 clock per element) but raises SSA's instructions per element past the audit's
    gates (1.5x softmax's in the forward, 2.0x in the backward; bench/NOTES.md). A GPU
    measurement should decide. Which score functions qualify: ``logits.poly_exp2_pays``."""
    if FORCE_POLY_EXP2 is not None:
        return FORCE_POLY_EXP2
    if not (poly_exp2_pays(score) and head_block <= 64 and _fast_math(q)):
        return 0
    if kernel != "bwd_dkdv" and os.environ.get("SSA_FLASH_POLY_EXP2", "0") in ("", "0"):
        return 0
    return {torch.bfloat16: 3, torch.float16: 4}.get(q.dtype, 0)


def tf32_allowed() -> bool:
    """Whether torch's own float32 matmuls on CUDA may use TF32 tensor cores: True after
    ``torch.set_float32_matmul_precision("high")`` or ``("medium")`` or
    ``torch.backends.cuda.matmul.allow_tf32 = True`` (torch keeps the two in step); False at
    torch's default, ``"highest"``."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def dot_precision(dtype: torch.dtype, arch: Optional[int]) -> str:
    """``input_precision`` of the kernels' ``tl.dot`` (the ``DOT_PRECISION`` constexpr, so a change
    of torch's setting compiles and caches another kernel): ``"tf32"`` for float32 inputs on a
    GPU with TF32 tensor cores (sm_80+) when :func:`tf32_allowed`, as torch's float32 matmuls do;
    ``"ieee"`` otherwise (float32 at ``"highest"``, 16-bit inputs, which the precision does not
    affect, float64, the interpreter). Read on the host at every call, outside any graph."""
    if dtype != torch.float32 or arch is None or arch < 80:
        return "ieee"
    return "tf32" if tf32_allowed() else "ieee"


_common: dict = {}


def _common_consts(q, spec: AttentionSpec, score: int, mask_kind, dv=None):
    """The constexprs every attention kernel takes (a new dict each call: callers add theirs),
    kept per what decides them."""
    d = q.shape[-1]
    arch = _device_arch(q.device)
    tf32 = q.dtype == torch.float32 and tf32_allowed()
    # arch decides FAST_MATH too: None exactly where the interpreter runs (see _fast_math)
    key = (q.dtype, q.device.type, arch, d, dv, score, spec.causal, mask_kind, tf32)
    consts = _common.get(key)
    if consts is None:
        even = _head_block(d) == d and (dv is None or _head_block(dv) == dv)
        consts = _common[key] = dict(
            SCORE=score, CAUSAL=spec.causal, MASK_KIND=mask_kind,
            BLOCK_D=_head_block(d), EVEN_D=even, ACC=_acc_dtype(q.dtype),
            DOT_PRECISION=dot_precision(q.dtype, arch), FAST_MATH=_fast_math(q),
        )
    return dict(consts)


def _stat_tensor(q):
    B, H, Lq, _ = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty((B, H, Lq), device=q.device, dtype=dtype)


def _packed_view(x):
    """``(total, H, D)`` -> the ``(1, H, total, D)`` view the kernels index (no copy)."""
    return x.unsqueeze(0).transpose(1, 2)


def _check_packed_offsets(x, max_len: int):
    """Kernels index a packed sequence's rows with int32 offsets from its first row (int64)."""
    if x.is_contiguous() and x.numel() < 2**31:  # then no sequence spans 2^31 (cheap, common)
        return
    span = (max_len - 1) * abs(x.stride(0)) + sum((size - 1) * abs(st) for size, st in zip(x.shape[1:], x.stride()[1:]))
    if span >= 2**31:
        raise ValueError(f"ssa_flash: one sequence of a packed tensor of shape {tuple(x.shape)} and strides "
                         f"{x.stride()} spans {span} elements; the Triton kernels support up to 2^31")


class _Layout(NamedTuple):
    """What the kernels need to know about the layout, resolved from ``layout=``."""

    varlen: int  # VARLEN_*
    q: torch.Tensor  # 4-D views as the kernels index them
    k: torch.Tensor
    v: Optional[torch.Tensor]
    batch: int  # batch elements or packed sequences
    Lq: int  # queries per batch element (packed: the longest sequence)
    Lk: int
    cu_q: torch.Tensor  # pointer arguments (dummies where unused)
    cu_k: torch.Tensor
    seqused_k: torch.Tensor
    stat_stride_h: int  # packed: per-row statistics are (H, total_q)
    splits: int  # KV cache: programs sharing each row block's keys


def _resolve_layout(q, k, v, layout) -> _Layout:
    if layout is None:
        _check_offsets(q, k, *(() if v is None else (v,)))
        return _Layout(VARLEN_NONE, q, k, v, q.shape[0], q.shape[2], k.shape[2], q, q, q, 0, 1)
    if isinstance(layout, Packed):
        _check_packed_offsets(q, layout.max_seqlen_q)
        for t in (k, v):
            if t is not None:
                _check_packed_offsets(t, layout.max_seqlen_k)
        pv = None if v is None else _packed_view(v)
        return _Layout(VARLEN_PACKED, _packed_view(q), _packed_view(k), pv, layout.cu_seqlens_q.shape[0] - 1,
                       int(layout.max_seqlen_q), int(layout.max_seqlen_k), layout.cu_seqlens_q,
                       layout.cu_seqlens_k, layout.cu_seqlens_q, q.shape[0], 1)
    if isinstance(layout, KVCache):
        _check_offsets(q, k, *(() if v is None else (v,)))
        varlen = VARLEN_CACHE if layout.k_start is None else VARLEN_CACHE_START
        k_start = layout.seqused_k if layout.k_start is None else layout.k_start
        return _Layout(varlen, q, k, v, q.shape[0], q.shape[2], k.shape[2], q, k_start, layout.seqused_k,
                       0, int(layout.num_splits))
    raise TypeError(f"unknown layout {type(layout).__name__}")


def _stat_for(lay: _Layout, q_orig, H):
    """A per-row statistic: ``(B, H, Lq)``, or ``(H, total_q)`` for a packed batch."""
    dtype = torch.float64 if q_orig.dtype == torch.float64 else torch.float32
    if lay.varlen == VARLEN_PACKED:
        return torch.empty((H, q_orig.shape[0]), device=q_orig.device, dtype=dtype)
    return _stat_tensor(q_orig)


def _splits(lay: _Layout, block_m: int, block_n: int, H: int, device) -> int:
    if lay.varlen < VARLEN_CACHE:
        return 1
    if lay.splits > 0:
        return lay.splits
    programs = _cdiv(lay.Lq, block_m) * lay.batch * H
    return num_splits_heuristic(programs, _cdiv(lay.Lk, block_n), _sm_count(device))


def _kernel_name(base: str, lay: _Layout) -> str:
    """Kernel names for the block tables: KV-cache launches with short query blocks use the
    decoding table."""
    return base + "_decode" if lay.varlen >= VARLEN_CACHE and lay.Lq <= 16 else base


def _merge_block_s(splits: int) -> int:
    return max(2, _next_pow2(splits))


# Rows whose length is not a multiple of 8 elements (odd head dims such as 59 or 111) cannot be
# loaded as 16-byte vectors: every element goes through registers on its own and the main loops
# spill at any useful tile size (static audit: 200-900 B per thread at D=111 on sm_80 and sm_90,
# even with 32 x 32 tiles). Like FlashAttention, the host functions below zero-pad such head
# dims to the next multiple of 8 (an O(L D) copy next to O(L^2 D) work; zero columns change
# neither q . k nor the kept columns of the output) and slice the results. Not for a KV cache:
# there the copy would be as large as the decoding step's own reads.
HEAD_DIM_ALIGN = 8


def _unaligned(layout, *tensors) -> bool:
    return not isinstance(layout, KVCache) and any(t.shape[-1] % HEAD_DIM_ALIGN for t in tensors)


def _pad_head(x):
    pad = (-x.shape[-1]) % HEAD_DIM_ALIGN
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def _score_id(spec: AttentionSpec) -> int:
    """The registry id of ``spec.score`` (``ValueError`` for an unknown name)."""
    return scores.get(spec.score).id


def row_entropy(q, k, mask, params, spec: AttentionSpec, layout=None, sinks=None):
    """Entropy and log-sum-exp of ``softmax(l)`` per row (the sink an entry of the row if
    ``sinks``), each ``(B, Hq, Lq)`` (packed: ``(Hq, total_q)``), O(L) memory. ``params``: the
    score function's per-head parameters (module docstring)."""
    if _unaligned(layout, q):
        return row_entropy(_pad_head(q), _pad_head(k), mask, params, spec, layout, sinks)
    plan_key = _dense_key(q, k, k, mask, params, spec, layout, sinks)
    if plan_key is not None:
        plan_key = ("row_entropy", plan_key)
        plan = plans.get(plan_key)
        if plan is not None:
            return _ent_replay(plan, q, k, mask, params)
    lay = _resolve_layout(q, k, None, layout)
    q4, k4 = lay.q, lay.k
    _, H, _, D = q4.shape
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    ent, lse_l = _stat_for(lay, q, H), _stat_for(lay, q, H)
    mask_args, mask_kind = _mask_args(mask, q4)
    score = _score_id(spec)
    score_params = kernel_params(score, params, q)  # q: a dummy for absent parameters
    consts = _common_consts(q4, spec, score, mask_kind)
    consts.update(VARLEN=lay.varlen)
    feat_args, feat_consts = _feature_args(q, lay.Lq, lay.Lk, spec)
    consts["WINDOW"] = feat_consts["WINDOW"]  # dropout acts after the statistics
    logit_args, logit_consts = _logit_args(spec, sinks, acc_torch)
    consts.update(logit_consts)
    name = _kernel_name("row_entropy", lay)
    state = {}

    def args(blk):
        splits = _splits(lay, blk.m, blk.n, H, q.device)
        state["splits"] = splits
        ent_out, lse_out = ent, lse_l
        if splits > 1:
            shape = (splits,) + tuple(ent.shape)
            state["parts"] = ent_out, lse_out = (torch.empty(shape, device=q.device, dtype=acc_torch),
                                                 torch.empty(shape, device=q.device, dtype=acc_torch))
        return _positional(
            "row_entropy", Q=q4, K=k4, ENT=ent_out, LSE=lse_out, score_params=score_params, **mask_args,
            q_strides=_strides(q4), k_strides=_strides(k4),
            dims=(H, lay.Lq, lay.Lk, D, spec.group, _cdiv(lay.Lq, blk.m)),
            **_scale_args(spec.scale), seqlens=(lay.cu_q, lay.cu_k, lay.seqused_k),
            stat_stride_h=lay.stat_stride_h, stat_stride_s=ent.numel() if splits > 1 else 0,
            window=feat_args["window"], **logit_args)

    def grid(blk):
        return (_cdiv(lay.Lq, blk.m) * lay.batch * H, _splits(lay, blk.m, blk.n, H, q.device))

    blk = _launch(row_entropy_kernel, name, grid, args, dict(consts, SPLIT=None), q.device, consts["BLOCK_D"],
                  q.dtype, spec.deterministic, (lay.Lq, lay.Lk, lay.batch * H))
    if plan_key is not None and state.get("splits", 1) == 1 and _capture is None:
        launch = _plan_launch(row_entropy_kernel, "row_entropy", _ENT_SLOTS, blk, grid(blk), args(blk),
                              dict(consts, SPLIT=None), q.device)
        if launch is not None:
            plans.put(plan_key, plans.Plan([launch], (tuple(ent.shape), ent.dtype, score)))
    if state.get("splits", 1) > 1 and _capture is None:
        ent_part, lse_part = state["parts"]
        with _on_device(q.device):
            direct.LAUNCHER.run(merge_entropy_kernel, (ent.numel(),),
                                (ent_part, lse_part, ent, lse_l, state["splits"], ent.numel()),
                                dict(BLOCK_S=_merge_block_s(state["splits"]), ACC=_acc_dtype(q.dtype)), {}, q.device)
    return ent, lse_l


def forward(q, k, v, mask, params, beta, spec: AttentionSpec, layout=None, sinks=None):
    """Output ``(B, Hq, Lq, Dv)`` in q's dtype and natural-log LSE ``(B, Hq, Lq)`` of ``beta * l``
    (packed: ``(total_q, Hq, Dv)`` and ``(Hq, total_q)``); with ``sinks`` of ``beta * [l, s_h]``.
    ``params``: the score function's per-head parameters (module docstring)."""
    if _unaligned(layout, q, v):
        o, lse = forward(_pad_head(q), _pad_head(k), _pad_head(v), mask, params, beta, spec, layout, sinks)
        return o[..., :v.shape[-1]].contiguous(), lse
    plan_key = _fwd_plan_key(q, k, v, mask, params, beta, spec, layout, sinks)
    if plan_key is not None:
        plan = plans.get(plan_key)
        if plan is not None:
            return _fwd_replay(plan, q, k, v, mask, params, beta, spec)
    lay = _resolve_layout(q, k, v, layout)
    q4, k4, v4 = lay.q, lay.k, lay.v
    _, H, _, D = q4.shape
    DV = v4.shape[3]
    acc_torch = torch.float64 if q.dtype == torch.float64 else torch.float32
    if lay.varlen == VARLEN_PACKED:
        o = torch.empty((q.shape[0], H, DV), device=q.device, dtype=q.dtype)
        o4 = _packed_view(o)
    else:
        o = o4 = torch.empty((q.shape[0], H, q.shape[2], DV), device=q.device, dtype=q.dtype)
    lse = _stat_for(lay, q, H)
    mask_args, mask_kind = _mask_args(mask, q4)
    score = _score_id(spec)
    score_params = kernel_params(score, params, q)
    consts = _common_consts(q4, spec, score, mask_kind, DV)
    consts.update(ADAPTIVE=spec.adaptive, BLOCK_DV=_head_block(DV), VARLEN=lay.varlen,
                  POLY_EXP2=_poly_exp2_degree(q, score, max(consts["BLOCK_D"], _head_block(DV)), "fwd"))
    name = _kernel_name("fwd", lay)
    state = {}
    feat_args, feat_consts = _feature_args(q, lay.Lq, lay.Lk, spec)
    consts.update(feat_consts)
    logit_args, logit_consts = _logit_args(spec, sinks, acc_torch)
    consts.update(logit_consts)

    def args(blk):
        splits = _splits(lay, blk.m, blk.n, H, q.device)
        state["splits"] = splits
        o_out, lse_out, stride_os = o4, lse, 0
        if splits > 1:
            state["parts"] = o_out, lse_out = (
                torch.empty((splits,) + tuple(o.shape), device=q.device, dtype=acc_torch),
                torch.empty((splits,) + tuple(lse.shape), device=q.device, dtype=acc_torch))
            stride_os = o_out.stride(0)
            o_out = o_out.select(0, 0)
        return _positional(
            "fwd", Q=q4, K=k4, V=v4, O=o_out, LSE=lse_out, BETA=beta if spec.adaptive else q,
            score_params=score_params, **mask_args,
            q_strides=_strides(q4), k_strides=_strides(k4), v_strides=_strides(v4), o_strides=_strides(o_out),
            dims=(H, lay.Lq, lay.Lk, D, DV, spec.group, _cdiv(lay.Lq, blk.m)),
            **_scale_args(spec.scale), seqlens=(lay.cu_q, lay.cu_k, lay.seqused_k),
            stat_stride_h=lay.stat_stride_h, split_strides=(stride_os, lse.numel() if splits > 1 else 0),
            **feat_args, **logit_args)

    def grid(blk):
        return (_cdiv(lay.Lq, blk.m) * lay.batch * H, _splits(lay, blk.m, blk.n, H, q.device))

    # the warp-specialised form (WARP_SPECIALIZE) implements dense layouts with D = DV in {64, 128}
    # and 16-bit inputs only, without mask, dropout, window, sinks or cap; it reads beta through a
    # descriptor too, whose rows of each (batch, head) must start 16-byte aligned
    # (the table's answer first: elsewhere than sm_90 nothing more is read on the host path)
    ws_ok = (tiles.warp_specialized_forward(_device_arch(q.device), consts["BLOCK_D"], q.dtype) is not None
             and lay.varlen == VARLEN_NONE and mask_kind == MASK_NONE and D == DV and D in (64, 128)
             and q.dtype in (torch.float16, torch.bfloat16) and not feat_consts["DROPOUT"]
             and not feat_consts["WINDOW"] and not logit_consts and _tma_ready(q4, k4, v4)
             and (not spec.adaptive or (lay.Lq % 4 == 0 and beta.is_contiguous() and beta.data_ptr() % 16 == 0)))
    if ws_ok:
        # no index checks in the warp-specialised loop where every key block is whole and none is
        # cut by the diagonal (its key tiles are 64 or 128 wide: 128 divides both)
        consts["WS_FULL_BLOCKS"] = not spec.causal and lay.Lk % 128 == 0
    blk = _launch(attention_fwd_kernel, name, grid, args, dict(consts, SPLIT=None), q.device,
                  max(consts["BLOCK_D"], consts["BLOCK_DV"]), q.dtype, spec.deterministic,
                  (lay.Lq, lay.Lk, lay.batch * H), ws_ok)
    splits = state.get("splits", 1)
    if plan_key is not None and splits == 1 and _capture is None:
        _plan_forward(plan_key, blk, grid, args, dict(consts, SPLIT=None), q, o, lse, mask_args, feat_args)
    if splits > 1 and _capture is None:
        o_part, lse_part = state["parts"]
        with _on_device(q.device):
            direct.LAUNCHER.run(
                merge_output_kernel, (lse.numel(),),
                (o_part, lse_part, o, lse, tuple(o_part.stride()), tuple(o.stride()), H, lay.Lq, DV, splits, lse.numel()),
                dict(BLOCK_S=_merge_block_s(splits), BLOCK_DV=_head_block(DV), ACC=_acc_dtype(q.dtype)), {}, q.device)
    return o, lse


# Launch plans (plans.py) of the dense forward: the tensors a call passes, by the names of the
# kernel's runtime parameters, in the order a plan's launch fills them
_FWD_SLOTS = ("Q", "K", "V", "O", "LSE", "BETA", "score_params", "MASK", "seqlens", "dropout")
_ENT_SLOTS = ("Q", "K", "ENT", "LSE", "score_params", "MASK", "seqlens")


def _ent_replay(plan, q, k, mask, params):
    """:func:`row_entropy` from its plan."""
    shape, dtype, score = plan.extra
    ent = torch.empty(shape, device=q.device, dtype=dtype)
    lse_l = torch.empty(shape, device=q.device, dtype=dtype)
    _run_plan(plan, q.device, (q, k, ent, lse_l, kernel_params(score, params, q), _planned_mask(mask, q), (q, q, q)))
    return ent, lse_l


def _planned_mask(mask, q):
    """The ``MASK`` argument of a planned launch (as :func:`_mask_args` gives it)."""
    if mask is None:
        return q
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _run_plan(plan, device: torch.device, *tensors) -> None:
    """Run ``plan``'s launches, each with its tuple of ``tensors``, with ``device`` current."""
    if plans.on_device(device):
        for launch, ts in zip(plan.launches, tensors):
            launch.run(device, ts)
    else:
        with _on_device(device):
            for launch, ts in zip(plan.launches, tensors):
                launch.run(device, ts)


def _spec_key(spec: AttentionSpec) -> tuple:
    """The fields of ``spec`` a dense launch depends on (the dropout tensor by its key only)."""
    return (spec.scale, spec.score, spec.causal, spec.group, spec.adaptive, spec.poly, spec.threshold,
            spec.deterministic, spec.dropout_p, spec.window_left, spec.window_right, spec.softcap,
            plans.tensor_key(spec.dropout_rng))


def _fwd_plan_key(q, k, v, mask, params, beta, spec: AttentionSpec, layout, sinks) -> Optional[tuple]:
    """The plan key of a dense forward (see plans.py), or None where the call is not planned."""
    key = _dense_key(q, k, v, mask, params, spec, layout, sinks)
    if key is None:
        return None
    return ("fwd", key, plans.tensor_key(beta) if spec.adaptive else None)


def _dense_key(q, k, v, mask, params, spec: AttentionSpec, layout, sinks) -> Optional[tuple]:
    """What every dense launch's plan key holds (the inputs, the spec, the global switches the
    constexprs read), or None where the call is not planned: a layout, sinks, a boolean mask
    turned additive, parameters that are not tensors, or launches that cannot be planned now
    (:func:`plans.usable`)."""
    if layout is not None or sinks is not None or _capture is not None or not plans.usable(q.device):
        return None
    if mask is not None and mask.dtype == torch.bool and _bool_mask_as_additive(q):
        return None
    try:
        pkey = tuple([plans.tensor_key(p) for p in params])
    except AttributeError:  # a number among the parameters
        return None
    return (plans.tensor_key(q), plans.tensor_key(k), plans.tensor_key(v), q.device, plans.tensor_key(mask), pkey,
            _spec_key(spec),
            q.dtype == torch.float32 and tf32_allowed(), FORCE_POLY_EXP2,
            os.environ.get("SSA_FLASH_POLY_EXP2") if spec.score == "ssa" else None)


def _plan_launch(kernel, name: str, slots: tuple, blk: Blocks, grid: tuple, args: tuple, consts: dict,
                 device: torch.device):
    """The :class:`plans.Launch` of the launch of ``kernel`` (``_PARAMS`` name ``name``) just made
    in configuration ``blk`` with ``grid``, runtime ``args`` and ``consts`` (as :func:`_run` made
    it), its tensor slots those of the parameters named in ``slots``; None if nothing was kept."""
    grid, kconsts = _split_grid(grid, consts)
    return plans.make_launch(kernel, grid, args, _block_consts(kconsts, blk), _options(blk, _device_arch(device)), device,
                             tuple(_PARAMS[name].index(n) for n in slots))


def _plan_forward(key, blk, grid_fn, args_fn, consts, q, o, lse, mask_args, feat_args) -> None:
    """Keep the plan of the dense forward launch just made in configuration ``blk``, if the
    direct launcher kept its compiled kernel."""
    launch = _plan_launch(attention_fwd_kernel, "fwd", _FWD_SLOTS, blk, grid_fn(blk), args_fn(blk), consts, q.device)
    if launch is None:
        return
    drop = feat_args["dropout"]
    extra = (tuple(o.shape), tuple(lse.shape), lse.dtype, consts["SCORE"], None if drop is None else drop[1:],
             blk.ws)
    plans.put(key, plans.Plan([launch], extra))


def _fwd_replay(plan, q, k, v, mask, params, beta, spec: AttentionSpec):
    """:func:`forward` from its plan: allocate the outputs, fill the tensor slots, launch."""
    o_shape, lse_shape, lse_dtype, score, drop_rest, ws = plan.extra
    if ws:  # Triton's allocator is a context variable: the launching thread may not have it yet
        _ensure_allocator()  # (a checkpointed forward recomputed in the autograd engine's thread)
    o = torch.empty(o_shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(lse_shape, device=q.device, dtype=lse_dtype)
    _run_plan(plan, q.device, (q, k, v, o, lse, beta if spec.adaptive else q, kernel_params(score, params, q),
                               _planned_mask(mask, q), (q, q, q),
                               None if drop_rest is None else (spec.dropout_rng, *drop_rest)))
    return o, lse


def backward(do, q, k, v, o, lse, dlse, mask, params, temp: Optional[TemperatureState],
             spec: AttentionSpec, layout=None, *, g: Optional[torch.Tensor] = None,
             dbeta_only: bool = False, sinks: Optional[torch.Tensor] = None):
    """Gradients ``(dq, dk, dv, dparams, dsinks)``; ``dparams`` is a tuple with one ``(Hq,)``
    tensor (accumulation dtype) per entry of ``params`` (``()`` for softmax), ``dsinks`` ``(Hq,)``
    or None without ``sinks``.

    ``dlse`` (or None) is the gradient reaching the returned LSE: since ``d lse_i / d S'_ij = P'_ij``
    it only shifts ``delta`` (``delta_i = rowsum(dO_i * O_i) - dlse_i``). ``layout``: None (dense) or
    :class:`Packed`.

    For callers holding a shard of the keys (adaptive only; see :func:`row_dbeta`): ``g``
    ``(B, Hq, Lq)`` is the temperature gradient ``g_i = dbeta_i * dbeta/dH_i`` of whole rows, used
    instead of the one computed from the keys given; ``dbeta_only`` runs the dQ kernel alone and
    returns its ``g`` (``temp.dbeta_dh`` of ones makes that the partial ``dbeta``, centred as
    :func:`row_dbeta` says).
    """
    if isinstance(layout, KVCache):
        raise NotImplementedError("ssa_flash: the KV-cache layout (decoding) is forward only")
    if _unaligned(layout, q, v):
        res = backward(_pad_head(do), _pad_head(q), _pad_head(k), _pad_head(v), _pad_head(o), lse, dlse, mask,
                       params, temp, spec, layout, g=g, dbeta_only=dbeta_only, sinks=sinks)
        if dbeta_only:
            return res
        dq, dk, dv, dparams, dsinks = res
        D, DV = q.shape[-1], v.shape[-1]
        return dq[..., :D].contiguous(), dk[..., :D].contiguous(), dv[..., :DV].contiguous(), dparams, dsinks
    plan_key = None
    if g is None and not dbeta_only:
        plan_key = _bwd_plan_key(do, q, k, v, o, lse, dlse, mask, params, temp, spec, layout, sinks)
        if plan_key is not None:
            plan = plans.get(plan_key)
            if plan is not None:
                return _bwd_replay(plan, do, q, k, v, o, lse, dlse, mask, params, temp, spec)
    lay = _resolve_layout(q, k, v, layout)
    packed = lay.varlen == VARLEN_PACKED
    q4, k4, v4 = lay.q, lay.k, lay.v
    do4, o4 = (_packed_view(do), _packed_view(o)) if packed else (do, o)
    _, H, _, D = q4.shape
    HKV, DV = k4.shape[1], v4.shape[3]
    if packed:
        _check_packed_offsets(do, lay.Lq)
        _check_packed_offsets(o, lay.Lq)
    else:
        _check_offsets(do, o)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    dq4, dk4, dv4 = (_packed_view(dq), _packed_view(dk), _packed_view(dv)) if packed else (dq, dk, dv)
    delta = _stat_for(lay, q, H)
    lse2 = _stat_for(lay, q, H)  # the LSE in base 2, -inf (empty rows) as 0: written by the dQ kernel
    acc_torch = delta.dtype
    mask_args, mask_kind = _mask_args(mask, q4)
    lse_lo = _lse_residuals(lay, q, H, mask_kind, spec.adaptive, lse2)
    score = _score_id(spec)
    score_params = kernel_params(score, params, q)
    n_params = len(tuple(params))
    consts = _common_consts(q4, spec, score, mask_kind, DV)
    consts.update(ADAPTIVE=spec.adaptive, BLOCK_DV=_head_block(DV), VARLEN=lay.varlen)
    feat_args, feat_consts = _feature_args(q, lay.Lq, lay.Lk, spec)
    consts.update(feat_consts)
    head_block = max(consts["BLOCK_D"], consts["BLOCK_DV"])
    consts.update(POLY_EXP2=_poly_exp2_degree(q, score, head_block, "bwd_dkdv"))
    logit_args, logit_consts = _logit_args(spec, sinks, acc_torch)
    if spec.adaptive:
        beta, lse_l, ent, dbeta_dh = temp
        g_given = g is not None
        g = _stat_for(lay, q, H) if g is None else g.to(acc_torch).contiguous()
    else:
        g_given = False
        if g is not None or dbeta_only:
            raise ValueError("g and dbeta_only are for the adaptive temperature only")
        beta = lse_l = ent = dbeta_dh = g = q
    common_args = dict(score_params=score_params, **mask_args, q_strides=_strides(q4), k_strides=_strides(k4),
                       v_strides=_strides(v4), do_strides=_strides(do4), **_scale_args(spec.scale),
                       seqlens=(lay.cu_q, lay.cu_k), **feat_args)
    B = lay.batch
    parts = {}

    def dq_args(blk):
        num_m = _cdiv(lay.Lq, blk.m)
        # one partial sum per program and parameter; packed: programs past their sequence's end
        # write none
        alloc = torch.zeros if packed else torch.empty
        parts["dparams"] = [alloc((B * H * num_m,), device=q.device, dtype=acc_torch) for _ in range(n_params)]
        sink_args = None
        if sinks is not None:
            parts["dsinks"] = (torch.zeros if packed else torch.empty)((B * H * num_m,), device=q.device,
                                                                     dtype=acc_torch)
            sink_args = (logit_args["sinks"], parts["dsinks"])
        param_parts = kernel_params(score, parts["dparams"], q)
        return _positional(
            "bwd_dq", Q=q4, K=k4, V=v4, O=o4, DO=do4, DQ=dq4,
            row_stats=(lse, dlse if dlse is not None else q, delta, lse2, *lse_lo, lay.stat_stride_h),
            temperature=(beta, lse_l, ent, dbeta_dh, g),
            param_parts=param_parts, **common_args, o_strides=_strides(o4), dq_strides=_strides(dq4),
            dims=(H, lay.Lq, lay.Lk, D, DV, spec.group, num_m), sinks=sink_args, softcap=logit_args["softcap"])

    dq_consts = dict(consts, **logit_consts, HAS_DLSE=dlse is not None,
                     POLY_EXP2=_poly_exp2_degree(q, score, head_block, "bwd_dq"))
    if g_given:  # only then: the default specialisations' constexprs stay as they were
        dq_consts["G_GIVEN"] = True
    if dbeta_only and dlse is not None:  # a shard's dbeta: the caller adds lse_l * dlse once per row
        dq_consts["DBETA_PART"] = True
    dq_grid = lambda blk: (_cdiv(lay.Lq, blk.m) * B * H,)  # noqa: E731
    dq_blk = _launch(attention_bwd_dq_kernel, "bwd_dq", dq_grid, dq_args,
                     dq_consts, q.device, head_block, q.dtype, spec.deterministic, (lay.Lq, lay.Lk, B * H))
    if dbeta_only:
        return g
    dq_planned = None
    if plan_key is not None and _capture is None:
        launched = dict(parts)  # dq_args allocates new partial sums: keep the launched ones
        dq_planned = (dq_blk, dq_grid(dq_blk), dq_args(dq_blk))
        parts.update(launched)

    def dkdv_args(blk):
        return _positional(
            "bwd_dkdv", Q=q4, K=k4, V=v4, DO=do4, DK=dk4, DV_OUT=dv4, row_stats=(lse2, delta, *lse_lo, lay.stat_stride_h),
            temperature=(beta, lse_l, ent, g), **common_args, dk_strides=_strides(dk4), dv_strides=_strides(dv4),
            dims=(H, HKV, lay.Lq, lay.Lk, D, DV, spec.group, _cdiv(lay.Lk, blk.n)),
            softcap=logit_args["softcap"])

    dkdv_consts = dict(consts)
    if spec.softcap > 0:  # the dK/dV kernel needs no sink (its tiles use the sink-including LSE)
        dkdv_consts["SOFTCAP"] = True
    dkdv_grid = lambda blk: (_cdiv(lay.Lk, blk.n) * B * HKV,)  # noqa: E731
    dkdv_blk = _launch(attention_bwd_dkdv_kernel, "bwd_dkdv", dkdv_grid,
                       dkdv_args, dkdv_consts, q.device, head_block, q.dtype, spec.deterministic,
                       (lay.Lq, lay.Lk, B * H))
    if dq_planned is not None:
        dq_blk, grid, args = dq_planned
        _plan_backward(plan_key, q, (dq_blk, grid, args, dq_consts),
                       (dkdv_blk, dkdv_grid(dkdv_blk), dkdv_args(dkdv_blk), dkdv_consts),
                       (tuple(delta.shape), acc_torch, B * H * _cdiv(lay.Lq, dq_blk.m), n_params, score,
                        None if feat_args["dropout"] is None else feat_args["dropout"][1:], lay.stat_stride_h))
    dsinks = None
    # per-program partial sums added in a fixed order; per query head
    dparams = tuple(part.view(B, H, -1).sum(dim=(0, 2)) for part in parts["dparams"])
    if sinks is not None:
        dsinks = parts["dsinks"].view(B, H, -1).sum(dim=(0, 2))
    return dq, dk, dv, dparams, dsinks


def _lse_residuals(lay: _Layout, q, H: int, mask_kind: int, adaptive: bool, dummy) -> tuple:
    """``(LSE2_LO, LSE_L2_HI, LSE_L2_LO)``, the backward's buffers of the recounted LSEs
    (``lse_residual.py``): per-row statistics with an additive mask (the last two with the
    adaptive temperature only), ``dummy`` otherwise (never read)."""
    if mask_kind != MASK_ADD:
        return dummy, dummy, dummy
    lo = _stat_for(lay, q, H)
    if not adaptive:
        return lo, lo, lo
    return lo, _stat_for(lay, q, H), _stat_for(lay, q, H)


# the tensors a call passes to each backward kernel (plans.py), by their parameters' names
_DQ_SLOTS = ("Q", "K", "V", "O", "DO", "DQ", "row_stats", "temperature", "score_params", "param_parts", "MASK",
             "seqlens", "dropout")
_DKDV_SLOTS = ("Q", "K", "V", "DO", "DK", "DV_OUT", "row_stats", "temperature", "score_params", "MASK", "seqlens",
               "dropout")


def _bwd_plan_key(do, q, k, v, o, lse, dlse, mask, params, temp, spec: AttentionSpec, layout, sinks):
    """The plan key of a dense backward (as :func:`_fwd_plan_key`), or None."""
    key = _dense_key(q, k, v, mask, params, spec, layout, sinks)
    if key is None:
        return None
    tk = plans.tensor_key
    return ("bwd", key, tk(do), tk(o), tk(lse), tk(dlse),
            tuple([tk(t) for t in temp]) if spec.adaptive else None)


def _plan_backward(key, q, dq_launch, dkdv_launch, extra) -> None:
    """Keep the plan of the dense backward's two launches just made (``(blk, grid, args,
    constexprs)`` each), if the direct launcher kept both compiled kernels."""
    launches = []
    for kernel, name, slots, (blk, grid, args, consts) in (
            (attention_bwd_dq_kernel, "bwd_dq", _DQ_SLOTS, dq_launch),
            (attention_bwd_dkdv_kernel, "bwd_dkdv", _DKDV_SLOTS, dkdv_launch)):
        launch = _plan_launch(kernel, name, slots, blk, grid, args, consts, q.device)
        if launch is None:
            return
        launches.append(launch)
    plans.put(key, plans.Plan(launches, extra))


def _bwd_replay(plan, do, q, k, v, o, lse, dlse, mask, params, temp, spec: AttentionSpec):
    """:func:`backward` from its plan (dense, no sinks, no given ``g``)."""
    stat_shape, acc, n_parts, n_params, score, drop_rest, h = plan.extra
    dev = q.device
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty(stat_shape, device=dev, dtype=acc)
    lse2 = torch.empty(stat_shape, device=dev, dtype=acc)
    lse_lo = (lse2,) * 3
    if mask is not None and (mask.is_floating_point() or _bool_mask_as_additive(q)):  # MASK_ADD: residuals
        lse_lo = tuple(torch.empty(stat_shape, device=dev, dtype=acc) for _ in range(3))
    if spec.adaptive:
        beta, lse_l, ent, dbeta_dh = temp
        g = torch.empty(stat_shape, device=dev, dtype=acc)
    else:
        beta = lse_l = ent = dbeta_dh = g = q
    parts = [torch.empty((n_parts,), device=dev, dtype=acc) for _ in range(n_params)]
    score_params = kernel_params(score, params, q)
    mask = _planned_mask(mask, q)
    dropout = None if drop_rest is None else (spec.dropout_rng, *drop_rest)
    _run_plan(plan, dev,
              (q, k, v, o, do, dq, (lse, q if dlse is None else dlse, delta, lse2, *lse_lo, h),
               (beta, lse_l, ent, dbeta_dh, g),
               score_params, kernel_params(score, parts, q), mask, (q, q), dropout),
              (q, k, v, do, dk, dv, (lse2, delta, *lse_lo, h), (beta, lse_l, ent, g), score_params, mask, (q, q),
               dropout))
    B, H = q.shape[0], q.shape[1]
    dparams = tuple(part.view(B, H, -1).sum(dim=(0, 2)) for part in parts)
    return dq, dk, dv, dparams, None


def row_dbeta(do, q, k, v, o, lse, dlse, mask, params, temp: TemperatureState, spec: AttentionSpec):
    """This shard's centred part of ``dbeta_i``, ``sum_j dS'_ij (l_ij - lse^l_i)`` ``(B, Hq, Lq)``
    over the keys given (adaptive only; the contract of
    :meth:`ssa_flash.backends.spec.KeyShardTemperature.row_dbeta`): ``o``, ``lse`` and ``temp``
    are those of whole rows. One launch of the dQ kernel with ``dbeta/dH = 1`` (its other outputs
    are discarded)."""
    if not spec.adaptive:
        raise ValueError("row_dbeta is for the adaptive temperature only")
    ones = TemperatureState(temp.beta, temp.lse_l, temp.entropy, torch.ones_like(temp.dbeta_dh))
    return backward(do, q, k, v, o, lse, dlse, mask, params, ones, spec, dbeta_only=True)


def dropout_mask(rng: torch.Tensor, shape, dropout_p: float) -> torch.Tensor:
    """The keep-mask ``(B, H, Lq, Lk)`` (bool, on ``rng``'s device) that the attention kernels
    apply for the ``(seed, offset)`` tensor ``rng`` and ``dropout_p``, materialised by a kernel that
    calls the same ``dropout.dropout_keep`` on tiles of its own size. For tests and inspection."""
    B, H, Lq, Lk = (int(x) for x in shape)
    out = torch.empty((B, H, Lq, Lk), device=rng.device, dtype=torch.uint8)
    if out.numel() == 0:
        return out.bool()
    # tiles unlike any attention kernel's (which use 16 x 16 under the interpreter)
    bm, bn = (32, 64) if _device_arch(rng.device) is None else (64, 128)
    num_m, num_n = _cdiv(Lq, bm), _cdiv(Lk, bn)
    with _on_device(rng.device):
        dropout_mask_kernel[(num_m * num_n * B * H,)](
            out, rng, dropout_keep_threshold(float(dropout_p)), H, Lq, Lk, tuple(out.stride()), num_m, num_n,
            BLOCK_M=bm, BLOCK_N=bn, FAST_MATH=_device_arch(rng.device) is not None)
    return out.bool()
