"""``torch.nn`` form of ring attention: :class:`RingSSAttention`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..nn import InitValue, SSAttention
from ..ops import _check_bool
from .ring import ring_attention

__all__ = ["RingSSAttention"]


class RingSSAttention(SSAttention):
    """:class:`ssa_flash.nn.SSAttention` (learnable per-head ``b > 0``, ``n >= 1``, the same
    parametrisation and state dict) computed by :func:`ssa_flash.distributed.ring_attention` on a
    sequence sharded over the ranks of ``group``::

        attn = RingSSAttention(num_heads, is_causal=True)            # one per layer
        out = attn(q, k, v)     # q, k, v: this rank's shards (shard_sequence(..., is_causal=True))

    Every rank holds a replica of ``b_raw``, ``n_raw``. With ``reduce_param_grads=False`` (the
    default) each rank's ``b``/``n`` gradients are its own queries' part, like those of every other
    replicated parameter computed on local tokens: wrap the model in DDP or FSDP over these ranks
    (or a mesh containing them), whose gradient reduction then treats ``b``, ``n`` exactly like the
    other parameters. With ``reduce_param_grads=True`` the module all-reduces them itself (every
    rank gets the whole gradient of the sum of the ranks' losses): for use without a
    data-parallel wrapper over these ranks; under one, they would be reduced twice (``W`` times
    too large relative to the other parameters under an averaging wrapper).

    Args:
        num_heads, b_init, n_init, learnable, adaptive_temperature, backend, sinks, sinks_init,
            softcap, device, dtype: as :class:`ssa_flash.nn.SSAttention` (an unknown backend
            name is refused here; the learnable sink logits are replicated like ``b_raw`` and
            their gradients follow ``reduce_param_grads`` like those of ``b``, ``n``).
        group: the process group of the sequence shards (None: the default group), resolved at
            each call.
        is_causal: default of ``forward``'s ``is_causal``.
        reduce_param_grads: see above.
    """

    def __init__(self, num_heads: int, b_init: InitValue = 1.0, n_init: InitValue = 1.5,
                 learnable: bool = True, *, group=None, is_causal: bool = False,
                 adaptive_temperature: bool = False, backend: str = "auto",
                 reduce_param_grads: bool = False, sinks: bool = False, sinks_init: InitValue = 0.0,
                 softcap: float = 0.0, device=None, dtype: Optional[torch.dtype] = None):
        super().__init__(num_heads, b_init, n_init, learnable, adaptive_temperature=adaptive_temperature,
                         backend=backend, sinks=sinks, sinks_init=sinks_init, softcap=softcap,
                         device=device, dtype=dtype)
        self.group = group
        self.is_causal = _check_bool("is_causal", is_causal)
        self.reduce_param_grads = _check_bool("reduce_param_grads", reduce_param_grads)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                is_causal: Optional[bool] = None, scale: Optional[float] = None,
                enable_gqa: bool = False) -> Tensor:
        """``ring_attention(query, key, value, group, is_causal, scale, enable_gqa,
        score="ssa", score_params=(self.b, self.n), ...)`` on this rank's shards ``(B, Hq, L/W, D)``;
        returns this rank's output shard. ``attn_mask`` must be None (masks are not sharded)."""
        if attn_mask is not None:
            raise ValueError("attn_mask: RingSSAttention takes no mask (is_causal only)")
        heads = query.shape[-3] if query.dim() >= 3 else None
        if heads != self.num_heads:
            raise ValueError(f"RingSSAttention was built for {self.num_heads} query heads, got query of "
                             f"shape {tuple(query.shape)}")
        causal = self.is_causal if is_causal is None else is_causal
        return ring_attention(query, key, value, self.group, causal, scale, enable_gqa, score="ssa",
                              score_params=(self.b, self.n), adaptive_temperature=self.adaptive_temperature,
                              backend=self.backend, reduce_param_grads=self.reduce_param_grads,
                              sinks=self.sinks, softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, is_causal={self.is_causal}, "
                f"reduce_param_grads={self.reduce_param_grads}")
