"""Which of the CUDA backend's kernels runs a call: today's forward (csrc/fwd_kernel.h) or the
sm_90a warp-specialised one (csrc/hopper/), where the latter takes the call at all
(csrc/hopper/fwd_launch.h, ``fwd_ws_declines``: no mask, dropout, window, sinks or soft-capping;
padded head dim 64 or 128; an sm_90 device; a build that holds it); and likewise today's backward
(csrc/bwd_kernel.h) or the sm_90a one (csrc/hopper/bwd_launch.h, ``hopper_bwd_declines``: softmax
or SSA, D = Dv = 64 or 128, none of those features, not ``deterministic``).

The sm_90a kernels run only where committed measurements say they are the fastest: the table
``cuda_fwd_choice.json`` beside this file, read once at import, lists the shapes (architecture,
dtype, padded head dim, causal or not, a range of sequence lengths, score functions) on which a
GPU session measured them ahead of today's kernels (and of ``ssa_flash.triton``): each row with the
results file that says so, and its ``pass``: ``"fwd"`` (the default: forward rows, for the
forward's kernel) or ``"fwd_bwd"`` (forward + backward rows, for the backward's kernel). Empty
today (no GPU run of the kernels yet), so every call runs today's kernels. A GPU session adds rows
from ``python -m ssa_flash.bench`` results that include ``ssa_flash.cuda_ws`` beside
``ssa_flash.cuda``, only where the new kernels won.

Overrides, in order: :func:`forced` (the benchmark's ``ssa_flash.cuda_ws`` / ``ssa_flash.cuda``
impls, the device tests; forward and backward together unless told apart), then the environment
variables ``SSA_FLASH_HOPPER_FWD`` / ``SSA_FLASH_HOPPER_BWD`` (``1``: wherever the kernel takes the
call; ``0``: never; read by the extension itself, once, so this module leaves that switch alone
when it is set), then the table. The choice reaches the extension as its process-wide switches,
set before each forward / backward it concerns (``cuda_backend._choose_kernel``): threads calling
at once with different choices may see each other's (either kernel computes the same attention;
only which one ran differs).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Tuple

TABLE_PATH = Path(__file__).resolve().with_name("cuda_fwd_choice.json")
ENV = "SSA_FLASH_HOPPER_FWD"
ENV_BWD = "SSA_FLASH_HOPPER_BWD"
# the kernel a choice concerns -> (the environment variable the extension reads, the table rows' pass)
KERNELS = {"fwd": (ENV, "fwd"), "bwd": (ENV_BWD, "fwd_bwd")}
TABLE_PASSES = ("fwd", "fwd_bwd")


class Row(NamedTuple):
    """One measured win of the warp-specialised forward: on ``arch`` (e.g. ``"sm_90a"``), ``dtype``
    (``"bfloat16"`` / ``"float16"``), padded ``head_dim`` (64 / 128), ``causal``, query and key
    lengths both in ``[len_min, len_max]``, the score functions ``scores`` (names, e.g. ``"ssa"``)
    with or without the adaptive temperature as ``adaptive`` says (None: both). ``evidence``: the
    results file and row that measured it. ``pass_`` (``"pass"`` in the file): ``"fwd"`` (the
    forward's kernel) or ``"fwd_bwd"`` (the backward's)."""
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    len_min: int
    len_max: int
    scores: Tuple[str, ...]
    adaptive: Optional[bool]
    evidence: str
    pass_: str = "fwd"


def parse_table(data: dict) -> Tuple[Row, ...]:
    """The rows of a table file's JSON (``{"rows": [...]}``); raises ValueError on a malformed row."""
    rows = []
    for i, r in enumerate(data.get("rows", ())):
        try:
            row = Row(arch=str(r["arch"]), dtype=str(r["dtype"]), head_dim=int(r["head_dim"]),
                      causal=bool(r["causal"]), len_min=int(r["len_min"]), len_max=int(r["len_max"]),
                      scores=tuple(str(s) for s in r["scores"]),
                      adaptive=None if r.get("adaptive") is None else bool(r["adaptive"]),
                      evidence=str(r["evidence"]), pass_=str(r.get("pass", "fwd")))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"cuda_fwd_choice table: row {i} is malformed ({err!r}): {r}") from None
        if row.pass_ not in TABLE_PASSES:
            raise ValueError(f"cuda_fwd_choice table: row {i}'s pass is {row.pass_!r}, not one of {TABLE_PASSES}")
        if not row.evidence:
            raise ValueError(f"cuda_fwd_choice table: row {i} names no evidence (a results file)")
        rows.append(row)
    return tuple(rows)


