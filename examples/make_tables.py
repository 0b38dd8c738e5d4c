#!/usr/bin/env python
"""Markdown tables (as in docs/reproduction.md) from the JSON written by the examples.

    python examples/make_tables.py examples/results/icl_linear-cpu/icl_linear.json \
                                   examples/results/max_retrieval-cpu/max_retrieval.json
"""
from __future__ import annotations

import json
import sys


def provenance_line(res):
    p = res["provenance"]
    commit = (p.get("commit") or "unknown")[:10]
    return (f"_{res['experiment']}, mode `{res['mode']}`: {p['device']}, backend `{p['backend']}`, torch {p['torch']}, "
            f"{p['steps']} steps per model, seeds {p['seeds']}, commit {commit}, {p['date']}, "
            f"{res['seconds_total'] / 60:.1f} min._")


def icl_table(res):
    cfg, paper = res["config"], res["paper"]
    lines = [f"Model: {cfg['layers']} layers, {cfg['heads']} heads, width {cfg['dim']}; batch {cfg['batch']}, "
             f"lr {cfg['lr']}; {cfg['eval_functions']} test functions per sigma (the same for both models).", "",
             "| sigma | softmax MSE | SSA MSE | predict-0 MSE | paper softmax | paper SSA |",
             "|---:|---:|---:|---:|---:|---:|"]
    for s in range(1, 11):
        sm, ssa = res["eval"]["softmax"][str(s)], res["eval"]["ssa"][str(s)]
        ps = pss = ""
        if s == paper["sigma"]:
            ps, pss = str(paper["mse"]["softmax"]), str(paper["mse"]["ssa"])
        lines.append(f"| {s} | {sm['mse']:.4g} ± {sm['mse_sem']:.2g} | {ssa['mse']:.4g} ± {ssa['mse_sem']:.2g} | "
                     f"{sm['zero_predictor_mse']:.3g} | {ps} | {pss} |")
    return "\n".join(lines)


def retrieval_table(res):
    paper = res["paper"]["accuracy"]
    lines = ["| items | softmax | adaptive temp. | SSA | SSA + adaptive | paper softmax | paper adaptive |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in res["test_sizes"]:
        row = res["eval"][str(s)]
        cells = [f"{100 * row[v]['accuracy']:.1f} ± {100 * row[v]['accuracy_se']:.1f}"
                 for v in ("softmax", "adaptive", "ssa", "ssa_adaptive")]
        ps = f"{100 * paper['softmax'][str(s)]:.1f}" if str(s) in paper["softmax"] else ""
        pa = f"{100 * paper['adaptive'][str(s)]:.1f}" if str(s) in paper["adaptive"] else ""
        lines.append(f"| {s} | " + " | ".join(cells) + f" | {ps} | {pa} |")
    return "\n".join(lines)


def main(paths):
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        print(icl_table(res) if res["experiment"] == "icl_linear" else retrieval_table(res))
        print()
        print(provenance_line(res))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
