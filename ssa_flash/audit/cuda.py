"""The audit's CUDA C++ section: compile ``csrc/*.cu`` to cubins with ``nvcc -cubin -Xptxas -v``
(the extension's own flags) and run the same SASS analysis on every kernel instantiation.

Which kernel a symbol is, and its tile, comes from :data:`DESCRIBERS`: functions from a (mangled)
symbol to a description, or None. The one given reads ``KernelTraits<D, BM, BN, WARPS, T, SPLIT>``
and the ``bool`` switches of ``attn_{fwd,stats,bwd_dq,bwd_dkdv}_kernel`` (``csrc/traits.h``);
kernels it does not recognise still get resources and raw per-iteration counts. Causality and
masks are run-time switches of these kernels, so their loops are counted with every path present
(``inner_branches`` says how many branches a loop body holds).

Skipped (with the reason) when nvcc or ``csrc`` is absent. The tensor column reports ``gemms`` =
tensor multiply-adds per score element / padded head dim (2 for a forward: QK^T and PV).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from . import model, resources, sass

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"

_FALLBACK_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo",
                   "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                   "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__"]


def nvcc_flags() -> List[str]:
    """The extension's nvcc flags (``ssa_flash.cuda.NVCC_FLAGS``), ``-lineinfo`` included."""
    try:
        from ssa_flash.cuda import NVCC_FLAGS

        flags = list(NVCC_FLAGS)
    except Exception:  # noqa: BLE001 - the module may be absent or fail to import without torch CUDA
        flags = list(_FALLBACK_FLAGS)
    if "-lineinfo" not in flags:
        flags.append("-lineinfo")
    return flags


def unavailable(csrc: Path = CSRC) -> Optional[str]:
    """Why the CUDA section cannot run here, or None."""
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    if not csrc.is_dir() or not list(csrc.glob("*.cu")):
        return f"no .cu files in {csrc}"
    return None


_TRAITS_RE = re.compile(r"KernelTraitsI((?:Li\d+E)+)(\w+?)((?:Li\d+E)*)E")
_KERNEL_RE = re.compile(r"attn_(fwd|stats|bwd_dq|bwd_dkdv|bwd_fused)_kernel")


def describe_ssa_flash(symbol: str) -> Optional[dict]:
    """``{kernel, head_dim, block_m, block_n, warps, dtype, col_split, ssa, adaptive}`` of an
    ``attn_*_kernel<KernelTraits<...>, bool...>`` symbol (mangled), or None."""
    km = _KERNEL_RE.search(symbol)
    tm = _TRAITS_RE.search(symbol)
    if not km or not tm:
        return None
    ints = [int(x) for x in re.findall(r"Li(\d+)E", tm.group(1))]
    tail = [int(x) for x in re.findall(r"Li(\d+)E", tm.group(3))]
    if len(ints) < 4:
        return None
    elem = tm.group(2)
    dtype = "bf16" if "bfloat16" in elem else "fp16" if ("half" in elem or "__half" in elem) else elem
    bools = [b == "1" for b in re.findall(r"Lb([01])E", symbol[tm.end():])]
    kernel = km.group(1)
    return {"kernel": kernel, "head_dim": ints[0], "block_m": ints[1], "block_n": ints[2], "warps": ints[3],
            "dtype": dtype, "col_split": tail[0] if tail else 1,
            "ssa": bools[0] if bools else None, "adaptive": bools[1] if len(bools) > 1 else False}


#: Symbol describers, tried in order; the first non-None answer is used.
DESCRIBERS: List[Callable[[str], Optional[dict]]] = [describe_ssa_flash]


