"""Compile the launches of tests/triton/test_dropout.py::test_gqa_mask_lengths (B=1, Hq=4, Hkv=2,
Lq=34, Lk=19, D=16, dropout 0.45) for sm_90 without a GPU and dump TTIR / TTGIR / LLIR / PTX, with
the launcher's own arguments (launch.capture_launches(90), meta tensors: pointers 16-byte aligned,
unit strides constant, as in a real launch).

    PYTHONPATH=/work/tritons/triton-3.6.0:. python bench/gpu_diag/compile_bool_mask_sm90.py OUT ssa bool
    DT=fp16 DROP=0 PYTHONPATH=. python bench/gpu_diag/compile_bool_mask_sm90.py OUT ssa add 16 16 4 1 fwd

argv: out_dir mode (ssa | ssa_adaptive) mask (bool | add | none) [m n warps stages [kernel]];
env DT=fp32|fp16 (default fp32), DROP=1|0 (default 1). Without m n warps stages: the launcher's
first choice for each kernel (SSA_FLASH_AUTOTUNE=0's choice).
Files: OUT/<kernel>-<mask>-<dtype>-<drop|nodrop>-<m>x<n>w<warps>s<stages>.{ttir,ttgir,llir,ptx}."""
import os
import sys

import torch
from ssa_flash.triton import block_choice, launch, tiles
from ssa_flash.audit import compile as acomp
import triton
out_dir, mode, mk = sys.argv[1], sys.argv[2], sys.argv[3]
force = tuple(int(x) for x in sys.argv[4:8]) if len(sys.argv) > 7 else None
only = sys.argv[8] if len(sys.argv) > 8 else None
os.makedirs(out_dir, exist_ok=True)
adaptive = mode == "ssa_adaptive"
DT = {"fp32": torch.float32, "fp16": torch.float16}[os.environ.get("DT", "fp32")]
DROP = os.environ.get("DROP", "1") == "1"
def meta(*shape, dtype=None):
    dtype = DT if dtype is None else dtype
    return torch.empty(*shape, device="meta", dtype=dtype)
B, H, Hkv, Lq, Lk, D = 1, 4, 2, 34, 19, 16
q, k, v = meta(B, H, Lq, D), meta(B, Hkv, Lk, D), meta(B, Hkv, Lk, D)
ACCT = torch.float32
if mk == "bool":
    mask = meta(Lq, Lk, dtype=torch.bool).expand(B, H, Lq, Lk)
elif mk == "add":
    mask = meta(Lq, Lk).expand(B, H, Lq, Lk)
else:
    mask = None
params = (meta(H, dtype=ACCT), meta(H, dtype=ACCT))
spec = launch.AttentionSpec(scale=D ** -0.5, causal=False, group=2, adaptive=adaptive, score="ssa",
                            **(dict(dropout_p=0.45, dropout_rng=meta(2, dtype=torch.int64)) if DROP else {}))
orig = block_choice.candidate_blocks
if force:
    def pick(*a, **kw):
        return [tiles.Blocks(*force)]
    block_choice.candidate_blocks = pick
with launch.capture_launches(90) as cap:
    beta = meta(B, H, Lq, dtype=ACCT) if adaptive else None
    launch.forward(q, k, v, mask, params, beta, spec)
    o, lse = meta(*q.shape), meta(B, H, Lq, dtype=ACCT)
    temp = launch.TemperatureState(*(meta(B, H, Lq, dtype=ACCT) for _ in range(4))) if adaptive else None
    launch.backward(o, q, k, v, o, lse, None, mask, params, temp, spec)
block_choice.candidate_blocks = orig
for kl in cap:
    if only and kl.name != only:
        continue
    ck, log = acomp._triton_compile(kl.kernel, kl.args, kl.constexprs, kl.blocks.warps, kl.blocks.stages, 90)
    tag = f"{kl.name}-{mk}-{os.environ.get('DT','fp32')}-{'drop' if DROP else 'nodrop'}-{kl.blocks.m}x{kl.blocks.n}w{kl.blocks.warps}s{kl.blocks.stages}"
    for key in ("ttir", "ttgir", "llir", "ptx"):
        with open(os.path.join(out_dir, f"{tag}.{key}"), "w") as f:
            f.write(ck.asm[key])
    ptx = ck.asm["ptx"]
    byte_st = sum("st.shared" in ln and "b8" in ln for ln in ptx.splitlines())
    print(triton.__version__, tag, "shared", ck.metadata.shared, "st.shared.*b8", byte_st, "prmt", ptx.count("prmt"),
          "stmatrix", ptx.count("stmatrix"), flush=True)
