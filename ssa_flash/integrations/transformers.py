"""Hugging Face transformers integration: train and run transformers models with SSA attention.

    import ssa_flash.integrations.transformers as ssa_hf

    config = GPT2Config(n_layer=4, n_head=4, n_embd=256)      # attn_pdrop=0.1: attention dropout
    model = ssa_hf.enable_ssa(GPT2LMHeadModel(config), b_init=1.0, n_init=1.5)
    ...train...
    model.save_pretrained(path)
    model = GPT2LMHeadModel.from_pretrained(path)   # SSA parameters restored, attention routed to SSA

What importing this module does (it needs ``pip install ssa_flash[transformers]``):

* registers the attention function :func:`ssa_attention_forward` under the name ``"ssa"`` in
  transformers' ``AttentionInterface`` (and :func:`ssa_mask` as the mask builder for ``"ssa"`` in
  ``AttentionMaskInterface`` where that exists), so ``config._attn_implementation == "ssa"`` routes
  every attention call of a model to :func:`ssa_flash.ssa_attention` (padded batches:
  :func:`ssa_flash.varlen_attention`; decoding: :func:`ssa_flash.attention_with_kvcache`);
* wraps ``PreTrainedModel.post_init`` (once) so that a model whose config carries an
  ``ssa_attention`` entry (written by :func:`enable_ssa`, saved in ``config.json``) gets its SSA
  parameters and the ``"ssa"`` attention implementation when it is built: this is what lets
  ``from_pretrained`` and ``from_config`` restore an SSA model. Models without that entry are
  untouched.

The per-head parameters live on each attention module as a submodule ``ssa``
(a :class:`ssa_flash.nn.SSAttention`), so they appear in ``state_dict()`` as
``...<attention>.ssa.b_raw`` / ``.n_raw`` and are saved by ``save_pretrained``. The attention
function reads them from the module transformers calls it with.

Padded batches and decoding (transformers >= 5, whose mask builders take ``q_length``; with
:data:`PADDING_FREE`): for plain causal attention :func:`ssa_mask` hands the attention function
the 2-D padding mask instead of a ``(B, 1, Lq, Lk)`` one, and

* a padded prompt (queries = every token seen) is unpadded, run through
  :func:`ssa_flash.varlen_attention` (no mask read by the kernels) and padded back; query rows
  at padding positions get 0 (they are never used by the model's outputs at real tokens);
* decoding (fewer queries than tokens seen, the keys being HF's cache after its update: a
  ``DynamicCache`` concatenates, a ``StaticCache`` writes in place, so this module uses the
  non-writing form of :func:`ssa_flash.attention_with_kvcache`) runs the split-KV kernel with
  ``cache_seqlens`` = tokens seen and ``cache_leftpad`` = each row's first real token, when every
  row's real tokens are contiguous and end with the newest token (left padding, the
  generation convention); otherwise a small ``(B, 1, Lq, Lk)`` mask is built (O(Lq Lk) bytes,
  Lq of a decoding step) and the dense kernels run;
* without padding, prompts run the dense causal kernels and single-query decoding the split-KV
  kernel, as before no mask at all.

Sliding windows, packed sequences detected from ``position_ids``, bidirectional masks and
``torch.compile`` tracing keep transformers' ``sdpa_mask`` (materialised masks).

Attention sinks and logit soft-capping (docs/design.md §1.6) are the model's own: a model that
passes its per-head sink logits to the attention function (GPT-OSS: ``s_aux``, the attention
module's ``sinks`` parameter, which then receives gradients) or a soft-capping constant (Gemma 2:
``softcap``, from ``config.attn_logit_softcapping``) gets them applied to SSA exactly as its eager
attention applies them to softmax: the sink is one more logit of every row with a zero value,
the cap ``c tanh(z / c)`` acts on the scaled scores before the SSA transform. Which backends run
them: docs/support.md (``backend="auto"`` picks one that does).

Pretrained softmax weights are not SSA weights: :func:`enable_ssa` on a model loaded from a
softmax checkpoint changes what every attention layer computes, and the model must be trained or
fine-tuned with SSA before its outputs mean anything.
"""
from __future__ import annotations

