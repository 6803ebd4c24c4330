"""Live caches: every format's encoded tensors in a running model (kvtool.hf.live).

Greedy tokens from the live cache equal the file-based path of `kvtool generate` (the encoded prefix
through the format's attention with new tokens dense, or the format's ring), for every registered
format; the live layers grow the format's way (the same bytes as encoding the same tokens);
`kvtool.press` equals compressing the prefilled cache; in-memory compression; what live caches refuse.
"""

from __future__ import annotations

import json

import pytest
import torch

import kvtool
from kvtool.core.attention import attend_partial
from kvtool.core.errors import UsageError
from kvtool.formats.base import compress_cache, load_all, save_compressed
from kvtool.formats.pipeline import resolve
from kvtool.hf import models
from kvtool.hf.cache import generate, to_hf_cache
from kvtool.hf.interface import cache_kwargs, output_cache
from kvtool.hf.live import compress_hf_cache, is_live, live_layers, stored_bytes

from .conftest import synthetic_cache

# one spec per registered format (a new format must add its line: the test below checks the registry)
SPECS = {
    "dense": "dense",
    "bitmap": "bitmap:sparsity=0.7",
    "bitmapq": "bitmapq",
    "quant": "quant:bits=2,group=16,residual=16",
    "signvq": "signvq",
    "pagestat": "pagestat:budget=64",
    "snapstream": "snapstream:budget=64",
    "pipeline": "snapkv:budget=128+quant:bits=4",
    "mixed": "mixed:heads=quant:bits=2|bitmap:sparsity=0.5",
}


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model, tokenizer, _ = models.load(str(tiny_llama_dir))
    return model, tokenizer


@pytest.fixture(scope="module")
def long_cap(tiny):
    model, tok = tiny
    return kvtool.capture("kvtool live test sentence " * 12, model=(model, tok))


def test_every_format_is_covered():
    assert set(SPECS) == set(load_all())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_live_tokens_equal_the_file_path(name, tiny, long_cap, tmp_path):
    """The live cache (auto) and the pre-live file path (`--mode attend`, or `ring` for ring formats)
    give the same greedy tokens and the same mode names."""
    model, tok = tiny
    fmt, params, _ = resolve(SPECS[name])
    cc = compress_cache(long_cap, fmt, params, heldout=16)
    path = save_compressed(cc, tmp_path / f"{name}.safetensors")
    live = generate(path, "", max_new_tokens=8, loaded=(model, tok))
    ref = generate(path, "", max_new_tokens=8, loaded=(model, tok), mode="ring" if fmt.appends_tokens else "attend")
    assert live["mode"] == "live"
    assert live["new_token_ids"] == ref["new_token_ids"]
    cache = to_hf_cache(path, model)
    assert is_live(cache) and stored_bytes(cache) > 0


def test_live_cache_compresses_for_real(tiny, long_cap, tmp_path):
    """A live bitmap / KIVI-2 cache holds fewer bytes than the dense cache of the same tokens, and
    its layers hold no dense tensor of the compressed tokens."""
    model, _ = tiny
    dense_cc = compress_cache(long_cap, *resolve("dense")[:2], heldout=16)
    dense = stored_bytes(to_hf_cache(save_compressed(dense_cc, tmp_path / "d.safetensors"), model))
    for spec, most in (("bitmap:sparsity=0.7", 0.8), ("quant:bits=2,group=16,residual=16", 0.6)):
        cc = compress_cache(long_cap, *resolve(spec)[:2], heldout=16)
        cache = to_hf_cache(save_compressed(cc, tmp_path / "c.safetensors", force=True), model)
        assert stored_bytes(cache) < most * dense, spec
        for live in live_layers(cache):
            big = [n for n, t in vars(live).items() if isinstance(t, torch.Tensor) and t.ndim == 4 and t.shape[2] > 150]
            assert not big, (spec, big)


def _feed(live, keys, values, scale=None):
    """Append tokens one decode step at a time (each with a random query)."""
    b, h, t, d = keys.shape
    for j in range(t):
        q = torch.randn(b, 2 * h, 1, d, dtype=keys.dtype)
        live.step(q, keys[:, :, j:j + 1], values[:, :, j:j + 1], scale)


