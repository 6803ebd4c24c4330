"""Composed pipelines (evict -> prune -> storage format): equal to their steps applied one by one,
bytes counted, files round-trip, steps that cannot compose refused, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvtool.core import io
from kvtool.core.attention import attend_partial
from kvtool.cli import app
from kvtool.core.errors import BadDataError, UsageError
from kvtool.methods.evict import evict_layer, gather_tokens
from kvtool.formats import get_format
from kvtool.formats.base import Encoded, compress_cache, load_compressed, make_params, save_compressed
from kvtool.formats.bitmapq import encode_masked
from kvtool.formats.pipeline import PipelineParams
from kvtool.formats.pipeline import parse_prune, plan, resolve, split_chain
from kvtool.methods.prune import prune_layer

from .conftest import synthetic_cache

runner = CliRunner()


@pytest.fixture(scope="module")
def cache():
    return synthetic_cache(tokens=160, head_dim=32, heads=4, kv_heads=2)


def run(cache, evict=None, prune=None, fmt="quant:bits=4", heldout=32):
    f, params, _ = resolve(fmt, {"evict": evict, "prune": prune})
    return f, compress_cache(cache, f, params, heldout=heldout)


def test_parse_steps():
    assert parse_prune("per-token:k=0.5,v=0.7") == parse_prune("per-token:v=0.7,k=0.5,window=32")
    step = parse_prune("output-aware/per-token:s=0.6,window=8")
    assert (step.method, step.key_sparsity, step.value_sparsity, step.dense_window) == ("output-aware/per-token", 0.6, 0.6, 8)
    assert parse_prune("2:4").key_sparsity == 0.5
    assert split_chain("snapkv:budget=64+per-token:k=0.5,v=0.7+quant:bits=2") == ("snapkv:budget=64", "per-token:k=0.5,v=0.7", "quant:bits=2")
    assert split_chain("streaming:budget=64+dense") == ("streaming:budget=64", None, "dense")
    for bad, text in (("quant+snapkv:budget=4", "order"), ("snapkv:budget=4+streaming:budget=8+dense", "two evict"), ("snapkv:budget=4++dense", "empty")):
        with pytest.raises(UsageError, match=text):
            split_chain(bad)
    for bad, text in (("per-token", "prunes nothing"), ("per-token:k=1.5", "below 1"), ("per-token:q=0.5", "unknown parameter"), ("magic:k=0.5", "unknown pruning method")):
        with pytest.raises(UsageError, match=text):
            parse_prune(bad)


def test_plain_format_is_not_wrapped():
    fmt, params, name = resolve("quant:bits=2", {"group": 16})
    assert fmt.name == "quant" and name == "quant" and params.bits == 2 and params.group == 16


def test_evict_prune_quant_equals_steps_one_by_one(cache):
    f, cc = run(cache, "snapkv:budget=64", "per-token:k=0.5,v=0.7", "quant:bits=4,group=16,residual=16")
    assert f.name == "pipeline" and cc.layers[0].meta["storage"] == "bitmapq"
    for i, enc in cc.layers.items():
        f.validate(enc)
        head = cache.layers[i].slice_tokens(0, 128)
        kept = evict_layer(head, budget=64)
        small = gather_tokens(head, kept)
        pr = prune_layer(small, 0.5, 0.7, "per-token", 32)
        ref = encode_masked(pr.keys, pr.values, pr.key_mask, pr.value_mask, 4, 16, 16)
        for name, t in ref.tensors.items():
            assert torch.equal(enc.tensors[name], t), name
        assert torch.equal(enc.tensors["pipeline.kept"].long(), kept)
        dec = f.decode(enc)
        ref_dec = get_format("bitmapq").decode(ref)
        assert torch.equal(dec.keys, ref_dec.keys) and torch.equal(dec.values, ref_dec.values)
        # bytes: the storage format's tensors plus the kept positions, nothing else
        parts = f.nbytes(enc)
        assert sum(parts.values()) == enc.tensor_bytes() == ref.tensor_bytes() + kept.numel() * 2
        assert parts["positions"] == kept.numel() * 2


def test_evict_then_plain_formats(cache):
    f, cc = run(cache, "streaming:budget=48", None, "dense")
    enc = cc.layers[1]
    head = cache.layers[1].slice_tokens(0, 128)
    kept = evict_layer(head, budget=48, policy="streaming")
    assert torch.equal(f.decode(enc).keys, gather_tokens(head, kept).keys)
    f, cc = run(cache, "snapkv:budget=64", None, "quant:bits=2")
    small = gather_tokens(cache.layers[0].slice_tokens(0, 128), evict_layer(cache.layers[0].slice_tokens(0, 128), budget=64))
    q = get_format("quant")
    ref = q.encode(small, make_params(q, {"bits": "2"}))
    dec = f.decode(cc.layers[0])
    assert torch.equal(dec.keys, q.decode(ref).keys) and torch.equal(dec.values, q.decode(ref).values)


def test_prune_then_dense_equals_pruned_cache(cache):
    f, cc = run(cache, None, "per-channel:k=0.6,v=0.4,window=16", "dense")
    pr = prune_layer(cache.layers[0].slice_tokens(0, 128), 0.6, 0.4, "per-channel", 16)
    dec = f.decode(cc.layers[0])
    assert torch.equal(dec.keys, pr.keys) and torch.equal(dec.values, pr.values)
    assert "pipeline.kept" not in cc.layers[0].tensors
    assert f.selected_mask(cache.layers[0].queries[:, :, -4:], cc.layers[0]) is None


def test_selected_mask_and_attend(cache):
    f, cc = run(cache, "snapkv:budget=64", "per-token:s=0.5", "quant:bits=8")
    enc = cc.layers[0]
    q = cache.layers[0].queries[:, :, -8:]
    sel = f.selected_mask(q, enc)
    assert sel.shape == (1, 4, 8, 128) and int(sel[0, 0, 0].sum()) == 64
    kept = enc.tensors["pipeline.kept"].long()
    assert bool(sel[0, 2, 3, kept[0, 1]].all()) and bool(sel[0, 1, 3, kept[0, 0]].all())  # query head h reads KV head h // 2
    out, lse = f.attend(q, enc)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())
    dense = f.decode(enc)  # quant storage keeps every kept token: attend is attention over decode
    ref_out, ref_lse = attend_partial(q, dense.keys, dense.values)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_file_round_trip_and_validation(cache, tmp_path):
    f, cc = run(cache, "snapkv:budget=64", "per-token:k=0.5,v=0.7", "quant:bits=2")
    path = save_compressed(cc, tmp_path / "p.safetensors")
    back = load_compressed(path)
    assert back.format == "pipeline" and back.params == {"evict": "snapkv:budget=64", "prune": "per-token:k=0.5,v=0.7", "format": "quant:bits=2"}
    for i in cc.layers:
        assert torch.equal(f.decode(back.layers[i]).values, f.decode(cc.layers[i]).values)
    enc = cc.layers[0]
    bad = Encoded(dict(enc.tensors), enc.meta)
    bad.tensors["pipeline.kept"] = enc.tensors["pipeline.kept"].flip(-1).contiguous()
    with pytest.raises(BadDataError, match="ascending"):
        f.validate(bad)
    bad.tensors["pipeline.kept"] = enc.tensors["pipeline.kept"] + 1000
    with pytest.raises(BadDataError, match="outside"):
        f.validate(bad)
    with pytest.raises(BadDataError, match="storage"):
        f.validate(Encoded(dict(enc.tensors), dict(enc.meta, storage="pipeline")))


def test_steps_that_cannot_compose(cache):
    with pytest.raises(UsageError, match="prunes by itself"):
        plan(None, "per-token:s=0.5", "bitmapq")
    with pytest.raises(UsageError, match="scheme kivi"):
        plan(None, "per-token:s=0.5", "quant:scheme=int8")
    with pytest.raises(UsageError, match="cannot follow --evict"):
        plan("snapkv:budget=64", "output-aware:s=0.5", "dense")
    with pytest.raises(UsageError, match="budget"):
        plan("snapkv:window=4", None, "dense")
    with pytest.raises(UsageError, match="--bits"):
        resolve("quant:bits=3", {"prune": "per-token:s=0.5"})
    with pytest.raises(UsageError, match="another pipeline"):
        resolve("pipeline", {"evict": "snapkv:budget=64"})
    fmt, params, _ = resolve("quant", {"evict": "snapkv:budget=64", "bits": 2, "group": None})
    assert params.format == "quant:bits=2"
    with pytest.raises(UsageError, match="contradicts --bits 2"):  # not last-wins (issue 34)
        resolve("quant:bits=4", {"evict": "snapkv:budget=64", "bits": 2})
    with pytest.raises(UsageError, match="once"):
        resolve("snapkv:budget=64+quant", {"evict": "streaming:budget=64"})


def test_default_pipeline_params_compose():
    p = PipelineParams()
    pl = plan(p.evict, p.prune, p.format)
    assert pl.storage.name == "bitmapq" and pl.evict.budget == 128 and pl.prune is None


def test_cli_pipeline_info_and_errors(tmp_path):
    src = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=160, head_dim=32), src)
    out = tmp_path / "p.safetensors"
    res = runner.invoke(app, ["compress", str(src), "--evict", "snapkv:budget=64", "--prune", "per-token:k=0.5,v=0.7", "--format", "quant", "--bits", "2", "--heldout", "32", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["format"] == "pipeline" and rep["params"]["format"] == "quant:bits=2"
    assert rep["details"]["pipeline"] == "snapkv:budget=64 -> per-token:k=0.5,v=0.7 -> quant:bits=2" and rep["details"]["storage"] == "bitmapq"
    assert rep["stored_bytes"] == sum(rep["bytes_by_part"].values())
    res = runner.invoke(app, ["info", str(out), "--json"])
    assert res.exit_code == 0
    info = json.loads(res.output)
    assert info["compression"]["details"]["pipeline"].startswith("snapkv:budget=64")
    res = runner.invoke(app, ["info", str(out)])
    assert "pipeline" in res.output and "snapkv:budget=64" in res.output
    chain = tmp_path / "c.safetensors"
    res = runner.invoke(app, ["compress", str(src), "--format", "streaming:budget=64+quant:bits=8", "-o", str(chain), "--json"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["compress", str(src), "--prune", "per-token:s=0.5", "--format", "bitmapq", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "prunes by itself" in res.output
    res = runner.invoke(app, ["compress", str(src), "--format", "quant", "--bits", "5", "-o", str(tmp_path / "y.safetensors")])
    assert res.exit_code == 2 and "--bits must be one of 2, 4, 8" in res.output


def test_pipeline_spec_with_semicolons_and_bits_per_element(cache):
    fmt, params, _ = resolve("pipeline:evict=snapkv:budget=64;window=16,prune=per-token:k=0.5;v=0.7,format=quant:bits=2;group=16", {})
    assert fmt.name == "pipeline" and params.evict == "snapkv:budget=64;window=16"
    pl = plan(params.evict, params.prune, params.format)
    assert pl.evict.window == 16 and pl.storage_params.group == 16 and pl.storage_params.value_sparsity == 0.7
    cc = compress_cache(cache, fmt, params, heldout=32)
    stored = sum(e.tensor_bytes() for e in cc.layers.values())
    elements = 2 * 2 * 128 * 32 * len(cc.layers)  # kv_heads * prefix tokens * head_dim, keys and values
    assert fmt.report(cc)["bits_per_element"] == pytest.approx(8 * stored / elements)