import functools
import numbers
import types
import warnings
from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

try:
    import transformers
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "ssa_flash.integrations.transformers needs the transformers package: "
        "pip install 'ssa_flash[transformers]'") from err
try:
    from transformers import PreTrainedModel
    from transformers.modeling_utils import AttentionInterface
except ImportError as err:  # pragma: no cover - transformers without the AttentionInterface registry
    raise ImportError(
        f"ssa_flash.integrations.transformers needs a transformers version with AttentionInterface "
        f"(tested: 4.51 to 5.23); found {transformers.__version__}: pip install -U 'ssa_flash[transformers]'"
    ) from err

try:  # transformers >= 4.53 builds masks per attention implementation
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # pragma: no cover - older transformers build the masks in the model
    AttentionMaskInterface = sdpa_mask = None
try:
    from transformers.masking_utils import causal_mask_function
except ImportError:  # pragma: no cover
    causal_mask_function = None

from ..nn import B_MIN, SSAttention
from ..ops import attention_with_kvcache, ssa_attention, varlen_attention

__all__ = ["enable_ssa", "ssa_attention_forward", "ssa_mask", "register", "ATTN_IMPLEMENTATION",
           "CONFIG_KEY", "PADDING_FREE"]

PADDING_FREE = True
"""Padded batches without a materialised mask, and decoding with the split-KV kernel (see
:func:`ssa_mask` and :func:`ssa_attention_forward`). ``False``: every padded batch is described by
a ``(B, 1, Lq, Lk)`` mask read by the kernels, and decoding runs the dense kernels (the behaviour
before packed batches existed; read when a mask is built and when attention runs)."""

ATTN_IMPLEMENTATION = "ssa"  # the name in transformers' AttentionInterface
CONFIG_KEY = "ssa_attention"  # config attribute holding {"b_init", "n_init", "learnable"}
SUBMODULE = "ssa"  # attribute of each attention module holding its SSAttention

_UNSUPPORTED_KWARGS = ("position_bias",)


# --------------------------------------------------------------------------------------------
# The attention function


def ssa_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], dropout: float = 0.0,
                          scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                          **kwargs) -> Tuple[Tensor, None]:
    """transformers attention function (the ``AttentionInterface`` signature): query
    ``(B, Hq, Lq, D)``, key/value ``(B, Hkv, Lk, D)``, ``attention_mask`` None or a boolean /
    additive mask broadcastable to ``(B, Hq, Lq, Lk)``. Uses ``module.ssa`` (added by
    :func:`enable_ssa`) for the per-head ``b``, ``n``. ``dropout`` is the attention dropout
    probability, which transformers passes as 0 outside training (as to SDPA); it is applied to
    the final weights in the kernels, by whichever backend runs (docs/support.md). A sliding window reaches this function inside ``attention_mask``
    (transformers builds it into the mask). Returns ``(out (B, Lq, Hq, Dv), None)``: attention
    weights are never materialised."""
    ssa = getattr(module, SUBMODULE, None)
    if not isinstance(ssa, SSAttention):
        raise RuntimeError(
            f"{type(module).__name__} has no SSA parameters (module.{SUBMODULE}): call "
            "ssa_flash.integrations.transformers.enable_ssa(model) instead of setting "
            f"attn_implementation={ATTN_IMPLEMENTATION!r} alone")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"ssa_flash's attention does not support {name!r}")
    extra = _sinks_softcap(kwargs)
    if kwargs.get("output_attentions", False):
        warnings.warn("ssa_flash attention does not return attention weights (output_attentions)",
                      stacklevel=2)

    q_len, kv_len = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    fast = _padding_free(ssa, query, key, value)
    if attention_mask is not None and attention_mask.dim() == 2:  # ssa_mask's padding mask
        return _attend_padded(ssa, query, key, value, attention_mask, scaling, bool(is_causal), fast,
                              float(dropout or 0.0), extra), None
    if (fast and attention_mask is None and q_len == 1 and kv_len > 1 and not dropout
            and not _differentiable(ssa, query, key, value, extra)):
        # decoding without padding: every cached key is valid; keys split over programs
        B = query.shape[0]
        out = _decode(ssa, query, key, value, torch.full((B,), kv_len, dtype=torch.int32, device=query.device),
                      None, scaling, False, extra)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and attention_mask.shape[-1] > kv_len:
        # older transformers build masks for a longer (static-cache) key length: keep the keys we have
        attention_mask = attention_mask[..., :kv_len]
    # Same convention as transformers' sdpa integration: without a mask, a causal module uses
    # is_causal (top-left aligned) for prefill, and no mask at all for a single query.
    is_causal = bool(is_causal) and attention_mask is None and q_len > 1
    if is_causal and kv_len > q_len:
        # prefill into an empty static cache: the keys past q_len are not written yet
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = _dense(ssa, query, key, value, attention_mask, is_causal, scaling, float(dropout or 0.0), extra)
    return out.transpose(1, 2).contiguous(), None


