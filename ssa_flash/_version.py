"""The package version (the contract layer: the Triton launcher keys its tuning cache with it)."""
__version__ = "0.1.0"
