"""``python -m ssa_flash.audit``: the static audit of the compiled kernels (no GPU needed).

Compiles every kernel specialisation the Triton launcher can choose (and the CUDA C++ kernels when
nvcc is present) for the target GPUs, prints a table (stdout) and writes
``bench/results/audit-sm<arch>.json``. Progress goes to stderr. A static bound, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

# Kernels defined while TRITON_INTERPRET is set are interpreted functions that cannot be compiled;
# nothing has imported Triton yet here (``import ssa_flash`` does not).
os.environ.pop("TRITON_INTERPRET", None)

from . import report, runner, specs  # noqa: E402


def _bool_axis(text: str):
    return {"both": [False, True], "true": [True], "false": [False], "yes": [True], "no": [False]}[text.lower()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ssa_flash.audit",
        description="Static audit of the compiled attention kernels: registers, spills, shared memory, ptxas "
                    "warnings, tensor-core instructions and the instruction mix per score element of each main "
                    "loop, and the throughput bound these allow (docs/design.md §4.3). Compiles on the CPU; it is a "
                    "static bound, never a measurement.")
    p.add_argument("--arch", default="80,90", help="compute capabilities, e.g. 80,90 (also 75, 86, 89, 100, 120: "
                   "resources and counts, no bound model)")
    p.add_argument("--kernels", help=f"subset of {','.join(specs.KERNELS)}")
    p.add_argument("--ops", help=f"subset of {','.join(specs.OPS)}")
    p.add_argument("--causal", default="both", choices=["both", "true", "false"])
    p.add_argument("--masks", help=f"subset of {','.join(specs.MASKS)}")
    p.add_argument("--dims", help=f"head dims (default {','.join(map(str, specs.HEAD_DIMS))})")
    p.add_argument("--dtypes", help=f"subset of {','.join(specs.DTYPES)} (also fp32: float32 with IEEE dots, "
                   "tf32: float32 under torch's 'high' matmul precision)")
    p.add_argument("--features", help=f"feature switches, e.g. none,dropout+window (from {','.join(specs.FEATURES)}; "
                   "default none)")
    p.add_argument("--gqa", default="1", help="query heads per key/value head, e.g. 1,4 (default 1)")
    p.add_argument("--seqlen", type=int, default=4096, help="Lq = Lk of the audited launches (default 4096)")
    p.add_argument("--selection", metavar="FILE",
                   help="a JSON list of specialisations (Variant fields: kernel, op, causal, mask, head_dim, "
                        "dtype, arch[, seqlen, group]) instead of the axes above")
    p.add_argument("--quick", action="store_true",
                   help="the gated configurations only: sm_90, bf16, head dims 64 and 128, no mask (every "
                        "kernel and variant, causal or not), and the CUDA C++ kernels likewise narrowed "
                        "(sm_90a, the bf16 units built for head dims 64 and 128 only, without the "
                        "soft-capping / sink instances). A few minutes on a cold cache with 2 cores; "
                        "no JSON unless --out is given")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile processes")
    p.add_argument("--all-candidates", action="store_true",
                   help="compile every block configuration the launcher may fall back to, not only its choice")
    p.add_argument("--no-cache", action="store_true", help="recompile everything (cache: $SSA_FLASH_AUDIT_CACHE "
                   "or ~/.cache/ssa_flash/audit)")
    p.add_argument("--out", help="directory for audit-sm<arch>.json (default bench/results for a full run; a "
                   "filtered run writes JSON only when --out is given)")
    p.add_argument("--no-json", action="store_true", help="write no JSON")
    p.add_argument("--interior-only", action="store_true", help="table: only the gated (interior / main) loop")
    p.add_argument("--dump-sass", metavar="DIR", help="also write each kernel's SASS, ptxas log and Triton IR")
    p.add_argument("--cuda", choices=["auto", "yes", "no", "only"], default="auto",
                   help="CUDA C++ kernels (csrc/*.cu, needs nvcc): auto = when nvcc is found. --quick, "
                        "--dtypes and --dims narrow the units and head dims compiled; nvcc reports "
                        "progress while it runs (a backward unit takes minutes)")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"),
                   help="print a before/after table of two audit JSON files and exit")
    p.add_argument("--threshold", type=float, default=0.005, help="--compare: relative change to report")
    p.add_argument("--from-json", nargs="+", metavar="FILE", help="print the table of existing audit JSON files "
                   "(no compiling)")
    p.add_argument("--markdown", action="store_true", help="tables as markdown: the interior / main loop of each "
                   "specialisation")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def selection(args) -> tuple:
    """``(variants, filtered, archs)`` from the command line."""
    if args.selection:
        with open(args.selection) as f:
            chosen = [specs.Variant(**d) for d in json.load(f)]
        return chosen, True, sorted({v.arch for v in chosen})
    archs = specs.parse_list(args.arch, [], int)
    kw = dict(archs=archs)
    if args.quick:
        kw.update(archs=[90], dtypes=["bf16"], head_dims=[64, 128], masks=["none"])
    if args.kernels:
        kw["kernels"] = specs.parse_list(args.kernels, specs.KERNELS)
    if args.ops:
        kw["ops"] = specs.parse_list(args.ops, specs.OPS)
    if args.masks:
        kw["masks"] = specs.parse_list(args.masks, specs.MASKS)
    if args.dims:
        kw["head_dims"] = specs.parse_list(args.dims, [], int)
    if args.dtypes:
        kw["dtypes"] = specs.parse_list(args.dtypes, ["bf16", "fp16", "fp32", "tf32"])
    if args.features:
        kw["features"] = specs.parse_list(args.features, [])
    kw["causal"] = _bool_axis(args.causal)
    kw["groups"] = specs.parse_list(args.gqa, [], int)
    kw["seqlen"] = args.seqlen
    filtered = bool(args.quick or args.kernels or args.ops or args.masks or args.dims or args.dtypes or args.features
                    or args.causal != "both" or args.gqa != "1" or args.seqlen != 4096)
    return specs.variants(**kw), filtered, kw["archs"]


def cuda_scope(args):
    """``(dtypes, head_dims, extras)`` of the CUDA C++ section: what ``--quick``, ``--dtypes`` and
    ``--dims`` select (None: everything), the soft-capping / sink instances only when no narrowing
    was asked for or ``--features`` names them."""
    dtypes = head_dims = None
    extras = True
    if args.quick:
        dtypes, head_dims, extras = ["bf16"], [64, 128], False
    if args.dtypes:
        dtypes = [d for d in specs.parse_list(args.dtypes, ["bf16", "fp16", "fp32", "tf32"]) if d in ("bf16", "fp16")]
    if args.dims:
        head_dims = specs.parse_list(args.dims, [], int)
    if args.features:
        extras = any(f in feature for feature in specs.parse_list(args.features, []) for f in ("softcap", "sinks"))
    elif args.dtypes or args.dims:
        extras = False
    return dtypes, head_dims, extras


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        print(report.compare(report.load(args.compare[0]), report.load(args.compare[1]), args.threshold))
        return 0
    if args.from_json:
        for path in args.from_json:
            doc = report.load(path)
            results = doc["results"]
            print(report.markdown_table(results, doc["arch"]) if args.markdown
                  else report.text_report(results, doc["arch"], all_loops=not args.interior_only))
            print()
        return 0
    variants, filtered, archs = selection(args)
    progress = None if args.quiet else runner.stderr_progress
    status = 0
    results = []
    start = time.monotonic()
    if args.cuda != "only":
        if progress:
            progress(f"ssa_flash.audit: {len(variants)} Triton specialisations, {args.jobs} processes "
                     "(static bound, not a measurement)")
        results = runner.run(variants, jobs=args.jobs, all_candidates=args.all_candidates,
                             use_cache=not args.no_cache, dump_dir=args.dump_sass, progress=progress)
        for arch in archs:
            print(report.markdown_table(results, arch) if args.markdown
                  else report.text_report(results, arch, all_loops=not args.interior_only))
            print()
        errors = [r for r in results if r.get("error")]
        for r in errors:
            print(f"ERROR {r['id']}: {r['error']}", file=sys.stderr)
        status = 1 if errors else 0
    cuda_results = {}
    if args.cuda != "no":
        from . import cuda as cuda_audit

        why = cuda_audit.unavailable()
        if why:
            msg = f"CUDA C++ section skipped: {why}"
            if args.cuda in ("yes", "only"):
                print(msg, file=sys.stderr)
                status = status or 2
            elif progress:
                progress(msg)
        else:
            dtypes, head_dims, extras = cuda_scope(args)
            files = cuda_audit.scope_files(cuda_audit.source_dir(), dtypes)
            flags = cuda_audit.scope_flags(head_dims, extras)
            if progress:
                progress(f"ssa_flash.audit: CUDA C++ kernels, {len(files)} nvcc units per architecture "
                         f"({', '.join(f.name for f in files)}{'; ' + ' '.join(flags) if flags else ''}); "
                         "nvcc says every few seconds that it is still compiling")
            for arch in archs:
                cuda_results[arch] = cuda_audit.audit(arch, progress=progress, dump_dir=args.dump_sass,
                                                     files=files, jobs=args.jobs, use_cache=not args.no_cache,
                                                     extra_flags=flags) if files else {
                                                         "skipped": "no CUDA C++ kernels of the selected dtypes"}
                print(cuda_audit.text_report(cuda_results[arch], arch))
                print()
    filtered = filtered or args.cuda == "only"
    out = args.out or (None if filtered else report.default_out_dir())
    if not args.no_json and out:
        for arch in archs:
            extra = {"selection": {"filtered": filtered, "argv": sys.argv[1:] if argv is None else list(argv)},
                     "cuda": cuda_results.get(arch)}
            path = report.write_document(report.document(results, arch, extra), out)
            if progress:
                progress(f"wrote {path}")
    elif filtered and not args.no_json and progress:
        progress("filtered run: no JSON written (give --out DIR to write one)")
    if progress:
        progress(f"done in {time.monotonic() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