def _sinks_softcap(kwargs: dict) -> dict:
    """The model's own attention sinks and soft-capping among the attention function's keyword
    arguments, as keywords of the ssa_flash functions: ``s_aux`` (GPT-OSS: the ``(Hq,)`` sink
    logits, a parameter of the attention module) -> ``sinks``, ``softcap`` (Gemma 2's
    ``attn_logit_softcapping``; None or 0: none) -> ``softcap``."""
    extra = {}
    if kwargs.get("s_aux") is not None:
        extra["sinks"] = kwargs["s_aux"]
    if kwargs.get("softcap"):
        extra["softcap"] = float(kwargs["softcap"])
    return extra


def _dense(ssa: SSAttention, query, key, value, mask, is_causal, scaling, dropout_p, extra):
    """``ssa(...)`` (the module's ``b``, ``n``, temperature and backend) with the model's sinks
    and soft-capping; ``(B, Hq, Lq, Dv)``."""
    if not extra:
        return ssa(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling,
                   enable_gqa=query.shape[1] != key.shape[1], dropout_p=dropout_p)
    return ssa_attention(query, key, value, mask, dropout_p, is_causal, scaling, query.shape[1] != key.shape[1],
                         b=ssa.b, n=ssa.n, adaptive_temperature=ssa.adaptive_temperature, backend=ssa.backend,
                         **extra)


# --------------------------------------------------------------------------------------------
# Padded batches and decoding without materialised masks

_TOKENS_ATTR = "_ssa_flash_tokens"  # on ssa_mask's padding mask: tokens seen, this step's included
_LAYOUT_ATTR = "_ssa_flash_layout"  # on the same mask: what the first layer derived from it


def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _padding_free(ssa: SSAttention, *tensors) -> bool:
    """Whether the packed / KV-cache kernels may serve this call: enabled, not traced, a backend
    that implements them (the CUDA C++ backend does not: docs/support.md)."""
    return PADDING_FREE and ssa.backend != "cuda" and not _tracing()


