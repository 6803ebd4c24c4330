"""Generation from exported caches equals generation with the model's own live cache; compressed
prefixes attended through kvtool's attention function; bad input."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from typer.testing import CliRunner

import kvtool
from kvtool.hf import models
from kvtool.cli import app
from kvtool.export.convert import export_file
from kvtool.core.cache import LayerKV
from kvtool.formats.base import FORMATS, Encoded, Format, FormatParams, compress_cache, get_format, save_compressed
from kvtool.hf.cache import continuation_ids, generate, to_hf_cache
from kvtool.hf.interface import cache_kwargs, output_cache

from .test_export import KeepLast, KeepLastParams

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    model, tokenizer, _ = models.load(str(tiny_llama_dir))
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_cap(tiny_llama_dir, tmp_path_factory):
    """A capture of every layer with 3 decode steps (so the cache holds decode-time keys too)."""
    cache = kvtool.capture("kvtool export test " * 3, model=str(tiny_llama_dir), generate=3, dtype="float32")  # the model computes in float32: same bits as its own cache
    return kvtool.save(cache, tmp_path_factory.mktemp("gen") / "cap.safetensors")


def greedy(model, ids, cache=None, n=12):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache), max_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits)


def live_cache(model, cap):
    """The model's own cache for the capture's tokens, built as the capture ran: prefill, then one
    decode step per generated token."""
    n = cap.info["prefill_tokens"]
    cache = output_cache(model(input_ids=cap.token_ids[:, :n], use_cache=True))
    for t in range(n, cap.num_tokens):
        cache = output_cache(model(input_ids=cap.token_ids[:, t : t + 1], use_cache=True, **cache_kwargs(model, cache)))
    return cache


def test_exported_capture_generates_like_the_live_cache(tiny, tiny_cap, tmp_path):
    model, tok = tiny
    hf = tmp_path / "cap.hf.safetensors"
    assert export_file(tiny_cap, "hf", hf)["mode"] == "dense"
    cap = kvtool.load(tiny_cap)
    ids = continuation_ids(cap.token_ids, tok(" more", add_special_tokens=False)["input_ids"])
    cache = kvtool.to_hf_cache(hf, model)
    assert type(cache).__name__ == "DynamicCache" and cache.layers[1].keys.shape == (1, 2, cap.num_tokens, 16)
    ours, our_logits = greedy(model, ids, cache)
    ref, ref_logits = greedy(model, ids, live_cache(model, cap))
    assert ours.tolist() == ref.tolist()
    assert torch.equal(our_logits, ref_logits)  # same cache bits, same computation
    # prefilling everything at once rounds differently but picks the same tokens here
    assert greedy(model, ids)[0].tolist() == ref.tolist()


def test_generate_library_and_empty_prompt(tiny, tiny_cap):
    model, tok = tiny
    cap = kvtool.load(tiny_cap)
    result = generate(tiny_cap, "", max_new_tokens=6, loaded=(model, tok))
    # no prompt: the last cached token is fed again, so this is the live continuation of the capture
    ref = model.generate(cap.token_ids, attention_mask=torch.ones_like(cap.token_ids), max_new_tokens=6, do_sample=False)
    assert result["new_token_ids"][0] == ref[0, cap.num_tokens :].tolist()
    assert result["mode"] == "dense" and result["prompt_tokens"] == 0


def test_capture_and_generate_pass_the_cache_under_the_models_own_name(tiny, tiny_llama_dir, tiny_cap):
    """transformers renamed ``past_key_values`` to ``cache`` (the old name warns, then goes away)."""
    import warnings

    model, tok = tiny
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kvtool.capture("kvtool export test", model=str(tiny_llama_dir), generate=2)
        generate(tiny_cap, " more", max_new_tokens=3, loaded=(model, tok))
    assert not [w for w in seen if "past_key_values" in str(w.message)]

    class Old:
        def forward(self, input_ids, past_key_values=None): ...

    class New:
        def forward(self, input_ids, cache=None): ...

    assert cache_kwargs(Old(), 1) == {"past_key_values": 1} and cache_kwargs(New(), 1) == {"cache": 1}


def test_attend_path_equals_dense_path_for_the_dense_format(tiny, tiny_cap, tmp_path):
    model, tok = tiny
    fmt = get_format("dense")
    cc = compress_cache(kvtool.load(tiny_cap), fmt, fmt.Params(), heldout=6)
    path = save_compressed(cc, tmp_path / "c.dense.safetensors")
    ids = continuation_ids(cc.token_ids, tok(" go", add_special_tokens=False)["input_ids"])
    dense_tokens, dense_logits = greedy(model, ids, to_hf_cache(path, model, mode="dense"))
    cache = to_hf_cache(path, model, mode="attend")
    assert type(cache).__name__ == "KvtoolCache" and model.config._attn_implementation == "kvtool"
    att_tokens, att_logits = greedy(model, ids, cache)
    assert att_tokens.tolist() == dense_tokens.tolist()
    torch.testing.assert_close(att_logits, dense_logits, rtol=1e-4, atol=1e-4)
    # a plain cache on the switched model still gets ordinary attention
    assert greedy(model, ids)[0].tolist() == dense_tokens.tolist()


def test_evicting_format_attends_only_to_kept_tokens(tiny, tiny_cap, tmp_path):
    """Reference: a DynamicCache of only the kept tokens (keys carry their RoPE) with the new tokens
    at their original positions."""
    from transformers import DynamicCache

    model, tok = tiny
    FORMATS[KeepLast.name] = KeepLast()
    try:
        cap = kvtool.load(tiny_cap)
        cc = compress_cache(cap, FORMATS[KeepLast.name], KeepLastParams(keep=10), heldout=5)
        path = save_compressed(cc, tmp_path / "k.safetensors")
        hf = tmp_path / "k.hf.safetensors"
        assert export_file(path, "hf", hf)["mode"] == "attend"
        new = torch.tensor([tok(" ok", add_special_tokens=False)["input_ids"]])
        t = cap.num_tokens
        out = model(input_ids=new, use_cache=True, **cache_kwargs(model, to_hf_cache(hf, model))).logits
        kept = [(torch.cat([cc.layers[i].tensors["keys"], cc.tails[i].keys], 2), torch.cat([cc.layers[i].tensors["values"], cc.tails[i].values], 2)) for i in range(2)]
        ref = model(input_ids=new, position_ids=torch.arange(t, t + new.shape[1])[None], use_cache=True, **cache_kwargs(model, DynamicCache(ddp_cache_data=kept, config=model.config))).logits
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        full = model(input_ids=new, use_cache=True, **cache_kwargs(model, to_hf_cache(tiny_cap, model))).logits
        assert (full - ref).abs().max() > 1e-3  # eviction changed the answer: the check above has teeth
    finally:
        FORMATS.pop(KeepLast.name)


def test_generate_cli_json(tiny_cap):
    res = runner.invoke(app, ["generate", str(tiny_cap), "--prompt", " hi", "-n", "4", "--json"])
    assert res.exit_code == 0, res.output
    assert "loading model " in res.stderr  # the file chose the model: stderr names it
    data = json.loads(res.stdout)
    assert len(data["new_token_ids"][0]) == 4 and data["prompt_tokens"] == 3 and data["mode"] == "dense"


def test_a_model_without_a_tokenizer_continues_the_cached_tokens(tmp_path):
    # random:<shape> models have no tokenizer: the ids are generated, the text is empty, --prompt is refused
    cap, packed = tmp_path / "r.safetensors", tmp_path / "r.bitmap.safetensors"
    assert runner.invoke(app, ["capture", "--model", "random:tiny", "--random-tokens", "64", "--dtype", "float32", "-o", str(cap)]).exit_code == 0
    assert runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--sparsity", "0.5", "--heldout", "8", "-o", str(packed)]).exit_code == 0
    runs = []
    for dev in ("cpu", "cpu,cpu:0"):
        res = runner.invoke(app, ["generate", str(packed), "--model", "random:tiny", "-n", "5", "--device", dev, "--json"])
        assert res.exit_code == 0, res.output
        runs.append(json.loads(res.stdout))
    assert runs[0]["mode"] == "live" and runs[0]["text"] == [""] and len(runs[0]["new_token_ids"][0]) == 5
    assert runs[0]["model_device"] == runs[1]["model_device"] == "cpu" and runs[0]["seconds"] >= 0
    assert runs[0]["new_token_ids"] == runs[1]["new_token_ids"]
    res = runner.invoke(app, ["generate", str(packed), "--model", "random:tiny", "--prompt", "hi"])
    assert res.exit_code == 2 and "has no tokenizer: --prompt needs one" in res.output
    res = runner.invoke(app, ["generate", str(packed), "--model", "random:tiny", "-n", "3"])
    assert res.exit_code == 0 and "token ids " in res.output and "3 new tokens in" in res.output


def test_model_mismatch_is_refused(tiny_cap, tmp_path):
    from .conftest import make_byte_tokenizer, make_tiny_llama

    other = tmp_path / "three-layers"
    make_tiny_llama(num_layers=3).save_pretrained(other)
    make_byte_tokenizer().save_pretrained(other)
    res = runner.invoke(app, ["generate", str(tiny_cap), "--model", str(other), "-n", "2"])
    assert res.exit_code == 2
    assert "the model does not match: the file's model" in res.output and "has 2 layers, this model has 3" in res.output


def test_generate_bad_input(tiny_cap, sample_capture, tmp_path):
    res = runner.invoke(app, ["generate", str(tiny_cap), "-n", "0"])
    assert res.exit_code == 2 and "--max-new-tokens must be at least 1" in res.output
    synth = kvtool.save(__import__("tests.conftest", fromlist=["synthetic_cache"]).synthetic_cache(tokens=8), tmp_path / "s.safetensors")
    res = runner.invoke(app, ["generate", str(synth)])
    assert res.exit_code == 2 and "synthetic tensors made without a model; pass --model" in res.output


@pytest.mark.model
def test_embedded_model_generates_like_its_live_cache(tmp_path):
    model, tok, _ = models.load(None)
    cap = kvtool.capture("The capital of France is", model=(model, tok))
    path = kvtool.save(cap, tmp_path / "fr.safetensors")
    hf = tmp_path / "fr.hf.safetensors"
    export_file(path, "hf", hf)
    ids = continuation_ids(cap.token_ids, tok(" Paris. The capital of Italy is", add_special_tokens=False)["input_ids"])
    ours, _ = greedy(model, ids, to_hf_cache(hf, model), n=8)
    ref, _ = greedy(model, ids, live_cache(model, cap), n=8)
    assert ours.tolist() == ref.tolist()
    assert "Rome" in tok.decode(ours[0])


# ----------------------------------------------------------------------------- ring buffers


@dataclass
class RingParams(FormatParams):
    recent: int = 6


def append_token(enc, key, value, inplace=False):
    """Test ring: token at position p goes to slot p mod R (what snapstream's ``append_token`` does)."""
    r, length = int(enc.meta["recent"]), int(enc.meta["length"])
    t = enc.tensors if inplace else {n: x.clone() for n, x in enc.tensors.items()}
    t["keys"][:, :, length % r] = key.reshape(t["keys"][:, :, 0].shape)
    t["values"][:, :, length % r] = value.reshape(t["values"][:, :, 0].shape)
    t["positions"][:, :, length % r] = length
    meta = {**enc.meta, "length": length + 1}
    if inplace:
        enc.meta = meta
        return enc
    return Encoded(t, meta)


class RingFormat(Format):
    """Test format: only the last R tokens, in a ring of R slots."""

    name = "test-ring"
    summary = "test only"
    Params = RingParams
    selects = True
    appends_tokens = True

    def append_token(self, enc, key, value, inplace=False):
        return append_token(enc, key, value, inplace)

    def encode(self, layer, params):
        t, r = layer.num_tokens, params.recent
        pos = torch.arange(t - r, t)
        slots = pos % r
        keys = torch.empty_like(layer.keys[:, :, :r])
        values = torch.empty_like(keys)
        keys[:, :, slots], values[:, :, slots] = layer.keys[:, :, pos], layer.values[:, :, pos]
        positions = torch.empty(*keys.shape[:2], r, dtype=torch.int32)
        positions[:, :, slots] = pos.to(torch.int32)
        return Encoded({"keys": keys, "values": values, "positions": positions}, {"recent": r, "length": t})

    def decode(self, enc):
        order = enc.tensors["positions"][0, 0].argsort()
        return LayerKV(keys=enc.tensors["keys"][:, :, order], values=enc.tensors["values"][:, :, order])


@pytest.fixture
def ring_file(tiny_cap, tmp_path):
    FORMATS[RingFormat.name] = RingFormat()
    try:
        cc = compress_cache(kvtool.load(tiny_cap), FORMATS[RingFormat.name], RingParams(recent=6), heldout=4)
        yield cc, save_compressed(cc, tmp_path / "ring.safetensors")
    finally:
        FORMATS.pop(RingFormat.name)


def test_ring_cache_writes_new_tokens_into_the_ring(tiny, ring_file):
    from transformers import DynamicCache

    model, tok = tiny
    cc, path = ring_file
    cache = to_hf_cache(path, model)
    layer = cache.layers[0]
    t = cc.token_ids.shape[1]
    assert type(layer).__name__ == "RingLayer" and cache.get_seq_length() == t
    # the 4 held-out tokens went through the ring: it holds positions t-6..t-1
    assert sorted(layer.ring.enc.tensors["positions"][0, 0].tolist()) == list(range(t - 6, t))
    new = torch.tensor([tok("!", add_special_tokens=False)["input_ids"]])
    out = model(input_ids=new, use_cache=True, **cache_kwargs(model, cache)).logits
    assert layer.keys.shape[2] == 6 and cache.get_seq_length() == t + 1  # fixed size, one more position
    # reference: the slots the new token did not overwrite, in a plain cache, new token at position t
    slots = [s for s in range(6) if s != t % 6]
    before = to_hf_cache(path, model).layers
    kept = [(before[i].ring.enc.tensors["keys"][:, :, slots], before[i].ring.enc.tensors["values"][:, :, slots]) for i in range(2)]
    ref = model(input_ids=new, position_ids=torch.tensor([[t]]), use_cache=True, **cache_kwargs(model, DynamicCache(ddp_cache_data=kept, config=model.config))).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_ring_chunk_equals_token_by_token(tiny, ring_file):
    model, tok = tiny
    _, path = ring_file
    new = torch.tensor([tok("abcdefgh", add_special_tokens=False)["input_ids"]])
    chunk = model(input_ids=new, use_cache=True, **cache_kwargs(model, to_hf_cache(path, model))).logits
    cache = to_hf_cache(path, model)
    steps = torch.cat([model(input_ids=new[:, j : j + 1], use_cache=True, **cache_kwargs(model, cache)).logits for j in range(new.shape[1])], 1)
    torch.testing.assert_close(chunk, steps, rtol=1e-4, atol=1e-4)


def test_generate_through_the_ring(tiny, ring_file, tmp_path):
    model, tok = tiny
    cc, path = ring_file
    assert export_file(path, "hf", tmp_path / "ring.hf.safetensors")["mode"] == "ring"
    result = generate(tmp_path / "ring.hf.safetensors", " x", max_new_tokens=5, loaded=(model, tok))
    assert result["mode"] == "ring" and len(result["new_token_ids"][0]) == 5
    empty = generate(path, "", max_new_tokens=3, loaded=(model, tok))  # the last held-out token is fed again
    assert empty["mode"] == "ring" and len(empty["new_token_ids"][0]) == 3


def test_snapstream_continues_through_its_ring(tiny, tiny_cap, tmp_path):
    """The real snapstream format: held-out and new tokens go to SnapStream's ring slots; the new
    token's logits equal a plain cache of the filled slots it did not overwrite."""
    from transformers import DynamicCache

    from kvtool.formats.snapstream import ring_slot

    model, tok = tiny
    fmt = FORMATS["snapstream"]
    cap = kvtool.load(tiny_cap)
    cc = compress_cache(cap, fmt, fmt.Params(budget=40, sinks=4, recent=16, window=8), heldout=8)
    path = save_compressed(cc, tmp_path / "snap.safetensors")
    assert export_file(path, "hf", tmp_path / "snap.hf.safetensors")["mode"] == "ring"
    cache = to_hf_cache(tmp_path / "snap.hf.safetensors", model)
    t = cap.num_tokens
    ring = cache.layers[0].live  # snapstream's own live layer: its ring
    assert ring.length == t and cache.get_seq_length() == t
    pos = ring.enc.tensors["positions"][0, 0]
    assert set(range(t - 16, t)) <= set(pos.tolist()) and set(range(4)) <= set(pos.tolist())  # recent ring and sinks
    victim = ring_slot(t, 4, 16)
    keep = [s for s in range(40) if s != victim and int(pos[s]) >= 0]
    kept = [(cache.layers[i].live.enc.tensors["keys"][:, :, keep].float(), cache.layers[i].live.enc.tensors["values"][:, :, keep].float()) for i in range(2)]
    new = torch.tensor([tok("?", add_special_tokens=False)["input_ids"]])
    ref = model(input_ids=new, position_ids=torch.tensor([[t]]), use_cache=True, **cache_kwargs(model, DynamicCache(ddp_cache_data=kept, config=model.config))).logits
    out = model(input_ids=new, use_cache=True, **cache_kwargs(model, cache)).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert int(cache.layers[0].live.enc.tensors["positions"][0, 0, victim]) == t and cache.layers[0].live.tokens == 40
    result = generate(path, "", max_new_tokens=4, loaded=(model, tok))
    assert result["mode"] == "live" and len(result["new_token_ids"][0]) == 4
    assert generate(path, "", max_new_tokens=4, loaded=(model, tok), mode="ring")["new_token_ids"] == result["new_token_ids"]
