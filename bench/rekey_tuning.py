"""Carry tuned block choices over a kernel edit that does not change their compiled code.

The launcher files each tuned choice (``build/ssa-flash-cache/autotune/*.json`` on the GPU machine,
``ssa_flash.triton.tuning_cache.cache_key``) under the kernel's Triton ``cache_key``: a hash of its source
and of every JIT function it calls. Any edit of a helper, even one reached only under a constexpr
switch the cached specialisation has off (the dropout keep bits, say), changes that hash, and the
next GPU session tunes again (session 4: 16 tunings, 117 s of a 243 s benchmark budget).

This script re-files an entry under the current kernels' hash only where that is exact: for the
entry's specialisation (kernel, constexprs, head dim, dtype) it compiles **every candidate** of the
entry's candidate list with the old sources (git revision ``--old``) and with the current ones, for
the GPU's target (sm_90 for H100/H200), with the Triton version the entry was tuned with, and
re-files the entry only if every candidate's PTX is the same text once its debug information is
left out (:func:`code_text`: line numbers and source paths; ptxas is deterministic, so the machine
code is the same and the timings that chose the entry were timings of it). It also checks that the old sources give the entry's own kernel
hash (the revision is the one the entry was tuned at; ``--trust-old`` for entries filed before
``tuning_cache.kernel_identity``, under Triton's ``cache_key``, which cannot be reproduced off the GPU
machine) and that the captured launch has exactly the
entry's constexprs and candidates. Entries it cannot map to a launch the static audit can capture
(``ssa_flash.audit.specs``: masks, dropout, windows, packed batches... are skipped for now) are left
as they are. The old file stays (a revert finds it).

    python bench/rekey_tuning.py --old REV [--cache build/ssa-flash-cache] \
        [--triton-path /path/to/site-packages-with-triton-3.6] [--dry-run] [--trust-old]

Needs no GPU: Triton compiles for the target on the CPU (as ``python -m ssa_flash.audit`` does).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
ARCH_OF_GPU = {"H100": 90, "H200": 90, "H800": 90, "H20": 90, "GH200": 90, "A100": 80, "A800": 80}


def parse_key(text: str) -> Dict[str, str]:
    """The ``name=value`` lines of a cache key (``tuning_cache.cache_key``) as a dict."""
    return dict(line.split("=", 1) for line in text.split("\n"))


def format_key(fields: Dict[str, str]) -> str:
    return "\n".join(f"{k}={v}" for k, v in fields.items())


def cache_file_name(key: str) -> str:
    """``tuning_cache.cache_path``'s file name for ``key``."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] + ".json"


def gpu_arch(gpu: str) -> Optional[int]:
    return next((arch for name, arch in ARCH_OF_GPU.items() if name in gpu.split()), None)


def group_of(fields: Dict[str, str]) -> str:
    """The specialisation an entry belongs to (what decides its compiled code, less the size bucket)."""
    return json.dumps([fields[k] for k in ("kernel", "name", "head_block", "dtype", "consts", "candidates")])


# ------------------------------------------------------------------------------------------------
# Worker: runs inside one source tree (PYTHONPATH), compiles, prints JSON


_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}
# constexprs whose only value the audit's dense launches capture; any other value: not mapped
_DENSE = {"DROPOUT": "False", "WINDOW": "False", "VARLEN": "0", "MASK_KIND": "0", "SINKS": "False",
          "SOFTCAP": "False", "HAS_DLSE": "False"}


def _variant(fields: Dict[str, str], arch: int):
    """The audit Variant whose launch has ``fields``' specialisation, or a reason string."""
    from ssa_flash import scores
    from ssa_flash.audit import specs

    consts = dict(ast.literal_eval(fields["consts"]))
    for name, dense in _DENSE.items():
        if consts.get(name, dense) != dense:
            return f"{name}={consts[name]} (only dense specialisations are mapped)"
    if fields["dtype"] not in _DTYPE_NAMES:
        return f"dtype {fields['dtype']}"
    score = scores.get(int(consts["SCORE"]))
    adaptive = consts.get("ADAPTIVE", "False") == "True"
    if fields["name"] == "row_entropy":
        adaptive = True  # the statistics pass runs for the tempered variants only
    op = scores.Variant(score, adaptive).name
    return specs.Variant(kernel=fields["name"], op=op, causal=consts["CAUSAL"] == "True", mask="none",
                         head_dim=int(fields["head_block"]), dtype=_DTYPE_NAMES[fields["dtype"]], arch=arch)


