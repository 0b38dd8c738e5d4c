"""The package's import graph, by layer: ``python tools/import_graph.py [--dot]``.

Reads every module of ``ssa_flash/`` with ``ast`` (nothing is imported, so neither torch nor
Triton is needed) and takes every ``import`` statement as an arrow, those inside functions too
(a lazy import is still a dependency). Each module belongs to one layer of :data:`LAYERS`
(docs/design.md §5), lowest first; a module may import modules of a lower layer and of its own
group. The report lists the layers, the arrows that go upward or sideways between groups of
one layer, and the import cycles (strongly connected components of more than one module).
Exit status 1 when there is either. tests/test_layers.py holds the package to it.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "ssa_flash"

# (layer, groups): each group a tuple of module prefixes, lowest layer first. A module belongs to
# the group of its longest matching prefix (``ssa_flash`` itself, the package's front door that
# re-exports the public names, only exactly). Groups of one layer do not import each other.
LAYERS: Tuple[Tuple[str, Tuple[Tuple[str, ...], ...]], ...] = (
    ("contract", (("ssa_flash.spec", "ssa_flash.scores", "ssa_flash.conventions", "ssa_flash.errors",
                   "ssa_flash.temperature", "ssa_flash._version"),)),
    ("kernels", (("ssa_flash.triton",), ("ssa_flash.reference",), ("ssa_flash._C",))),
    ("backends", (("ssa_flash.backends",),)),
    ("ops", (("ssa_flash.autograd",),)),
    ("public", (("ssa_flash.ops", "ssa_flash.cuda", "ssa_flash._shapes", "ssa_flash._nested"),)),
    ("modules", (("ssa_flash.nn",), ("ssa_flash.flash_attn",))),
    ("package", (("ssa_flash",),)),
    ("above", (("ssa_flash.distributed",), ("ssa_flash.integrations",))),
    ("tools", (("ssa_flash.selfcheck", "ssa_flash.__main__", "ssa_flash.bench", "ssa_flash.audit"),)),
)


# compiled modules (no source to read): the CUDA extension built from csrc/
EXTENSIONS = ("ssa_flash._C",)


def modules(root: str = ROOT) -> Dict[str, str]:
    """Every module of the package: dotted name -> path (a package by its ``__init__``; an
    extension of :data:`EXTENSIONS` by ``None``)."""
    out: Dict[str, Optional[str]] = dict.fromkeys(EXTENSIONS)
    base = os.path.join(root, PACKAGE)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "__pycache__")))
        rel = os.path.relpath(dirpath, root).replace(os.sep, ".")
        for f in sorted(filenames):
            if f.endswith(".py"):
                name = rel if f == "__init__.py" else f"{rel}.{f[:-3]}"
                out[name] = os.path.join(dirpath, f)
    return out


def _resolve(current: str, is_package: bool, level: int, target: Optional[str]) -> str:
    parts = current.split(".")
    if not is_package:
        parts = parts[:-1]
    if level > 1:
        parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def imports(mods: Dict[str, str]) -> Dict[str, Set[str]]:
    """module -> the package's modules it imports (``from x import y`` counts ``x.y`` when that is
    a module, else ``x``)."""
    graph: Dict[str, Set[str]] = {}
    for name, path in mods.items():
        if path is None:
            graph[name] = set()
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        deps: Set[str] = set()
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module) if node.level else (node.module or "")
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in mods else base)
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def place(module: str) -> Tuple[int, int]:
    """``(layer index, group index)`` of a module: its longest matching prefix."""
    best, where = -1, None
    for li, (_, groups) in enumerate(LAYERS):
        for gi, prefixes in enumerate(groups):
            for p in prefixes:
                if (module == p or module.startswith(p + ".") and p != PACKAGE) and len(p) > best:
                    best, where = len(p), (li, gi)
    if where is None:
        raise KeyError(f"{module} is in no layer of tools/import_graph.py LAYERS")
    return where


def bad_arrows(graph: Dict[str, Set[str]]) -> List[Tuple[str, str, str]]:
    """``(importer, imported, why)`` for each arrow to a higher layer or to another group of the
    same layer. A parent package counts only where a name is taken from its ``__init__`` (``from
    .. import name``): Python's implicit import of the parents of every module is no arrow."""
    out = []
    for a, deps in sorted(graph.items()):
        la, ga = place(a)
        for b in sorted(deps):
            lb, gb = place(b)
            if lb > la:
                out.append((a, b, f"upward: {LAYERS[la][0]} -> {LAYERS[lb][0]}"))
            elif lb == la and gb != ga:
                out.append((a, b, f"sideways within {LAYERS[la][0]}"))
    return out


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def report(graph: Dict[str, Set[str]]) -> str:
    lines = ["layers, lowest first:"]
    for li, (layer, groups) in enumerate(LAYERS):
        members = [sorted(m for m in graph if place(m) == (li, gi)) for gi in range(len(groups))]
        names = " | ".join(", ".join(m.replace("ssa_flash.", "") for m in g) for g in members)
        lines.append(f"  {li} {layer}: {names}")
    bad = bad_arrows(graph)
    lines.append(f"arrows: {sum(len(d) for d in graph.values())}; against the layers: {len(bad)}")
    lines += [f"  {a} -> {b} ({why})" for a, b, why in bad]
    cyc = cycles(graph)
    lines.append(f"cycles: {len(cyc)}")
    lines += ["  " + " <-> ".join(c) for c in cyc]
    return "\n".join(lines)


def dot(graph: Dict[str, Set[str]]) -> str:
    """Graphviz source: one cluster per layer, upward arrows in red."""
    bad = {(a, b) for a, b, _ in bad_arrows(graph)}
    lines = ["digraph ssa_flash {", "  rankdir=BT; node [shape=box, fontsize=10];"]
    for li, (layer, _) in enumerate(LAYERS):
        lines.append(f'  subgraph cluster_{li} {{ label="{layer}";')
        lines += [f'    "{m}";' for m in sorted(graph) if place(m)[0] == li]
        lines.append("  }")
    for a in sorted(graph):
        for b in sorted(graph[a]):
            lines.append(f'  "{a}" -> "{b}"' + (' [color=red]' if (a, b) in bad else "") + ";")
    lines.append("}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dot", action="store_true", help="print Graphviz source instead of the report")
    args = p.parse_args(argv)
    graph = imports(modules())
    print(dot(graph) if args.dot else report(graph))
    return 1 if bad_arrows(graph) or cycles(graph) else 0


if __name__ == "__main__":
    sys.exit(main())
