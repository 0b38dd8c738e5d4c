"""Static model of the sm_90a backward's main loop (csrc/hopper/bwd_*.h; docs/design.md §4.3's
bound model): per shipped instance, from its SASS, the consumers' instructions, MUFU operations and
tensor multiply-adds per score element of the interior step loop, which pipe bounds it, and the
TFLOP/s that bound allows. A bound, never a measurement: memory, latency, the producer, the
pre-pass and the dQ atomics' L2 traffic are not in it.

The loop: of the innermost loops of a kernel holding wgmma (HGMMA), the one with the most of them,
then the smallest (the interior steps' loop; the checked steps' loop has the same GEMMs and the
bounds / causal checks). One iteration is one step of one consumer warpgroup: its 64 keys x 64
queries = 4096 scores on 128 threads, 32 per thread. Tensor work per score element, from the
HGMMA shapes (M x N x K multiply-adds each, per warpgroup): S^T, dP^T, dV, dK, dQ = 5 D
(D = 128: 640, 0.3125 clocks at 2048 per SM and clock; MUFU: lg2, ex2, rcp for SSA, ex2 for
softmax, plus the adaptive temperature's second ex2). FLOPs per element: 10 D (2 per
multiply-add; FlashAttention's count for a backward, 2.5 times the forward's 4 D). Two figures:
the bound, max(issue, MUFU, tensor) clocks (every pipe overlapped: the two consumer warpgroups
interleaving perfectly), and "serial", tensor + max(issue, MUFU) clocks (no overlap of the
tensor cores with the elementwise work at all); a measurement should fall between them.

    python tools/hopper_bwd_model.py [--json bench/results/hopper-bwd-model.json]

compiles tests/cuda/hopper_bwd.cu for sm_90a (nvcc on PATH, cuobjdump from PATH or the nvidia
wheels) and prints one row per instance.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CU = ROOT / "tests" / "cuda" / "hopper_bwd.cu"

# H100 / H200 (sm_90): ssa_flash/audit/model.py ARCHS[90]
ISSUE, MUFU, TENSOR, PEAK_TFLOPS = 128, 16, 2048, 989.0
ELEMENTS_PER_THREAD = 64 * 64 // 128  # one consumer warpgroup's step


def _sass_count():
    """tools/sass_count.py (its SASS parsing, loop finding, ptxas report reading)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import sass_count
    finally:
        sys.path.pop(0)
    return sass_count


def build(out_dir: Path):
    """(ptxas -v log, cuobjdump -sass text) of tests/cuda/hopper_bwd.cu for sm_90a."""
    try:
        from ssa_flash.audit.compile import tool  # (also finds Triton's bundled cuobjdump)
    except ImportError:
        tool = _sass_count().tool
    nvcc, cuobjdump = shutil.which("nvcc"), tool("cuobjdump")
    if nvcc is None or cuobjdump is None:
        raise RuntimeError("nvcc and cuobjdump are needed")
    cubin = out_dir / "hopper_bwd.cubin"
    proc = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
                           "-DSSA_FLASH_EXTRAS=0", "-Xptxas", "-v", "-I", str(ROOT / "csrc"), str(CU), "-o", str(cubin)],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{proc.stdout}{proc.stderr}")
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return proc.stdout + proc.stderr, sass


def instance_name(demangled: str):
    """(dtype, D, score, adaptive) of a hopper_bwd_kernel instance, or None."""
    m = re.search(r"hopper_bwd_kernel<ssa_flash::hopper::BwdTile<(\d+), (__half|__nv_bfloat16)>, ssa_flash::(\w+), "
                  r"(true|false), 0>", demangled)
    if not m:
        return None
    return ("bf16" if m.group(2) == "__nv_bfloat16" else "fp16", int(m.group(1)), m.group(3).lower(),
            m.group(4) == "true")