def ssa_mask(*args, **kwargs):
    """The mask builder registered for ``"ssa"`` in transformers' ``AttentionMaskInterface``.

    For plain causal attention (``mask_function`` is transformers' ``causal_mask_function``, no
    key offset) it returns, instead of a ``(B, 1, Lq, Lk)`` mask, ``None`` when nothing is padded
    and the queries are either all tokens or one (as ``sdpa_mask`` does), else a boolean
    ``(B, kv_length)`` padding mask (True = a real token; the tail of a static cache that is not
    written yet is False) carrying the number of tokens seen as an attribute, which
    :func:`ssa_attention_forward` turns into packed sequences or KV-cache lengths. Anything else
    (sliding windows, packed sequences from ``position_ids``, extra mask functions, tracing,
    :data:`PADDING_FREE` off, a transformers whose mask builders take other arguments) is
    ``sdpa_mask``'s materialised mask."""
    mask_function = kwargs.get("mask_function")
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if (args or not PADDING_FREE or _tracing() or causal_mask_function is None
            or mask_function is not causal_mask_function or kwargs.get("kv_offset", 0) != 0
            or not isinstance(q_length, int) or not isinstance(kv_length, int)):
        return sdpa_mask(*args, **kwargs)
    batch_size = kwargs["batch_size"]
    attention_mask = kwargs.get("attention_mask")
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")
    # tokens seen, these queries included (a static cache's offset is a tensor: one sync); the 2-D
    # mask may be wider (generate pads it to a static cache's length)
    tokens = int(kwargs.get("q_offset", 0)) + q_length
    if tokens > kv_length:
        return sdpa_mask(*args, **kwargs)
    pm = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            return sdpa_mask(*args, **kwargs)
        pm = attention_mask.to(device=device, dtype=torch.bool)[:, :kv_length]
        if pm.shape[-1] < kv_length:  # a static cache's unwritten tail
            pm = torch.nn.functional.pad(pm, (0, kv_length - pm.shape[-1]), value=False)
    no_skip = tokens == kv_length and (q_length == 1 or q_length == kv_length)
    if pm is None:
        if no_skip:
            return None
        pm = (torch.arange(kv_length, device=device) < tokens).expand(batch_size, kv_length)
    elif no_skip and bool(pm.all()):  # a device sync, as in transformers' own sdpa / flash masks
        return None
    if tokens < kv_length:  # rows past the tokens seen are a static cache's unwritten tail
        pm = pm & (torch.arange(kv_length, device=pm.device) < tokens)
    pm = pm.contiguous()
    setattr(pm, _TOKENS_ATTR, tokens)
    return pm


def _differentiable(ssa: SSAttention, query, key, value, extra: Optional[dict] = None) -> bool:
    """Whether autograd records this call (the KV-cache kernel is forward only)."""
    sinks = (extra or {}).get("sinks")
    tensors = (query, key, value, ssa.b_raw, ssa.n_raw) + ((sinks,) if isinstance(sinks, Tensor) else ())
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _padding_layout(pm: Tensor, packed: bool) -> dict:
    """What a ``(B, L)`` padding mask says, computed once per mask (all layers share it; one or two
    device syncs): ``first`` (each row's first real token, ``tokens`` for an empty row) and
    ``contiguous_left`` (every row's real tokens are exactly ``[first, tokens)``); with ``packed``
    also the flat indices of the real tokens, the cumulative lengths ``cu`` and ``max_len``."""
    layout = getattr(pm, _LAYOUT_ATTR, None)
    if layout is not None and (not packed or "indices" in layout):
        return layout
    tokens = getattr(pm, _TOKENS_ATTR, pm.shape[-1])
    seen = pm[:, :tokens]
    lengths = seen.sum(-1, dtype=torch.int32)
    positions = torch.arange(tokens, device=pm.device)
    first = torch.where(seen, positions, tokens).amin(-1).to(torch.int32)
    end = torch.where(seen, positions + 1, 0).amax(-1)
    ok = (lengths == 0) | ((end == tokens) & (tokens - first == lengths))
    contiguous_left, max_len = torch.stack([ok.all().to(torch.int64), lengths.max().to(torch.int64)]).tolist()
    layout = dict(first=first, contiguous_left=bool(contiguous_left), max_len=int(max_len))
    if packed:
        layout.update(indices=seen.reshape(-1).nonzero().squeeze(1),
                      cu=torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)))
    setattr(pm, _LAYOUT_ATTR, layout)
    return layout


def _mask_from_padding(pm: Tensor, q_len: int, kv_len: int, tokens: int, causal: bool) -> Tensor:
    """The boolean ``(B, 1, q_len, kv_len)`` mask equivalent to a padding mask: real keys, and under
    ``causal`` the keys up to each query's position (queries are the last ``q_len`` tokens)."""
    mask = pm[:, None, None, :kv_len]
    if causal:
        pos = torch.arange(q_len, device=pm.device)[:, None] + (tokens - q_len)
        mask = mask & (torch.arange(kv_len, device=pm.device)[None, :] <= pos)
    return mask


def _decode(ssa: SSAttention, query, key, value, cache_seqlens, cache_leftpad, scaling, causal, extra):
    return attention_with_kvcache(
        query, key, value, cache_seqlens, is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], score="ssa", score_params=(ssa.b, ssa.n),
        adaptive_temperature=ssa.adaptive_temperature, cache_leftpad=cache_leftpad, backend=ssa.backend,
        **extra)


