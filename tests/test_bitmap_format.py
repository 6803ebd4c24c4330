"""The bitmap format: the layout against a hand-worked example, exact round trips, bytes by part,
validation of corrupted files before any kernel reads them, and the compress/decompress commands."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvtool.core.io import write_safetensors
from typer.testing import CliRunner

from kvtool.core import io
from kvtool.cli import app
from kvtool.core.errors import BadDataError, UsageError
from kvtool.formats import get_format
from kvtool.formats.base import compress_cache, load_compressed, make_params, save_compressed
from kvtool.formats.bitmap import cache_from_encoded
from kvtool.kernels.bitmap_compress import encode_torch, random_pruned
from kvtool.kernels.bitmap_layout import BitmapTensor, popcount64

from .conftest import synthetic_cache

runner = CliRunner()
FMT = get_format("bitmap")


def test_layout_hand_example():
    x = torch.tensor([[1, 0], [0, 2], [3, 4]], dtype=torch.float16)[None, None]  # [1, 1, 3 tokens, 2 channels]
    k = encode_torch(x, "keys")
    # channel 0 over tokens: 1,0,3 -> bits 0,2 = 5; channel 1: 0,2,4 -> bits 1,2 = 6
    assert k.bitmaps.tolist() == [[[[5, 6]]]]
    assert k.nz.tolist() == [1, 3, 2, 4, 0, 0, 0, 0]  # (channel, token) order, padded to 8 (16 bytes)
    assert k.offsets.tolist() == [0, 8]
    v = encode_torch(x, "values")
    assert v.bitmaps.tolist() == [[[[1], [2], [3]]]]  # one tile per token: bits of channels
    assert v.nz.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]  # (token, channel) order
    assert torch.equal(k.decode(), x) and torch.equal(v.decode(), x)


def test_negative_zero_is_stored_and_decoded_bit_for_bit():
    x = torch.tensor([-0.0, 0.0, 1.0], dtype=torch.float16).reshape(1, 1, 1, 3)
    for kind in ("keys", "values"):
        bt = encode_torch(x, kind)
        assert int(popcount64(bt.bitmaps).sum()) == 2
        assert torch.equal(bt.decode().view(torch.int16), x.view(torch.int16))


def test_popcount64():
    words = torch.tensor([0, 1, -1, 2**62, -(2**63), 0x5555555555555555], dtype=torch.int64)
    assert popcount64(words).tolist() == [0, 1, 64, 1, 1, 32]


@pytest.mark.parametrize("s", [0.0, 0.5, 0.7, 0.9, 0.99])
@pytest.mark.parametrize("shape", [(1, 2, 100, 64), (2, 3, 1, 16), (1, 1, 129, 80), (1, 1, 64, 130)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_round_trip_is_exact(s, shape, dtype):
    x = random_pruned(*shape, s, dtype=dtype, seed=shape[2])
    for kind in ("keys", "values"):
        bt = encode_torch(x, kind)
        bt.validate()
        assert torch.equal(bt.decode().view(torch.int16), x.view(torch.int16))
        assert int(popcount64(bt.bitmaps).sum()) == int((x != 0).sum())
        assert bt.nz.numel() % 8 == 0


def _same_tensors(a, b) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert torch.equal(u.view(torch.uint8) if u.is_floating_point() else u, t.view(torch.uint8) if t.is_floating_point() else t), name


@pytest.mark.parametrize("window", [0, 5, 32, 100])
def test_format_round_trip_and_bytes(window):
    cache = synthetic_cache(tokens=90, head_dim=80, heads=6, kv_heads=2)
    params = make_params(FMT, {"sparsity": "0.7", "value_sparsity": "0.5", "dense_window": str(window)})
    layer = cache.layers[0]
    enc = FMT.encode(layer, params)
    FMT.validate(enc)
    dec = FMT.decode(enc)
    w = min(window, 90)
    assert torch.equal(dec.keys[:, :, 90 - w :], layer.keys[:, :, 90 - w :])
    kept_k = (dec.keys[:, :, : 90 - w] != 0).sum(-1)
    assert (kept_k == 24).all()  # round(0.3 * 80)
    assert ((dec.values[:, :, : 90 - w] != 0).sum(-1) == 40).all()
    parts = FMT.nbytes(enc)
    assert sum(parts.values()) == enc.tensor_bytes()
    assert parts["dense_window"] == 2 * 2 * w * 80 * 2
    assert parts["nonzeros"] == 2 * 2 * (90 - w) * (24 + 40)
    # padding: key tokens up to a multiple of 64 (1 bit each per channel), value channels 80 -> 128
    tc = 90 - w
    nb = -(-tc // 64)
    pad_bitmap = (2 * (nb * 64 - tc) * 80) // 8 + (2 * tc * 48) // 8  # 2 KV heads
    align_max = 2 * 2 * nb * 7 * 2  # keys+values, 2 heads, <= 7 zero elements of 2 bytes per block
    assert pad_bitmap <= parts["padding"] <= pad_bitmap + align_max
    # the Triton encoder makes the same bytes
    _same_tensors(enc, FMT.encode(layer, params, backend="triton"))


def test_params_bad_input():
    with pytest.raises(UsageError, match="below 1"):
        make_params(FMT, {"sparsity": "1.0"})
    with pytest.raises(UsageError, match="--key-sparsity"):
        make_params(FMT, {"key_sparsity": "-0.2"})
    with pytest.raises(UsageError, match="unknown pruning method"):
        make_params(FMT, {"method": "random"})
    with pytest.raises(UsageError, match="--dense-window"):
        make_params(FMT, {"dense_window": "-1"})
    cache = synthetic_cache(tokens=40, head_dim=16, queries=False)
    with pytest.raises(UsageError, match="recapture without --no-queries"):
        compress_cache(cache, FMT, make_params(FMT, {"method": "output-aware"}), heldout=8)


@pytest.fixture()
def saved(tmp_path):
    cache = synthetic_cache(tokens=150, head_dim=64, heads=4, kv_heads=2)
    cc = compress_cache(cache, FMT, make_params(FMT, {"sparsity": "0.7"}), heldout=16)
    return save_compressed(cc, tmp_path / "c.safetensors")


def _rewrite(path, edit):
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
        tensors = {n: fh.get_tensor(n) for n in fh.keys()}
    edit(tensors)
    # rewritten with fresh checksums: the structural checks must catch the edit on their own
    meta.pop("kvtool.checksums", None)
    write_safetensors(path, tensors, meta, force=True)


def _expect_bad(path, match):
    with pytest.raises(BadDataError, match=match):
        load_compressed(path)
    res = runner.invoke(app, ["decompress", str(path), "-o", str(path.with_name("out.safetensors")), "--force"])
    assert res.exit_code == 1 and "error:" in res.output and "Traceback" not in res.output


def test_corrupted_offsets_not_monotone(saved):
    def edit(t):
        off = t["layers.0.keys.offsets"]
        off[1], off[2] = off[2].clone(), off[1].clone()

    _rewrite(saved, edit)
    _expect_bad(saved, "layer 0: keys.offsets are not monotone")


def test_offsets_past_the_buffer(saved):
    def edit(t):
        t["layers.1.values.offsets"][-1] += 8

    _rewrite(saved, edit)
    _expect_bad(saved, "values.offsets end at .* but values.nz holds")


def test_popcount_disagrees_with_offsets(saved):
    def edit(t):
        t["layers.0.keys.bitmaps"][0, 0, 0, 0] ^= 1 << 5

    _rewrite(saved, edit)
    _expect_bad(saved, "popcount is .* but the offsets give it")


def test_padding_bits_set(saved):
    # 150 - 16 held out - 32 window = 102 compressed tokens: block 1 holds tokens 64..101, bits
    # 38..63 of its value tiles (layout v2: values are channel tiles) are padding. Move one set bit
    # there (the popcount stays right).
    def edit(t):
        bm = t["layers.0.values.bitmaps"]
        w = int(bm[0, 0, 1, 0])
        low = w & -w
        bm[0, 0, 1, 0] = (w ^ low) | (1 << 40)

    _rewrite(saved, edit)
    _expect_bad(saved, "padding positions")


def test_truncated_file(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 100])
    _expect_bad(saved, "truncated")


def test_kernel_path_validates_before_launch(saved):
    cc = load_compressed(saved)
    enc = cc.layers[0]
    enc.tensors["keys.offsets"][3] += 1000
    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    with pytest.raises(BadDataError, match="offsets"):
        FMT.attend_kernel(q, enc)


def test_compress_and_decompress_commands(tmp_path):
    cap = tmp_path / "cap.safetensors"
    io.save(synthetic_cache(tokens=120, head_dim=64, heads=6, kv_heads=2), cap)
    out = tmp_path / "c.safetensors"
    res = runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--sparsity", "0.7", "--key-sparsity", "0.5", "-o", str(out), "--heldout", "20", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert set(rep["bytes_by_part"]) == {"nonzeros", "bitmaps", "offsets", "padding", "dense_window"}
    d = rep["details"]
    assert d["achieved_key_sparsity"] == 0.5 and d["achieved_value_sparsity"] == pytest.approx(1 - 19 / 64)
    assert rep["stored_bytes"] < rep["dense_bytes"] and d["paper_layout_bytes"] > rep["stored_bytes"]
    dense = tmp_path / "d.safetensors"
    res = runner.invoke(app, ["decompress", str(out), "-o", str(dense)])
    assert res.exit_code == 0, res.output
    back = io.load(dense)
    src = io.load(cap)
    cc = load_compressed(out)
    for i in src.layer_indices:
        want = FMT.decode(cc.layers[i])
        assert torch.equal(back.layers[i].keys[:, :, :100], want.keys)
        assert torch.equal(back.layers[i].values[:, :, 100:], src.layers[i].values[:, :, 100:])
    res = runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--sparsity", "1.2", "-o", str(out), "--force"])
    assert res.exit_code == 2 and "below 1" in res.output
    res = runner.invoke(app, ["compress", str(cap), "--format", "bitmap", "--method", "zz", "-o", str(out), "--force"])
    assert res.exit_code == 2 and "unknown pruning method" in res.output


def test_bytes_on_the_real_sample(sample_capture):
    """The sample: 448 compressed tokens, 32 of them the dense window (7.1% of dense by itself).
    Every byte counted; the layout beats the paper's layout on the same tiles."""
    cache = io.load(sample_capture, parts=("keys", "values"))
    rates = {}
    for s in (0.5, 0.7):
        cc = compress_cache(cache, FMT, make_params(FMT, {"sparsity": str(s)}), heldout=64)
        rep = cc.byte_report()
        details = FMT.report(cc)
        rates[s] = 100 * rep["storage_ratio"]
        assert rep["parts"]["dense_window"] / rep["dense_bytes"] == pytest.approx(32 / 448)
        assert details["paper_layout_rate_percent"] > rates[s] + 4
    assert rates[0.5] <= 60.0
    assert rates[0.7] <= 41.0


