"""The CUDA kernels (``backend="cuda"``) on the shared feature matrix (tests/features.py) against the
float64 specification: on the CPU through the emulation of the kernels (csrc/emu, emulation.py) in
float16, on a GPU through the extension in float16 and bfloat16."""

import pytest
import torch

import features
from attn_testing import CUDA
from emulation import cuda_backend_context

DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]


@pytest.fixture(scope="module")
def runs_on():
    """The context the CUDA backend runs in: the extension on a GPU, else the emulator."""
    return cuda_backend_context()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row", features.rows_for("cuda"), ids=str)
def test_feature_row(runs_on, row, dtype):
    with runs_on():
        features.check_row(row, "cuda", dtype)
