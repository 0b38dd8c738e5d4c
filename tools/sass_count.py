"""Static audit of the CUDA kernels (docs/design.md §4.3): per kernel, registers / spills / shared
memory from ptxas, and the SASS instructions of the main loop per score element.

The counting logic is one self-contained function, :func:`count_loop`, which takes the SASS text
of one kernel (``cuobjdump -sass`` or ``nvdisasm`` output) and a :class:`LoopSpec`, and returns a
plain dict; everything else here (compiling, splitting a cubin's SASS into kernels, the command
line) only feeds it.

How a loop is found: every backward branch (``BRA`` to a lower address) closes a loop that spans
[target, branch]. Of the innermost loops that contain tensor-core instructions (``HMMA``), ranked
by their number (most first) and then by size (smallest first: the kernels run interior key
blocks, which need no masking, in a loop of their own next to the checked one),
``LoopSpec.rank`` picks one (0 = the main loop, 1 = the next, typically the checked loop). Instructions
between the branch target and the branch are counted once (a static count: code inside an ``if``
in the loop body counts as if it ran every iteration; the kernels keep such code to loads).

Output of :func:`count_loop` (all counts are static SASS instructions in the loop body, per
thread and iteration, unless they say per element):

    {"loop": [start, end],             # byte offsets of the loop in the kernel
     "instructions": int,              # all instructions but NOP
     "per_element": float,             # instructions * threads / (block_m * block_n)
     "mufu": {"EX2": int, "LG2": int, "RCP": int, ...},
     "mufu_per_element": float,
     "mma": int,                       # HMMA instructions (one per m16n8k16 / m16n8k8 on
                                       #  sm_75+, several per m8n8k4 on sm_70)
     "ldmatrix": int,                  # LDSM
     "ldmatrix_per_mma": float,
     "lds": int, "sts": int, "ldg": int, "ldgsts": int,   # other memory instructions
     "classes": {"fp32": int, "int": int, "control": int, "convert": int, "shuffle": int,
                 "tensor": int, "memory": int, "other": int},
     "per_element_by_class": {...},    # the same per element
     "opcodes": {"FFMA": int, ...}}    # every opcode, for anything the classes hide

Command line (compiles with the nvcc on PATH, disassembles with cuobjdump):

    python tools/sass_count.py --arch 80 --head-dim 128 --dtype fp16 [--json out.json]

prints one row per kernel: registers, spills, then the main loop's counts per score element.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# ------------------------------------------------------------------------------------------
# The counting function


@dataclass
class LoopSpec:
    """What one iteration of a kernel's main loop covers: a block_m x block_n tile of scores
    (for the dK/dV kernel: keys x queries), computed by `threads` threads."""
    block_m: int
    block_n: int
    threads: int
    rank: int = 0  # 0: the loop with the most HMMA instructions, 1: the next, ...


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_CLASS_PREFIXES = [
    ("tensor", ("HMMA", "IMMA", "DMMA", "HGMMA")),
    ("memory", ("LDSM", "LDS", "STS", "LDG", "STG", "LDGSTS", "LDL", "STL", "LD", "ST", "ATOM",
                "RED", "LDC", "LDGDEPBAR", "DEPBAR")),
    ("fp32", ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "FSET", "FSWZADD",
              "MUFU", "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2")),
    ("convert", ("F2F", "F2FP", "F2I", "I2F", "I2FP", "F2IP", "FRND")),
    ("shuffle", ("SHFL",)),
    ("control", ("BRA", "BRX", "BSSY", "BSYNC", "BAR", "EXIT", "RET", "CALL", "WARPSYNC",
                 "BMOV", "JMP", "SYNC", "YIELD", "NANOSLEEP", "BPT", "KILL")),
    ("int", ("IMAD", "IADD3", "IADD", "LOP3", "LOP", "ISETP", "SHF", "LEA", "IABS", "IMNMX",
             "SEL", "PRMT", "MOV", "P2R", "R2P", "PLOP3", "VIADD", "IMUL", "ISCADD", "SHL",
             "SHR", "BFE", "BFI", "POPC", "FLO", "BREV", "CS2R", "S2R", "S2UR", "ULDC", "UMOV",
             "UIADD3", "UIMAD", "ULEA", "ULOP3", "USHF", "UISETP", "USEL", "R2UR", "VOTE",
             "VOTEU", "UPRMT", "IDP", "IMNMX", "VIMNMX", "IMUL", "XMAD")),
]


def _opcode(text: str) -> str:
    """The opcode of one SASS instruction (predicate guard and modifiers stripped)."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def _klass(op: str) -> str:
    base = op.split(".")[0]
    for name, prefixes in _CLASS_PREFIXES:
        if base in prefixes:
            return name
    return "other"


