"""ssa_flash.integrations.transformers: tiny GPT-2 and Llama models built from configs (no downloads)."""
import contextlib
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ssa_flash.integrations.transformers as ssa_hf  # noqa: E402
from ssa_flash import reference  # noqa: E402
from ssa_flash.nn import SSAttention  # noqa: E402

from attn_testing import DEVICE, needs_kernels  # noqa: E402

pytestmark = needs_kernels

VOCAB = 32


def gpt2_config(**kw):
    base = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, attn_pdrop=0.0,
                resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**base, **kw})


def llama_config(**kw):
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
                eos_token_id=0, pad_token_id=0)
    return transformers.LlamaConfig(**{**base, **kw})


def ssa_modules(model):
    return [m for m in model.modules() if isinstance(m, SSAttention)]


def tokens(batch, length, seed=0):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@contextlib.contextmanager
def reference_attention(calls):
    """Routes "ssa" to the naive reference (same per-module b, n) with transformers' materialised
    masks, counting the calls."""

    def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        calls.append(module)
        if attention_mask is not None:  # older transformers pass masks longer than the keys
            attention_mask = attention_mask[..., : key.shape[2]]
        causal = attention_mask is None and query.shape[2] > 1
        out = reference.attention(query, key, value, attention_mask, is_causal=causal, scale=scaling,
                                  enable_gqa=True, score="ssa", score_params=(module.ssa.b, module.ssa.n))
        return out.transpose(1, 2).contiguous(), None

    ssa_hf.AttentionInterface.register(ssa_hf.ATTN_IMPLEMENTATION, fn)
    if ssa_hf.AttentionMaskInterface is not None:  # materialised (B, 1, Lq, Lk) masks, as sdpa
        ssa_hf.AttentionMaskInterface.register(ssa_hf.ATTN_IMPLEMENTATION, ssa_hf.sdpa_mask)
    try:
        yield
    finally:
        ssa_hf.register()


