"""Which block configuration a kernel launch runs, and the launch: the candidates of a
specialisation (``tiles.py``'s tables, pruned, with warp-specialised ones where Triton and the
tensors allow), the first that builds or the fastest one timed (``tuning_cache.py`` keeps the
winner), the device the launch plans for (its compute capability and SM count; the pretended one
under :func:`capture_launches` or ``direct.stub``), and the launch itself (Triton's or the direct
launcher, ``direct.py``)."""
from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor

from . import direct, tiles
from .interpreter import interpreting
from .masks import MASK_BOOL
from .tiles import Blocks, decode_candidates as _decode_candidates, prune as _prune_candidates
from .tiles import next_pow2 as _next_pow2
from .tuning_cache import cache_dir, cache_key as _cache_key, cache_load as _cache_load, cache_store as _cache_store
from .tuning_cache import logger

_MAX_GRID = 2**31 - 1



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


# Split-KV decoding: the SM count the heuristic fills when it cannot ask a GPU (the interpreter,
# meta tensors): an H100 SXM's.
DEFAULT_SMS = 132


_sm_counts: dict = {}


def sm_count(device: torch.device) -> int:
    if pretended_arch() is not None or device.type != "cuda" or interpreting():
        return DEFAULT_SMS
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


# (launch name, device, arch, head block, dtype, constexprs, deterministic, size bucket) -> Blocks;
# and ((launch name, device, arch, head block, dtype, constexprs), "candidates") -> the pruned
# candidate list (one table: clearing it forgets both)
chosen_blocks: dict = {}
recording: Optional[list] = None
_capture_arch: Optional[int] = None


def pretended_arch() -> Optional[int]:
    """The architecture that launch capture or stub mode (``direct.stub``) plans for, else None."""
    return _capture_arch if recording is not None else direct.stub_arch()


@contextmanager
def capture_launches(arch: int):
    """Within this context the launcher records a :class:`KernelLaunch` per kernel launch (with
    the configuration it would choose first on compute capability ``arch``) instead of running
    it. Call the host functions with ``meta`` tensors: outputs are allocated, nothing runs."""
    global recording, _capture_arch
    if recording is not None:
        raise RuntimeError("capture_launches is not re-entrant")
    recording, _capture_arch = [], int(arch)
    try:
        yield recording
    finally:
        recording, _capture_arch = None, None


_archs: dict = {}


def device_arch(device: torch.device) -> Optional[int]:
    """Compute capability of ``device`` as an int (90), None for the interpreter and non-CUDA
    tensors; the pretended one under capture or stub mode. Read once per device."""
    pretended = pretended_arch()
    if pretended is not None:
        return pretended
    if device.type != "cuda" or interpreting():  # (the device type first: no knob read on the CPU)
        return None
    arch = _archs.get(device)
    if arch is None:
        major, minor = torch.cuda.get_device_capability(device)
        arch = _archs[device] = 10 * major + minor
    return arch


def autotuning() -> bool:
    """Whether timed choices are allowed: not with ``SSA_FLASH_AUTOTUNE=0``, nor under
    ``torch.use_deterministic_algorithms(True)`` (which also fixes the tiles of the KV-cache and
    ring paths, which take no ``deterministic`` argument)."""
    return (os.environ.get("SSA_FLASH_AUTOTUNE", "1") not in ("", "0")
            and not torch.are_deterministic_algorithms_enabled())


