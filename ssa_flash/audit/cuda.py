"""The audit's CUDA C++ section: compile ``csrc/*.cu`` to cubins with ``nvcc -cubin -Xptxas -v``
(the extension's own flags) and run the same SASS analysis on every kernel instantiation.

Which kernel a symbol is, and its tile, comes from :data:`DESCRIBERS`: functions from a (mangled)
symbol to a description, or None. The one given reads ``KernelTraits<D, BM, BN, WARPS, T, SPLIT>``
and the ``bool`` switches of ``attn_{fwd,row_entropy,bwd_dq,bwd_dkdv}_kernel`` (``csrc/traits.h``);
kernels it does not recognise still get resources and raw per-iteration counts. Causality and
masks are run-time switches of these kernels, so their loops are counted with every path present
(``inner_branches`` says how many branches a loop body holds).

Results are cached per file and architecture (``runner.cache_dir()``, files ``cuda-<hash>.json``)
under a hash of every source in ``csrc`` (``*.cu``, ``*.h``), nvcc's version, the flags, the
architecture and the analysing modules, so an unchanged tree is not recompiled.

Skipped (with the reason) when nvcc or the sources are absent (:func:`source_dir`: csrc/ of a
checkout, ``ssa_flash/_csrc`` of an installed package). The tensor column reports ``gemms`` =
tensor multiply-adds per score element / padded head dim (2 for a forward: QK^T and PV).
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

from . import model, report, resources, sass

ROOT = Path(__file__).resolve().parents[2]


def source_dir() -> Path:
    """The CUDA sources to audit: the CUDA backend's :func:`~ssa_flash.backends.cuda_backend.source_dir`
    (csrc/ of a source checkout, or ``ssa_flash/_csrc`` of an installed package), else the
    checkout's csrc/ path (then reported missing)."""
    from ..backends.cuda_backend import source_dir as backend_sources

    found = backend_sources()
    return Path(found) if found is not None else ROOT / "csrc"

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


def unavailable(csrc: Optional[Path] = None) -> Optional[str]:
    """Why the CUDA section cannot run here, or None: nvcc to compile, the sources (``csrc``,
    default :func:`source_dir`), ``nvdisasm`` and ``cuobjdump`` (Triton's bundled copies or PATH)
    to read the cubins."""
    csrc = source_dir() if csrc is None else Path(csrc)
    if shutil.which("nvcc") is None:
        return "nvcc is not on PATH"
    if not csrc.is_dir() or not list(csrc.glob("*.cu")):
        return f"no .cu files in {csrc}"
    try:
        from . import compile as comp

        for name in ("nvdisasm", "cuobjdump"):
            comp.tool(name)
    except (ImportError, FileNotFoundError) as err:
        return str(err)
    return None


_TRAITS_RE = re.compile(r"KernelTraitsI((?:Li\d+E)+)(\w+?)((?:Li\d+E)*)E")
_KERNEL_RE = re.compile(r"attn_(fwd|row_entropy|bwd_dq|bwd_dkdv|bwd_fused)_kernel")


def describe_ssa_flash(symbol: str) -> Optional[dict]:
    """``{kernel, head_dim, block_m, block_n, warps, dtype, col_split, ssa, adaptive, prep,
    inner_trips}`` of an ``attn_*_kernel<KernelTraits<...>, bool...>`` symbol (mangled), or None
    (``prep``: the dQ kernel as the fused backward's pre-pass; ``inner_trips``: iterations of the
    rolled loop inside each main loop, sass.main_loops)."""
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
    # the score function's policy type (csrc/logits.h) comes first, as a (substituted) nested name
    # (N9ssa_flash3SsaE, NS_3SsaE; before the policies, a bool kSSA): the audit's tables have
    # softmax and SSA, read as that bool; logit-scale kernels are left out of them
    sm = re.match(r"E?N(?:9ssa_flash|S\d*_)(\d+)", symbol[tm.end():])
    if sm:
        score = symbol[tm.end() + sm.end(): tm.end() + sm.end() + int(sm.group(1))]
        if score not in ("Softmax", "Ssa"):
            return None
        bools = [score == "Ssa"] + bools
    # the statistics pass is "row_entropy" in every audit table (attn_stats_kernel in csrc/)
    kernel = "row_entropy" if km.group(1) == "stats" else km.group(1)
    d, block_m, warps = ints[0], ints[1], ints[3]
    # csrc/bwd_kernel.h: above D = 64 the fused kernel's dQ GEMM is a rolled loop over chunks of
    # kDQC = 32 (or 16) of the kDQ = D / (warps / (block_m / 16)) columns of a warp (kDQRolled)
    inner_trips = 1
    if kernel == "bwd_fused" and d > 64:
        dq_cols = d // (warps // (block_m // 16))
        inner_trips = dq_cols // (32 if dq_cols % 32 == 0 else 16)
    # the bool template arguments of each kernel (csrc/fwd_kernel.h, bwd_kernel.h), the
    # soft-capping and sink switches last (false: the kernels without them)
    names = {"fwd": ("ssa", "adaptive", "softcap", "sinks"), "row_entropy": ("ssa", "softcap", "sinks"),
             "bwd_dq": ("ssa", "adaptive", "prep", "softcap", "sinks"),
             "bwd_dkdv": ("ssa", "adaptive", "softcap"), "bwd_fused": ("ssa", "adaptive", "softcap")}[kernel]
    flags = dict(zip(names, bools))
    return {"kernel": kernel, "head_dim": d, "block_m": block_m, "block_n": ints[2], "warps": warps,
            "dtype": dtype, "col_split": tail[0] if tail else 1,
            "ssa": flags.get("ssa"), "adaptive": flags.get("adaptive", False),
            "prep": flags.get("prep", False), "softcap": flags.get("softcap", False),
            "sinks": flags.get("sinks", False), "inner_trips": inner_trips}


