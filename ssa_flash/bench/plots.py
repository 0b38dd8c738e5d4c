"""PNG plots of a results dict (matplotlib is optional: without it plots are skipped with a message).

* ``<base>-tflops-<pass>.png``: TFLOP/s vs sequence length, one panel per (head dim, causality),
  one line per (op, impl); the dense matmul rate as a dotted line.
* ``<base>-memory.png``: forward+backward peak memory vs sequence length (log-log), with the size of
  the tensors themselves; out-of-memory points marked on the top edge.
"""
from __future__ import annotations

import os
from typing import List, Optional

_STYLE = {"ssa_flash.triton": "-", "ssa_flash.cuda": "-.", "flex": "--", "reference": ":",
          "sdpa.flash": (0, (5, 1)), "sdpa.cudnn": (0, (3, 1, 1, 1)), "sdpa.efficient": (0, (1, 1)),
          "sdpa.math": (0, (3, 3))}
_MARK = {"softmax": "o", "ssa": "s", "adaptive": "^", "ssa_adaptive": "D"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # ImportError or a broken backend
        return None, f"plots skipped: matplotlib unavailable ({type(err).__name__}: {err}); pip install matplotlib"
    return plt, None


def make_plots(results: dict, out_dir: str, base: str) -> List[str]:
    """Writes the PNGs; returns their paths. Prints why when nothing can be plotted."""
    plt, why = _pyplot()
    if plt is None:
        print(why, flush=True)
        return []
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    rows = results.get("rows", [])
    speed = [r for r in rows if r.get("sweep", "speed") == "speed"]
    title_tail = f"{results.get('device', '?')}, {results.get('date', '')}"
    for pass_ in ("fwd", "bwd", "fwd_bwd"):
        sel = [r for r in speed if r["pass"] == pass_]
        if not sel:
            continue
        dims = sorted({r["headdim"] for r in sel})
        causals = sorted({r["causal"] for r in sel})
        fig, axes = plt.subplots(len(dims), len(causals), figsize=(6.5 * len(causals), 4.2 * len(dims)),
                                 squeeze=False)
        for i, d in enumerate(dims):
            for j, c in enumerate(causals):
                ax = axes[i][j]
                panel = [r for r in sel if r["headdim"] == d and r["causal"] == c]
                series = []
                for r in panel:
                    if (r["op"], r["impl"]) not in series:
                        series.append((r["op"], r["impl"]))
                for op, impl in series:
                    pts = sorted((r["seqlen"], r["tflops"]) for r in panel
                                 if r["op"] == op and r["impl"] == impl and r.get("tflops"))
                    if not pts:
                        continue
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=_STYLE.get(impl, "-"),
                            marker=_MARK.get(op, "o"), markersize=4, label=f"{op} / {impl}")
                top = max([r["tflops"] for r in panel if r.get("tflops")] + [0.0])
                if results.get("matmul_tflops") and results["matmul_tflops"] < 3 * top:
                    ax.axhline(results["matmul_tflops"], color="gray", linestyle=":", linewidth=1,
                               label="dense matmul")
                ax.set_xscale("log", base=2)
                ax.set_xlabel("sequence length")
                ax.set_ylabel("TFLOP/s")
                ax.set_title(f"{pass_}, D={d}, {'causal' if c else 'non-causal'}")
                ax.grid(True, alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
        fig.suptitle(f"{pass_}: TFLOP/s vs sequence length ({title_tail})", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{base}-tflops-{pass_}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    mem = [r for r in rows if r.get("sweep") == "memory"]
    if mem:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        series = []
        for r in mem:
            if (r["op"], r["impl"]) not in series:
                series.append((r["op"], r["impl"]))
        top = max([r["peak_mem_bytes"] for r in mem if r.get("peak_mem_bytes")] + [1])
        plotted = False
        for op, impl in series:
            pts = sorted((r["seqlen"], r["peak_mem_bytes"]) for r in mem
                         if r["op"] == op and r["impl"] == impl and r.get("peak_mem_bytes"))
            oom = sorted(r["seqlen"] for r in mem if r["op"] == op and r["impl"] == impl
                         and r.get("note") == "out of memory")
            line = None
            if pts:
                (line,) = ax.plot([p[0] for p in pts], [p[1] / 2**30 for p in pts],
                                  linestyle=_STYLE.get(impl, "-"), marker=_MARK.get(op, "o"),
                                  markersize=4, label=f"{op} / {impl}")
                plotted = True
            if oom:
                ax.scatter(oom, [top / 2**30] * len(oom), marker="x",
                           color=None if line is None else line.get_color(),
                           label=f"{op} / {impl}: out of memory")
                plotted = True
        io = sorted({(r["seqlen"], r["io_bytes"]) for r in mem if r.get("io_bytes")})
        if io and plotted:
            ax.plot([p[0] for p in io], [p[1] / 2**30 for p in io], color="gray", linestyle=":",
                    label="q,k,v,o,dO,dq,dk,dv,lse")
        if plotted:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no peak-memory data\n(CUDA only)", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("peak allocated memory (GiB)")
        r0 = mem[0]
        ax.set_title(f"forward+backward peak memory, B={r0['batch']} H={r0['heads']} D={r0['headdim']} "
                     f"{r0['dtype']} ({title_tail})", fontsize=9)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{base}-memory.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
