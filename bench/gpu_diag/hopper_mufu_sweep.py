"""The MUFU / FMA share of the sm_90a warp-specialised forward on the device: bf16 SSA, fixed
temperature, non-causal, B x 16 heads x L (B = 16k // L), the kernel forced on, each budget the
extension holds (csrc/hopper/fwd_launch.h, SSA_FLASH_HOPPER_MUFU_SWEEP: D 64 at 2/8, 3/8 and
2/8 + 2/8 of ex2 (+ lg2) on the FMA pipe, D 128 at 1/8 and 2/8) beside all-MUFU, timed with
triton.testing.do_bench (median ms, TFLOP/s of the forward's 4 B H L^2 D). The static model's
prediction is bench/results/hopper-fwd-model.json. Prints a table; --out writes the rows as
JSON. Needs an extension built with SSA_FLASH_BUILD_HOPPER_FWD=1 SSA_FLASH_BUILD_HOPPER_MUFU_SWEEP=1.

    python bench/gpu_diag/hopper_mufu_sweep.py [--seqlens 4096,16384] [--out sweep.json]
"""
import argparse
import json
import sys

import torch

import ssa_flash
from ssa_flash.backends import cuda_backend, cuda_fwd_choice

# (D, budgets as (ex2, lg2) eighths on the FMA pipe)
BUDGETS = {64: ((0, 0), (2, 0), (3, 0), (2, 2)), 128: ((0, 0), (1, 0), (2, 0))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU")
        return 1
    from triton.testing import do_bench

    state = cuda_backend.hopper_fwd_state()
    if not state.get("built") or not state.get("mufu_sweep"):
        print(f"the extension lacks the sweep's instances: {state}")
        return 1
    ext = cuda_backend.load_extension()
    rows = []
    for D, budgets in BUDGETS.items():
        for L in (int(x) for x in args.seqlens.split(",")):
            B, H = max(1, 16384 // L), 16
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            b, n = torch.full((H,), 1.0, device="cuda"), torch.full((H,), 2.0, device="cuda")
            ref = None
            for ex2, lg2 in budgets:
                ext.hopper_fwd(mufu=8 * ex2 + lg2)
                try:
                    with torch.no_grad(), cuda_fwd_choice.forced(True):
                        fn = lambda: ssa_flash.attention(q, k, v, score="ssa", score_params=[b, n],  # noqa: E731
                                                         backend="cuda")
                        out = fn()
                        ref = out if ref is None else ref
                        err = (out.float() - ref.float()).abs().max().item()
                        ms = do_bench(fn, warmup=10, rep=40)
                finally:
                    ext.hopper_fwd(mufu=0)
                tflops = 4 * B * H * L * L * D / ms / 1e9
                row = dict(D=D, L=L, B=B, H=H, ex2_fma_eighths=ex2, lg2_fma_eighths=lg2, ms=round(ms, 4),
                           tflops=round(tflops, 1), max_abs_diff_vs_all_mufu=err)
                rows.append(row)
                print(f"D {D:3d} L {L:6d}  ex2 {ex2}/8 lg2 {lg2}/8 on FMA: {ms:8.3f} ms {tflops:7.1f} TFLOP/s "
                      f"(max |diff| vs all-MUFU {err:.3g})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
