"""Bit packing, group quantisation, the quant format (KIVI, int8, fp8) and bitmapq."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.core.attention import attend_partial, dense_attention, merge_partials
from kvtool.core.cache import LayerKV
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats import get_format
from kvtool.formats.base import Encoded, compress_cache, make_params
from kvtool.formats.bitmapq import encode_masked
from kvtool.formats.quant import decode_kivi
from kvtool.methods.quantize import (
    dequantize_groups,
    dequantize_symmetric,
    masked_row_groups,
    pack_codes,
    packed_length,
    quantize_groups,
    quantize_symmetric,
    row_groups,
    unpack_codes,
)

from .conftest import synthetic_cache


def quant(**kw):
    fmt = get_format("quant")
    return fmt, make_params(fmt, {k: str(v) for k, v in kw.items()})


def layer(b=1, h=2, t=100, d=16, seed=0, dtype=torch.float16) -> LayerKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g)
    k[..., 3] *= 8  # an outlier channel, as real keys have
    return LayerKV(k.to(dtype), torch.randn(b, h, t, d, generator=g).to(dtype))


# ----------------------------------------------------------------------------- packing


def test_pack_hand_examples():
    assert pack_codes(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack_codes(torch.tensor([0xA, 0x3, 0x5], dtype=torch.uint8), 4).tolist() == [0x3A, 0x05]
    assert pack_codes(torch.tensor([1, 0, 0, 1, 1, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [0b11001, 1]
    assert pack_codes(torch.tensor([7, 200], dtype=torch.uint8), 8).tolist() == [7, 200]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 7, 8, 33, 64])
def test_pack_unpack_exact(bits, n):
    codes = torch.randint(0, 1 << bits, (3, 5, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, packed_length(n, bits))
    assert torch.equal(unpack_codes(packed, bits, n), codes)


# ----------------------------------------------------------------------------- group quantisation


def test_quantize_groups_hand_example():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 5.0, 5.0])
    codes, scales, zeros = quantize_groups(x, torch.tensor([0, 0, 0, 0, 1, 1]), 2, 2)
    assert codes.tolist() == [0, 1, 2, 3, 0, 0]
    assert scales.tolist() == [1.0, 0.0] and zeros.tolist() == [0.0, 5.0]
    assert torch.equal(dequantize_groups(codes, torch.tensor([0, 0, 0, 0, 1, 1]), scales, zeros), x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequant_error_within_half_scale(bits):
    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(4000, generator=g) * torch.linspace(0.01, 50, 4000)).to(torch.float16)
    idx, n = row_groups(125, 32, 32)
    codes, scales, zeros = quantize_groups(x, idx, n, bits)
    assert int(codes.max()) <= (1 << bits) - 1
    err = (dequantize_groups(codes, idx, scales, zeros) - x.float()).abs()
    bound = scales.float()[idx] / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-6).all())
    # and the scale is what the bit width implies: (max - min) / (2**bits - 1), rounded up to float16
    rows = x.float().reshape(125, 32)
    ideal = (rows.amax(1) - rows.amin(1)) / ((1 << bits) - 1)
    assert bool((scales.float() >= ideal).all()) and bool((scales.float() <= ideal * 1.002 + 1e-7).all())


def test_row_groups_and_masked_row_groups():
    idx, n = row_groups(2, 5, 2)
    assert n == 6 and idx.tolist() == [0, 0, 1, 1, 2, 3, 3, 4, 4, 5]
    mask = torch.tensor([[1, 0, 1, 1, 0, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    gidx, per_row = masked_row_groups(mask, 2)
    assert per_row.tolist() == [3, 0, 2]
    assert gidx.tolist() == [0, 0, 1, 1, 2, 3, 3, 4]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_symmetric_per_row(kind):
    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(1)) * 3).to(torch.float16)
    x[2] = 0
    codes, scales = quantize_symmetric(x, kind)
    assert scales.shape == (6,) and codes.shape == (6, 64)
    back = dequantize_symmetric(codes, scales, kind)
    s = scales.float()[:, None]
    err = (back - x.float()).abs()
    if kind == "int8":
        assert codes.dtype == torch.int8 and bool((err <= s / 2 * (1 + 1e-5)).all())
    else:  # e4m3: 3 mantissa bits (relative step 2**-3), subnormal step 2**-9 of the scale
        assert codes.dtype == torch.uint8 and bool((err <= x.float().abs() / 16 + s * 2.0**-10 + 1e-6).all())
    assert bool((back[2] == 0).all())


# ----------------------------------------------------------------------------- the quant format


def test_kivi_layout_and_bytes_by_hand():
    fmt, p = quant(bits=2, group=32, residual=32)
    enc = fmt.encode(layer(t=100, d=16), p)
    fmt.validate(enc)
    # n = 100 - 32 = 68 quantised tokens: keys take whole groups (64), values all 68
    assert enc.meta["key_tokens"] == 64 and enc.meta["value_tokens"] == 68
    shapes = {n: tuple(t.shape) for n, t in enc.tensors.items()}
    assert shapes == {
        "codes.keys": (1, 2, 16, 16), "scales.keys": (1, 2, 16, 2), "zeros.keys": (1, 2, 16, 2),
        "codes.values": (1, 2, 68, 4), "scales.values": (1, 2, 68, 1), "zeros.values": (1, 2, 68, 1),
        "residual.keys": (1, 2, 36, 16), "residual.values": (1, 2, 32, 16),
    }
    parts = fmt.nbytes(enc)
    assert parts == {"codes": 512 + 544, "scales": 128 + 272, "zeros": 128 + 272, "residual": 2304 + 2048}
    assert sum(parts.values()) == enc.tensor_bytes() == 6208


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("d,group", [(16, 32), (20, 8), (64, 32)])
def test_kivi_error_within_bound_per_group(bits, d, group):
    fmt, p = quant(bits=bits, group=group, residual=8)
    src = layer(t=72, d=d, seed=bits)
    enc = fmt.encode(src, p)
    fmt.validate(enc)
    keys, values = decode_kivi(enc)
    tk, tv = enc.meta["key_tokens"], enc.meta["value_tokens"]
    # keys: scale of (channel, token group); values: scale of (token, channel group)
    ks = enc.tensors["scales.keys"].float().repeat_interleave(group, dim=-1).transpose(-1, -2)  # [B,H,Tk,D]
    vs = enc.tensors["scales.values"].float().repeat_interleave(group, dim=-1)[..., :d]  # [B,H,Tv,D]
    kerr = (keys[:, :, :tk] - src.keys[:, :, :tk].float()).abs()
    verr = (values[:, :, :tv] - src.values[:, :, :tv].float()).abs()
    assert bool((kerr <= ks / 2 * (1 + 1e-5) + 1e-6).all()) and bool((verr <= vs / 2 * (1 + 1e-5) + 1e-6).all())
    assert torch.equal(keys[:, :, tk:], src.keys[:, :, tk:].float()) and torch.equal(values[:, :, tv:], src.values[:, :, tv:].float())
    assert enc.tensors["scales.values"].shape[-1] == math.ceil(d / group)


def test_scheme_bits_and_reported_bits_per_element():
    cache = synthetic_cache(tokens=96, head_dim=32)
    errs = {}
    for spec in ({"bits": 2}, {"bits": 4}, {"bits": 8}, {"scheme": "int8"}, {"scheme": "fp8"}):
        fmt, p = quant(**spec)
        cc = compress_cache(cache, fmt, p, heldout=16)
        rep, details = cc.byte_report(), fmt.report(cc)
        elements = 2 * sum(e.meta["shape"][0] * e.meta["shape"][1] * e.meta["shape"][2] * e.meta["shape"][3] for e in cc.layers.values())
        assert details["bits_per_element"] == pytest.approx(8 * rep["stored_bytes"] / elements)
        assert rep["stored_bytes"] == sum(e.tensor_bytes() for e in cc.layers.values())
        d = fmt.decode(cc.layers[0])
        src = cache.layers[0].slice_tokens(0, 80)
        errs[p.scheme + str(p.bits)] = float((d.keys.float() - src.keys.float()).norm() / src.keys.float().norm())
    # int8/fp8 have no residual (bits per element 8 + a scale per token); more bits, less error
    assert errs["kivi2"] > errs["kivi4"] > errs["kivi8"]
    assert errs["int88"] < errs["kivi4"] and errs["fp88"] < errs["kivi4"]


def test_bad_parameters_are_usage_errors():
    fmt = get_format("quant")
    for values, text in (({"bits": "3"}, "--bits must be one of 2, 4, 8"), ({"group": "0"}, "--group"), ({"scheme": "int4"}, "scheme"),
                         ({"scheme": "int8", "bits": "4"}, "8-bit"), ({"scheme": "fp8", "group": "16"}, "--group"), ({"residual": "-1"}, "--residual")):
        with pytest.raises(UsageError, match=text):
            make_params(fmt, values)
    with pytest.raises(UsageError, match="--bits"):
        make_params(get_format("bitmapq"), {"bits": "1"})


def test_validate_catches_bad_tensors():
    fmt, p = quant(bits=4)
    enc = fmt.encode(layer(), p)
    bad = Encoded(dict(enc.tensors), dict(enc.meta))
    bad.tensors["codes.keys"] = bad.tensors["codes.keys"][..., :-1]
    with pytest.raises(BadDataError, match="codes.keys"):
        fmt.validate(bad)
    bad = Encoded(dict(enc.tensors), dict(enc.meta))
    bad.tensors["scales.values"] = bad.tensors["scales.values"].clone().fill_(float("inf"))
    with pytest.raises(BadDataError, match="non-finite"):
        fmt.validate(bad)


def test_residual_covers_short_layers():
    fmt, p = quant(bits=2, residual=32)
    src = layer(t=20)
    enc = fmt.encode(src, p)
    fmt.validate(enc)
    assert enc.meta["key_tokens"] == 0 and enc.meta["value_tokens"] == 0
    out = fmt.decode(enc)
    assert torch.equal(out.keys, src.keys) and torch.equal(out.values, src.values)


# ----------------------------------------------------------------------------- bitmapq


def test_bitmapq_hand_example_and_bytes():
    # one head, 1 token quantised (+ 1 residual), 8 channels, keep 5 value elements, groups of 2
    keys = torch.zeros(1, 1, 2, 8, dtype=torch.float16)
    values = torch.tensor([[[[1, 0, 2, 3, 0, 4, 0, 8], [9, 9, 9, 9, 9, 9, 9, 9]]]], dtype=torch.float16)
    vmask = values != 0
    kmask = torch.zeros_like(vmask)
    kmask[..., 1, :] = True
    enc = encode_masked(keys, values, kmask, vmask, bits=2, group=2, residual=1)
    fmt = get_format("bitmapq")
    fmt.validate(enc)
    assert enc.tensors["bitmap.values"].tolist() == [[[[0b10101101]]]]
    assert enc.meta["kept_values"] == 5 and enc.tensors["codes.values"].numel() == 2  # 5 codes * 2 bits -> 2 bytes
    assert torch.allclose(enc.tensors["scales.values"].float(), torch.tensor([1 / 3, 1 / 3, 0.0]), atol=1e-3)
    assert enc.tensors["zeros.values"].tolist() == [1.0, 3.0, 8.0]
    out = fmt.decode(enc)
    assert torch.equal(out.values, values)  # [1,2] [3,4] [8]: every group's two values are its min and max
    assert sum(fmt.nbytes(enc).values()) == enc.tensor_bytes() == 2 * 1 + 0 + 2 + 3 * 2 * 2 + 2 * 16


def test_bitmapq_equals_prune_then_quantise():
    from kvtool.methods.prune import prune_layer

    src = layer(t=90, d=24, seed=3)
    fmt = get_format("bitmapq")
    p = make_params(fmt, {"bits": "4", "key_sparsity": "0.5", "value_sparsity": "0.7", "group": "8", "residual": "16"})
    enc = fmt.encode(src, p)
    fmt.validate(enc)
    pr = prune_layer(src, 0.5, 0.7, "per-token", 16)
    ref = encode_masked(pr.keys, pr.values, pr.key_mask, pr.value_mask, 4, 8, 16)
    for name in ref.tensors:
        assert torch.equal(enc.tensors[name], ref.tensors[name]), name
    out = fmt.decode(enc)
    assert bool((out.values[~pr.value_mask] == 0).all()) and bool((out.keys[~pr.key_mask] == 0).all())
    rel = (out.values.float() - pr.values.float()).norm() / pr.values.float().norm()
    assert rel < 0.1
    assert enc.meta["achieved_value_sparsity"] == pytest.approx(0.7, abs=0.01)


def test_bitmapq_validate_popcount():
    fmt = get_format("bitmapq")
    enc = fmt.encode(layer(), fmt.Params())
    bad = Encoded(dict(enc.tensors), dict(enc.meta, kept_keys=enc.meta["kept_keys"] + 1))
    with pytest.raises(BadDataError, match="popcount"):
        fmt.validate(bad)
    bad = Encoded(dict(enc.tensors), dict(enc.meta))
    bad.tensors["scales.keys"] = bad.tensors["scales.keys"][:-1]
    with pytest.raises(BadDataError, match="scales.keys"):
        fmt.validate(bad)


# ----------------------------------------------------------------------------- the real sample


def heldout_error(fmt, cc, cache, i, w):
    """Relative L2 error of the attention output of the last w queries (prefix via the format)."""
    full = cache.layers[i]
    q = full.queries[:, :, -w:]
    tail = cc.tails[i]
    part = fmt.attend(q, cc.layers[i])
    mask = torch.ones(w, w, dtype=torch.bool).tril()
    out, _ = merge_partials(part, attend_partial(q, tail.keys, tail.values, None, mask))
    ref = dense_attention(q, full.keys, full.values, causal=True)
    return float((out - ref).norm() / ref.norm())


def test_sample_bits_order_and_ratio(sample_capture):
    from kvtool.core import io

    cache = io.load(sample_capture, layers=[7])
    errors, ratios = {}, {}
    for spec in ({"bits": 2}, {"bits": 4}, {"bits": 8}, {"scheme": "int8"}):
        fmt, p = quant(**spec)
        cc = compress_cache(cache, fmt, p, heldout=64)
        key = f"{p.scheme}{p.bits}"
        errors[key], ratios[key] = heldout_error(fmt, cc, cache, 7, 64), cc.byte_report()["storage_ratio"]
    assert errors["kivi2"] > errors["kivi4"] > errors["kivi8"]
    assert errors["kivi4"] < 0.1 and errors["kivi8"] < 0.01
    # 448 tokens, 32 residual, group 32: codes + 2 float16 per 32 elements + residual share
    assert ratios["kivi2"] < ratios["kivi4"] < ratios["kivi8"] < 0.7
    assert ratios["int88"] == pytest.approx((64 + 2) / 128)


def test_bitmapq_key_groups_are_tiles_of_64_tokens():
    # P = 70 tokens -> two key tiles per channel (64 + 6 tokens); groups never cross a tile
    src = layer(t=74, d=4, seed=5)
    enc = encode_masked(src.keys, src.values, torch.ones(1, 2, 74, 4, dtype=torch.bool), torch.ones(1, 2, 74, 4, dtype=torch.bool), 8, 64, 4)
    assert enc.tensors["scales.keys"].numel() == 1 * 2 * 2 * 4 and enc.tensors["scales.values"].numel() == 2 * 70
    # the first tile of channel 0 of head 0 is quantised over tokens 0..63 only
    tile = src.keys[0, 0, :64, 0].float()
    assert float(enc.tensors["zeros.keys"][0]) <= float(tile.min()) and float(enc.tensors["zeros.keys"][0]) > float(tile.min()) - 0.01
    out = get_format("bitmapq").decode(enc)
    assert (out.keys.float() - src.keys.float()).abs().max() < 0.2


@pytest.mark.parametrize("scheme", ["kivi", "int8"])
def test_bfloat16_and_float32_scales_when_values_exceed_float16(scheme):
    fmt = get_format("quant")
    p = make_params(fmt, {"scheme": scheme, "residual": "4"})
    src = layer(t=40, d=16, dtype=torch.bfloat16)
    enc = fmt.encode(src, p)
    fmt.validate(enc)
    assert enc.meta["scale_dtype"] == "float16" and fmt.decode(enc).keys.dtype == torch.bfloat16
    big = LayerKV(src.keys * 1e5, src.values)
    enc = fmt.encode(big, p)
    fmt.validate(enc)
    assert enc.meta["scale_dtype"] == "float32" and enc.tensors["scales.keys"].dtype == torch.float32
    out = fmt.decode(enc).keys.float()
    assert bool(torch.isfinite(out).all())
    rel = (out - big.keys.float()).norm() / big.keys.float().norm()
    assert rel < (0.1 if scheme == "kivi" else 0.02)
