"""Hugging Face transformers integration: train and run transformers models with SSA attention.

    import ssa_flash.integrations.transformers as ssa_hf

    config = GPT2Config(n_layer=4, n_head=4, n_embd=256)      # attn_pdrop=0.1: attention dropout
    model = ssa_hf.enable_ssa(GPT2LMHeadModel(config), b_init=1.0, n_init=1.5)
    ...train...
    model.save_pretrained(path)
    model = GPT2LMHeadModel.from_pretrained(path)   # SSA parameters restored, attention routed to SSA

What importing this module does (it needs ``pip install ssa_flash[transformers]``):

* registers the attention function :func:`ssa_attention_forward` under the name ``"ssa"`` in
  transformers' ``AttentionInterface`` (and ``sdpa_mask`` as the mask builder for ``"ssa"`` in
  ``AttentionMaskInterface`` where that exists), so ``config._attn_implementation == "ssa"`` routes
  every attention call of a model to :func:`ssa_flash.ssa_attention`;
* wraps ``PreTrainedModel.post_init`` (once) so that a model whose config carries an
  ``ssa_attention`` entry (written by :func:`enable_ssa`, saved in ``config.json``) gets its SSA
  parameters and the ``"ssa"`` attention implementation when it is built: this is what lets
  ``from_pretrained`` and ``from_config`` restore an SSA model. Models without that entry are
  untouched.

The per-head parameters live on each attention module as a submodule ``ssa``
(a :class:`ssa_flash.nn.SSAttention`), so they appear in ``state_dict()`` as
``...<attention>.ssa.b_raw`` / ``.n_raw`` and are saved by ``save_pretrained``. The attention
function reads them from the module transformers calls it with.

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

from ..nn import B_MIN, SSAttention

__all__ = ["enable_ssa", "ssa_attention_forward", "register", "ATTN_IMPLEMENTATION", "CONFIG_KEY"]

ATTN_IMPLEMENTATION = "ssa"  # the name in transformers' AttentionInterface
CONFIG_KEY = "ssa_attention"  # config attribute holding {"b_init", "n_init", "learnable"}
SUBMODULE = "ssa"  # attribute of each attention module holding its SSAttention

_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "position_bias")


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
    the final weights in the kernels (the Triton and reference backends; ``backend="auto"`` picks
    Triton for it on a GPU). A sliding window reaches this function inside ``attention_mask``
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
    if kwargs.get("output_attentions", False):
        warnings.warn("ssa_flash attention does not return attention weights (output_attentions)",
                      stacklevel=2)

    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None and attention_mask.shape[-1] > kv_len:
        # older transformers build masks for a longer (static-cache) key length: keep the keys we have
        attention_mask = attention_mask[..., :kv_len]
    # Same convention as transformers' sdpa integration: without a mask, a causal module uses
    # is_causal (top-left aligned) for prefill, and no mask at all for a single query.
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal) and attention_mask is None and q_len > 1
    if is_causal and kv_len > q_len:
        # prefill into an empty static cache: the keys past q_len are not written yet
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = ssa(query, key, value, attn_mask=attention_mask, is_causal=is_causal, scale=scaling,
              enable_gqa=query.shape[1] != key.shape[1], dropout_p=float(dropout or 0.0))
    return out.transpose(1, 2).contiguous(), None


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

    Tested with GPT-2 and Llama. Models built from a config then train with SSA. Pretrained
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
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _install_post_init_hook()


register()
