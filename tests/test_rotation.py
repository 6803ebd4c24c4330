"""Rotated quantisation: the Walsh-Hadamard rotation against the Sylvester matrix, ``quant:rotate=hadamard``
against rotating by hand and then quantising, its bytes, its validation, its live layer (grown token by
token it holds what encoding stores; greedy tokens through a running model equal the file path), and the
KIVI kernel with the rotation folded around it (TRITON_INTERPRET=1 on the CPU)."""

from __future__ import annotations

import pytest
import torch

import kvtool
from kvtool.core.attention import attend_partial
from kvtool.core.cache import LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats import get_format
from kvtool.formats.base import Encoded, compress_cache, make_params, save_compressed
from kvtool.formats.pipeline import resolve
from kvtool.formats.quant import decode_kivi, decode_symmetric
from kvtool.methods.rotation import hadamard_transform, random_signs, rotate, rotation_matrix, sylvester, unrotate

FMT = get_format("quant")


def params(**kw):
    return make_params(FMT, {k: str(v) for k, v in kw.items()})


def layer(t=100, d=16, h=2, seed=0, dtype=torch.float16) -> LayerKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, h, t, d, generator=g)
    k[..., 3] *= 8
    return LayerKV(k.to(dtype), torch.randn(1, h, t, d, generator=g).to(dtype))


# ----------------------------------------------------------------------------- the transform


def test_sylvester_hand_example():
    assert sylvester(2).tolist() == [[1, 1], [1, -1]]
    assert sylvester(4)[3].tolist() == [1, -1, -1, 1]


@pytest.mark.parametrize("d", [1, 2, 8, 64, 128])
def test_fast_transform_equals_the_matrix_and_is_orthonormal(d):
    x = torch.randn(3, 5, d, generator=torch.Generator().manual_seed(d))
    ref = x @ sylvester(d).T / d ** 0.5
    torch.testing.assert_close(hadamard_transform(x), ref, rtol=1e-5, atol=1e-5)
    s = random_signs(d, 7)
    y = rotate(x, s)
    torch.testing.assert_close(y, (x * s.float()) @ sylvester(d).T / d ** 0.5, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unrotate(y, s), x, rtol=1e-5, atol=1e-5)
    m = rotation_matrix(d, s)
    torch.testing.assert_close(x @ m, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y @ m.T, x, rtol=1e-5, atol=1e-5)


def test_signs_are_seeded_and_checked():
    a = random_signs(32, 3)
    assert a.dtype == torch.int8 and set(a.tolist()) == {-1, 1} and torch.equal(a, random_signs(32, 3))
    assert not torch.equal(a, random_signs(32, 4))
    with pytest.raises(UsageError, match="power of two"):
        hadamard_transform(torch.zeros(2, 24))


# ----------------------------------------------------------------------------- the format


@pytest.mark.parametrize("kw", [dict(bits=2, group=128, residual=0, partial="true"), dict(bits=4), dict(scheme="int8"), dict(bits=2, group=16, residual=8)])
@pytest.mark.parametrize("seed", [None, 5])
def test_rotated_encode_is_quantising_the_rotated_tensors(kw, seed):
    """Codes, scales and residual equal the plain format's encoding of the layer rotated by hand
    (float32 rotation, then the capture dtype); decode is that decode rotated back; bytes are the plain
    bytes plus the sign vector."""
    x = layer()
    extra = {"rotate": "hadamard"} | ({} if seed is None else {"rotate_seed": seed})
    enc = FMT.encode(x, params(**kw, **extra))
    FMT.validate(enc)
    s = None if seed is None else random_signs(16, seed)
    by_hand = LayerKV(rotate(x.keys, s).half(), rotate(x.values, s).half())
    plain = FMT.encode(by_hand, params(**kw))
    for name, t in plain.tensors.items():
        assert torch.equal(enc.tensors[name], t), name
    assert enc.meta["rotate"] == "hadamard" and enc.meta["rotate_seed"] == seed
    dec = FMT.decode(enc)
    pk, pv = (decode_kivi if plain.meta["scheme"] == "kivi" else decode_symmetric)(plain)  # float32, before the capture dtype
    assert dec.keys.dtype == torch.float16
    assert torch.equal(dec.keys, unrotate(pk, s).half()) and torch.equal(dec.values, unrotate(pv, s).half())
    parts, pparts = FMT.nbytes(enc), FMT.nbytes(plain)
    assert sum(parts.values()) == sum(pparts.values()) + (0 if seed is None else 16)
    assert parts.get("rotation", 0) == (0 if seed is None else 16)


def test_rotation_spreads_an_outlier_channel():
    """Per-token 2-bit values with one outlier channel: the rotated layer decodes with far less error."""
    x = layer(t=256, d=64)
    v = x.values.float()
    v[..., 5] *= 20
    x = LayerKV(x.keys, v.half())
    err = {}
    for rot in ("none", "hadamard"):
        dec = FMT.decode(FMT.encode(x, params(bits=2, group=64, residual=0, rotate=rot)))
        err[rot] = float((dec.values.float() - v).pow(2).mean())
    assert err["hadamard"] < 0.5 * err["none"], err


