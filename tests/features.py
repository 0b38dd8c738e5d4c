"""The shared feature matrix: one table of feature combinations that every implementation of the
attention is held to, each row against the float64 specification (``ssa_flash.reference``) with
FlashAttention's error rule (``attn_testing.compare``), forward, LSE and every gradient.

Consumers (one parametrised test each, ``@pytest.mark.parametrize("row", rows_for(...), ids=str)``):

* tests/reference/test_reference_features.py: ``backend="reference"`` (its explicit backward),
* tests/triton/test_triton_features.py: ``backend="triton"`` (the interpreter on the CPU),
* tests/cuda/test_cuda_features.py: ``backend="cuda"`` (the CPU emulation of the CUDA kernels
  on the CPU, the extension on a GPU).

Each row switches on a few features at once (variant x causal x mask kind x GQA x dropout x window
x varlen x odd head dims x LSE gradient x deterministic x sinks x soft-capping) so that together the
rows take every feature, with every variant, at least once, at small shapes whose lengths are not multiples of the
kernels' tiles (ragged last blocks; several key blocks where a window or causality skips some).
The per-area files test their own feature in depth (every mask kind, every length corner, ...);
this table is what every implementation shares. The variants are the registry's
(``ssa_flash.scores.variants()``: every score function with and without the adaptive temperature),
called through ``attention(score=, score_params=)``, so a new score function is held to the table
once it has rows. Adding a feature end to end (CONTRIBUTING.md): add its switch to :class:`Row`,
give it to :func:`_kwargs`, add rows that use it with each variant, and list it in ``UNSUPPORTED``
for a backend without it (docs/support.md says which).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

import ssa_flash
from attn_testing import DEVICE, compare, detached_copy
from ssa_flash import scores

MODES = tuple(scores.VARIANTS)
MASKS = (None, "bool", "bool_empty_rows", "float", "float_heads", "key_padding")


@dataclasses.dataclass(frozen=True)
class Row:
    """One combination. ``mask``: one of ``MASKS``; ``gqa``: (Hq, Hkv); ``window``: window_size;
    ``varlen``: packed sequences of these (Lq, Lk) lengths instead of a dense batch (Lq, Lk
    then unused); ``dlse``: the loss uses the returned LSE too; ``sinks``: a learnable per-head sink
    logit; ``softcap``: the cap ``c`` (0: off)."""
    mode: str
    causal: bool = False
    mask: Optional[str] = None
    gqa: Tuple[int, int] = (2, 2)
    dropout_p: float = 0.0
    window: Tuple[int, int] = (-1, -1)
    varlen: Tuple[Tuple[int, int], ...] = ()
    D: int = 16
    Dv: Optional[int] = None
    Lq: int = 21
    Lk: int = 26
    B: int = 1
    dlse: bool = False
    deterministic: bool = False
    sinks: bool = False
    softcap: float = 0.0

    def features(self) -> set:
        """The features this row switches on (names as in ``UNSUPPORTED``)."""
        on = {self.mode}
        on |= {"causal"} if self.causal else set()
        on |= {f"mask:{self.mask}"} if self.mask else set()
        on |= {"gqa"} if self.gqa[0] != self.gqa[1] else set()
        on |= {"dropout"} if self.dropout_p else set()
        on |= {"window"} if self.window != (-1, -1) else set()
        on |= {"varlen"} if self.varlen else set()
        on |= {"odd_dims"} if self.D % 8 or (self.Dv or self.D) != self.D else set()
        on |= {"dlse"} if self.dlse else set()
        on |= {"deterministic"} if self.deterministic else set()
        on |= {"sinks"} if self.sinks else set()
        on |= {"softcap"} if self.softcap else set()
        return on

    def __str__(self):
        return "-".join(sorted(self.features(), key=lambda f: (f not in MODES, f)))


# Every variant with every feature at least once (tests/test_features' coverage test checks it).
ROWS = [
    Row("softmax"),
    Row("ssa", causal=True, gqa=(4, 2), dlse=True),
    Row("adaptive", mask="bool_empty_rows", D=27, Dv=20),
    Row("ssa_adaptive", causal=True, mask="float", gqa=(4, 1)),
    Row("softmax", mask="float_heads", causal=True, dlse=True, D=20, Dv=20, deterministic=True),
    Row("ssa", mask="bool", D=27, Dv=27, deterministic=True),
    Row("adaptive", causal=True, mask="float", gqa=(4, 2), dlse=True, deterministic=True),
    Row("ssa_adaptive", mask="key_padding", B=2, dlse=True, D=20, Dv=12),
    # dropout (the keep mask of the seed: ssa_flash.dropout_mask), every variant
    Row("softmax", dropout_p=0.3, causal=True, gqa=(4, 2)),
    Row("ssa", dropout_p=0.3, mask="bool_empty_rows", dlse=True),
    Row("adaptive", dropout_p=0.3, D=20, Dv=12),
    Row("ssa_adaptive", dropout_p=0.3, causal=True, mask="float", deterministic=True),
    # local windows: both sides bounded, one side, with causality, masks, dropout
    Row("softmax", window=(7, 3), mask="bool", Lq=30, Lk=30),
    Row("ssa", window=(10, -1), causal=True, mask="float_heads", dlse=True, Lq=30, Lk=36),
    Row("adaptive", window=(-1, 4), gqa=(4, 2), dropout_p=0.2, Lq=24, Lk=30),
    Row("ssa_adaptive", window=(6, 6), mask="float_heads", D=27, Dv=27, Lq=30, Lk=24),
    # packed variable-length batches: an empty sequence, Lq != Lk, a single row
    Row("softmax", varlen=((9, 13), (0, 5), (14, 14)), causal=True),
    Row("ssa", varlen=((12, 7), (1, 20)), gqa=(4, 2), window=(4, 2), dlse=True),
    Row("adaptive", varlen=((12, 12), (5, 9)), dropout_p=0.3),
    Row("ssa_adaptive", varlen=((11, 15), (14, 3)), causal=True, D=27, Dv=20),
    # attention sinks and soft-capping, every variant
    Row("softmax", sinks=True, softcap=1.5, mask="bool_empty_rows", dlse=True),
    Row("ssa", sinks=True, causal=True, dropout_p=0.2, gqa=(4, 2)),
    Row("ssa", softcap=2.0, window=(5, 5), mask="float_heads", Lq=30, Lk=30),
    Row("adaptive", sinks=True, softcap=2.0, varlen=((10, 12), (0, 4))),
    Row("ssa_adaptive", sinks=True, softcap=1.5, mask="bool", D=27, Dv=20, dlse=True),
    Row("softmax", sinks=True, varlen=((6, 9), (13, 13)), causal=True),
    # the per-head logit scale: every feature through the registry's path alone
    Row("logit_scale"),
    Row("logit_scale", causal=True, gqa=(4, 2), dlse=True, mask="bool_empty_rows", deterministic=True),
    Row("logit_scale", mask="float", dropout_p=0.3, D=27, Dv=20, sinks=True),
    Row("logit_scale", window=(6, 3), mask="key_padding", B=2, softcap=2.0, Lq=30, Lk=30),
    Row("logit_scale", varlen=((9, 13), (0, 5), (14, 14)), causal=True, gqa=(4, 2), dlse=True),
    Row("logit_scale_adaptive", causal=True, mask="float_heads", deterministic=True, softcap=1.5),
    Row("logit_scale_adaptive", mask="bool", gqa=(4, 1), dropout_p=0.2, dlse=True, sinks=True),
    Row("logit_scale_adaptive", window=(-1, 5), D=20, Dv=12, Lq=24, Lk=30),
    Row("logit_scale_adaptive", varlen=((12, 7), (1, 20)), window=(4, 2), sinks=True),
    Row("logit_scale_adaptive", mask="key_padding", B=2, causal=True, D=27, Dv=27),
]

# Features a backend does not have (docs/support.md), and the rows it therefore skips.
UNSUPPORTED = {"cuda": {"varlen"}}


def rows_for(backend: str):
    """The rows ``backend`` runs (those using none of its unsupported features)."""
    return [r for r in ROWS if not (r.features() & UNSUPPORTED.get(backend, set()))]


def _mask(kind, B, H, Lq, Lk, dtype, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "bool":
        m = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
    elif kind == "bool_empty_rows":
        m = torch.rand(B, H, Lq, Lk, generator=g) > 0.4
        m[:, :, ::5] = False  # rows that attend to nothing: output 0, lse -inf, zero gradients
    elif kind == "float":
        m = torch.randn(Lq, Lk, generator=g)
        m[torch.rand(Lq, Lk, generator=g) > 0.7] = float("-inf")
    elif kind == "float_heads":
        m = torch.randn(1, H, Lq, Lk, generator=g) * 2
    elif kind == "key_padding":
        lengths = torch.tensor([Lk, Lk // 2, Lk // 3])[:B]
        m = (torch.arange(Lk)[None, :] < lengths[:, None]).view(B, 1, 1, Lk)
    else:
        raise ValueError(kind)
    return m.to(device=device, dtype=m.dtype if m.dtype == torch.bool else dtype)


def _kwargs(row: Row, q_dtype, device, B, H, Lq, Lk) -> dict:
    kw = dict(is_causal=row.causal)
    mask = _mask(row.mask, B, H, Lq, Lk, q_dtype, device)
    if mask is not None:
        kw["attn_mask"] = mask
    if row.gqa[0] != row.gqa[1]:
        kw["enable_gqa"] = True
    if row.window != (-1, -1):
        kw["window_size"] = row.window
    if row.deterministic:
        kw["deterministic"] = True
    if row.softcap:
        kw["softcap"] = row.softcap
    return kw


def score_params(score: scores.ScoreFunction, H: int, device=DEVICE, seed=1) -> dict:
    """Learnable per-head parameters of ``score`` (float32 ``(H,)``, requiring grad), each drawn in
    ``[0.5, 1.5]`` times the registry's example value: ``{"b": ..., "n": ...}`` for SSA."""
    g = torch.Generator().manual_seed(seed)
    return {name: (e * (0.5 + torch.rand(H, generator=g, dtype=torch.float64))).float().to(device).requires_grad_()
            for name, e in zip(score.params, score.example)}