def _capture(v, candidate: int):
    """``(launch, consts)``: ``specs.capture(v, candidate)`` as the current tree does it (the
    candidate shifted for ``v.kernel`` only, not for the backward's other kernel), with the running
    tree's launcher; ``consts`` are the constexprs the launcher chose the candidates for (what
    its tuning key lists)."""
    from ssa_flash.audit import specs
    from ssa_flash.triton import block_choice, launch, tuning_cache

    original, seen = block_choice.candidate_blocks, []

    def pick(name, arch, head_block, dtype, consts, *args, **kwargs):
        cands = original(name, arch, head_block, dtype, consts, *args, **kwargs)
        if name not in (v.kernel, v.kernel + "_decode"):
            return cands
        seen.append(dict(consts))
        return cands[candidate:]

    block_choice.candidate_blocks = pick
    try:
        with launch.capture_launches(v.arch) as cap:
            specs._call_host(v)
    finally:
        block_choice.candidate_blocks = original
    found = [kl for kl in cap if kl.name in (v.kernel, v.kernel + "_decode")]
    if len(found) != 1 or len(seen) != 1:
        raise RuntimeError(f"{v.id}: expected one {v.kernel} launch, captured {[kl.name for kl in cap]}")
    return found[0], seen[0]


def _identity(kernel) -> Optional[str]:
    """The tree's ``tuning_cache.kernel_identity`` of ``kernel``; None in trees from before it."""
    from ssa_flash.triton import block_choice, launch, tuning_cache

    fn = getattr(launch, "_kernel_identity", None)
    return fn(kernel) if fn is not None else None


def code_text(ptx: str) -> str:
    """``ptx`` without its debug information (``.file`` / ``.loc`` directives, ``.section .debug_*``
    blocks): the line numbers and the file paths of the sources, which differ between two trees
    holding the same kernels, and which ptxas does not generate code from. The same text gives
    the same SASS (ptxas is deterministic)."""
    out, in_debug = [], False
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") and ".debug" in stripped:
            in_debug = True
        if in_debug:
            if stripped == "}":
                in_debug = False
            continue
        if stripped.startswith((".loc", ".file")):
            continue
        out.append(line)
    return "\n".join(out)


def worker(groups: List[Dict[str, str]], arch: int) -> dict:
    """For each entry's fields: the kernel identity and per-candidate sha256 of the PTX's code (:func:`code_text`) in this tree."""
    import triton

    from ssa_flash.audit import compile as audit_compile
    from ssa_flash.triton import block_choice, launch, tuning_cache

    out = {"triton": triton.__version__, "groups": {}}
    for fields in groups:
        res: dict = {}
        out["groups"][group_of(fields)] = res
        v = _variant(fields, arch)
        if isinstance(v, str):
            res["skip"] = v
            continue
        try:
            first, consts = _capture(v, 0)
        except Exception as err:  # e.g. the old tree lacks the variant
            res["skip"] = f"capture failed: {type(err).__name__}: {err}"
            continue
        got = str(sorted((k, repr(x)) for k, x in consts.items()))
        if got != fields["consts"]:
            res["skip"] = f"the captured launch's constexprs differ: {got}"
            continue
        cands = [tuple(tuning_cache.block_list(c)) for c in dict.fromkeys(first.candidates)]
        if str(cands) != fields["candidates"]:
            res["skip"] = f"the captured candidates {cands} differ"
            continue
        res["kernel"] = _identity(first.kernel)
        res["code"] = {}
        for i, blk in enumerate(cands):
            kl = first if i == 0 else _capture(v, i)[0]
            compiled = audit_compile.compile_launch(kl, arch)
            res["code"][str(list(blk))] = hashlib.sha256(code_text(compiled.ptx).encode()).hexdigest()
    return out


