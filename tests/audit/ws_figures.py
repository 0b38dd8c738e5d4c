"""Compile the forward kernel's first choice and its warp-specialised candidate for sm_90 and print
the audit's figures of both as JSON (a subprocess of tests/audit/test_audit_ws.py: the tests run
Triton's interpreter, which cannot compile). Arguments: ``op:causal:head_dim:dtype`` items."""
import json
import sys

from ssa_flash.audit import runner, specs


def figures(r):
    gated = r["loops"][r["gated_loop"]] if r.get("gated_loop") is not None else None
    return {"blocks": r["blocks"], "threads": r["threads"], "registers": r["registers"],
            "spill_bytes": r["spill_store_bytes"] + r["spill_load_bytes"], "spills": r["spills"],
            "shared_bytes": r["shared_bytes"], "fits": r["fits"], "warnings": r["warnings"],
            "warp_specialized": r.get("warp_specialized"),
            "per_element": gated["per_element"]["total"] if gated else None,
            "mufu_per_element": gated["per_element"].get("mufu") if gated else None,
            "macs_per_element": gated["tensor"]["macs_per_element"] if gated else None,
            "loops": [(lp["instructions"], lp["per_element"]["total"]) for lp in r["loops"]]}


def main(items):
    out = {}
    for item in items:
        op, causal, d, dtype = item.split(":")
        v = specs.Variant("fwd", op, causal == "1", "none", int(d), dtype, 90)
        first = specs.capture(v)
        ws = [i for i, c in enumerate(first.candidates) if c.ws]
        row = {"first": figures(runner._cached(v, first, True, None)), "ws_index": ws}
        if ws:
            kl = specs.capture(v, ws[0])
            row["ws"] = figures(runner._cached(v, kl, True, None))
        out[item] = row
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
