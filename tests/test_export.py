"""kvtool export: the paged layout (hand-computed tables, round trips), npz, dense, tables, hf, and
bad input."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvtool
from kvtool.core.cache import KVCache, LayerKV
from kvtool.cli import app
from kvtool.export.convert import export_file, load_npz, result_records
from kvtool.formats.base import FORMATS, Encoded, Format, FormatParams, compress_cache, get_format, save_compressed
from kvtool.export.paged import from_paged, load_paged, page_table, to_paged

from .conftest import synthetic_cache

runner = CliRunner()


def padded_cache() -> KVCache:
    """Batch of 2, T=5, row 0 left-padded by 2; keys[b, h, t, d] = 1000 b + 100 h + 10 t + d."""
    cache = synthetic_cache(batch=2, heads=4, kv_heads=2, tokens=5, head_dim=4, layers=(0,), dtype=torch.float32, queries=False)
    b, h, t, d = torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(5), torch.arange(4), indexing="ij")
    keys = (1000 * b + 100 * h + 10 * t + d).float()
    cache.layers[0] = LayerKV(keys=keys, values=-keys)
    cache.attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    return cache


def test_page_table_by_hand():
    table = page_table([3, 5], page_size=2)
    assert table["kv_indptr"].tolist() == [0, 2, 5]
    assert table["kv_indices"].tolist() == [0, 1, 2, 3, 4]
    assert table["kv_last_page_len"].tolist() == [1, 1]
    assert table["seq_lens"].tolist() == [3, 5]
    assert table["block_table"].tolist() == [[0, 1, 0], [2, 3, 4]]
    assert all(t.dtype == torch.int32 for t in table.values())
    assert page_table([4], page_size=4)["kv_last_page_len"].tolist() == [4]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_pages_hold_the_right_tokens(layout):
    paged = to_paged(padded_cache(), page_size=2, layout=layout)
    k = paged.k_pages[0]
    assert list(k.shape) == ([5, 2, 2, 4] if layout == "NHD" else [5, 2, 2, 4])
    nhd = k if layout == "NHD" else k.transpose(1, 2)
    # sequence 0 drops its 2 pad tokens: its first real token (t=2) is page 0 slot 0
    assert nhd[0, 0, 1].tolist() == [120.0, 121.0, 122.0, 123.0]
    # page 1 holds t=4 then an unused zero slot
    assert nhd[1, 0, 0, 0].item() == 40.0 and nhd[1, 1].abs().sum().item() == 0.0
    # sequence 1's token 4 is page 4 slot 0
    assert nhd[4, 0, 1].tolist() == [1140.0, 1141.0, 1142.0, 1143.0]
    assert torch.equal(paged.v_pages[0], -k)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_file_round_trips_ragged(layout, tmp_path):
    cache = padded_cache()
    out = tmp_path / "p.safetensors"
    from kvtool.export.paged import save_paged

    save_paged(to_paged(cache, 2, layout), out)
    back = from_paged(load_paged(out))
    keys = cache.layers[0].keys
    assert torch.equal(back[0][0][0], keys[0][:, 2:]) and torch.equal(back[0][1][0], keys[1])
    assert torch.equal(back[0][1][1], -keys[1])


@pytest.mark.parametrize("page_size,layout", [(16, "NHD"), (7, "HND")])
def test_paged_export_of_the_real_sample_round_trips(sample_capture, tmp_path, page_size, layout):
    out = tmp_path / "s.paged.safetensors"
    report = export_file(sample_capture, "paged", out, page_size=page_size, layout=layout)
    assert report["num_pages"] == -(-512 // page_size)
    paged = load_paged(out)
    cache = kvtool.load(sample_capture)
    for i, seqs in from_paged(paged).items():
        assert torch.equal(seqs[0][0], cache.layers[i].keys[0]) and torch.equal(seqs[0][1], cache.layers[i].values[0])


def test_paged_loader_rejects_a_broken_table(tmp_path):
    from kvtool.core.errors import BadDataError
    from kvtool.export.paged import save_paged

    paged = to_paged(padded_cache(), 2, "NHD")
    paged.kv_last_page_len = torch.tensor([2, 1], dtype=torch.int32)
    save_paged(paged, tmp_path / "bad.safetensors")
    with pytest.raises(BadDataError, match="kv_last_page_len"):
        load_paged(tmp_path / "bad.safetensors")


def test_npz_round_trip(tmp_path):
    cache = synthetic_cache(tokens=12, dtype=torch.float16)
    src = kvtool.save(cache, tmp_path / "c.safetensors")
    out = tmp_path / "c.npz"
    export_file(src, "npz", out)
    raw = np.load(out, allow_pickle=False)
    assert raw["layers.0.keys"].dtype == np.float16 and raw["layers.0.keys"].shape == (1, 2, 12, 16)
    assert json.loads(str(raw["kvtool_metadata"]))["kvtool.schema"] == "kvtool.capture"
    back = load_npz(out)
    for i in cache.layers:
        for part in ("keys", "values", "queries"):
            assert torch.equal(getattr(back.layers[i], part), getattr(cache.layers[i], part))
    assert torch.equal(back.token_ids, cache.token_ids)


def test_npz_bfloat16_becomes_float32(tmp_path):
    cache = synthetic_cache(tokens=6, dtype=torch.bfloat16, queries=False)
    src = kvtool.save(cache, tmp_path / "c.safetensors")
    export_file(src, "npz", tmp_path / "c.npz")
    back = load_npz(tmp_path / "c.npz")
    assert back.layers[0].keys.dtype == torch.float32
    assert torch.equal(back.layers[0].keys, cache.layers[0].keys.float())


def test_dense_export_of_a_compressed_file_matches_the_capture(tmp_path):
    cache = synthetic_cache(tokens=20)
    fmt = get_format("dense")
    comp = save_compressed(compress_cache(cache, fmt, fmt.Params(), heldout=4), tmp_path / "c.dense.safetensors")
    export_file(comp, "dense", tmp_path / "out.safetensors")
    back = kvtool.load(tmp_path / "out.safetensors")
    assert torch.equal(back.layers[1].keys, cache.layers[1].keys)


def test_result_records_finds_the_table():
    data = {"device": "cpu", "rows": [{"format": "bitmap", "params": {"sparsity": 0.5}, "ratio": 0.6}, {"format": "quant", "params": {"bits": 4}, "ratio": 0.3}], "layers": [{"i": 0}]}
    where, records = result_records(data)
    assert where == "rows"
    assert records[0] == {"format": "bitmap", "params.sparsity": 0.5, "ratio": 0.6}
    assert result_records({"a": 1, "b": {"c": [1, 2]}})[1] == [{"a": 1, "b.c": "1;2"}]


def test_csv_and_json_from_a_result(tmp_path):
    src = tmp_path / "eval.json"
    src.write_text(json.dumps({"results": [{"format": "a", "err": 0.1}, {"format": "b", "err": 0.2, "extra": True}]}))
    export_file(src, "csv", tmp_path / "eval.csv")
    assert (tmp_path / "eval.csv").read_text().splitlines() == ["format,err,extra", "a,0.1,", "b,0.2,True"]
    export_file(src, "json", tmp_path / "flat.json")
    assert json.loads((tmp_path / "flat.json").read_text())[1]["extra"] is True


def test_csv_of_a_kvtool_file_lists_tensors(sample_capture, tmp_path):
    export_file(sample_capture, "csv", tmp_path / "t.csv")
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0] == "name,dtype,shape,bytes" and "layers.0.keys,float16,1x3x512x64,196608" in lines


# ----------------------------------------------------------------------------- formats that drop tokens


@dataclass
class KeepLastParams(FormatParams):
    keep: int = 8


class KeepLast(Format):
    """Test format: keeps only the last ``keep`` tokens (an evicting format, like snapstream)."""

    name = "test-keep-last"
    summary = "test only"
    Params = KeepLastParams

    def encode(self, layer, params):
        return Encoded({"keys": layer.keys[:, :, -params.keep :].contiguous(), "values": layer.values[:, :, -params.keep :].contiguous()})

    def decode(self, enc):
        return LayerKV(keys=enc.tensors["keys"], values=enc.tensors["values"])


@pytest.fixture
def keep_last():
    FORMATS[KeepLast.name] = KeepLast()
    yield FORMATS[KeepLast.name]
    FORMATS.pop(KeepLast.name)


def test_a_target_that_cannot_hold_the_format_says_which_can(keep_last, tmp_path):
    cache = synthetic_cache(tokens=20, layers=(0,))
    comp = save_compressed(compress_cache(cache, keep_last, KeepLastParams(), heldout=4), tmp_path / "k.safetensors")
    for target in ("npz", "dense"):
        res = runner.invoke(app, ["export", str(comp), "--to", target])
        assert res.exit_code == 2, res.output
        assert f"--to {target} cannot hold it; --to hf can" in res.output
    # pages hold it: every KV head keeps the same count (the kept tokens, then the held-out tail)
    paged = export_file(comp, "paged", tmp_path / "k.paged.safetensors", page_size=4)
    assert paged["next_position"] == 20 and [r["layer"] for r in paged["layers"]] == [0] and paged["layers"][0]["seq_len"] == 8 + 4  # the 8 kept, then the 4 held out
    report = export_file(comp, "hf", tmp_path / "k.hf.safetensors")
    assert report["mode"] == "attend"


def test_hf_export_needs_every_layer(sample_capture, tmp_path):
    res = runner.invoke(app, ["export", str(sample_capture), "--to", "hf", "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2
    assert "holds layers 0,7,15,23 of the model's 30; a transformers cache needs every layer" in res.output


def test_existing_output_needs_force(tmp_path):
    src = kvtool.save(synthetic_cache(tokens=8), tmp_path / "c.safetensors")
    out = tmp_path / "c.npz"
    out.write_text("keep me")
    res = runner.invoke(app, ["export", str(src), "--to", "npz", "-o", str(out)])
    assert res.exit_code == 2 and "exists; pass --force" in res.output
    assert out.read_text() == "keep me"
    res = runner.invoke(app, ["export", str(src), "--to", "npz", "-o", str(out), "--force", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["to"] == "npz"


def test_bad_target_and_layout(tmp_path):
    src = kvtool.save(synthetic_cache(tokens=8), tmp_path / "c.safetensors")
    res = runner.invoke(app, ["export", str(src), "--to", "onnx"])
    assert res.exit_code == 2 and "--to must be one of hf, paged, npz, dense, csv, json" in res.output
    res = runner.invoke(app, ["export", str(src), "--to", "paged", "--layout", "NDH"])
    assert res.exit_code == 2 and "--layout must be NHD or HND" in res.output
    res = runner.invoke(app, ["export", str(tmp_path / "missing.safetensors"), "--to", "npz"])
    assert res.exit_code == 1 and "no such file" in res.output


def test_flashinfer_check_reference_matches_kvtool_attention():
    """The GPU test's dense reference over pages read back through the table equals kvtool's
    reference attention on the unpadded sequences (the GPU part runs with `pytest -m gpu`)."""
    from kvtool.core.attention import dense_attention

    from .paged_reference import dense_reference, synthetic_paged

    paged = synthetic_paged([5, 17], heads=6, kv_heads=2, head_dim=8, page_size=4, layout="HND")
    assert paged.seq_lens.tolist() == [5, 17] and paged.kv_indptr.tolist() == [0, 2, 7]
    seqs = from_paged(paged)[0]
    q = torch.randn(2, 6, 8)
    got = dense_reference(q, seqs, 8**-0.5)
    for b, (k, v) in enumerate(seqs):
        want = dense_attention(q[b, :, None][None], k[None], v[None])[0, :, 0]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


def test_info_describes_a_paged_file(tmp_path):
    src = kvtool.save(synthetic_cache(tokens=8), tmp_path / "c.safetensors")
    out = tmp_path / "c.paged.safetensors"
    export_file(src, "paged", out, page_size=4, layout="HND")
    res = runner.invoke(app, ["info", str(out), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["schema"] == "kvtool.paged" and data["metadata"]["kvtool.paged"]["layout"] == "HND"
    res = runner.invoke(app, ["export", str(out), "--to", "npz"])
    assert res.exit_code == 1 and "is a kvtool.paged file; expected kvtool.capture or kvtool.compressed" in res.output
