"""A known kernel through the whole audit: a tiled ``C = A B`` whose loop does one
``BLOCK x BLOCK x BLOCK`` dot per iteration (so ``BLOCK`` tensor multiply-adds per element of
the ``BLOCK x BLOCK`` tile, repeat factor 1). With ``maxnreg`` below what its accumulator needs,
ptxas must spill. Used by the tests to show the audit measures what it claims on real compiler
output, and as a check that the toolchain works here:

    python -m ssa_flash.audit.probe --arch 90 [--block 128 --maxnreg 64]   # prints JSON

Importing this module imports Triton for compiling: it clears ``TRITON_INTERPRET`` first (kernels
defined under the interpreter cannot be compiled).
"""
import argparse
import json
import os
import sys
from types import SimpleNamespace

os.environ.pop("TRITON_INTERPRET", None)

import triton.language as tl  # noqa: E402


def _tiled_matmul(A, B, C, K, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(A + offs[:, None] * K + k + offs[None, :])
        b = tl.load(B + (k + offs[:, None]) * BLOCK + offs[None, :])
        acc += tl.dot(a, b)
    tl.store(C + offs[:, None] * BLOCK + offs[None, :], acc)


def probe(arch: int, block: int = 64, maxnreg=None, k: int = 1024, warps: int = 4) -> dict:
    """Compile and analyse the tiled matmul for ``sm_<arch>`` (fp16 inputs, fp32 accumulator)."""
    import torch
    from triton.runtime.jit import JITFunction

    from ssa_flash.triton.launch import Blocks

    from . import runner

    kernel = JITFunction(_tiled_matmul)
    a = torch.empty(block, k, device="meta", dtype=torch.float16)
    b = torch.empty(k, block, device="meta", dtype=torch.float16)
    c = torch.empty(block, block, device="meta", dtype=torch.float32)
    consts = {"BLOCK": block}
    if maxnreg:
        consts["maxnreg"] = int(maxnreg)  # a compile option, passed like the launcher passes num_warps
    kl = SimpleNamespace(kernel=kernel, args=(a, b, c, k), constexprs=consts, blocks=Blocks(block, block, warps, 2))
    return runner.compile_and_analyse(kl, arch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssa_flash.audit.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--maxnreg", type=int)
    args = p.parse_args(argv)
    json.dump(probe(args.arch, args.block, args.maxnreg), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