def test_bitmap_tensor_shape_checks():
    x = random_pruned(1, 1, 70, 64, 0.5)
    bt = encode_torch(x, "keys")
    bad = BitmapTensor("keys", bt.nz, bt.bitmaps[:, :, :1], bt.offsets, bt.tokens, bt.head_dim)
    with pytest.raises(BadDataError, match="expected"):
        bad.validate()
    enc = FMT.encode(synthetic_cache(tokens=40, head_dim=16).layers[0], FMT.Params())
    del enc.tensors["values.nz"]
    with pytest.raises(BadDataError, match="values.nz"):
        cache_from_encoded(enc)


def test_layout_version_1_layers_still_decode_and_attend():
    """A layer written before layout version 2 (keys as channel tiles, no layout_version in its
    metadata) decodes as stored, and the kernel path converts it to version 2."""
    from kvtool.formats.bitmap import encoded_from_cache
    from kvtool.kernels.bitmap_sparse_attention import convert_layout

    layer = synthetic_cache(tokens=150, head_dim=64, heads=4, kv_heads=2).layers[0]
    enc2 = FMT.encode(layer, make_params(FMT, {"sparsity": "0.7"}))
    assert enc2.meta["layout_version"] == 2 and list(enc2.tensors["keys.bitmaps"].shape) == [1, 2, 118, 1]
    meta1 = {k: v for k, v in enc2.meta.items() if k != "layout_version"}
    enc1 = encoded_from_cache(convert_layout(cache_from_encoded(enc2), 1), meta1)
    assert list(enc1.tensors["keys.bitmaps"].shape) == [1, 2, 2, 64]
    FMT.validate(enc1)
    d1, d2 = FMT.decode(enc1), FMT.decode(enc2)
    assert torch.equal(d1.keys, d2.keys) and torch.equal(d1.values, d2.values)
    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    ref = FMT.attend(q, enc2)
    for enc in (enc1, enc2):
        out, lse = FMT.attend_kernel(q, enc)
        assert float((out - ref[0]).norm() / ref[0].norm()) < 1e-2
        torch.testing.assert_close(lse, ref[1], atol=1e-2, rtol=1e-3)
    enc2.meta["layout_version"] = 7
    with pytest.raises(BadDataError, match="layout version 7"):
        FMT.validate(enc2)


