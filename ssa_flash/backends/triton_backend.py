"""The Triton backend: :class:`~ssa_flash.spec.Backend` over ``ssa_flash.triton.launch``.

Runs on CUDA tensors, and on CPU tensors through Triton's interpreter when ``TRITON_INTERPRET=1``
was set before Triton was imported (slow: for tests). Every dtype; head dims up to 256; dense,
packed variable-length (``spec.packed``) and KV-cache (``spec.kv_cache``, split-KV) layouts; dropout
(Philox bits generated in the kernels, regenerated in the backward), windows, attention sinks and
logit soft-capping (compile-time switches: calls without them run the kernels compiled without);
every score function of ``ssa_flash.scores`` (the kernels are compiled per score function,
``triton/logits.py``). No atomics (per-block partial sums of the score parameters' gradients reduced
in a fixed order); ``spec.deterministic`` fixes the block configurations, which are otherwise timed
(see ``ssa_flash.triton.block_choice.launch_kernel``).
Triton is imported on first use, so the package works without it.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import scores
from . import temperature as _temperature
from ..triton.interpreter import interpreting
from ..spec import AttentionSpec, TemperatureState, acc_dtype

__all__ = ["NAME", "MAX_HEAD_DIM", "unavailable_reason", "supports", "row_entropy", "forward", "backward",
           "prepare", "row_dbeta", "backward_given_g", "dropout_mask"]

NAME = "triton"
MAX_HEAD_DIM = 256


_modules: list = []  # ssa_flash.triton.launch once imported (an import statement per call costs ~1 us)


def _launch():
    if not _modules:
        from ..triton import launch  # lazily: Triton is optional

        _modules.append(launch)
    return _modules[0]


def importable() -> bool:
    """Whether ``import triton`` succeeds (it is imported here if nothing imported it yet)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the kernels cannot run on ``device`` in this process, or None.

    ``@triton.jit`` fixes each function's mode when it runs, i.e. when its module is imported
    (Triton 3.4 to 3.9 alike: ``os.environ`` before 3.4, ``triton.knobs`` after): an interpreted
    function under ``TRITON_INTERPRET=1``, a GPU kernel otherwise. Triton's own library functions
    (``triton.language.standard``) are made when Triton is imported, this package's kernels when
    ``ssa_flash.triton`` is. Switching the interpreter on later does not convert them: with 3.9
    a CPU call then fails inside Triton ("Cannot call @triton.jit'd outside of the scope of a
    kernel", or "0 active drivers" on a machine without a GPU). So on the CPU the interpreter must
    be on now and every Triton function already made must be an interpreted one; the reason
    says which was made without it."""
    device = torch.device(device)
    if not importable():
        return "Triton is not installed (pip install triton)"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return (f"tensors on {device} need CUDA, which this process does not have "
                    "(torch.cuda.is_available() is False)")
        return None
    if device.type != "cpu":
        return (f"tensors are on {device}; Triton kernels need a CUDA device, or TRITON_INTERPRET=1 "
                "set before Triton is imported to run them on the CPU")
    import sys

    # The mode of the Triton functions made so far: the first jit function found in each module
    # that makes some (Triton's standard library; this package's kernels once imported).
    from triton.runtime.jit import JITFunction
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # pragma: no cover - every Triton 3.x has it
        InterpretedFunction = ()
    compiled_in, interpreted = [], False
    for name in ("triton.language.standard", "ssa_flash.triton.forward"):
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            if isinstance(value, InterpretedFunction):
                interpreted = True
                break
            if isinstance(value, JITFunction):
                compiled_in.append("Triton" if name.startswith("triton") else "ssa_flash.triton")
                break
    on_now = interpreting()
    if on_now and not compiled_in:
        return None
    if on_now:
        return (f"TRITON_INTERPRET=1 was set after {' and '.join(compiled_in)} had been imported "
                "without it: their @triton.jit functions are GPU kernels, which the interpreter "
                "cannot run on the CPU. Set TRITON_INTERPRET=1 before anything imports triton "
                "(in the shell, or first thing in the script)")
    if interpreted and not compiled_in:
        return (f"tensors are on {device}, but TRITON_INTERPRET was switched off after Triton was "
                "imported under the interpreter; keep TRITON_INTERPRET=1 to run the kernels on "
                "the CPU")
    return (f"tensors are on {device}; Triton kernels need a CUDA device, or TRITON_INTERPRET=1 "
            "set before Triton is imported to run them on the CPU")


def supports(q, k, v, spec: AttentionSpec, sinks=None) -> Optional[str]:
    if spec.score_fn is None:  # every score function of the registry (triton/logits.py has each one's maths)
        return scores.unknown(spec.score)
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return (f"head dims up to {MAX_HEAD_DIM} are supported by the kernels, got query {q.shape[-1]}, "
                f"value {v.shape[-1]}")
    return None


def _layout(launch, spec: AttentionSpec):
    """The kernels' layout: packed sequences, a KV cache, or None (dense)."""
    if spec.packed:
        return launch.Packed(spec.cu_seqlens_q, spec.cu_seqlens_k, int(spec.max_seqlen_q), int(spec.max_seqlen_k))
    if spec.kv_cache:
        return launch.KVCache(spec.seqused_k, spec.k_start, int(spec.num_splits))
    return None


# bfloat16 on the CPU. Triton's interpreter computes ``tl.dot`` on bfloat16 operands wrongly (outputs
# ~1e9 for inputs of magnitude ~3: numpy has no bfloat16), while float16 and float32 are right. So
# bfloat16 CPU calls run the kernels on float32 copies of the bfloat16 tensors and round what the
# GPU kernels return in bfloat16 (the output, dQ, dK, dV) to bfloat16; the statistics stay float32
# as on the GPU. The one difference from a GPU run: the GPU also rounds the probabilities P (and
# dS in the backward) to bfloat16 before their matmuls, as FlashAttention does; here they stay
# float32, which is at least as accurate.


def _emulate_bf16(x) -> bool:
    """Whether ``x`` is a bfloat16 tensor that the interpreter would run (a CPU tensor)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu"


def _f32(x):
    """A float32 copy of a bfloat16 tensor; anything else (None, bool masks, int tensors, float32
    statistics) as it is."""
    return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x


def _bf16(x):
    return None if x is None else x.to(torch.bfloat16)


def row_entropy(q, k, mask, params, sinks, spec: AttentionSpec):
    launch = _launch()
    if _emulate_bf16(q):
        q, k, mask = _f32(q), _f32(k), _f32(mask)
    return launch.row_entropy(q, k, mask, params, spec, _layout(launch, spec), sinks=sinks)


def forward(q, k, v, mask, params, sinks, beta, spec: AttentionSpec):
    launch = _launch()
    if _emulate_bf16(q):
        o, lse = forward(_f32(q), _f32(k), _f32(v), _f32(mask), params, sinks, beta, spec)
        return _bf16(o), lse
    return launch.forward(q, k, v, mask, params, beta if spec.adaptive else None, spec,
                          _layout(launch, spec), sinks=sinks)


def backward(dout, q, k, v, out, lse, dlse, mask, params, sinks, temp: Optional[TemperatureState],
             spec: AttentionSpec, mask_grad_shape=None):
    """``(dq, dk, dv, dparams, dsinks)``; with ``mask_grad_shape`` (a learned float mask, dense
    layout) also the mask's gradient of that 4-D shape, in the accumulation dtype, last."""
    launch = _launch()
    if _emulate_bf16(q):
        dq, dk, dv, dparams, dsinks, *dmask = backward(*map(_f32, (dout, q, k, v, out)), lse, dlse, _f32(mask),
                                                       params, sinks, temp, spec, mask_grad_shape)
        return (_bf16(dq), _bf16(dk), _bf16(dv), dparams, dsinks, *dmask)
    kw = {} if mask_grad_shape is None else {"mask_grad_shape": mask_grad_shape}
    return launch.backward(dout, q, k, v, out, lse, dlse, mask, params, temp if spec.adaptive else None, spec,
                           _layout(launch, spec), sinks=sinks, **kw)


def prepare(q, k, v, mask, params, sinks, spec: AttentionSpec):
    """``spec.Backend.prepare``: ``ssa_flash.triton.prepared``'s launches of the dense call without
    sinks that just ran with these tensors, or None (another layout, sinks, bfloat16 on the
    interpreter, a launch not planned)."""
    if sinks is not None or spec.packed or spec.kv_cache or _emulate_bf16(q):
        return None
    from ..triton import prepared

    temperature_launch = None  # (the torch definition, where backends.temperature uses it)
    if spec.adaptive:
        ent = torch.empty(q.shape[:-1], device=q.device, dtype=acc_dtype(q.dtype))
        if _temperature._fused(ent):
            temperature_launch = _temperature._triton_temperature().plan_launch(ent, spec.poly, spec.threshold)
            if temperature_launch is None:
                return None
    return prepared.prepare(q, k, v, mask, params, spec, temperature_launch)


# spec.KeyShardTemperature: the adaptive temperature's backward over a shard of the keys


def row_dbeta(dout, q, k, v, out, lse, dlse, mask, params, temp: TemperatureState, spec: AttentionSpec):
    launch = _launch()
    if _emulate_bf16(q):
        dout, q, k, v, out, mask = map(_f32, (dout, q, k, v, out, mask))
    return launch.row_dbeta(dout, q, k, v, out, lse, dlse, mask, params, temp,
                            spec)


def backward_given_g(dout, q, k, v, out, lse, dlse, mask, params, temp: TemperatureState, g,
                     spec: AttentionSpec):
    launch = _launch()
    if _emulate_bf16(q):
        dq, dk, dv, dparams = backward_given_g(*map(_f32, (dout, q, k, v, out)), lse, dlse, _f32(mask), params,
                                               temp, g, spec)
        return _bf16(dq), _bf16(dk), _bf16(dv), dparams
    return launch.backward(dout, q, k, v, out, lse, dlse, mask, params, temp,
                           spec, g=g)[:4]


def dropout_mask(rng, shape, dropout_p: float):
    """The kernels' dropout keep-mask ``(B, H, Lq, Lk)`` (bool) for the ``(seed, offset)`` tensor
    ``rng``, materialised by a kernel calling the same mask function (not part of
    :class:`~.spec.Backend`: tests and ``ssa_flash.dropout_mask``)."""
    return _launch().dropout_mask(rng, shape, dropout_p)