def _attend_padded(ssa: SSAttention, query, key, value, pm, scaling, causal, fast, dropout_p=0.0, extra=None):
    """Attention under a padding mask ``pm (B, kv_len)`` (from :func:`ssa_mask`) with attention
    dropout ``dropout_p`` and the model's sinks / soft-capping ``extra``; returns ``(B, q_len, Hq, Dv)``."""
    extra = extra or {}
    B, H, q_len, _ = query.shape
    kv_len = key.shape[2]
    tokens = getattr(pm, _TOKENS_ATTR, pm.shape[-1])
    gqa = H != key.shape[1]
    if fast and q_len == tokens <= kv_len:
        # a prompt: the real tokens of each row form one packed sequence (no mask read)
        lay = _padding_layout(pm, packed=True)
        idx = lay["indices"]

        def unpad(x):
            return x[:, :, :tokens].transpose(1, 2).reshape(B * tokens, x.shape[1], x.shape[3])[idx]

        out = varlen_attention(unpad(query), unpad(key), unpad(value), lay["cu"], lay["cu"],
                               max(lay["max_len"], 1), max(lay["max_len"], 1), is_causal=causal,
                               scale=scaling, enable_gqa=gqa, score="ssa", score_params=(ssa.b, ssa.n),
                               dropout_p=dropout_p,
                               adaptive_temperature=ssa.adaptive_temperature, backend=ssa.backend, **extra)
        full = out.new_zeros((B * tokens, H, out.shape[-1])).index_copy(0, idx, out)
        return full.view(B, tokens, H, -1)
    if fast and q_len < tokens and dropout_p == 0.0 and not _differentiable(ssa, query, key, value, extra):
        lay = _padding_layout(pm, packed=False)
        if lay["contiguous_left"]:  # decoding a left-padded batch: split-KV over [first, tokens)
            seqlens = torch.full((B,), tokens, dtype=torch.int32, device=query.device)
            out = _decode(ssa, query, key, value, seqlens, lay["first"], scaling, causal, extra)
            return out.transpose(1, 2).contiguous()
    mask = _mask_from_padding(pm, q_len, kv_len, tokens, causal)
    out = _dense(ssa, query, key, value, mask, False, scaling, dropout_p, extra)
    return out.transpose(1, 2).contiguous()


# --------------------------------------------------------------------------------------------
# Adding the parameters


def _attention_modules(model: nn.Module) -> List[Tuple[nn.Module, int]]:
    """(module, number of query heads) for each attention module that dispatches through
    transformers' AttentionInterface (GPT-2, Llama and the models written like them)."""
    found = []
    for module in model.modules():
        if isinstance(module, (SSAttention, PreTrainedModel)):
            continue
        if not type(module).__name__.endswith("Attention"):
            continue
        config = getattr(module, "config", None)
        if config is None or not hasattr(module, "layer_idx"):
            continue
        heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
        if not isinstance(heads, int) or heads < 1:
            continue
        found.append((module, heads))
    return found


def _module_device(module: nn.Module):
    for p in module.parameters(recurse=False):
        return p.device
    for p in module.parameters():
        return p.device
    return None


def _check_settings(b_init, n_init, learnable) -> dict:
    for name, x, low in (("b_init", b_init, B_MIN), ("n_init", n_init, 1.0)):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"{name} must be a number, got {type(x).__name__}")
        if not float(x) > low or float(x) == float("inf"):
            raise ValueError(f"{name} must be finite and > {low:g}, got {x}")
    if not isinstance(learnable, bool):
        raise TypeError(f"learnable must be a bool, got {type(learnable).__name__}")
    return {"b_init": float(b_init), "n_init": float(n_init), "learnable": learnable}