#: Symbol describers, tried in order; the first non-None answer is used.
DESCRIBERS: List[Callable[[str], Optional[dict]]] = [describe_ssa_flash]


#: seconds between two "still compiling" lines of a running nvcc (:func:`compile_cu`)
HEARTBEAT_S = 15.0

#: head dims the kernels are compiled for (csrc/dispatch.h); ``-DSSA_FLASH_HEAD_DIM_<D>=0`` leaves one out
HEAD_DIMS = (32, 64, 96, 128, 256)


def scope_flags(head_dims=None, extras: bool = True) -> List[str]:
    """nvcc defines narrowing a build to ``head_dims`` (None: all of :data:`HEAD_DIMS`; others are
    zero-padded to these, so a head dim outside them selects the next one up) and, without
    ``extras``, to the kernels without the soft-capping / sink instances (csrc/dispatch.h's
    ``SSA_FLASH_EXTRAS`` = 0)."""
    flags = []
    if head_dims is not None:
        keep = {next((h for h in HEAD_DIMS if h >= d), HEAD_DIMS[-1]) for d in head_dims}
        flags += [f"-DSSA_FLASH_HEAD_DIM_{d}=0" for d in HEAD_DIMS if d not in keep]
    if not extras:
        flags.append("-DSSA_FLASH_EXTRAS=0")
    return flags


def scope_files(csrc: Path, dtypes=None) -> List[Path]:
    """The ``.cu`` files of ``csrc`` holding kernels of ``dtypes`` (audit names: ``fp16``, ``bf16``;
    None: every file). Files named after no dtype are always kept."""
    files = sorted(Path(csrc).glob("*.cu"))
    if dtypes is None:
        return files
    known = ("fp16", "bf16")
    return [f for f in files if not any(k in f.stem for k in known) or any(d in f.stem for d in dtypes)]