def randomise_ssa(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in ssa_modules(model):
        h = m.num_heads
        m.reset_parameters(b_init=(0.3 + 2 * torch.rand(h, generator=g)).tolist(),
                           n_init=(1.1 + 2 * torch.rand(h, generator=g)).tolist())


# --------------------------------------------------------------------------------------------


def test_gpt2_from_config_trains_with_ssa():
    torch.manual_seed(0)
    model = ssa_hf.enable_ssa(transformers.GPT2LMHeadModel(gpt2_config(n_layer=1)).to(DEVICE))
    assert model.config._attn_implementation == "ssa"
    mods = ssa_modules(model)
    assert len(mods) == 1 and mods[0].num_heads == 2
    initial = [(m.b.detach().clone(), m.n.detach().clone()) for m in mods]
    x = tokens(1, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for step in range(24):
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for m in mods:
                for p in (m.b_raw, m.n_raw):
                    assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad != 0).all()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    for m, (b0, n0) in zip(mods, initial):
        assert not torch.allclose(m.b, b0) and not torch.allclose(m.n, n0)
        assert (m.b > 0).all() and (m.n >= 1).all()


def test_gpt2_attention_is_ssa_with_module_parameters():
    torch.manual_seed(0)
    model = ssa_hf.enable_ssa(transformers.GPT2LMHeadModel(gpt2_config()).to(DEVICE).eval())
    randomise_ssa(model)
    x = tokens(2, 12)
    with torch.no_grad():
        ours = model(x).logits
        calls = []
        with reference_attention(calls):
            ref = model(x).logits
        assert len(calls) == 2  # one per layer: the "ssa" dispatch is what the model used
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("sdpa")
        else:  # transformers < 4.56
            model.config._attn_implementation = "sdpa"
        softmax = model(x).logits
    assert (softmax - ours).abs().max() > 1e-3  # SSA really changes the model


def test_llama_gqa_padding_generation():
    torch.manual_seed(0)
    model = ssa_hf.enable_ssa(transformers.LlamaForCausalLM(llama_config()).to(DEVICE).eval(),
                              b_init=0.7, n_init=2.0)
    mods = ssa_modules(model)
    assert len(mods) == 2 and all(m.num_heads == 4 for m in mods)  # per query head (GQA 4:2)
    torch.testing.assert_close(mods[0].b, torch.full((4,), 0.7, device=DEVICE))
    randomise_ssa(model, seed=1)
    x = tokens(2, 10)
    attn_mask = torch.ones_like(x)
    attn_mask[1, :3] = 0  # left padding
    with torch.no_grad():
        ours = model(x, attention_mask=attn_mask).logits
        calls = []
        with reference_attention(calls):
            ref = model(x, attention_mask=attn_mask).logits
            gen_ref = model.generate(x[:1, :5], max_new_tokens=4, do_sample=False)
        gen = model.generate(x[:1, :5], max_new_tokens=4, do_sample=False)
    assert len(calls) >= 2
    keep = attn_mask.bool()
    torch.testing.assert_close(ours[keep], ref[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(gen, gen_ref)  # KV-cache decoding (one query row) through the kernels
    model.train()
    loss = model(x, attention_mask=attn_mask, labels=x).loss
    loss.backward()
    for m in mods:
        assert torch.isfinite(m.b_raw.grad).all() and (m.b_raw.grad != 0).all()
        assert torch.isfinite(m.n_raw.grad).all() and (m.n_raw.grad != 0).all()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_state_dict_round_trip(arch, tmp_path):
    torch.manual_seed(0)
    cls, config = ((transformers.GPT2LMHeadModel, gpt2_config()) if arch == "gpt2"
                   else (transformers.LlamaForCausalLM, llama_config()))
    model = ssa_hf.enable_ssa(cls(config).to(DEVICE).eval(), b_init=0.8, n_init=1.7)
    randomise_ssa(model, seed=2)
    keys = [k for k in model.state_dict() if k.endswith(("ssa.b_raw", "ssa.n_raw"))]
    assert len(keys) == 4
    x = tokens(1, 8)
    with torch.no_grad():
        expected = model(x).logits

    # plain state dict into a fresh SSA model
    fresh = ssa_hf.enable_ssa(cls(config).to(DEVICE).eval())
    fresh.load_state_dict(model.state_dict())
    # save_pretrained / from_pretrained: the config carries the SSA settings, the weights b, n
    model.save_pretrained(tmp_path)
    loaded = cls.from_pretrained(tmp_path).to(DEVICE).eval()
    assert loaded.config._attn_implementation == "ssa"
    assert loaded.config.ssa_attention == {"b_init": 0.8, "n_init": 1.7, "learnable": True}
    for other in (fresh, loaded):
        for a, b in zip(ssa_modules(model), ssa_modules(other)):
            torch.testing.assert_close(a.b, b.b.to(a.b.device), atol=0, rtol=0)
            torch.testing.assert_close(a.n, b.n.to(a.n.device), atol=0, rtol=0)
        with torch.no_grad():
            torch.testing.assert_close(other(x).logits, expected, atol=1e-5, rtol=1e-5)


def test_ssa_config_over_softmax_checkpoint_initialises_parameters(tmp_path):
    transformers.GPT2LMHeadModel(gpt2_config(n_layer=1)).save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert not ssa_modules(plain) and plain.config._attn_implementation != "ssa"  # untouched
    config = transformers.GPT2Config.from_pretrained(tmp_path)
    config.ssa_attention = {"b_init": 0.6, "n_init": 1.8, "learnable": True}
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, config=config)
    (m,) = ssa_modules(model)
    torch.testing.assert_close(m.b, torch.full((2,), 0.6))
    torch.testing.assert_close(m.n, torch.full((2,), 1.8))


def test_enable_ssa_on_pretrained_warns_and_is_idempotent(tmp_path):
    transformers.GPT2LMHeadModel(gpt2_config(n_layer=1)).save_pretrained(tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="not SSA weights"):
        ssa_hf.enable_ssa(model)
    params = [m.b_raw for m in ssa_modules(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ssa_hf.enable_ssa(model, b_init=3.0) is model
    assert [m.b_raw for m in ssa_modules(model)] == params


def test_errors():
    with pytest.raises(TypeError):
        ssa_hf.enable_ssa(torch.nn.Linear(2, 2))
    model = transformers.GPT2LMHeadModel(gpt2_config(n_layer=1))
    with pytest.raises(ValueError, match="b_init"):
        ssa_hf.enable_ssa(model, b_init=0.0)
    with pytest.raises(ValueError, match="n_init"):
        ssa_hf.enable_ssa(model, n_init=1.0)
    # "ssa" selected without enable_ssa: no parameters to use
    bare = transformers.GPT2LMHeadModel(gpt2_config(n_layer=1, attn_implementation="ssa")).to(DEVICE).eval()
    with pytest.raises(RuntimeError, match="enable_ssa"):
        bare(tokens(1, 4))


def test_attention_dropout_in_training(monkeypatch):
    """GPT-2's default attention dropout: no warning, applied in training (transformers passes
    it to the attention function), not in eval; torch.manual_seed reproduces a training step."""
    import ssa_flash.nn

    seen = []
    orig = ssa_flash.nn.ssa_attention
    monkeypatch.setattr(ssa_flash.nn, "ssa_attention",
                        lambda *a, **kw: seen.append(a[4] if len(a) > 4 else kw.get("dropout_p")) or orig(*a, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = ssa_hf.enable_ssa(transformers.GPT2LMHeadModel(gpt2_config(n_layer=1, attn_pdrop=0.5)))
    model.to(DEVICE)
    x = tokens(1, 20)
    model.eval()
    with torch.no_grad():
        clean = model(x).logits
        assert torch.equal(clean, model(x).logits)
    assert seen == [0.0, 0.0]
    model.train()
    logits = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        out = model(x).logits
        assert torch.isfinite(out).all()
        logits.append(out)
    assert seen[2:] == [0.5] * 3
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])
    assert not torch.allclose(logits[0], clean)
    logits[0].sum().backward()
    grads = [p.grad for m in ssa_modules(model) for p in (m.b_raw, m.n_raw)]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


# --------------------------------------------------------------------------------------------
# Padded batches without materialised masks, and the decode kernel in generation


@contextlib.contextmanager
def padding_free(enabled):
    previous = ssa_hf.PADDING_FREE
    ssa_hf.PADDING_FREE = enabled
    try:
        yield
    finally:
        ssa_hf.PADDING_FREE = previous


@pytest.fixture
def kernel_layouts(monkeypatch):
    """Records (layout kind, mask given) of every Triton forward launch."""
    from ssa_flash.triton import launch

    seen = []
    fwd = launch.forward

    def forward(q, k, v, mask, params, beta, spec, layout=None, **kw):
        seen.append((type(layout).__name__ if layout is not None else "dense", mask is not None))
        return fwd(q, k, v, mask, params, beta, spec, layout, **kw)

    monkeypatch.setattr(launch, "forward", forward)
    return seen


def padded_batch(batch, length, lengths, left, seed=0):
    x = tokens(batch, length, seed)
    mask = torch.zeros_like(x)
    for i, n in enumerate(lengths):
        if left:
            mask[i, length - n:] = 1
        else:
            mask[i, :n] = 1
    return x, mask


def build(arch, seed=0):
    torch.manual_seed(seed)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(gpt2_config())
    else:
        model = transformers.LlamaForCausalLM(llama_config())
    model = ssa_hf.enable_ssa(model.to(DEVICE).eval())
    randomise_ssa(model, seed)
    return model


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("left", [True, False])
def test_padded_batch_is_padding_free(arch, left, kernel_layouts):
    """A padded batch runs the packed kernels (no mask reaches them) and gives the logits of the
    materialised-mask path at every real token; the training gradients of b and n agree too."""
    model = build(arch)
    x, attn_mask = padded_batch(3, 9, [9, 4, 1], left)
    keep = attn_mask.bool()
    with torch.no_grad():
        fast = model(x, attention_mask=attn_mask).logits
        assert kernel_layouts and all(kind == "Packed" and not has_mask for kind, has_mask in kernel_layouts)
        kernel_layouts.clear()
        with padding_free(False):
            masked = model(x, attention_mask=attn_mask).logits
        assert kernel_layouts and all(kind == "dense" and has_mask for kind, has_mask in kernel_layouts)
        calls = []
        with reference_attention(calls):
            ref = model(x, attention_mask=attn_mask).logits
    torch.testing.assert_close(fast[keep], masked[keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast[keep], ref[keep], atol=1e-5, rtol=1e-5)

    labels = x.masked_fill(~keep, -100)
    grads = []
    for enabled in (True, False):
        model.zero_grad()
        with padding_free(enabled):
            model(x, attention_mask=attn_mask, labels=labels).loss.backward()
        grads.append([p.grad.clone() for m in ssa_modules(model) for p in (m.b_raw, m.n_raw)])
    for g_fast, g_masked in zip(*grads):
        assert torch.isfinite(g_fast).all() and (g_fast != 0).any()
        torch.testing.assert_close(g_fast, g_masked, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_uses_decode_kernel(arch, cache, kernel_layouts):
    """Greedy generation of a left-padded batch with SSA: the decoding steps run the split-KV
    KV-cache kernel (on transformers' cache after its update: the non-writing form) and generate
    the tokens of the path without it (materialised masks, dense kernels)."""
    model = build(arch, seed=1)
    x, attn_mask = padded_batch(2, 6, [6, 3], left=True, seed=1)
    kw = dict(attention_mask=attn_mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    if cache == "static":
        # on a GPU transformers compiles a static cache's step, and under tracing the integration
        # takes the materialised masks (docs/usage.md, section 10)
        kw.update(cache_implementation="static", disable_compile=True)
    with torch.no_grad():
        fast = model.generate(x, **kw)
        kinds = {kind for kind, _ in kernel_layouts}
        assert "KVCache" in kinds and "Packed" in kinds, kinds  # prompt packed, steps from the cache
        assert not any(has_mask for _, has_mask in kernel_layouts)
        kernel_layouts.clear()
        with padding_free(False):
            slow = model.generate(x, **kw)
        assert {kind for kind, _ in kernel_layouts} == {"dense"}
        calls = []
        with reference_attention(calls):
            ref = model.generate(x, **kw)
    assert fast.shape == (2, 11)
    assert torch.equal(fast, slow) and torch.equal(fast, ref)


def test_decode_kernel_matches_masked_logits():
    """One decoding step over a left-padded cache: the split-KV kernel's logits equal the
    materialised-mask path's (a stronger check than equal greedy tokens)."""
    model = build("llama", seed=2)
    x, attn_mask = padded_batch(2, 7, [7, 2], left=True, seed=2)
    with torch.no_grad():
        out = model(x, attention_mask=attn_mask, use_cache=True)
        step = tokens(2, 1, seed=3)
        mask2 = torch.cat([attn_mask, torch.ones_like(step)], dim=1)
        import copy
        cache2 = copy.deepcopy(out.past_key_values)
        fast = model(step, attention_mask=mask2, past_key_values=out.past_key_values).logits
        with padding_free(False):
            masked = model(step, attention_mask=mask2, past_key_values=cache2).logits
    torch.testing.assert_close(fast, masked, atol=1e-5, rtol=1e-5)


def test_padded_batch_dropout_in_training(kernel_layouts):
    """Attention dropout on a padded batch in training: the packed kernels run with it (no mask
    reaches them), torch.manual_seed reproduces a step, and it changes the logits."""
    torch.manual_seed(0)
    model = ssa_hf.enable_ssa(transformers.LlamaForCausalLM(llama_config(attention_dropout=0.5)).to(DEVICE))
    randomise_ssa(model)
    x, attn_mask = padded_batch(3, 9, [9, 4, 2], left=False)
    keep = attn_mask.bool()
    model.eval()
    with torch.no_grad():
        clean = model(x, attention_mask=attn_mask).logits
    model.train()
    logits = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        logits.append(model(x, attention_mask=attn_mask).logits)
    assert kernel_layouts and all(kind == "Packed" and not has_mask for kind, has_mask in kernel_layouts)
    assert all(torch.isfinite(t[keep]).all() for t in logits)
    assert torch.equal(logits[0][keep], logits[1][keep]) and not torch.equal(logits[0][keep], logits[2][keep])
    assert not torch.allclose(logits[0][keep], clean[keep])


# --------------------------------------------------------------------------------------------
# The model's own attention sinks (GPT-OSS) and logit soft-capping (Gemma 2)
#
# SSA with ``b -> 0``, ``n = 1 / b`` is softmax: ``phi(z) = n log1p(b z) = z - b z^2 / 2 + ...``.
# In that limit the "ssa" attention of a model must equal the model's own eager attention,
# sinks and soft-capping included, which is what these tests hold it to.

NEAR_SOFTMAX = dict(b_init=2e-6, n_init=5e5)  # |phi(z) - z| <= 1e-6 z^2


def gpt_oss_config(**kw):
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4,
                layer_types=["sliding_attention", "full_attention"], bos_token_id=0, eos_token_id=0,
                pad_token_id=0)
    return transformers.GptOssConfig(**{**base, **kw})


def gemma2_config(**kw):
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                head_dim=8, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=8, attn_logit_softcapping=1.5, final_logit_softcapping=None,
                bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.Gemma2Config(**{**base, **kw})


def _attention_modules(model, name):
    return [m for m in model.modules() if type(m).__name__ == name]


def _sharpen(model, attention_class, factor=40.0):
    """Scales the query projections so that the scores reach the soft-cap's range (randomly
    initialised models have tiny scores)."""
    with torch.no_grad():
        for m in _attention_modules(model, attention_class):
            m.q_proj.weight.mul_(factor)


def _logits(model, impl, x, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(x, attention_mask=mask).logits


def _on_reference(model, attention_class):
    """Runs the model's SSA attention on the reference backend. The softmax limit these tests
    compare with eager attention (``NEAR_SOFTMAX``: b = 2e-6, n = 5e5) is accurate in float32 only
    there: the kernels compute ``log2(1 + b|z|)`` from the rounded ``1 + b|z|`` (a relative error
    up to 2^-24 / (b|z|), some per cent here, times n); they are held to the reference at ordinary
    b, n by tests/triton/test_triton_sinks_softcap.py and tests/cuda/test_cuda_sinks_softcap.py."""
    for m in _attention_modules(model, attention_class):
        m.ssa.backend = "reference"


needs_gpt_oss = pytest.mark.skipif(not hasattr(transformers, "GptOssConfig"), reason="transformers without GPT-OSS")
needs_gemma2 = pytest.mark.skipif(not hasattr(transformers, "Gemma2Config"), reason="transformers without Gemma 2")
needs_set_impl = pytest.mark.skipif(not hasattr(transformers.PreTrainedModel, "set_attn_implementation"),
                                    reason="transformers < 4.56")


@needs_gpt_oss
@needs_set_impl
def test_gpt_oss_sinks_match_eager_attention():
    """GPT-OSS passes its per-head sink logits (``s_aux``): the "ssa" attention in the softmax
    limit equals the model's eager attention (sinks included) on a left-padded batch, its
    gradients of the sinks too, and the sinks matter (without them the logits differ)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(gpt_oss_config()).to(DEVICE).eval()
    attns = _attention_modules(model, "GptOssAttention")
    assert len(attns) == 2
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in attns:
            m.sinks.copy_(2.0 * torch.randn(m.sinks.shape, generator=g))
    _sharpen(model, "GptOssAttention", 10.0)
    ssa_hf.enable_ssa(model, **NEAR_SOFTMAX)
    _on_reference(model, "GptOssAttention")
    x = tokens(2, 10, seed=3)
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding
    keep = mask.bool()
    eager = _logits(model, "eager", x, mask)
    ours = _logits(model, "ssa", x, mask)
    torch.testing.assert_close(ours[keep], eager[keep], atol=2e-4, rtol=2e-4)
    with torch.no_grad():
        saved = [m.sinks.clone() for m in attns]
        for m in attns:
            m.sinks.fill_(float("-inf"))  # no sink
        without = _logits(model, "eager", x, mask)
        for m, s in zip(attns, saved):
            m.sinks.copy_(s)
    assert (without[keep] - ours[keep]).abs().max() > 100 * (ours[keep] - eager[keep]).abs().max()

    # generation (decoding over the cache) agrees with eager
    model.set_attn_implementation("eager")
    gen_eager = model.generate(x[:1, :5], max_new_tokens=4, do_sample=False)
    model.set_attn_implementation("ssa")
    gen = model.generate(x[:1, :5], max_new_tokens=4, do_sample=False)
    assert torch.equal(gen, gen_eager)

    # the sinks' gradients (they are the model's parameters) match eager's
    model.train()
    grads = {}
    for impl in ("eager", "ssa"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(x, attention_mask=mask, labels=x).loss.backward()
        grads[impl] = [m.sinks.grad.clone() for m in attns]
    for ours_g, eager_g in zip(grads["ssa"], grads["eager"]):
        assert (eager_g != 0).any()
        torch.testing.assert_close(ours_g, eager_g, atol=1e-5, rtol=1e-3)


@needs_gemma2
@needs_set_impl
def test_gemma2_softcap_matches_eager_attention():
    """Gemma 2 passes ``softcap = config.attn_logit_softcapping``: the "ssa" attention in the
    softmax limit equals the model's eager attention (capped) on a left-padded batch, and the
    cap matters (without it the logits differ)."""
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(gemma2_config()).to(DEVICE).eval()
    _sharpen(model, "Gemma2Attention")
    ssa_hf.enable_ssa(model, **NEAR_SOFTMAX)
    _on_reference(model, "Gemma2Attention")
    x = tokens(2, 10, seed=4)
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    keep = mask.bool()
    eager = _logits(model, "eager", x, mask)
    ours = _logits(model, "ssa", x, mask)
    torch.testing.assert_close(ours[keep], eager[keep], atol=2e-4, rtol=2e-4)
    model.config.attn_logit_softcapping = None
    for m in _attention_modules(model, "Gemma2Attention"):
        m.attn_logit_softcapping = None
    uncapped = _logits(model, "eager", x, mask)
    assert (uncapped[keep] - ours[keep]).abs().max() > 100 * (ours[keep] - eager[keep]).abs().max()
