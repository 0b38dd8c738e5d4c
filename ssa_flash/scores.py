"""Score functions: the per-element transform ``phi`` from scaled scores to logits, one object each.

Every attention here computes ``softmax(phi(z) + mask)`` (optionally tempered, docs/design.md §1.3)
with ``z = scale * q . k`` (soft-capped first when ``softcap > 0``). What differs between
variants is ``phi`` and its per-head learnable parameters; this module is where each is defined
once, and every layer looks it up here:

* the reference (the spec) builds its logits with :attr:`ScoreFunction.phi`;
* ``ssa_flash.ops`` checks each parameter against :attr:`ScoreFunction.rules`;
* the custom ops carry the parameters as one list (``Tensor[] score_params``) in the order of
  :attr:`ScoreFunction.params`, and return one gradient per entry;
* the Triton kernels are compiled for ``SCORE = score.id`` (``ssa_flash/triton/logits.py`` keeps
  each score function's transform and derivatives, selected by that constexpr);
* the CUDA C++ kernels are templated on a policy type per score function (``csrc/logits.h``),
  chosen from ``score.id`` in ``csrc/dispatch.h``;
* tests, the audit and the benchmark take their variant list from :func:`variants`.

Adding a score function end to end: CONTRIBUTING.md, "A new score function".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
from torch import Tensor

__all__ = ["ScoreFunction", "Variant", "SOFTMAX", "SSA", "LOGIT_SCALE", "SCORES", "get", "variants",
           "ssa_logits"]


def ssa_logits(z: Tensor, b: Tensor, n: Tensor) -> Tensor:
    """SSA: ``phi(z) = n * sgn(z) * log1p(b|z|)``, i.e. weights ``(1 + b|z|)^(sgn(z) n)``; written
    so that autograd's derivative at ``z = 0`` is the continuous limit ``n * b``
    (``sign(z) * log1p(b * abs(z))`` would give 0 there)."""
    # each branch sees only its own sign (clamped), so the unused one cannot make 0 * inf = NaN
    # in the backward (log1p(-b z) at b z = 1)
    return n * torch.where(z >= 0, torch.log1p(b * z.clamp(min=0)), -torch.log1p(b * (-z).clamp(min=0)))


def _ssa_derivatives(z: Tensor, b: Tensor, n: Tensor):
    u = 1.0 + b * z.abs()
    return n * b / u, (n * z / u, torch.sign(z) * torch.log1p(b * z.abs()))


@dataclass(frozen=True, eq=False)
class ScoreFunction:
    """One score function.

    ``phi(z, *params)``: the logits of the scaled (and soft-capped) scores ``z`` of shape
    ``(..., Hq, Lq, Lk)``, each parameter a ``(Hq, 1, 1)`` tensor in ``z``'s dtype; differentiable
    (the reference's gradients of the parameters are autograd's). ``derivatives(z, *params)``:
    ``(dphi/dz, (dphi/dparam, ...))`` element by element, the same shapes (what the explicit
    backward of ``ssa_flash.backends.reference_backend`` uses, and what each kernel's form in
    ``triton/logits.py`` and ``csrc/logits.h`` computes; tests/test_scores.py holds them to
    autograd's derivatives of ``phi``)."""

    name: str
    """the registry key, ``AttentionSpec.score``"""
    id: int
    """what the kernels are compiled for: the Triton ``SCORE`` constexpr, the C++ policy's ``kId``"""
    params: Tuple[str, ...]
    """the per-head parameters' names, in the order the ops and backends carry them"""
    rules: Tuple[str, ...]
    """each parameter's domain, ``"> 0"`` or ``">= 0"`` (finite always)"""
    phi: Callable[..., Tensor]
    """the transform (the spec)"""
    derivatives: Callable[..., tuple]
    """``(dphi/dz, per-parameter dphi/dparam)``"""
    example: Tuple[float, ...]
    """typical parameter values (tests draw per-head values around them, benchmarks use them)"""
    summary: str
    """one line for documentation and error messages"""

    # (eq=False: each score function is one object of the registry, compared and hashed by
    # identity, as cheaply as an int wherever it keys a cache)


def _identity(z: Tensor) -> Tensor:
    return z


def _logit_scale(z: Tensor, s: Tensor) -> Tensor:
    return s * z


SOFTMAX = ScoreFunction("softmax", 0, (), (), _identity, lambda z: (torch.ones_like(z), ()), (),
                        "phi(z) = z (softmax attention)")
SSA = ScoreFunction("ssa", 1, ("b", "n"), ("> 0", ">= 0"), ssa_logits, _ssa_derivatives, (1.0, 1.5),
                    "phi(z) = n sgn(z) log1p(b |z|) (Scaled Signed Averaging)")
LOGIT_SCALE = ScoreFunction("logit_scale", 2, ("s",), (">= 0",), _logit_scale,
                            lambda z, s: (s.expand_as(z), (z,)), (1.25,),
                            "phi(z) = s z (a learnable per-head logit scale)")

SCORES: Dict[str, ScoreFunction] = {f.name: f for f in (SOFTMAX, SSA, LOGIT_SCALE)}
"""Every score function, by name."""
_BY_ID = {f.id: f for f in SCORES.values()}
assert len(_BY_ID) == len(SCORES), "score ids must be distinct"


def get(name) -> ScoreFunction:
    """The score function called ``name`` (or with that id), or ``ValueError`` listing the names."""
    f = SCORES.get(name) if isinstance(name, str) else _BY_ID.get(name)
    if f is None:
        raise ValueError(unknown(name))
    return f


def unknown(name) -> str:
    """The message for a name (or id) that is no score function."""
    return f"unknown score function {name!r}; choose one of {tuple(SCORES)}"


@dataclass(frozen=True)
class Variant:
    """A score function with or without the adaptive temperature: what tests, the audit and the
    benchmark enumerate. Named as before score functions were a concept: ``softmax``, ``ssa``,
    ``adaptive`` (softmax tempered), ``ssa_adaptive``, then ``<score>`` / ``<score>_adaptive``."""

    score: ScoreFunction
    adaptive: bool

    @property
    def name(self) -> str:
        if self.score is SOFTMAX:
            return "adaptive" if self.adaptive else "softmax"
        return f"{self.score.name}_adaptive" if self.adaptive else self.score.name


def variants() -> Tuple[Variant, ...]:
    """Every score function, untempered and tempered, in registry order."""
    return tuple(Variant(f, a) for f in SCORES.values() for a in (False, True))


VARIANTS: Dict[str, Variant] = {v.name: v for v in variants()}
"""Every variant, by name."""