def test_rotated_parameters_and_validation():
    with pytest.raises(UsageError, match="rotate"):
        params(rotate="givens")
    with pytest.raises(UsageError, match="rotate_seed"):
        params(rotate_seed=3)
    with pytest.raises(UsageError, match="power of two"):
        FMT.check(layer(d=24), params(rotate="hadamard"))
    with pytest.raises(UsageError, match="rotate=none"):
        resolve("quant:bits=4,rotate=hadamard", {"prune": "per-token:k=0.5,v=0.5"})
    enc = FMT.encode(layer(), params(bits=2, rotate="hadamard", rotate_seed=1))
    bad = Encoded({**enc.tensors, "rotation.signs": torch.zeros(16, dtype=torch.int8)}, enc.meta)
    with pytest.raises(BadDataError, match="rotation.signs"):
        FMT.validate(bad)
    with pytest.raises(BadDataError, match="rotation.signs"):
        FMT.validate(Encoded({n: t for n, t in enc.tensors.items() if n != "rotation.signs"}, enc.meta))
    with pytest.raises(BadDataError, match="rotation"):
        FMT.validate(Encoded(enc.tensors, {**enc.meta, "rotate": "givens"}))


# ----------------------------------------------------------------------------- live and kernel


def _feed(live, keys, values):
    b, h, t, d = keys.shape
    for j in range(t):
        q = torch.randn(b, 2 * h, 1, d, dtype=keys.dtype)
        live.step(q, keys[:, :, j:j + 1], values[:, :, j:j + 1], None)


@pytest.mark.parametrize("seed", [None, 2])
def test_rotated_live_layer_grows_as_encode_stores(seed):
    """Tokens appended one decode step at a time: the live layer holds the bytes `encode` writes for
    the same tokens (split at the same place), and attends as the reference over its decode."""
    x = layer(t=200, d=32, seed=3)
    p = params(bits=2, group=16, residual=16, rotate="hadamard", **({} if seed is None else {"rotate_seed": seed}))
    live = FMT.live_from_dense(x.slice_tokens(0, 100), p)
    _feed(live, x.keys[:, :, 100:], x.values[:, :, 100:])
    got = live.encoded()
    FMT.validate(got)
    n = got.meta["value_tokens"]
    ref = FMT.encode(x, params(bits=2, group=16, residual=200 - n, rotate="hadamard", **({} if seed is None else {"rotate_seed": seed})))
    for name in ("codes.values", "scales.values", "zeros.values", "residual.values", "codes.keys"):
        a, b = got.tensors[name], ref.tensors[name]
        assert torch.equal(a, b[..., :a.shape[-1]]), name
    if seed is not None:
        assert torch.equal(got.tensors["rotation.signs"], ref.tensors["rotation.signs"])
        assert live.stored_bytes() == live.inner.stored_bytes() + 32
    dense = FMT.decode(got)
    q = torch.randn(1, 4, 2, 32, dtype=torch.float16)
    torch.testing.assert_close(live.partial(q, None)[0], attend_partial(q, dense.keys, dense.values)[0], rtol=2e-3, atol=2e-3)
    one = torch.randn(1, 4, 1, 32, dtype=torch.float16)
    torch.testing.assert_close(live.attend_one(one, None).float(), attend_partial(one, dense.keys, dense.values)[0], rtol=2e-3, atol=2e-3)


def test_rotated_kernel_equals_the_reference():
    """attend_kernel (the KIVI kernel over the stored codes, query rotated before, output rotated
    after) equals the reference attention over the decoded layer."""
    x = layer(t=300, d=64, seed=4)
    enc = FMT.encode(x, params(bits=2, group=128, residual=44, rotate="hadamard", rotate_seed=9))
    q = torch.randn(1, 8, 1, 64, generator=torch.Generator().manual_seed(1)).half()
    out, lse = FMT.attend_kernel(q, enc)
    rout, rlse = FMT.attend(q, enc)
    err = float((out.double() - rout.double()).norm() / rout.double().norm())
    assert err < 2e-3 and float((lse - rlse).abs().max()) < 1e-3


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from kvtool.hf import models

    model, tokenizer, _ = models.load(str(tiny_llama_dir))
    return model, tokenizer


@pytest.mark.parametrize("spec", ["quant:bits=2,group=16,residual=32,rotate=hadamard", "quant:bits=4,group=16,residual=32,rotate=hadamard,rotate_seed=3",
                                  "snapkv:budget=64+quant:bits=2,group=16,residual=32,rotate=hadamard"])
