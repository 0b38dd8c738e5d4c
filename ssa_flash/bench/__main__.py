"""``python -m ssa_flash.bench``: see ``--help`` and docs/benchmarks.md."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _ints(text: str):
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        out.append(int(part) * mult)
    return out


def _names(allowed):
    def parse(text: str):
        names = [t.strip() for t in text.split(",") if t.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return names

    return parse


def _causal(text: str):
    t = text.strip().lower()
    return {"both": [False, True], "true": [True], "yes": [True], "1": [True],
            "false": [False], "no": [False], "0": [False]}[t]


def build_parser() -> argparse.ArgumentParser:
    from .impls import DTYPES, IMPLS, OPS, PASSES

    p = argparse.ArgumentParser(
        prog="python -m ssa_flash.bench",
        description="Benchmark ssa_flash against SDPA, FlexAttention and the naive reference. "
                    "Defaults: docs/design.md §4.1 shapes (bf16, B*L = 16k tokens, 16 heads, D in {64, 128}, "
                    "L in 1k..16k, causal and not) and a memory sweep up to 128k.")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke mode: tiny shapes, the reference, SDPA math and the Triton kernels "
                        "through the interpreter (sets TRITON_INTERPRET=1); its file is named "
                        "<date>-cpu-smoke.json, and its timings are not judged against the GPU targets")
    p.add_argument("--out", default=None,
                   help="output directory (default bench/results under the current directory; "
                        "the path written is printed at the end)")
    p.add_argument("--subset", choices=["targets"], default=None,
                   help="targets: only the rows docs/design.md's targets are judged on (other options narrow it further)")
    p.add_argument("--seqlens", type=_ints, default=None, help="comma list, e.g. 1k,2k,4k")
    p.add_argument("--headdims", type=_ints, default=None, help="comma list, e.g. 64,128")
    p.add_argument("--batch-tokens", type=int, default=None, help="batch = batch_tokens // seqlen (default 16384)")
    p.add_argument("--heads", type=int, default=None, help="number of heads (default 16)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (float32 in --smoke)")
    p.add_argument("--causal", type=_causal, default=None, help="both (default), true or false")
    p.add_argument("--ops", type=_names(OPS), default=None, help=f"comma list of {','.join(OPS)}")
    p.add_argument("--impls", type=_names(IMPLS), default=None, help=f"comma list of {','.join(IMPLS)}")
    p.add_argument("--passes", type=_names(PASSES), default=None, help=f"comma list of {','.join(PASSES)}")
    p.add_argument("--memory-max-seqlen", type=_ints, default=None,
                   help="memory sweep over powers of two from 1k up to this (default 128k; 0 disables)")
    p.add_argument("--memory-impls", type=_names(IMPLS), default=None,
                   help="implementations in the memory sweep (default ssa_flash.triton,ssa_flash.cuda,"
                        "sdpa.flash,reference)")
    p.add_argument("--memory-ops", type=_names(OPS), default=None, help="operations in the memory sweep (default all)")
    p.add_argument("--phases", type=_names(("speed", "memory", "flex", "others", "learned_bias")), default=None,
                   help="the benchmark's phases in the order to run them, those left out not run (default "
                        "speed,memory,learned_bias,flex,others: ours and sdpa.flash, the memory sweep, softmax "
                        "with a learned (H, L, L) bias beside sdpa.efficient (GPU only), FlexAttention, the other "
                        "SDPA backends and the reference); e.g. memory,flex,speed to reach the rows "
                        "a time budget would cut")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25)")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition time (default 100)")
    p.add_argument("--matmul-size", type=int, default=None, help="square matmul size for the reference rate (default 8192)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; rows not started by then are kept with a 'skipped' note")
    p.add_argument("--gpu-tests-json", default=None,
                   help='JSON file {"passed", "failed", "skipped"} from the GPU test run, folded into the results')
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--from-json", default=None,
                   help="do not measure: print the tables (and plots unless --no-plots) of an existing results file")
    p.add_argument("--markdown", action="store_true", help="print the tables as markdown (for docs/benchmarks.md)")
    p.add_argument("--quiet", action="store_true", help="no per-row progress lines")
    p.add_argument("--host", action="store_true",
                   help="measure the host path instead (ssa_flash/bench/host.py): host time of one call per "
                        "function, feature, backend and pass, beside SDPA's; without a GPU the launches are "
                        "stubbed (sets TRITON_INTERPRET=1); writes <date>-<device>-host.json")
    p.add_argument("--host-reps", type=int, default=100, help="calls timed per --host row (default 100)")
    p.add_argument("--host-profile", action="store_true",
                   help="--host: first a cProfile of the plain softmax calls per backend (the top functions by own time)")
    p.add_argument("--host-features", type=_names(("plain", "mask", "dropout", "window", "varlen", "kvcache")),
                   default=None, help="--host: comma list of plain,mask,dropout,window,varlen,kvcache (default all); "
                                      "--ops narrows the functions")
    return p


def _read_gpu_tests(path: str):
    with open(path) as f:
        data = json.load(f)
    out = {k: data.get(k) for k in ("passed", "failed", "skipped")}
    for k in ("errors", "incomplete", "command"):
        if k in data:
            out[k] = data[k]
    return out


def _report(results: dict, out_dir: str, base: str, plots: bool, markdown: bool) -> None:
    from .report import ratio_tables, render_markdown, render_text

    tables = ratio_tables(results)
    print()
    print(render_markdown(tables) if markdown else render_text(tables))
    if plots:
        from .plots import make_plots

        for path in make_plots(results, out_dir, base):
            print(f"plot: {path}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
        out_dir = args.out or os.path.dirname(os.path.abspath(args.from_json))
        base = os.path.splitext(os.path.basename(args.from_json))[0]
        _report(results, out_dir, base, not args.no_plots, args.markdown)
        return 0

    # Decide the device before anything imports Triton: the interpreter must be chosen first.
    import torch

    if args.host:
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
        from .host import FEATURES, OPS, render, run

        results = run(args.out or os.path.join("bench", "results"), reps=args.host_reps, quiet=args.quiet,
                      ops=tuple(args.ops or OPS), features=tuple(args.host_features or FEATURES),
                      profile=args.host_profile)
        if args.quiet:
            print(render(results))
        print(f"wrote {results['path']}")
        return 0

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("no CUDA device: running the CPU smoke mode (--smoke); GPU figures need a GPU",
              file=sys.stderr)
        smoke = True
    if smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            print("warning: triton was imported before TRITON_INTERPRET could be set", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "1"

    from .impls import DTYPES
    from .runner import Config, Runner, result_basename

    if smoke:
        # tiny CPU ops: one thread (OpenMP threads waiting on a shared CPU cost 10-100x at these sizes)
        torch.set_num_threads(1)
        cfg = Config(device="cpu", dtype=torch.float32, seqlens=(16, 32), headdims=(16,), batch_tokens=16,
                     heads=1, causal=(True,), impls=("ssa_flash.triton", "sdpa.flash", "sdpa.math", "reference"),
                     memory_seqlens=(16, 32), memory_impls=("ssa_flash.triton", "reference"),
                     memory_ops=("ssa",), memory_heads=1, memory_headdim=16, matmul_size=256,
                     cpu_reps=1, cpu_warmup=0, smoke=True)
    else:
        cfg = Config(device="cuda")
    if args.subset:
        from .runner import apply_subset

        apply_subset(cfg, args.subset)
    if args.seqlens:
        cfg.seqlens = tuple(args.seqlens)
    if args.headdims:
        cfg.headdims = tuple(args.headdims)
    if args.batch_tokens:
        cfg.batch_tokens = args.batch_tokens
    if args.heads:
        cfg.heads = args.heads
    if args.dtype:
        cfg.dtype = DTYPES[args.dtype]
    if args.causal is not None:
        cfg.causal = tuple(args.causal)
    if args.ops:
        cfg.ops = tuple(args.ops)
    if args.impls:
        cfg.impls = tuple(args.impls)
    if args.passes:
        cfg.passes = tuple(args.passes)
    if args.memory_max_seqlen is not None:
        top = args.memory_max_seqlen[0] if args.memory_max_seqlen else 0
        start = min(cfg.memory_seqlens) if cfg.memory_seqlens else 1024
        cfg.memory_seqlens = tuple(L for L in (start << i for i in range(40)) if L <= top)
    if args.memory_impls:
        cfg.memory_impls = tuple(args.memory_impls)
    if args.memory_ops:
        cfg.memory_ops = tuple(args.memory_ops)
    if args.phases:
        cfg.phases = tuple(dict.fromkeys(args.phases))
    if args.warmup_ms is not None:
        cfg.warmup_ms = args.warmup_ms
    if args.rep_ms is not None:
        cfg.rep_ms = args.rep_ms
    if args.matmul_size:
        cfg.matmul_size = args.matmul_size
    cfg.time_budget_s = args.time_budget
    cfg.quiet = args.quiet
    if args.gpu_tests_json:
        try:
            cfg.gpu_tests = _read_gpu_tests(args.gpu_tests_json)
        except Exception as err:
            print(f"warning: could not read {args.gpu_tests_json}: {err}", file=sys.stderr)

    out_dir = os.path.abspath(args.out or os.path.join("bench", "results"))
    os.makedirs(out_dir, exist_ok=True)
    base = result_basename(torch.device(cfg.device), smoke=cfg.smoke)
    path = os.path.join(out_dir, base + ".json")
    runner = Runner(cfg, out_path=path)
    status = 0
    try:
        results = runner.run()
    except KeyboardInterrupt:  # e.g. `timeout --signal=INT`: keep what was measured
        runner.results["interrupted"] = True
        runner.save()
        results = runner.results
        print(f"\ninterrupted: partial results", file=sys.stderr)
        status = 130
    print(f"\nresults: {path} ({len(results['rows'])} rows, {results.get('elapsed_s')} s)")
    if cfg.smoke:
        print("smoke run: CPU / Triton-interpreter timings, not comparable with GPU figures or targets")
    _report(results, out_dir, base, not args.no_plots, args.markdown)
    return status


if __name__ == "__main__":
    sys.exit(main())
