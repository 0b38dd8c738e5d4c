"""``torch.nn`` modules.

:class:`SSAttention` holds the per-head SSA parameters ``b`` and ``n`` of one attention layer and
calls :func:`ssa_flash.ssa_attention` with them. The paper's constraints (``b > 0``, ``n >= 1``)
hold by construction through a smooth parametrisation of unconstrained tensors::

    b = B_MIN + softplus(b_raw)    in (B_MIN, inf),  B_MIN = 1e-6
    n = 1 + softplus(n_raw)        in [1, inf)

so an optimiser can update ``b_raw`` and ``n_raw`` freely. (``B_MIN`` keeps ``b > 0`` when
``softplus`` underflows to 0 in float32, for ``b_raw`` below about -104; ``n`` reaches 1 only in
that underflow.) ``.b`` and ``.n`` are the constrained
values (differentiable functions of the raw tensors).

With ``sinks=True`` it also holds one learnable attention-sink logit per head, ``sinks``
(unconstrained: a logit; docs/design.md §1.6), and ``softcap`` caps the scores
(``c tanh(z / c)``). State dict: ``b_raw``, ``n_raw`` and, with sinks, ``sinks``, each
``(num_heads,)``.
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import BACKENDS, _check_bool, _check_softcap, ssa_attention

__all__ = ["SSAttention", "B_MIN"]

B_MIN = 1e-6  # b = B_MIN + softplus(b_raw) > 0 even where softplus underflows

InitValue = Union[float, Sequence[float], Tensor]


def _inverse_softplus(y: Tensor) -> Tensor:
    """``x`` with ``softplus(x) = y`` for ``y > 0``: ``log(expm1(y))``, written stably for large ``y``."""
    return y + torch.log(-torch.expm1(-y))


def _init_values(name: str, value: InitValue, heads: int, low: Optional[float]) -> Tensor:
    """An initial value (a number, or one per head) as a float64 CPU tensor of shape ``(heads,)``
    (explicitly on the CPU: models may be built under a ``torch.device("meta")`` context), finite
    and above ``low`` (None: any finite value)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number or one number per head, got bool")
    if isinstance(value, numbers.Real):
        t = torch.full((heads,), float(value), dtype=torch.float64, device="cpu")
    elif isinstance(value, Tensor) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes))):
        if isinstance(value, Tensor):
            t = value.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        else:
            t = torch.tensor([float(x) for x in value], dtype=torch.float64, device="cpu")
        if t.numel() != heads:
            raise ValueError(f"{name} must be a number or have one value per head ({heads}), got {t.numel()} values")
    else:
        raise TypeError(f"{name} must be a number or one number per head, got {type(value).__name__}")
    if low is None:
        if not torch.isfinite(t).all():
            raise ValueError(f"{name} must be finite for every head, got {t.tolist()}")
    elif not torch.isfinite(t).all() or (t <= low).any():
        raise ValueError(f"{name} must be finite and > {low:g} for every head, got {t.tolist()}")
    return t


