"""Results of the audit as JSON documents, a text table, and a before/after comparison."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from . import model

DISCLAIMER = ("Static bound from compiled code (no GPU ran anything): instruction counts of each compiled main "
              "loop and the throughput they allow at best; memory bandwidth, latency and stalls are ignored. "
              "Not a measurement.")

DEFINITIONS = {
    "per_element": ("per score element (one query x key pair of a loop iteration's BLOCK_M x BLOCK_N tile): "
                    "thread-instructions the SM issues for it = static loop-body instructions / "
                    "(BLOCK_M * BLOCK_N / threads). Static: every instruction of the body once, including "
                    "code that an inner branch may skip (inner_branches counts those branches)."),
    "main_loops": ("innermost SASS loops (label .. backward branch) holding tensor-core instructions; with "
                   "several, the one with the fewest instructions per element is 'interior', the others "
                   "'boundary'; a single one is 'main'. Gates use the interior / main loop."),
    "tensor": ("macs_per_element: multiply-adds of the loop's MMA instructions (whole program) / "
               "(BLOCK_M * BLOCK_N); source_macs_per_element: the same for the tt.dot ops of the matching "
               "source loop (Triton IR); repeat_factor = their ratio (> 1: repeated tensor work)."),
    "bound": ("clocks per element = max(instructions / ISSUE, MUFU / MUFU_RATE, tensor MACs / TENSOR_RATE) "
              "per SM (H100 sm_90: 128, 16, 2048 bf16/fp16 MACs; A100 sm_80: 128, 16, 1024); "
              "binding = the largest term; tflops = the source's matmul FLOPs per element over that time, "
              "at 132 SMs x 1.83 GHz (989 TFLOP/s) or 108 x 1.41 GHz (312 TFLOP/s)."),
    "ratio_vs_softmax": "score function (SSA, ...) / the same specialisation with softmax, interior (or main) loop",
}


def git_commit(root: Optional[Path] = None) -> Tuple[Optional[str], Optional[bool]]:
    """``(commit, dirty)`` of the repository holding this package, or ``(None, None)``."""
    root = root or Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "ssa_flash", "csrc"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return None, None


def chosen_config(result: dict) -> Optional[dict]:
    """The configuration the launcher would run (first that fits), or None."""
    if result.get("chosen") is None:
        return None
    return result["configs"][result["chosen"]]


def gated_loop(config: Optional[dict]) -> Optional[dict]:
    """The interior (or only) main loop of a configuration."""
    if not config or config.get("gated_loop") is None:
        return None
    return config["loops"][config["gated_loop"]]


def add_ratios(results: List[dict]) -> None:
    """Set ``ratio_vs_softmax`` on the gated loop of every result of a score function other than
    softmax whose softmax twin is present."""
    from .. import scores
    from .specs import Variant

    by_id = {r["id"]: r for r in results}
    for r in results:
        v = Variant(**r["variant"])
        if v.score is scores.SOFTMAX:
            continue
        twin = by_id.get(v.softmax_twin().id)
        a, b = gated_loop(chosen_config(r)), gated_loop(chosen_config(twin) if twin else None)
        if a is None or b is None:
            continue
        ratio = {"instructions": round(a["per_element"]["total"] / b["per_element"]["total"], 3)}
        if a.get("bound") and b.get("bound"):
            ratio["clocks"] = round(a["bound"]["clocks_per_element"] / b["bound"]["clocks_per_element"], 3)
        a["ratio_vs_softmax"] = ratio


def document(results: List[dict], arch: int, extra: Optional[dict] = None) -> dict:
    """The JSON document of one architecture (``bench/results/audit-sm<arch>.json``)."""
    import torch
    import triton

    am = model.arch_model(arch)
    commit, dirty = git_commit()
    mine = [r for r in results if r["variant"]["arch"] == arch]
    add_ratios(mine)
    doc = {
        "kind": "ssa_flash static audit",
        "note": DISCLAIMER,
        "arch": arch,
        "target": f"sm_{arch}",
        "model": {"gpu": am.gpu, "issue_per_clock": am.issue, "mufu_per_clock": am.mufu,
                  "tensor_macs_per_clock_16bit": am.tensor16, "peak_tflops": am.peak_tflops,
                  "smem_per_block_bytes": am.smem_per_block, "smem_per_sm_bytes": am.smem_per_sm},
        "definitions": DEFINITIONS,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": commit,
        "git_dirty": dirty,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": {"batch": 2, "heads": 16, "seqlen_note": "Lq = Lk = variant.seqlen (4096 unless stated)"},
        "results": mine,
    }
    if extra:
        doc.update(extra)
    return doc


def write_document(doc: dict, out_dir: str) -> Path:
    path = Path(out_dir) / f"audit-sm{doc['arch']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(doc))
    for r in slim["results"]:
        r.pop("traceback", None)
    path.write_text(json.dumps(slim, indent=1, sort_keys=False) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- table

_HEAD = ("kernel", "op", "causal", "mask", "D", "dtype", "blocks", "regs", "spill", "smemKB", "warn", "loop",
         "instr", "fp32", "mufu", "ex2/lg2/rcp", "int", "mem", "move", "cvt", "ctrl", "mma/el", "MMA", "rep",
         "bound", "TF/s", "xsoftmax")


def _fmt(x, nd=1):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _lead_cells(v: dict) -> List[str]:
    """kernel, op, causal, mask, D (with the GQA group and length when not the defaults), dtype."""
    d = str(v["head_dim"])
    if v.get("group", 1) != 1:
        d += f" g{v['group']}"
    if v.get("seqlen", 4096) != 4096:
        d += f" L{v['seqlen']}"
    return [v["kernel"], v["op"], "yes" if v["causal"] else "no", v["mask"], d, v["dtype"]]


def table_rows(results: Iterable[dict], all_loops: bool = True) -> List[List[str]]:
    """One row per (specialisation, compiled configuration, main loop)."""
    rows = []
    for r in results:
        v = r["variant"]
        lead = _lead_cells(v)
        c = chosen_config(r)
        if r.get("error") or c is None:
            rows.append(lead + [r.get("error", "no configuration fits")[:60]] + [""] * (len(_HEAD) - 7))
            continue
        for i, cfg in enumerate(r["configs"]):
            mark = ("*" if i else "") if i == r["chosen"] else "~"
            rows.extend(_config_rows(lead, cfg, mark, all_loops))
    return rows


def _mma_shape(kind: str) -> str:
    """The shape part of a tensor instruction kind (``HMMA.16816.F32.BF16`` -> ``16816``); kinds
    printed without one (Blackwell's ``UTCHMMA``, whose shape lives in a descriptor) as they are."""
    parts = kind.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _config_rows(lead, c, mark, all_loops):
    """Rows of one compiled configuration: one per main loop (or the gated one only)."""
    rows = []
    b = c["blocks"]
    blk = f"{b['m']}x{b['n']}w{b['warps']}s{b['stages']}" + mark
    spill = c["spill_store_bytes"] + c["spill_load_bytes"] if c["spills"] else 0
    warn = ",".join(sorted({w["code"] or "W" for w in c["warnings"]})) or "-"
    res = [blk, str(c["registers"]), str(spill), f"{c['shared_bytes'] / 1024:.0f}/{c['shared_limit_bytes'] // 1024}",
           warn]
    loops = c["loops"] if all_loops else [gated_loop(c)] if gated_loop(c) else []
    if not loops:
        rows.append(lead + res + ["none"] + [""] * (len(_HEAD) - 12))
    for lp in loops:
        pe = lp["per_element"]
        mk = lp["mufu_per_element"]
        mufu_kinds = "/".join(_fmt(mk.get(k, 0.0), 2) for k in ("EX2", "LG2", "RCP"))
        kinds = ",".join(_mma_shape(k) for k in lp["mma"]) or "-"
        t = lp["tensor"]
        bd = lp.get("bound")
        ratio = lp.get("ratio_vs_softmax", {}).get("instructions")
        rows.append(lead + res + [
            lp.get("role", "?"), _fmt(pe["total"]), _fmt(pe["fp32"]), _fmt(pe["mufu"], 2), mufu_kinds,
            _fmt(pe["integer"]), _fmt(pe["memory"]), _fmt(pe["move"]), _fmt(pe["conversion"]),
            _fmt(pe["control"]), _fmt(t["macs_per_element"], 0), kinds,
            _fmt(t["repeat_factor"], 2), (bd["binding"] if bd else "-"), _fmt(bd["tflops"], 0) if bd else "-",
            _fmt(ratio, 2)])
    return rows




def format_table(rows: List[List[str]], head=_HEAD) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def text_report(results: List[dict], arch: int, all_loops: bool = True) -> str:
    mine = [r for r in results if r["variant"]["arch"] == arch]
    add_ratios(mine)
    am = model.arch_model(arch)
    head = (f"== sm_{arch} ({am.gpu}) ==  {DISCLAIMER}\n"
            "Per score element of the loop; blocks BMxBN w=warps s=stages (* = a fallback: the first choice does "
            "not fit; ~ = a candidate the launcher would not use, --all-candidates); spill = bytes stored+loaded; "
            "mufu ex2/lg2/rcp per element; mma/el = tensor MACs per element; "
            "rep = tensor work / source matmuls; bound = binding term (issue / mufu / tensor); TF/s = matmul "
            "TFLOP/s the bound allows; xsoftmax = the score function's instructions / softmax's (interior loop).")
    return head + "\n" + format_table(table_rows(mine, all_loops))


def markdown_table(results: List[dict], arch: int) -> str:
    """A compact markdown table of the gated (interior / main) loop of every result for ``arch``."""
    mine = [r for r in results if r["variant"]["arch"] == arch]
    add_ratios(mine)
    head = ["kernel", "op", "causal", "mask", "D", "dtype", "blocks", "regs", "spill B", "ptxas", "loops",
            "instr/el", "MUFU/el", "tensor rep", "bound", "TFLOP/s", "SSA/softmax"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in mine:
        v, c = r["variant"], chosen_config(r)
        lead = _lead_cells(v)
        lp = gated_loop(c)
        if c is None or lp is None:
            lines.append("| " + " | ".join(lead + [r.get("error", "no main loop")[:50]] + [""] * 10) + " |")
            continue
        b, bd = c["blocks"], lp.get("bound") or {}
        ratio = lp.get("ratio_vs_softmax", {}).get("instructions")
        cells = lead + [f"{b['m']}x{b['n']} w{b['warps']} s{b['stages']}", str(c["registers"]),
                        str(c["spill_store_bytes"] + c["spill_load_bytes"]),
                        ",".join(sorted({w["code"] or "W" for w in c["warnings"]})) or "-",
                        "/".join(x.get("role", "?")[0] for x in c["loops"]),
                        _fmt(lp["per_element"]["total"]), _fmt(lp["per_element"]["mufu"], 2),
                        _fmt(lp["tensor"]["repeat_factor"], 2), bd.get("binding", "-"),
                        _fmt(bd.get("tflops"), 0), _fmt(ratio, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- compare

def _index(doc: dict) -> Dict[Tuple[str, str], dict]:
    """``(specialisation, loop key) -> {config, loop}``: the gated loop under ``"gated"`` (so that a
    single ``main`` loop compares with the ``interior`` loop of a kernel later split in two), the
    other loops under their role."""
    out = {}
    for r in doc.get("results", []):
        c = chosen_config(r)
        if not c:
            continue
        g = c.get("gated_loop")
        for i, lp in enumerate(c["loops"]):
            out[(r["id"], "gated" if i == g else lp.get("role", "?"))] = {"config": c, "loop": lp}
    return out


def compare(old: dict, new: dict, threshold: float = 0.005) -> str:
    """A compact before/after table of two audit documents: every (specialisation, loop) whose
    instructions, MUFU, registers, spills, repeat factor or bound changed by more than
    ``threshold`` (relative), plus specialisations present in only one of them."""
    a, b = _index(old), _index(new)
    rows = []
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]

        def pick(e):
            lp, c = e["loop"], e["config"]
            bd = lp.get("bound") or {}
            return {"instr": lp["per_element"]["total"], "mufu": lp["per_element"]["mufu"], "regs": c["registers"],
                    "spill": c["spill_store_bytes"] + c["spill_load_bytes"],
                    "rep": lp["tensor"]["repeat_factor"] or 0.0, "tflops": bd.get("tflops") or 0.0}
        p, q = pick(x), pick(y)
        changed = any(abs(q[k] - p[k]) > threshold * max(abs(p[k]), 1e-9) for k in p)
        if not changed:
            continue
        roles = (x["loop"].get("role", "?"), y["loop"].get("role", "?"))
        cells = [key[0], roles[1] if roles[0] == roles[1] else f"{roles[0]}->{roles[1]}"]
        for k in ("instr", "mufu", "regs", "spill", "rep", "tflops"):
            nd = 2 if k in ("mufu", "rep") else 1
            if p[k] == q[k]:
                cells.append(_fmt(q[k], nd))
            else:
                pct = f" ({(q[k] - p[k]) / p[k] * 100:+.0f}%)" if p[k] else ""
                cells.append(f"{_fmt(p[k], nd)}->{_fmt(q[k], nd)}{pct}")
        rows.append(cells)
    only_old = sorted({k[0] for k in a} - {k[0] for k in b})
    only_new = sorted({k[0] for k in b} - {k[0] for k in a})
    new_loops = sorted(k for k in set(b) - set(a) if k[0] in {x[0] for x in a})
    for key in new_loops:  # loops that appeared (e.g. a boundary loop split off): their figures
        lp, c = b[key]["loop"], b[key]["config"]
        bd = lp.get("bound") or {}
        rows.append([key[0], f"(new) {lp.get('role', '?')}", _fmt(lp["per_element"]["total"]),
                     _fmt(lp["per_element"]["mufu"], 2), _fmt(c["registers"]),
                     _fmt(c["spill_store_bytes"] + c["spill_load_bytes"]), _fmt(lp["tensor"]["repeat_factor"], 2),
                     _fmt(bd.get("tflops"), 1)])
    head = ("specialisation", "loop", "instr/el", "mufu/el", "regs", "spill B", "rep", "bound TF/s")
    def origin(d):
        return f"{(d.get('git_commit') or '?')[:10]} ({d.get('date', '?')}, triton {d.get('triton', '?')})"

    def listing(ids):
        return ", ".join(ids[:20]) + (" ..." if len(ids) > 20 else "")

    out = [f"audit compare: {origin(old)} -> {origin(new)}; static bound, not a measurement",
           format_table(rows, head) if rows else "(no changes above threshold)"]
    if only_old:
        out.append(f"only in old ({len(only_old)}): {listing(only_old)}")
    if only_new:
        out.append(f"only in new ({len(only_new)}): {listing(only_new)}")
    return "\n".join(out)


def load(path: str) -> dict:
    """An audit document; one written before the statistics pass was named ``row_entropy``
    (kernel ``stats``) is read with the current name, so that ``--compare`` pairs them."""
    with open(path) as f:
        doc = json.load(f)
    for r in doc.get("results", []):
        v = r.get("variant") or {}
        if v.get("kernel") == "stats":
            v["kernel"] = "row_entropy"
            r["id"] = r["id"].replace("-stats-", "-row_entropy-", 1)
    return doc


def default_out_dir() -> str:
    root = Path(__file__).resolve().parents[2]
    return str(root / "bench" / "results") if (root / "bench").is_dir() else os.getcwd()