def compile_cu(path: Path, arch: int, out_dir: Path, extra_flags=()) -> dict:
    """``nvcc -cubin`` one file for ``sm_<arch>`` (``sm_90a`` from 90 on). Returns the cubin path,
    the ptxas log, nvcc's other output and the time."""
    gpu = f"sm_{arch}{'a' if arch >= 90 else ''}"
    cubin = out_dir / f"{path.stem}.{gpu}.cubin"
    cmd = ["nvcc", "-cubin", "-std=c++17", f"-arch={gpu}", "-Xptxas", "-v", *nvcc_flags(), *extra_flags,
           "-I", str(path.parent), str(path), "-o", str(cubin)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return {"file": path.name, "cubin": cubin if proc.returncode == 0 else None, "returncode": proc.returncode,
            "log": proc.stdout + proc.stderr, "compile_s": round(time.monotonic() - start, 1)}


def analyse_cubin(cubin: bytes, ptxas_text: str, arch: int) -> List[dict]:
    """Resources and main-loop figures of every kernel in a cubin."""
    from . import compile as comp

    am = model.arch_model(arch)
    text = comp.disassemble(cubin)
    res = resources.parse_res_usage(comp.res_usage(cubin))
    log = resources.parse_ptxas_log(ptxas_text)
    out = []
    for func in sass.parse(text):
        if func.name not in res:  # device functions (slow paths) have no resource entry
            continue
        desc = next((d for d in (f(func.name) for f in DESCRIBERS) if d), None)
        r = res[func.name]
        p = log.functions.get(func.name, resources.PtxasFunction())
        row = {"symbol": func.name, "describe": desc, "registers": r.registers, "local_bytes": r.local_bytes,
               "spill_store_bytes": p.spill_store_bytes, "spill_load_bytes": p.spill_load_bytes,
               "spills": bool(p.spill_store_bytes or p.spill_load_bytes or r.local_bytes),
               "static_shared_bytes": r.static_shared_bytes, "loops": []}
        for lp in sass.main_loops(func):
            c = sass.count_loop(func, lp)
            loop = {"instructions": c.instructions, "mufu": c.mufu, "mma": c.mma, "inner_branches": c.inner_branches,
                    "by_category": c.by_category, "branch_line": (f"{c.branch_line[0].rsplit('/', 1)[-1]}:"
                                                                   f"{c.branch_line[1]}" if c.branch_line else None)}
            if desc:
                threads = desc["warps"] * 32
                tile = desc["block_m"] * desc["block_n"]
                elems = tile / threads
                macs = c.macs_per_warp * desc["warps"]
                pe = {k: round(v / elems, 4) for k, v in c.by_category.items()}
                pe["total"] = round(c.instructions / elems, 4)
                loop.update(per_element=pe, mufu_per_element={k: round(v / elems, 4) for k, v in c.mufu.items()},
                            macs_per_element=round(macs / tile, 3), gemms=round(macs / tile / desc["head_dim"], 3))
                types: Dict[str, float] = {}
                for kind, count in c.mma.items():
                    m, g = sass.mma_macs(sass.Instr(0, 0, kind, kind, kind.split(".")[0], ""))
                    t = model.mma_input_type(kind)
                    types[t] = types.get(t, 0.0) + count * m * desc["warps"] / g / tile
                b = model.bound(am, pe["total"], pe["mufu"], types, macs / tile)
                loop["bound"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in b.items()} if b else None
            row["loops"].append(loop)
        if row["loops"] and desc:
            best = min(range(len(row["loops"])), key=lambda i: row["loops"][i]["per_element"]["total"])
            for i, lp in enumerate(row["loops"]):
                lp["role"] = "main" if len(row["loops"]) == 1 else ("interior" if i == best else "boundary")
        out.append(row)
    return out


def audit(arch: int, csrc: Path = CSRC, progress=None, dump_dir: Optional[str] = None,
          files: Optional[List[Path]] = None) -> dict:
    """Compile and analyse every ``.cu`` file of ``csrc`` for ``sm_<arch>``."""
    why = unavailable(csrc)
    if why:
        return {"skipped": why}
    files = files or sorted(csrc.glob("*.cu"))
    kernels, compiles = [], []
    with tempfile.TemporaryDirectory(prefix="ssa_flash_audit_cu_") as tmp:
        for path in files:
            if progress:
                progress(f"nvcc {path.name} for sm_{arch} ...")
            c = compile_cu(path, arch, Path(dump_dir) if dump_dir else Path(tmp))
            warnings = resources.parse_ptxas_log(c["log"]).warnings
            compiles.append({"file": c["file"], "returncode": c["returncode"], "compile_s": c["compile_s"],
                             "warnings": warnings, "error": None if c["cubin"] else c["log"][-2000:]})
            if c["cubin"] is None:
                continue
            for row in analyse_cubin(Path(c["cubin"]).read_bytes(), c["log"], arch):
                row["file"] = path.name
                kernels.append(row)
    return {"nvcc": shutil.which("nvcc"), "flags": nvcc_flags(), "compiles": compiles, "kernels": kernels}


def text_report(result: dict, arch: int) -> str:
    """A table of the CUDA section for one architecture."""
    from .report import DISCLAIMER, format_table

    if result.get("skipped"):
        return f"== CUDA C++ kernels, sm_{arch}: skipped ({result['skipped']}) =="
    rows = []
    for k in result["kernels"]:
        d = k["describe"] or {}
        name = (f"{d['kernel']} ssa={int(bool(d['ssa']))} adapt={int(bool(d['adaptive']))} D={d['head_dim']} "
                f"{d['dtype']} {d['block_m']}x{d['block_n']}w{d['warps']}" if d else k["symbol"][:60])
        spill = k["spill_store_bytes"] + k["spill_load_bytes"]
        loops = k["loops"] or [None]
        for lp in loops:
            if lp is None:
                rows.append([name, str(k["registers"]), str(spill), "-", "-", "-", "-", "-", "-", "-"])
                continue
            pe = lp.get("per_element", {})
            b = lp.get("bound") or {}
            rows.append([name, str(k["registers"]), str(spill), lp.get("role", "?"),
                         f"{pe.get('total', lp['instructions'])}", f"{pe.get('mufu', '-')}",
                         ",".join(x.split(".")[1] for x in lp["mma"]) or "-", f"{lp.get('gemms', '-')}",
                         str(lp["inner_branches"]), f"{b.get('binding', '-')} {b.get('tflops', 0):.0f}" if b else "-"])
    errors = [c for c in result["compiles"] if c["error"]]
    head = ("kernel", "regs", "spill", "loop", "instr/el", "mufu/el", "MMA", "gemms", "branches", "bound TF/s")
    out = [f"== CUDA C++ kernels, sm_{arch} ==  {DISCLAIMER}", format_table(rows, head)]
    out += [f"nvcc {c['file']} failed (exit {c['returncode']})" for c in errors]
    return "\n".join(out)
