"""Static model of the sm_90a warp-specialised forward (csrc/hopper/, docs/design.md §4.4): for
each instance compiled from ``csrc/hopper/fwd_instances.cu``, the consumer warpgroups' main loops
(the interior one: no masking) counted per score element from the SASS, and the bound model of
docs/design.md §4.3 (``model.bound``): which pipe binds (issue, MUFU, tensor) and the TFLOP/s it
allows. A bound from the instruction stream, never a measurement.

Per score element: one iteration of a consumer loop covers a 128 x 128 tile of scores for the
two consumer warpgroups (256 threads: 64 elements per thread); the producer warpgroup's
instructions (one elected thread, a few per key block) are left out. Two figures per loop:

* ``bound``: ``max(issue, MUFU, tensor)`` clocks per element, the pipes fully overlapped, which is
  what the ping-pong and the intra-warpgroup overlap aim at;
* ``serial_tflops``: ``tensor + max(issue, MUFU)``, nothing overlapped with the GEMMs (one
  warpgroup issuing loads, GEMMs and transform in turn, as today's kernel does).

    python -m ssa_flash.audit.hopper [--json bench/results/hopper-fwd-model.json]

needs nvcc (sm_90a), nvdisasm and cuobjdump (``compile.tool``).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from . import model, resources, sass

ARCH = 90
BLOCK_M = BLOCK_N = 128
CONSUMER_THREADS = 256
INSTANCES = "hopper/fwd_instances.cu"

_SYMBOL_RE = re.compile(r"WsFwdTraitsILi(\d+)E(\d+)(__nv_bfloat16|__half)NS_10MufuBudgetILi(\d)ELi(\d)EEELi(\d)EEENS_\d+"
                        r"(Softmax|Ssa|LogitScale)ELb([01])E")
_SCORES = {"Softmax": "softmax", "Ssa": "ssa", "LogitScale": "logit_scale"}


def describe(symbol: str) -> Optional[dict]:
    """Head dim, dtype, score, adaptive, MUFU budget (eighths of ex2 / lg2 on the FMA pipe) and
    fault of an ``attn_fwd_ws_kernel`` instance's mangled name, or None."""
    m = _SYMBOL_RE.search(symbol)
    if not m or "attn_fwd_ws_kernel" not in symbol:
        return None
    d, _, ty, ex2p, lg2p, fault, score, adaptive = m.groups()
    return {"head_dim": int(d), "dtype": "bf16" if ty == "__nv_bfloat16" else "fp16", "score": _SCORES[score],
            "adaptive": adaptive == "1", "ex2_poly_eighths": int(ex2p), "lg2_poly_eighths": int(lg2p),
            "fault": int(fault)}


def _wait_retry(func: sass.Function, lp: sass.Loop) -> bool:
    """Whether ``lp`` is only an mbarrier wait's out-of-line retry: ptxas puts the retry of a
    ``try_wait`` after the kernel's end (``SYNCS.PHASECHK`` then a branch back to the wait), which
    looks like a loop from the wait to there."""
    return any(func.instrs[i].mnemonic == "SYNCS" and "PHASECHK" in func.instrs[i].opcode
               for i in range(max(lp.head, lp.tail - 2), lp.tail))


def consumer_loops(func: sass.Function) -> List[sass.Loop]:
    """The consumer warpgroups' key-block loops: the innermost loops holding wgmma, mbarrier
    retries left out (:func:`_wait_retry`)."""
    loops = [lp for lp in sass.find_loops(func) if not _wait_retry(func, lp)]
    with_mma = [lp for lp in loops if any(func.instrs[i].category == "tensor" for i in range(lp.head, lp.tail + 1))]
    return [lp for lp in with_mma if not any(lp.contains(o) for o in with_mma)]


def loop_figures(func: sass.Function, lp: sass.Loop, arch_model: model.ArchModel, head_dim: int) -> dict:
    """Per-element counts and bounds of one consumer loop (see the module docstring)."""
    c = sass.count_loop(func, lp)
    elems = BLOCK_M * BLOCK_N / CONSUMER_THREADS
    tile = BLOCK_M * BLOCK_N
    warps = CONSUMER_THREADS // 32
    per = {k: round(v / elems, 4) for k, v in c.by_category.items()}
    per["total"] = round(c.instructions / elems, 4)
    types: Dict[str, float] = {}
    macs = 0.0
    for kind, count in c.mma.items():
        m, group = sass.mma_macs(sass.Instr(0, 0, kind, kind, kind.split(".")[0], ""))
        t = model.mma_input_type(kind)
        # an HGMMA is issued by each of the 4 warps of its warpgroup: per warp m / group
        v = count * m * warps / group / tile
        types[t] = types.get(t, 0.0) + v
        macs += v
    b = model.bound(arch_model, per["total"], per["mufu"], types, 2 * head_dim)
    serial = b["tensor_clocks"] + max(b["issue_clocks"], b["mufu_clocks"])
    ideal = 2 * head_dim / arch_model.tensor16
    return {"instructions": c.instructions, "per_element": per,
            "mufu_per_element": {k: round(v / elems, 4) for k, v in c.mufu.items()},
            "mma": c.mma, "macs_per_element": round(macs, 3), "inner_branches": c.inner_branches,
            "bound": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in b.items()},
            "serial_tflops": round(ideal / serial * arch_model.peak_tflops, 1)}