def test_live_tokens_equal_the_file_path(spec, tiny, tmp_path):
    """Greedy tokens through the live cache (rotated storage, query and output rotated) equal the
    file path (the reference: decode, rotate back, attend). The residual holds the 16 held-out and 8
    new tokens, so both paths attend over the same numbers (the growth is checked above)."""
    from kvtool.hf.cache import generate

    model, tok = tiny
    cap = kvtool.capture("kvtool rotation test sentence " * 12, model=(model, tok))
    fmt, p, _ = resolve(spec)
    cc = compress_cache(cap, fmt, p, heldout=16)
    path = save_compressed(cc, tmp_path / "r.safetensors")
    live = generate(path, "", max_new_tokens=8, loaded=(model, tok))
    ref = generate(path, "", max_new_tokens=8, loaded=(model, tok), mode="attend")
    assert live["mode"] == "live" and live["new_token_ids"] == ref["new_token_ids"]


def test_press_with_rotation_equals_compressing_the_prefilled_cache(tiny):
    from kvtool.hf.interface import cache_kwargs, output_cache

    model, tok = tiny
    spec = "quant:bits=2,group=16,residual=16,rotate=hadamard"
    ids = torch.tensor([tok("kvtool rotated press sentence " * 10, add_special_tokens=False)["input_ids"]])
    with kvtool.press(spec):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        o = model(input_ids=ids, use_cache=True)
        cache = output_cache(o)
        nxt = o.logits[:, -1].argmax(-1, keepdim=True)
        toks = [int(nxt)]
        kvtool.compress(cache, spec)
        with kvtool.press("dense"):
            for _ in range(7):
                o = model(input_ids=nxt, use_cache=True, **cache_kwargs(model, cache))
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                toks.append(int(nxt))
    assert out[0, ids.shape[1]:].tolist() == toks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotated_live_on_cuda_reads_the_kernel_as_its_reference(dtype):
    """At the Llama-3-8B layer shape (8 KV heads, 32 query heads, head_dim 128, 4k tokens) the live
    rotated KIVI-2 g128 layer attends through the KIVI kernel (query and output rotated around it)
    as through the torch reference, before and after decode steps that quantise new groups."""
    from kvtool.formats._live import reference_paths

    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 8, 4096, 128, generator=g)
    k[..., 7] *= 10
    x = LayerKV(k.to(dtype).cuda(), torch.randn(1, 8, 4096, 128, generator=g).to(dtype).cuda())
    live = FMT.live_from_dense(x, params(bits=2, group=128, residual=32, rotate="hadamard", rotate_seed=1))
    for step in range(2):
        q = torch.randn(1, 32, 1, 128, generator=g).to(dtype).cuda()
        out = live.attend_one(q, None).float()
        with reference_paths():
            ref = live.attend_one(q, None).float()
        assert float((out - ref).norm() / ref.norm()) < (2e-3 if dtype == torch.float16 else 1e-2)
        for _ in range(160):  # new tokens join; a group of 128 is quantised
            kv = torch.randn(1, 8, 1, 128, generator=g).to(dtype).cuda()
            live.step(torch.randn(1, 32, 1, 128, generator=g).to(dtype).cuda(), kv, kv, None)
    FMT.validate(live.encoded())


@pytest.mark.parametrize("seed", [None, 3])
def test_turn_matches_the_float32_product_and_its_sign_matrix_is_exact(seed):
    """``turn`` (the live layer's query / output rotation) is ``x @ M`` (``x @ M.T`` back) rounded
    once; the +-1 matrix the CUDA path multiplies by is exactly ``M * sqrt(d)``."""
    from kvtool.formats import _rotated

    d = 64
    m = _rotated.shared_matrix(d, _rotated.signs_for(d, seed), torch.device("cpu"))
    pm, zero = _rotated._sign_matrix(m, torch.float16)
    assert set(pm.float().unique().tolist()) == {-1.0, 1.0} and float(zero) == 0.0
    assert torch.allclose(pm.float() / d ** 0.5, m, atol=1e-7)
    x = torch.randn(3, 5, 1, d, dtype=torch.float16)
    assert torch.equal(_rotated.turn(x, m), (x.float() @ m).half())
    assert torch.allclose(_rotated.turn(_rotated.turn(x, m), m, back=True).float(), x.float(), atol=4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_turn_on_cuda_is_one_gemm_as_exact_as_float32(dtype):
    """On CUDA ``turn`` runs one GEMM over the +-1 matrix (alpha 1 / sqrt(d)): within one rounding
    of the float32 product, both ways."""
    from kvtool.formats import _rotated

    d = 128
    m = _rotated.shared_matrix(d, _rotated.signs_for(d, 5), torch.device("cuda"))
    x = torch.randn(8, 32, 1, d, device="cuda").to(dtype)
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
    for back in (False, True):
        want = (x.float() @ (m.T if back else m))
        got = _rotated.turn(x, m, back=back).float()
        assert got.shape == x.shape
        assert float(((got - want).abs() / want.abs().clamp_min(1e-3)).max()) <= ulp