def _inputs(row: Row, dtype, device, seed=0):
    """(q, k, v, params, sinks, dout, dlse) of a dense row, or the packed tensors (plus cu_seqlens)
    of a varlen one; ``params`` the score function's (:func:`score_params`), ``sinks`` None or
    ``(Hq,)`` float32 requiring grad."""
    Hq, Hkv = row.gqa
    Dv = row.Dv or row.D
    g = torch.Generator().manual_seed(seed)
    if row.varlen:
        tq, tk = sum(a for a, _ in row.varlen), sum(b for _, b in row.varlen)
        shapes = [(tq, Hq, row.D), (tk, Hkv, row.D), (tk, Hkv, Dv), (tq, Hq, Dv), (Hq, tq)]
    else:
        shapes = [(row.B, Hq, row.Lq, row.D), (row.B, Hkv, row.Lk, row.D), (row.B, Hkv, row.Lk, Dv),
                  (row.B, Hq, row.Lq, Dv), (row.B, Hq, row.Lq)]
    q, k, v, dout, dlse = (torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes)
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v))
    params = score_params(scores.VARIANTS[row.mode].score, Hq, device)
    sinks = None
    if row.sinks:
        sinks = torch.randn(Hq, generator=g, dtype=torch.float64).float().to(device).requires_grad_()
    return q, k, v, params, sinks, dout.to(device), (dlse.to(device) if row.dlse else None)


