"""The Triton kernels (``backend="triton"``; Triton's interpreter on the CPU) on the shared feature
matrix (tests/features.py) against the float64 specification."""
import pytest

import features
from attn_testing import KERNEL_DTYPES, needs_kernels

pytestmark = needs_kernels


@pytest.mark.parametrize("row", features.rows_for("triton"), ids=str)
def test_feature_row(row):
    features.check_row(row, "triton", KERNEL_DTYPES[0])