def analyse(cubin: bytes, ptxas_log: str) -> List[dict]:
    """One row per warp-specialised forward instance of the cubin."""
    from . import compile as comp

    am = model.arch_model(ARCH)
    log = resources.parse_ptxas_log(ptxas_log)
    rows = []
    for func in sass.parse(comp.disassemble(cubin)):
        desc = describe(func.name)
        if desc is None:
            continue
        p = log.functions.get(func.name, resources.PtxasFunction())
        loops = [loop_figures(func, lp, am, desc["head_dim"]) for lp in consumer_loops(func)]
        # the interior loop: the fewest instructions per element (the checked loop carries the masks)
        interior = min(loops, key=lambda lp: lp["per_element"]["total"]) if loops else None
        rows.append({"symbol": func.name, **desc, "launch_registers": p.registers,
                     "spill_store_bytes": p.spill_store_bytes, "spill_load_bytes": p.spill_load_bytes,
                     "main_loops": len(loops), "interior": interior,
                     "boundary": [lp for lp in loops if lp is not interior]})
    rows.sort(key=lambda r: (r["head_dim"], r["score"], r["adaptive"], r["ex2_poly_eighths"], r["lg2_poly_eighths"]))
    return rows


def build(csrc: Path, out_dir: Path, host: bool = False) -> dict:
    """nvcc -cubin of csrc/hopper/fwd_instances.cu for sm_90a with the extension's flags: {cubin,
    log} (cubin None on failure). ``host``: the launcher's host code too (SSA_FLASH_WS_FWD_HOST)."""
    from .cuda import nvcc_flags

    cubin = out_dir / "fwd_instances.sm_90a.cubin"
    cmd = ["nvcc", "-cubin", "-std=c++17", "-arch=sm_90a", "-Xptxas", "-v", *nvcc_flags(), "-DSSA_FLASH_HOPPER_FWD=1",
           *(["-DSSA_FLASH_WS_FWD_HOST"] if host else []), "-I", str(csrc), str(csrc / INSTANCES), "-o", str(cubin)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return {"cubin": cubin if proc.returncode == 0 else None, "log": proc.stdout + proc.stderr}


def report(rows: List[dict]) -> dict:
    am = model.arch_model(ARCH)
    return {"kind": "ssa_flash static audit: sm_90a warp-specialised forward (csrc/hopper)",
            "note": ("Static bound from compiled code (no GPU ran anything): the consumer warpgroups' interior "
                     "main loop per score element; 'bound' assumes the tensor, MUFU and issue pipes fully "
                     "overlapped, 'serial_tflops' nothing overlapped with the GEMMs. Not a measurement."),
            "arch": ARCH, "model": {"gpu": am.gpu, "issue_per_clock": am.issue, "mufu_per_clock": am.mufu,
                                    "tensor_macs_per_clock_16bit": am.tensor16, "peak_tflops": am.peak_tflops},
            "command": "python -m ssa_flash.audit.hopper --json bench/results/hopper-fwd-model.json",
            "kernels": rows}


def text_table(rows: List[dict]) -> str:
    lines = [f"{'D':>4} {'score':<12}{'adapt':<6}{'ex2/lg2 poly':<13}{'instr/el':>9}{'mufu/el':>8}"
             f"{'binding':>9}{'TFLOP/s':>9}{'serial':>8}"]
    for r in rows:
        it = r["interior"]
        if it is None:
            continue
        b = it["bound"]
        lines.append(f"{r['head_dim']:>4} {r['score']:<12}{str(r['adaptive']):<6}"
                     f"{r['ex2_poly_eighths']}/8, {r['lg2_poly_eighths']}/8{'':<5}{it['per_element']['total']:>9.2f}"
                     f"{it['per_element']['mufu']:>8.3f}{b['binding']:>9}{b['tflops']:>9.0f}{it['serial_tflops']:>8.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from .cuda import source_dir, unavailable

    csrc = source_dir()
    why = unavailable(csrc)
    if why:
        print(f"skipped: {why}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        built = build(csrc, Path(tmp))
        if built["cubin"] is None:
            print(built["log"][-3000:], file=sys.stderr)
            return 1
        rows = analyse(Path(built["cubin"]).read_bytes(), built["log"])
    print(text_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(report(rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