def test_bitmap_live_blocks_are_the_encoders_bytes():
    """Each filled block is pruned and encoded as `encode` does the same tokens, in the kernel's
    cache with room to grow: after 150 decoded tokens the blocks in use equal the encoding of all
    tokens with the same dense window, and the window holds the rest."""
    from kvtool.formats.base import get_format
    from kvtool.formats.bitmap import BitmapLive, cache_from_encoded

    fmt = get_format("bitmap")
    layer = synthetic_cache(tokens=300, head_dim=64, heads=4, kv_heads=2, queries=False).layers[0]
    params = fmt.Params(sparsity=0.7, dense_window=16)
    live = fmt.live_from_dense(layer.slice_tokens(0, 150), params)
    assert isinstance(live, BitmapLive) and live.nblocks == 2 and live.wn == 22
    assert [int(x) for x in live.cache.lengths] == [128, 22]
    _feed(live, layer.keys[:, :, 150:], layer.values[:, :, 150:])
    assert live.nblocks == 4 and live.wn == 44 and live.tokens == 300 and [int(x) for x in live.cache.lengths] == [256, 44]
    got = cache_from_encoded(live.encoded())
    whole = cache_from_encoded(fmt.encode(layer, fmt.Params(sparsity=0.7, dense_window=44)))
    assert got.keys.same_bytes(whole.keys) and got.values.same_bytes(whole.values)
    assert torch.equal(got.window_keys, layer.keys[:, :, 256:]) and torch.equal(got.window_values, layer.values[:, :, 256:])
    fmt.validate(live.encoded())
    # past its capacity the layer re-lays itself into a larger one and keeps every block
    cap = live.capacity_blocks
    more = synthetic_cache(tokens=64 * (cap - 3), head_dim=64, heads=4, kv_heads=2, queries=False, seed=1).layers[0]
    live.append(more.keys, more.values)
    assert live.capacity_blocks > cap and live.tokens == 300 + 64 * (cap - 3)
    dec = fmt.decode(live.encoded())
    assert torch.equal(dec.keys[:, :, :256], fmt.decode(fmt.encode(layer, fmt.Params(sparsity=0.7, dense_window=44))).keys[:, :, :256])


def test_kivi_live_groups_are_the_encoders_codes():
    """Keys and values quantised a group at a time as they leave the residual: the codes equal
    `encode` of the same tokens split at the same place."""
    from kvtool.formats.base import get_format

    fmt = get_format("quant")
    layer = synthetic_cache(tokens=200, head_dim=32, heads=4, kv_heads=2, queries=False).layers[0]
    p = fmt.Params(bits=4, group=16, residual=16)
    live = fmt.live_from_dense(layer.slice_tokens(0, 100), p)
    _feed(live, layer.keys[:, :, 100:], layer.values[:, :, 100:])
    got = live.encoded()
    assert live.tokens == 200 and got.meta["key_tokens"] % 16 == 0 and 16 <= 200 - got.meta["value_tokens"] < 32
    for kind, n in (("keys", got.meta["key_tokens"]), ("values", got.meta["value_tokens"])):
        ref = fmt.encode(layer, fmt.Params(bits=4, group=16, residual=200 - n))
        for part in ("codes", "scales", "zeros"):
            a, b = got.tensors[f"{part}.{kind}"], ref.tensors[f"{part}.{kind}"]
            assert torch.equal(a, b) if kind == "values" or part == "codes" else torch.equal(a, b[..., :a.shape[-1]]), (kind, part)
    fmt.validate(got)
    dense = fmt.decode(got)
    q = torch.randn(1, 4, 2, 32, dtype=torch.float16)
    torch.testing.assert_close(live.partial(q, None)[0], attend_partial(q, dense.keys, dense.values)[0])


def test_pagestat_live_pages_keep_their_statistics():
    from kvtool.formats.base import get_format
    from kvtool.formats.pagestat import page_stats

    fmt = get_format("pagestat")
    layer = synthetic_cache(tokens=160, head_dim=32, heads=4, kv_heads=2, queries=False).layers[0]
    live = fmt.live_from_dense(layer.slice_tokens(0, 90), fmt.Params(page_size=16, budget=64, dense_window=8))
    _feed(live, layer.keys[:, :, 90:], layer.values[:, :, 90:])
    t = live.encoded_tokens
    assert t % 16 == 0 and 8 <= live.tail.n < 24 and t + live.tail.n == 160
    ref = page_stats(layer.keys[:, :, :t], 16, "unique")
    for name, x in ref.items():
        torch.testing.assert_close(live.stats[name].float(), x.to(layer.keys.dtype).float())
    enc = live._enc()
    assert enc.meta["forced_pages"] == [0] and enc.meta["select"] == (64 - 16 - 8) // 16


