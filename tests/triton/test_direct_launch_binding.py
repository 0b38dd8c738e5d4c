"""Direct launches pass ``CompiledKernel.run`` exactly the arguments Triton's own launch path
passes it: ``JITFunction.run`` binds the call with its binder and hands over every bound argument
in signature order (constexprs included, defaults applied). Checked against the binder of the
installed Triton and of the other Triton versions CI installs (``SSA_FLASH_AUDIT_TRITON``, as the
audit's tests use them), for every attention kernel's launch in a feature-rich call, in a
subprocess without the interpreter (the kernels must be JIT functions)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from attn_testing import compiled_kernels_env  # noqa: E402

SCRIPT = r'''
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from ssa_flash.spec import AttentionSpec, TemperatureState
from ssa_flash.triton import direct, launch

backend = make_backend(GPUTarget("cuda", 90, 32))
meta = dict(device="meta", dtype=torch.bfloat16)
q, k, v = (torch.empty(2, 4, 96, 64, **meta) for _ in range(3))
b = n = torch.empty(4, device="meta")
rng = torch.empty(2, device="meta", dtype=torch.int64)
spec = AttentionSpec(scale=0.125, causal=True, adaptive=True, dropout_p=0.1, dropout_rng=rng,
                     window_left=20, window_right=-1, softcap=30.0, score="ssa")
stat = torch.empty(2, 4, 96, device="meta")
temp = TemperatureState(stat, stat, stat, stat)
with launch.capture_launches(90) as cap:
    launch.row_entropy(q, k, None, (b, n), spec, sinks=b)
    o, lse = launch.forward(q, k, v, None, (b, n), stat, spec, sinks=b)
    launch.backward(o, q, k, v, o, lse, lse, None, (b, n), temp, spec, sinks=b)
checked = 0
for kl in cap:
    binder = create_function_from_signature(kl.kernel.signature, kl.kernel.params, backend)
    bound, _, _ = binder(*kl.args, **kl.constexprs, num_warps=kl.blocks.warps, num_stages=kl.blocks.stages)
    theirs = list(bound.values())
    sig = direct._Signature(kl.kernel)
    assert sig.ok, kl.name
    ours = list(kl.args) + list(sig.tail(kl.constexprs))
    assert len(ours) == len(theirs), (kl.name, len(ours), len(theirs))
    for name, a, t in zip(kl.kernel.arg_names, ours, theirs):
        same = a is t or (not isinstance(a, torch.Tensor) and type(a) is not tuple and a == t) or (
            type(a) is tuple and len(a) == len(t) and all(x is y or x == y for x, y in zip(a, t)))
        assert same, (kl.name, name, a, t)
    checked += 1
import triton
print("checked", checked, "launches with triton", triton.__version__)
'''


OTHER_TRITONS = [p for p in os.environ.get("SSA_FLASH_AUDIT_TRITON", "").split(os.pathsep) if p]


@pytest.mark.parametrize("triton_dir", [None] + OTHER_TRITONS)
def test_direct_launch_arguments_are_tritons_own(triton_dir):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=compiled_kernels_env(triton_dir), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "checked 4 launches" in proc.stdout, proc.stdout
