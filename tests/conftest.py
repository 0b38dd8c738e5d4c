"""Test configuration: without a GPU the Triton kernels run through Triton's CPU interpreter,
which must be switched on before anything imports triton."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # also listed in pyproject.toml; a second registration of the same marker is harmless
    config.addinivalue_line("markers", "gpu_smoke: the GPU smoke tier (tests/test_gpu_smoke.py): every kernel "
                                       "family once at small shapes; bench/run_gpu.sh runs it first")
