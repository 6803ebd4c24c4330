"""One test matrix over every registered format (the kvpress habit): each format, with its default
parameters, must encode/decode the same shapes, count exactly the bytes it stores, survive a file
round trip bit for bit, validate its own output, and attend consistently with its own decode."""

from __future__ import annotations

import pytest
import torch

from kvtool.core.attention import attend_partial
from kvtool.formats import load_all
from kvtool.formats.base import compress_cache, load_compressed, save_compressed

from .conftest import synthetic_cache

FORMATS = sorted(load_all())


@pytest.fixture(scope="module")
def cache():
    # T=200 so that paging, windows and budgets of every format have room at default settings
    return synthetic_cache(tokens=200, head_dim=64, heads=6, kv_heads=2)


@pytest.mark.parametrize("name", FORMATS)
def test_round_trip_and_bytes(name, cache, tmp_path):
    fmt = load_all()[name]
    params = fmt.Params()
    cc = compress_cache(cache, fmt, params, heldout=32)
    for i, enc in cc.layers.items():
        fmt.validate(enc)
        assert sum(fmt.nbytes(enc).values()) == enc.tensor_bytes(), "nbytes must count every stored tensor"
        dense = fmt.decode(enc)
        b, hkv, _, d = cache.layers[i].keys.shape
        assert dense.keys.shape[:2] == (b, hkv) and dense.keys.shape[-1] == d
        assert dense.keys.shape == dense.values.shape
    path = save_compressed(cc, tmp_path / f"{name}.safetensors")
    back = load_compressed(path)
    assert back.format == name and back.params == cc.params and back.prefix_tokens == 200 - 32
    for i in cc.layers:
        assert set(back.layers[i].tensors) == set(cc.layers[i].tensors)
        for t in cc.layers[i].tensors:
            assert torch.equal(back.layers[i].tensors[t], cc.layers[i].tensors[t]), t
        assert back.layers[i].meta == cc.layers[i].meta
        assert torch.equal(back.tails[i].keys, cc.tails[i].keys)


@pytest.mark.parametrize("name", FORMATS)
def test_attend_is_finite_and_matches_decode_when_not_selecting(name, cache):
    fmt = load_all()[name]
    cc = compress_cache(cache, fmt, fmt.Params(), heldout=32)
    q = cache.layers[0].queries[:, :, -32:]
    out, lse = fmt.attend(q, cc.layers[0])
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    if not fmt.selects:
        dense = fmt.decode(cc.layers[0])
        ref_out, ref_lse = attend_partial(q, dense.keys, dense.values)
        torch.testing.assert_close(out, ref_out, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(lse, ref_lse, rtol=2e-3, atol=2e-3)