def load_table(path: Path = TABLE_PATH) -> Tuple[Row, ...]:
    """The committed table (none if the file is missing)."""
    try:
        return parse_table(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        return ()


TABLE: Tuple[Row, ...] = load_table()


def arch_name(capability: Tuple[int, int]) -> str:
    major, minor = capability
    return f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


def table_prefers_ws(table, capability: Tuple[int, int], dtype: str, head_dim: int, causal: bool, len_q: int,
                     len_k: int, score: str, adaptive: bool, kernel: str = "fwd") -> bool:
    """Whether ``table`` has a row saying the sm_90a ``kernel`` (``"fwd"`` / ``"bwd"``) is fastest
    for this call."""
    arch, pass_ = arch_name(capability), KERNELS[kernel][1]
    for r in table:
        if (r.pass_ == pass_ and r.arch == arch and r.dtype == dtype and r.head_dim == head_dim and r.causal == causal
                and r.len_min <= len_q <= r.len_max and r.len_min <= len_k <= r.len_max and score in r.scores
                and (r.adaptive is None or r.adaptive == adaptive)):
            return True
    return False


_local = threading.local()
# the innermost forced() block of any thread: what a thread without its own sees. (A CUDA tensor's
# backward runs on autograd's device thread, not in the thread that entered the block.)
_process = {"forced": None}


@contextlib.contextmanager
def forced(on: bool, backward: Optional[bool] = None) -> Iterator[None]:
    """Within the block, the CUDA backend runs the sm_90a forward wherever it takes the call
    (``on``) or never (not ``on``), whatever the table says; the sm_90a backward likewise as
    ``backward`` says (None: as ``on``). For this thread, and for threads without a block of their
    own (autograd's, which runs the backward of CUDA tensors); blocks in several threads at once
    see the latest one there."""
    before, before_process = getattr(_local, "forced", None), _process["forced"]
    choice = {"fwd": bool(on), "bwd": bool(on) if backward is None else bool(backward)}
    _local.forced = _process["forced"] = choice
    try:
        yield
    finally:
        _local.forced = before
        _process["forced"] = before_process


def _forced(kernel: str) -> Optional[bool]:
    f = getattr(_local, "forced", None)
    f = _process["forced"] if f is None else f
    return None if f is None else f[kernel]


def env_setting(kernel: str = "fwd") -> Optional[bool]:
    """``SSA_FLASH_HOPPER_FWD`` (``kernel`` "fwd") or ``SSA_FLASH_HOPPER_BWD`` ("bwd") as the extension
    reads it: True for ``1``, False for any other value, None when unset."""
    value = os.environ.get(KERNELS[kernel][0])
    return None if value is None else value.strip() == "1"


def may_apply(kernel: str = "fwd") -> bool:
    """False when :func:`wanted` is None for every call (nothing forced, and the table has no row
    of this kernel or its environment variable is set): the caller then skips the per-call look-up."""
    pass_ = KERNELS[kernel][1]
    return _forced(kernel) is not None or (any(r.pass_ == pass_ for r in TABLE) and env_setting(kernel) is None)


def wanted(capability: Tuple[int, int], dtype: str, head_dim: int, causal: bool, len_q: int, len_k: int,
           score: str, adaptive: bool, table=None, kernel: str = "fwd") -> Optional[bool]:
    """What the extension's switch of ``kernel`` (``"fwd"`` / ``"bwd"``) should be for this call:
    True / False, or None to leave it (the environment variable decides, or no table row of this
    kernel concerns this architecture)."""
    f = _forced(kernel)
    if f is not None:
        return f
    if env_setting(kernel) is not None:
        return None
    table = TABLE if table is None else table
    arch, pass_ = arch_name(capability), KERNELS[kernel][1]
    if not any(r.arch == arch and r.pass_ == pass_ for r in table):
        return None
    return table_prefers_ws(table, capability, dtype, head_dim, causal, len_q, len_k, score, adaptive, kernel)