def _forward_backward(fn, mode, q, k, v, params, sinks, dout, dlse, **kw):
    """(out, lse, {name: grad}) of ``fn`` (ssa_flash or its reference: ``attention`` and
    ``varlen_attention``) for variant ``mode``; gradients of q, k, v, the score parameters (by
    name) and ``sinks``."""
    variant = scores.VARIANTS[mode]
    call_kw = dict(score=variant.score.name, score_params=params, adaptive_temperature=variant.adaptive,
                   sinks=sinks, return_lse=True)
    if "cu_seqlens_q" in kw:
        out, lse = fn.varlen_attention(q, k, v, **call_kw, **kw)
    else:
        out, lse = fn.attention(q, k, v, **call_kw, **kw)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse.double()).sum()
    named = dict(q=q, k=k, v=v, **params, sinks=sinks)
    named = {nm: t for nm, t in named.items() if t is not None and t.requires_grad}
    grads = torch.autograd.grad(loss, list(named.values()))
    return out, lse, dict(zip(named, grads))


class _Spec:
    """ssa_flash.reference with the ``backend`` keyword dropped (the specification's module)."""

    def __getattr__(self, name):
        fn = getattr(ssa_flash.reference, name)
        return lambda *a, backend=None, deterministic=None, **kw: fn(*a, **kw)


