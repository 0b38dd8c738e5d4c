"""Registers, local memory (spills), shared memory and compiler warnings of compiled kernels, read
from ``cuobjdump -res-usage`` and from the ``ptxas -v`` log."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

_RES_FUNC_RE = re.compile(r"^\s*Function\s+(\S+?):?\s*$")
_RES_FIELD_RE = re.compile(r"([A-Z_]+(?:\[\d+\])?):(\d+)")
_PTXAS_FUNC_RE = re.compile(r"(?:Compiling entry function|Function properties for)\s+'?([^'\s]+)'?")
_PTXAS_SPILL_RE = re.compile(r"(\d+)\s+bytes stack frame,\s*(\d+)\s+bytes spill stores,\s*(\d+)\s+bytes spill loads")
_PTXAS_REGS_RE = re.compile(r"Used\s+(\d+)\s+registers")
_WARNING_RE = re.compile(r"warning\s*:?\s*(?:\((C\d+)\))?\s*(.*)", re.IGNORECASE)
_CODED_RE = re.compile(r"\((C\d{3,5})\)\s*(.*)")

#: ptxas warning codes the audit treats as performance problems of the tensor-core code.
SERIALISATION_CODES = ("C7515",)


@dataclass
class ResUsage:
    """``cuobjdump -res-usage`` figures of one function."""

    registers: int
    local_bytes: int  # per thread: spills and local arrays
    stack_bytes: int
    static_shared_bytes: int


def parse_res_usage(text: str) -> Dict[str, ResUsage]:
    """``{function: ResUsage}`` from ``cuobjdump -res-usage`` output."""
    out: Dict[str, ResUsage] = {}
    name = None
    for line in text.splitlines():
        m = _RES_FUNC_RE.match(line)
        if m:
            name = m.group(1)
            continue
        if name is not None and "REG:" in line:
            f = dict((k, int(v)) for k, v in _RES_FIELD_RE.findall(line))
            out[name] = ResUsage(f.get("REG", 0), f.get("LOCAL", 0), f.get("STACK", 0), f.get("SHARED", 0))
            name = None
    return out


@dataclass
class PtxasFunction:
    """What ``ptxas -v`` said about one function."""

    registers: Optional[int] = None
    stack_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0


@dataclass
class PtxasLog:
    """A parsed ``ptxas -v`` log: per-function figures and every diagnostic: lines saying
    ``warning``, and lines carrying a message code such as ``(C7515)`` (ptxas prints its
    performance diagnostics, e.g. serialised wgmma, as ``info`` lines with a code)."""

    functions: Dict[str, PtxasFunction] = field(default_factory=dict)
    warnings: List[Dict[str, str]] = field(default_factory=list)  # {"code", "message"}

    def serialisation_warnings(self) -> List[Dict[str, str]]:
        """Warnings saying tensor-core instructions were serialised (e.g. C7515 for wgmma)."""
        return [w for w in self.warnings if w["code"] in SERIALISATION_CODES]


def parse_ptxas_log(text: str) -> PtxasLog:
    """Parse ``ptxas -v`` output (stderr), which may hold several functions and warnings."""
    log = PtxasLog()
    cur: Optional[PtxasFunction] = None
    seen = set()
    for line in text.splitlines():
        m = _PTXAS_FUNC_RE.search(line)
        if m:
            cur = log.functions.setdefault(m.group(1), PtxasFunction())
        m = _PTXAS_SPILL_RE.search(line)
        if m and cur is not None:
            cur.stack_bytes, cur.spill_store_bytes, cur.spill_load_bytes = (int(g) for g in m.groups())
        m = _PTXAS_REGS_RE.search(line)
        if m and cur is not None:
            cur.registers = int(m.group(1))
        cm = _CODED_RE.search(line)
        if cm or "warning" in line.lower():
            if cm:
                code, msg = cm.group(1), cm.group(2).strip()
            else:
                wm = _WARNING_RE.search(line)
                code = (wm.group(1) or "") if wm else ""
                msg = (wm.group(2) if wm else line).strip()
            if (code, msg) not in seen:
                seen.add((code, msg))
                log.warnings.append({"code": code, "message": msg})
    return log
