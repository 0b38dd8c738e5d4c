"""The kernel specialisations the Triton launcher can choose, and the launches that compile them.

A :class:`Variant` names one: kernel x operation (a score function of ``ssa_flash.scores`` x fixed /
adaptive temperature: ``scores.variants()``, named as :attr:`ssa_flash.scores.Variant.name`) x
causal x mask kind x head dim x dtype x target (x a feature switch: dropout, a local window, a
packed variable-length batch or a decoding step on a KV cache). :func:`capture` calls the launcher's host
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

from .. import scores

KERNELS = ("fwd", "row_entropy", "bwd_dq", "bwd_dkdv")
OPS = tuple(sv.name for sv in scores.variants())
MASKS = ("none", "bool", "additive")
#: Feature switches that change what the launcher compiles (and its tile choice): none; dropout
#: (p = 0.1); a sliding window of 256 keys (causal) or 256 either side; a packed variable-length
#: batch (no mask); one decoding step (Lq = 1) on a KV cache (forward and statistics only, no
#: mask); attention sinks (a ``(Hq,)`` sink logit per head); logit soft-capping (``softcap=30``).
#: Several join with "+", e.g. "dropout+window", "sinks+softcap".
FEATURES = ("none", "dropout", "window", "varlen", "decode", "sinks", "softcap")
HEAD_DIMS = (32, 64, 111, 128, 256)  # 111: an odd dim, zero-padded to the 128 tile
DTYPES = ("bf16", "fp16")  # also "fp32" (IEEE dots, torch's default) and "tf32" (float32, TF32 dots)
ARCHS = (80, 90)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation on one target."""

    kernel: str  # one of KERNELS
    op: str  # one of OPS
    causal: bool
    mask: str  # one of MASKS
    head_dim: int
    dtype: str  # "bf16", "fp16" (or "fp32", "tf32": float32 inputs under torch's "highest" / "high")
    arch: int  # compute capability, e.g. 90
    seqlen: int = 4096
    group: int = 1  # query heads per key/value head (GQA)
    feature: str = "none"  # one of FEATURES, or several joined with "+"

    @property
    def features(self) -> frozenset:
        return frozenset(self.feature.split("+")) - {"none"}

    @property
    def score(self) -> scores.ScoreFunction:
        """The score function of :attr:`op`."""
        return scores.VARIANTS[self.op].score

    @property
    def ssa(self) -> bool:
        return self.score is scores.SSA

    @property
    def adaptive(self) -> bool:
        return scores.VARIANTS[self.op].adaptive

    @property
    def id(self) -> str:
        """A stable name, e.g. ``sm90-fwd-ssa-causal-none-d128-bf16``."""
        parts = [f"sm{self.arch}", self.kernel, self.op, "causal" if self.causal else "full", self.mask,
                 f"d{self.head_dim}", self.dtype]
        if self.group != 1:
            parts.append(f"g{self.group}")
        if self.seqlen != 4096:
            parts.append(f"L{self.seqlen}")
        if self.feature != "none":
            parts.append(self.feature)
        return "-".join(parts)

    def softmax_twin(self) -> "Variant":
        """The same specialisation with softmax's score function (the baseline of the
        score function / softmax ratios)."""
        op = scores.Variant(scores.SOFTMAX, self.adaptive).name
        return Variant(**dict(asdict(self), op=op))

    def to_dict(self) -> dict:
        return asdict(self)


def runs(kernel: str, op: str, feature: str = "none", mask: str = "none") -> bool:
    """Whether ``op`` launches ``kernel`` (the statistics pass runs only for the adaptive
    temperature) with ``feature`` and ``mask`` (decoding runs the forward kernels only; packed
    batches and decoding take no mask; dropout acts after the statistics, whose launch it does
    not change)."""
    fs = set(feature.split("+")) - {"none"}
    unknown = fs - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown feature {sorted(unknown)}; choose from {FEATURES}")
    if kernel == "row_entropy" and not scores.VARIANTS[op].adaptive:
        return False
    if fs & {"varlen", "decode"} and mask != "none":
        return False
    if {"varlen", "decode"} <= fs:
        return False
    if "decode" in fs and (kernel not in ("fwd", "row_entropy") or "dropout" in fs):
        return False
    return not ("dropout" in fs and kernel == "row_entropy")


def variants(archs: Sequence[int] = ARCHS, kernels: Sequence[str] = KERNELS, ops: Sequence[str] = OPS,
             causal: Sequence[bool] = (False, True), masks: Sequence[str] = MASKS,
             head_dims: Sequence[int] = HEAD_DIMS, dtypes: Sequence[str] = DTYPES,
             groups: Sequence[int] = (1,), seqlen: int = 4096,
             features: Sequence[str] = ("none",)) -> List[Variant]:
    """Every combination of the given axes that the launcher can launch."""
    out = []
    for arch, dtype, d, kernel, op, c, mask, g, f in itertools.product(
            archs, dtypes, head_dims, kernels, ops, causal, masks, groups, features):
        if runs(kernel, op, f, mask):
            out.append(Variant(kernel, op, bool(c), mask, int(d), dtype, int(arch), seqlen, int(g), f))
    return out


