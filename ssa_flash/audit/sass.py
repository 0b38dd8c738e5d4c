"""Reading SASS (as printed by ``nvdisasm -c -g``): instructions, loops, instruction mix.

Pure text processing, no compiler needed, so that the analysis can be tested on synthetic snippets.

A *loop* is the code between a label and a later branch back to it: that range (head to the
backward branch, both included) is what repeats, whatever prologue or epilogue software
pipelining peeled off around it. Several branches back to one label form one loop. The *main
loops* of a kernel are the innermost loops holding tensor-core (MMA) instructions: a loop that
merely encloses another MMA loop (the GQA-group loop around the query loop of the dK/dV kernel)
is not one, while a small loop without MMA inside a main loop (a barrier spin-wait) does not stop
its enclosing loop from being one.

Counts are *static*: every instruction of the body once, whether or not a branch inside the body
skips it (the number of such branches is reported with each loop).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# Mnemonic (the part before the first dot) -> category. Anything else is "other".
_CATEGORIES = {
    "tensor": {
        "HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "BMMA", "BGMMA", "DMMA", "OMMA", "QMMA",
        "UTCHMMA", "UTCQMMA", "UTCIMMA", "UTCOMMA", "UTCMMA",
    },
    "mufu": {"MUFU"},
    "fp32": {
        "FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD", "FCMP",
        "FADD2", "FMUL2", "FFMA2", "FMNMX2", "FADD32I", "FMUL32I", "FFMA32I",
    },
    "fp16": {"HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2", "HSET2", "HADD2_32I", "HMUL2_32I", "HFMA2_32I"},
    "fp64": {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DSET"},
    "conversion": {"F2F", "F2I", "I2F", "I2FP", "F2FP", "F2IP", "FRND", "I2I", "I2IP", "F2F64"},
    "integer": {
        "IADD3", "IADD", "IADD32I", "IMAD", "IMAD32I", "IMUL", "IMUL32I", "ISETP", "ISCADD", "LEA", "LOP3", "LOP",
        "LOP32I", "SHF", "SHL", "SHR", "SEL", "IMNMX", "IABS", "POPC", "FLO", "BREV", "BMSK", "SGXT",
        "PRMT", "VIADD", "VIADDMNMX", "VIMNMX", "VIMNMX3", "IDP", "BFE", "BFI", "ICMP", "PLOP3", "P2R",
        "R2P", "IMNMX3", "IADD2", "ISETP2",
        "UIADD3", "UIMAD", "ULEA", "ULOP3", "ULOP", "ULOP32I", "USHF", "USHL", "USHR", "USEL", "UISETP",
        "USGXT", "UPRMT", "UFLO", "UPOPC", "UBMSK", "UPLOP3", "UBREV", "UIABS", "UIMNMX", "UP2UR",
        "UR2UP", "UVIADD", "UVIMNMX",
    },
    "memory": {
        "LD", "LDG", "LDS", "LDSM", "LDL", "LDC", "ULDC", "LDGSTS", "LDGDEPBAR", "ST", "STG", "STS",
        "STL", "STSM", "ATOM", "ATOMS", "ATOMG", "RED", "REDG", "REDAS", "UTMALDG", "UTMASTG",
        "UTMAREDG", "UTMAPF", "UBLKCP", "UBLKRED", "UBLKPF", "CCTL", "CCTLL", "LDTM", "STTM", "SUST",
        "SULD", "TEX", "TLD", "LDCU", "ULDCU",
    },
    "move": {"MOV", "MOV32I", "UMOV", "IMOV", "CS2R", "S2R", "S2UR", "R2UR", "SHFL", "VOTE", "VOTEU", "REDUX",
             "CREDUX", "MATCH", "UCS2R"},
    "control": {
        "BRA", "BRX", "BRXU", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "WARPSYNC",
        "BAR", "NOP", "YIELD", "DEPBAR", "MEMBAR", "FENCE", "WARPGROUP", "SYNCS", "ERRBAR",
        "CGAERRBAR", "ELECT", "ACQBULK", "ARRIVES", "KILL", "NANOSLEEP", "BPT", "PMTRIG", "B2R", "R2B",
        "UCGABAR_ARV", "UCGABAR_WAIT", "ACQSHMINIT", "WARPSYNC", "BMOV", "UTCBAR", "USETMAXREG",
        "SETMAXREG", "ENDCOLLECTIVE", "LEPC", "ULEPC",
    },
}
_CATEGORY_OF = {mn: cat for cat, mns in _CATEGORIES.items() for mn in mns}
CATEGORIES = ("tensor", "mufu", "fp32", "fp16", "fp64", "conversion", "integer", "memory", "move", "control", "other")

_INSTR_RE = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;?\s*(?:/\*.*\*/)?\s*$")
_LABEL_RE = re.compile(r"^\s*([.$\w]+):\s*$")
_LINE_RE = re.compile(r'//##\s*File\s+"([^"]*)",\s*line\s+(\d+)')
_FUNC_RE = re.compile(r"^\s*(?://-+\s*)?\.section\s+\.text\.([^\s,]+)|^//-+\s*\.text\.(\S+)\s*-+")
_PRED_RE = re.compile(r"^@!?U?P(?:T|\d+)\s+")
_TARGET_RE = re.compile(r"`\(?\s*([.$\w]+)\s*\)?")
_HMMA_SHAPE_RE = re.compile(r"^(?:HMMA|IMMA|BMMA|DMMA)\.(\d+)")
_GMMA_SHAPE_RE = re.compile(r"^[A-Z]*GMMA\.(\d+)x(\d+)x(\d+)")

# mma.sync shapes as SASS spells them (m, n, k)
_SYNC_SHAPES = {"16816": (16, 8, 16), "1688": (16, 8, 8), "16832": (16, 8, 32), "884": (8, 8, 4),
                "16864": (16, 8, 64), "1684": (16, 8, 4), "8816": (8, 8, 16), "8832": (8, 8, 32),
                "88128": (8, 8, 128), "168128": (16, 8, 128), "168256": (16, 8, 256)}


@dataclass
class Instr:
    """One SASS instruction."""

    index: int
    offset: int
    text: str  # without predicate and ';'
    opcode: str  # mnemonic with modifiers, e.g. "MUFU.EX2"
    mnemonic: str  # e.g. "MUFU"
    predicate: str  # "" or e.g. "@!P0"
    line: Optional[Tuple[str, int]] = None  # source (file, line) from nvdisasm -g
    target: Optional[str] = None  # branch / call target label

    @property
    def category(self) -> str:
        return category(self.mnemonic)


def category(mnemonic: str) -> str:
    """Category of an instruction mnemonic (see ``CATEGORIES``)."""
    return _CATEGORY_OF.get(mnemonic, "other")


@dataclass
class Function:
    """The instructions and label positions of one kernel (or device function) in a cubin."""

    name: str
    instrs: List[Instr] = field(default_factory=list)
    labels: Dict[str, int] = field(default_factory=dict)  # label -> index of the next instruction


def _new_function(funcs: List[Function], name: str) -> Function:
    funcs.append(Function(name))
    return funcs[-1]


def parse(text: str) -> List[Function]:
    """Split ``nvdisasm -c [-g]`` (or ``cuobjdump -sass``) output into functions."""
    funcs: List[Function] = []
    cur: Optional[Function] = None
    line: Optional[Tuple[str, int]] = None
    for raw in text.splitlines():
        m = _FUNC_RE.match(raw)
        if m:
            name = m.group(1) or m.group(2)
            if cur is None or cur.name != name:
                cur = _new_function(funcs, name)
            line = None
            continue
        m = _LINE_RE.search(raw)
        if m:
            line = (m.group(1), int(m.group(2)))
            continue
        m = _INSTR_RE.match(raw)
        if m:
            cur = cur or _new_function(funcs, "<anonymous>")
            body = m.group(2).strip().rstrip(";").strip()
            pm = _PRED_RE.match(body)
            pred = pm.group(0).strip() if pm else ""
            body = body[pm.end():] if pm else body
            opcode = body.split()[0] if body else ""
            mnemonic = opcode.split(".")[0]
            target = None
            if mnemonic in ("BRA", "CALL", "JMP", "BSSY", "BREAK", "SSY", "PBK"):
                tm = _TARGET_RE.search(body)
                target = tm.group(1) if tm else None
            cur.instrs.append(Instr(len(cur.instrs), int(m.group(1), 16), body, opcode, mnemonic, pred, line, target))
            continue
        m = _LABEL_RE.match(raw)
        if m:
            cur = cur or _new_function(funcs, "<anonymous>")
            cur.labels[m.group(1)] = len(cur.instrs)
    return funcs


def mma_macs(ins: Instr) -> Tuple[int, int]:
    """``(multiply-adds, warps that execute it together)`` of a tensor instruction, or ``(0, 1)``.

    An ``HMMA`` (``mma.sync``) is one warp's ``m*n*k``; an ``HGMMA`` (``wgmma``) is a warpgroup's
    (4 warps) ``M*N*K``, every warp of the group issuing the same instruction.
    """
    m = _GMMA_SHAPE_RE.match(ins.opcode)
    if m:
        a, b, c = (int(g) for g in m.groups())
        return a * b * c, 4
    m = _HMMA_SHAPE_RE.match(ins.opcode)
    if m:
        shape = _SYNC_SHAPES.get(m.group(1))
        if shape is None:
            raise ValueError(f"unknown mma.sync shape in {ins.opcode!r}")
        return shape[0] * shape[1] * shape[2], 1
    return 0, 1


def mma_kind(ins: Instr) -> str:
    """Shape and types of a tensor instruction, e.g. ``HGMMA.64x64x16.F32.BF16``, without the
    operand modifiers."""
    return ".".join(p for p in ins.opcode.split(".") if p not in ("SP",))


@dataclass
class Loop:
    """A loop of a function: instructions ``head..tail`` (inclusive) repeat."""

    head: int
    tail: int
    depth: int = 0  # number of enclosing loops
    children: List["Loop"] = field(default_factory=list)

    def contains(self, other: "Loop") -> bool:
        inside = self.head <= other.head and other.tail <= self.tail
        return inside and (self.head, self.tail) != (other.head, other.tail)


def find_loops(func: Function) -> List[Loop]:
    """Every loop of ``func`` (a backward ``BRA`` and its target), outermost first in code order."""
    tails: Dict[int, int] = {}
    for ins in func.instrs:
        if ins.mnemonic == "BRA" and ins.target in func.labels:
            head = func.labels[ins.target]
            if head <= ins.index:
                tails[head] = max(tails.get(head, -1), ins.index)
    loops = sorted((Loop(h, t) for h, t in tails.items()), key=lambda lp: (lp.head, -lp.tail))
    for lp in loops:
        parents = [o for o in loops if o.contains(lp)]
        lp.depth = len(parents)
        if parents:
            min(parents, key=lambda o: o.tail - o.head).children.append(lp)
    return loops


def _has_mma(func: Function, lp: Loop) -> bool:
    return any(func.instrs[i].category == "tensor" for i in range(lp.head, lp.tail + 1))


def main_loops(func: Function, inner_trips: int = 1) -> List[Loop]:
    """Innermost loops holding tensor instructions, in code order.

    ``inner_trips > 1``: the caller knows that each main loop of the kernel holds one inner loop
    of that constant trip count (a loop kept rolled in the source, say over column chunks of a
    GEMM): where such inner loops are found, the loops directly around them are the main loops
    (to be counted with ``count_loop(..., inner_trips)``), not the inner loops themselves."""
    loops = find_loops(func)
    with_mma = [lp for lp in loops if _has_mma(func, lp)]
    innermost = [lp for lp in with_mma if not any(lp.contains(o) for o in with_mma)]
    if inner_trips <= 1:
        return innermost
    # loops whose tensor-holding loops inside are all innermost ones, and the innermost loops no
    # such loop contains
    outer = [lp for lp in with_mma if lp not in innermost and
             all(o in innermost for o in with_mma if lp.contains(o))]
    return sorted(outer + [lp for lp in innermost if not any(o.contains(lp) for o in outer)],
                  key=lambda lp: lp.head)


@dataclass
class LoopCounts:
    """Static counts of one loop body (per warp, i.e. per thread, per iteration)."""

    head: int
    tail: int
    offset: int  # byte offset of the head
    instructions: int
    by_category: Dict[str, int]
    by_opcode: Dict[str, int]  # mnemonic -> count
    mufu: Dict[str, int]  # "EX2", "LG2", "RCP", ...
    mma: Dict[str, int]  # kind -> count
    macs_per_warp: int  # sum over MMA of m*n*k / (warps executing it together)
    uniform: int  # uniform-datapath instructions (U*), included in the categories
    local_memory: int  # LDL / STL in the body (spill traffic inside the loop)
    inner_branches: int  # conditional forward branches that stay inside the body
    calls: int  # CALL instructions (e.g. slow paths of a division)
    nested_loops: int  # loops inside this one (spin-waits)
    lines: Dict[str, Tuple[int, int]]  # source file -> (first line, last line) seen in the body
    branch_line: Optional[Tuple[str, int]]  # source line of the backward branch
    line_set: frozenset = frozenset()  # every (file name, line) seen in the body


def count_loop(func: Function, lp: Loop, inner_trips: int = 1) -> LoopCounts:
    """Instruction mix of the body of ``lp``; instructions of tensor-holding loops inside it count
    ``inner_trips`` times (see :func:`main_loops`)."""
    body = func.instrs[lp.head:lp.tail + 1]
    weight = [1] * len(body)
    if inner_trips > 1:
        for o in find_loops(func):
            if lp.contains(o) and _has_mma(func, o):
                for i in range(o.head, o.tail + 1):
                    weight[i - lp.head] = inner_trips
    by_cat: Counter = Counter()
    by_op: Counter = Counter()
    mufu: Counter = Counter()
    mma: Counter = Counter()
    macs = 0.0
    uniform = local = inner = calls = 0
    lines: Dict[str, List[int]] = {}
    for ins, w in zip(body, weight):
        cat = ins.category
        by_cat[cat] += w
        by_op[ins.mnemonic] += w
        if cat == "mufu":
            kind = ins.opcode.split(".")[1] if "." in ins.opcode else "?"
            mufu[kind] += w
        elif cat == "tensor":
            mma[mma_kind(ins)] += w
            m, group = mma_macs(ins)
            macs += w * m / group
        if ins.mnemonic.startswith("U") and cat in ("integer", "move", "memory"):
            uniform += w
        if ins.mnemonic in ("LDL", "STL"):
            local += w
        if ins.mnemonic == "CALL":
            calls += w
        if ins.mnemonic == "BRA" and ins.index != lp.tail and ins.target in func.labels:
            tgt = func.labels[ins.target]
            if ins.index < tgt <= lp.tail + 1:
                inner += 1
        if ins.line is not None:
            lines.setdefault(ins.line[0], []).append(ins.line[1])
    nested = sum(1 for o in find_loops(func) if lp.contains(o))
    return LoopCounts(
        head=lp.head, tail=lp.tail, offset=body[0].offset if body else 0, instructions=sum(weight),
        by_category={c: by_cat.get(c, 0) for c in CATEGORIES}, by_opcode=dict(by_op.most_common()),
        mufu=dict(mufu.most_common()), mma=dict(mma.most_common()), macs_per_warp=int(round(macs)),
        uniform=uniform, local_memory=local, inner_branches=inner, calls=calls, nested_loops=nested,
        lines={f: (min(v), max(v)) for f, v in lines.items()},
        branch_line=func.instrs[lp.tail].line,
        line_set=frozenset((f.rsplit("/", 1)[-1], ln) for f, v in lines.items() for ln in v),
    )
