"""GPU timing of the Triton forward kernel's warp-specialised form (``WARP_SPECIALIZE``, docs/design.md
§4.4) against the tile table's first choice: ``SSA_FLASH_WARP_SPECIALIZE=1`` vs ``=0`` with
``SSA_FLASH_AUTOTUNE=0`` (each the first candidate, no timing of the others), bf16, D = 128, 16
heads, ``B * L = 16k`` tokens, non-causal, SSA and softmax forward at L = 4k and 16k. Prints one
line per row and writes ``<out>/warp-specialize.json``. Without a CUDA device it says so and
exits 0. ``python -m ssa_flash.bench.warp_specialize --out DIR``.

Compiles two kernels per operation (~5 s each on the CPU) and runs ~0.3 s per row: ~15 s in all.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path


def _time_ms(fn, budget_s: float = 0.25) -> float:
    import torch

    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(5, min(50, int(budget_s * 1000 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/gpu-run")
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--ops", default="ssa,softmax")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("warp-specialise timing: no CUDA device, skipped")
        return 0
    import ssa_flash
    from ssa_flash.triton import block_choice, launch, tuning_cache

    os.environ["SSA_FLASH_AUTOTUNE"] = "0"
    H, D, tokens = 16, 128, 16384
    rows = []
    for knob in ("0", "1"):
        os.environ[block_choice.WS_ENV] = knob
        block_choice.chosen_blocks.clear()
        for op in args.ops.split(","):
            for L in (int(x) for x in args.lengths.split(",")):
                B = max(1, tokens // L)
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
                b = torch.ones(H, device="cuda")
                n = torch.full((H,), 1.5, device="cuda")
                if op == "ssa":
                    fn = lambda: ssa_flash.ssa_attention(q, k, v, b=b, n=n, backend="triton")  # noqa: E731
                else:
                    fn = lambda: ssa_flash.softmax_attention(q, k, v, backend="triton")  # noqa: E731
                ms = _time_ms(fn)
                chosen = [blk for key, blk in block_choice.chosen_blocks.items()
                          if key[0] == "fwd" and isinstance(blk, launch.Blocks)]
                tflops = 4 * B * H * L * L * D / (ms * 1e-3) / 1e12
                row = dict(op=op, L=L, B=B, warp_specialize=knob == "1", ms=round(ms, 4), tflops=round(tflops, 1),
                           blocks=[tuning_cache.block_list(c) for c in chosen])
                rows.append(row)
                print(f"warp-specialise {knob}: {op} L={L} B={B}: {ms:.3f} ms, {tflops:.0f} TFLOP/s, blocks {row['blocks']}",
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "warp-specialize.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "triton": __import__("triton").__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