def on_device(device: torch.device):
    """Context making ``device`` the current CUDA device for the launches inside it.

    Triton launches on the current device and that device's current stream, whatever device the
    tensors are on: tensors on ``cuda:1`` while ``cuda:0`` is current (a model split with
    ``device_map="auto"``) fail ("pointer cannot be accessed") or, with peer access, run on the
    wrong GPU racing the right one's stream. Entering the tensors' device is cheap when it is
    already current. Nothing to enter for the CPU (interpreter) or ``meta`` tensors (capture)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def timed(run) -> float:
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


def split_grid(grid, consts):
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


COMPILE_ERRORS = _compile_errors()
_SLOW_TUNING_S = 5.0  # tuning longer than this is logged (one line, logger "ssa_flash")


WS_ENV = "SSA_FLASH_WARP_SPECIALIZE"


def triton_warp_specializes() -> bool:
    """Whether this Triton warp-specialises the forward kernel's key loop (``tl.range(...,
    warp_specialize=True)`` with device-side tensor descriptors): 3.6 and later (compiled for
    sm_90 with 3.6 and 3.9, static audit)."""
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 6)


def tma_ready(*tensors) -> bool:
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
    if knob == "0" or blk is None or name != "fwd" or not triton_warp_specializes():
        return cands
    return [blk] + cands if knob == "1" else cands[:1] + [blk] + cands[1:]


def candidate_blocks(name: str, arch: Optional[int], head_block: int, dtype, consts: dict, ws_ok: bool = False) -> list:
    """The configurations ``launch_kernel`` may choose, best first, de-duplicated and pruned of what
    cannot fit (never compiled); ``ws_ok``: the launch may take the warp-specialised forward
    (:func:`_with_warp_specialized`)."""
    if name.endswith("_decode"):
        cands = _decode_candidates(arch, head_block, dtype)
    else:
        cands = tiles.block_candidates(arch, head_block, dtype, name, masked=consts.get("MASK_KIND", 0) != 0,
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


def launch_kernel(kernel, name: str, grid_fn, args, consts, device, head_block, dtype, deterministic: bool = False,
            sizes: tuple = (), ws_ok: bool = False):
    """Launch ``kernel`` with the best block configuration for this GPU, on ``device`` (the
    tensors' device, made current: see :func:`on_device`) and its current stream.

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
    arch = device_arch(device)
    if recording is not None:  # fresh: the audit replaces block_candidates between captures
        cands = candidate_blocks(name, arch, head_block, dtype, consts, ws_ok)
        blk = cands[0]
        grid, kconsts = split_grid(grid_fn(blk), consts)
        recording.append(KernelLaunch(name, kernel, grid, tuple(args(blk)),
                                     block_consts(kconsts, blk), blk, tuple(cands)))
        return blk
    spec_key = (name, device, arch, head_block, dtype, tuple(consts.items()), ws_ok)
    cands = chosen_blocks.get((spec_key, "candidates"))
    if cands is None:
        cands = chosen_blocks[(spec_key, "candidates")] = candidate_blocks(name, arch, head_block, dtype, consts, ws_ok)
    key = spec_key + (bool(deterministic), _bucket(grid_fn(cands[0])[0], sizes))
    with on_device(device):
        blk = chosen_blocks.get(key)
        if blk is not None:  # the fast path: a kept choice
            _run(kernel, blk, grid_fn, args, consts, arch, device)
            return blk
        return _choose_and_run(kernel, name, grid_fn, args, consts, device, head_block, dtype,
                               bool(deterministic), arch, cands, key)


def block_consts(consts: dict, blk: Blocks) -> dict:
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


def ensure_allocator() -> None:
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


def compile_options(blk: Blocks, arch: Optional[int]) -> dict:
    """The compile options of configuration ``blk`` (none under the interpreter)."""
    return {} if arch is None else {"num_warps": blk.warps, "num_stages": blk.stages}


def _run(kernel, blk: Blocks, grid_fn, args, consts, arch, device):
    """One launch of ``kernel`` in configuration ``blk``."""
    grid, kconsts = split_grid(grid_fn(blk), consts)
    if grid[0] > _MAX_GRID or (len(grid) > 1 and grid[1] > 65535):
        raise ValueError(f"ssa_flash: problem too large for one launch ({grid} programs)")
    options = compile_options(blk, arch)
    if blk.ws:
        ensure_allocator()
    direct.LAUNCHER.run(kernel, grid, args(blk), block_consts(kconsts, blk), options, device)


def _choose_and_run(kernel, name, grid_fn, args, consts, device, head_block, dtype, deterministic, arch, cands,
                    key):
    """:func:`launch_kernel`'s choice and launches, with ``device`` current; ``cands`` de-duplicated;
    the choice is kept under ``key``."""
    bucket = key[-1]
    may_tune = (not deterministic and arch is not None and len(cands) > 1 and autotuning()
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
        except COMPILE_ERRORS as err:  # this configuration cannot be built for this GPU
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
            chosen_blocks[key] = blk
            return blk
        ms = timed(run)
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
    chosen_blocks[key] = best
    _cache_store(disk_key, best, timings)
    elapsed = time.perf_counter() - started
    if elapsed > _SLOW_TUNING_S:
        logger.warning("ssa_flash: tuning the Triton kernel %s (head dim block %d, %s, size bucket %s) took "
                       "%.1f s over %d block configurations; the choice is kept in %s for later processes "
                       "(SSA_FLASH_AUTOTUNE=0: the first that fits, no timing)", name, head_block,
                       str(dtype).replace("torch.", ""), bucket, elapsed, len(timings), cache_dir())
    return best