def test_encode_backend_names_and_the_fused_path_choice():
    cache = synthetic_cache(tokens=70, head_dim=64, heads=4, kv_heads=2)
    layer = cache.layers[0]
    params = make_params(FMT, {"sparsity": "0.7"})
    with pytest.raises(UsageError, match="backend must be one of"):
        FMT.encode(layer, params, backend="fast")
    # on the CPU "cuda" and "auto" take the torch path: the same bytes as "torch"
    _same_tensors(FMT.encode(layer, params, backend="torch"), FMT.encode(layer, params, backend="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("options", [
    {"sparsity": "0.7"},
    {"key_sparsity": "0.5", "value_sparsity": "0.7", "dense_window": "5"},
    {"sparsity": "0", "dense_window": "0"},
    {"sparsity": "0.7", "dense_window": "500"},  # everything in the window
])
def test_fused_gpu_encode_matches_torch_prune_then_encode(dtype, options):
    cache = synthetic_cache(tokens=197, head_dim=128, heads=8, kv_heads=2)
    layer = cache.layers[0]
    layer = type(layer)(layer.keys.to("cuda", dtype), layer.values.to("cuda", dtype))
    params = make_params(FMT, options)
    fused = FMT.encode(layer, params)  # auto: one prune + encode launch per tensor
    want = FMT.encode(layer, params, backend="triton")  # torch pruning, Triton encoder
    _same_tensors(fused, want)
    for key in ("achieved_key_sparsity", "achieved_value_sparsity"):
        assert fused.meta[key] == pytest.approx(want.meta[key], abs=1e-6)
    assert {k: v for k, v in fused.meta.items() if not k.startswith("achieved")} == {k: v for k, v in want.meta.items() if not k.startswith("achieved")}