def test_signvq_live_grows_against_its_codebook():
    from kvtool.formats.base import get_format

    fmt = get_format("signvq")
    layer = synthetic_cache(tokens=260, head_dim=32, heads=4, kv_heads=2, dtype=torch.float32, queries=False).layers[0]
    live = fmt.live_from_dense(layer.slice_tokens(0, 128), fmt.Params(budget_ratio=1.0))
    _feed(live, layer.keys[:, :, 128:], layer.values[:, :, 128:])
    assert live.m["compressed_tokens"] == 124 + 128 and live.tail.n == 4
    fmt.validate(live.encoded())
    # every stored token selected: the live attention is dense attention over the dequantised
    # stored tokens and the dense tail
    live.m["select"] = live.m["compressed_tokens"]
    q = torch.randn(1, 4, 2, 32)
    dec = fmt.decode(live.encoded())
    wk, wv = live.tail.view()
    ref = attend_partial(q, torch.cat([dec.keys, wk], 2), torch.cat([dec.values, wv], 2))[0]
    torch.testing.assert_close(live.partial(q, None)[0], ref, rtol=1e-4, atol=1e-4)


def test_press_equals_compressing_the_prefilled_cache(tiny):
    """`with kvtool.press(spec): model.generate(...)` gives the tokens of a dense prefill whose cache
    is then compressed in place and decoded greedily, and differs from dense generation."""
    model, tok = tiny
    before = model.config._attn_implementation
    ids = torch.tensor([tok("kvtool press test sentence " * 10, add_special_tokens=False)["input_ids"]])
    for spec in ("bitmap:sparsity=0.9", "quant:bits=2", "snapkv:budget=96+quant:bits=4"):
        with kvtool.press(spec) as state:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert state.layers == 2
        pressed = out[0, ids.shape[1]:].tolist()
        with torch.no_grad():
            o = model(input_ids=ids, use_cache=True)
            cache = output_cache(o)
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            toks = [int(nxt)]
            if spec.startswith("snapkv"):
                with pytest.raises(UsageError, match="kvtool.press"):
                    kvtool.compress(cache, spec)
                continue
            assert kvtool.compress(cache, spec) is cache and is_live(cache)
            with kvtool.press("dense"):  # kvtool's attention dispatch, nothing new to compress
                for _ in range(7):
                    o = model(input_ids=nxt, use_cache=True, **cache_kwargs(model, cache))
                    nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                    toks.append(int(nxt))
        assert pressed == toks, spec
    dense = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    with kvtool.press("bitmap:sparsity=0.9"):
        sparse = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert sparse != dense  # the press changed the answer: the equality above has teeth
    assert model.config._attn_implementation == before


def test_press_with_a_plan_file(tiny, tmp_path):
    model, tok = tiny
    plan = {"schema": "kvtool.plan", "version": 1, "model": {"num_layers": 2, "num_kv_heads": 2}, "default": "dense",
            "layers": {"0": "quant:bits=4", "1": ["bitmap:sparsity=0.7", "snapstream:budget=64,policy=streaming"]}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    ids = torch.tensor([tok("a plan in a running model " * 8, add_special_tokens=False)["input_ids"]])
    with kvtool.press(path, model=model) as state:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert state.layers == 2 and out.shape[1] == ids.shape[1] + 4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**plan, "model": {"num_layers": 5}}))
    with pytest.raises(UsageError, match="5 layers"):
        with kvtool.press(bad, model=model):
            pass