def parse_instructions(sass: str) -> List[Tuple[int, str]]:
    """(byte offset, instruction text) of every instruction of one kernel's SASS."""
    return [(int(m.group(1), 16), m.group(2)) for m in _INSTR.finditer(sass)]


def find_loops(instrs: List[Tuple[int, str]]) -> List[Tuple[int, int]]:
    """(start, end) byte offsets of every backward branch's loop."""
    loops = []
    for addr, text in instrs:
        if _opcode(text).split(".")[0] != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        if m and int(m.group(1), 16) <= addr:
            loops.append((int(m.group(1), 16), addr))
    return loops


def count_loop(sass: str, spec: LoopSpec) -> Optional[dict]:
    """Counts of the chosen loop of one kernel's SASS text (format in the module docstring), or
    None when the kernel has no loop with tensor-core instructions."""
    instrs = parse_instructions(sass)
    loops = []
    for start, end in find_loops(instrs):
        body = [t for a, t in instrs if start <= a <= end]
        mma = sum(1 for t in body if _opcode(t).startswith("HMMA"))
        if mma:
            loops.append((start, end, mma, body))
    # innermost loops only: a loop around two tensor-core loops (say, over heads) is not a main loop
    inner = [lp for lp in loops
             if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] and (o[0], o[1]) != (lp[0], lp[1])
                        for o in loops)]
    ranked = [(mma, -(end - start), start, end, body) for start, end, mma, body in inner]
    if len(ranked) <= spec.rank:
        return None
    ranked.sort(reverse=True)
    _, _, start, end, body = ranked[spec.rank]
    ops = Counter(_opcode(t) for t in body if _opcode(t) != "NOP")
    base = Counter()
    for op, c in ops.items():
        base[op.split(".")[0]] += c
    classes = Counter()
    for op, c in ops.items():
        classes[_klass(op)] += c
    mufu = Counter()
    for op, c in ops.items():
        if op.startswith("MUFU."):
            mufu[op.split(".")[1]] += c
    total = sum(ops.values())
    per = spec.threads / float(spec.block_m * spec.block_n)
    mma = base["HMMA"]
    return {
        "loop": [start, end],
        "instructions": total,
        "per_element": round(total * per, 3),
        "mufu": dict(sorted(mufu.items())),
        "mufu_per_element": round(sum(mufu.values()) * per, 3),
        "mma": mma,
        "ldmatrix": base["LDSM"],
        "ldmatrix_per_mma": round(base["LDSM"] / mma, 3) if mma else None,
        "lds": base["LDS"], "sts": base["STS"], "ldg": base["LDG"], "ldgsts": base["LDGSTS"],
        "classes": {k: classes.get(k, 0) for k in
                    ("fp32", "int", "control", "convert", "shuffle", "tensor", "memory", "other")},
        "per_element_by_class": {k: round(classes.get(k, 0) * per, 3) for k in
                                 ("fp32", "int", "control", "convert", "shuffle", "tensor", "memory", "other")},
        "opcodes": dict(sorted(ops.items())),
    }


# ------------------------------------------------------------------------------------------
# Feeding it: compile, split the SASS per kernel, read ptxas's resource report


def split_kernels(sass_dump: str) -> Dict[str, str]:
    """cuobjdump -sass output -> {mangled kernel name: its SASS text}."""
    out: Dict[str, str] = {}
    parts = re.split(r"\n\s*Function : (\S+)\n", "\n" + sass_dump)
    for i in range(1, len(parts) - 1, 2):
        out[parts[i]] = parts[i + 1]
    return out


_PTXAS_FN = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_resources(log: str) -> Dict[str, dict]:
    """ptxas -v output -> {mangled kernel name: {registers, stack, spill_stores, spill_loads}}."""
    res: Dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            cur = res.setdefault(m.group(1), {"arch": m.group(2)})
            continue
        if cur is None:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_REGS.search(line)
        if m:
            cur["registers"] = int(m.group(1))
    return res


