"""Sequence parallelism (placeholder)."""