def _call_host(v: Variant):
    """Call the launcher's host function(s) that launch ``v.kernel`` with meta tensors."""
    from ssa_flash.triton import block_choice, launch

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
    params = tuple(meta(H, dtype=acc) for _ in v.score.params)
    fs = v.features
    feat = {}
    if "dropout" in fs:
        feat.update(dropout_p=0.1, dropout_rng=meta(2, dtype=torch.int64))
    if "window" in fs:
        feat.update(window_left=256, window_right=0 if v.causal else 256)
    if "softcap" in fs:
        feat.update(softcap=30.0)
    sinks = meta(H, dtype=acc) if "sinks" in fs else None
    spec = launch.AttentionSpec(scale=D ** -0.5, causal=v.causal, group=v.group, adaptive=v.adaptive,
                                score=v.score.name, **feat)
    layout = None
    Lq = L
    if "varlen" in fs:  # B sequences of at most L rows, packed: (B * L, H, D)
        q, k, val = (t.transpose(1, 2).reshape(B * L, t.shape[1], D) for t in (q, k, val))
        cu = meta(B + 1, dtype=torch.int32)
        layout = launch.Packed(cu, cu, L, L)
    elif "decode" in fs:  # one new query per sequence on a cache of L rows
        Lq = 1
        q = meta(B, H, Lq, D)
        layout = launch.KVCache(meta(B, dtype=torch.int32))
    rows = (H, B * L) if "varlen" in fs else (B, H, Lq)
    if v.kernel == "row_entropy":
        launch.row_entropy(q, k, mask, params, spec, layout, sinks=sinks)
    elif v.kernel == "fwd":
        beta = meta(*rows, dtype=acc) if v.adaptive else None
        launch.forward(q, k, val, mask, params, beta, spec, layout, sinks=sinks)
    else:
        o, lse = meta(*q.shape), meta(*rows, dtype=acc)
        temp = launch.TemperatureState(*(meta(*rows, dtype=acc) for _ in range(4))) if v.adaptive else None
        launch.backward(o, q, k, val, o, lse, None, mask, params, temp, spec, layout, sinks=sinks)


def capture(v: Variant, candidate: int = 0):
    """The :class:`~ssa_flash.triton.launch.KernelLaunch` of ``v`` with the launcher's block
    configuration number ``candidate`` (0: its first choice) among those it would try on this
    target (the table's candidates less those pruned for shared memory: the launcher falls back
    to later ones when a configuration does not fit the GPU)."""
    from ssa_flash.triton import block_choice, launch

    if v.dtype == "tf32":  # float32 under torch's "high" matmul precision: TF32 dots
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            return capture(Variant(**dict(asdict(v), dtype="fp32")), candidate)
        finally:
            torch.set_float32_matmul_precision(before)
    original = block_choice.candidate_blocks
    if candidate:
        # the launcher's final list (the tables pruned, the warp-specialised forward added) shifted
        def pick(name, *args, **kwargs):
            cands = original(name, *args, **kwargs)
            if name not in (v.kernel, v.kernel + "_decode"):  # the backward's other kernel
                return cands
            if candidate >= len(cands):
                raise IndexError(f"{v.id}: the launcher has only {len(cands)} block configurations")
            return cands[candidate:]
        block_choice.candidate_blocks = pick
    try:
        with launch.capture_launches(v.arch) as cap:
            _call_host(v)
    finally:
        block_choice.candidate_blocks = original
    found = [kl for kl in cap if kl.name in (v.kernel, v.kernel + "_decode")]
    if len(found) != 1:
        raise RuntimeError(f"{v.id}: expected one {v.kernel} launch, captured {[kl.name for kl in cap]}")
    return found[0]


def describe_launch(kl) -> dict:
    """A JSON-able description of a launch: what decides its compiled code (for cache keys)."""
    def arg(a):
        if isinstance(a, torch.Tensor):
            return ["tensor", str(a.dtype), list(a.shape), list(a.stride())]
        if isinstance(a, tuple):  # grouped arguments (strides, the split scale, dropout, window)
            return ["tuple", [arg(x) for x in a]]
        return repr(a)
    return {"name": kl.name, "constexprs": {k: repr(v) for k, v in sorted(kl.constexprs.items())},
            "blocks": [kl.blocks.m, kl.blocks.n, kl.blocks.warps, kl.blocks.stages] + ([True] if kl.blocks.ws else []),
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