def check_row(row: Row, backend: str, dtype=torch.float32, device=DEVICE):
    """``backend`` on ``row`` in ``dtype`` against the specification in the same dtype (the naive
    error) and in float64 (the gold): FlashAttention's rule on out, lse and every gradient.
    Returns ours, (out, lse, grads)."""
    q, k, v, params, sinks, dout, dlse = _inputs(row, dtype, device)
    Hq = row.gqa[0]
    if row.varlen:
        lq = [a for a, _ in row.varlen]
        lk = [c for _, c in row.varlen]
        cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32, device=device)  # noqa: E731
        kw = dict(cu_seqlens_q=cu(lq), cu_seqlens_k=cu(lk), max_seqlen_q=max(lq), max_seqlen_k=max(lk),
                  is_causal=row.causal)
        if row.gqa[0] != row.gqa[1]:
            kw["enable_gqa"] = True
        if row.window != (-1, -1):
            kw["window_size"] = row.window
        if row.softcap:
            kw["softcap"] = row.softcap
        drop_shape, Lq, Lk = (len(lq), Hq, max(lq), max(lk)), max(lq), max(lk)
    else:
        kw = _kwargs(row, dtype, device, row.B, Hq, row.Lq, row.Lk)
        drop_shape, Lq, Lk = (row.B, Hq, row.Lq, row.Lk), row.Lq, row.Lk
    ref_kw = dict(kw)
    if row.dropout_p:
        kw["dropout_p"] = ref_kw["dropout_p"] = row.dropout_p
        torch.manual_seed(1234)
        ref_kw["dropout_mask"] = ssa_flash.dropout_mask(drop_shape, row.dropout_p, device=device)
        torch.manual_seed(1234)  # ours draws the same (seed, offset)
    ours = _forward_backward(_Backend(backend), row.mode, q, k, v, params, sinks, dout, dlse, **kw)
    naive = _forward_backward(_Spec(), row.mode, q, k, v, params, sinks, dout, dlse, **ref_kw)
    d64 = lambda t: detached_copy(t, torch.float64)  # noqa: E731
    gold_kw = {key: (val.double() if torch.is_tensor(val) and val.is_floating_point() else val)
               for key, val in ref_kw.items()}
    gold = _forward_backward(_Spec(), row.mode, d64(q), d64(k), d64(v), {nm: d64(t) for nm, t in params.items()},
                             d64(sinks), dout, dlse, **gold_kw)
    assert ours[0].dtype == dtype and ours[0].shape == gold[0].shape
    assert ours[1].shape == gold[1].shape
    compare(ours, naive, gold, dtype, Lq, Lk)
    return ours


class _Backend:
    """ssa_flash's public functions with ``backend=name``."""

    def __init__(self, name):
        self.name = name

    def __getattr__(self, attr):
        fn = getattr(ssa_flash, attr)
        return lambda *a, **kw: fn(*a, backend=self.name, **kw)