def compile_cu(path: Path, arch: int, out_dir: Path, extra_flags=(), progress=None,
               heartbeat_s: float = HEARTBEAT_S) -> dict:
    """``nvcc -cubin`` one file for ``sm_<arch>`` (``sm_90a`` from 90 on). Returns the cubin path,
    the ptxas log, nvcc's other output and the time. With ``progress``, says every ``heartbeat_s``
    seconds that nvcc is still at it (a backward file takes minutes)."""
    gpu = f"sm_{arch}{'a' if arch >= 90 else ''}"
    cubin = out_dir / f"{path.stem}.{gpu}.cubin"
    cmd = ["nvcc", "-cubin", "-std=c++17", f"-arch={gpu}", "-Xptxas", "-v", *nvcc_flags(), *extra_flags,
           "-I", str(path.parent), str(path), "-o", str(cubin)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        try:
            out, err = proc.communicate(timeout=heartbeat_s if progress else None)
            break
        except subprocess.TimeoutExpired:  # (communicate again loses no output)
            progress(f"  nvcc {path.name} for {gpu}: still compiling, {time.monotonic() - start:.0f} s")
    return {"file": path.name, "cubin": cubin if proc.returncode == 0 else None, "returncode": proc.returncode,
            "log": out + err, "compile_s": round(time.monotonic() - start, 1)}


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
        trips = desc["inner_trips"] if desc else 1
        for lp in sass.main_loops(func, trips):
            c = sass.count_loop(func, lp, trips)
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


@functools.lru_cache(maxsize=None)
def _nvcc_version() -> str:
    try:
        return subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""


_ANALYSER_MODULES = ("cuda.py", "compile.py", "model.py", "resources.py", "sass.py")


def cache_key(path: Path, arch: int, extra_flags=()) -> str:
    """Hash of everything that decides the audit of ``path`` for ``sm_<arch>``: the sources of its
    directory (``*.cu``, ``*.h``), nvcc's version, the flags and the analysing modules."""
    h = hashlib.sha256()
    h.update(json.dumps({"file": path.name, "arch": arch, "flags": nvcc_flags(), "extra": list(extra_flags),
                         "nvcc": _nvcc_version()}, sort_keys=True).encode())
    for src in sorted([*path.parent.glob("*.h"), *path.parent.glob("*.cu")]):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    here = Path(__file__).resolve().parent
    for name in _ANALYSER_MODULES:
        h.update((here / name).read_bytes())
    return h.hexdigest()


def _audit_file(path: Path, arch: int, out_dir: Path, extra_flags=(), progress=None) -> dict:
    c = compile_cu(path, arch, out_dir, extra_flags, progress)
    warnings = resources.parse_ptxas_log(c["log"]).warnings
    compile_row = {"file": c["file"], "returncode": c["returncode"], "compile_s": c["compile_s"],
                   "warnings": warnings, "error": None if c["cubin"] else c["log"][-2000:]}
    kernels = []
    if c["cubin"] is not None:
        for row in analyse_cubin(Path(c["cubin"]).read_bytes(), c["log"], arch):
            row["file"] = path.name
            kernels.append(row)
    return {"compile": compile_row, "kernels": kernels}


def audit(arch: int, csrc: Optional[Path] = None, progress=None, dump_dir: Optional[str] = None,
          files: Optional[List[Path]] = None, jobs: int = 1, use_cache: bool = True,
          extra_flags=()) -> dict:
    """Compile and analyse every ``.cu`` file of ``csrc`` for ``sm_<arch>`` (``jobs`` nvcc
    processes at once; cached unless ``use_cache`` is false or ``dump_dir`` is given). ``csrc``:
    default :func:`source_dir`."""
    csrc = source_dir() if csrc is None else Path(csrc)
    why = unavailable(csrc)
    if why:
        return {"skipped": why}
    from .runner import cache_dir

    files = files or sorted(csrc.glob("*.cu"))
    use_cache = use_cache and not dump_dir
    results: Dict[str, dict] = {}
    todo = []
    for path in files:
        cached = cache_dir() / f"cuda-{cache_key(path, arch, extra_flags)}.json" if use_cache else None
        if cached is not None and cached.is_file():
            try:
                results[path.name] = json.loads(cached.read_text())
                results[path.name]["compile"]["cached"] = True
                continue
            except (OSError, ValueError, KeyError):
                pass
        todo.append((path, cached))
    with tempfile.TemporaryDirectory(prefix="ssa_flash_audit_cu_") as tmp:
        out_dir = Path(dump_dir) if dump_dir else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)  # (nvcc does not create it)

        def one(item):
            path, cached = item
            if progress:
                progress(f"nvcc {path.name} for sm_{arch} ...")
            res = _audit_file(path, arch, out_dir, extra_flags, progress)
            if progress:
                status = "ok" if res["compile"]["returncode"] == 0 else f"exit {res['compile']['returncode']}"
                progress(f"nvcc {path.name} for sm_{arch}: {status}, {res['compile']['compile_s']} s, "
                         f"{len(res['kernels'])} kernels analysed")
            if cached is not None and res["compile"]["returncode"] == 0:
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp_file = cached.with_suffix(f".{os.getpid()}.tmp")
                tmp_file.write_text(json.dumps(res))
                os.replace(tmp_file, cached)
            return path.name, res

        # (the bwd files first: they take longest)
        todo.sort(key=lambda item: not item[0].name.startswith("bwd"))
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            for name, res in pool.map(one, todo):
                results[name] = res
    if progress:
        for p in files:
            if results[p.name]["compile"].get("cached"):
                progress(f"nvcc {p.name} for sm_{arch}: cached")
    compiles = [results[p.name]["compile"] for p in files]
    kernels = [row for p in files for row in results[p.name]["kernels"]]
    return {"nvcc": shutil.which("nvcc"), "flags": nvcc_flags(), "extra_flags": list(extra_flags),
            "compiles": compiles, "kernels": kernels}


