"""The reference backend (``backend="reference"``: the specification's forward with its own explicit
backward, ssa_flash/backends/reference_backend.py) on the shared feature matrix (tests/features.py)
against autograd of the specification in float64."""
import pytest
import torch

import features


@pytest.mark.parametrize("row", features.rows_for("reference"), ids=str)
def test_feature_row(row):
    features.check_row(row, "reference", torch.float32, device="cpu")
