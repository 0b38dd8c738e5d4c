"""From a compiled kernel to the audit's figures: resources, main loops, instruction mix per score
element, tensor work against the source's matmuls, and the bound model.

*Per score element*: a loop iteration of a program of ``warps * 32`` threads covers a
``BLOCK_M x BLOCK_N`` tile of scores (queries x keys), i.e. ``BLOCK_M * BLOCK_N / threads``
elements per thread. Each thread issues every instruction of the loop body once per iteration,
so ``instructions per element = body instructions / (BLOCK_M * BLOCK_N / threads)``: the
thread-instructions an SM issues per score element. Tensor multiply-adds per element are those of
the loop's MMA instructions over the whole program, divided by ``BLOCK_M * BLOCK_N``.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

from . import ir, model, resources, sass


def _per(x: float, elems: float) -> float:
    return round(x / elems, 4)


def analyse_loop(func: sass.Function, lp: sass.Loop, block_m: int, block_n: int, warps: int,
                 arch_model: model.ArchModel, source: Optional[ir.IRLoop]) -> dict:
    """Figures of one main loop (see the module docstring for *per element*)."""
    c = sass.count_loop(func, lp)
    threads = warps * 32
    elems = block_m * block_n / threads  # score elements per thread per iteration
    tile = block_m * block_n
    macs_by_type: Dict[str, float] = {}
    total_macs = 0.0
    for kind, count in c.mma.items():
        per_instr, group = sass.mma_macs(sass.Instr(0, 0, kind, kind, kind.split(".")[0], ""))
        macs = count * per_instr * warps / group  # whole program, one iteration
        total_macs += macs
        t = model.mma_input_type(kind)
        macs_by_type[t] = macs_by_type.get(t, 0.0) + macs / tile
    src_macs = source.macs if source is not None else None
    per_element = {k: _per(v, elems) for k, v in c.by_category.items()}
    per_element["total"] = _per(c.instructions, elems)
    per_element["uniform"] = _per(c.uniform, elems)
    per_element["local_memory"] = _per(c.local_memory, elems)
    mufu_kinds = {k: _per(v, elems) for k, v in c.mufu.items()}
    tensor = {
        "macs_per_iteration": int(total_macs),
        "macs_per_element": round(total_macs / tile, 3),
        "source_macs_per_iteration": src_macs,
        "source_macs_per_element": round(src_macs / tile, 3) if src_macs else None,
        "source_dots": [[d.m, d.n, d.k] for d in source.dots] if source is not None else None,
        "repeat_factor": round(total_macs / src_macs, 4) if src_macs else None,
    }
    b = model.bound(arch_model, per_element["total"], per_element["mufu"], macs_by_type,
                    (src_macs if src_macs else total_macs) / tile)
    return {
        "sass_offset": f"0x{c.offset:x}",
        "instructions": c.instructions,
        "elements_per_thread": elems,
        "per_element": per_element,
        "mufu_per_element": mufu_kinds,
        "mma": c.mma,
        "tensor": tensor,
        "bound": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in b.items()} if b else None,
        "inner_branches": c.inner_branches,
        "calls": c.calls,
        "nested_loops": c.nested_loops,
        "source_lines": {f.rsplit("/", 1)[-1]: list(r) for f, r in c.lines.items()},
        "branch_line": (f"{c.branch_line[0].rsplit('/', 1)[-1]}:{c.branch_line[1]}" if c.branch_line else None),
        "opcodes": dict(list(c.by_opcode.items())[:16]),  # the most frequent mnemonics
        "boundary_code": bool(c.line_set & boundary_marker_lines()),
    }


_MARKER = "# audit: boundary-only"


def boundary_marker_lines() -> frozenset:
    """``(file name, line)`` of the source lines marked ``# audit: boundary-only`` in the Triton
    kernels: code that only boundary tiles run (the index checks). A main loop holding any
    instruction from them is a boundary loop; the loop holding none is the interior one."""
    global _marker_cache
    if _marker_cache is None:
        from pathlib import Path

        root = Path(__file__).resolve().parent.parent / "triton"
        found = set()
        for path in root.glob("*.py"):
            for i, text in enumerate(path.read_text().splitlines(), 1):
                if _MARKER in text:
                    found.add((path.name, i))
        _marker_cache = frozenset(found)
    return _marker_cache


_marker_cache = None


def assign_roles(loops: List[dict]) -> Optional[int]:
    """Name the main loops: one loop is ``main``; with several, the ``interior`` one (no bounds,
    causal or mask work) and ``boundary`` ones (``boundary1``, ``boundary2``, ... in code order
    when there are several). The interior loop is the one without code from the lines marked
    ``# audit: boundary-only`` (:func:`boundary_marker_lines`) when exactly one such loop exists,
    else the one with the fewest instructions per element (an interior loop can be the longer
    one: the polynomial exp2 moves MUFU work into it). Returns the index of the loop the gates
    use (None if there is no loop)."""
    if not loops:
        return None
    if len(loops) == 1:
        loops[0]["role"] = "main"
        return 0
    unmarked = [i for i, lp in enumerate(loops) if not lp.get("boundary_code")]
    if len(unmarked) == 1:
        best = unmarked[0]
    else:
        best = min(range(len(loops)), key=lambda i: (loops[i]["per_element"]["total"], i))
    others = [i for i in range(len(loops)) if i != best]
    for k, i in enumerate(others, 1):
        loops[i]["role"] = "boundary" if len(others) == 1 else f"boundary{k}"
    loops[best]["role"] = "interior"
    return best


def warp_specialisation(ptx: str, sass_text: str) -> dict:
    """What makes a kernel warp-specialised (``tl.range(..., warp_specialize=True)``): its threads
    per block (``.reqntid``; 0 if absent), the ``setmaxnreg`` register counts per warpgroup role
    (``dec``: the producer's and the default partition's, ``inc``: the consumers'), the TMA loads
    (``cp.async.bulk.tensor`` in the PTX, ``UTMALDG`` in the SASS) and the mbarrier waits."""
    m = re.search(r"\.reqntid\s+(\d+)", ptx)
    return {
        "threads": int(m.group(1)) if m else 0,
        "setmaxnreg_dec": sorted({int(x) for x in re.findall(r"setmaxnreg\.dec\S*\s+(\d+)", ptx)}),
        "setmaxnreg_inc": sorted({int(x) for x in re.findall(r"setmaxnreg\.inc\S*\s+(\d+)", ptx)}),
        "ptx_bulk_tensor_loads": ptx.count("cp.async.bulk.tensor"),
        "sass_utmaldg": len(re.findall(r"\bUTMALDG\b", sass_text)),
        "sass_mbarrier_waits": len(re.findall(r"SYNCS\.PHASECHK", sass_text)),
    }


def analyse_compiled(name: str, cubin_sass: str, res_text: str, ptxas_text: str, ttir: str, shared_bytes: int,
                     block_m: int, block_n: int, warps: int, arch: int, threads: Optional[int] = None) -> dict:
    """All figures of one compiled Triton kernel (the SASS, ``cuobjdump -res-usage`` and ptxas
    texts already produced). ``warps``: the warps that run the main loops over the
    ``block_m x block_n`` tile (per element figures); ``threads``: the block's threads where
    they are more (a warp-specialised kernel's producer), else ``warps * 32``."""
    am = model.arch_model(arch)
    funcs = [f for f in sass.parse(cubin_sass) if f.name == name] or sass.parse(cubin_sass)[:1]
    func = funcs[0]
    res = resources.parse_res_usage(res_text).get(name)
    log = resources.parse_ptxas_log(ptxas_text)
    plog = log.functions.get(name) or next(iter(log.functions.values()), resources.PtxasFunction())
    threads = threads or warps * 32
    registers = res.registers if res else (plog.registers or 0)
    sass_loops = sass.main_loops(func)
    ir_loops = ir.main_loops(ttir) if ttir else []
    notes = []
    if len(ir_loops) == len(sass_loops):
        pairs = list(zip(sass_loops, ir_loops))
    else:
        if sass_loops:
            notes.append(f"{len(sass_loops)} SASS main loops vs {len(ir_loops)} source loops with dots: "
                         "each compared with the source loop of most multiply-adds")
        ref = max(ir_loops, key=lambda lp: lp.macs) if ir_loops else None
        pairs = [(lp, ref) for lp in sass_loops]
    loops = [analyse_loop(func, lp, block_m, block_n, warps, am, src) for lp, src in pairs]
    gated = assign_roles(loops)
    if not loops:
        notes.append("no loop with tensor instructions found")
    # Triton requests all its shared memory dynamically (``shared_bytes``) and its launcher refuses a
    # kernel asking for more than the per-block opt-in maximum; cuobjdump's static SHARED of a Triton
    # kernel is the system's reservation (1 KB on sm_90), which the per-SM budget below accounts for.
    limit = am.smem_per_block
    fit_problems = []
    total_shared = shared_bytes
    if total_shared > limit:
        fit_problems.append(f"shared memory {total_shared} B > {limit} B per block")
    if registers * threads > am.regs_per_sm:
        fit_problems.append(f"{registers} registers x {threads} threads > {am.regs_per_sm}")
    return {
        "symbol": name,
        "threads": threads,
        "registers": registers,
        "local_bytes": res.local_bytes if res else None,
        "stack_bytes": plog.stack_bytes,
        "spill_store_bytes": plog.spill_store_bytes,
        "spill_load_bytes": plog.spill_load_bytes,
        "spills": bool(plog.spill_store_bytes or plog.spill_load_bytes or (res and res.local_bytes)),
        "shared_bytes": total_shared,
        "static_shared_bytes": res.static_shared_bytes if res else None,
        "shared_limit_bytes": limit,
        "fits": not fit_problems,
        "fit_problems": fit_problems,
        "occupancy": model.occupancy(am, registers, threads, total_shared),
        "warnings": log.warnings,
        "serialisation_warnings": log.serialisation_warnings(),
        "loops": loops,
        "gated_loop": gated,
        "notes": notes,
    }