def text_report(result: dict, arch: int) -> str:
    """A table of the CUDA section for one architecture."""
    from .report import DISCLAIMER, format_table

    if result.get("skipped"):
        return f"== CUDA C++ kernels, sm_{arch}: skipped ({result['skipped']}) =="
    rows = []
    for k in result["kernels"]:
        d = k["describe"] or {}
        extras = ("+cap" if d.get("softcap") else "") + ("+sink" if d.get("sinks") else "") if d else ""
        name = (f"{d['kernel']}{'(prep)' if d.get('prep') else ''}{extras} ssa={int(bool(d['ssa']))} adapt={int(bool(d['adaptive']))} D={d['head_dim']} "
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
                         ",".join(report._mma_shape(x) for x in lp["mma"]) or "-", f"{lp.get('gemms', '-')}",
                         str(lp["inner_branches"]), f"{b.get('binding', '-')} {b.get('tflops', 0):.0f}" if b else "-"])
    errors = [c for c in result["compiles"] if c["error"]]
    head = ("kernel", "regs", "spill", "loop", "instr/el", "mufu/el", "MMA", "gemms", "branches", "bound TF/s")
    out = [f"== CUDA C++ kernels, sm_{arch} ==  {DISCLAIMER}", format_table(rows, head)]
    out += [f"nvcc {c['file']} failed (exit {c['returncode']})" for c in errors]
    return "\n".join(out)


def interior(row: dict) -> Optional[dict]:
    """The interior (or only) main loop of a kernel row, or None."""
    loops = [lp for lp in row.get("loops", []) if lp.get("per_element")]
    if not loops:
        return None
    return min(loops, key=lambda lp: lp["per_element"]["total"])


#: The op (as the Triton audit names it) of a CUDA C++ kernel by its ``(ssa, adaptive)`` flags
#: (:func:`describe_ssa_flash`): the variants the CUDA C++ kernels are audited for, a subset of
#: ``specs.OPS`` until their symbols name the other score functions.
_CUDA_OPS = {(False, False): "softmax", (True, False): "ssa", (False, True): "adaptive",
             (True, True): "ssa_adaptive"}
OPS = tuple(_CUDA_OPS.values())


def kernel_rows(result: dict) -> Dict[tuple, dict]:
    """The kernels of an :func:`audit` result by ``(kernel, op, head_dim, dtype)`` (``op`` as the
    Triton audit names it: softmax, ssa, adaptive, ssa_adaptive); the fused backward's pre-pass is
    ``bwd_prep``. Specialisations the launcher never runs on sm_80+ (the sm_75 dK/dV split) are
    left out, as are the soft-capping and sink instances (the tables compare the kernels without
    them; their spills are still in ``result["kernels"]``)."""
    out: Dict[tuple, dict] = {}
    for row in result.get("kernels", []):
        d = row.get("describe")
        if not d:
            continue
        if d["kernel"] == "bwd_dkdv" and d["col_split"] != (1 if d["head_dim"] <= 128 else 2):
            continue  # DkdvTraitsSm75
        if d.get("softcap") or d.get("sinks"):
            continue
        op = _CUDA_OPS[(bool(d["ssa"]), bool(d["adaptive"]))]
        kernel = "bwd_prep" if d.get("prep") else d["kernel"]
        out[(kernel, op, d["head_dim"], d["dtype"])] = row
    return out


def versus_triton(result: dict, triton_results: List[dict], arch: int, dims=(64, 128), dtypes=("bf16",),
                  ops=("softmax", "ssa")) -> List[dict]:
    """CUDA kernels against the Triton kernels of the same variant (non-causal, no mask: the CUDA
    kernels' interior loop is the same code for every mask and causality), per score element of
    the interior loop. The fused backward (one kernel for dQ, dK and dV) is compared with the sum
    of Triton's dQ and dK/dV kernels. ``ratio`` = CUDA / Triton."""
    from .report import chosen_config, gated_loop

    triton = {}
    for r in triton_results:
        v = r["variant"]
        if v["arch"] == arch and not v["causal"] and v["mask"] == "none" and v.get("group", 1) == 1:
            g = gated_loop(chosen_config(r))
            if g is not None:
                triton[(v["kernel"], v["op"], v["head_dim"], v["dtype"])] = g["per_element"]["total"]
    rows = kernel_rows(result)
    out = []
    for dtype in dtypes:
        for d in dims:
            for op in ops:
                for kernel in ("fwd", "bwd_dq", "bwd_dkdv", "bwd_fused"):
                    row = rows.get((kernel, op, d, dtype))
                    if row is None:
                        continue
                    lp = interior(row)
                    if kernel == "bwd_fused":
                        parts = [triton.get(("bwd_dq", op, d, dtype)), triton.get(("bwd_dkdv", op, d, dtype))]
                        tri = None if None in parts else round(sum(parts), 4)
                    else:
                        tri = triton.get((kernel, op, d, dtype))
                    cu = lp["per_element"]["total"] if lp else None
                    out.append({"kernel": kernel, "op": op, "head_dim": d, "dtype": dtype, "arch": arch,
                                "cuda": cu, "triton": tri, "ratio": round(cu / tri, 3) if cu and tri else None,
                                "mufu": lp["per_element"].get("mufu") if lp else None,
                                "gemms": lp.get("gemms") if lp else None, "registers": row["registers"],
                                "spills": row["spills"]})
    return out
