"""Which of the CUDA backend's forward kernels runs a call: today's kernel (csrc/fwd_kernel.h) or
the sm_90a warp-specialised one (csrc/hopper/), where the latter takes the call at all
(csrc/hopper/fwd_launch.h, ``fwd_ws_declines``: no mask, dropout, window, sinks or soft-capping;
padded head dim 64 or 128; an sm_90 device; a build that holds it).

The warp-specialised forward runs only where committed measurements say it is the fastest: the
table ``cuda_fwd_choice.json`` beside this file, read once at import, lists the shapes (architecture,
dtype, padded head dim, causal or not, a range of sequence lengths, score functions) on which a
GPU session measured it ahead of today's kernel (and of ``ssa_flash.triton``): each row with the
results file that says so. Empty today (no GPU run of the kernel yet), so every call runs today's
kernel. A GPU session adds rows from ``python -m ssa_flash.bench`` results that include
``ssa_flash.cuda_ws`` beside ``ssa_flash.cuda``, only where the new kernel won.

Overrides, in order: :func:`forced` (the benchmark's ``ssa_flash.cuda_ws`` / ``ssa_flash.cuda``
impls, the device tests), then the environment variable ``SSA_FLASH_HOPPER_FWD`` (``1``: wherever
the kernel takes the call; ``0``: never; read by the extension itself, once, so this module leaves
the switch alone when it is set), then the table. The choice reaches the extension as its
process-wide switch, set before each forward it concerns (``cuda_backend._choose_fwd_kernel``):
threads calling at once with different choices may see each other's (either kernel computes
the same attention; only which one ran differs).
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


class Row(NamedTuple):
    """One measured win of the warp-specialised forward: on ``arch`` (e.g. ``"sm_90a"``), ``dtype``
    (``"bfloat16"`` / ``"float16"``), padded ``head_dim`` (64 / 128), ``causal``, query and key
    lengths both in ``[len_min, len_max]``, the score functions ``scores`` (names, e.g. ``"ssa"``)
    with or without the adaptive temperature as ``adaptive`` says (None: both). ``evidence``: the
    results file and row that measured it."""
    arch: str
    dtype: str
    head_dim: int
    causal: bool
    len_min: int
    len_max: int
    scores: Tuple[str, ...]
    adaptive: Optional[bool]
    evidence: str


def parse_table(data: dict) -> Tuple[Row, ...]:
    """The rows of a table file's JSON (``{"rows": [...]}``); raises ValueError on a malformed row."""
    rows = []
    for i, r in enumerate(data.get("rows", ())):
        try:
            row = Row(arch=str(r["arch"]), dtype=str(r["dtype"]), head_dim=int(r["head_dim"]),
                      causal=bool(r["causal"]), len_min=int(r["len_min"]), len_max=int(r["len_max"]),
                      scores=tuple(str(s) for s in r["scores"]),
                      adaptive=None if r.get("adaptive") is None else bool(r["adaptive"]),
                      evidence=str(r["evidence"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"cuda_fwd_choice table: row {i} is malformed ({err!r}): {r}") from None
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
                     len_k: int, score: str, adaptive: bool) -> bool:
    """Whether ``table`` has a row saying the warp-specialised forward is fastest for this call."""
    arch = arch_name(capability)
    for r in table:
        if (r.arch == arch and r.dtype == dtype and r.head_dim == head_dim and r.causal == causal
                and r.len_min <= len_q <= r.len_max and r.len_min <= len_k <= r.len_max and score in r.scores
                and (r.adaptive is None or r.adaptive == adaptive)):
            return True
    return False


_local = threading.local()


@contextlib.contextmanager
def forced(on: bool) -> Iterator[None]:
    """Within the block (this thread), the CUDA backend's forward runs the warp-specialised kernel
    wherever it takes the call (``on``) or never (not ``on``), whatever the table says."""
    before = getattr(_local, "forced", None)
    _local.forced = bool(on)
    try:
        yield
    finally:
        _local.forced = before


def env_setting() -> Optional[bool]:
    """``SSA_FLASH_HOPPER_FWD`` as the extension reads it: True for ``1``, False for any other value,
    None when unset."""
    value = os.environ.get(ENV)
    return None if value is None else value.strip() == "1"


def may_apply() -> bool:
    """False when :func:`wanted` is None for every call (nothing forced, and the table empty or the
    environment variable set): the caller then skips the per-call look-up."""
    return getattr(_local, "forced", None) is not None or (bool(TABLE) and env_setting() is None)


def wanted(capability: Tuple[int, int], dtype: str, head_dim: int, causal: bool, len_q: int, len_k: int,
           score: str, adaptive: bool, table=None) -> Optional[bool]:
    """What the extension's switch should be for this call: True / False, or None to leave it
    (the environment variable decides, or no table row concerns this architecture)."""
    f = getattr(_local, "forced", None)
    if f is not None:
        return f
    if env_setting() is not None:
        return None
    table = TABLE if table is None else table
    arch = arch_name(capability)
    if not any(r.arch == arch for r in table):
        return None
    return table_prefers_ws(table, capability, dtype, head_dim, causal, len_q, len_k, score, adaptive)