def _ssa_init_weights(self, module):
    """Instance override of ``_init_weights``: transformers calls it for parameters it could not
    load (an SSA config over a checkpoint without SSA tensors); SSA parameters get their initial
    values, everything else the model's own initialisation. Tensors that transformers marked as
    loaded (``_is_hf_initialized``) keep their values."""
    if isinstance(module, SSAttention):
        tensors = (module.b_raw, module.n_raw)
        loaded = [(t, t.detach().clone()) for t in tensors if getattr(t, "_is_hf_initialized", False)]
        if len(loaded) == len(tensors):
            return
        settings = getattr(self.config, CONFIG_KEY, None) or {}
        module.reset_parameters(settings.get("b_init", 1.0), settings.get("n_init", 1.5))
        with torch.no_grad():
            for t, value in loaded:
                t.copy_(value)
    else:
        type(self)._init_weights(self, module)


def _apply(model: PreTrainedModel, settings: dict) -> int:
    """Adds the SSA submodules that are missing and routes attention to ssa. Returns how many
    were added."""
    modules = _attention_modules(model)
    added = 0
    for module, heads in modules:
        if isinstance(getattr(module, SUBMODULE, None), SSAttention):
            continue
        module.add_module(SUBMODULE, SSAttention(
            heads, settings["b_init"], settings["n_init"], settings["learnable"],
            device=_module_device(module)))
        added += 1
    setattr(model.config, CONFIG_KEY, dict(settings))
    model._init_weights = types.MethodType(_ssa_init_weights, model)
    if modules:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:  # pragma: no cover - transformers < 4.56
            model.config._attn_implementation = ATTN_IMPLEMENTATION
    return added


def enable_ssa(model: PreTrainedModel, b_init: float = 1.0, n_init: float = 1.5,
               learnable: bool = True) -> PreTrainedModel:
    """Turns every attention layer of a transformers model into SSA attention; returns ``model``.

    Adds to each attention module a submodule ``ssa`` (:class:`ssa_flash.nn.SSAttention`) with
    per-head ``b`` (init ``b_init`` > 0) and ``n`` (init ``n_init`` > 1), trainable unless
    ``learnable=False``; records the settings as ``model.config.ssa_attention`` (saved in
    ``config.json``) and sets the model's attention implementation to ``"ssa"``, the function
    registered by this module in transformers' ``AttentionInterface``. Modules that already have
    SSA parameters keep them (calling it twice changes nothing).

    Tested with GPT-2, Llama, GPT-OSS (its attention sinks) and Gemma 2 (its logit soft-capping).
    Models built from a config then train with SSA. Pretrained
    softmax weights are not SSA weights: on a model loaded from a softmax checkpoint this changes
    what the model computes, and it needs training or fine-tuning with SSA.

    The config's attention dropout (GPT-2's ``attn_pdrop``, Llama's ``attention_dropout``)
    applies in training mode, as with SDPA.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"enable_ssa expects a transformers PreTrainedModel, got {type(model).__name__}")
    settings = _check_settings(b_init, n_init, learnable)
    previous = getattr(model.config, CONFIG_KEY, None)
    if not _attention_modules(model):
        raise ValueError(
            f"enable_ssa found no attention module in {type(model).__name__} that dispatches through "
            "transformers' AttentionInterface (supported: GPT-2, Llama and models written like them)")
    if previous is None and getattr(model.config, "_name_or_path", ""):
        warnings.warn(
            f"enable_ssa on a model loaded from {model.config._name_or_path!r}: pretrained softmax "
            "weights are not SSA weights; the model must be trained or fine-tuned with SSA", stacklevel=2)
    _apply(model, settings if previous is None else {**settings, **previous})
    return model


# --------------------------------------------------------------------------------------------
# Registration (at import)


def _install_post_init_hook() -> None:
    original = PreTrainedModel.post_init
    if getattr(original, "_ssa_flash_hook", False):
        return

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        settings = getattr(getattr(self, "config", None), CONFIG_KEY, None)
        if isinstance(settings, dict):
            _apply(self, _check_settings(settings.get("b_init", 1.0), settings.get("n_init", 1.5),
                                         settings.get("learnable", True)))
        return result

    post_init._ssa_flash_hook = True
    PreTrainedModel.post_init = post_init


def register() -> None:
    """Registers ``"ssa"`` with transformers and installs the ``post_init`` hook (idempotent;
    done when this module is imported)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, ssa_attention_forward)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ssa_mask)
    _install_post_init_hook()


register()
