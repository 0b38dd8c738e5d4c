"""The CUDA kernels (``backend="cuda"``) on the shared feature matrix (tests/features.py) against the
float64 specification: on the CPU through the emulation of the kernels (csrc/emu, emulation.py) in
float16, on a GPU through the extension in float16 and bfloat16."""
import contextlib

import pytest
import torch

import features
import ssa_flash
from attn_testing import CUDA
from emulation import build_emulator

DTYPES = [torch.float16, torch.bfloat16] if CUDA else [torch.float16]


@pytest.fixture(scope="module")
def runs_on():
    """The context the CUDA backend runs in: the extension on a GPU, else the emulator."""
    if CUDA:
        if not ssa_flash.cuda.is_available():
            pytest.skip(f"CUDA backend unavailable: {ssa_flash.cuda.unavailable_reason()}")
        return contextlib.nullcontext
    emu = build_emulator()
    return lambda: ssa_flash.cuda.emulated(emu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("row", features.rows_for("cuda"), ids=str)
def test_feature_row(runs_on, row, dtype):
    with runs_on():
        features.check_row(row, "cuda", dtype)
