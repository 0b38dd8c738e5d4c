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
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import BACKENDS, _check_bool, ssa_attention

__all__ = ["SSAttention", "B_MIN"]

B_MIN = 1e-6  # b = B_MIN + softplus(b_raw) > 0 even where softplus underflows

InitValue = Union[float, Sequence[float], Tensor]


def _inverse_softplus(y: Tensor) -> Tensor:
    """``x`` with ``softplus(x) = y`` for ``y > 0``: ``log(expm1(y))``, written stably for large ``y``."""
    return y + torch.log(-torch.expm1(-y))


def _init_values(name: str, value: InitValue, heads: int, low: float) -> Tensor:
    """An initial value (a number, or one per head) as a float64 CPU tensor of shape ``(heads,)``
    (explicitly on the CPU: models may be built under a ``torch.device("meta")`` context)."""
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
    if not torch.isfinite(t).all() or (t <= low).any():
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
        device, dtype: of the raw tensors (default float32: ``b`` and ``n`` are cast to the
            kernels' accumulation dtype anyway).

    Attributes:
        b_raw, n_raw: the unconstrained ``(num_heads,)`` tensors (parameters or buffers).
        b, n: the constrained ``(num_heads,)`` values, ``B_MIN + softplus(b_raw)`` and ``1 + softplus(n_raw)``.
    """

    def __init__(self, num_heads: int, b_init: InitValue = 1.0, n_init: InitValue = 1.5,
                 learnable: bool = True, *, adaptive_temperature: bool = False,
                 backend: str = "auto", device=None, dtype: Optional[torch.dtype] = None):
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

    @property
    def b(self) -> Tensor:
        """``B_MIN + softplus(b_raw)``: per-head ``b > 0``, shape ``(num_heads,)``."""
        return B_MIN + F.softplus(self.b_raw)

    @property
    def n(self) -> Tensor:
        """``1 + softplus(n_raw)``: per-head ``n >= 1``, shape ``(num_heads,)``."""
        return 1.0 + F.softplus(self.n_raw)

    @torch.no_grad()
    def reset_parameters(self, b_init: InitValue = 1.0, n_init: InitValue = 1.5) -> None:
        """Sets ``b`` and ``n`` to new values (numbers or one per head)."""
        b0 = _init_values("b_init", b_init, self.num_heads, B_MIN)
        n0 = _init_values("n_init", n_init, self.num_heads, 1.0)
        self.b_raw.copy_(_inverse_softplus(b0 - B_MIN).to(self.b_raw.device))
        self.n_raw.copy_(_inverse_softplus(n0 - 1.0).to(self.n_raw.device))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                is_causal: bool = False, scale: Optional[float] = None,
                enable_gqa: bool = False, *, dropout_p: float = 0.0,
                window_size: Tuple[int, int] = (-1, -1)) -> Tensor:
        """``ssa_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        b=self.b, n=self.n, window_size=window_size)``: shapes and masks as
        ``F.scaled_dot_product_attention``, with ``query`` of ``num_heads`` heads. ``dropout_p``
        (attention dropout on the final weights, SDPA's semantics) applies whenever it is > 0, as
        with SDPA: pass ``self.dropout if self.training else 0.0`` from the calling layer.
        ``window_size=(left, right)``: local attention (see :func:`ssa_flash.ssa_attention`)."""
        heads = query.shape[-3] if query.dim() >= 3 else None
        if heads != self.num_heads:
            raise ValueError(f"SSAttention was built for {self.num_heads} query heads, got query of shape {tuple(query.shape)}")
        return ssa_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             b=self.b, n=self.n, adaptive_temperature=self.adaptive_temperature,
                             backend=self.backend, window_size=window_size)

    def extra_repr(self) -> str:
        if self.b_raw.is_meta:
            return f"num_heads={self.num_heads}, learnable={self.learnable}, backend={self.backend!r}"
        with torch.no_grad():
            b = ", ".join(f"{x:.3g}" for x in self.b.tolist()[:8])
            n = ", ".join(f"{x:.3g}" for x in self.n.tolist()[:8])
        more = ", ..." if self.num_heads > 8 else ""
        extra = ", adaptive_temperature=True" if self.adaptive_temperature else ""
        return (f"num_heads={self.num_heads}, b=[{b}{more}], n=[{n}{more}], "
                f"learnable={self.learnable}{extra}, backend={self.backend!r}")