class SSAttention(nn.Module):
    """Scaled Signed Averaging attention with learnable per-head ``b > 0`` and ``n >= 1``.

    A drop-in for a ``torch.nn.functional.scaled_dot_product_attention`` call inside a model::

        self.attn = ssa_flash.nn.SSAttention(num_heads)
        ...
        out = self.attn(q, k, v, is_causal=True)      # instead of F.scaled_dot_product_attention

    Args:
        num_heads: the number of query heads ``Hq``; one ``b`` and one ``n`` per head.
        b_init: initial ``b`` (paper: 1.0), a number or one value per head; must be > ``B_MIN`` (1e-6).
        n_init: initial ``n`` (paper: 1.5), a number or one value per head; must be > 1 (the
            parametrisation ``n = 1 + softplus(n_raw)`` reaches 1 only in the limit).
        learnable: if False, ``b_raw`` and ``n_raw`` are buffers (saved in the state dict, not
            trained) instead of parameters.
        adaptive_temperature: apply the entropy-driven temperature of "Softmax is not Enough" on
            top of SSA (see :func:`ssa_flash.ssa_attention`).
        backend: passed to :func:`ssa_flash.ssa_attention`: "auto", "triton", "cuda" or
            "reference" (another name raises ``ValueError`` here; whether the backend can run the
            inputs is decided at each call).
        sinks: hold a per-head attention-sink logit ``sinks`` (docs/design.md §1.6): every row of
            head ``h`` gets one more logit ``sinks[h]`` with a zero value vector (GPT-OSS's
            sinks). A parameter (a buffer if ``learnable`` is False).
        sinks_init: initial sink logits (a finite number or one per head; default 0).
        softcap: logit soft-capping ``c >= 0`` (0: off): scores ``z -> c tanh(z / c)`` before the
            SSA transform (Gemma 2's ``attn_logit_softcapping``).
        device, dtype: of the raw tensors (default float32: ``b``, ``n`` and ``sinks`` are cast
            to the kernels' accumulation dtype anyway).

    Which backends implement ``sinks`` and ``softcap``: docs/support.md (``backend="auto"`` takes
    the first that does).

    Attributes:
        b_raw, n_raw: the unconstrained ``(num_heads,)`` tensors (parameters or buffers).
        b, n: the constrained ``(num_heads,)`` values, ``B_MIN + softplus(b_raw)`` and ``1 + softplus(n_raw)``.
        sinks: with ``sinks=True``, the ``(num_heads,)`` sink logits (parameter or buffer; in the
            state dict as ``sinks``); else None.
        softcap: the soft-capping constant (0: off).
    """

    def __init__(self, num_heads: int, b_init: InitValue = 1.0, n_init: InitValue = 1.5,
                 learnable: bool = True, *, adaptive_temperature: bool = False,
                 backend: str = "auto", sinks: bool = False, sinks_init: InitValue = 0.0,
                 softcap: float = 0.0, device=None, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        learnable = _check_bool("learnable", learnable)
        adaptive_temperature = _check_bool("adaptive_temperature", adaptive_temperature)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        # checked here, not at the first forward: a typo must not survive model construction
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        dtype = torch.float32 if dtype is None else dtype
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        self.num_heads = num_heads
        self.learnable = learnable
        self.adaptive_temperature = adaptive_temperature
        self.backend = backend
        b0 = _init_values("b_init", b_init, num_heads, B_MIN)
        n0 = _init_values("n_init", n_init, num_heads, 1.0)
        b_raw = _inverse_softplus(b0 - B_MIN).to(device=device, dtype=dtype)
        n_raw = _inverse_softplus(n0 - 1.0).to(device=device, dtype=dtype)
        if learnable:
            self.b_raw = nn.Parameter(b_raw)
            self.n_raw = nn.Parameter(n_raw)
        else:
            self.register_buffer("b_raw", b_raw)
            self.register_buffer("n_raw", n_raw)
        self.softcap = _check_softcap(softcap)
        if _check_bool("sinks", sinks):
            s0 = _init_values("sinks_init", sinks_init, num_heads, None).to(device=device, dtype=dtype)
            if learnable:
                self.sinks = nn.Parameter(s0)
            else:
                self.register_buffer("sinks", s0)
        else:
            self.sinks = None

    @property
    def b(self) -> Tensor:
        """``B_MIN + softplus(b_raw)``: per-head ``b > 0``, shape ``(num_heads,)``."""
        return B_MIN + F.softplus(self.b_raw)

    @property
    def n(self) -> Tensor:
        """``1 + softplus(n_raw)``: per-head ``n >= 1``, shape ``(num_heads,)``."""
        return 1.0 + F.softplus(self.n_raw)

    @torch.no_grad()
    def reset_parameters(self, b_init: InitValue = 1.0, n_init: InitValue = 1.5,
                         sinks_init: InitValue = 0.0) -> None:
        """Sets ``b``, ``n`` (and the sink logits, if the module has them) to new values (numbers
        or one per head)."""
        b0 = _init_values("b_init", b_init, self.num_heads, B_MIN)
        n0 = _init_values("n_init", n_init, self.num_heads, 1.0)
        self.b_raw.copy_(_inverse_softplus(b0 - B_MIN).to(self.b_raw.device))
        self.n_raw.copy_(_inverse_softplus(n0 - 1.0).to(self.n_raw.device))
        if self.sinks is not None:
            self.sinks.copy_(_init_values("sinks_init", sinks_init, self.num_heads, None).to(self.sinks.device))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False, scale: Optional[float] = None,
                enable_gqa: bool = False, *, dropout_p: float = 0.0,
                window_size: Tuple[int, int] = (-1, -1)) -> Tensor:
        """``ssa_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        b=self.b, n=self.n, window_size=window_size, sinks=self.sinks, softcap=self.softcap)``: shapes and masks as
        ``F.scaled_dot_product_attention``, with ``query`` of ``num_heads`` heads. ``dropout_p``
        (attention dropout on the final weights, SDPA's semantics) applies whenever it is > 0, as
        with SDPA: pass ``self.dropout if self.training else 0.0`` from the calling layer.
        ``window_size=(left, right)``: local attention (see :func:`ssa_flash.ssa_attention`)."""
        heads = query.shape[-3] if query.dim() >= 3 else None
        if heads != self.num_heads:
            raise ValueError(f"SSAttention was built for {self.num_heads} query heads, got query of shape {tuple(query.shape)}")
        return ssa_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             b=self.b, n=self.n, adaptive_temperature=self.adaptive_temperature,
                             backend=self.backend, window_size=window_size, sinks=self.sinks,
                             softcap=self.softcap)

    def extra_repr(self) -> str:
        if self.b_raw.is_meta:
            return f"num_heads={self.num_heads}, learnable={self.learnable}, backend={self.backend!r}"
        with torch.no_grad():
            b = ", ".join(f"{x:.3g}" for x in self.b.tolist()[:8])
            n = ", ".join(f"{x:.3g}" for x in self.n.tolist()[:8])
        more = ", ..." if self.num_heads > 8 else ""
        extra = ", adaptive_temperature=True" if self.adaptive_temperature else ""
        if self.sinks is not None:
            extra += ", sinks=[" + ", ".join(f"{x:.3g}" for x in self.sinks.tolist()[:8]) + f"{more}]"
        if self.softcap:
            extra += f", softcap={self.softcap:g}"
        return (f"num_heads={self.num_heads}, b=[{b}{more}], n=[{n}{more}], "
                f"learnable={self.learnable}{extra}, backend={self.backend!r}")
