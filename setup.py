"""Build script. The pure-Python package always installs; the CUDA extension (csrc/) is added by the
CUDA backend when a CUDA toolkit and a CUDA-enabled torch are present (see docs/cuda.md)."""
from setuptools import setup

setup()
