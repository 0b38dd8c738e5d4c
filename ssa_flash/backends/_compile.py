"""``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` at package import.

``torch.compiler.assume_constant_result`` imports ``torch._dynamo``, which imports Triton: done at
``import ssa_flash`` time it would import Triton before ``python -m ssa_flash`` (or a user) can set
``TRITON_INTERPRET=1``, and cost every import a second. The decorator only sets a marker on the
function, so this sets the same marker; tests/ops/test_backends.py checks that it is the one torch sets.
"""
from __future__ import annotations

MARKER = "_dynamo_marked_constant"


def constant_for_compile(fn):
    """Marks ``fn`` as returning a constant for torch.compile: Dynamo calls it once while tracing
    and bakes the result into the graph instead of tracing into it. Its arguments must be
    constants there (no tensors, no symbolic sizes)."""
    setattr(fn, MARKER, True)
    return fn
