"""The kernel specialisations the Triton launcher can choose, and the launches that compile them.

A :class:`Variant` names one: kernel x operation (softmax / SSA x fixed / adaptive temperature) x
causal x mask kind x head dim x dtype x target. :func:`capture` calls the launcher's host
functions (``ssa_flash.triton.launch``) with ``meta`` tensors inside ``capture_launches``, so that
the audit compiles exactly what a real call of that shape would launch on that GPU.

Shapes: batch 2, 16 query heads, ``seqlen`` queries and keys (default 4096), ``Lq == Lk``; masks
are one ``(L, L)`` matrix broadcast over batch and heads (the common case); additive masks have
the input dtype.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Iterable, List, Optional, Sequence

import torch

KERNELS = ("fwd", "stats", "bwd_dq", "bwd_dkdv")
OPS = ("softmax", "ssa", "adaptive", "ssa_adaptive")
MASKS = ("none", "bool", "additive")
HEAD_DIMS = (32, 64, 111, 128, 256)  # 111: an odd dim, zero-padded to the 128 tile
DTYPES = ("bf16", "fp16")
ARCHS = (80, 90)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation on one target."""

    kernel: str  # one of KERNELS
    op: str  # one of OPS
    causal: bool
    mask: str  # one of MASKS
    head_dim: int
    dtype: str  # "bf16", "fp16" (or "fp32")
    arch: int  # compute capability, e.g. 90
    seqlen: int = 4096
    group: int = 1  # query heads per key/value head (GQA)

    @property
    def ssa(self) -> bool:
        return self.op in ("ssa", "ssa_adaptive")

    @property
    def adaptive(self) -> bool:
        return self.op in ("adaptive", "ssa_adaptive")

    @property
    def id(self) -> str:
        """A stable name, e.g. ``sm90-fwd-ssa-causal-none-d128-bf16``."""
        parts = [f"sm{self.arch}", self.kernel, self.op, "causal" if self.causal else "full", self.mask,
                 f"d{self.head_dim}", self.dtype]
        if self.group != 1:
            parts.append(f"g{self.group}")
        if self.seqlen != 4096:
            parts.append(f"L{self.seqlen}")
        return "-".join(parts)

    def softmax_twin(self) -> "Variant":
        """The same specialisation without SSA (the baseline of the SSA/softmax ratios)."""
        op = {"ssa": "softmax", "ssa_adaptive": "adaptive"}.get(self.op, self.op)
        return Variant(**dict(asdict(self), op=op))

    def to_dict(self) -> dict:
        return asdict(self)


def runs(kernel: str, op: str) -> bool:
    """Whether ``op`` launches ``kernel`` (the statistics pass runs only for the adaptive
    temperature)."""
    return kernel != "stats" or op in ("adaptive", "ssa_adaptive")


def variants(archs: Sequence[int] = ARCHS, kernels: Sequence[str] = KERNELS, ops: Sequence[str] = OPS,
             causal: Sequence[bool] = (False, True), masks: Sequence[str] = MASKS,
             head_dims: Sequence[int] = HEAD_DIMS, dtypes: Sequence[str] = DTYPES,
             groups: Sequence[int] = (1,), seqlen: int = 4096) -> List[Variant]:
    """Every combination of the given axes that the launcher can launch."""
    out = []
    for arch, dtype, d, kernel, op, c, mask, g in itertools.product(
            archs, dtypes, head_dims, kernels, ops, causal, masks, groups):
        if runs(kernel, op):
            out.append(Variant(kernel, op, bool(c), mask, int(d), dtype, int(arch), seqlen, int(g)))
    return out


def _call_host(v: Variant):
    """Call the launcher's host function(s) that launch ``v.kernel`` with meta tensors."""
    from ssa_flash.triton import launch

    B, H, L, D = 2, 16, v.seqlen, v.head_dim
    hkv = H // v.group
    dt = _DTYPES[v.dtype]
    acc = torch.float64 if dt == torch.float64 else torch.float32

    def meta(*shape, dtype=dt):
        return torch.empty(*shape, device="meta", dtype=dtype)

    q, k, val = meta(B, H, L, D), meta(B, hkv, L, D), meta(B, hkv, L, D)
    mask = None
    if v.mask == "bool":
        mask = meta(1, 1, L, L, dtype=torch.bool).expand(B, H, L, L)
    elif v.mask == "additive":
        mask = meta(1, 1, L, L).expand(B, H, L, L)
    b = meta(H, dtype=acc) if v.ssa else None
    n = meta(H, dtype=acc) if v.ssa else None
    spec = launch.AttentionSpec(scale=D ** -0.5, causal=v.causal, group=v.group, ssa=v.ssa, adaptive=v.adaptive)
    if v.kernel == "stats":
        launch.row_entropy(q, k, mask, b, n, spec)
    elif v.kernel == "fwd":
        beta = meta(B, H, L, dtype=acc) if v.adaptive else None
        launch.forward(q, k, val, mask, b, n, beta, spec)
    else:
        o, lse = meta(B, H, L, D), meta(B, H, L, dtype=acc)
        temp = launch.TemperatureState(*(meta(B, H, L, dtype=acc) for _ in range(4))) if v.adaptive else None
        launch.backward(o, q, k, val, o, lse, None, mask, b, n, temp, spec)


def capture(v: Variant, candidate: int = 0):
    """The :class:`~ssa_flash.triton.launch.KernelLaunch` of ``v`` with the launcher's block
    configuration number ``candidate`` (0: its first choice; the launcher falls back to later
    ones when a configuration does not fit the GPU)."""
    from ssa_flash.triton import launch

    original = launch.block_candidates
    if candidate:
        def shifted(*args, **kwargs):
            cands = original(*args, **kwargs)
            if candidate >= len(cands):
                raise IndexError(f"{v.id}: the launcher has only {len(cands)} block configurations")
            return cands[candidate:]
        launch.block_candidates = shifted
    try:
        with launch.capture_launches(v.arch) as cap:
            _call_host(v)
    finally:
        launch.block_candidates = original
    found = [kl for kl in cap if kl.name == v.kernel]
    if len(found) != 1:
        raise RuntimeError(f"{v.id}: expected one {v.kernel} launch, captured {[kl.name for kl in cap]}")
    return found[0]


def describe_launch(kl) -> dict:
    """A JSON-able description of a launch: what decides its compiled code (for cache keys)."""
    def arg(a):
        if isinstance(a, torch.Tensor):
            return ["tensor", str(a.dtype), list(a.shape), list(a.stride())]
        return repr(a)
    return {"name": kl.name, "constexprs": {k: repr(v) for k, v in sorted(kl.constexprs.items())},
            "blocks": [kl.blocks.m, kl.blocks.n, kl.blocks.warps, kl.blocks.stages],
            "args": [arg(a) for a in kl.args]}


def parse_list(text: Optional[str], allowed: Iterable, kind=str) -> Optional[list]:
    """``"a,b"`` -> ``[a, b]`` checked against ``allowed`` (None: everything)."""
    if text is None:
        return None
    allowed = list(allowed)
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        value = kind(item)
        if allowed and value not in allowed:
            raise ValueError(f"unknown value {item!r}; choose from {allowed}")
        out.append(value)
    return out