def model_loop(kernel_sass: str, D: int) -> dict:
    """The interior step loop's counts per score element and the bound (see the module docstring)."""
    sc = _sass_count()
    instrs = sc.parse_instructions(kernel_sass)
    loops = []
    for start, end in sc.find_loops(instrs):
        body = [(a, t) for a, t in instrs if start <= a <= end]
        hg = sum(1 for _, t in body if sc._opcode(t).startswith("HGMMA"))
        # a step loop holds the step's dQ GEMM (both operands transposed)
        dq = any(sc._opcode(t).startswith("HGMMA") and ".tnspA.tnspB" in t for _, t in body)
        if hg:
            loops.append((start, end, hg, dq, body))

    def inside(o, lp):
        return lp[0] <= o[0] and o[1] <= lp[1] and (o[0], o[1]) != (lp[0], lp[1])

    steps = [lp for lp in loops if lp[3]]
    inner = [lp for lp in steps if not any(o is not lp and inside(o, lp) for o in steps)]
    inner.sort(key=lambda lp: (-lp[2], lp[1] - lp[0]))
    start, end, _, _, body = inner[0]
    # a loop over the step's query parts inside it (BwdSplit kSplitLooped) runs 64 / N times, N the
    # queries of its score GEMMs (64 x N: no transposed operand)
    parts = [lp for lp in loops if inside(lp, inner[0])]
    assert len(parts) <= 1, f"more than one loop with wgmma inside the step loop: {[(a, b) for a, b, *_ in parts]}"
    trips, part_loop = 1, None
    ops = Counter(sc._opcode(t) for a, t in body if sc._opcode(t) != "NOP")
    if parts:
        p0, p1, _, _, pbody = parts[0]
        ns = {int(m.group(1)) for _, t in pbody if "tnsp" not in t
              for m in [re.match(r"HGMMA\.64x(\d+)x16", sc._opcode(t))] if m}
        assert len(ns) == 1, f"the part loop's score GEMMs: N {ns}"
        trips, part_loop = 64 // ns.pop(), [p0, p1]
        for _, t in pbody:
            if sc._opcode(t) != "NOP":
                ops[sc._opcode(t)] += trips - 1
    total = sum(ops.values())
    macs = 0
    for op, c in ops.items():
        m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op)
        if m:
            macs += c * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    mufu = sum(c for op, c in ops.items() if op.startswith("MUFU"))
    per = 1.0 / ELEMENTS_PER_THREAD
    instr_pe, mufu_pe = total * per, mufu * per
    tensor_pe = macs / (64 * 64)  # per warpgroup step: 64 x 64 scores
    clocks = {"issue": instr_pe / ISSUE, "mufu": mufu_pe / MUFU, "tensor": tensor_pe / TENSOR}
    bound = max(clocks, key=clocks.get)
    rate = 10 * D * PEAK_TFLOPS / (2 * TENSOR)  # TFLOP/s at one clock per element (SMs x clock = peak / (2 TENSOR))
    tflops = rate / clocks[bound]
    # no overlap of the tensor cores with the rest (a warpgroup waits for its GEMMs before its
    # elementwise work and the reverse; the two consumer warpgroups overlapping nothing either)
    serial = rate / (clocks["tensor"] + max(clocks["issue"], clocks["mufu"]))
    classes = Counter()
    for op, c in ops.items():
        classes[sc._klass(op)] += c
    return {
        "loop": [start, end], "part_loop": part_loop, "part_trips": trips, "instructions": total, "per_element": round(instr_pe, 3),
        "mufu_per_element": round(mufu_pe, 3), "tensor_macs_per_element": tensor_pe,
        "hgmma": sum(c for op, c in ops.items() if op.startswith("HGMMA")),
        "red": sum(c for op, c in ops.items() if op.startswith("RED")),
        # spill traffic inside the loop (ptxas's spill counts are the kernel's, loop or not)
        "local_in_loop": sum(c for op, c in ops.items() if op.startswith(("LDL", "STL"))),
        "per_element_by_class": {k: round(v * per, 3) for k, v in sorted(classes.items())},
        "clocks_per_element": {k: round(v, 5) for k, v in clocks.items()},
        "bound": bound, "bound_tflops": round(tflops, 1), "serial_tflops": round(serial, 1),
    }


def audit(out_dir: Path) -> list:
    sc = _sass_count()
    log, sass = build(out_dir)
    res = sc.ptxas_resources(log)
    kernels = sc.split_kernels(sass)
    names = sc.demangle(list(kernels))
    rows = []
    for mangled, text in kernels.items():
        inst = instance_name(names[mangled])
        if inst is None:
            continue
        dtype, D, score, adaptive = inst
        row = dict(dtype=dtype, D=D, score=score, adaptive=adaptive, **{k: res.get(mangled, {}).get(k) for k in
                                                                      ("registers", "stack", "spill_stores", "spill_loads")})
        row.update(model_loop(text, D))
        rows.append(row)
    rows.sort(key=lambda r: (r["dtype"], r["D"], r["score"], r["adaptive"]))
    return rows


def format_rows(rows) -> str:
    head = (f"{'instance':34} {'spill':>6} {'in loop':>7} {'instr/el':>8} {'mufu/el':>7} {'tensor/el':>9} {'bound':>6} {'TFLOP/s':>8} "
            f"{'serial':>7}")
    lines = [head]
    for r in rows:
        name = f"{r['dtype']} D{r['D']} {r['score']}{' adaptive' if r['adaptive'] else ''}"
        lines.append(f"{name:34} {r['spill_stores']:>6} {r['local_in_loop']:>7} {r['per_element']:>8} {r['mufu_per_element']:>7} "
                     f"{r['tensor_macs_per_element']:>9} {r['bound']:>6} {r['bound_tflops']:>8} {r['serial_tflops']:>7}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = audit(Path(tmp))
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": {"issue": ISSUE, "mufu": MUFU, "tensor16": TENSOR,
                                                         "peak_tflops": PEAK_TFLOPS}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
