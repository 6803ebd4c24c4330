"""signvq: sign codes and codebooks by hand, LUT scores = q.k_hat, quantisation error bounds, full
precision tokens, recall 1.0 at full budget, bad input, and the sample's byte ratio and report."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kvtool.core.attention import attend_partial
from kvtool.core.cache import LayerKV
from kvtool.cli import app
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats import get_format
from kvtool.formats.base import Encoded, compress_cache, make_params
from kvtool.formats.signvq import (
    SignVQParams,
    build_codebook,
    dequantize,
    lut_scores,
    pack_bits,
    pack_nibbles,
    quantize,
    reconstruct_index_keys,
    sign_nibbles,
    unpack_bits,
    unpack_nibbles,
    used_from_bytes,
    used_mask_bytes,
)

from .conftest import synthetic_cache

FMT = get_format("signvq")
runner = CliRunner()


def layer(tokens=40, d=16, heads=4, kv=2, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, kv, tokens, d, generator=g) + 0.5
    v = torch.randn(1, kv, tokens, d, generator=g)
    q = torch.randn(1, heads, tokens, d, generator=g)
    return LayerKV(k.to(dtype), v.to(dtype), q.to(dtype))


def test_sign_codes_hand_example():
    x = torch.tensor([1.0, -2.0, 0.0, -0.5, -1.0, 3.0, -4.0, 2.0])
    nib = sign_nibbles(x)
    # group 0: dims 0 (+) and 2 (0 counts as >= 0) -> bits 0, 2 -> 5; group 1: dims 1, 3 -> 2 + 8 = 10
    assert nib.tolist() == [5, 10]
    packed = pack_nibbles(nib)
    assert packed.tolist() == [5 | (10 << 4)] == [165]
    assert unpack_nibbles(packed, 2).tolist() == [5, 10]
    # an odd number of groups pads the last high nibble with zero
    assert pack_nibbles(torch.tensor([3, 7, 9], dtype=torch.uint8)).tolist() == [3 | 7 << 4, 9]


def test_codebook_hand_example():
    # one head, 3 tokens, D = 4: two tokens share code 15, one has code 0; the other 14 codes are empty
    centred = torch.tensor([[1.0, 2, 3, 4], [3, 2, 1, 0], [-1, -1, -1, -3]]).reshape(1, 1, 3, 4)
    nib = sign_nibbles(centred)
    assert nib.flatten().tolist() == [15, 15, 0]
    cent, counts = build_codebook(centred, nib)
    assert cent.shape == (1, 1, 1, 16, 4)
    assert cent[0, 0, 0, 15].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert cent[0, 0, 0, 0].tolist() == [-1.0, -1.0, -1.0, -3.0]
    assert torch.isfinite(cent).all() and cent[0, 0, 0, 1:15].abs().sum() == 0  # empty codes: zeros, never NaN
    assert counts[0, 0, 0].tolist() == [1] + [0] * 14 + [2]
    used = used_mask_bytes(counts)
    assert used.flatten().tolist() == [0b00000001, 0b10000000]
    assert used_from_bytes(used)[0, 0, 0].tolist() == [True] + [False] * 14 + [True]


@pytest.mark.parametrize("gqa", ["sum", "max"])
def test_lut_scores_equal_q_dot_reconstructed_keys(gqa):
    enc = FMT.encode(layer(), SignVQParams(sinks=2))
    codes, cb = enc.tensors["index.codes"], enc.tensors["index.codebook"]
    q = torch.randn(1, 4, 3, 16, dtype=torch.float64)
    lut = lut_scores(q, codes, cb, gqa)
    k_hat = reconstruct_index_keys(codes, cb).double()  # [1, 2, Tc, 16]
    direct = torch.einsum("bkgtd,bksd->bkgts", q.reshape(1, 2, 2, 3, 16), k_hat)
    direct = direct.sum(2) if gqa == "sum" else direct.amax(2)
    torch.testing.assert_close(lut, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantise_error_within_bound(bits, dtype):
    x = torch.randn(5, 7, 64) * 3
    packed, qp = quantize(x, bits, 32, dtype)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 7, 64 * bits // 8)
    assert qp.shape == (5, 7, 2, 2) and qp.dtype == dtype
    back = dequantize(packed, qp, bits, 32, 64)
    scale = qp[..., 0].float().repeat_interleave(32, -1)
    # half a step, plus the rounding of the stored scale and zero point (relative eps of the dtype)
    eps = torch.finfo(dtype).eps
    bound = scale / 2 + 2 * eps * (x.abs().unflatten(-1, (2, 32)).amax(-1).repeat_interleave(32, -1) + (2**bits) * scale)
    assert ((back - x).abs() <= bound).all()


def test_pack_bits_round_trip_and_layout():
    codes = torch.tensor([1, 2, 3, 0, 3, 3, 0, 1])
    packed = pack_bits(codes, 2)
    assert packed.tolist() == [1 | 2 << 2 | 3 << 4 | 0 << 6, 3 | 3 << 2 | 0 << 4 | 1 << 6]
    for bits in (2, 4, 8):
        c = torch.randint(0, 2**bits, (3, 32))
        assert torch.equal(unpack_bits(pack_bits(c, bits), bits, 32), c)


def test_decode_keeps_full_precision_tokens_and_reconstructs_keys():
    lay = layer(tokens=40)
    enc = FMT.encode(lay, SignVQParams(sinks=3, dense_window=5, keep_top=4, group=8, bits=4, budget=20))
    FMT.validate(enc)
    dec = FMT.decode(enc)
    pos = enc.tensors["full.positions"].long()
    assert pos[0, 0, :3].tolist() == [0, 1, 2] and pos[0, 0, -5:].tolist() == list(range(35, 40))
    for h in range(2):
        p = pos[0, h]
        assert torch.equal(dec.keys[0, h, p], lay.keys[0, h, p]) and torch.equal(dec.values[0, h, p], lay.values[0, h, p])
    # keep-top tokens are the best centred-key scores against the last query (mean over the group)
    kc = lay.keys[:, :, 3:35].float()
    centred = kc - enc.tensors["keys.center"].float()[:, :, None]
    qm = lay.queries[:, :, -1].float().reshape(1, 2, 2, 16).mean(2)
    best = torch.topk(torch.einsum("bktd,bkd->bkt", centred, qm), 4).indices.sort(-1).values + 3
    assert torch.equal(pos[:, :, 3:7], best)
    # the dequantised keys have the original signs of the centred keys and small error
    other = torch.ones(40, dtype=torch.bool)
    other[:3] = other[35:] = False
    err = (dec.keys[0, :, other].float() - lay.keys[0, :, other].float()).norm() / lay.keys[0, :, other].float().norm()
    assert err < 0.15
    assert torch.equal((dec.keys[:, :, 3:35].float() - enc.tensors["keys.center"].float()[:, :, None] >= 0), centred >= 0)


def test_full_budget_recalls_everything_and_matches_decode():
    lay = layer(tokens=48)
    p = SignVQParams(sinks=2, dense_window=4, keep_top=3, budget=48)
    enc = FMT.encode(lay, p)
    assert enc.meta["select"] == 48 - 2 - 4 - 3
    q = torch.randn(1, 4, 5, 16).half()
    assert FMT.selected_mask(q, enc).all()
    out, lse = FMT.attend(q, enc)
    dec = FMT.decode(enc)
    ref_out, ref_lse = attend_partial(q, dec.keys, dec.values)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_selection_follows_lut_scores_and_excludes_keep_top():
    lay = layer(tokens=60)
    enc = FMT.encode(lay, SignVQParams(sinks=2, keep_top=5, budget=20))
    q = torch.randn(1, 4, 2, 16).half()
    sel = FMT.select(q, enc)
    assert sel.shape == (1, 2, 2, 20)
    pos = enc.tensors["full.positions"].long()
    scores = lut_scores(q, enc.tensors["index.codes"], enc.tensors["index.codebook"])
    for h in range(2):
        for t in range(2):
            chosen = set(sel[0, h, t, :13].tolist())
            assert not chosen & set(pos[0, h].tolist())
            s = scores[0, h, t].clone()
            s[pos[0, h, 2:7] - 2] = float("-inf")
            expect = set((torch.topk(s, 13).indices + 2).tolist())
            assert chosen == expect
            assert set(sel[0, h, t, 13:].tolist()) == set(pos[0, h].tolist())


def test_bad_parameters_are_usage_errors():
    with pytest.raises(UsageError, match="bits"):
        make_params(FMT, {"bits": "3"})
    with pytest.raises(UsageError, match="center"):
        make_params(FMT, {"center": "mode"})
    with pytest.raises(UsageError, match="multiple of 4"):
        FMT.check(layer(d=6), SignVQParams(group=2))
    with pytest.raises(UsageError, match="smaller than"):
        FMT.check(layer(tokens=40), SignVQParams(sinks=8, dense_window=8, budget=10))
    with pytest.raises(UsageError, match="divide"):
        FMT.check(layer(d=16), SignVQParams(group=12))
    with pytest.raises(UsageError, match="queries"):
        FMT.check(LayerKV(layer().keys, layer().values), SignVQParams(keep_top=2, group=16))


def corrupt(enc: Encoded, name: str, fn) -> Encoded:
    t = dict(enc.tensors)
    t[name] = fn(t[name].clone())
    return Encoded(t, dict(enc.meta))


def test_validate_detects_corruption():
    enc = FMT.encode(layer(tokens=40), SignVQParams(group=16))
    FMT.validate(enc)
    used = used_from_bytes(enc.tensors["index.used"])
    # point a token's group-0 code at a code no token had: the used set no longer matches
    g0 = unpack_nibbles(enc.tensors["index.codes"], 4)[0, 0, :, 0]
    unused = int((~used[0, 0, 0]).nonzero()[0])

    def recode(c):
        c[0, 0, 0, 0] = (c[0, 0, 0, 0] & 0xF0) | unused
        return c

    assert int(g0[0]) != unused
    with pytest.raises(BadDataError, match="codes"):
        FMT.validate(corrupt(enc, "index.codes", recode))
    code = int(used[0, 0, 0].nonzero()[0])

    def flip(cb):
        cb[0, 0, 0, code] = -cb[0, 0, 0, code] - 0.5 * (cb[0, 0, 0, code] == 0)
        return cb

    with pytest.raises(BadDataError, match="codebook"):
        FMT.validate(corrupt(enc, "index.codebook", flip))

    def nan(cb):
        cb[0, 1, 2, 3, 0] = float("nan")
        return cb

    with pytest.raises(BadDataError, match="NaN"):
        FMT.validate(corrupt(enc, "index.codebook", nan))
    with pytest.raises(BadDataError, match="index.codes"):
        FMT.validate(corrupt(enc, "index.codes", lambda c: c[:, :, :-1]))

    def fill(cb):
        cb[0, 0, 0, unused] = 1.0
        return cb

    with pytest.raises(BadDataError, match="unused"):
        FMT.validate(corrupt(enc, "index.codebook", fill))


def test_cli_compress_median_and_corrupted_file(tmp_path):
    from kvtool.core import io

    cache = synthetic_cache(tokens=96, head_dim=16, heads=4, kv_heads=2)
    cap = tmp_path / "cap.safetensors"
    io.save(cache, cap)
    out = tmp_path / "cap.signvq.safetensors"
    res = runner.invoke(app, ["compress", str(cap), "--format", "signvq", "--center", "median", "--bits", "4", "--group", "16", "--heldout", "16", "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    d = rep["details"]
    assert d["better_balanced_center"] in ("mean", "median") and 0 < d["recall"] <= 1
    assert d["bits_per_element_keys"] > d["bits_per_element_values"] > 4
    res = runner.invoke(app, ["compress", str(cap), "--format", "signvq", "--bits", "3", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "bits" in res.output
    res = runner.invoke(app, ["compress", str(cap), "--format", "signvq", "--group", "16", "--sinks", "20", "--dense-window", "20", "--budget", "30", "--heldout", "16", "-o", str(tmp_path / "y.safetensors")])
    assert res.exit_code == 2 and "budget" in res.output
    # corrupt the codebook in the file: a centroid whose signs disagree with its code
    tensors, meta = io.read_tensors(out), io.read_header(out)[0]
    name = next(n for n in tensors if n.endswith("index.codebook"))
    cb = tensors[name].clone()
    cb[..., 15, :] = -1.0
    tensors[name] = cb
    bad = tmp_path / "bad.safetensors"
    io.write_safetensors(bad, tensors, meta)
    res = runner.invoke(app, ["decompress", str(bad), "-o", str(tmp_path / "dense.safetensors")])
    assert res.exit_code == 1 and "codebook" in res.output and len(res.output.strip().splitlines()) == 1


def test_sample_ratio_bits_and_recall(sample_capture, tmp_path):
    from kvtool.formats.files import compress_file

    _, _, rep = compress_file(sample_capture, "signvq", tmp_path / "s.safetensors")
    d = rep["details"]
    # 448 compressed tokens of SmolLM2 (head_dim 64): at least 4.5x smaller than fp16
    assert d["times_smaller_than_dense"] >= 4.5
    assert rep["storage_ratio"] * d["times_smaller_than_dense"] == pytest.approx(1.0, rel=1e-3)
    assert 3.5 < d["bits_per_element_keys"] < 4.5 and 2.5 < d["bits_per_element_values"] < 3.0
    assert set(d["recall_per_layer"]) == {"0", "7", "15", "23"} and 0.5 < d["recall"] <= 1
    assert d["sign_entropy_median_center"] >= d["sign_entropy_mean_center"] - 1e-3


def test_matrix_shapes_with_default_params():
    cache = synthetic_cache(tokens=120, head_dim=64, heads=6, kv_heads=2)
    cc = compress_cache(cache, FMT, SignVQParams(), heldout=20)
    for enc in cc.layers.values():
        assert enc.meta["budget"] == 25 and enc.meta["select"] == 21


def test_oracle_recall_bounds_the_selection(tmp_path):
    from kvtool.formats.files import build_report
    from kvtool.formats.pagestat import PageStatParams

    cache = synthetic_cache(tokens=100, head_dim=16, heads=6, kv_heads=2)
    for fmt, params in ((FMT, SignVQParams(group=16, budget=30)), (get_format("pagestat"), PageStatParams(page_size=8, budget=32))):
        cc = compress_cache(cache, fmt, params, heldout=20)
        d = build_report(cc, cache)["details"]
        assert d["recall"] <= d["recall_oracle_same_budget"] + 1e-6 <= 1 + 1e-6
        full = compress_cache(cache, fmt, type(params)(**{**params.to_dict(), "budget": 80}), heldout=20)
        d = build_report(full, cache)["details"]
        assert d["recall"] == 1.0 and d["recall_oracle_same_budget"] == 1.0


def test_report_ratio_is_over_float16_whatever_the_capture_dtype():
    from kvtool.formats.files import build_report

    reference = {}
    for dtype in (torch.float32, torch.float16):
        cache = synthetic_cache(tokens=100, head_dim=16, heads=4, kv_heads=2, dtype=dtype)
        cc = compress_cache(cache, FMT, SignVQParams(group=16), heldout=20)
        reference[dtype] = cc.byte_report()["dense_bytes"]
        d = build_report(cc, cache)["details"]
        # the stored share is over the float16 bytes of the keys and values, not the capture's dtype
        assert d["times_smaller_than_fp16"] == pytest.approx(d["times_smaller_than_dense"], rel=1e-3)
    batch, layers = cache.token_ids.shape[0], len(cc.layers)
    assert reference[torch.float32] == reference[torch.float16] == 2 * layers * batch * 2 * 80 * 16 * 2  # K+V, 2 KV heads, 80-token prefix, 2 bytes
