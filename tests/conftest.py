"""Test configuration: without a GPU the Triton kernels run through Triton's CPU interpreter,
which must be switched on before anything imports triton."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
