"""tests/triton/test_dropout.py::test_gqa_mask_lengths[ssa]'s launches (forward, dQ, dK/dV), compiled
for sm_90 with the launcher's own arguments and run through ptx_lockstep.py (a CPU interpreter of
the PTX, one CTA at a time): output, LSE and gradients against ssa_flash.reference with the
kernels' keep mask. No GPU needed (3 s to minutes per configuration on 2 cores).

    PYTHONPATH=/work/tritons/triton-3.6.0:. python bench/gpu_diag/check_ptx_library.py [m n warps stages]
    DT=fp16 DROP=0 PYTHONPATH=... python bench/gpu_diag/check_ptx_library.py 16 16 4 1

Without a configuration: the launcher's first sm_90 choice for each kernel (the failing test's
32x32 w4 s3 forward, 32x32 w4 s2 backward kernels); with one, every kernel forced to it. env DT
fp32 (default) | fp16, DROP 1 (default, p = 0.45) | 0. The backward runs on the reference's
output (each kernel checked on its own). Prints the max |error| of out, lse, dq, dk, dv; exit
status 1 when one is off (1e-4 for fp32, 1e-2 for fp16).
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
import ptx_lockstep as P  # noqa: E402
from ssa_flash import reference  # noqa: E402
from ssa_flash.audit import compile as acomp  # noqa: E402
from ssa_flash.spec import AttentionSpec  # noqa: E402
from ssa_flash.triton import block_choice, launch, tiles  # noqa: E402


def _leaves(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _leaves(y)
    else:
        yield x


def simulate(launches, verbose=True):
    """Runs each captured launch's sm_90 PTX in order on the CPU; the tensors' storages are the
    global memory (addresses = their CPU addresses), written back at the end."""
    gmem, storages = {}, []
    for kl in launches:
        for x in _leaves(kl.args):
            if isinstance(x, torch.Tensor):
                st = x.untyped_storage()
                if st.data_ptr() not in gmem:
                    gmem[st.data_ptr()] = bytearray(bytes(st))
                    storages.append(st)
    for kl in launches:
        ck, _ = acomp._triton_compile(kl.kernel, kl.args, kl.constexprs, kl.blocks.warps, kl.blocks.stages, 90)
        prog = P.Program(ck.asm["ptx"])
        # PTX parameters: the launch's leaves minus what Triton specialised away (None, ints
        # equal to 1), then Triton's scratch pointers
        vals = [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in _leaves(kl.args)
                if not (x is None or (isinstance(x, int) and not isinstance(x, bool) and x == 1))]
        types = [t for t, _ in prog.params]
        names = [nm for _, nm in prog.params]
        assert len(types) >= len(vals) and all(t == "u64" for t in types[len(vals):]), \
            (kl.name, len(vals), types)
        for i, (t, x) in enumerate(zip(types, vals)):
            if t == "f32":
                vals[i] = P._from_f32(float(x))
            elif isinstance(x, float):
                raise TypeError(f"{kl.name}: parameter {i} ({t}) got a float")
            else:
                vals[i] = int(x) & ((1 << 64) - 1)
        vals += [0] * (len(names) - len(vals))
        grid = tuple(kl.grid) + (1,) * (3 - len(kl.grid))
        if verbose:
            print(f"  {kl.name}: {kl.blocks}, grid {grid}, {len(prog.instrs)} PTX instructions", flush=True)
        for z in range(grid[2]):
            for y in range(grid[1]):
                for x in range(grid[0]):
                    cta = P.CTA(prog, 32 * kl.blocks.warps, dict(zip(names, vals)), gmem, ctaid=(x, y, z))
                    cta.nctaid = grid
                    cta.run()
    for st in storages:
        st.copy_(torch.UntypedStorage.from_buffer(bytes(gmem[st.data_ptr()]), dtype=torch.uint8))


def main():
    force = tuple(int(a) for a in sys.argv[1:5]) if len(sys.argv) > 4 else None
    dt = {"fp32": torch.float32, "fp16": torch.float16}[os.environ.get("DT", "fp32")]
    drop = os.environ.get("DROP", "1") == "1"
    tol = 1e-4 if dt == torch.float32 else 1e-2
    B, H, Hkv, Lq, Lk, D, seed, offset = 1, 4, 2, 34, 19, 16, 1234567, 3
    p = 0.45 if drop else 0.0
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Lq, D, generator=g).to(dt)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(dt)
    v = torch.randn(B, Hkv, Lk, D, generator=g).to(dt)
    do = torch.randn(B, H, Lq, D, generator=g).to(dt)
    allowed = torch.rand(Lq, Lk, generator=torch.Generator().manual_seed(2)) > 0.25
    allowed[5] = False
    mask = allowed.expand(B, H, Lq, Lk)
    b = 0.5 + torch.rand(H, generator=g)
    n = 1.0 + 1.5 * torch.rand(H, generator=g)
    rng = torch.tensor([seed, offset], dtype=torch.int64)
    spec = AttentionSpec(scale=D ** -0.5, causal=False, group=H // Hkv, adaptive=False, score="ssa",
                         **(dict(dropout_p=p, dropout_rng=rng) if drop else {}))
    orig = block_choice.candidate_blocks
    if force:
        block_choice.candidate_blocks = lambda *a, **kw: [tiles.Blocks(*force)]
    print(f"triton {triton.__version__}, sm_90 PTX of test_gqa_mask_lengths[ssa]'s launches ({dt}, bool mask, "
          f"dropout {p}) under the lockstep interpreter", flush=True)
    keep = reference.dropout_keep_mask(seed, offset, (B, H, Lq, Lk), p) if drop else None
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = reference.attention(*leaves, mask, dropout_p=p, enable_gqa=True, score="ssa",
                                         score_params=(b.double(), n.double()), return_lse=True, dropout_mask=keep)
    ref_grads = torch.autograd.grad((ref_o * do.double()).sum(), leaves)
    try:
        with launch.capture_launches(90) as cap:
            o, lse = launch.forward(q, k, v, mask, (b, n), None, spec)
        simulate(cap)
        # the backward gets the true output (each kernel checked on its own: dQ and dK depend on
        # delta = rowsum(dO * O))
        with launch.capture_launches(90) as cap:
            dq, dk, dv, _, _ = launch.backward(do, q, k, v, ref_o.detach().to(dt), lse, None, mask, (b, n), None, spec)
        simulate(cap)
    finally:
        block_choice.candidate_blocks = orig
    fin = torch.isfinite(ref_lse)
    errs = {"out": (o.double() - ref_o).abs().max().item(),
            "lse": (lse.double()[fin] - ref_lse[fin]).abs().max().item()}
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        errs[name] = (got.double() - ref).abs().max().item()
    bad = [name for name, e in errs.items() if not e < tol]
    print(" ".join(f"{name} max err {e:.3g}" for name, e in errs.items()), "->",
          f"WRONG IN PTX: {bad}" if bad else "ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
