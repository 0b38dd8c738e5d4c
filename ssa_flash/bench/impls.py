"""What is benchmarked: the operations, the implementations, and how to build a call of one.

Operations (docs/design.md §4.2 ``op``): the variants of ``ssa_flash.scores`` (every score function
with and without the adaptive temperature): ``softmax``, ``adaptive`` (softmax with the adaptive
temperature), ``ssa``, ``ssa_adaptive``, ``logit_scale``, ``logit_scale_adaptive``.
Implementations (``impl``):

* ``ssa_flash.triton``, ``ssa_flash.cuda``: our backends, through the public functions
  (``ssa_flash.cuda``: today's CUDA kernels, csrc/fwd_kernel.h and csrc/bwd_kernel.h, the sm_90a
  warp-specialised ones forced off).
* ``ssa_flash.cuda_ws``: the CUDA backend with the sm_90a warp-specialised forward and backward
  (csrc/hopper/) forced on (ssa_flash/backends/cuda_fwd_choice.py, ``forced``), wherever each takes
  the call (sm_90, padded head dim 64 / 128, an extension built with them; the backward: softmax or
  SSA, D = Dv): its ``fwd`` rows time the new forward, its ``bwd`` / ``fwd_bwd`` rows the new
  backward too (the choice table's ``"fwd_bwd"`` rows come from those).
* ``sdpa.flash``, ``sdpa.efficient``, ``sdpa.cudnn``, ``sdpa.math``: PyTorch SDPA pinned to one
  backend with ``torch.nn.attention.sdpa_kernel`` (softmax only). ``sdpa.flash`` (FlashAttention-2)
  and ``sdpa.cudnn`` (cuDNN's fused attention, what SDPA picks by default on Hopper with a recent
  cuDNN) are the baselines users would pick instead; the runner measures them with ours.
* ``flex``: ``torch.compile``d FlexAttention computing SSA with a ``score_mod`` that reads per-head
  ``b``, ``n`` tensors requiring grad (a block mask for causality).
* ``reference``: ``backend="reference"``, the specification with its explicit backward
  (``ssa_flash.backends.reference_backend``: every score materialised, accumulated in float32).

One more operation outside the variants, :data:`LEARNED_BIAS_OP` (the runner's ``learned_bias``
phase, GPU only): softmax with a learned additive ``(H, L, L)`` bias that requires grad (T5 / Swin
style), forward + backward, the bias's gradient included: ``ssa_flash.triton`` and ``ssa_flash.cuda``
(their mask-gradient kernels, ``ssa_flash/triton/mask_grad.py``, ``csrc/mask_grad.h``) beside
``sdpa.efficient`` with the same bias.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..scores import SCORES, SSA, VARIANTS

OPS = tuple(VARIANTS)
IMPLS = ("ssa_flash.triton", "ssa_flash.cuda", "ssa_flash.cuda_ws", "sdpa.flash", "sdpa.cudnn", "sdpa.efficient",
         "sdpa.math", "flex", "reference")
PASSES = ("fwd", "bwd", "fwd_bwd")
SDPA_IMPLS = ("sdpa.flash", "sdpa.cudnn", "sdpa.efficient", "sdpa.math")

LEARNED_BIAS_OP = "softmax_learned_bias"
LEARNED_BIAS_IMPLS = ("ssa_flash.triton", "ssa_flash.cuda", "sdpa.efficient")

# which operations each implementation computes; other (op, impl) pairs produce no row
IMPL_OPS = {
    "ssa_flash.triton": OPS + (LEARNED_BIAS_OP,),
    "ssa_flash.cuda": OPS + (LEARNED_BIAS_OP,),
    "ssa_flash.cuda_ws": OPS,
    "reference": OPS,
    "flex": ("ssa",),
    **{name: ("softmax",) for name in SDPA_IMPLS},
    "sdpa.efficient": ("softmax", LEARNED_BIAS_OP),
}


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
          "fp64": torch.float64, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    headdim: int
    causal: bool
    dtype: torch.dtype

    def describe(self) -> str:
        return (f"{dtype_name(self.dtype)} B={self.batch} H={self.heads} L={self.seqlen} "
                f"D={self.headdim}{' causal' if self.causal else ''}")

    def io_bytes(self) -> int:
        """Bytes of q, k, v, o, dO, dq, dk, dv (input dtype) and lse (float32): the floor of any
        forward+backward's memory (docs/design.md §4.1's memory target)."""
        elems = self.batch * self.heads * self.seqlen * self.headdim
        return 8 * elems * torch.empty((), dtype=self.dtype).element_size() + \
            self.batch * self.heads * self.seqlen * 4


class NotRunnable(Exception):
    """This implementation cannot run this row here (missing backend, unsupported input)."""


def uses_ssa(op: str) -> bool:
    return VARIANTS[op].score is SSA


def uses_adaptive(op: str) -> bool:
    return VARIANTS[op].adaptive


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    params: Dict[str, Tuple[torch.Tensor, ...]]
    """per score function (by name), its per-head parameters, each ``(H,)`` at the registry's
    example value (SSA: the paper's initialisation b = 1, n = 1.5), requiring grad; the inputs of
    one shape serve every operation"""


def make_inputs(shape: Shape, device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = (shape.batch, shape.heads, shape.seqlen, shape.headdim)

    def rnd(grad: bool) -> torch.Tensor:
        x = torch.randn(dims, generator=gen, device=device, dtype=shape.dtype)
        return x.requires_grad_(grad)

    q, k, v, dout = rnd(True), rnd(True), rnd(True), rnd(False)
    acc = torch.float64 if shape.dtype == torch.float64 else torch.float32
    params = {f.name: tuple(torch.full((shape.heads,), e, device=device, dtype=acc, requires_grad=True)
                            for e in f.example) for f in SCORES.values()}
    return Inputs(q, k, v, dout, params)


def availability(impl: str, device: torch.device) -> Optional[str]:
    """None when ``impl`` can be tried on ``device``; otherwise the reason it cannot."""
    import ssa_flash

    if impl == "ssa_flash.triton":
        if "triton" not in ssa_flash.available_backends(device):
            return "triton backend unavailable here (CPU tensors need TRITON_INTERPRET=1)"
        return None
    if impl == "ssa_flash.cuda_ws":
        why = availability("ssa_flash.cuda", device)
        if why is not None:
            return why
        if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
            return "the warp-specialised kernels run on sm_90 only"
        from ssa_flash.backends import cuda_backend

        if not cuda_backend.hopper_fwd_state(device).get("built"):
            return "the CUDA extension was built without the sm_90a kernels (SSA_FLASH_HOPPER_FWD=0)"
        return None
    if impl == "ssa_flash.cuda":
        if "cuda" not in ssa_flash.available_backends(device):
            from ssa_flash import cuda as cuda_backend

            return "unavailable: " + cuda_backend.unavailable_reason(device)
        return None
    if impl == "flex":
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except Exception as err:  # older torch
            return f"FlexAttention not importable: {err}"
        if device.type != "cuda":
            return "flex: compiled FlexAttention is benchmarked on CUDA only"
        return None
    if impl in SDPA_IMPLS:
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as err:
            return f"torch.nn.attention.sdpa_kernel not importable: {err}"
        return None
    if impl == "reference":
        return None
    raise ValueError(f"unknown impl {impl!r}")


def _sdpa_backend(impl: str):
    from torch.nn.attention import SDPBackend

    return {"sdpa.flash": SDPBackend.FLASH_ATTENTION,
            "sdpa.efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa.cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa.math": SDPBackend.MATH}[impl]


_flex_compiled = None


def _flex_fn():
    """``torch.compile(flex_attention)``, created once; recompiles per shape (static shapes)."""
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def ssa_score_mod(b: torch.Tensor, n: torch.Tensor):
    """FlexAttention ``score_mod`` for SSA: ``phi(z) = n_h sgn(z) log1p(b_h |z|)`` on the scaled
    score, with ``b``, ``n`` per-head tensors captured (gradients flow to them)."""
    def score_mod(score, batch, head, q_idx, kv_idx):
        return n[head] * torch.sign(score) * torch.log1p(b[head] * torch.abs(score))

    return score_mod


def _causal_block_mask(seqlen_q: int, seqlen_k: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(batch, head, q_idx, kv_idx):
        return q_idx >= kv_idx

    try:  # _compile avoids materialising the dense (Lq, Lk) mask while building the block mask
        return create_block_mask(causal, None, None, seqlen_q, seqlen_k, device=device, _compile=True)
    except TypeError:
        return create_block_mask(causal, None, None, seqlen_q, seqlen_k, device=device)


@dataclass
class Call:
    """A ready-to-time forward: ``forward()`` returns the output; ``grad_inputs`` are the tensors
    the backward differentiates (q, k, v, and b, n for SSA); ``context()`` wraps every call."""

    forward: Callable[[], torch.Tensor]
    grad_inputs: List[torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager]


def build_call(op: str, impl: str, shape: Shape, inputs: Inputs, device: torch.device) -> Call:
    """The forward of ``op`` by ``impl`` on ``inputs``. Raises ``NotRunnable`` when not possible."""
    import ssa_flash

    why = availability(impl, device)
    if why is not None:
        raise NotRunnable(why)
    if op not in IMPL_OPS[impl]:
        raise NotRunnable(f"{impl} does not compute {op}")
    if op == LEARNED_BIAS_OP:
        return _learned_bias_call(impl, shape, inputs, device)
    q, k, v, params = inputs.q, inputs.k, inputs.v, inputs.params[VARIANTS[op].score.name]
    causal = shape.causal
    grads = [q, k, v, *params]
    nullctx = contextlib.nullcontext

    if impl in ("ssa_flash.triton", "ssa_flash.cuda", "ssa_flash.cuda_ws", "reference"):
        backend = {"ssa_flash.triton": "triton", "ssa_flash.cuda": "cuda", "ssa_flash.cuda_ws": "cuda",
                   "reference": "reference"}[impl]
        variant = VARIANTS[op]
        context = nullctx
        if impl.startswith("ssa_flash.cuda"):
            from ssa_flash.backends import cuda_fwd_choice

            context = functools.partial(cuda_fwd_choice.forced, impl == "ssa_flash.cuda_ws")

        def fwd():
            return ssa_flash.attention(q, k, v, is_causal=causal, score=variant.score.name, score_params=params,
                                       adaptive_temperature=variant.adaptive, backend=backend)
        return Call(fwd, grads, context)

    if impl in SDPA_IMPLS:
        from torch.nn.attention import sdpa_kernel

        backend = _sdpa_backend(impl)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def fwd():
            return sdpa(q, k, v, is_causal=causal)

        return Call(fwd, grads, lambda: sdpa_kernel(backend))

    if impl == "flex":
        flex = _flex_fn()
        block_mask = _causal_block_mask(shape.seqlen, shape.seqlen, device) if causal else None
        score_mod = ssa_score_mod(*params)

        def fwd():
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask)

        return Call(fwd, grads, nullctx)
    raise ValueError(f"unknown impl {impl!r}")


def _learned_bias_call(impl: str, shape: Shape, inputs: Inputs, device: torch.device) -> Call:
    """Softmax attention with a learned ``(H, L, L)`` additive bias requiring grad (the gradient
    inputs: q, k, v and the bias), by ``ssa_flash.triton``, ``ssa_flash.cuda`` or ``sdpa.efficient``."""
    import ssa_flash

    gen = torch.Generator(device=device).manual_seed(1)
    bias = (0.5 * torch.randn((shape.heads, shape.seqlen, shape.seqlen), generator=gen, device=device,
                              dtype=shape.dtype)).requires_grad_()
    q, k, v, causal = inputs.q, inputs.k, inputs.v, shape.causal
    if impl in ("ssa_flash.triton", "ssa_flash.cuda"):
        backend = impl.split(".")[1]

        def fwd():
            return ssa_flash.softmax_attention(q, k, v, attn_mask=bias, is_causal=causal, backend=backend)

        return Call(fwd, [q, k, v, bias], contextlib.nullcontext)
    from torch.nn.attention import sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if causal:  # SDPA takes no attn_mask with is_causal: the triangle folded into the bias
        tri = torch.ones(shape.seqlen, shape.seqlen, dtype=torch.bool, device=device).tril()
        bias_in = lambda: bias.masked_fill(~tri, float("-inf"))  # noqa: E731
    else:
        bias_in = lambda: bias  # noqa: E731

    def fwd():
        return sdpa(q, k, v, attn_mask=bias_in())

    return Call(fwd, [q, k, v, bias], lambda: sdpa_kernel(_sdpa_backend(impl)))


def pass_fn(call: Call, pass_: str, dout: torch.Tensor) -> Tuple[Callable[[], object], Callable[[], None]]:
    """The function to time for ``pass_`` and a cleanup releasing what it keeps alive.

    ``fwd``: the forward with autograd recording (as in training). ``bwd``: the backward alone,
    ``torch.autograd.grad(out, inputs, dO, retain_graph=True)`` on one stored forward.
    ``fwd_bwd``: both."""
    grads = call.grad_inputs
    if pass_ == "fwd":
        return call.forward, lambda: None
    if pass_ == "fwd_bwd":
        def both():
            return torch.autograd.grad(call.forward(), grads, dout)

        return both, lambda: None
    if pass_ == "bwd":
        holder = {"out": call.forward()}

        def bwd():
            return torch.autograd.grad(holder["out"], grads, dout, retain_graph=True)

        return bwd, holder.clear
    raise ValueError(f"unknown pass {pass_!r}")
