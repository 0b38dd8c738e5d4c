"""Where a Triton call's host time goes on a GPU machine, layer by layer (< 15 s).

    python bench/gpu_diag/host_launch.py [--reps 2000]

The H200 of 2026-11-28 spent 168-666 us of host time per ssa_flash Triton call (B 1, H 2, L 128,
D 64, bf16) against SDPA's 27-81 us, while the CPU's stubbed measurement of every host step but
the launch gives ~60-90 us. This times, with the device idle before each block of calls (median
microseconds per call over blocks of 50), from the bottom up:

1. ``torch.empty`` on the GPU (one output allocation);
2. a trivial Triton kernel launched through ``kernel[grid]`` (Triton's binder, cache lookup);
3. the same kernel's ``CompiledKernel.run``, the call ssa_flash's direct launcher makes;
4. ssa_flash's launcher (``direct.LAUNCHER.run``: key, kept kernel, stream, hooks) on it;
5. ``ssa_flash.softmax_attention`` forward (the whole host path), direct launches on and off
   (``SSA_FLASH_DIRECT_LAUNCH=0``);
6. SDPA's forward at the same shape.

The differences between consecutive lines are the cost of each layer. Exit status 0; 2 without
CUDA. Prints one line per measurement.
"""
import argparse
import os
import statistics
import sys
import time

import torch


def per_call_us(fn, reps: int, block: int = 50) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(1, reps // block)):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(block):
            fn()
        samples.append((time.perf_counter() - start) / block)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2000)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import triton
    import triton.language as tl

    import ssa_flash
    from ssa_flash.triton import direct

    @triton.jit
    def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    dev = torch.device("cuda")
    x = torch.randn(4096, device=dev)
    y = torch.empty_like(x)
    grid = (4,)
    compiled = _copy[grid](x, y, x.numel(), BLOCK=1024)
    stream = torch.cuda.current_stream().cuda_stream
    from triton import knobs

    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          f"launch hooks: enter {enter!r}, exit {leave!r}")

    def run_compiled():
        meta = compiled.launch_metadata(grid, stream, x, y, x.numel(), 1024)
        compiled.run(4, 1, 1, stream, compiled.function, compiled.packed_metadata, meta, enter, leave,
                     x, y, x.numel(), 1024)

    rows = [("torch.empty (GPU)", lambda: torch.empty(8192, device=dev)),
            ("trivial kernel: kernel[grid]", lambda: _copy[grid](x, y, x.numel(), BLOCK=1024)),
            ("trivial kernel: CompiledKernel.run", run_compiled),
            ("trivial kernel: ssa_flash direct.LAUNCHER.run",
             lambda: direct.LAUNCHER.run(_copy, grid, (x, y, x.numel()), {"BLOCK": 1024}, {}, dev))]
    q = torch.randn(1, 2, 128, 64, device=dev, dtype=torch.bfloat16)
    rows.append(("ssa_flash.softmax_attention fwd (triton)",
                 lambda: ssa_flash.softmax_attention(q, q, q, is_causal=True, backend="triton")))
    rows.append(("torch SDPA fwd", lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)))
    for name, fn in rows:
        print(f"{per_call_us(fn, args.reps):9.1f} us  {name}", flush=True)
    os.environ[direct.ENV] = "0"
    print(f"{per_call_us(rows[4][1], args.reps // 4):9.1f} us  ssa_flash.softmax_attention fwd (triton), "
          "SSA_FLASH_DIRECT_LAUNCH=0", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
