"""The matmuls a Triton kernel's source asks for, read from its Triton IR (``ttir``).

Each ``tt.dot`` of shape ``(M, K) x (K, N)`` is ``M*N*K`` multiply-adds. Dots are attributed to
the innermost ``scf.for`` around them (through ``scf.if`` and other regions); the innermost loops
holding dots correspond, in order, to the main loops found in the SASS. This is the reference the
tensor work of the compiled loop is compared with: a compiled loop doing more multiply-adds per
iteration than its source repeats work (e.g. two warpgroups computing the same rows).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

_DOT_RE = re.compile(r"\btt\.dot\b.*?:\s*tensor<(\d+)x(\d+)x(\w+)[^>]*>\s*\*\s*tensor<(\d+)x(\d+)x\w+[^>]*>")
_LOC_RE = re.compile(r'loc\("([^"]+)":(\d+):\d+\)')


@dataclass
class Dot:
    """One ``tt.dot``: ``(m, k) x (k, n)`` with ``dtype`` operands."""

    m: int
    n: int
    k: int
    dtype: str

    @property
    def macs(self) -> int:
        return self.m * self.n * self.k


@dataclass
class IRLoop:
    """One ``scf.for`` of the IR and the dots directly in it (not in a nested loop)."""

    line: int  # line of the IR text
    depth: int
    dots: List[Dot] = field(default_factory=list)
    children: List["IRLoop"] = field(default_factory=list)
    parent: Optional["IRLoop"] = None

    @property
    def macs(self) -> int:
        """Multiply-adds per iteration of this loop's own dots."""
        return sum(d.macs for d in self.dots)


def parse_loops(ttir: str) -> List[IRLoop]:
    """All ``scf.for`` loops of ``ttir`` in text order, each with its dots."""
    loops: List[IRLoop] = []
    stack: List[Optional[IRLoop]] = []  # one entry per open region: the loop, or None
    for no, line in enumerate(ttir.splitlines()):
        s = line.strip()
        closes = s.startswith("}")
        opens = s.endswith("{")
        if closes and stack:
            stack.pop()
        if not closes or opens:
            m = _DOT_RE.search(s)
            if m:
                mm, kk, dtype, kk2, nn = m.groups()
                cur = next((x for x in reversed(stack) if x is not None), None)
                if cur is not None:
                    cur.dots.append(Dot(int(mm), int(nn), int(kk), dtype))
        if opens:
            if "scf.for" in s and not closes:
                parent = next((x for x in reversed(stack) if x is not None), None)
                lp = IRLoop(no + 1, sum(1 for x in stack if x is not None), parent=parent)
                if parent is not None:
                    parent.children.append(lp)
                loops.append(lp)
                stack.append(lp)
            else:
                stack.append(None)
    return loops


def _subtree_has_dots(lp: IRLoop) -> bool:
    return bool(lp.dots) or any(_subtree_has_dots(c) for c in lp.children)


def main_loops(ttir: str) -> List[IRLoop]:
    """Innermost loops holding dots, in text order (what the SASS main loops compile from)."""
    return [lp for lp in parse_loops(ttir) if lp.dots and not any(_subtree_has_dots(c) for c in lp.children)]
