"""Exceptions shared by every layer (the public functions, the custom ops, the backends).

Kept in a module of its own, importing nothing from the package, so that the layers below
``ssa_flash.ops`` can raise them without importing ``ops``.
"""
from __future__ import annotations

__all__ = ["BackendUnavailableError"]


class BackendUnavailableError(RuntimeError, ValueError):
    """The requested backend cannot run these inputs here (not built, no GPU, no interpreter,
    an unsupported dtype or head dim).

    A ``ValueError`` (a bad ``backend`` argument) and a ``RuntimeError`` (a missing capability)."""
