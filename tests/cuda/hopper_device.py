"""What the sm_90a kernels' GPU tests (test_hopper_fwd_device.py, test_hopper_bwd_device.py) need:
an sm_90 GPU, the CUDA backend, an extension built with the kernels."""
from __future__ import annotations

import os

import pytest
import torch


def require(kernel: str) -> dict:
    """The extension's switch state of the sm_90a ``kernel`` ("fwd": hopper_fwd, with the tensor-map
    cache's counters; "bwd": hopper_bwd). Skips without an sm_90 GPU, the backend or the kernel in
    the build; fails instead under SSA_FLASH_REQUIRE_CUDA=1 where the GPU is there but not they."""
    import ssa_flash

    if not torch.cuda.is_available():
        pytest.skip("GPU only (the CPU emulation: test_hopper_fwd_emulated.py, test_hopper_bwd_dispatch.py)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernels run on sm_90 only")
    strict = os.environ.get("SSA_FLASH_REQUIRE_CUDA") == "1"
    if not ssa_flash.cuda.is_available():
        reason = f"CUDA backend unavailable: {ssa_flash.cuda.unavailable_reason(torch.device('cuda'))}"
        pytest.fail(reason) if strict else pytest.skip(reason)
    from ssa_flash.backends import cuda_backend

    state = cuda_backend.hopper_fwd_state() if kernel == "fwd" else cuda_backend.hopper_bwd_state()
    if not state.get("built"):
        why = "the extension was built without the sm_90a kernels (SSA_FLASH_HOPPER_FWD=0 at compile time)"
        pytest.fail(why) if strict else pytest.skip(why)
    return state
