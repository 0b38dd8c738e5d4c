"""Summary tables from a results dict: the ratios of docs/design.md §4.1, side by side from one run.

Speed-ups are ``baseline ms / our ms`` (above 1: we are faster); cost ratios are
``our adaptive ms / our softmax ms``. A cell that misses its target is marked ``!``;
``-`` means a time is missing (not run, out of memory, unsupported). The targets are GPU
targets: a CPU run (the smoke mode, Triton's interpreter) is not judged against them
(:func:`comparable_with_targets`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

OUR_IMPLS = ("ssa_flash.triton", "ssa_flash.cuda", "ssa_flash.cuda_ws")

# (label, pass, ours (op), baseline (op, impl or None = same ours impl), kind, target, the shortest
# L the target applies to)
COMPARISONS = (
    ("SSA fwd vs sdpa.flash", "fwd", "ssa", ("softmax", "sdpa.flash"), "speedup", 1.0, 0),
    ("SSA f+b vs sdpa.flash", "fwd_bwd", "ssa", ("softmax", "sdpa.flash"), "speedup", 0.9, 0),
    ("SSA fwd vs sdpa.cudnn", "fwd", "ssa", ("softmax", "sdpa.cudnn"), "speedup", 1.0, 4096),
    ("SSA fwd vs flex", "fwd", "ssa", ("ssa", "flex"), "speedup", 1.5, 0),
    ("SSA f+b vs flex", "fwd_bwd", "ssa", ("ssa", "flex"), "speedup", 1.5, 0),
    ("softmax fwd vs sdpa.flash", "fwd", "softmax", ("softmax", "sdpa.flash"), "speedup", None, 0),
    ("softmax fwd vs sdpa.cudnn", "fwd", "softmax", ("softmax", "sdpa.cudnn"), "speedup", None, 0),
    ("adaptive/softmax fwd", "fwd", "adaptive", ("softmax", None), "cost", 1.4, 0),
    ("adaptive/softmax f+b", "fwd_bwd", "adaptive", ("softmax", None), "cost", 1.6, 0),
    ("SSA+adapt/SSA f+b", "fwd_bwd", "ssa_adaptive", ("ssa", None), "cost", None, 0),
)


def _key(row) -> Tuple:
    return (row["op"], row["impl"], row["pass"], row["dtype"], row["batch"], row["heads"],
            row["seqlen"], row["headdim"], row["causal"])


def _index(rows) -> Dict[Tuple, float]:
    return {_key(r): r["ms"] for r in rows if r.get("sweep", "speed") == "speed" and r.get("ms")}


def _fmt(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


Table = Tuple[str, List[str], List[List[str]], List[str]]  # title, headers, rows, notes


def comparable_with_targets(results: dict) -> bool:
    """Whether the run's timings can be held to the GPU targets: not for a smoke run nor for any
    CPU run (Triton's interpreter runs the kernels as numpy code, 1000x off any GPU figure, and
    the ratios between implementations mean nothing there either)."""
    if results.get("smoke"):
        return False
    return not str(results.get("device", "")).strip().lower().startswith("cpu")


def ratio_tables(results: dict) -> List[Table]:
    rows = results.get("rows", [])
    idx = _index(rows)
    shapes = sorted({(r["dtype"], r["headdim"], r["causal"], r["seqlen"], r["batch"], r["heads"])
                     for r in rows if r.get("sweep", "speed") == "speed"})
    mm = results.get("matmul_tflops")
    tflops = {_key(r): r.get("tflops") for r in rows if r.get("sweep", "speed") == "speed"}
    judged = comparable_with_targets(results)
    tables = []
    for ours in OUR_IMPLS:
        if not any(r["impl"] == ours and r.get("ms") for r in rows):
            continue
        headers = ["dtype", "D", "causal", "L", "B"]
        for label, _, _, _, kind, target, min_l in COMPARISONS:
            mark = "" if target is None or not judged else (
                f" (>={target:g}" if kind == "speedup" else f" (<={target:g}")
            if mark:
                mark += f" at L>={min_l // 1024}k)" if min_l else ")"
            headers.append(label + mark)
        headers.append("SSA f+b TFLOP/s")
        headers.append("% of matmul")
        body = []
        for dtype, d, causal, L, B, H in shapes:
            line = [dtype, str(d), "yes" if causal else "no", str(L), str(B)]
            for label, pass_, op, (bop, bimpl), kind, target, min_l in COMPARISONS:
                mine = idx.get((op, ours, pass_, dtype, B, H, L, d, causal))
                base = idx.get((bop, bimpl or ours, pass_, dtype, B, H, L, d, causal))
                if mine is None or base is None:
                    line.append("-")
                    continue
                val = base / mine if kind == "speedup" else mine / base
                miss = judged and target is not None and L >= min_l and (
                    val < target if kind == "speedup" else val > target)
                line.append(f"{val:.2f}{'!' if miss else ''}")
            tf = tflops.get(("ssa", ours, "fwd_bwd", dtype, B, H, L, d, causal))
            line.append(_fmt(tf, "{:.4g}"))
            line.append(_fmt(None if (tf is None or not mm) else 100.0 * tf / mm, "{:.3g}%"))
            body.append(line)
        judging = ("'!' misses the docs/design.md §4.1 target" if judged else
                   "CPU / Triton-interpreter timings: not comparable with the GPU targets, none judged")
        notes = [f"{ours}: speed-ups = baseline ms / {ours} ms; cost = {ours} ms / {ours} softmax ms; "
                 f"{judging}; '-' = no time (not run, OOM or unsupported).",
                 f"dense matmul: {_fmt(mm, '{:.4g}')} TFLOP/s ({results.get('matmul', {}).get('dtype', '?')})"]
        tables.append((f"Ratios for {ours} on {results.get('device', '?')}", headers, body, notes))
    mem = [r for r in rows if r.get("sweep") == "memory"]
    if mem:
        combos = []
        for r in mem:
            c = (r["op"], r["impl"])
            if c not in combos:
                combos.append(c)
        lengths = sorted({r["seqlen"] for r in mem})
        by = {(r["op"], r["impl"], r["seqlen"]): r for r in mem}
        headers = ["L"] + [f"{op} {impl}" for op, impl in combos]
        body = []
        for L in lengths:
            line = [str(L)]
            for op, impl in combos:
                r = by.get((op, impl, L))
                if r is None:
                    line.append("")
                elif r.get("peak_mem_bytes") is None:
                    # no peak measured (a CPU run has no allocator statistics): never a time in
                    # this table, whose cells are GiB
                    line.append("OOM" if r.get("note") == "out of memory" else
                                ("n/a" if r.get("ms") is not None else "-"))
                else:
                    peak = r["peak_mem_bytes"]
                    line.append(f"{peak / 2**30:.2f}G x{peak / r['io_bytes']:.2f}")
            body.append(line)
        r0 = mem[0]
        notes = [f"forward+backward peak allocated memory (GiB) and its ratio to the tensors themselves "
                 f"(q, k, v, o, dO, dq, dk, dv, lse; docs/design.md §4.1 target x1.2); B={r0['batch']} "
                 f"H={r0['heads']} D={r0['headdim']} {r0['dtype']}{' causal' if r0['causal'] else ''}"]
        if any(r.get("peak_mem_bytes") is None and r.get("ms") is not None for r in mem):
            notes.append("n/a: ran, but no peak memory was measured (torch measures CUDA memory "
                         "only; a CPU run has none); its time is in the results file")
        tables.append(("Peak memory vs sequence length", headers, body, notes))
    return tables


def render_text(tables: List[Table]) -> str:
    out = []
    for title, headers, body, notes in tables:
        widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
        out.append(title)
        out.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        out.append("  ".join("-" * w for w in widths))
        for r in body:
            out.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        out.extend(notes)
        out.append("")
    return "\n".join(out)


def render_markdown(tables: List[Table]) -> str:
    out = []
    for title, headers, body, notes in tables:
        out.append(f"#### {title}\n")
        out.append("| " + " | ".join(headers) + " |")
        out.append("|" + "|".join("---:" for _ in headers) + "|")
        for r in body:
            out.append("| " + " | ".join(r) + " |")
        out.append("")
        out.extend(n + "\n" for n in notes)
    return "\n".join(out)