def _run_worker(tree: Path, groups: List[dict], arch: int, triton_path: Optional[str]) -> subprocess.Popen:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([triton_path] if triton_path else [])
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    fd, path = tempfile.mkstemp(suffix=".json", prefix="rekey-groups-")
    with os.fdopen(fd, "w") as f:
        json.dump(groups, f)
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", path, "--arch", str(arch)],
                            cwd=str(tree), env=env, stdout=subprocess.PIPE, text=True)


def _old_tree(rev: str, dest: Path) -> Path:
    """The package sources of ``rev`` under ``dest`` (git archive: no worktree to clean up)."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, "ssa_flash"], cwd=str(ROOT), check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", help="the git revision the entries were tuned at")
    ap.add_argument("--cache", default=str(ROOT / "build" / "ssa-flash-cache"),
                    help="SSA_FLASH_CACHE_DIR (its autotune/ folder is read)")
    ap.add_argument("--triton-path", help="a folder holding the Triton the entries were tuned with")
    ap.add_argument("--dry-run", action="store_true", help="report only, write nothing")
    ap.add_argument("--trust-old", action="store_true",
                    help="entries filed before the launcher named kernels by _kernel_identity (under Triton's "
                         "cache_key, which differed between the GPU machine and this one: not reproducible here): take --old as the "
                         "revision they were tuned at without checking their kernel hash")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--arch", type=int, default=90, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        with open(args.worker) as f:
            groups = json.load(f)
        os.unlink(args.worker)
        print(json.dumps(worker(groups, args.arch)))
        return 0
    if not args.old:
        ap.error("--old is required")

    folder = Path(args.cache) / "autotune"
    entries = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            entries.append((path, data, parse_key(data["key"])))
        except (OSError, ValueError, KeyError):
            print(f"{path.name}: unreadable, left alone")
    by_arch: Dict[int, Dict[str, dict]] = {}
    for _, _, fields in entries:
        arch = gpu_arch(fields.get("gpu", ""))
        if arch is not None:
            by_arch.setdefault(arch, {})[group_of(fields)] = fields

    results: Dict[int, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="rekey-old-") as tmp:
        old = _old_tree(args.old, Path(tmp))
        for arch, groups in by_arch.items():
            procs = [_run_worker(tree, list(groups.values()), arch, args.triton_path) for tree in (old, ROOT)]
            outs = []
            for p in procs:
                text, _ = p.communicate()
                if p.returncode:
                    print(f"worker failed (exit {p.returncode})")
                    return 1
                outs.append(json.loads(text.strip().splitlines()[-1]))
            results[arch] = tuple(outs)

    moved = kept = 0
    for path, data, fields in entries:
        arch = gpu_arch(fields.get("gpu", ""))
        if arch is None:
            print(f"{path.name}: GPU {fields.get('gpu')!r} has no known target, left alone")
            kept += 1
            continue
        old_out, new_out = results[arch]
        g = group_of(fields)
        why = None
        if old_out["triton"] != fields.get("triton") or new_out["triton"] != fields.get("triton"):
            why = f"tuned with Triton {fields.get('triton')}, compiled with {old_out['triton']}"
        o, n = old_out["groups"][g], new_out["groups"][g]
        why = why or o.get("skip") or n.get("skip")
        if not why and o["kernel"] != fields["kernel"] and not (args.trust_old and o["kernel"] is None):
            why = (f"--old gives kernel {str(o['kernel'])[-12:]}, the entry has {fields['kernel'][-12:]}"
                   if o["kernel"] else "--old has no tuning_cache.kernel_identity (see --trust-old)")
        if not why and o["code"] != n["code"]:
            diff = [b for b in o["code"] if o["code"][b] != n["code"].get(b)]
            why = f"compiled code differs for {diff}"
        if not why and n["kernel"] == fields["kernel"]:
            why = "already at the current kernel hash"
        if why:
            print(f"{path.name} ({fields['name']}): left alone: {why}")
            kept += 1
            continue
        new_fields = dict(fields, kernel=n["kernel"])
        new_key = format_key(new_fields)
        target = folder / cache_file_name(new_key)
        print(f"{path.name} ({fields['name']}, {len(n['code'])} kernels of identical code) -> {target.name}")
        if not args.dry_run:
            target.write_text(json.dumps(dict(data, key=new_key)))
        moved += 1
    print(f"{moved} re-filed, {kept} left alone{' (dry run)' if args.dry_run else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
