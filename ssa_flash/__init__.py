"""ssa_flash: fused attention kernels for Scaled Signed Averaging (SSA) and adaptive-temperature
softmax, drop-in replacements for ``torch.nn.functional.scaled_dot_product_attention``.

    >>> import ssa_flash
    >>> out = ssa_flash.ssa_attention(q, k, v, is_causal=True, b=1.0, n=1.5)

``ssa_flash.attention(q, k, v, score=..., score_params=...)`` takes any score function of
``ssa_flash.scores``. ``ssa_flash.reference`` is the specification in code: the same maths
written naively (``reference.attention(q, k, v, score=..., score_params=...)``, its entropy,
packed and KV-cache loops and the dropout bits).
"""
from . import cuda, nn, reference, scores
from .errors import BackendUnavailableError
from .ops import (
    adaptive_temperature_attention,
    attention,
    attention_entropy,
    attention_with_kvcache,
    available_backends,
    dropout_mask,
    softmax_attention,
    ssa_attention,
    varlen_attention,
)

from ._version import __version__

__all__ = [
    "attention",
    "ssa_attention",
    "softmax_attention",
    "adaptive_temperature_attention",
    "attention_entropy",
    "varlen_attention",
    "attention_with_kvcache",
    "dropout_mask",
    "available_backends",
    "BackendUnavailableError",
    "reference",
    "scores",
    "nn",
]