def tool(name: str) -> Optional[str]:
    """A CUDA binary from PATH, else from the nvidia-* PyPI wheels (nvidia-cuda-cuobjdump)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(root).glob(f"*/bin/{name}")):
            return str(cand)
    return None


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return dict(zip(names, out))


def compile_cubin(cu: Path, arch: str, out: Path, head_dims=(128,), extra=()) -> str:
    """nvcc -cubin of one csrc/*.cu for one architecture; returns ptxas's -v report."""
    defs = [f"-DSSA_FLASH_HEAD_DIM_{d}={int(d in head_dims)}" for d in (32, 64, 96, 128, 256)]
    cmd = ["nvcc", "-cubin", f"-arch=sm_{arch}", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
           "-Xptxas", "-v", "-I", str(CSRC), *defs, *extra, str(cu), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.stdout + proc.stderr


def _score_name(policy: str) -> str:
    """csrc/logits.h's policy type -> the registry's name (ssa_flash/scores.py), by the naming
    rule the policies follow: ``LogitScale`` -> ``logit_scale``, ``Ssa`` -> ``ssa``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", policy).lower()


def kernel_spec(demangled: str) -> Optional[Tuple[str, LoopSpec]]:
    """(short name, LoopSpec) of one of our kernels from its demangled name, reading the tile
    sizes from the KernelTraits template arguments <D, BM, BN, warps, T, ...>."""
    m = re.search(r"ssa_flash::(attn_\w+)<ssa_flash::KernelTraits<(\d+), (\d+), (\d+), (\d+), (\w+), (\d+)", demangled)
    if not m:
        return None
    kern, d, bm, bn, warps, elem = m.group(1), *map(int, m.group(2, 3, 4, 5)), m.group(6)
    split = int(m.group(7))
    rest = demangled.split(">", 1)[1]
    # the score function's policy type (csrc/logits.h), then the bool switches
    sm = re.match(r"\s*,\s*ssa_flash::(\w+)", rest)
    score = _score_name(sm.group(1)) if sm else "?"
    flags = re.findall(r"(true|false)", rest)
    variant = kern
    if kern in ("attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_fused_kernel") and flags:
        variant += f"[{score}" + (",adaptive]" if flags[0] == "true" else "]")
    elif kern == "attn_row_entropy_kernel":
        variant += f"[{score}]"
    variant += f" D={d} {'fp16' if 'half' in elem else 'bf16'}"
    if kern == "attn_bwd_dkdv_kernel" and split > 1 and d <= 128:
        variant += " (sm_75 split)"
    return variant, LoopSpec(block_m=bm, block_n=bn, threads=32 * warps)


def audit(arch: str, head_dims=(128,), dtype="fp16", files=("fwd", "bwd"), csrc: Path = CSRC) -> List[dict]:
    """Compiles csrc/{fwd,bwd}_<dtype>.cu for sm_<arch>, returns one row per kernel."""
    cuobjdump = tool("cuobjdump")
    if cuobjdump is None:
        raise RuntimeError("cuobjdump not found (PATH, or pip install nvidia-cuda-cuobjdump)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            cu = csrc / f"{f}_{dtype}.cu"
            cubin = Path(tmp) / f"{f}.cubin"
            log = compile_cubin(cu, arch, cubin, head_dims)
            res = ptxas_resources(log)
            env = dict(os.environ)
            env["PATH"] = os.pathsep.join([str(Path(cuobjdump).parent), env.get("PATH", "")])
            dump = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                                  check=True, env=env).stdout
            kernels = split_kernels(dump)
            names = demangle(list(kernels))
            for mangled, sass in kernels.items():
                ks = kernel_spec(names[mangled])
                if ks is None:
                    continue
                variant, spec = ks
                row = {"kernel": variant, "arch": f"sm_{arch}", "block_m": spec.block_m,
                       "block_n": spec.block_n, "threads": spec.threads, **res.get(mangled, {})}
                row["main_loop"] = count_loop(sass, spec)
                rows.append(row)
    rows.sort(key=lambda r: r["kernel"])
    return rows


def format_rows(rows: List[dict]) -> str:
    head = f"{'kernel':52s} {'regs':>4s} {'spill':>5s} {'tile':>9s} {'instr/el':>8s} {'MUFU/el':>7s} {'MUFU kinds':24s} {'LDSM/mma':>8s}"
    lines = [head]
    for r in rows:
        lp = r["main_loop"] or {}
        mufu = ",".join(f"{k}:{v}" for k, v in (lp.get("mufu") or {}).items())
        lines.append(f"{r['kernel']:52s} {r.get('registers', 0):4d} {r.get('spill_stores', 0):5d} "
                     f"{r['block_m']:>4d}x{r['block_n']:<4d} {lp.get('per_element', float('nan')):8.2f} "
                     f"{lp.get('mufu_per_element', float('nan')):7.3f} {mufu:24s} "
                     f"{(lp.get('ldmatrix_per_mma') or 0):8.3f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="80")
    ap.add_argument("--head-dim", type=int, action="append", dest="head_dims")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--files", default="fwd,bwd")
    ap.add_argument("--csrc", default=str(CSRC))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = audit(args.arch, tuple(args.head_dims or (128,)), args.dtype, tuple(args.files.split(",")),
                 Path(args.csrc))
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
