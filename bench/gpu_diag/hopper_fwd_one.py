"""One launch of the sm_90a warp-specialised forward (csrc/hopper/) for a profiler: bf16, D 128,
B 2, H 16, L 8k, SSA, non-causal, the kernel forced on (ssa_flash/backends/cuda_fwd_choice.py),
after one warm-up call (the profiled launch is the second: ``ncu --launch-count 1`` with
``--launch-skip 0`` sees the first; bench/run_gpu.sh profiles the first of the run, which is
the same kernel and shape). Prints what ran. Usage: python bench/gpu_diag/hopper_fwd_one.py [L]."""
import sys

import torch

import ssa_flash
from ssa_flash.backends import cuda_backend, cuda_fwd_choice


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU")
        return 1
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 16, L, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    b = torch.full((16,), 1.0, device="cuda")
    n = torch.full((16,), 2.0, device="cuda")
    with torch.no_grad(), cuda_fwd_choice.forced(True):
        for _ in range(2):
            ssa_flash.attention(q, k, v, score="ssa", score_params=[b, n], backend="cuda")
    torch.cuda.synchronize()
    state = cuda_backend.hopper_fwd_state()
    print(f"L {L}: {state}")
    return 0 if state.get("built") and state.get("hits", 0) + state.get("misses", 0) >= 6 else 1


if __name__ == "__main__":
    sys.exit(main())