def test_compress_takes_in_memory_caches(tmp_path):
    cap = synthetic_cache(tokens=96, head_dim=16)
    r = kvtool.compress(cap, "quant:bits=4,residual=0")
    assert r.output is None and r.compressed.format == "quant" and 0 < r.storage_ratio < 0.5
    r2 = kvtool.compress(cap, "bitmap:sparsity=0.7", tmp_path / "m.safetensors", heldout=8)
    assert r2.compressed.prefix_tokens == 88 and kvtool.info(r2.output).schema == "kvtool.compressed"
    with pytest.raises(UsageError, match="capture path, a kvtool KVCache or a transformers cache"):
        kvtool.compress(object(), "dense")


def test_live_caches_refuse_what_they_cannot_do(tiny, long_cap, tmp_path):
    model, tok = tiny
    cc = compress_cache(long_cap, *resolve("bitmap:sparsity=0.5")[:2], heldout=4)
    cache = to_hf_cache(save_compressed(cc, tmp_path / "b.safetensors"), model)
    with pytest.raises(UsageError, match="cannot drop tokens"):
        cache.crop(-1)
    with pytest.raises(UsageError, match="beam search"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(UsageError, match="no dense layer"):
        compress_hf_cache(cache, "dense")


def test_load_model(tiny_llama_dir):
    model, tok = kvtool.load_model(tiny_llama_dir, dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16 and tok("a")["input_ids"]


def test_a_model_that_bypasses_kvtools_attention_is_an_error(tiny, long_cap, tmp_path):
    """A live cache in a model whose attention does not dispatch through kvtool's function (here a
    registered copy of SDPA under another name) fails at the next step instead of attending only to
    the new tokens."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvtool.hf.attention import clear_handovers

    model, tok = tiny
    cc = compress_cache(long_cap, *resolve("quant:bits=4")[:2], heldout=4)
    cache = to_hf_cache(save_compressed(cc, tmp_path / "q.safetensors"), model)
    AttentionInterface.register("plain-copy", sdpa_attention_forward)
    before = model.config._attn_implementation
    model.config._attn_implementation = "plain-copy"
    try:
        ids = torch.tensor([[5]])
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
            with pytest.raises(UsageError, match="did not attend through its live cache"):
                model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    finally:
        model.config._attn_implementation = before
        clear_handovers()


def test_bench_decode_runs_on_the_cpu(tmp_path, monkeypatch):
    """`kvtool bench decode` end to end on the tiny random model (timings meaningless on the CPU):
    records for dense and each format with the decode fields, budget rows, the report's table."""
    from typer.testing import CliRunner

    from kvtool.cli import app

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "decode.json"
    res = CliRunner().invoke(app, ["bench", "decode", "--model-shape", "tiny", "--batch", "1", "--seq", "160", "--formats", "bitmap:sparsity=0.7",
                                   "--formats", "snapstream:budget=64", "--formats", "quant:bits=4,group=16", "--memory-budget", "2MiB", "--runs", "3",
                                   "--generate", "4", "--encode-repeats", "1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "dense/sdpa" in res.stdout  # the table (not --json)
    doc = json.loads(out.read_text())
    rows = {(r["kernel"], r["provider"]): r for r in doc["records"]}
    providers = {"dense/sdpa", "bitmap:sparsity=0.7", "snapstream:budget=64", "quant:bits=4,group=16"}
    assert {p for k, p in rows if k == "decode"} == providers
    assert {p for k, p in rows if k == "decode-budget"} == providers
    assert rows[("decode", "quant:bits=4,group=16")]["stored_bytes"] < 0.6 * rows[("decode", "dense/sdpa")]["stored_bytes"]
    dense, bitmap = rows[("decode", "dense/sdpa")], rows[("decode", "bitmap:sparsity=0.7")]
    assert bitmap["stored_bytes"] < dense["stored_bytes"] and bitmap["tokens_per_s"] > 0 and bitmap["encode_us_per_token"] > 0
    assert not dense["timing_valid"] and bitmap["speedup"]["dense"] > 0 and bitmap["method"] == "eager"
    assert bitmap["encode_repeats"] == 1 and bitmap["encode_span_tokens"] == 64 and dense["encode_us_per_token"] is None
    for r in (dense, bitmap):  # --generate 4: greedy tokens through the live cache, the closing encode included
        assert r["generate_tokens"] == 4 and r["generate_tokens_per_s"] > 0 and r["generate_encodes"] >= 1 and 0 <= r["generate_encode_share"] < 1
    assert rows[("decode-budget", "snapstream:budget=64")]["batch"] > rows[("decode-budget", "dense/sdpa")]["batch"]
    table = CliRunner().invoke(app, ["bench", "report", str(out)])
    assert table.exit_code == 0 and "| provider | batch | context | ms / step |" in table.stdout and "| generate tokens/s |" in table.stdout


def test_the_shipped_decode_results_render():
    """docs/benchmarks/decode.json (the H100 run docs/decode.md quotes) is a bench document whose
    report table carries the numbers the docs cite."""
    from pathlib import Path

    from kvtool.bench.runner import read_bench_json
    from kvtool.bench.tables import markdown

    doc = read_bench_json(Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "decode.json")
    text = markdown(doc)
    assert doc["subcommand"] == "decode" and "H100" in doc["env"]["device"]
    assert "| bitmap:sparsity=0.7 | 8 | 32768 | 15.01 | 533 | 1.29 |" in text
    assert "| bitmap:sparsity=0.7 (budget) | 26 | 32768 | 29.13 | 893 | 2.13 |" in text


def test_bitmap_live_cache_is_what_the_kernel_reads():
    """The live layer's cache with room to grow, attended by the kernel (its Triton backend under the
    interpreter reads the lengths in use), equals the torch reference over the same tokens, before
    and after blocks join."""
    from kvtool.formats.base import get_format
    from kvtool.kernels.bitmap_sparse_attention import bitmap_sparse_attention

    fmt = get_format("bitmap")
    layer = synthetic_cache(tokens=260, head_dim=64, heads=4, kv_heads=2, queries=False).layers[0]
    live = fmt.live_from_dense(layer.slice_tokens(0, 170), fmt.Params(sparsity=0.7, dense_window=8))
    for stop in (170, 235, 260):
        if stop > live.tokens:
            _feed(live, layer.keys[:, :, live.tokens:stop], layer.values[:, :, live.tokens:stop])
        q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
        out, lse = bitmap_sparse_attention(q, live.cache, backend="triton")
        ref, ref_lse = live.partial(q, None)
        assert float((out - ref).norm() / ref.norm()) < 1e-2, stop
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)


def _replay(live, keys, values):
    """What replays of a captured decode step leave: each token written where the device's lengths
    say, the lengths advanced on the device, the host's counts untouched."""
    from kvtool.formats.bitmap import BitmapLive

    for t in range(keys.shape[2]):
        if isinstance(live, BitmapLive):
            at = int(live.cache.lengths[1])
            live.cache.window_keys[:, :, at] = keys[:, :, t]
            live.cache.window_values[:, :, at] = values[:, :, t]
            live.cache.lengths[1] += 1
        else:
            for i, (kind, x) in enumerate((("keys", keys), ("values", values))):
                live.res[kind][:, :, int(live.lengths[2 + i])] = x[:, :, t]
            live.lengths[2:4] += 1


@pytest.mark.parametrize("spec", ["bitmap", "quant"])
def test_eager_appends_after_replayed_steps_count_from_the_device(spec):
    """A serving loop replays a captured step (tokens appended on the device only), then appends a
    block eagerly: the layer counts from the device's lengths, so nothing is written past its
    window and it holds what appending every token eagerly gives."""
    from kvtool.formats.base import get_format

    fmt = get_format(spec)
    layer = synthetic_cache(tokens=300, head_dim=64, heads=4, kv_heads=2, queries=False).layers[0]
    params = fmt.Params(sparsity=0.7, dense_window=16) if spec == "bitmap" else fmt.Params(bits=4, group=16, residual=16)
    eager = fmt.live_from_dense(layer.slice_tokens(0, 150), params)
    _feed(eager, layer.keys[:, :, 150:], layer.values[:, :, 150:])
    live = fmt.live_from_dense(layer.slice_tokens(0, 150), params)
    live.reserve(12)
    _replay(live, layer.keys[:, :, 150:160], layer.values[:, :, 150:160])
    live.append(layer.keys[:, :, 160:], layer.values[:, :, 160:])  # 140 tokens at once, eagerly
    assert live.tokens == eager.tokens == 300
    a, b = fmt.decode(live.encoded()), fmt.decode(eager.encoded())
    torch.testing.assert_close(a.keys, b.keys) and torch.testing.assert_close(a.values, b.values)
